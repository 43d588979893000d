"""Multi-agent throughput: agent-steps per second of one PettingZoo env, aps next to peers.

mpe2's ``simple_spread_v3`` (3 agents, 18-float observations, Discrete(5) actions) as a
vector env of agents, ``2 x C`` env copies (``C`` per worker or per process) of 3 agents,
stepped with random actions taken round-robin from a pool made up front. Contenders:

- ``aps-tcp``: ``aps.ClusterEnv.local`` with 2 ``aps worker`` processes over loopback TCP,
  each hosting ``C`` copies as :class:`aps.multiagent.MultiAgentVectorEnv` (the learner
  picks every action, lockstep);
- ``supersuit-proc``: SuperSuit's ``pettingzoo_env_to_vec_env_v1`` +
  ``concat_vec_envs_v1(num_cpus=2)``: 2 subprocesses of ``C`` copies each, shared memory;
- ``supersuit-sync``: the same in the benchmark's own process (``num_cpus=0``);
- ``pufferlib`` (only if it imports): PufferLib's ``PettingZooPufferEnv`` emulation with
  its multiprocessing backend, 2 workers.

Method: every contender is started, reset and warmed up; then timed windows run
round-robin over the contenders, ``--repeats`` times, so machine noise hits all alike. The
table reports the median window and ratios of medians against ``aps-tcp``. Nothing here
asserts on wall-clock numbers.

Usage::

    python benchmarks/multiagent.py                     # C in 1, 8; 2 s windows, 3 rounds
    python benchmarks/multiagent.py --copies 16 --seconds 3 --json out.json
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

import aps

ENV = "mpe2.simple_spread_v3:parallel_env"
WORKERS = 2


def make_parallel_env() -> Any:
    from mpe2 import simple_spread_v3

    return simple_spread_v3.parallel_env()


class Contender:
    name = ""

    def __init__(self, copies: int) -> None:
        self.copies = copies
        self.envs: Any = None

    def start(self) -> None:
        raise NotImplementedError

    @property
    def slots(self) -> int:
        return int(self.envs.num_envs)

    def reset(self) -> None:
        self.envs.reset(seed=0)

    def step(self, actions: np.ndarray[Any, Any]) -> None:
        self.envs.step(actions)

    def close(self) -> None:
        self.envs.close()


class ApsTcp(Contender):
    name = "aps-tcp"

    def start(self) -> None:
        self.envs = aps.ClusterEnv.local(
            ENV, num_workers=WORKERS, envs_per_worker=self.copies, transport="tcp"
        )


class SuperSuit(Contender):
    def __init__(self, copies: int, *, processes: int) -> None:
        super().__init__(copies)
        self.processes = processes
        self.name = "supersuit-proc" if processes else "supersuit-sync"

    def start(self) -> None:
        import supersuit as ss

        vec = ss.pettingzoo_env_to_vec_env_v1(make_parallel_env())
        self.envs = ss.concat_vec_envs_v1(
            vec, WORKERS * self.copies, num_cpus=self.processes, base_class="gymnasium"
        )


class PufferLib(Contender):
    name = "pufferlib"

    def start(self) -> None:
        import pufferlib.emulation
        import pufferlib.vector

        def creator(*args: Any, **kwargs: Any) -> Any:
            return pufferlib.emulation.PettingZooPufferEnv(env=make_parallel_env())

        self.envs = pufferlib.vector.make(
            creator,
            num_envs=WORKERS * self.copies,
            num_workers=WORKERS,
            backend=pufferlib.vector.Multiprocessing,
        )

    def step(self, actions: np.ndarray[Any, Any]) -> None:
        self.envs.step(actions)


def contenders(copies: int, notes: list[str]) -> list[Contender]:
    found: list[Contender] = [
        ApsTcp(copies),
        SuperSuit(copies, processes=WORKERS),
        SuperSuit(copies, processes=0),
    ]
    try:
        import pufferlib.emulation
        import pufferlib.vector  # noqa: F401
    except ImportError as exc:
        note = f"pufferlib skipped: it does not import here ({exc})"
        if note not in notes:
            notes.append(note)
    else:
        found.append(PufferLib(copies))
    return found


def window(contender: Contender, pool: np.ndarray[Any, Any], seconds: float) -> float:
    """Agent-steps per second over one window of at least ``seconds``."""
    steps = 0
    start = time.perf_counter()
    while True:
        for actions in pool:
            contender.step(actions)
        steps += len(pool)
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps * contender.slots / elapsed


def measure(copies: int, seconds: float, repeats: int, notes: list[str]) -> dict[str, Any]:
    everyone = contenders(copies, notes)
    started: list[Contender] = []
    rates: dict[str, list[float]] = {}
    try:
        for contender in everyone:
            try:
                contender.start()
            except Exception as exc:
                notes.append(f"{contender.name} skipped at C={copies}: {type(exc).__name__}: {exc}")
                continue
            started.append(contender)
            contender.reset()
        rng = np.random.default_rng(0)
        pools = {c.name: rng.integers(0, 5, size=(32, c.slots)) for c in started}
        for contender in started:
            window(contender, pools[contender.name], 0.3)  # warm up
            rates[contender.name] = []
        for round_ in range(repeats):
            order = started[round_ % len(started) :] + started[: round_ % len(started)]
            for contender in order:
                rates[contender.name].append(window(contender, pools[contender.name], seconds))
    finally:
        for contender in started:
            contender.close()
    median = {name: statistics.median(values) for name, values in rates.items()}
    base = median.get("aps-tcp")
    return {
        "copies_per_worker": copies,
        "slots": WORKERS * copies * 3,
        "agent_steps_per_s": {
            name: {"median": median[name], "min": min(v), "max": max(v)}
            for name, v in rates.items()
        },
        "ratio_to_aps_tcp": {name: m / base for name, m in median.items()} if base else {},
    }


def versions() -> dict[str, str]:
    found = {}
    for package in ("aps-rl", "pettingzoo", "mpe2", "supersuit", "pufferlib", "gymnasium"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--copies", default="1,8", help="env copies per worker, comma-separated")
    parser.add_argument("--seconds", type=float, default=2.0, help="length of each timed window")
    parser.add_argument("--repeats", type=int, default=3, help="rounds over the contenders")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    notes: list[str] = []
    results = []
    for copies in (int(c) for c in args.copies.split(",")):
        result = measure(copies, args.seconds, args.repeats, notes)
        results.append(result)
        print(f"\n{WORKERS} x {copies} copies x 3 agents = {result['slots']} slots")
        for name, rate in result["agent_steps_per_s"].items():
            ratio = result["ratio_to_aps_tcp"].get(name, float("nan"))
            print(
                f"  {name:16s} {rate['median']:>10.0f} agent-steps/s "
                f"(min {rate['min']:.0f}, max {rate['max']:.0f})  x{ratio:.2f} of aps-tcp"
            )
    for note in notes:
        print(f"note: {note}")
    if args.json is not None:
        record = {
            "benchmark": "multiagent",
            "env": ENV,
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "versions": versions(),
            "seconds": args.seconds,
            "repeats": args.repeats,
            "results": results,
            "notes": notes,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
