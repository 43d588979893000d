"""What a weight fan-out engine costs its root: torch.distributed broadcast over gloo.

aps sends each synced worker its own copy of a version from the learner, so the learner's
bytes per version grow with the workers synced. An engine that fans out through the workers
themselves keeps the root's share small. This measures one candidate aps already depends on
for its gradient all-reduce: ``torch.distributed.broadcast`` on the gloo backend, one root
and ``n`` receivers as processes on 127.0.0.1, a float32 tensor of ``--megabytes`` (6.7 MB:
the Nature CNN). For each ``n`` it reports, per broadcast (the mean of ``--repeats`` after a
warm-up), the bytes the root process wrote (``wchar`` of ``/proc/self/io``, all its
writes, sockets included) in copies of the tensor, and the root's CPU seconds; beside them,
what aps's own path costs by construction: one copy per worker synced.

    python benchmarks/fanout.py --receivers 1,2,4,8,16 --json benchmarks/results/fanout.json

Linux only (``/proc``); needs torch.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import socket
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def written() -> int:
    """Bytes this process has written through system calls (files and sockets alike)."""
    with open(f"/proc/{os.getpid()}/io") as io:
        for line in io:
            if line.startswith("wchar:"):
                return int(line.split()[1])
    raise RuntimeError("no wchar in /proc/self/io")


def member(rank: int, world: int, port: int, numel: int, repeats: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        tensor = torch.zeros(numel)
        dist.broadcast(tensor, 0)  # warm: the connections are made
        dist.barrier()
        before, cpu = written(), time.process_time()
        for _ in range(repeats):
            dist.broadcast(tensor, 0)
        dist.barrier()
        if rank == 0:
            out.put(((written() - before) / repeats, (time.process_time() - cpu) / repeats))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def measure(receivers: int, megabytes: float, repeats: int) -> dict[str, Any]:
    numel = int(megabytes * 1e6 // 4)
    out: Any = mp.get_context("spawn").Queue()
    world, port = receivers + 1, free_port()
    context = mp.get_context("spawn")
    procs = [
        context.Process(target=member, args=(rank, world, port, numel, repeats, out))
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    try:
        root_bytes, root_cpu = out.get(timeout=300)
    finally:
        for proc in procs:
            proc.join(timeout=60)
            if proc.is_alive():
                proc.kill()
    return {
        "receivers": receivers,
        "root_copies": root_bytes / (numel * 4),
        "root_cpu_s": root_cpu,
        "aps_copies": receivers,  # the learner sends each synced worker its own copy
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--receivers", default="1,2,4,8,16")
    p.add_argument("--megabytes", type=float, default=6.7)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = []
    print("| receivers | gloo broadcast: root's copies | root CPU ms | aps today: copies |")
    print("|---:|---:|---:|---:|")
    for receivers in map(int, args.receivers.split(",")):
        row = measure(receivers, args.megabytes, args.repeats)
        rows.append(row)
        print(
            f"| {receivers} | {row['root_copies']:.2f} | {1e3 * row['root_cpu_s']:.1f} "
            f"| {row['aps_copies']} |",
            flush=True,
        )
    if args.json is not None:
        report = {
            "benchmark": "fanout",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(["fanout.py", *(argv or sys.argv[1:])]),
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "megabytes": args.megabytes,
            "rows": rows,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
