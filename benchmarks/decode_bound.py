"""What decoding one frame costs, per structure: peak memory against the frame's size.

Usage: python benchmarks/decode_bound.py [--mib 64] [--family NAME ...]. For each family of
structures (the cheapest ways, per byte, to make msgpack, numpy or the ext hooks build many
Python objects: empty and one-element containers, deep nesting, small numbers, tiny strs,
bins and arrays, numpy scalars, object arrays, maps of one entry, random trees), builds a
frame of about ``--mib`` MiB, decodes it with :func:`aps.codec.decode` under
:mod:`tracemalloc` (which sees numpy's allocations too), and prints the peak divided by the
frame's size, the outcome (the message type, or the ``WireError`` that refused the frame)
and the CPU seconds the decode (or refusal) took. Then the same for legitimate messages with
many arrays. The goal is a peak under 3x the frame for every row; nothing asserts here
(tests/test_decode_bound.py asserts it at a few MiB).
"""

from __future__ import annotations

import argparse
import itertools
import random
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from aps import codec
from aps.errors import WireError
from aps.messages import StepResult, Weights


def frame_of(value: Any) -> bytes:
    """A frame holding ``value`` where a message holds plain data (a Weights' arrays)."""
    return msgpack.packb(
        {"t": "weights", "version": 1, "epsilon": None, "arrays": value}, use_bin_type=True
    )


def _payload(array: np.ndarray[Any, Any]) -> bytes:
    """The ext payload the codec writes for ``array``, taken from a real encoding."""
    arrays = msgpack.unpackb(codec.encode(Weights(version=1, epsilon=None, arrays=array)))
    assert isinstance(arrays["arrays"], msgpack.ExtType)
    return bytes(arrays["arrays"].data)


TINY_ARRAY = msgpack.ExtType(codec.EXT_NDARRAY, _payload(np.zeros(1, np.float32)))
SCALAR = msgpack.ExtType(codec.EXT_SCALAR, _payload(np.zeros((), np.float32)))
TINY_OBJECT = msgpack.ExtType(codec.EXT_OBJECT_ARRAY, _payload(np.array([None], dtype=object)))


def random_tree(rng: random.Random, size: int) -> Any:
    """A random tree of tiny objects (nesting at most 60 deep), about ``size`` bytes."""
    leaves: list[Callable[[], Any]] = [
        lambda: 0,
        lambda: None,
        lambda: rng.randrange(-(2**31), 2**31),
        lambda: rng.random(),
        lambda: "",
        lambda: "ab",
        lambda: b"x",
        dict,
        list,
        lambda: TINY_ARRAY,
        lambda: SCALAR,
    ]
    items: list[tuple[Any, int]] = []  # (value, how deep it nests)
    spent = 0
    while spent < size:
        take = min(len(items), rng.randint(1, 20))
        if rng.random() < 0.3 and take and max(d for _, d in items[-take:]) < 60:
            group, items = items[-take:], items[:-take]
            values = [value for value, _ in group]
            depth = 1 + max(d for _, d in group)
            if rng.random() < 0.5:
                items.append((values, depth))
            else:
                items.append(({f"{i}": v for i, v in enumerate(values)}, depth))
            spent += 3 + take
        else:
            items.append((rng.choice(leaves)(), 0))
            spent += 4
    return [value for value, _ in items]


def spine(width: int) -> Any:
    """Containers nested 100 deep, each full of scalars before its child: every level is
    open, its elements built, while msgpack reads the next."""
    value: Any = [0] * width
    for _ in range(100):
        value = [*([1000] * width), value]
    return value


def families(n: int) -> dict[str, Callable[[], Any]]:
    """Structures of about ``n`` bytes of msgpack each, by name (built when called)."""
    return {
        "small ints": lambda: [0] * n,
        "empty maps": lambda: [{}] * n,
        "empty arrays": lambda: [[]] * n,
        "empty strs": lambda: [""] * n,
        "one-element arrays": lambda: [[0]] * (n // 2),
        "maps of one entry": lambda: [{"": 0}] * (n // 3),
        "deep nesting": lambda: [[[[[[[[0]]]]]]]] * (n // 8),
        "a deep spine of scalars": lambda: spine(n // 300),
        "uint16s": lambda: [1000] * (n // 3),
        "float64s": lambda: [1.5] * (n // 9),
        "tiny strs": lambda: ["ab"] * (n // 3),
        "tiny bins": lambda: [b"ab"] * (n // 4),
        "tiny arrays": lambda: [TINY_ARRAY] * (n // 15),
        "numpy scalars": lambda: [SCALAR] * (n // 12),
        "tiny object arrays": lambda: [TINY_OBJECT] * (n // 10),
        "a map of tiny arrays": lambda: {f"{i:x}": TINY_ARRAY for i in range(n // 20)},
        "ext headers": lambda: [msgpack.ExtType(codec.EXT_NDARRAY, b"")] * (n // 3),
        "unknown ext codes": lambda: [msgpack.ExtType(42, b"")] * (n // 3),
        "a big map": lambda: {f"{i:x}": i for i in range(n // 8)},
        "random trees": lambda: random_tree(random.Random(29), n),
        "random trees, seed 2": lambda: random_tree(random.Random(2), n),
    }


def state_dict(rng: np.random.Generator, widths: list[int]) -> dict[str, np.ndarray[Any, Any]]:
    """A policy's weights: per layer a matrix, a bias, a norm's mean and its step count."""
    arrays: dict[str, np.ndarray[Any, Any]] = {}
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        arrays[f"layers.{i}.weight"] = rng.standard_normal((fan_out, fan_in), np.float32)
        arrays[f"layers.{i}.bias"] = rng.standard_normal(fan_out, np.float32)
        arrays[f"layers.{i}.norm.num_batches_tracked"] = np.zeros((), np.int64)
        arrays[f"layers.{i}.norm.running_mean"] = np.zeros(fan_out, np.float32)
    arrays["log_std"] = np.zeros(1, np.float32)
    return arrays


def step_result(num_envs: int, obs_size: int) -> StepResult:
    """A SameStep step's result: half the envs ended, with their final observations."""
    rng = np.random.default_rng(2)
    obs = rng.standard_normal((num_envs, obs_size), np.float32)
    ended = rng.random(num_envs) < 0.5
    final = np.empty(num_envs, dtype=object)
    for i in range(num_envs):
        final[i] = obs[i].copy() if ended[i] else None
    info = {
        "final_obs": final,
        "_final_obs": ended,
        "episode": {"r": rng.random(num_envs), "l": np.arange(num_envs), "_r": ended},
    }
    return StepResult(
        seq=1,
        obs=obs,
        reward=rng.random(num_envs).astype(np.float32),
        terminated=ended,
        truncated=np.zeros(num_envs, bool),
        info=info,
    )


def legitimate(n: int) -> dict[str, Callable[[], Any]]:
    """Honest messages, the largest about ``n`` bytes, by name."""
    width = max(64, int((n / 4 / 3) ** 0.5))  # three square layers of about n bytes
    return {
        "an MLP's weights": lambda: Weights(
            version=3,
            epsilon=None,
            arrays=state_dict(np.random.default_rng(0), [64, width, width, width, 8]),
        ),
        "a deep net's many arrays": lambda: Weights(
            version=3, epsilon=None, arrays=state_dict(np.random.default_rng(1), [96] * 120)
        ),
        "thousands of tiny arrays (the floor)": lambda: Weights(
            version=1,
            epsilon=None,
            arrays={f"p.{i}": np.zeros(1, np.float32) for i in range(2000)},
        ),
        "a SameStep result with final observations": lambda: step_result(
            256, max(4, n // 4 // 256 // 2)
        ),
    }


def peak(frame: bytes, *, timed: bool = True) -> tuple[float, str, float]:
    """Decode ``frame``: the peak allocated per byte of frame, the outcome, CPU seconds.

    The seconds are measured on a second decode without tracemalloc, which slows every
    allocation down (0 when not ``timed``).
    """
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        try:
            outcome = type(codec.decode(frame)).__name__
        except WireError as exc:
            outcome = f"WireError: {exc}"
        top = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    if not timed:
        return top / len(frame), outcome, 0.0
    start = time.process_time()
    try:
        codec.decode(frame)
    except WireError:
        pass
    return top / len(frame), outcome, time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, default=64.0, help="size of each frame, in MiB")
    parser.add_argument("--family", action="append", help="only these rows (repeatable)")
    args = parser.parse_args()
    n = int(args.mib * 2**20)
    rows = {**families(n), **legitimate(n)}
    print(f"frames of about {args.mib:g} MiB; peak = tracemalloc peak / frame size")
    print(f"{'structure':44s} {'frame MiB':>9s} {'peak':>6s} {'cpu s':>6s}  outcome")
    for name, build in rows.items():
        if args.family and name not in args.family:
            continue
        value = build()
        frame = codec.encode(value) if isinstance(value, Weights | StepResult) else frame_of(value)
        del value
        ratio, outcome, seconds = peak(frame)
        short = outcome if len(outcome) < 72 else outcome[:69] + "..."
        print(f"{name:44s} {len(frame) / 2**20:9.1f} {ratio:5.2f}x {seconds:6.2f}  {short}")


if __name__ == "__main__":
    main()
