"""What decoding one frame costs, per structure: peak memory against the frame's size.

Usage: python benchmarks/decode_bound.py [--mib 64] [--family NAME ...]. For each family of
structures (the cheapest ways, per byte, to make msgpack, numpy or the ext hooks build many
Python objects: empty and one-element containers, deep nesting, small numbers, tiny strs,
bins and arrays, numpy scalars, object arrays, maps of one entry, random trees), builds a
frame of about ``--mib`` MiB, decodes it with :func:`aps.wire.codec.decode` under
:mod:`tracemalloc` (which sees numpy's allocations too), and prints the peak divided by the
frame's size, the outcome (the message type, or the ``WireError`` that refused the frame)
and the CPU seconds the decode (or refusal) took. Then the same for legitimate messages with
many arrays. The goal is a peak under 3x the frame for every row; nothing asserts here
(tests/test_decode_bound.py asserts it at a few MiB).

With ``--attacks`` it measures instead the frames a token holder sent to stall or bloat the
learner (tests/test_attacks_decode.py holds what each is refused by): each decoded as the
learner's session decodes it (zstd, frame delta, its inflation rate), with the wall time,
the tracemalloc peak and the outcome; the long frame-delta chunk also through the Python
loop the rebuild used to run; and the share of a second of the event loop that a stream of
64 KB/s of frames inflating as much as the rate lets through takes.
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

from aps.errors import WireError
from aps.wire import codec
from aps.wire.messages import StepResult, Weights


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


# --------------------------------------------------------------------------------------------
# Attacks by a token holder


def _raw_map(*pairs: tuple[Any, Any]) -> bytes:
    """A msgpack map written pair by pair: keys may repeat."""
    return bytes([0x80 | len(pairs)]) + b"".join(
        msgpack.packb(key, use_bin_type=True) + msgpack.packb(value, use_bin_type=True)
        for key, value in pairs
    )


def _long_delta(steps: int) -> tuple[bytes, Any]:
    """A valid chunk whose obs are ``steps`` steps of one env, 2 frames of 1 byte each."""
    from aps.wire import frame_delta

    frames = (np.arange(steps + 1) % 251).astype(np.uint8).reshape(-1, 1)
    mask = np.ones((steps, 1), bool)
    mask[0] = False
    obs = np.lib.stride_tricks.sliding_window_view(frames, 2, axis=0).transpose(0, 2, 1)
    obs = np.ascontiguousarray(obs).reshape(steps, 1, 2, 1)
    delta = frame_delta.Delta(obs.shape, obs.dtype, mask, obs[:1, 0], frames[2:])
    ext = frame_delta.pack(delta, codec._packb)
    body = msgpack.unpackb(codec.encode(_chunk()), raw=False)
    body["obs"] = ext
    return msgpack.packb(body, use_bin_type=True), delta


def _chunk() -> Any:
    """A small honest chunk of 4 steps of 2 envs, whose fields the attacks replace."""
    from aps.wire.messages import RolloutChunk

    zeros = np.zeros((4, 2), np.float32)
    obs = np.zeros((4, 2, 2, 1), np.uint8)
    return RolloutChunk(
        version=1,
        obs=obs,
        actions=zeros,
        logprob=zeros,
        value=None,
        reward=zeros,
        terminated=zeros.astype(bool),
        truncated=zeros.astype(bool),
        next_obs=obs[-1],
        episode_return=np.zeros(0),
        episode_length=np.zeros(0, np.int64),
        episode_env=np.zeros(0, np.int64),
        truncated_obs=obs[:0, 0],
        truncated_index=np.zeros((0, 2), np.int64),
        seq=1,
    )


def loop_rebuild(delta: Any) -> np.ndarray[Any, Any]:
    """The rebuild as it was before it was vectorized: one Python iteration per step."""
    out = np.empty(delta.shape, delta.dtype)
    whole_at = newest_at = 0
    for t in range(delta.shape[0]):
        coded = delta.mask[t]
        count = int(coded.sum())
        rest = len(coded) - count
        if rest:
            out[t, ~coded] = delta.whole[whole_at : whole_at + rest]
            whole_at += rest
        if count:
            out[t, coded, :-1] = out[t - 1, coded, 1:]
            out[t, coded, -1] = delta.newest[newest_at : newest_at + count]
            newest_at += count
    return out


def attacks() -> dict[str, Callable[[], bytes]]:
    import gymnasium as gym

    from aps.wire import compression
    from aps.wire.messages import Ready

    zstd = compression.compressor("zstd")
    assert zstd is not None, "the attacks need zstandard"

    def packed(array: np.ndarray[Any, Any]) -> Any:
        ext = zstd.pack(array)
        assert ext is not None
        return ext

    def delta_ext(shape: list[int], mask: bytes) -> msgpack.ExtType:
        head = msgpack.packb(["|u1", shape]) + msgpack.packb(mask)
        return msgpack.ExtType(5, head + b"\xc7\x00\x01" * 2)

    def ready(space: Any, num_envs: int) -> bytes:
        return codec.encode(
            Ready(observation_space=space, action_space=gym.spaces.Discrete(2), num_envs=num_envs)
        )

    def bounds_bomb() -> bytes:
        bomb = packed(np.zeros(2**25, np.float32))
        body = msgpack.unpackb(ready(gym.spaces.Box(-1, 1, (4,)), 1), raw=False)
        body["observation_space"] = {"type": "Box", "dtype": "float32", "low": bomb, "high": bomb}
        return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]

    def one_kib_delta() -> bytes:
        # One stack of 2**22 frames of 16 bytes (64 MiB), its whole stack compressed.
        from aps.wire import frame_delta

        shape = (2, 1, 2**22, 16)
        mask = np.array([[False], [True]])
        whole = np.zeros((1, *shape[2:]), np.uint8)
        delta = frame_delta.Delta(
            shape, np.dtype(np.uint8), mask, whole, np.zeros((1, 16), np.uint8)
        )
        body = msgpack.unpackb(codec.encode(_chunk()), raw=False)
        body["obs"] = frame_delta.pack(delta, lambda a: codec._packb(a, compressor=zstd))
        return msgpack.packb(body, use_bin_type=True)  # type: ignore[no-any-return]

    bomb = packed(np.zeros(2**28, np.uint8))
    return {
        "delta: T=2**40, zero-size axis": lambda: _raw_map(
            ("t", "chunk"), ("obs", delta_ext([2**40, 0, 2, 1], b""))
        ),
        "delta: T=2**40, 1-byte frames": lambda: _raw_map(
            ("t", "chunk"), ("obs", delta_ext([2**40, 1, 2, 1], b"\0" * 8))
        ),
        "delta: valid, T=2**20": lambda: _long_delta(2**20)[0],
        "delta: in a heartbeat": lambda: _raw_map(
            ("t", "heartbeat"), ("x", msgpack.ExtType(5, _long_delta(2**12)[0][-4200:]))
        ),
        "heartbeat: repeated key, 256 MiB zstd": lambda: _raw_map(
            ("t", "heartbeat"), ("x", bomb), ("x", bomb)
        ),
        "weights: repeated key, 256 MiB zstd": lambda: _raw_map(
            ("t", "weights"), ("version", 1), ("epsilon", None), ("arrays", bomb), ("arrays", bomb)
        ),
        "ready: Box(4,) x 100,000,000 envs": lambda: ready(
            gym.spaces.Box(-1, 1, (4,)), 100_000_000
        ),
        "ready: Box(33554432,) zstd bounds": bounds_bomb,
        "weights: under 1 KB, 31 MiB of zeros": lambda: codec.encode(
            Weights(version=1, epsilon=None, arrays=np.zeros(2**25 - 2**20, np.uint8)),
            compressor=zstd,
        ),
        "weights: 4 KB inflating all the burst": lambda: codec.encode(
            Weights(version=1, epsilon=None, arrays=np.zeros(2**27 - 2**21, np.uint8)),
            compressor=zstd,
        ),
        "chunk: 1 KB delta, K = 2**22": one_kib_delta,
    }


def measure_attack(frame: bytes) -> tuple[float, int, str]:
    """Decode ``frame`` as a learner's session would: wall seconds, peak bytes, outcome."""
    from aps.wire._wire import InflationRate

    def run() -> str:
        rate = InflationRate()
        rate.tokens = rate.burst  # a connection that has waited to fill its bucket
        try:
            return type(
                codec.decode(frame, compression="zstd", frame_delta=True, rate=rate)
            ).__name__
        except WireError as exc:
            return f"WireError: {exc}"

    start = time.perf_counter()
    run()
    seconds = time.perf_counter() - start
    tracemalloc.start()
    try:
        outcome = run()
        top = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return seconds, top, outcome


def stolen_share(frame_bytes: int = 8192, rate_bytes: int = 64_000, seconds: float = 10.0) -> float:
    """The share of the loop that ``rate_bytes`` per second of inflating frames take.

    The attacker's frames arrive every ``frame_bytes / rate_bytes`` seconds (simulated) and
    each asks for as much inflation as the connection's rate still allows; the decodes run
    for real and their wall time is summed.
    """
    from aps.wire import compression
    from aps.wire._wire import InflationRate
    from aps.wire.messages import Weights

    zstd = compression.compressor("zstd")
    assert zstd is not None, "the attacks need zstandard"
    now = [0.0]
    rate = InflationRate(clock=lambda: now[0])
    rate.tokens = rate.burst
    busy = 0.0
    frames: dict[int, bytes] = {}
    while now[0] < seconds:
        rate.frame(frame_bytes)
        allowed = max(rate.credit + int(rate.tokens) - 2**20, 0) // 2**20 * 2**20
        if allowed:
            frame = frames.get(allowed)
            if frame is None:
                arrays = {"a": np.zeros(allowed, np.uint8), "pad": b""}
                size = len(
                    codec.encode(Weights(version=1, epsilon=None, arrays=arrays), compressor=zstd)
                )
                arrays["pad"] = bytes(max(frame_bytes - size - 8, 0))  # the frame's own credit
                weights = Weights(version=1, epsilon=None, arrays=arrays)
                frame = frames[allowed] = codec.encode(weights, compressor=zstd)
            start = time.perf_counter()
            codec.decode(frame, compression="zstd", rate=rate)
            busy += time.perf_counter() - start
        now[0] += frame_bytes / rate_bytes
    return busy / seconds


def run_attacks() -> None:
    print(f"{'attack':40s} {'frame B':>9s} {'wall ms':>8s} {'peak MiB':>8s}  outcome")
    for name, build in attacks().items():
        frame = build()
        seconds, top, outcome = measure_attack(frame)
        short = outcome if len(outcome) < 60 else outcome[:57] + "..."
        print(f"{name:40s} {len(frame):9d} {seconds * 1e3:8.2f} {top / 2**20:8.2f}  {short}")
    frame, delta = _long_delta(2**20)
    start = time.perf_counter()
    loop_rebuild(delta)
    print(f"{'delta: valid, T=2**20, the old loop':40s} {len(frame):9d} "
          f"{(time.perf_counter() - start) * 1e3:8.2f}")  # fmt: skip
    share = stolen_share()
    print(f"64 KB/s of frames inflating all the rate allows take {share:.1%} of the loop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=float, default=64.0, help="size of each frame, in MiB")
    parser.add_argument("--family", action="append", help="only these rows (repeatable)")
    parser.add_argument("--attacks", action="store_true", help="measure the attack frames")
    args = parser.parse_args()
    if args.attacks:
        run_attacks()
        return
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
