"""The benchmark matrix: aps, its peers and the limits of this machine, in one run.

Columns: CartPole-v1 on 2 workers x 1 env, CartPole-v1 on 2 x 64 and LunarLander-v3 on
2 x 64. Rows: the peers (Gymnasium ``SyncVectorEnv`` and ``AsyncVectorEnv``, Ray actors,
ZeroMQ + JSON, EnvPool), the limits (the transport limit, the env limit and the ideal
2-core rate derived from them, the bare ceilings with no aps code on asyncio streams and on
``asyncio.Protocol``) and aps (remote step over TCP, WebSocket and a Unix socket,
the await loop, partial batches, DETACH streaming). The contenders are those of
``throughput.py`` and ``contenders.py``; the method is ``throughput.py``'s: per column every
contender is started and warmed up, then the timed windows run round-robin, ``--repeats``
rounds, the order rotating each round.

Derived rows, per column and per round, from the windows of the same round:

- ``ideal = min(workers x env-limit, transport-limit)``: the targets' yardstick. It assumes
  the messaging overlaps the stepping.
- ``lockstep bound = 1 / (1 / transport-limit + 1 / (workers x env-limit))``: in lockstep
  (``step()``, ``AsyncVectorEnv``) they cannot overlap. No worker steps before its actions
  arrive, and the learner sends nothing before every answer is in. So each step pays one
  transport round trip plus one worker's env time, one after the other. No lockstep
  implementation over this transport goes faster here; the row shows how much of a
  lockstep gap is aps's own.
- ``step-limit`` is measured, not derived: the transport limit's workers step their real
  envs and encode each result, with no aps code at either end. It is the lockstep bound as
  it comes out on this machine, where each worker's env step shares its core (and its
  caches) with the messages, and the learner and the workers share the cores: on 2 cores
  it falls well short of the derived bound. aps's lockstep rows are also given as a share
  of it, so that what aps itself costs is told apart from what the bound leaves out.
- ``DETACH bound = workers x act-limit``: ``act-limit`` runs a DETACH worker's loop (the
  policy acts, the envs step) in one process with nothing else, so this is what 2 workers
  acting with that policy could deliver if streaming cost nothing. The DETACH target is
  against the ideal, which leaves out the inference; this row shows the share inference
  takes and the share that is aps's own.
- ``stream-limit`` is DETACH's measured counterpart of ``step-limit``: the workers act and
  build chunks with aps's own collector, and send them over plain sockets to a learner
  that only decodes them. It leaves out aps's session, learner, worker loop and transport;
  the learner's share of the cores and the chunks' encoding stay in.

Ratios are of medians, with the range of the per-round ratios. The targets are reported,
never asserted.

Usage::

    python benchmarks/matrix.py                  # 3 columns, 3 s windows, 3 rounds
    python benchmarks/matrix.py --quick          # 1 s windows, 2 rounds
    python benchmarks/matrix.py --columns CartPole-v1:64 --contenders aps-tcp,gym-async
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from contenders import ALL, ApsDetach
from throughput import (
    POOL_SIZE,
    Series,
    Setup,
    available,
    fmt_ratio,
    machine,
    measure_size,
    name_list,
    ratio,
    stop_ray,
    write_json,
)

ROOT = Path(__file__).resolve().parent
DEFAULT_JSON = ROOT / "results" / "matrix.json"
IDEAL = "ideal"  # the derived rows' keys
LOCKSTEP_BOUND = "lockstep-bound"
DETACH_BOUND = "detach-bound"


@dataclass(frozen=True, slots=True)
class Column:
    """One column of the matrix: ``envs_per_worker`` envs of ``env_id`` on each worker."""

    env_id: str
    envs_per_worker: int

    def label(self, workers: int) -> str:
        return f"{self.env_id.split('-v')[0]} {workers}x{self.envs_per_worker}"

    @property
    def key(self) -> str:
        return f"{self.env_id}:{self.envs_per_worker}"


COLUMNS = (Column("CartPole-v1", 1), Column("CartPole-v1", 64), Column("LunarLander-v3", 64))

# Rows in table order: contender name -> label ({w}: the number of workers).
ROWS = {
    "gym-sync": "Gymnasium SyncVectorEnv (all envs in 1 process)",
    "gym-async": "Gymnasium AsyncVectorEnv ({w} processes, envs grouped per process, shm)",
    "ray": "Ray actors ({w}, one ray.get per step)",
    "zmq-json": "ZeroMQ + JSON ({w} processes)",
    "envpool": "EnvPool (C++ envs, {w} threads)",
    "transport-limit": "asyncio TCP + msgpack, pre-built replies (transport limit)",
    "step-limit": "step limit: the transport limit's workers step their envs (no aps code)",
    "bare-ceiling": "bare ceiling: asyncio TCP + plain msgpack, Gymnasium SyncVectorEnv workers",
    "bare-protocol": "bare ceiling on asyncio.Protocol (own buffer, no StreamReader), same workers",
    "env-limit": "env limit: one worker's envs in aps's vector env, 1 process (single-core rate)",
    "env-parallel": "env parallel: {w} processes step their envs at once, no messages",
    "act-limit": "act + env limit: the DETACH policy acting on one worker's envs, 1 process",
    "stream-limit": "stream limit: {w} processes act, chunks over plain sockets (no aps code)",
    IDEAL: "ideal {w}-core = min({w} x env limit, transport limit)",
    LOCKSTEP_BOUND: "lockstep bound = 1 / (1 / transport limit + 1 / ({w} x env limit))",
    DETACH_BOUND: "DETACH bound = {w} x act + env limit",
    "aps-tcp": "**aps** remote step, TCP (`ClusterEnv`)",
    "aps-tcp-async": "**aps** remote step, TCP (`await Learner.step`)",
    "aps-ws": "**aps** remote step, WebSocket (`ClusterEnv`)",
    "aps-unix": "**aps** remote step, Unix socket (`await Learner.step`)",
    "aps-partial": "**aps** partial batches, TCP (`send`/`recv(min_workers=1)`)",
    "aps-detach": "**aps** DETACH streaming, TCP (workers act with the agent's MLP)",
}


@dataclass(frozen=True, slots=True)
class Target:
    """``top >= factor x bottom`` (by the ratio of medians) in the columns ``keys``."""

    what: str
    keys: tuple[str, ...]  # Column.key values; () = every column
    tops: tuple[str, ...]
    bottom: str
    factor: float


LOCKSTEP = ("aps-tcp", "aps-tcp-async")
# The remote-step targets are checked for each way aps steps remote envs over TCP: the two
# lockstep ones, and partial batches (EnvPool's asynchronous mode), each reported on its own.
REMOTE_STEP = (*LOCKSTEP, "aps-partial")
TARGETS = (
    Target(
        "remote step >= 1.3x AsyncVectorEnv", ("CartPole-v1:64",), REMOTE_STEP, "gym-async", 1.3
    ),
    Target("remote step >= 2.5x ZeroMQ + JSON", ("CartPole-v1:64",), REMOTE_STEP, "zmq-json", 2.5),
    Target("remote step >= 3x Ray actors", ("CartPole-v1:64",), REMOTE_STEP, "ray", 3.0),
    Target("remote step >= 0.8x ideal", ("LunarLander-v3:64",), REMOTE_STEP, IDEAL, 0.8),
    Target(
        "remote step >= 0.8x transport limit",
        ("CartPole-v1:1",),
        REMOTE_STEP,
        "transport-limit",
        0.8,
    ),
    Target("WebSocket within 20% of TCP", (), ("aps-ws",), "aps-tcp", 0.8),
    # The strictest bare ceiling (issue 45): the await loop against a learner on asyncio.Protocol.
    Target(
        "await loop >= 0.85x Protocol ceiling",
        ("CartPole-v1:1",),
        ("aps-tcp-async",),
        "bare-protocol",
        0.85,
    ),
    Target(
        "await loop >= 0.9x Protocol ceiling",
        ("CartPole-v1:64",),
        ("aps-tcp-async",),
        "bare-protocol",
        0.9,
    ),
    Target(
        "DETACH >= 0.8x ideal", ("CartPole-v1:64", "LunarLander-v3:64"), ("aps-detach",), IDEAL, 0.8
    ),
)

Results = dict[Column, dict[str, Series]]


def ideal(series: dict[str, Series], workers: int) -> Series | None:
    """Per round, ``min(workers x env-limit, transport-limit)``; None without both."""
    return _derive(series, lambda env, wire: min(workers * env, wire))


def lockstep_bound(series: dict[str, Series], workers: int) -> Series | None:
    """Per round, ``1 / (1 / transport-limit + 1 / (workers x env-limit))``; None without both."""
    return _derive(series, lambda env, wire: 1 / (1 / wire + 1 / (workers * env)))


def detach_bound(series: dict[str, Series], workers: int) -> Series | None:
    """Per round, ``workers x act-limit``; None without it."""
    act = series.get("act-limit")
    if act is None or not act.rates:
        return None
    out = Series()
    out.rates = [workers * rate for rate in act.rates]
    out.rounds = list(act.rounds)
    return out


def _derive(series: dict[str, Series], rate: Callable[[float, float], float]) -> Series | None:
    """Per round, ``rate(env-limit, transport-limit)`` of that round's windows."""
    env, wire = series.get("env-limit"), series.get("transport-limit")
    if env is None or wire is None:
        return None
    wire_by_round = dict(zip(wire.rounds, wire.rates, strict=True))
    out = Series()
    for round_, env_rate in zip(env.rounds, env.rates, strict=True):
        if round_ in wire_by_round:
            out.rates.append(rate(env_rate, wire_by_round[round_]))
            out.rounds.append(round_)
    return out if out.rates else None


def _cell(s: Series | None) -> str:
    if s is None:
        return ""
    if s.skipped:
        return "skipped"
    if not s.rates:
        return "failed"
    mark = " †" if s.note else ""
    return f"{s.median:,.0f}{mark} ({min(s.rates):,.0f}-{max(s.rates):,.0f})"


def render_table(results: Results, workers: int) -> str:
    """Rows = contenders, columns = env x size; env-steps/s median (min-max)."""
    columns = list(results)
    head = "| | " + " | ".join(c.label(workers) for c in columns) + " |"
    lines = [head, "|---|" + "---:|" * len(columns)]
    for name, label in ROWS.items():
        cells = [_cell(results[c].get(name)) for c in columns]
        if any(cells):
            lines.append(f"| {label.format(w=workers)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_cpu_table(results: Results, workers: int) -> str:
    """CPU µs per env-step, all processes (learner + workers), median over the rounds."""
    columns = list(results)
    lines = ["| CPU µs/env-step | " + " | ".join(c.label(workers) for c in columns) + " |"]
    lines.append("|---|" + "---:|" * len(columns))
    for name in ROWS:
        if name in (IDEAL, LOCKSTEP_BOUND, DETACH_BOUND):
            continue  # derived from other rows' rates; it used no CPU of its own
        cells = []
        for c in columns:
            s = results[c].get(name)
            cells.append(f"{statistics.median(s.cpu_us):.1f}" if s and s.cpu_us else "-")
        if any(results[c].get(name) is not None for c in columns):
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render_notes(results: Results, workers: int) -> list[str]:
    """Footnotes: what ran instead of the column's env, what was skipped or failed, and why."""
    lines = []
    for column, series in results.items():
        for name, s in series.items():
            if s.note:
                lines.append(f"† {name}, {column.label(workers)}: {s.note}")
            elif s.skipped:
                lines.append(f"{name}, {column.label(workers)}: skipped: {s.skipped}")
            elif s.error:
                lines.append(f"{name}, {column.label(workers)}: failed: {s.error}")
    return lines


def check_targets(results: Results, workers: int) -> list[dict[str, Any]]:
    """Every target in every column it names: its ratio and whether it held."""
    out = []
    for target in TARGETS:
        for column, series in results.items():
            if target.keys and column.key not in target.keys:
                continue
            for top in target.tops:
                r = ratio(series, top, target.bottom)
                if r is None:
                    verdict = "not measured"
                else:
                    verdict = "holds" if r["median"] >= target.factor else "does NOT hold"
                out.append(
                    {
                        "target": target.what,
                        "column": column.label(workers),
                        "contender": top,
                        "against": target.bottom,
                        "factor": target.factor,
                        "ratio": r,
                        "verdict": verdict,
                    }
                )
    return out


# Lockstep contenders, compared with what lockstep allows on this machine.
LOCKSTEP_PEERS = ("gym-async", "zmq-json", "ray", *LOCKSTEP, "aps-ws", "aps-unix")


def bound_shares(results: Results, workers: int) -> list[dict[str, Any]]:
    """Each contender's share of the bound for its mode, per column (not a target)."""
    pairs = [(name, LOCKSTEP_BOUND) for name in LOCKSTEP_PEERS]
    pairs += [(name, "step-limit") for name in LOCKSTEP_PEERS]
    pairs += [(name, "bare-ceiling") for name in LOCKSTEP_PEERS]
    pairs += [(name, "bare-protocol") for name in LOCKSTEP_PEERS]
    # Not lockstep: partial batches overlap the learner's work with the workers' stepping,
    # so they may pass the lockstep bound; how far they do is the point of the mode.
    pairs.append(("aps-partial", LOCKSTEP_BOUND))
    pairs.append(("aps-detach", DETACH_BOUND))
    pairs.append(("aps-detach", "stream-limit"))
    out = []
    for column, series in results.items():
        for name, bound in pairs:
            r = ratio(series, name, bound)
            if r is not None:
                out.append(
                    {"column": column.label(workers), "contender": name, "bound": bound, "ratio": r}
                )
    return out


def render_targets(checks: list[dict[str, Any]]) -> list[str]:
    return [
        f"{c['column']}: {c['target']} ({c['contender']} / {c['against']} >= {c['factor']:g}): "
        f"{c['verdict']}" + (f", {fmt_ratio(c['ratio'])}" if c["ratio"] else "")
        for c in checks
    ]


def parse_columns(text: str) -> list[Column]:
    columns = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        env_id, _, size = part.rpartition(":")
        if not env_id or not size.isdigit() or int(size) < 1:
            raise argparse.ArgumentTypeError(
                f"a column is ENV_ID:ENVS_PER_WORKER with ENVS_PER_WORKER >= 1, got {part!r}"
            )
        columns.append(Column(env_id, int(size)))
    if not columns:
        raise argparse.ArgumentTypeError(f"no columns in {text!r}")
    return columns


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    default_columns = ",".join(c.key for c in COLUMNS)
    p.add_argument(
        "--columns",
        type=parse_columns,
        default=list(COLUMNS),
        help=f"ENV_ID:ENVS_PER_WORKER,... (default {default_columns})",
    )
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument(
        "--contenders",
        type=name_list(ALL),
        default=[name for name in ROWS if name in ALL],
        help=f"comma-separated subset of {','.join(ALL)} (default: all available)",
    )
    p.add_argument("--seconds", type=float, default=None, help="timed window (default 3; quick 1)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up (default 0.5; quick 0.2)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (default 3; quick 2)")
    p.add_argument(
        "--detach-chunk",
        type=int,
        default=ApsDetach.chunk_env_steps,
        help="env-steps per DETACH chunk and worker: T = ceil(this / envs per worker) "
        "(default %(default)s)",
    )
    p.add_argument("--quick", action="store_true", help="1 s windows, 2 rounds")
    p.add_argument(
        "--no-uvloop", action="store_true", help="run aps on asyncio's own loop (APS_UVLOOP=0)"
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.workers < 1 or args.detach_chunk < 1:
        raise SystemExit(
            f"--workers and --detach-chunk must be >= 1, got {args.workers} and {args.detach_chunk}"
        )
    if args.no_uvloop:
        os.environ["APS_UVLOOP"] = "0"  # read by aps in this process and in its workers
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 3.0)
    warmup = args.warmup if args.warmup is not None else (0.2 if args.quick else 0.5)
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 3)
    ApsDetach.chunk_env_steps = args.detach_chunk

    names, skipped = available(args.contenders, ALL)

    print(
        f"{len(args.columns)} columns x {len(names)} contenders, {args.workers} workers; "
        f"{seconds:g} s windows, {repeats} interleaved rounds; {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    load_at_start = list(os.getloadavg())
    results: Results = {}
    try:
        for column in args.columns:
            print(f"{column.label(args.workers)} ({column.env_id}):", flush=True)
            setup = Setup(column.env_id, args.workers, column.envs_per_worker)
            series = measure_size(
                names, setup, seconds=seconds, warmup=warmup, repeats=repeats, registry=ALL
            )
            derivations = (
                (IDEAL, ideal),
                (LOCKSTEP_BOUND, lockstep_bound),
                (DETACH_BOUND, detach_bound),
            )
            for key, derive in derivations:
                derived = derive(series, args.workers)
                if derived is not None:
                    series[key] = derived
            results[column] = series
    finally:
        stop_ray()

    checks = check_targets(results, args.workers)
    print()
    print(f"env-steps/s delivered to the learner, {args.workers} workers x E envs each")
    print("(median of the rounds, min-max in brackets)")
    print()
    print(render_table(results, args.workers))
    for line in render_notes(results, args.workers):
        print(line)
    print()
    print(render_cpu_table(results, args.workers))
    print()
    print("Targets (ratio of medians, range of the per-round ratios):")
    for line in render_targets(checks):
        print(f"  {line}")
    shares = bound_shares(results, args.workers)
    if shares:
        print()
        print("Share of the bound for each mode (not a target):")
        for share in shares:
            print(
                f"  {share['column']}: {share['contender']} / {share['bound']} "
                f"{fmt_ratio(share['ratio'])}"
            )

    report = {
        "benchmark": "matrix",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "load_average_at_start": load_at_start,
            **machine(distributions=("envpool", "torch")),
        },
        "settings": {
            "columns": [c.key for c in args.columns],
            "workers": args.workers,
            "seconds": seconds,
            "warmup": warmup,
            "repeats": repeats,
            "action_pool": POOL_SIZE,
            "detach_chunk_env_steps": ApsDetach.chunk_env_steps,
            "detach_steps_per_chunk": {
                c.key: ApsDetach.steps_per_chunk(c.envs_per_worker) for c in args.columns
            },
            "detach_max_in_flight": ApsDetach.max_in_flight,
        },
        "contenders": {name: ALL[name].description for name in names},
        "skipped": skipped,
        "results": {
            column.key: {name: s.as_json() for name, s in series.items()}
            for column, series in results.items()
        },
        "targets": checks,
        "bound_shares": shares,
    }
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
