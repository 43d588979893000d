"""Does DETACH + APS learn Atari, and what does it save? Seeds of examples/ppo_atari.py.

Runs ``examples/ppo_atari.py --mode detach`` once per seed and sync strategy (APS and
always-sync by default), several at a time, and measures a random policy on the same env
with the same preprocessing. It reports, per strategy, the final mean return (the last 20
episodes of each run) with its 95% percentile-bootstrap interval over the seeds, each
seed's return and env-steps, and the weight bytes sent; then the learning check's three
questions, each answered from those figures:

- does every APS seed end above the random policy's interval (it learns)?
- are APS's weight bytes at most 0.2x always-sync's (the saving)?
- is APS's mean return inside always-sync's interval (at no cost in return)?

Each run writes its JSON after every iteration, so a run cut short by ``--max-seconds``
still leaves its curve (its ``complete`` is false, and the table says so).

    python benchmarks/atari_learning.py --env-id Breakout-v5 --backend ale \\
        --seeds 1,2,3 --total-timesteps 1000000 --parallel 6
    python benchmarks/atari_learning.py --replot     # the summary again, from saved runs

Extra arguments after ``--`` go to every run (``-- --cuda``, ``-- --kl-threshold 0.1``).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import platform
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from cluster import format_interval, mean_interval

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "ppo_atari.py"
RESULTS = REPO / "benchmarks" / "results"
# What the summary keeps of each run (the curves are kept beside it, whole).
SEED_KEYS = (
    "seed", "final_return", "global_step", "complete", "seconds", "sps", "syncs", "versions",
    "weight_bytes", "lag_mean",
)  # fmt: skip
# What the runs themselves say they were; the rest of the setup is in the command.
CONFIG_KEYS = (
    "env_id", "backend", "workers", "envs_per_worker", "total_timesteps", "kl_threshold",
    "device",
)  # fmt: skip


def random_returns(env_id: str, backend: str, episodes: int, seed: int) -> list[float]:
    """Game returns of uniformly random actions, over ``episodes`` whole episodes.

    The env is built as the workers build it (EnvPool's id, or ALE's through
    :func:`aps.vector.atari_env`), 8 at a time, the actions drawn from a seeded generator.
    """
    num_envs = 8
    if backend == "envpool":
        import envpool

        envs: Any = envpool.make(env_id, env_type="gymnasium", num_envs=num_envs, seed=seed)
    else:
        import gymnasium as gym

        from aps.vector import atari_env

        ale_id = env_id if "/" in env_id else f"ALE/{env_id}"
        envs = gym.vector.SyncVectorEnv(
            [lambda: atari_env(ale_id)] * num_envs,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
        )
    rng = np.random.default_rng(seed)
    envs.reset(seed=seed)
    totals = np.zeros(num_envs)
    # EnvPool autoresets in the step after an episode's end: that step is not the game's.
    skip = np.zeros(num_envs, dtype=bool)
    returns: list[float] = []
    n_actions = int(envs.single_action_space.n)
    while len(returns) < episodes:
        _, reward, terminated, truncated, _ = envs.step(rng.integers(n_actions, size=num_envs))
        totals += np.where(skip, 0.0, reward)
        ended = (terminated | truncated) & ~skip
        returns.extend(float(r) for r in totals[ended])
        totals[ended] = 0.0
        skip = ended if backend == "envpool" else np.zeros(num_envs, dtype=bool)
    envs.close()
    return returns[:episodes]


def run_one(args: argparse.Namespace, sync: str, seed: int, extra: Sequence[str]) -> Path:
    """One ``ppo_atari.py`` run; its JSON path (written whatever the run's exit status)."""
    out = args.out / f"{args.env_id}-{sync}-{seed}.json"
    command = [
        sys.executable,
        str(EXAMPLE),
        "--mode", "detach",
        "--backend", args.backend,
        "--env-id", args.env_id,
        "--sync", sync,
        "--seed", str(seed),
        "--workers", str(args.workers),
        "--envs-per-worker", str(args.envs_per_worker),
        "--total-timesteps", str(args.total_timesteps),
        "--json", str(out),
    ]  # fmt: skip
    if args.max_seconds is not None:
        command += ["--max-seconds", str(args.max_seconds)]
    command += list(extra)
    with (args.out / f"{args.env_id}-{sync}-{seed}.log").open("w") as log:
        proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=args.out)
    if proc.returncode != 0:
        print(f"{sync} seed {seed} exited {proc.returncode}; see its log", flush=True)
    return out


def return_at(curve: Sequence[dict[str, Any]], step: int) -> float | None:
    """The mean return of the last iteration that ended by env-step ``step``, or None."""
    value = None
    for row in curve:
        if row["step"] <= step and row["return"] is not None:
            value = float(row["return"])
    return value


def summarize(runs: Sequence[dict[str, Any]], random: Sequence[float]) -> dict[str, Any]:
    """Per strategy: the interval of final returns, the seeds, the bytes; and the verdicts.

    Runs cut short by time end at different env-steps, so the return is also given at the
    fewest env-steps any run reached (``common_step``), read off each run's curve.
    """
    by_sync: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: (r["sync"], r["seed"])):
        by_sync.setdefault(run["sync"], []).append(run)
    random_ci = mean_interval(list(random))
    common_step = min((r["global_step"] for r in runs), default=0)
    strategies = {}
    for sync, group in by_sync.items():
        strategies[sync] = {
            "return": mean_interval([r["final_return"] for r in group]),
            "return_at_common_step": mean_interval(
                [return_at(r["curve"], common_step) for r in group]
            ),
            "weight_bytes": mean_interval([float(r["weight_bytes"]) for r in group]),
            "seeds": [{key: r.get(key) for key in SEED_KEYS} for r in group],
        }
    verdicts: dict[str, bool | None] = {"learns": None, "bytes": None, "return": None}
    aps_s, always = strategies.get("aps"), strategies.get("always")
    if aps_s is not None and random_ci["high"] is not None:
        finals = [s["final_return"] for s in aps_s["seeds"]]
        verdicts["learns"] = all(f is not None and f > random_ci["high"] for f in finals)
    if aps_s is not None and always is not None:
        always_bytes = always["weight_bytes"]["mean"]
        if always_bytes:
            verdicts["bytes"] = aps_s["weight_bytes"]["mean"] <= 0.2 * always_bytes
        low, high, mean = always["return"]["low"], always["return"]["high"], aps_s["return"]["mean"]
        if None not in (low, high, mean):
            verdicts["return"] = low <= mean <= high
    ratio = None
    if aps_s is not None and always is not None and always["weight_bytes"]["mean"]:
        ratio = aps_s["weight_bytes"]["mean"] / always["weight_bytes"]["mean"]
    return {
        "random": {**random_ci, "episodes": len(random)},
        "common_step": common_step,
        "strategies": strategies,
        "weight_bytes_ratio": ratio,
        "verdicts": verdicts,
    }


def table(report: dict[str, Any]) -> str:
    """The summary as markdown: one row per strategy, then the verdicts."""
    summary = report["summary"]

    def ci(x: dict[str, Any], fmt: str = ".1f", scale: float = 1.0) -> str:
        return format_interval(x, fmt, scale)

    lines = [
        "| policy | final return, mean (95% CI) | per seed: return @ env-steps "
        f"| return at {summary['common_step']:,} env-steps | weights sent, MB |",
        "|---|---:|---|---:|---:|",
        f"| random | {ci(summary['random'])} over {summary['random']['episodes']} episodes | | | |",
    ]
    for sync, s in summary["strategies"].items():
        seeds = ", ".join(
            f"{'n/a' if x['final_return'] is None else format(x['final_return'], '.1f')} @ "
            f"{x['global_step']:,}{'' if x['complete'] else ' (cut short)'}"
            for x in s["seeds"]
        )
        lines.append(
            f"| {sync} | {ci(s['return'])} | {seeds} | {ci(s['return_at_common_step'])} "
            f"| {ci(s['weight_bytes'], '.0f', 1e6)} |"
        )
    v, ratio = summary["verdicts"], summary["weight_bytes_ratio"]
    word = {True: "yes", False: "no", None: "not measured"}
    lines += [
        "",
        f"- every APS seed above the random policy's interval: {word[v['learns']]}",
        f"- APS's weight bytes / always-sync's: "
        f"{'n/a' if ratio is None else f'{ratio:.2f}x'} (goal <= 0.2x): {word[v['bytes']]}",
        f"- APS's mean return inside always-sync's interval: {word[v['return']]}",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Each run's mean return against env-steps, one colour per strategy; the random band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours: dict[str, str] = {}
    for name, curve in report["curves"].items():
        sync = name.rsplit("-", 1)[0]
        colour = colours.setdefault(sync, f"C{len(colours)}")
        points = [(row["step"], row["return"]) for row in curve if row["return"] is not None]
        if points:
            steps, returns = zip(*points, strict=True)
            ax.plot(steps, returns, color=colour, label=sync if name.endswith("-1") else None)
    random = report["summary"]["random"]
    if random["mean"] is not None:
        ax.axhspan(random["low"], random["high"], color="grey", alpha=0.3, label="random")
    ax.set_xlabel("env-steps")
    ax.set_ylabel("mean return, last 20 episodes")
    ax.set_title(f"{', '.join(report['config']['env_id'])}: DETACH PPO, one line per seed")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--env-id", default="Breakout-v5")
    p.add_argument("--backend", default="ale", choices=("ale", "envpool"))
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--syncs", default="aps,always")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--envs-per-worker", type=int, default=8)
    p.add_argument("--total-timesteps", type=int, default=1_000_000)
    p.add_argument("--max-seconds", type=float, default=None, help="per run (see the example)")
    p.add_argument("--parallel", type=int, default=1, help="runs at a time")
    p.add_argument("--random-episodes", type=int, default=30)
    p.add_argument("--out", type=Path, default=Path("runs/atari-learning"), help="runs' JSON")
    p.add_argument("--json", type=Path, default=RESULTS / "atari-learning.json")
    p.add_argument("--replot", action="store_true", help="summarize the saved runs only")
    args = p.parse_args(argv)
    args.out = args.out.resolve()
    return args, extra


def main(argv: Sequence[str] | None = None) -> int:
    args, extra = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    syncs = args.syncs.split(",")
    jobs = [(sync, seed) for seed in seeds for sync in syncs]
    if not args.replot:
        run = {
            "command": "python benchmarks/atari_learning.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "random": random_returns(args.env_id, args.backend, args.random_episodes, seed=0),
        }
        (args.out / "run.json").write_text(json.dumps(run) + "\n")
        with concurrent.futures.ThreadPoolExecutor(max_workers=args.parallel) as pool:
            list(pool.map(lambda job: run_one(args, *job, extra), jobs))
    if not (args.out / "run.json").exists():
        raise SystemExit(f"no runs under {args.out}: run without --replot, or pass their --out")
    run = json.loads((args.out / "run.json").read_text())
    paths = [args.out / f"{args.env_id}-{sync}-{seed}.json" for sync, seed in jobs]
    runs = [json.loads(p.read_text()) for p in paths if p.exists()]
    missing = [p.name for p in paths if not p.exists()]
    report = {
        "benchmark": "atari_learning",
        "command": run["command"],
        "date": run["date"],
        "machine": run["machine"],
        "config": {key: sorted({str(r.get(key)) for r in runs}) for key in CONFIG_KEYS},
        "missing": missing,
        "summary": summarize(runs, run["random"]),
        "curves": {f"{r['sync']}-{r['seed']}": r["curve"] for r in runs},
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(report, indent=1) + "\n")
    plot(report, args.json.with_suffix(".png"))
    print(table(report))
    if missing:
        print(f"missing runs: {', '.join(missing)}")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
