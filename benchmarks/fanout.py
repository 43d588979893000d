"""What a weight fan-out engine costs its root: gloo broadcast and scatter-allgather.

aps sends each synced worker its own copy of a version from the learner, so the learner's
bytes per version grow with the workers synced. An engine that fans out through the workers
themselves keeps the root's share small. This measures two built from the gloo backend aps
already depends on for its gradient all-reduce, one root and ``n`` receivers on 127.0.0.1,
a float32 tensor of ``--megabytes`` (6.7 MB: the Nature CNN):

- ``broadcast``: gloo's own broadcast from rank 0;
- ``scatter-allgather``: van de Geijn's broadcast, the tensor padded to a multiple of the
  ranks and cut into one equal piece per rank; rank 0 scatters the pieces, then every rank,
  rank 0 included, all-gathers them.

The root is a process of its own (so its ``wchar`` counts its writes only); the receivers
are threads in ``--receiver-processes`` processes, spread evenly, each thread a rank with
its own ``ProcessGroupGloo`` built directly over a ``TCPStore`` the parent hosts (no
``init_process_group``, which is one per process). For each method and ``n`` it reports,
per version (the mean of ``--repeats`` after a warm-up), the bytes the root process wrote
(``wchar`` of ``/proc/self/io``, all its writes, sockets included) in copies of the tensor,
the root's CPU seconds, the wall time from the first version sent until a barrier after the
last one, and the ratios of copies and CPU to the same method's 1-receiver row; beside them,
what aps's own path costs by construction: one copy per worker synced.

    python benchmarks/fanout.py --receivers 1,4,16 --json benchmarks/results/fanout.json

Linux only (``/proc``); needs torch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import platform
import queue
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("broadcast", "scatter-allgather")
STARTUP = 120.0  # seconds for a trial's processes to start and import torch on a busy machine


def written() -> int:
    """Bytes this process has written through system calls (files and sockets alike)."""
    with open(f"/proc/{os.getpid()}/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


@dataclass(frozen=True)
class Trial:
    """One method at one world size: what every rank needs to join and run it."""

    method: str
    world: int  # the root and the receivers
    port: int  # the parent's TCPStore
    numel: int
    repeats: int
    timeout: float  # seconds any one wait may take


def distributed() -> Any:
    """``torch.distributed``, untyped: its stubs leave out the stores and the gloo group."""
    import torch.distributed

    return torch.distributed


def version(numel: int) -> Any:
    """The root's tensor: distinct values, so a misplaced piece shows."""
    import torch

    return torch.arange(numel, dtype=torch.float32)


def transfer(group: Any, trial: Trial, rank: int) -> tuple[Callable[[], None], Any]:
    """One version's transfer on ``group`` as a blocking call, and the tensor it fills."""
    import torch

    dist = distributed()
    delta = datetime.timedelta(seconds=trial.timeout)
    if trial.method == "broadcast":
        tensor = version(trial.numel) if rank == 0 else torch.zeros(trial.numel)
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor, options.timeout = 0, 0, delta

        def broadcast() -> None:
            group.broadcast([tensor], options).wait()

        return broadcast, tensor
    # Padded so the pieces are equal; each rank's piece is a view of its own buffer, so
    # the scatter lands in place and the all-gather fills the rest.
    padded = math.ceil(trial.numel / trial.world) * trial.world
    buffer = torch.zeros(padded)
    if rank == 0:
        buffer[: trial.numel] = version(trial.numel)
    pieces = list(buffer.chunk(trial.world))
    scatter = dist.ScatterOptions()
    scatter.rootRank, scatter.timeout = 0, delta
    sources = [pieces] if rank == 0 else []

    def scatter_allgather() -> None:
        group.scatter([pieces[rank]], sources, scatter).wait()
        group.allgather([pieces], [pieces[rank]]).wait()

    return scatter_allgather, buffer[: trial.numel]


def member(rank: int, trial: Trial) -> tuple[float, float, float]:
    """Run ``trial`` as ``rank``: per version, the process's bytes written, CPU s and wall s.

    Raises RuntimeError when gloo fails or a wait passes ``trial.timeout``, and when a
    receiver's tensor differs from the root's after the timed transfers.
    """
    dist = distributed()
    delta = datetime.timedelta(seconds=trial.timeout)
    store = dist.TCPStore("127.0.0.1", trial.port, trial.world, False, timeout=delta)
    gloo = dist.ProcessGroupGloo
    options = gloo._Options()
    options._timeout = delta
    options._devices = [gloo.create_device(hostname="127.0.0.1")]
    group = gloo(dist.PrefixStore(f"{trial.method}/", store), rank, trial.world, options)
    try:
        step, tensor = transfer(group, trial, rank)
        step()  # warm: the first transfer over each connection
        if rank != 0:
            tensor.zero_()  # what it holds at the end came in the timed transfers
        group.barrier().wait()
        before, cpu, wall = written(), time.process_time(), time.perf_counter()
        for _ in range(trial.repeats):
            step()
        group.barrier().wait()  # every rank holds the last version
        wall = time.perf_counter() - wall
        result = (
            (written() - before) / trial.repeats,
            (time.process_time() - cpu) / trial.repeats,
            wall / trial.repeats,
        )
        if rank != 0 and not tensor.equal(version(trial.numel)):
            raise RuntimeError(f"rank {rank} holds a different tensor from the root's")
        return result
    finally:
        group.shutdown()


def root(trial: Trial, out: Any) -> None:
    """Process entry of rank 0: puts ``("root", result)`` or ``("error", text)`` on ``out``."""
    try:
        out.put(("root", member(0, trial)))
    except BaseException as error:
        out.put(("error", f"rank 0: {error!r}"))
        raise


def receivers(ranks: Sequence[int], trial: Trial, out: Any) -> None:
    """Process entry of some receivers, a thread each; a failure goes to ``out``."""

    def run(rank: int) -> None:
        try:
            member(rank, trial)
        except BaseException as error:
            out.put(("error", f"rank {rank}: {error!r}"))

    # Daemons: a thread stuck past its deadline must not hold the process open.
    threads = [threading.Thread(target=run, args=(rank,), daemon=True) for rank in ranks]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + trial.timeout * (trial.repeats + 3)
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


def spread(receivers: int, processes: int) -> list[list[int]]:
    """Ranks 1..``receivers`` in at most ``processes`` contiguous blocks, sizes within one."""
    count = min(processes, receivers)
    ranks = list(range(1, receivers + 1))
    bounds = [receivers * k // count for k in range(count + 1)]
    return [ranks[bounds[k] : bounds[k + 1]] for k in range(count)]


def measure(
    method: str,
    receivers_count: int,
    *,
    megabytes: float,
    repeats: int,
    processes: int,
    timeout: float,
) -> dict[str, Any]:
    """One row: ``method`` from a root to ``receivers_count`` receivers.

    Raises RuntimeError when a rank fails or no result comes within the trial's deadline.
    """
    dist = distributed()
    numel = int(megabytes * 1e6 // 4)
    world = receivers_count + 1
    delta = datetime.timedelta(seconds=timeout)
    # The parent hosts the store, so the root process writes nothing but its own traffic.
    store = dist.TCPStore("127.0.0.1", 0, world, True, timeout=delta, wait_for_workers=False)
    trial = Trial(method, world, store.port, numel, repeats, timeout)
    context = mp.get_context("spawn")
    out: Any = context.Queue()
    blocks = spread(receivers_count, processes)
    procs = [context.Process(target=root, args=(trial, out))]
    procs += [context.Process(target=receivers, args=(block, trial, out)) for block in blocks]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + STARTUP + timeout * (repeats + 3)
        while True:
            try:
                kind, payload = out.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise RuntimeError(f"{method}, {receivers_count} receivers: no result") from None
            if kind == "error":
                raise RuntimeError(f"{method}, {receivers_count} receivers: {payload}")
            root_bytes, root_cpu, wall = payload
            break
    finally:
        for proc in procs:
            if proc.pid is not None:
                proc.join(timeout=60)
                if proc.is_alive():
                    proc.kill()
                    proc.join(timeout=10)
    return {
        "method": method,
        "receivers": receivers_count,
        "receiver_processes": len(blocks),
        "root_copies": root_bytes / (numel * 4),
        "root_cpu_s": root_cpu,
        "wall_s": wall,
        "aps_copies": receivers_count,  # the learner sends each synced worker its own copy
    }


def ratio(value: float, base: float | None) -> float | None:
    return None if base is None or base == 0 else value / base


def cell(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--receivers", default="1,4,16")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--receiver-processes", type=int, default=4)
    p.add_argument("--megabytes", type=float, default=6.7)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds any one wait may take")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    methods = args.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    load = os.getloadavg()
    rows = []
    print(
        "| method | receivers | root's copies | root CPU ms | wall ms per version "
        "| aps today: copies | copies / 1-receiver | CPU / 1-receiver |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for method in methods:
        base_copies: float | None = None
        base_cpu: float | None = None
        for count in map(int, args.receivers.split(",")):
            row = measure(
                method,
                count,
                megabytes=args.megabytes,
                repeats=args.repeats,
                processes=args.receiver_processes,
                timeout=args.timeout,
            )
            if count == 1:
                base_copies, base_cpu = row["root_copies"], row["root_cpu_s"]
            row["copies_ratio"] = ratio(row["root_copies"], base_copies)
            row["cpu_ratio"] = ratio(row["root_cpu_s"], base_cpu)
            rows.append(row)
            print(
                f"| {method} | {count} | {row['root_copies']:.2f} "
                f"| {1e3 * row['root_cpu_s']:.1f} | {1e3 * row['wall_s']:.0f} "
                f"| {row['aps_copies']} | {cell(row['copies_ratio'])} "
                f"| {cell(row['cpu_ratio'])} |",
                flush=True,
            )
    if args.json is not None:
        report = {
            "benchmark": "fanout",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["fanout.py", *(argv or sys.argv[1:])]),
            "machine": {
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "load_average_at_start": list(load),
            },
            "megabytes": args.megabytes,
            "repeats": args.repeats,
            "receiver_processes": args.receiver_processes,
            "rows": rows,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
