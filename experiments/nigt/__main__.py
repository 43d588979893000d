"""Rennala, Malenia, synchronized NIGT and AFedPG in the paper's time model (aps.pg.simulate).

    python -m experiments.nigt                       # equal, sqrt, comm on Reacher, 3 seeds
    python -m experiments.nigt --scenarios hetero    # the heterogeneous-environment experiment
    python -m experiments.nigt --quick               # a smoke run, a minute
    python -m experiments.nigt --replot              # the figures and summary from saved runs
    python -m experiments.nigt --lr 2^-7,2^-5,2^-3   # a step-size grid: the best per method

Worker i (i = 1..n) needs ``h_i`` virtual time units per env step, so ``horizon * h_i`` per
trajectory gradient, and ``kappa_i`` per aggregation of its sum (NIGT) or per gradient sent
(AFedPG). Scenarios, as in the paper's section 6 and appendix H.3:

- ``equal`` (n workers): h_i = 1, kappa_i = 0;
- ``sqrt`` (n workers): h_i = sqrt(i), kappa_i = sqrt(i);
- ``comm`` (n workers): h_i = sqrt(i), kappa_i = sqrt(i) * d^(1/4) (d = the policy's
  parameter count);
- ``hetero`` (always 2 workers): h = (1, 10), kappa = 0, and each worker has its own env:
  worker 1 observes ``(s, 0)`` and worker 2 ``(-s, 1)`` (the paper's construction). The
  objective is the average of the two envs' returns, measured off the clock: the policy
  ``theta`` is evaluated on both envs (``--eval-episodes`` episodes each, fixed reset seeds,
  sampled actions, ``horizon`` steps) at ``--eval-points`` evenly spaced virtual times.

The policy is the paper's: a Gaussian over ``u`` (a 2x64 tanh MLP for the mean, a learned
state-independent log-std) and the env gets ``tanh(u)`` scaled to the action bounds
(``--squash tanh``, the default; ``--squash clip`` clips ``u`` to the bounds instead). The
squashing is an env wrapper: the policy's action space is unbounded, and REINFORCE's
gradient of ``log p(u)`` is that of ``log p(a)``, since the Jacobian of the squashing does
not depend on ``theta``.

``--lr`` takes one step size or a grid (``2^-7,2^-5``: powers of two as the paper writes
them). With a grid every (scenario, method) runs every step size, and the summary and figure
use, per (scenario, method), the one whose median curve over the seeds has the highest mean
over virtual time (area under the curve: it rewards learning early and ending high); the
``.txt`` names the choice. The paper tunes per algorithm and per figure in the same way,
on its grid ``2^-10 .. 2^-1``.

Synchronized NIGT is the paper's baseline: every worker computes ``--sync-share`` gradients
(1 by default) and waits for the slowest; fast workers idle.

Each run stops at the same virtual-time budget. Every finished run is saved to
``<out>/runs/<tag>_<scenario>_<method>_s<seed>.csv`` and skipped on the next call, so an
interrupted call resumes. Then ``<out>/nigt_sim_<env>[_n<workers>][_<scenarios>].csv`` (every
run's curve at 100 evenly spaced times, its step size, its totals, and whether its step size
is the one chosen), ``.png`` (median and (20%, 80%) band over seeds against virtual time) and
``.txt`` (step sizes chosen, final values, means over time, time-to-reward ratios) are
written.
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from aps import pg
from aps.pg.simulate import afedpg, simulate

METHODS = ("rennala", "malenia", "synchronous", "afedpg")
SCENARIOS = ("equal", "sqrt", "comm", "hetero")


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


class TanhSquashed(gym.ActionWrapper[Any, np.ndarray, np.ndarray]):
    """The paper's action map: the policy samples ``u``, the env gets ``tanh(u)`` in its bounds."""

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        super().__init__(env)
        space = env.action_space
        assert isinstance(space, gym.spaces.Box), "tanh squashing needs a Box action space"
        self.low = np.asarray(space.low, dtype=np.float64)
        self.high = np.asarray(space.high, dtype=np.float64)
        self.action_space = gym.spaces.Box(-np.inf, np.inf, space.shape, np.float32)

    def action(self, action: np.ndarray) -> np.ndarray:
        unit = (np.tanh(np.asarray(action, dtype=np.float64)) + 1.0) / 2.0
        return (self.low + unit * (self.high - self.low)).astype(np.float32)


class Flagged(gym.ObservationWrapper[np.ndarray, Any, np.ndarray]):
    """The paper's heterogeneous envs: observe ``(sign * s, flag)``."""

    def __init__(self, env: gym.Env[Any, Any], sign: float, flag: float) -> None:
        super().__init__(env)
        low = np.asarray(env.observation_space.low, dtype=np.float32)  # type: ignore[attr-defined]
        high = np.asarray(env.observation_space.high, dtype=np.float32)  # type: ignore[attr-defined]
        low, high = (low, high) if sign > 0 else (-high, -low)
        self.observation_space = gym.spaces.Box(
            np.append(low, 0.0).astype(np.float32), np.append(high, 1.0).astype(np.float32)
        )
        self.sign, self.flag = sign, flag

    def observation(self, observation: np.ndarray) -> np.ndarray:
        return np.append(self.sign * observation, self.flag).astype(np.float32)


def make(
    env: str, worker: int | None = None, *, squash: str = "tanh", **kwargs: Any
) -> Callable[[], gym.Env[Any, Any]]:
    """An env factory: the plain env, or worker ``worker``'s flagged env (hetero).

    ``squash="tanh"`` wraps it in :class:`TanhSquashed`; ``"clip"`` leaves the actions to
    the policy's clipping.
    """

    def plain() -> gym.Env[Any, Any]:
        made = gym.make(env, **kwargs)
        return TanhSquashed(made) if squash == "tanh" else made

    if worker is None:
        return plain
    sign, flag = (1.0, 0.0) if worker == 0 else (-1.0, 1.0)
    return lambda: Flagged(plain(), sign, flag)


def env_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Keyword arguments for gym.make (``--gravity`` for Pendulum)."""
    return {} if args.gravity is None else {"g": args.gravity}


def times(scenario: str, n: int, horizon: int, d: int) -> tuple[list[float], list[float]]:
    """Per-worker virtual times per gradient (h) and per aggregation (kappa)."""
    if scenario == "equal":
        return [float(horizon)] * n, [0.0] * n
    if scenario == "hetero":
        return [float(horizon), 10.0 * horizon], [0.0, 0.0]
    h = [horizon * math.sqrt(i) for i in range(1, n + 1)]
    kappa = [math.sqrt(i) for i in range(1, n + 1)]
    if scenario == "comm":
        kappa = [k * d**0.25 for k in kappa]
    return h, kappa


def rule(method: str, batch: int, share: int) -> Any:
    """The aggregation rule of a NIGT method."""
    if method == "rennala":
        return pg.Rennala(batch=batch)
    if method == "malenia":
        return pg.Malenia(batch=batch)
    return pg.Synchronous(share=share)


def step_sizes(text: str) -> list[float]:
    """``"2^-7,0.01"`` -> ``[0.0078125, 0.01]``: a step size or a grid of them."""
    values = []
    for part in text.split(","):
        base, _, power = part.strip().partition("^")
        values.append(float(base) ** float(power) if power else float(base))
    if not values or any(not (math.isfinite(v) and v > 0) for v in values):
        raise argparse.ArgumentTypeError(f"--lr needs positive step sizes, got {text!r}")
    return values


def evaluate(agent: nn.Module, factories: list[Any], args: argparse.Namespace) -> list[float]:
    """The mean return of ``agent`` on each env: fixed reset seeds, sampled actions."""
    from gymnasium.vector import AutoresetMode, SyncVectorEnv

    from aps.policy import Policy

    means = []
    for index, factory in enumerate(factories):
        envs = SyncVectorEnv([factory] * args.eval_episodes, autoreset_mode=AutoresetMode.SAME_STEP)
        policy = Policy(agent, envs.single_observation_space, envs.single_action_space)
        policy.seed(10_000 + index)
        obs, _ = envs.reset(seed=[10_000 + k for k in range(args.eval_episodes)])
        total = np.zeros(args.eval_episodes)
        alive = np.ones(args.eval_episodes, dtype=bool)
        for _ in range(args.horizon):
            actions, _, _ = policy.act(obs)
            obs, reward, terminated, truncated, _ = envs.step(policy.env_actions(actions))
            total += np.where(alive, reward, 0.0)
            alive &= ~(terminated | truncated)
            if not alive.any():
                break
        envs.close()
        means.append(float(total.mean()))
    return means


def one_run(
    args: argparse.Namespace, scenario: str, method: str, seed: int, lr: float
) -> list[dict[str, Any]]:
    """One simulated training run: a row per round (NIGT) or per server step (AFedPG)."""
    torch.manual_seed(seed)
    n = 2 if scenario == "hetero" else args.workers
    kwargs = {**env_kwargs(args), "squash": args.squash}
    factories = [make(args.env, i, **kwargs) for i in range(n)] if scenario == "hetero" else []
    probe = (factories[0] if factories else make(args.env, **kwargs))()
    agent = Agent(probe.observation_space, probe.action_space)
    d = sum(p.numel() for p in agent.parameters())
    h, kappa = times(scenario, n, args.horizon, d)
    envs: Any = factories or make(args.env, **kwargs)
    common = {
        "h": h,
        "kappa": kappa,
        "lr": lr,
        "momentum": args.momentum,
        "horizon": args.horizon,
        "gamma": args.gamma,
        "time_budget": args.budget,
        "seed": seed,
    }
    if method == "afedpg":
        steps = afedpg(agent, envs, **common)
    else:
        steps = simulate(
            agent,
            envs,
            aggregator=rule(method, args.batch, args.sync_share),
            envs_per_worker=args.envs_per_worker,
            **common,
        )
    grid = list(np.linspace(0.0, args.budget, args.eval_points + 1))[1:] if factories else []
    rows = []
    initial_evals = evaluate(agent, factories, args) if factories else []
    evals = initial_evals
    for r in steps:
        row = {
            "env": args.env,
            "scenario": scenario,
            "method": method,
            "seed": seed,
            "lr": lr,
            "iteration": r.iteration,
            "time": r.time,
            "compute": r.compute,
            "communication": r.communication,
            "used": r.used,
            "delay": r.delay,
            "mean_return": r.mean_return,
        }
        if factories:
            # Evaluate theta after the first round that ends at or past each grid time.
            passed = [t for t in grid if t <= r.time]
            grid = [t for t in grid if t > r.time]
            if passed:
                evals = evaluate(agent, factories, args)
            for i, value in enumerate(evals):
                row[f"eval_{i}"] = value if passed else math.nan
            row["eval_avg"] = float(np.mean(evals)) if passed else math.nan
        rows.append(row)
    if factories:
        initial = {**rows[0], "iteration": -1, "time": 0.0, "used": 0, "mean_return": math.nan}
        for i, value in enumerate(initial_evals):
            initial[f"eval_{i}"] = value
        initial["eval_avg"] = float(np.mean(initial_evals))
        rows.insert(0, initial)
    return rows


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as CSV, atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    fields = list(dict.fromkeys(key for row in rows for key in row))
    with tmp.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    tmp.replace(path)  # a run is saved whole or not at all: resuming never sees half a run


def read(path: Path) -> list[dict[str, Any]]:
    """Read rows of a CSV."""
    with path.open(newline="") as handle:
        return list(csv.DictReader(handle))


def _number(value: Any) -> float:
    return math.nan if value in (None, "") else float(value)


def series(rows: list[dict[str, Any]], metric: str, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(times, values) of a run's metric.

    ``mean_return``: the mean training return of the last ``window`` trajectories used (a
    round of M trajectories counts M times, so rounds and single AFedPG steps compare);
    ``eval_*``: the evaluations, held until the next one.
    """
    rows = [r for r in rows if int(r["iteration"]) >= 0 or metric != "mean_return"]
    t = np.array([float(r["time"]) for r in rows])
    if metric == "mean_return":
        used = np.array([float(r["used"]) for r in rows])
        total = np.cumsum(used * np.array([_number(r["mean_return"]) for r in rows]))
        count = np.cumsum(used)
        start = np.searchsorted(count, count - window, side="right")
        before_total = np.where(start > 0, total[np.maximum(start - 1, 0)], 0.0)
        before_count = np.where(start > 0, count[np.maximum(start - 1, 0)], 0.0)
        return t, (total - before_total) / (count - before_count)
    values = np.array([_number(r.get(metric)) for r in rows])
    keep = np.isfinite(values)
    return t[keep], values[keep]


def curve(rows: list[dict[str, Any]], grid: np.ndarray, metric: str, window: int) -> np.ndarray:
    """A run's metric at each grid time (a step function of virtual time)."""
    t, y = series(rows, metric, window)
    index = np.searchsorted(t, grid, side="right") - 1
    return np.where(index >= 0, y[np.clip(index, 0, None)], np.nan)


def time_to(rows: list[dict[str, Any]], target: float, metric: str, window: int) -> float:
    """The first virtual time at which the metric reaches ``target`` (inf: never)."""
    t, y = series(rows, metric, window)
    hit = np.flatnonzero(y >= target)
    return float(t[hit[0]]) if hit.size else math.inf


def ratio(a: float, b: float) -> float:
    """``a / b`` for times to a target (inf: never reached); nan when neither reached it."""
    if math.isinf(a) and math.isinf(b):
        return math.nan
    if a == b:
        return 1.0
    return math.inf if b == 0.0 or math.isinf(a) else a / b


def quantiles(values: list[float]) -> str:
    """'median (20%: a, 80%: b)' of finite or infinite values."""
    if not values:
        return "no runs"
    known = [v for v in values if not math.isnan(v)]
    if not known:
        return "undefined (no run reached the target)"
    array = np.asarray(known, dtype=float)
    # Linear interpolation, as the figures' bands; observed values when one is infinite (a
    # run that never reached the target), where interpolating gives nan.
    method = "linear" if np.isfinite(array).all() else "inverted_cdf"
    q = np.quantile(array, [0.2, 0.5, 0.8], method=method)
    return f"median {q[1]:.2f} (20%: {q[0]:.2f}, 80%: {q[2]:.2f})"


Runs = dict[tuple[str, str, int], list[dict[str, Any]]]


def tune(
    args: argparse.Namespace, every: dict[tuple[str, str, int, float], list[dict[str, Any]]]
) -> tuple[Runs, list[str]]:
    """Per (scenario, method), the runs of the best step size, and lines that say why.

    The best step size has the highest mean over virtual time of its median curve over the
    tuning seeds (``args.tune_seeds``, or every seed): the area under the curve. A single
    step size is chosen trivially. The chosen runs are those of every seed at that size.
    """
    tuning = set(args.tune_seeds or args.seeds)
    grid = np.linspace(0, args.budget, 200)
    chosen: Runs = {}
    lines = []
    for scenario in args.scenarios:
        metric = "eval_avg" if scenario == "hetero" else "mean_return"
        for method in args.methods:
            scores = {}
            for lr in args.lr:
                curves = [
                    curve(rows, grid, metric, args.window)
                    for (s, m, seed, r), rows in every.items()
                    if (s, m, r) == (scenario, method, lr) and seed in tuning
                ]
                if curves:
                    with warnings.catch_warnings():  # before a run's first round: nan
                        warnings.simplefilter("ignore", RuntimeWarning)
                        median = np.nanmedian(np.stack(curves), axis=0)
                    scores[lr] = float(np.nanmean(median))
            if not scores:
                continue
            best = max(scores, key=lambda lr: scores[lr])
            for (s, m, seed, r), rows in every.items():
                if (s, m, r) == (scenario, method, best):
                    chosen[s, m, seed] = rows
            if len(args.lr) > 1:
                listed = ", ".join(f"{lr:g}: {score:.1f}" for lr, score in sorted(scores.items()))
                lines.append(
                    f"{args.env} {scenario} {method}: lr {best:g} chosen "
                    f"(mean of the median {metric} over time, by lr: {listed})"
                )
    return chosen, lines


def summarize(
    args: argparse.Namespace,
    every: dict[tuple[str, str, int, float], list[dict[str, Any]]],
    stem: str,
) -> None:
    """Write the combined CSV, the final values, the time-to-reward ratios and the figure."""
    out = Path(args.out)
    runs, lines = tune(args, every)
    grid = np.linspace(0, args.budget, 200)
    # Every run's curve at 100 times, with its totals: small enough to commit (a run's every
    # round stays in runs/).
    points = np.linspace(0, args.budget, 101)[1:]
    compact = []
    for (scenario, method, seed, lr), rows in every.items():
        metric = "eval_avg" if scenario == "hetero" else "mean_return"
        steps = [r for r in rows if int(r["iteration"]) >= 0]
        totals = {
            "rounds": len(steps),
            "used": sum(int(r["used"]) for r in steps),
            "communication": sum(float(r["communication"]) for r in steps),
            "chosen": int(runs.get((scenario, method, seed)) is rows),
        }
        values = curve(rows, points, metric, args.window)
        compact += [
            {"scenario": scenario, "method": method, "lr": lr, "seed": seed, **totals,
             "metric": metric, "time": float(t), "value": float(v)}
            for t, v in zip(points, values, strict=True)
        ]  # fmt: skip
    write(out / f"{stem}.csv", compact)
    scenarios = [s for s in args.scenarios if any(k[0] == s for k in runs)]
    for scenario in scenarios:
        metric = "eval_avg" if scenario == "hetero" else "mean_return"
        proposed = "malenia" if scenario == "hetero" else "rennala"
        keys = [k for k in runs if k[0] == scenario]
        finals = {
            m: [curve(runs[k], grid, metric, args.window)[-1] for k in keys if k[1] == m]
            for m in args.methods
        }
        for method in args.methods:
            lines.append(
                f"{args.env} {scenario} {method}: final {metric} "
                f"{quantiles(finals[method])} over {len(finals[method])} seeds"
            )
        for method in args.methods:
            # The mean of each run's curve over the whole budget: learning early counts too.
            with warnings.catch_warnings():  # before a run's first round: nan
                warnings.simplefilter("ignore", RuntimeWarning)
                areas = [
                    float(np.nanmean(curve(runs[k], grid, metric, args.window)))
                    for k in keys
                    if k[1] == method
                ]
            lines.append(
                f"{args.env} {scenario} {method}: mean {metric} over time "
                f"{quantiles(areas)} over {len(areas)} seeds"
            )
        first = [series(runs[k], metric, args.window)[1][0] for k in keys]
        last = [v for values in finals.values() for v in values]
        # The target: 80% of the way from the initial value to the median final value.
        target = float(np.nanmedian(first) + 0.8 * (np.nanmedian(last) - np.nanmedian(first)))
        for method in args.methods:
            if method == proposed:
                continue
            ratios = []
            for seed in args.seeds:
                if (scenario, proposed, seed) in runs and (scenario, method, seed) in runs:
                    a = time_to(runs[scenario, proposed, seed], target, metric, args.window)
                    b = time_to(runs[scenario, method, seed], target, metric, args.window)
                    ratios.append(ratio(a, b))
            lines.append(
                f"{args.env} {scenario}: time to {metric} {target:.1f}, {proposed} / {method}: "
                f"{quantiles(ratios)} over {len(ratios)} seeds"
            )
    text = "\n".join(lines)
    print(text)
    (out / f"{stem}.txt").write_text(text + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure")
        return
    panels = [(s, "mean_return") for s in scenarios if s != "hetero"]
    if "hetero" in scenarios:
        panels += [("hetero", "eval_avg"), ("hetero", "eval_0"), ("hetero", "eval_1")]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for ax, (scenario, metric) in zip(axes[0], panels, strict=True):
        for method in args.methods:
            curves = [
                curve(runs[k], grid, metric, args.window)
                for k in runs
                if k[0] == scenario and k[1] == method
            ]
            if not curves:
                continue
            with warnings.catch_warnings():  # before a run's first round: nan
                warnings.simplefilter("ignore", RuntimeWarning)
                low, mid, high = np.nanquantile(np.stack(curves), [0.2, 0.5, 0.8], axis=0)
            ax.plot(grid, mid, label=method)
            ax.fill_between(grid, low, high, alpha=0.2)
        n = 2 if scenario == "hetero" else args.workers
        label = {
            "mean_return": f"training return (last {args.window} trajectories)",
            "eval_avg": "average objective (both envs)",
            "eval_0": "worker 1's env (s, 0), h = 1",
            "eval_1": "worker 2's env (-s, 1), h = 10",
        }[metric]
        ax.set_title(f"{args.env}, n={n}, {scenario}\n{label}", fontsize=9)
        ax.set_xlabel("virtual time")
        ax.xaxis.set_major_locator(plt.MaxNLocator(5))  # long budgets: labels apart
    axes[0][0].set_ylabel("episode return")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(out / f"{stem}.png", dpi=120)


# What docs/results/nigt_simulated.md reports: ``python -m experiments.nigt --suite`` runs each
# configuration in turn (arguments after --suite apply to every one, e.g. --seeds 0,1).
SUITE: tuple[tuple[str, ...], ...] = (
    ("--env", "Reacher-v5", "--lr", "2^-9,2^-7,2^-5", "--seeds", "0,1,2,3,4",
     "--tune-seeds", "0,1"),
    # n = 100: the step size the n = 10 grid chose for heterogeneous times, not tuned again
    # (the budget of 2 cores).
    ("--env", "Reacher-v5", "--workers", "100", "--scenarios", "sqrt,comm", "--budget", "20000",
     "--lr", "2^-7", "--seeds", "0,1,2,3,4"),
    ("--env", "Reacher-v5", "--workers", "100", "--scenarios", "equal", "--budget", "1500",
     "--lr", "2^-7", "--seeds", "0,1,2,3,4"),
    ("--env", "Pendulum-v1", "--gravity", "2", "--scenarios", "hetero", "--budget", "30000",
     "--envs-per-worker", "8", "--lr", "2^-7,2^-5,2^-3", "--seeds", "0,1,2,3,4",
     "--tune-seeds", "0,1"),
    ("--env", "Hopper-v5", "--horizon", "200", "--scenarios", "comm", "--budget", "150000",
     "--lr", "2^-9,2^-7,2^-5", "--seeds", "0,1,2,3,4", "--tune-seeds", "0,1"),
)  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """Run what is missing, then summarize (``--suite``: every configuration of SUITE)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--suite" in argv:
        rest = [a for a in argv if a != "--suite"]
        for number, config in enumerate(SUITE, 1):
            print(f"configuration {number} of {len(SUITE)}: {' '.join(config)}", flush=True)
            main([*config, *rest])
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="Reacher-v5")
    parser.add_argument("--gravity", type=float, default=None, help="Pendulum's g")
    parser.add_argument("--workers", type=int, default=10, help="n (not for hetero: 2)")
    parser.add_argument("--batch", type=int, default=20, help="M = M_init (Rennala, Malenia)")
    parser.add_argument(
        "--lr", type=step_sizes, default=[2**-5], help="a step size or a grid: 2^-7,2^-5"
    )
    parser.add_argument("--squash", choices=("tanh", "clip"), default="tanh")
    parser.add_argument(
        "--sync-share", type=int, default=1, help="gradients per worker per synchronized round"
    )
    parser.add_argument("--momentum", type=float, default=0.1)
    parser.add_argument("--horizon", type=int, default=50)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--budget", type=float, default=40_000.0, help="virtual time per run")
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument(
        "--tune-seeds",
        type=lambda s: [int(x) for x in s.split(",")],
        default=None,
        help="with an --lr grid: tune on these seeds, run the rest at each method's best",
    )
    parser.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS[:3]))
    parser.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    parser.add_argument(
        "--envs-per-worker", type=int, default=1, help="vectorized sampling (see simulate)"
    )
    parser.add_argument("--window", type=int, default=100, help="trajectories per return mean")
    parser.add_argument("--eval-points", type=int, default=20, help="evaluations (hetero)")
    parser.add_argument("--eval-episodes", type=int, default=16, help="per env (hetero)")
    parser.add_argument("--out", default="docs/results")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--replot", action="store_true")
    parser.add_argument("--suite", action="store_true", help="every configuration of SUITE")
    args = parser.parse_args(argv)
    for name, values, known in (
        ("scenarios", args.scenarios, SCENARIOS),
        ("methods", args.methods, METHODS),
    ):
        unknown = [v for v in values if v not in known]
        if unknown:
            parser.error(f"unknown {name} {unknown}; choose from {', '.join(known)}")
    if args.quick:
        args.budget, args.seeds = 2_000.0, [0]
    # The policies are tiny: torch's intra-op threads only contend (measured: 2-4x slower
    # per trajectory on 2 cores, benchmarks/simulate_speed.py --threads).
    torch.set_num_threads(1)
    from tqdm import tqdm

    every: dict[tuple[str, str, int, float], list[dict[str, Any]]] = {}
    g = "" if args.gravity is None else f"_g{args.gravity:g}"
    tag = (
        f"{args.env}{g}_n{args.workers}_b{args.budget:g}_e{args.envs_per_worker}"
        f"_{args.squash}_M{args.batch}_k{args.sync_share}"
    )

    def run_all(todo: list[tuple[str, str, int, float]], desc: str) -> None:
        for scenario, method, seed, lr in tqdm(todo, desc=desc):
            path = Path(args.out) / "runs" / f"{tag}_{scenario}_{method}_lr{lr:g}_s{seed}.csv"
            if path.exists():
                every[scenario, method, seed, lr] = read(path)
            elif not args.replot:
                rows = one_run(args, scenario, method, seed, lr)
                write(path, rows)
                every[scenario, method, seed, lr] = read(path)

    pairs = [(s, m) for s in args.scenarios for m in args.methods]
    # Every step size on the tuning seeds, then the other seeds at each method's best.
    tuning = args.tune_seeds if args.tune_seeds and len(args.lr) > 1 else args.seeds
    run_all([(s, m, seed, lr) for s, m in pairs for lr in args.lr for seed in tuning], "runs")
    chosen, _ = tune(args, every)
    best = {(s, m): float(chosen[s, m, seed][0]["lr"]) for s, m, seed in chosen}
    others = [seed for seed in args.seeds if seed not in tuning]
    run_all([(s, m, seed, best[s, m]) for s, m in best for seed in others], "rest")
    stem = f"nigt_sim_{args.env.split('-')[0].lower()}"
    if args.workers != 10 and args.scenarios != ["hetero"]:
        stem += f"_n{args.workers}"
    if args.scenarios != list(SCENARIOS[:3]):
        stem += "_" + "_".join(args.scenarios)
    summarize(args, every, stem)


if __name__ == "__main__":
    main()
