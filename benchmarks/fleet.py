"""A fleet on one learner: an admission storm from many source addresses, then lockstep.

Many light :class:`aps.Worker` instances (one CartPole env each) run as tasks in a few host
processes (``--hosts``), and each dials from one of ``--addresses`` loopback source
addresses (``127.0.0.2``, ``127.0.0.3``, ...; bound before connect with
``TCPFactory(source=...)``), so the learner's pre-auth budget sees as many hosts as a
cluster would show it. The token is on. For each worker count:

1. **The storm.** Every host builds its workers, says it is ready, and on the learner's one
   ``go`` starts them all at once. Admission time runs from the ``go`` to the moment
   ``Learner.wait_for_workers`` returns (all admitted); the hosts report how many workers
   gave up (their ``run()`` ended with an error before the learner said goodbye) and why.
   The learner reports its CPU time over the storm, its RSS and open file descriptors
   (``/proc/self/fd``) once all are in, and the log lines at WARNING and above that aps
   wrote meanwhile (counted, with a few samples).
2. **Lockstep.** ``await learner.step(actions)`` over all workers in a loop for a timed
   window; the learner process's CPU time (user + system, ``resource.getrusage``) per
   message, messages = steps x workers. This figure is what decides how many workers one
   learner core carries; it should stay flat as workers are added. Throughput is printed for
   reference only: the workers share the machine's cores with the learner.

Usage::

    python benchmarks/fleet.py                               # 32, 128, 512 workers
    python benchmarks/fleet.py --workers 1024 --addresses 16 --hosts 4
    python benchmarks/fleet.py --workers 32,64 --seconds 2 --json /tmp/fleet.json

Linux only (every address of 127.0.0.0/8 is loopback there; ``/proc`` is read). Writes
``results/fleet.json``. Nothing asserts on timings.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import logging
import os
import platform
import re
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

import aps
from aps.session import Timeouts
from aps.session._loop import run as run_loop
from aps.transports.tcp import TCPFactory

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
ENV = "CartPole-v1"
TOKEN = "fleet-benchmark-token"
GO = b"go\n"


def source_addresses(count: int) -> list[str]:
    """``count`` loopback source addresses, ``127.0.0.2`` upwards (the learner has ``.1``)."""
    if not 1 <= count <= 250:
        raise ValueError(f"between 1 and 250 source addresses, got {count}")
    return [f"127.0.0.{2 + i}" for i in range(count)]


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def rss_bytes() -> int:
    """This process's resident set size now (``VmRSS`` of ``/proc/self/status``)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def open_fds() -> int:
    """File descriptors this process holds open now."""
    return len(os.listdir("/proc/self/fd"))


class LogCount(logging.Handler):
    """Counts aps's log records at WARNING and above, with a few samples of each kind."""

    SAMPLES = 3

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.by_kind: collections.Counter[str] = collections.Counter()
        self.samples: dict[str, list[str]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        # Addresses, ports and counts differ between lines that say the same thing.
        kind = f"{record.levelname}: " + re.sub(r"[0-9]+", "N", message)[:120]
        self.by_kind[kind] += 1
        samples = self.samples.setdefault(kind, [])
        if len(samples) < self.SAMPLES:
            samples.append(message[:300])

    def report(self) -> dict[str, Any]:
        return {
            "lines": sum(self.by_kind.values()),
            "kinds": [
                {"kind": kind, "count": count, "samples": self.samples[kind]}
                for kind, count in self.by_kind.most_common()
            ],
        }


# A worker host.


async def host(url: str, sources: list[str], count: int, first: int, connect: float) -> None:
    """Run ``count`` workers, worker ``first + i`` dialing from ``sources[(first + i) % n]``.

    Prints ``ready`` once every worker is built, waits for ``go`` on stdin, starts them all
    at once, and at the end prints one JSON line: when it started them and how many gave up.
    """
    timeouts = Timeouts(connect=connect, step=300.0)
    factories = {source: TCPFactory(source=source) for source in sources}
    workers = [
        aps.Worker(
            url,
            ENV,
            num_envs=1,
            token=TOKEN,
            timeouts=timeouts,
            factory=factories[sources[(first + i) % len(sources)]],
            label=str(first + i),
        )
        for i in range(count)
    ]
    loop = asyncio.get_running_loop()
    print("ready", flush=True)
    line = await loop.run_in_executor(None, sys.stdin.buffer.readline)
    if line != GO:
        return
    started = time.time()
    results = await asyncio.gather(*(w.run() for w in workers), return_exceptions=True)
    errors = collections.Counter(
        f"{type(r).__name__}: {r}"[:200] for r in results if isinstance(r, BaseException)
    )
    report = {"started": started, "gave_up": sum(errors.values()), "errors": dict(errors)}
    print(json.dumps(report), flush=True)


# The learner.


async def start_hosts(
    url: str, workers: int, hosts: int, sources: list[str], connect: float
) -> list[asyncio.subprocess.Process]:
    shares = [workers // hosts + (i < workers % hosts) for i in range(hosts)]
    procs = []
    first = 0
    for share in shares:
        if not share:
            continue
        command = [__file__, "--host", url, "--count", str(share), "--first", str(first)]
        command += ["--sources", ",".join(sources), "--connect", str(connect)]
        procs.append(
            await asyncio.create_subprocess_exec(
                sys.executable,
                *command,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
        )
        first += share
    return procs


async def measure(
    workers: int,
    *,
    hosts: int,
    addresses: int,
    seconds: float,
    warmup: float,
    admission_timeout: float,
) -> dict[str, Any]:
    sources = source_addresses(addresses)
    timeouts = Timeouts(connect=admission_timeout, step=300.0)
    logs = LogCount()
    aps_logger = logging.getLogger("aps")
    aps_logger.addHandler(logs)
    row: dict[str, Any] = {"workers": workers, "hosts": hosts, "addresses": addresses}
    procs: list[asyncio.subprocess.Process] = []
    try:
        async with aps.Learner(
            "tcp://127.0.0.1:0", num_workers=workers, token=TOKEN, timeouts=timeouts
        ) as learner:
            procs = await start_hosts(learner.url, workers, hosts, sources, admission_timeout)
            async with asyncio.timeout(300):  # building the workers and their envs
                for proc in procs:
                    assert proc.stdout is not None
                    if await proc.stdout.readline() != b"ready\n":
                        raise RuntimeError(f"a host (pid {proc.pid}) ended before it was ready")
            row["fds_before"], row["rss_before_bytes"] = open_fds(), rss_bytes()
            cpu0, go = cpu_seconds(), time.time()
            for proc in procs:
                assert proc.stdin is not None
                proc.stdin.write(GO)
            await asyncio.gather(*(proc.stdin.drain() for proc in procs if proc.stdin))
            try:
                await learner.wait_for_workers(timeout=admission_timeout)
                row["admitted_all"] = True
            except aps.errors.Timeout as exc:
                row["admitted_all"] = False
                row["admission_error"] = str(exc)[:500]
            row["admission_s"] = time.time() - go
            row["admission_cpu_s"] = cpu_seconds() - cpu0
            row["admitted"] = len(learner.workers)
            row["fds_admitted"], row["rss_admitted_bytes"] = open_fds(), rss_bytes()
            row["log_admission"] = logs.report()
            if row["admitted_all"]:
                row.update(await lockstep(learner, seconds, warmup))
                row["rss_after_lockstep_bytes"] = rss_bytes()
    finally:
        aps_logger.removeHandler(logs)
        reports = await stop_hosts(procs)
    row["log_total"] = logs.report()["lines"]
    row["gave_up"] = sum(r["gave_up"] for r in reports)
    row["give_up_errors"] = dict(
        sum((collections.Counter(r["errors"]) for r in reports), start=collections.Counter())
    )
    if reports:
        row["first_dial_after_go_s"] = min(r["started"] for r in reports) - go
    return row


async def lockstep(learner: aps.Learner, seconds: float, warmup: float) -> dict[str, Any]:
    await learner.reset(seed=0)
    actions = np.zeros(learner.num_envs, dtype=np.int64)
    deadline = time.perf_counter() + warmup
    while time.perf_counter() < deadline:
        await learner.step(actions)
    steps = 0
    cpu0, t0 = cpu_seconds(), time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        await learner.step(actions)
        steps += 1
    cpu, wall = cpu_seconds() - cpu0, time.perf_counter() - t0
    messages = steps * len(learner.workers)
    return {
        "lockstep_steps": steps,
        "lockstep_messages": messages,
        "lockstep_seconds": wall,
        "lockstep_learner_cpu_s": cpu,
        "cpu_us_per_message": cpu / messages * 1e6,
        "messages_per_s": messages / wall,
    }


async def stop_hosts(procs: list[asyncio.subprocess.Process]) -> list[dict[str, Any]]:
    """Wait for the hosts to end (the learner said goodbye) and read their reports."""
    reports = []
    for proc in procs:
        try:
            async with asyncio.timeout(60):
                out, _ = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            continue
        for line in out.decode().splitlines():
            if line.startswith("{"):
                reports.append(json.loads(line))
    return reports


def render(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| workers | addresses | admitted in | gave up | learner RSS | fds | WARNING+ lines "
        "| learner CPU per lockstep message | messages/s here |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        admitted = (
            f"{row['admission_s']:.1f} s"
            if row.get("admitted_all")
            else (f"{row.get('admitted', 0)} in {row.get('admission_s', 0):.0f} s")
        )
        us = f"{row['cpu_us_per_message']:.1f} µs" if "cpu_us_per_message" in row else "-"
        rate = f"{row['messages_per_s']:,.0f}" if "messages_per_s" in row else "-"
        lines.append(
            f"| {row['workers']} | {row['addresses']} | {admitted} | {row['gave_up']} "
            f"| {row['rss_admitted_bytes'] / 2**20:.0f} MiB | {row['fds_admitted']} "
            f"| {row['log_admission']['lines']} | {us} | {rate} |"
        )
    return "\n".join(lines)


def parse_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--workers", type=parse_ints, default=[32, 128, 512], help="32,128,512")
    p.add_argument("--hosts", type=int, default=4, help="worker processes (default 4)")
    p.add_argument("--addresses", type=int, default=16, help="source addresses (default 16)")
    p.add_argument("--seconds", type=float, default=3.0, help="lockstep window (default 3)")
    p.add_argument("--warmup", type=float, default=1.0, help="lockstep warm-up (default 1)")
    p.add_argument(
        "--admission-timeout",
        type=float,
        default=120.0,
        help="seconds for all to be admitted; also how long a worker dials (default 120)",
    )
    p.add_argument("--json", type=Path, default=RESULTS / "fleet.json")
    p.add_argument("--host", help=argparse.SUPPRESS)  # a worker host's learner URL
    p.add_argument("--count", type=int, help=argparse.SUPPRESS)
    p.add_argument("--first", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sources", help=argparse.SUPPRESS)
    p.add_argument("--connect", type=float, default=120.0, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.host:
        run_loop(host(args.host, args.sources.split(","), args.count, args.first, args.connect))
        return 0
    if not sys.platform.startswith("linux"):
        raise SystemExit("the fleet benchmark needs Linux (127.0.0.0/8 source addresses, /proc)")
    source_addresses(args.addresses)  # refuse a bad count before anything starts
    print(
        f"{args.hosts} host processes, {args.addresses} source addresses; {os.cpu_count()} "
        f"CPUs, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    rows = []
    for count in args.workers:
        row = run_loop(
            measure(
                count,
                hosts=args.hosts,
                addresses=args.addresses,
                seconds=args.seconds,
                warmup=args.warmup,
                admission_timeout=args.admission_timeout,
            )
        )
        rows.append(row)
        us = row.get("cpu_us_per_message", float("nan"))
        print(
            f"{count:5} workers: admitted {row['admitted']} in {row['admission_s']:.1f} s "
            f"({row['admission_cpu_s']:.1f} s learner CPU), {row['gave_up']} gave up, RSS "
            f"{row['rss_admitted_bytes'] / 2**20:.0f} MiB, {row['fds_admitted']} fds, "
            f"{row['log_admission']['lines']} WARNING+ lines; lockstep {us:.1f} µs learner "
            f"CPU per message",
            flush=True,
        )
    print()
    print(render(rows))
    report = {
        "benchmark": "fleet",
        "command": " ".join([Path(sys.executable).name, *(argv or sys.argv)]),
        "machine": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "load_average_at_start": list(os.getloadavg()),
        },
        "settings": {
            "env": ENV,
            "envs_per_worker": 1,
            "hosts": args.hosts,
            "addresses": args.addresses,
            "seconds": args.seconds,
            "warmup": args.warmup,
            "admission_timeout": args.admission_timeout,
        },
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
