"""Weight sync: a large state dict published to 2 workers, against raw loopback sockets.

One run measures, interleaved:

- ``raw``: the best a plain Python process does on this machine. The benchmark process
  sends ``B`` bytes (the state dict's size) to each of 2 receiver processes over
  127.0.0.1, one sending thread per receiver (``sock.sendall`` of one preallocated buffer);
  each receiver ``recv_into``\\ s a preallocated, reused buffer and answers one byte once all
  ``B`` arrived. Timed from the first send until both answers are in.
- ``raw-fresh``: the same, but each receiver reads every message into a new buffer, as a
  receiver that hands its messages on must (aps does: a frame is a new ``bytes``). Where
  first-touch memory is slow (page faults, a virtual machine), this is the closer bound.
- ``aps-tcp`` / ``aps-unix`` / ``aps-ws``: ``aps.Learner`` over that transport with 2
  ``python -m aps worker`` subprocesses (CartPole-v1, 1 env each) acting with a CleanRL-style
  agent of about ``--params`` float32 parameters (default 10M: 40 MB, mostly two big
  matrices). Timed from the start of ``learner.publish(agent)`` until ``learner.rollout(1)``
  returns. Weights have no reply of their own; each worker handles messages in order, so its
  rollout chunk is the acknowledgement that it applied the weights (``Policy.set_weights``).
  The time therefore includes snapshotting the agent, encoding the weights once, sending
  them to both workers, decoding and loading them there, and one policy step per worker.
- ``aps-*-baseline``: ``learner.rollout(1)`` alone, with no new version, on the same
  learner: the part of the ``aps-*`` time that is not weight sync.

Throughput is ``2 x B / time`` (GB/s, 10^9 bytes) for every contender, so the ratio
``aps-tcp / raw`` is the share of the raw loopback bandwidth aps reaches (the target is at
least 1/2). Each round runs
every contender ``--samples`` times, the order rotating each round so that machine noise
hits all of them alike; the tables report the median and the min-max of all samples, and the
ratio of medians with the min-max of the per-round ratios. Nothing here asserts on
wall-clock numbers.

Next to each wall time the run records CPU time, so that results from a loaded machine can
be read: ``cpu here`` is this process's (the learner, or the raw sending threads),
``cpu workers`` the receiver processes' together (user + system time; theirs from
``/proc/PID/stat``, in clock ticks, usually 10 ms; Linux only, blank elsewhere). The table
gives both as means per sample (the ticks are too coarse for one sample's median).

Usage::

    python benchmarks/weight_sync.py                      # 10M parameters, 5 rounds x 3 samples
    python benchmarks/weight_sync.py --quick              # 2M parameters, 2 rounds x 2 samples
    python benchmarks/weight_sync.py --contenders raw,aps-tcp --params 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gymnasium as gym
import torch
from torch import nn

import aps
from aps.launch.local import terminate
from aps.session._loop import new_event_loop
from aps.wire import codec
from aps.wire.messages import Weights

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:  # workers import this file by path, not as a script
    sys.path.insert(0, str(ROOT))

from throughput import (  # noqa: E402
    LOOPBACK,
    START_TIMEOUT,
    STOP_GRACE,
    check_alive,
    cpu_seconds,
    fmt_ratio,
    machine,
    name_list,
    write_json,
)

DEFAULT_JSON = ROOT / "results" / "weight_sync.json"
ENV_ID = "CartPole-v1"
# The agent's size travels to the worker processes (which build the agent from this file's
# make_agent) in this environment variable.
PARAMS_VARIABLE = "APS_WEIGHT_SYNC_PARAMS"
DEFAULT_PARAMS = 10_000_000
ACK = b"k"
CONTENDERS = ("raw", "raw-fresh", "aps-tcp", "aps-unix", "aps-ws")


# The agent the workers act with.


def _hidden_size(params: int, observations: int, actions: int) -> int:
    """The hidden width whose agent has the parameter count closest to ``params``."""

    def count(h: int) -> int:
        actor = observations * h + h + h * h + h + h * actions + actions
        critic = observations * h + h + h * h + h + h + 1
        return actor + critic

    h = 1
    while count(h + 1) <= params:
        h += 1
    return h if params - count(h) <= count(h + 1) - params else h + 1


def make_agent(observation_space: gym.Space[Any], action_space: gym.Space[Any]) -> nn.Module:
    """A CleanRL-style categorical agent of about ``$APS_WEIGHT_SYNC_PARAMS`` parameters."""
    observations = int(observation_space.shape[0])  # type: ignore[index]
    actions = int(action_space.n)  # type: ignore[attr-defined]
    h = _hidden_size(int(os.environ.get(PARAMS_VARIABLE, DEFAULT_PARAMS)), observations, actions)
    agent = nn.Module()
    agent.actor = nn.Sequential(
        nn.Linear(observations, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, actions)
    )
    agent.critic = nn.Sequential(
        nn.Linear(observations, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, 1)
    )
    return agent


def state_dict_nbytes(agent: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in agent.state_dict().values())


# The contenders.


class Raw:
    """Plain sockets: one sending thread per receiver process, ``recv_into`` on the far side.

    ``fresh``: the receivers read each message into a new buffer instead of a reused one.
    """

    def __init__(self, nbytes: int, workers: int, *, fresh: bool = False) -> None:
        self.name = "raw-fresh" if fresh else "raw"
        self.nbytes = nbytes
        self.workers = workers
        self.fresh = fresh
        self._payload = os.urandom(nbytes)
        self._processes: list[subprocess.Popen[bytes]] = []
        self._sockets: list[socket.socket] = []

    def start(self) -> None:
        with socket.create_server((LOOPBACK, 0)) as server:
            server.settimeout(START_TIMEOUT)
            port = server.getsockname()[1]
            command = [sys.executable, str(Path(__file__).resolve()), "--raw-receiver"]
            command += [f"{LOOPBACK}:{port}", "--raw-bytes", str(self.nbytes)]
            if self.fresh:
                command.append("--raw-fresh")
            for _ in range(self.workers):
                self._processes.append(subprocess.Popen(command))
            for _ in range(self.workers):
                sock, _ = server.accept()
                sock.settimeout(START_TIMEOUT)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._sockets.append(sock)

    def once(self) -> float:
        errors: list[BaseException] = []

        def send(sock: socket.socket) -> None:
            try:
                sock.sendall(self._payload)
                if sock.recv(1) != ACK:
                    raise RuntimeError("a raw receiver closed before it answered")
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(s,)) for s in self._sockets]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        elapsed = time.perf_counter() - start
        if errors:
            check_alive(self._processes, "raw receiver")
            raise errors[0]
        return elapsed

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()  # the receivers see the end of the stream and leave
        self._sockets.clear()
        terminate(self._processes, STOP_GRACE)
        self._processes.clear()


def raw_receiver(address: str, nbytes: int, *, fresh: bool) -> None:
    """Receive ``nbytes`` at a time into one preallocated buffer; answer each with one byte.

    ``fresh``: a new buffer for every message, as a receiver that hands messages on must.
    """
    host, _, port = address.rpartition(":")
    view = memoryview(bytearray(nbytes))
    with socket.create_connection((host, int(port)), timeout=START_TIMEOUT) as sock:
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            if fresh:
                view = memoryview(bytearray(nbytes))
            received = 0
            while received < nbytes:
                count = sock.recv_into(view[received:])
                if count == 0:
                    return
                received += count
            sock.sendall(ACK)


class ApsWeights:
    """``aps.Learner.publish`` then ``rollout(1)`` (the acknowledgement), on one transport."""

    def __init__(self, transport: str, workers: int) -> None:
        self.transport = transport
        self.name = f"aps-{transport}"
        self.workers = workers
        self._runner: asyncio.Runner | None = None
        self._learner: Any = None
        self._agent: nn.Module | None = None
        self._processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        self._runner = runner = asyncio.Runner(loop_factory=new_event_loop)
        url = "unix://" if self.transport == "unix" else f"{self.transport}://{LOOPBACK}:0"
        self._learner = learner = aps.Learner(
            url,
            num_workers=self.workers,
            policy=f"{Path(__file__).resolve()}:make_agent",
        )
        runner.run(learner.start())
        command = [sys.executable, "-m", "aps", "worker", learner.url, "--env", ENV_ID]
        command += ["--num-envs", "1", "--log-level", "WARNING"]
        command += ["--policy", f"{Path(__file__).resolve()}:make_agent"]
        for _ in range(self.workers):
            self._processes.append(subprocess.Popen(command))
        runner.run(self._connect(learner))
        probe = gym.make(ENV_ID)
        try:
            self._agent = make_agent(probe.observation_space, probe.action_space)
        finally:
            probe.close()
        self.once()  # the first version goes out in publish(); later ones before a rollout
        self.once()

    async def _connect(self, learner: Any) -> None:
        waiting = asyncio.ensure_future(learner.wait_for_workers(timeout=START_TIMEOUT))
        try:
            while not waiting.done():
                check_alive(self._processes, "'python -m aps worker'")
                await asyncio.wait({waiting}, timeout=0.1)
        finally:
            waiting.cancel()
            await asyncio.wait({waiting})
        waiting.result()
        await learner.reset(seed=0)

    def once(self) -> float:
        assert self._runner is not None
        return self._runner.run(self._publish_and_ack())

    def baseline(self) -> float:
        assert self._runner is not None
        return self._runner.run(self._ack_only())

    async def _publish_and_ack(self) -> float:
        learner, agent = self._learner, self._agent
        assert agent is not None
        with torch.no_grad():
            agent.critic[-1].bias.add_(1.0)  # type: ignore[index, union-attr]  # a new version
        start = time.perf_counter()
        version = await learner.publish(agent)
        await learner.rollout(1)
        elapsed = time.perf_counter() - start
        synced = [w.version for w in learner.metrics.workers]
        if synced != [version] * self.workers:
            raise RuntimeError(f"workers hold versions {synced} after publishing {version}")
        return elapsed

    async def _ack_only(self) -> float:
        start = time.perf_counter()
        await self._learner.rollout(1)
        return time.perf_counter() - start

    def close(self) -> None:
        runner, self._runner = self._runner, None
        learner, self._learner = self._learner, None
        try:
            if runner is not None and learner is not None:
                runner.run(learner.aclose())
        finally:
            if runner is not None:
                runner.close()
            terminate(self._processes, STOP_GRACE)
            self._processes.clear()


# Running and reporting.


@dataclass(slots=True)
class Series:
    """The timed samples of one contender."""

    seconds: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    cpu_here: list[float] = field(default_factory=list)  # this process, per sample
    cpu_workers: list[float] = field(default_factory=list)  # the receivers, per sample
    error: str | None = None

    def add(self, seconds: float, round_: int, here: float, workers: float | None) -> None:
        self.seconds.append(seconds)
        self.rounds.append(round_)
        self.cpu_here.append(here)
        if workers is not None:
            self.cpu_workers.append(workers)

    def rates(self, nbytes: int) -> list[float]:
        return [nbytes / s / 1e9 for s in self.seconds]


def measure(
    names: Sequence[str], *, params: int, workers: int, rounds: int, samples: int
) -> tuple[dict[str, Series], dict[str, Any]]:
    os.environ[PARAMS_VARIABLE] = str(params)  # read by make_agent here and in the workers
    probe = gym.make(ENV_ID)
    try:
        agent = make_agent(probe.observation_space, probe.action_space)
    finally:
        probe.close()
    nbytes = state_dict_nbytes(agent)
    state = {name: tensor.numpy() for name, tensor in agent.state_dict().items()}
    info: dict[str, Any] = {
        "parameters": sum(a.size for a in state.values()),
        "state_dict_bytes": nbytes,
        "weights_frame_bytes": len(codec.encode(Weights(version=1, arrays=state, epsilon=None))),
        "tensors": {name: list(a.shape) for name, a in state.items()},
    }
    del agent, state
    live: dict[str, Any] = {}
    series: dict[str, Series] = {}
    try:
        for name in names:
            contender: Any
            if name.startswith("raw"):
                contender = Raw(nbytes, workers, fresh=name == "raw-fresh")
            else:
                contender = ApsWeights(name.removeprefix("aps-"), workers)
            print(f"  starting {name} ...", flush=True)
            series[name] = Series()
            try:
                contender.start()
                if isinstance(contender, Raw):
                    contender.once()  # warm-up (ApsWeights.start publishes twice)
            except Exception as exc:
                series[name].error = f"{type(exc).__name__}: {exc}"
                print(f"  {name} failed to start: {series[name].error}", flush=True)
                contender.close()
                continue
            live[name] = contender
            if isinstance(contender, ApsWeights):
                series[f"{name}-baseline"] = Series()
        for round_ in range(rounds):
            order = list(live)
            shift = round_ % len(order) if order else 0
            for name in order[shift:] + order[:shift]:
                contender = live[name]
                pids = [process.pid for process in contender._processes]
                try:
                    for _ in range(samples):
                        seconds, here, there = timed(contender.once, pids)
                        series[name].add(seconds, round_, here, there)
                        rate = workers * nbytes / seconds / 1e9
                        line = f"{name:<22} {seconds * 1e3:9.1f} ms {rate:6.2f} GB/s"
                        cpu = f"cpu here {here * 1e3:6.1f} ms"
                        if there is not None:
                            cpu += f", workers {there * 1e3:6.1f} ms"
                        print(f"  round {round_ + 1}/{rounds} {line}  {cpu}", flush=True)
                    if isinstance(contender, ApsWeights):
                        base = series[f"{name}-baseline"]
                        for _ in range(samples):
                            seconds, here, there = timed(contender.baseline, pids)
                            base.add(seconds, round_, here, there)
                        print(
                            f"  round {round_ + 1}/{rounds} {name + '-baseline':<22} "
                            f"{statistics.median(base.seconds[-samples:]) * 1e3:9.1f} ms (median)",
                            flush=True,
                        )
                except Exception as exc:
                    series[name].error = f"{type(exc).__name__}: {exc}"
                    print(f"  {name} failed: {series[name].error}", flush=True)
                    live.pop(name).close()
    finally:
        for contender in live.values():
            try:
                contender.close()
            except Exception as exc:
                print(f"  closing {contender.name} failed: {type(exc).__name__}: {exc}")
    return series, info


def timed(once: Any, pids: Sequence[int]) -> tuple[float, float, float | None]:
    """Run ``once()``: its wall seconds, this process's CPU seconds, the receivers'."""
    here_before, workers_before = cpu_seconds(pids)
    seconds = once()
    here_after, workers_after = cpu_seconds(pids)
    if workers_before is None or workers_after is None:
        return seconds, here_after - here_before, None
    return seconds, here_after - here_before, workers_after - workers_before


def ratio(series: dict[str, Series], top: str, bottom: str) -> dict[str, float] | None:
    """Throughput ``top / bottom`` (time ``bottom / top``): ratio of medians, per-round range."""
    a, b = series.get(top), series.get(bottom)
    if a is None or b is None or not a.seconds or not b.seconds:
        return None
    paired = []
    for round_ in sorted(set(a.rounds) & set(b.rounds)):
        mine = [s for s, r in zip(a.seconds, a.rounds, strict=True) if r == round_]
        theirs = [s for s, r in zip(b.seconds, b.rounds, strict=True) if r == round_]
        paired.append(statistics.median(theirs) / statistics.median(mine))
    if not paired:
        return None
    median = statistics.median(b.seconds) / statistics.median(a.seconds)
    return {"median": median, "min": min(paired), "max": max(paired)}


def render_table(series: dict[str, Series], nbytes: int) -> str:
    """A Markdown table: time and GB/s per contender (``nbytes``: all workers together)."""
    lines = [
        "| contender | time (median) | min-max | GB/s (median) | min-max | vs raw "
        "| cpu here (mean) | cpu workers (mean) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in series.items():
        if not s.seconds:
            lines.append(f"| {name} | failed | {s.error} | - | - | - | - | - |")
            continue
        times = (
            f"| {name} | {statistics.median(s.seconds) * 1e3:.1f} ms "
            f"| {min(s.seconds) * 1e3:.1f}-{max(s.seconds) * 1e3:.1f} ms "
        )
        cpu = f"| {statistics.fmean(s.cpu_here) * 1e3:.1f} ms "
        cpu += f"| {statistics.fmean(s.cpu_workers) * 1e3:.1f} ms |" if s.cpu_workers else "| - |"
        if name.endswith("-baseline"):  # no weights travel: a time, not a bandwidth
            lines.append(times + "| - | - | - " + cpu)
            continue
        rates = s.rates(nbytes)
        vs_raw = "" if name == "raw" else fmt_ratio(ratio(series, name, "raw"))
        lines.append(
            times + f"| {statistics.median(rates):.2f} | {min(rates):.2f}-{max(rates):.2f} "
            f"| {vs_raw} " + cpu
        )
    return "\n".join(lines)


def render_sync_only(series: dict[str, Series], nbytes: int) -> list[str]:
    """The weight sync alone: an ``aps-*`` median less its baseline's (the rollout step)."""
    lines = []
    for name, s in series.items():
        base = series.get(f"{name}-baseline")
        if base is None or not s.seconds or not base.seconds:
            continue
        seconds = statistics.median(s.seconds) - statistics.median(base.seconds)
        raw = series.get("raw")
        share = ""
        if raw is not None and raw.seconds and seconds > 0:
            share = f", {statistics.median(raw.seconds) / seconds:.2f}x raw"
        if seconds > 0:
            lines.append(
                f"{name} without its 1-step rollout: {seconds * 1e3:.1f} ms, "
                f"{nbytes / seconds / 1e9:.2f} GB/s{share}"
            )
    return lines


def render_targets(series: dict[str, Series]) -> list[str]:
    """The project's target, and the same ratio against receivers that allocate per message."""
    lines = []
    r = ratio(series, "aps-tcp", "raw")
    if r is not None:
        verdict = "holds" if r["median"] >= 0.5 else "does NOT hold"
        lines.append(
            f"aps-tcp weight sync >= 1/2 of raw loopback: {verdict} (median ratio {fmt_ratio(r)})"
        )
    r = ratio(series, "aps-tcp", "raw-fresh")
    if r is not None:
        lines.append(f"(aps-tcp / raw-fresh, for reference: {fmt_ratio(r)})")
    r = ratio(series, "aps-ws", "aps-tcp")
    if r is not None:
        verdict = "holds" if r["median"] >= 0.5 else "does NOT hold"
        lines.append(
            f"aps-ws weight sync >= 1/2 of aps-tcp: {verdict} (median ratio {fmt_ratio(r)})"
        )
    return lines


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--params", type=int, default=None, help="agent parameters (default 10M)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument(
        "--contenders",
        type=name_list(CONTENDERS),
        default=list(CONTENDERS),
        help=f"comma-separated subset of {','.join(CONTENDERS)} (default: all available)",
    )
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5)")
    p.add_argument("--samples", type=int, default=None, help="samples per round (default 3)")
    p.add_argument("--quick", action="store_true", help="2M parameters, 2 rounds x 2 samples")
    p.add_argument(
        "--no-uvloop", action="store_true", help="run aps on asyncio's own loop (APS_UVLOOP=0)"
    )
    p.add_argument(
        "--ws-fragment-size",
        type=int,
        default=None,
        help="the learner's WebSocket fragment size in bytes (default: aps's FRAGMENT_SIZE)",
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    # A raw receiver process (started by the raw contender, not by hand).
    p.add_argument("--raw-receiver", metavar="HOST:PORT", help=argparse.SUPPRESS)
    p.add_argument("--raw-bytes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--raw-fresh", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.raw_receiver:
        raw_receiver(args.raw_receiver, args.raw_bytes, fresh=args.raw_fresh)
        return 0
    if args.no_uvloop:
        os.environ["APS_UVLOOP"] = "0"  # read by aps in this process and in its workers
    if args.ws_fragment_size is not None and importlib.util.find_spec("websockets") is not None:
        # The sender cuts the fragments (the learner, here): the workers need no setting.
        import aps.transports.websocket as websocket

        websocket.FRAGMENT_SIZE = args.ws_fragment_size
    params = args.params or (2_000_000 if args.quick else DEFAULT_PARAMS)
    rounds = args.rounds or (2 if args.quick else 5)
    samples = args.samples or (2 if args.quick else 3)
    names = list(args.contenders)
    skipped = {}
    if "aps-ws" in names and importlib.util.find_spec("websockets") is None:
        names.remove("aps-ws")
        skipped["aps-ws"] = "the websockets package is not installed"
        print("skipping aps-ws: the websockets package is not installed")
    torch.set_num_threads(1)  # the learner process shares the cores with the workers

    print(
        f"weight sync: ~{params:,} float32 parameters to {args.workers} workers; {rounds} "
        f"interleaved rounds x {samples} samples; {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    load_at_start = list(os.getloadavg())
    series, info = measure(
        names, params=params, workers=args.workers, rounds=rounds, samples=samples
    )
    nbytes = info["state_dict_bytes"]

    print()
    print(
        f"{info['parameters']:,} parameters = {nbytes / 1e6:.1f} MB to each of {args.workers} "
        f"workers; GB/s = {args.workers} x {nbytes / 1e6:.1f} MB / time"
    )
    print("(median of all samples; ratios: of medians, with the range of per-round ratios)")
    print()
    print(render_table(series, args.workers * nbytes))
    print()
    for line in render_sync_only(series, args.workers * nbytes):
        print(line)
    for line in render_targets(series):
        print(line)

    report = {
        "benchmark": "weight_sync",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"load_average_at_start": load_at_start, **machine()},
        "settings": {
            "env": ENV_ID,
            "workers": args.workers,
            "params": params,
            "rounds": rounds,
            "samples": samples,
            "ws_fragment_size": args.ws_fragment_size,
            **info,
        },
        "skipped": skipped,
        "results": {
            name: {
                "seconds": s.seconds,
                "rounds": s.rounds,
                "median_seconds": statistics.median(s.seconds) if s.seconds else None,
                "cpu_here_seconds": s.cpu_here,
                "cpu_workers_seconds": s.cpu_workers,
                "gb_per_s": s.rates(args.workers * nbytes),
                "median_gb_per_s": (
                    statistics.median(s.rates(args.workers * nbytes)) if s.seconds else None
                ),
                "error": s.error,
            }
            for name, s in series.items()
        },
        "ratios": {
            f"{name} / raw": r
            for name in series
            if name != "raw" and (r := ratio(series, name, "raw")) is not None
        },
        "sync_only": render_sync_only(series, args.workers * nbytes),
        "targets": render_targets(series),
    }
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
