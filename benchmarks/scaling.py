"""Scaling: throughput against envs per worker and against workers, and the learner's cost per step.

Two sweeps on CartPole-v1, each point measured as ``throughput.py`` measures (contenders
started and warmed up, timed windows round-robin, ``--repeats`` rounds):

- envs per worker in 1, 4, 16, 64, 256 at 2 workers;
- workers in 1, 2, 4, 8 at 16 envs per worker.

Contenders: ``aps-tcp`` (the ``ClusterEnv`` facade) and, as the reference, ``gym-async``
(Gymnasium ``AsyncVectorEnv``, one process per worker). Besides env-steps/s, every window
gives the learner's overhead per step: the CPU time (user + system, all threads) of the
learner process, which is this one, divided by the batched steps. One batched step sends one
message to each worker, so this cost should not grow with the envs per worker; the plot
shows whether it does.

Writes ``results/scaling.json`` and two figures, ``results/scaling_envs.png`` and
``results/scaling_workers.png``. Nothing asserts on timings.

Usage::

    python benchmarks/scaling.py             # 3 s windows, 3 rounds
    python benchmarks/scaling.py --quick     # 0.5 s windows, 1 round
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contenders import ALL
from throughput import (
    POOL_SIZE,
    Series,
    Setup,
    available,
    machine,
    measure_size,
    name_list,
    stop_ray,
    write_json,
)

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
ENVS = (1, 4, 16, 64, 256)
WORKERS = (1, 2, 4, 8)
CONTENDERS = ("aps-tcp", "gym-async")

Sweep = dict[int, dict[str, Series]]  # x (envs per worker or workers) -> contender -> series


def run_sweep(
    names: Sequence[str],
    setups: dict[int, Setup],
    *,
    seconds: float,
    warmup: float,
    repeats: int,
) -> Sweep:
    """Measure every setup (keyed by its x value) with every contender."""
    out: Sweep = {}
    for x, setup in setups.items():
        print(
            f"{setup.env_id}, {setup.num_workers} workers x {setup.envs_per_worker} envs:",
            flush=True,
        )
        out[x] = measure_size(
            names, setup, seconds=seconds, warmup=warmup, repeats=repeats, registry=ALL
        )
    return out


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def render(sweep: Sweep, names: Sequence[str], x_label: str) -> str:
    """A Markdown table: env-steps/s and learner CPU µs per step, per x and contender."""
    lines = [
        f"| {x_label} | contender | env-steps/s (median) | min-max | learner CPU µs/step |",
        "|---:|---|---:|---:|---:|",
    ]
    for x, series in sweep.items():
        for name in names:
            s = series.get(name)
            if s is None or not s.rates:
                why = "skipped" if s is not None and s.skipped else "failed"
                lines.append(f"| {x} | {name} | {why} | - | - |")
                continue
            learner = _median(s.learner_us)
            lines.append(
                f"| {x} | {name} | {s.median:,.0f} | {min(s.rates):,.0f}-{max(s.rates):,.0f} "
                f"| {learner:,.1f} |"
            )
    return "\n".join(lines)


def flatness(sweep: Sweep, names: Sequence[str]) -> list[str]:
    """How much the learner's CPU per step grew from the smallest x to the largest."""
    lines = []
    xs = sorted(sweep)
    for name in names:
        first = _median(sweep[xs[0]][name].learner_us) if name in sweep[xs[0]] else None
        last = _median(sweep[xs[-1]][name].learner_us) if name in sweep[xs[-1]] else None
        if first is None or last is None:
            continue
        lines.append(
            f"{name}: learner CPU per step {first:,.1f} µs at {xs[0]} envs/worker, "
            f"{last:,.1f} µs at {xs[-1]} ({last / first:.2f}x for {xs[-1] // xs[0]}x the envs)"
        )
    return lines


def plot(sweep: Sweep, names: Sequence[str], *, x_label: str, title: str, path: Path) -> None:
    """Two panels against x: env-steps/s, and the learner's CPU µs per step (median, min-max)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    xs = sorted(sweep)
    figure, (rate_axes, cpu_axes) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in names:
        for axes, field in ((rate_axes, "rates"), (cpu_axes, "learner_us")):
            points = [(x, getattr(sweep[x][name], field)) for x in xs if name in sweep[x]]
            points = [(x, v) for x, v in points if v]
            if not points:
                continue
            px = [x for x, _ in points]
            mid = [statistics.median(v) for _, v in points]
            low = [m - min(v) for m, (_, v) in zip(mid, points, strict=True)]
            high = [max(v) - m for m, (_, v) in zip(mid, points, strict=True)]
            axes.errorbar(px, mid, yerr=[low, high], marker="o", capsize=3, label=name)
    for axes in (rate_axes, cpu_axes):
        axes.set_xscale("log", base=2)
        axes.set_xticks(xs, [str(x) for x in xs])
        axes.set_xlabel(x_label)
        axes.grid(True, alpha=0.3)
        axes.legend()
    rate_axes.set_yscale("log")
    rate_axes.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    rate_axes.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:,.0f}"))
    rate_axes.yaxis.set_minor_formatter(NullFormatter())
    rate_axes.set_ylabel("env-steps/s delivered to the learner")
    rate_axes.set_title("throughput (median, min-max)")
    cpu_axes.set_ylabel("learner-process CPU µs per batched step")
    cpu_axes.set_title("learner overhead per step")
    cpu_axes.set_ylim(bottom=0)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


def parse_ints(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return sorted(set(values))


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--env", default="CartPole-v1", help="Gymnasium id (default %(default)s)")
    p.add_argument(
        "--envs", type=parse_ints, default=list(ENVS), help="envs per worker (1,4,16,64,256)"
    )
    p.add_argument("--envs-workers", type=int, default=2, help="workers in the envs sweep (2)")
    p.add_argument(
        "--workers", type=parse_ints, default=list(WORKERS), help="worker counts (1,2,4,8)"
    )
    p.add_argument(
        "--workers-envs", type=int, default=16, help="envs per worker in the workers sweep (16)"
    )
    p.add_argument(
        "--contenders",
        type=name_list(ALL),
        default=list(CONTENDERS),
        help=f"comma-separated subset of {','.join(ALL)} (default {','.join(CONTENDERS)})",
    )
    p.add_argument("--seconds", type=float, default=None, help="timed window (3; quick 0.5)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up (0.5; quick 0.2)")
    p.add_argument("--repeats", type=int, default=None, help="rounds (3; quick 1)")
    p.add_argument("--quick", action="store_true", help="0.5 s windows, 1 round")
    p.add_argument("--out", type=Path, default=RESULTS, help="folder for the JSON and the PNGs")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.envs_workers < 1 or args.workers_envs < 1:
        raise SystemExit(
            f"--envs-workers and --workers-envs must be >= 1, got {args.envs_workers} and "
            f"{args.workers_envs}"
        )
    seconds = args.seconds if args.seconds is not None else (0.5 if args.quick else 3.0)
    warmup = args.warmup if args.warmup is not None else (0.2 if args.quick else 0.5)
    repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    names, _ = available(args.contenders, ALL)

    print(
        f"{args.env}; {seconds:g} s windows, {repeats} rounds; {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    load_at_start = list(os.getloadavg())
    timing = {"seconds": seconds, "warmup": warmup, "repeats": repeats}
    try:
        by_envs = run_sweep(
            names,
            {e: Setup(args.env, args.envs_workers, e) for e in args.envs},
            seconds=seconds,
            warmup=warmup,
            repeats=repeats,
        )
        by_workers = run_sweep(
            names,
            {w: Setup(args.env, w, args.workers_envs) for w in args.workers},
            seconds=seconds,
            warmup=warmup,
            repeats=repeats,
        )
    finally:
        stop_ray()

    print()
    print(f"{args.env}, {args.envs_workers} workers, envs per worker varied:")
    print(render(by_envs, names, "envs/worker"))
    print()
    print(f"{args.env}, {args.workers_envs} envs per worker, workers varied:")
    print(render(by_workers, names, "workers"))
    print()
    flat = flatness(by_envs, names)
    for line in flat:
        print(line)

    out: Path = args.out
    figures = {
        "envs": out / "scaling_envs.png",
        "workers": out / "scaling_workers.png",
    }
    plot(
        by_envs,
        names,
        x_label="envs per worker",
        title=f"{args.env}, {args.envs_workers} workers",
        path=figures["envs"],
    )
    plot(
        by_workers,
        names,
        x_label="workers",
        title=f"{args.env}, {args.workers_envs} envs per worker",
        path=figures["workers"],
    )

    def as_json(sweep: Sweep) -> dict[str, Any]:
        return {str(x): {n: s.as_json() for n, s in series.items()} for x, series in sweep.items()}

    report = {
        "benchmark": "scaling",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"load_average_at_start": load_at_start, **machine()},
        "settings": {
            "env": args.env,
            "envs": args.envs,
            "envs_workers": args.envs_workers,
            "workers": args.workers,
            "workers_envs": args.workers_envs,
            "action_pool": POOL_SIZE,
            **timing,
        },
        "contenders": {name: ALL[name].description for name in names},
        "by_envs_per_worker": as_json(by_envs),
        "by_workers": as_json(by_workers),
        "learner_cpu_flatness": flat,
        "figures": {k: str(v.relative_to(out)) for k, v in figures.items()},
    }
    write_json(out / "scaling.json", report)
    print(f"wrote {figures['envs']}, {figures['workers']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
