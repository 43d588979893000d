"""Rennala, Malenia and synchronized NIGT in the paper's time model on MuJoCo (aps.pg.simulate).

    python -m experiments.nigt                 # every scenario, 3 seeds (resumes finished runs)
    python -m experiments.nigt --quick         # a smoke run, a minute
    python -m experiments.nigt --replot        # the figures and summary from the saved runs

Worker i (i = 1..n) needs ``h_i`` virtual time units per env step, so ``horizon * h_i`` per
trajectory gradient (Reacher's episodes all last 50 steps), and ``kappa_i`` per aggregation
of its sum. Scenarios, as in the paper's section 6 (n = 10):

- ``equal``: h_i = 1, kappa_i = 0;
- ``sqrt``: h_i = sqrt(i), kappa_i = sqrt(i);
- ``comm``: h_i = sqrt(i), kappa_i = sqrt(i) * d^(1/4) (d = the policy's parameter count).

Each run stops at the same virtual-time budget. Every finished run is saved to
``<out>/runs/<env>_<scenario>_<method>_s<seed>.csv`` and skipped on the next call, so an
interrupted call resumes. Then ``<out>/nigt_sim_<env>.csv`` (all rounds of all runs),
``<out>/nigt_sim_<env>.png`` (reward against virtual time, median and (20%, 80%) band over
seeds) and the time-to-reward ratios are written.
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from aps import pg
from aps.pg.simulate import simulate

METHODS = ("rennala", "malenia", "synchronous")
SCENARIOS = ("equal", "sqrt", "comm")


class Agent(nn.Module):
    """The paper's shape of policy: a 2-layer tanh MLP (64) for the mean, a learned log-std.

    The log-std is state-independent, and aps's Gaussian head clips actions to the bounds
    rather than squashing them with tanh.
    """

    def __init__(self, observation_space: Any, action_space: Any) -> None:
        super().__init__()
        size = int(np.prod(observation_space.shape))
        actions = int(np.prod(action_space.shape))
        self.actor_mean = nn.Sequential(
            nn.Linear(size, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, actions)
        )
        with torch.no_grad():
            self.actor_mean[-1].weight.mul_(0.01)
        self.actor_logstd = nn.Parameter(torch.full((1, actions), -0.5))


def times(scenario: str, n: int, horizon: int, d: int) -> tuple[list[float], list[float]]:
    """Per-worker virtual times per gradient (h) and per aggregation (kappa)."""
    if scenario == "equal":
        return [float(horizon)] * n, [0.0] * n
    h = [horizon * math.sqrt(i) for i in range(1, n + 1)]
    kappa = [math.sqrt(i) for i in range(1, n + 1)]
    if scenario == "comm":
        kappa = [k * d**0.25 for k in kappa]
    return h, kappa


def rule(method: str, batch: int) -> Any:
    """The aggregation rule of a method."""
    if method == "rennala":
        return pg.Rennala(batch=batch)
    if method == "malenia":
        return pg.Malenia(batch=batch)
    return pg.Synchronous()


def one_run(
    args: argparse.Namespace, scenario: str, method: str, seed: int
) -> list[dict[str, Any]]:
    """One simulated training run: a row per round."""
    torch.manual_seed(seed)
    probe = gym.make(args.env)
    agent = Agent(probe.observation_space, probe.action_space)
    d = sum(p.numel() for p in agent.parameters())
    h, kappa = times(scenario, args.workers, args.horizon, d)
    rows = []
    for r in simulate(
        agent,
        lambda: gym.make(args.env),
        h=h,
        kappa=kappa,
        aggregator=rule(method, args.batch),
        lr=args.lr,
        momentum=args.momentum,
        horizon=args.horizon,
        gamma=args.gamma,
        time_budget=args.budget,
        envs_per_worker=args.envs_per_worker,
        seed=seed,
    ):
        rows.append(
            {
                "env": args.env,
                "scenario": scenario,
                "method": method,
                "seed": seed,
                "iteration": r.iteration,
                "time": r.time,
                "compute": r.compute,
                "communication": r.communication,
                "used": r.used,
                "mean_return": r.mean_return,
            }
        )
    return rows


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as CSV, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)  # a run is saved whole or not at all: resuming never sees half a run


def read(path: Path) -> list[dict[str, Any]]:
    """Read rows of a CSV."""
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def curve(rows: list[dict[str, Any]], grid: np.ndarray, smooth: int = 5) -> np.ndarray:
    """The run's reward (running mean of ``smooth`` rounds) at each grid time (step function)."""
    t = np.array([float(r["time"]) for r in rows])
    y = np.array([float(r["mean_return"]) for r in rows])
    y = np.convolve(y, np.ones(smooth) / smooth, mode="full")[: len(y)] * smooth
    y /= np.minimum(np.arange(1, len(y) + 1), smooth)
    index = np.searchsorted(t, grid, side="right") - 1
    return np.where(index >= 0, y[np.clip(index, 0, None)], np.nan)


def time_to(rows: list[dict[str, Any]], target: float, smooth: int = 5) -> float:
    """The first virtual time at which the smoothed reward reaches ``target`` (inf: never)."""
    grid = np.array([float(r["time"]) for r in rows])
    values = curve(rows, grid, smooth)
    hit = np.flatnonzero(values >= target)
    return float(grid[hit[0]]) if hit.size else math.inf


def summarize(
    args: argparse.Namespace, runs: dict[tuple[str, str, int], list[dict[str, Any]]]
) -> None:
    """Write the combined CSV, the time-to-reward ratios and the figure."""
    out = Path(args.out)
    everything = [row for rows in runs.values() for row in rows]
    write(out / f"nigt_sim_{args.env.split('-')[0].lower()}.csv", everything)
    grid = np.linspace(0, args.budget, 200)
    lines = []
    for scenario in SCENARIOS:
        finals = []
        for method in METHODS:
            for seed in args.seeds:
                if (scenario, method, seed) in runs:
                    finals.append(curve(runs[scenario, method, seed], grid)[-1])
        if not finals:
            continue
        first = [float(rows[0]["mean_return"]) for (s, _, _), rows in runs.items() if s == scenario]
        # The target: 80% of the way from the initial reward to the median final reward.
        target = float(np.median(first) + 0.8 * (np.median(finals) - np.median(first)))
        for method in ("malenia", "synchronous"):
            ratios = []
            for seed in args.seeds:
                if (scenario, "rennala", seed) in runs and (scenario, method, seed) in runs:
                    a = time_to(runs[scenario, "rennala", seed], target)
                    b = time_to(runs[scenario, method, seed], target)
                    ratios.append(
                        a / b if math.isfinite(b) else (0.0 if math.isfinite(a) else math.nan)
                    )
            q = np.nanquantile(ratios, [0.2, 0.5, 0.8]) if ratios else [math.nan] * 3
            lines.append(
                f"{args.env} {scenario}: time to reward {target:.1f}, Rennala / {method}: "
                f"median {q[1]:.2f} (20%: {q[0]:.2f}, 80%: {q[2]:.2f}) over {len(ratios)} seeds"
            )
    text = "\n".join(lines)
    print(text)
    (out / f"nigt_sim_{args.env.split('-')[0].lower()}.txt").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure")
        return
    fig, axes = plt.subplots(1, len(SCENARIOS), figsize=(5 * len(SCENARIOS), 3.6), sharey=True)
    for ax, scenario in zip(axes, SCENARIOS, strict=True):
        for method in METHODS:
            curves = [curve(runs[k], grid) for k in runs if k[0] == scenario and k[1] == method]
            if not curves:
                continue
            stack = np.stack(curves)
            low, mid, high = np.nanquantile(stack, [0.2, 0.5, 0.8], axis=0)
            ax.plot(grid, mid, label=method)
            ax.fill_between(grid, low, high, alpha=0.2)
        ax.set_title(f"{args.env}, n={args.workers}, {scenario}")
        ax.set_xlabel("virtual time")
    axes[0].set_ylabel("episode return (5-round mean)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / f"nigt_sim_{args.env.split('-')[0].lower()}.png", dpi=120)


def main() -> None:
    """Run what is missing, then summarize."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="Reacher-v5")
    parser.add_argument("--workers", type=int, default=10)
    parser.add_argument("--batch", type=int, default=20, help="M = M_init (Rennala, Malenia)")
    parser.add_argument("--lr", type=float, default=2**-5)
    parser.add_argument("--momentum", type=float, default=0.1)
    parser.add_argument("--horizon", type=int, default=50)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--budget", type=float, default=40_000.0, help="virtual time per run")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument(
        "--envs-per-worker", type=int, default=1, help="vectorized sampling (see simulate)"
    )
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replot", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.budget, args.seeds = 2_000.0, [0]
    from tqdm import tqdm

    runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    todo = [(s, m, seed) for s in SCENARIOS for m in METHODS for seed in args.seeds]
    tag = f"{args.env}_n{args.workers}_b{args.budget:g}_e{args.envs_per_worker}"
    for scenario, method, seed in tqdm(todo, desc="runs"):
        path = Path(args.out) / "runs" / f"{tag}_{scenario}_{method}_s{seed}.csv"
        if path.exists():
            runs[scenario, method, seed] = read(path)
        elif not args.replot:
            rows = one_run(args, scenario, method, seed)
            write(path, rows)
            runs[scenario, method, seed] = read(path)
    summarize(args, runs)


if __name__ == "__main__":
    main()
