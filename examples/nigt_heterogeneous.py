"""Rennala, Malenia and synchronized NIGT on Pendulum with heterogeneous workers, CleanRL style.

Every method trains the same Gaussian policy from the same initial point with the REINFORCE
estimator g_H, which the workers compute on their own envs at the point the learner
broadcast. Worker i (i = 1..n) sleeps ``sqrt(i) * delay_base`` seconds after each env step,
so worker 1 is the fastest and worker n the slowest (h_i = sqrt(i), as in the paper). Each
worker steps ``envs_per_worker`` envs in lockstep, so it delivers that many trajectory
gradients at once, every ``horizon * h_i`` seconds.

Methods (the aggregation rule of each NIGT round):

- ``rennala``: the first ``--batch`` gradients from whichever workers finish first;
- ``malenia``: at least one gradient from every worker and a harmonic mean of the per-worker
  counts of at least ``batch / n``; every worker weighs the same;
- ``synchronous``: at least one gradient from every worker (``envs_per_worker`` at once).

Workers sum their gradients locally and send only counts during a round; when the rule holds
over the counts, each worker's sum travels once (one aggregation per round), so a worker's
sum may hold more gradients than the rule needed (it kept sampling until asked).

Same total gradient budget: every run stops after the round in which its cumulative count of
*used* trajectory gradients reaches ``--budget``. A method with a smaller batch per round
therefore takes more rounds (iterations) for the same budget.

Settings:

- ``--setting speeds``: the same env on every worker, heterogeneous speeds. Checks whether
  Rennala reaches a given reward sooner (in wall time) than synchronized NIGT.
- ``--setting envs``: heterogeneous speeds AND environments. The fast half of the workers
  has a motor that adds a constant torque ``+offset`` to every action, the slow half one
  that adds ``-offset``; the best policies of the two differ (they must lean against
  opposite biases). The goal is the average objective over the workers' envs. Every few
  rounds the policy is saved, and after the run it is evaluated on each worker's env in this
  process (mean action, fixed reset seeds), which shows which objective each method
  optimized.

Pendulum's default gravity (10) is out of reach of plain REINFORCE in this budget; the
default ``--gravity 2`` keeps the task (swing up and hold) learnable within minutes. Rewards
are Pendulum's, summed over ``--horizon`` steps.

    python examples/nigt_heterogeneous.py                      # both settings, 3 seeds
    python examples/nigt_heterogeneous.py --setting speeds --seeds 0,1,2
    python examples/nigt_heterogeneous.py --quick --out quick   # a smoke run, seconds
    python examples/nigt_heterogeneous.py --replot             # figures from the saved CSVs

Writes ``<out>/nigt_<setting>.csv`` (one row per round, plus one row per run for the initial
policy, ``iteration == -1``) and ``<out>/nigt_<setting>.png`` (needs matplotlib), and
prints time-to-reward ratios. docs/results/README.md reports a run with the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import csv
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn

import aps
from aps import pg
from aps.launch import LocalWorkers

HERE = Path(__file__).resolve()
POLICY = f"{HERE}:Agent"  # the workers import the agent from this file
ENV = f"{HERE}:make_env"  # ... and the env factory
METHODS = ("rennala", "malenia", "synchronous")
LABELS = {"rennala": "Rennala NIGT", "malenia": "Malenia NIGT", "synchronous": "Synchronized NIGT"}
COLORS = {"rennala": "tab:blue", "malenia": "tab:orange", "synchronous": "tab:green"}


# -- the environment and the agent (imported by the workers) -------------------------------


class MotorOffset(gym.ActionWrapper):
    """A miscalibrated motor: adds a constant torque to every action, within the bounds."""

    def __init__(self, env: gym.Env[Any, Any], offset: float) -> None:
        super().__init__(env)
        self.offset = float(offset)

    def action(self, action: np.ndarray) -> np.ndarray:
        space = self.action_space
        assert isinstance(space, gym.spaces.Box)
        return np.clip(action + self.offset, space.low, space.high).astype(space.dtype)


def make_env(g: float = 2.0, offset: float = 0.0) -> gym.Env[Any, Any]:
    """Pendulum-v1 with gravity ``g`` and a motor that adds ``offset`` to every torque."""
    env = gym.make("Pendulum-v1", g=g)
    return MotorOffset(env, offset) if offset else env


class Scale(nn.Module):
    """Multiplies the input by fixed factors (a buffer, so it travels with the weights)."""

    def __init__(self, factors: np.ndarray) -> None:
        super().__init__()
        self.register_buffer("factors", torch.as_tensor(factors, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factors


class Agent(nn.Module):
    """A Gaussian policy: a 2x64 tanh MLP for the mean and a fixed exploration std.

    The std is a buffer, not a parameter: it travels with the weights but gets no gradient.
    Learned, it made plain REINFORCE unstable here (its gradient is the noisiest component,
    and a normalized step moves it as far as the rest). The last layer starts near zero, so
    the first policy is close to "no torque".
    """

    def __init__(self, envs: Any) -> None:
        super().__init__()
        obs = int(np.prod(envs.single_observation_space.shape))
        act = int(np.prod(envs.single_action_space.shape))
        last = nn.Linear(64, act)
        with torch.no_grad():
            last.weight.mul_(0.01)
            last.bias.zero_()
        high = np.asarray(envs.single_observation_space.high, dtype=np.float64).reshape(-1)
        self.actor_mean = nn.Sequential(
            Scale(1.0 / np.where(np.isfinite(high) & (high > 0), high, 1.0)),  # inputs in [-1, 1]
            nn.Linear(obs, 64),
            nn.Tanh(),
            nn.Linear(64, 64),
            nn.Tanh(),
            last,
        )
        self.register_buffer("actor_logstd", torch.full((1, act), -0.5))  # std 0.61


# -- the experiment --------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--setting", choices=("speeds", "envs", "both"), default="both", help="heterogeneity"
    )
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated initial-weight seeds")
    p.add_argument("--workers", type=int, default=4, help="worker processes (4-8)")
    p.add_argument("--envs-per-worker", type=int, default=8, help="envs per worker")
    p.add_argument("--delay-base", type=float, default=0.003, help="seconds per env step, h=1")
    p.add_argument(
        "--comm-base", type=float, default=0.0, help="seconds per aggregation (a worker's sum), k=1"
    )
    p.add_argument(
        "--aggregation",
        choices=("server", "allreduce"),
        default="server",
        help="how a round's sums meet: sent to the learner, or one gloo all-reduce",
    )
    p.add_argument("--gravity", type=float, default=2.0, help="Pendulum's g on every worker")
    p.add_argument("--offset", type=float, default=1.0, help="envs: motor torque offset")
    p.add_argument("--budget", type=int, default=2400, help="trajectory gradients per run")
    p.add_argument("--batch", type=int, default=16, help="M of Rennala and Malenia")
    p.add_argument("--lr", type=float, default=0.1, help="NIGT step length alpha")
    p.add_argument("--momentum", type=float, default=0.5, help="NIGT eta")
    p.add_argument("--horizon", type=int, default=50, help="H, steps per trajectory")
    p.add_argument("--gamma", type=float, default=0.97, help="the discount factor")
    p.add_argument("--eval-points", type=int, default=20, help="evaluations per run")
    p.add_argument("--eval-episodes", type=int, default=32, help="episodes per evaluation")
    p.add_argument("--smooth", type=int, default=64, help="trajectories in the return average")
    p.add_argument(
        "--threshold",
        type=float,
        help="return for time-to-reward (None: -150 for speeds, -200 for envs)",
    )
    p.add_argument(
        "--out", type=Path, default=HERE.parent.parent / "docs" / "results", help="where figures go"
    )
    p.add_argument("--replot", action="store_true", help="only redo figures and summary")
    p.add_argument("--quick", action="store_true", help="a tiny smoke run (1 seed, seconds)")
    args = p.parse_args(argv)
    if args.quick:
        args.seeds, args.workers, args.envs_per_worker = "0", 2, 2
        args.delay_base, args.budget, args.batch, args.horizon = 0.0005, 12, 2, 20
        args.eval_points, args.eval_episodes, args.smooth = 2, 2, 4
    args.methods = [m for m in args.methods.split(",") if m]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    if unknown := set(args.methods) - set(METHODS):
        p.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    if args.workers < 2:
        p.error("--workers must be at least 2 (a fast and a slow half)")
    return args


def worker_setup(args: argparse.Namespace, setting: str) -> tuple[list[float], list[dict]]:
    """Per-worker compute delays and env kwargs; worker i (from 1) has h_i = sqrt(i)."""
    n = args.workers
    delays = [math.sqrt(i) * args.delay_base for i in range(1, n + 1)]
    if setting == "speeds":
        kwargs = [{"g": args.gravity} for _ in range(n)]
    else:  # the fast half leans one way, the slow half the other
        kwargs = [
            {"g": args.gravity, "offset": args.offset if i < n // 2 else -args.offset}
            for i in range(n)
        ]
    return delays, kwargs


def aggregator(args: argparse.Namespace, method: str) -> pg.AggregationRule:
    if method == "rennala":
        return pg.Rennala(batch=args.batch)
    if method == "malenia":
        return pg.Malenia(batch=args.batch)
    return pg.Synchronous()


def evaluate(agent: Agent, env_kwargs: dict, episodes: int, horizon: int) -> float:
    """Mean return of the mean action over ``episodes`` resets with fixed seeds."""
    envs = gym.vector.SyncVectorEnv([lambda: make_env(**env_kwargs) for _ in range(episodes)])
    try:
        obs, _ = envs.reset(seed=10_000)
        space = envs.single_action_space
        total, alive = np.zeros(episodes), np.ones(episodes, dtype=bool)
        with torch.no_grad():
            for _ in range(horizon):
                mean = agent.actor_mean(torch.as_tensor(obs, dtype=torch.float32)).numpy()
                obs, reward, terminated, truncated, _ = envs.step(
                    np.clip(mean, space.low, space.high)
                )
                total += np.where(alive, reward, 0.0)
                alive &= ~(terminated | truncated)
                if not alive.any():
                    break
        return float(total.mean())
    finally:
        envs.close()


async def start_cluster(
    args: argparse.Namespace, delays: list[float], kwargs: list[dict], token: str
) -> tuple[aps.Learner, list[LocalWorkers]]:
    """A learner and one worker process per entry, started one at a time.

    The learner numbers workers in order of arrival; starting them one by one makes learner
    worker id i the worker with delay ``delays[i]`` and env ``kwargs[i]``.
    """
    learner = aps.Learner(
        "tcp://127.0.0.1:0",
        num_workers=args.workers,
        policy=POLICY,
        autoreset_mode="SameStep",
        token=token,
    )
    launched: list[LocalWorkers] = []
    try:
        await learner.start()
        for i in range(args.workers):
            workers = LocalWorkers(
                ENV,
                num_workers=1,
                envs_per_worker=args.envs_per_worker,
                env_kwargs=[kwargs[i]],
                compute_delays=[delays[i]],
                comm_delays=[math.sqrt(i + 1) * args.comm_base],
                token=token,
                policy=POLICY,
            )
            launched.append(workers)
            await workers.start(learner.url)
            async with asyncio.timeout(60):
                # No admission event to wait on: poll the learner's list of workers.
                while len(learner.workers) < i + 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.05)
    except BaseException:
        await stop_cluster(learner, launched)
        raise
    return learner, launched


async def stop_cluster(learner: aps.Learner, launched: list[LocalWorkers]) -> None:
    try:
        await learner.aclose()
    finally:
        await asyncio.gather(*(workers.stop() for workers in launched))


async def one_run(
    args: argparse.Namespace,
    learner: aps.Learner,
    setting: str,
    method: str,
    seed: int,
    env_kwargs: list[dict],
) -> list[dict]:
    """Train one method from the seed's initial point until the budget is used; the rows."""
    torch.manual_seed(seed)
    agent = Agent(learner)
    trainer = pg.NIGT(
        agent,
        aggregator=aggregator(args, method),
        lr=args.lr,
        momentum=args.momentum,
        horizon=args.horizon,
        gamma=args.gamma,
        aggregation=args.aggregation,
    )
    base = {"setting": setting, "method": method, "seed": seed}
    snapshots = [(0, {k: v.clone() for k, v in agent.state_dict().items()})]
    next_eval = args.budget / args.eval_points
    rows: list[dict] = []
    used = 0
    # Every round uses at least one gradient, so ``budget`` iterations is an upper bound.
    rounds = trainer.train(learner, iterations=args.budget)
    async with contextlib.aclosing(rounds):
        async for stats in rounds:
            used += stats.used
            row = {
                **base,
                "iteration": stats.iteration,
                "elapsed": stats.elapsed,
                "seconds": stats.seconds,
                "used": stats.used,
                "cum_used": used,
                "discarded": stats.discarded,
                "mean_return": stats.mean_return,
                "bytes_sent": stats.bytes_sent,
                "bytes_received": stats.bytes_received,
                "aggregation_bytes": stats.aggregation_bytes,
                "direction_norm": stats.direction_norm,
            }
            for worker in range(args.workers):
                row[f"contrib_{worker}"] = stats.contributions.get(worker, 0)
            rows.append(row)
            if used >= next_eval or used >= args.budget:
                snapshots.append((len(rows), {k: v.clone() for k, v in agent.state_dict().items()}))
                while next_eval <= used:
                    next_eval += args.budget / args.eval_points
            if used >= args.budget:
                break
    # Evaluate the saved policies now, so evaluating never slows the timed rounds.
    rows.insert(0, {**base, "iteration": -1, "elapsed": 0.0, "cum_used": 0})
    scratch = Agent(learner)
    cache: dict[str, float] = {}
    eval_keys = [f"eval_{worker}" for worker in range(len(env_kwargs))]
    for index, state in snapshots:
        scratch.load_state_dict(state)
        cache.clear()
        for worker, kwargs in enumerate(env_kwargs):
            key = repr(sorted(kwargs.items()))  # workers with the same env share one figure
            if key not in cache:
                cache[key] = evaluate(scratch, kwargs, args.eval_episodes, args.horizon)
            rows[index][f"eval_{worker}"] = cache[key]
        rows[index]["eval_avg"] = float(np.mean(list(map(rows[index].get, eval_keys))))
    return rows


async def run_setting(args: argparse.Namespace, setting: str) -> list[dict]:
    delays, kwargs = worker_setup(args, setting)
    print(f"\n== setting {setting}: {args.workers} workers x {args.envs_per_worker} envs")
    for i, (delay, kw) in enumerate(zip(delays, kwargs, strict=True)):
        print(f"   worker {i}: {1000 * delay:.2f} ms per step, env {kw}")
    learner, launched = await start_cluster(args, delays, kwargs, secrets.token_hex(16))
    rows: list[dict] = []
    try:
        for seed in args.seeds:
            for method in args.methods:
                began = time.monotonic()
                run = await one_run(args, learner, setting, method, seed, kwargs)
                rows += run
                last = run[-1]
                print(
                    f"   {method:<11} seed {seed}: {last['iteration'] + 1:>4} rounds, "
                    f"{last['cum_used']:>5} gradients, {last['elapsed']:6.1f} s "
                    f"(+{time.monotonic() - began - last['elapsed']:.1f} s evaluating), "
                    f"final eval {run[-1].get('eval_avg', math.nan):8.1f}",
                    flush=True,
                )
    finally:
        await stop_cluster(learner, launched)
    return rows


# -- results ---------------------------------------------------------------------------------


def write_csv(rows: list[dict], path: Path) -> None:
    fields: list[str] = []
    for row in rows:
        fields += [key for key in row if key not in fields]
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, restval="")
        writer.writeheader()
        for row in rows:
            writer.writerow({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()})


def read_csv(path: Path) -> list[dict]:
    def value(text: str) -> Any:
        if text == "":
            return math.nan
        try:
            return int(text)
        except ValueError:
            try:
                return float(text)
            except ValueError:
                return text

    with path.open(newline="") as handle:
        return [{k: value(v) for k, v in row.items()} for row in csv.DictReader(handle)]


def workers_in(rows: list[dict]) -> int:
    return len({key for row in rows for key in row if key.startswith("contrib_")})


def runs_of(rows: list[dict]) -> dict[tuple[str, int], list[dict]]:
    runs: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        runs.setdefault((row["method"], int(row["seed"])), []).append(row)
    return runs


def smoothed_returns(run: list[dict], window: int) -> tuple[np.ndarray, np.ndarray]:
    """Wall time and the mean return of the last ``window`` used trajectories, per round."""
    rounds = [r for r in run if r["iteration"] >= 0 and not math.isnan(r["mean_return"])]
    times, values, recent = [], [], []
    for r in rounds:
        recent.append((r["used"], r["mean_return"]))
        while sum(n for n, _ in recent[1:]) >= window:
            recent.pop(0)
        total = sum(n for n, _ in recent)
        times.append(r["elapsed"])
        values.append(sum(n * v for n, v in recent) / total)
    return np.asarray(times), np.asarray(values)


def evaluations(run: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    points = [r for r in run if not math.isnan(r.get("eval_avg", math.nan))]
    return np.array([r["elapsed"] for r in points]), np.array([r["eval_avg"] for r in points])


def first_time(times: np.ndarray, values: np.ndarray, threshold: float) -> float:
    hit = np.nonzero(values >= threshold)[0]
    return float(times[hit[0]]) if hit.size else math.inf


def band(curves: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, ...]:
    """Mean, min and max over seeds on a common time grid (up to the shortest run)."""
    end = min(t[-1] for t, _ in curves)
    grid = np.linspace(0.0, end, 200)
    values = np.array([np.interp(grid, t, v) for t, v in curves])
    return grid, values.mean(0), values.min(0), values.max(0)


def threshold_of(args: argparse.Namespace, setting: str) -> float:
    if args.threshold is not None:
        return float(args.threshold)
    return -150.0 if setting == "speeds" else -200.0


def summarize(rows: list[dict], setting: str, args: argparse.Namespace) -> str:
    threshold = threshold_of(args, setting)
    runs = runs_of(rows)
    methods = [m for m in METHODS if any(k[0] == m for k in runs)]
    n = workers_in(rows)
    lines = [f"setting {setting}: threshold {threshold:g}"]
    medians: dict[str, dict[str, float]] = {}
    for method in methods:
        seeds = sorted(s for m, s in runs if m == method)
        train = [
            first_time(*smoothed_returns(runs[method, s], args.smooth), threshold) for s in seeds
        ]
        evals = [first_time(*evaluations(runs[method, s]), threshold) for s in seeds]
        medians[method] = {"train": float(np.median(train)), "eval": float(np.median(evals))}
        finals, initials = (
            np.array([[runs[method, s][at][f"eval_{w}"] for w in range(n)] for s in seeds])
            for at in (-1, 0)
        )
        gains = finals - initials
        total = np.median([runs[method, s][-1]["elapsed"] for s in seeds])
        rounds = np.median([runs[method, s][-1]["iteration"] + 1 for s in seeds])
        used = sum(r.get("used", 0) or 0 for s in seeds for r in runs[method, s][1:])
        dropped = sum(r.get("discarded", 0) or 0 for s in seeds for r in runs[method, s][1:])
        contrib = np.sum(
            [[r[f"contrib_{w}"] for w in range(n)] for s in seeds for r in runs[method, s][1:]],
            axis=0,
        )
        share = " ".join(f"{c / contrib.sum():.2f}" for c in contrib)
        lines += [
            f"  {LABELS[method]}: {rounds:.0f} rounds in {total:.1f} s (median); "
            f"time to {threshold:g}: training return "
            f"{', '.join(f'{t:.1f}' for t in train)} s, evaluation "
            f"{', '.join(f'{t:.1f}' for t in evals)} s",
            f"    gradients used {used}, discarded {dropped}; share per worker (fast..slow) "
            f"{share}",
            "    final evaluation per worker env, mean [min, max] over seeds (mean gain over "
            "the initial policy): "
            + "; ".join(
                f"w{w} {finals[:, w].mean():.0f} [{finals[:, w].min():.0f}, "
                f"{finals[:, w].max():.0f}] ({gains[:, w].mean():+.0f})"
                for w in range(n)
            )
            + f"; average {finals.mean(1).mean():.0f} [{finals.mean(1).min():.0f}, "
            f"{finals.mean(1).max():.0f}] ({gains.mean():+.0f})",
        ]
    if "synchronous" in medians:
        sync = medians["synchronous"]
        for method in ("rennala", "malenia"):
            if method in medians:
                ratio = {k: ratio_of(medians[method][k], sync[k]) for k in sync}
                text = {k: "n/a" if math.isnan(v) else f"{v:.2f}" for k, v in ratio.items()}
                lines.append(
                    f"  median time-to-reward ratio {LABELS[method]} / Synchronized NIGT: "
                    f"{text['train']} (training return), {text['eval']} (evaluation)"
                )
    return "\n".join(lines)


def ratio_of(time: float, reference: float) -> float:
    """``time / reference``; NaN when the reference never got there (or at once)."""
    if math.isinf(reference) or reference <= 0:
        return math.nan
    return time / reference


def plot(rows: list[dict], setting: str, args: argparse.Namespace, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"   (matplotlib is not installed: no figure {path.name})")
        return
    runs = runs_of(rows)
    methods = [m for m in METHODS if any(k[0] == m for k in runs)]
    seeds = sorted({s for _, s in runs})
    panels = 3 if setting == "envs" else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.0))
    for method in methods:
        kw = {"color": COLORS[method], "label": LABELS[method]}
        for ax, curve in (
            (axes[0], lambda s, m=method: smoothed_returns(runs[m, s], args.smooth)),
            (axes[1], lambda s, m=method: evaluations(runs[m, s])),
        ):
            curves = [curve(s) for s in seeds if (method, s) in runs]
            curves = [(t, v) for t, v in curves if len(t) > 1]
            if not curves:
                continue
            grid, mean, low, high = band(curves)
            ax.plot(grid, mean, **kw)
            ax.fill_between(grid, low, high, color=COLORS[method], alpha=0.2, linewidth=0)
    for ax in axes[:2]:
        ax.axhline(threshold_of(args, setting), color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("wall time (s)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"return over {args.horizon} steps")
    axes[0].set_title(f"training: last {args.smooth} used trajectories")
    axes[1].set_title("evaluation: mean action, average over workers' envs")
    axes[0].legend(loc="lower right", fontsize=8)
    if setting == "envs":
        n = workers_in(rows)
        half = n // 2
        groups = [("fast workers' env", range(half)), ("slow workers' env", range(half, n))]
        groups.append(("average", range(n)))
        width = 0.8 / len(methods)
        for j, method in enumerate(methods):
            finals = [runs[method, s][-1] for s in seeds if (method, s) in runs]
            for g, (_, members) in enumerate(groups):
                values = [np.mean([f[f"eval_{w}"] for w in members]) for f in finals]
                x = g + (j - (len(methods) - 1) / 2) * width
                axes[2].bar(x, np.mean(values), width, color=COLORS[method])
                axes[2].errorbar(
                    x,
                    np.mean(values),
                    yerr=[[np.mean(values) - min(values)], [max(values) - np.mean(values)]],
                    color="black",
                    capsize=3,
                    linewidth=1,
                )
        starts = [r for r in rows if r["iteration"] == -1]
        for g, (_, members) in enumerate(groups):
            initial = np.mean([[r[f"eval_{w}"] for w in members] for r in starts])
            label = "initial policy" if g == 0 else None
            axes[2].hlines(initial, g - 0.45, g + 0.45, color="black", linestyle="--", label=label)
        axes[2].legend(loc="lower right", fontsize=8)
        axes[2].set_xticks(range(len(groups)), [name for name, _ in groups])
        axes[2].set_title("final evaluation per env (min-max over seeds)")
        axes[2].grid(alpha=0.3, axis="y")
    fig.suptitle(
        f"Pendulum (g={args.gravity:g}), {setting} setting: {len(seeds)} seed(s), mean and "
        "min-max band"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    settings = ("speeds", "envs") if args.setting == "both" else (args.setting,)
    for setting in settings:
        csv_path = args.out / f"nigt_{setting}.csv"
        if args.replot:
            rows = read_csv(csv_path)
        else:
            rows = asyncio.run(run_setting(args, setting))
            write_csv(rows, csv_path)
            print(f"   wrote {csv_path}")
        print(summarize(rows, setting, args))
        plot(rows, setting, args, args.out / f"nigt_{setting}.png")


if __name__ == "__main__":
    main(sys.argv[1:])
