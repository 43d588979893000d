"""Rennala, Malenia, synchronized NIGT and AFedPG in the paper's time model (aps.learner.simulate).

    python -m experiments.nigt                       # equal, sqrt, comm on Reacher, 3 seeds
    python -m experiments.nigt --scenarios hetero    # the heterogeneous-environment experiment
    python -m experiments.nigt --quick               # a smoke run, a minute
    python -m experiments.nigt --replot              # the figures and summary from saved runs
    python -m experiments.nigt --lr 2^-7,2^-5 --batch 20,30,50   # a grid: the best per method
    python -m experiments.nigt --suite --dry-run     # the paper's protocol: what, how long
    python -m experiments.nigt --suite               # ... run it (resumable), write the page
    python -m experiments.nigt --suite --only humanoid   # a part of it (in parallel)
    python -m experiments.nigt --suite --replot      # every figure and the page, from runs/
    python -m experiments.nigt --published           # the runs of docs/results/nigt_simulated.md

Worker i (i = 1..n) needs ``h_i`` virtual time units per env step (``--time-unit step``, the
default: ``horizon * h_i`` per trajectory gradient) or per trajectory gradient
(``--time-unit gradient``), and ``kappa_i`` per aggregation of its sum (NIGT) or per
gradient sent (AFedPG). Scenarios, as in the paper's section 6 and appendix H.3:

- ``equal`` (n workers): h_i = 1, kappa_i = 0;
- ``sqrt`` (n workers): h_i = sqrt(i), kappa_i = sqrt(i);
- ``comm`` (n workers): h_i = sqrt(i), kappa_i = sqrt(i) * d^(1/4) (d = the policy's
  parameter count);
- ``hetero`` (always 2 workers): h = (1, 10), kappa = 0, and each worker has its own env:
  worker 1 observes ``(s, 0)`` and worker 2 ``(-s, 1)`` (the paper's construction). The
  objective is the average of the two envs' returns, measured off the clock: the policy
  ``theta`` is evaluated on both envs (``--eval-episodes`` episodes each, fixed reset seeds,
  sampled actions, ``horizon`` steps) at ``--eval-points`` evenly spaced virtual times.

Which unit the paper charges ``h_i`` in is not in the text aps could read (the stored copies
of arXiv 2509.24305 end after the introduction), so both run; with ``kappa_i`` as the paper
writes it, per gradient the communication-heavy scenario is communication-bound
(``kappa_i / h_i = d^(1/4)``), per env step it is not (``d^(1/4) / horizon``).

The policy (:class:`Agent`) is a Gaussian over ``u`` from 2x64 tanh MLPs: ``--std logstd``
(a state-independent log-std, the default) or ``--std softplus`` (the paper's: a
state-dependent standard deviation through Softplus). The env gets ``tanh(u)`` scaled to
the action bounds (``--squash tanh``, the default) or ``u`` clipped to them (``--squash
clip``). The squashing is an env wrapper: the policy's action space is unbounded, and
REINFORCE's gradient of ``log p(u)`` is that of ``log p(a)``, since the Jacobian of the
squashing does not depend on ``theta``.

Methods: ``rennala``, ``malenia``, ``synchronous`` (the paper's synchronized NIGT: every
worker computes ``--sync-share`` gradients, 1 by default, and waits for the slowest),
``synchronous-same-batch`` (every worker computes ``ceil(M / n)``, ``M`` the one Rennala,
or Malenia with heterogeneous envs, chose: the same batch per round), ``afedpg`` (one step
per arriving gradient, :func:`aps.learner.simulate.afedpg`).

Tuning, as the paper tunes: per (scenario, method) over its grid (:func:`grid_of`): the
step sizes of ``--lr`` (``2^-7,2^-5``: powers of two as the paper writes them), ``M`` of
``--batch`` for Rennala and Malenia, ``alpha`` of ``--alpha`` for AFedPG (its
delay-adaptive ``alpha_k`` and ``eta_k`` are not in the text aps could read, so ``alpha`` is
swept instead). With ``--pilot-budget``, a pilot on the first tuning seed rules grid points
out first (:func:`prune`: diverged, no progress, or below the best ``--pilot-keep``). Every
kept setting runs on the tuning seeds (``--tune-seeds``); the best by the mean over virtual
time of its median curve (area under the curve) is chosen, and the other seeds run at it.
The ``.txt`` records every choice in a fixed form, ``chosen M = 50, lr = 2^-7, score ...``,
with every setting tried and every one ruled out and why.

Each run stops at the same virtual-time budget. Every finished run is saved to
``<out>/runs/`` and skipped on the next call, so an interrupted call resumes. Then
``<out>/nigt_sim_<env>[_n<workers>][_per_gradient][_softplus][_<scenarios>].csv`` (every
run's curve at 100 evenly spaced times, its setting, its totals, and whether it is the one
chosen), ``.png`` (median and (20%, 80%) band over seeds against virtual time) and ``.txt``
(choices, final values, means over time, time-to-reward ratios) are written; ``--suite``
writes into ``docs/results/protocol/`` (unless ``--out``) and also writes
``nigt_protocol.md`` there, the claims page (:mod:`experiments.nigt.protocol`).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import math
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from aps import pg
from aps.errors import ApsError
from aps.learner.simulate import afedpg, simulate

METHODS = ("rennala", "malenia", "synchronous", "synchronous-same-batch", "afedpg")
SCENARIOS = ("equal", "sqrt", "comm", "hetero")


class Agent(nn.Module):
    """The paper's shape of policy: a Gaussian over ``u`` from 2-layer tanh MLPs of 64 units.

    ``std="logstd"`` (aps's default): the mean is a 2x64 tanh MLP and the log-std a learned,
    state-independent parameter (starts at -0.5). ``std="softplus"`` (the paper's): one 2x64
    tanh trunk with two heads, the mean and a state-dependent standard deviation
    ``softplus(head(s))`` (starts near ``exp(-0.5)``). The policy samples ``u`` unbounded; the
    env squashes it (:class:`TanhSquashed`) or clips it (``--squash clip``).
    """

    def __init__(self, observation_space: Any, action_space: Any, std: str = "logstd") -> None:
        super().__init__()
        size = int(np.prod(observation_space.shape))
        actions = int(np.prod(action_space.shape))
        self.std = std
        if std == "softplus":
            self.actor_mean: nn.Module = SoftplusHeads(size, actions)
            return
        last = nn.Linear(64, actions)
        with torch.no_grad():
            last.weight.mul_(0.01)
        self.actor_mean = nn.Sequential(
            nn.Linear(size, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), last
        )
        self.actor_logstd = nn.Parameter(torch.full((1, actions), -0.5))

    def __getattr__(self, name: str) -> Any:
        # With state-dependent stds, aps's Policy reads ``actor_logstd`` right after it called
        # ``actor_mean`` on a batch: the log-stds of that batch, with their graph.
        if name == "actor_logstd" and self.__dict__.get("std") == "softplus":
            return self.actor_mean.log_std
        return super().__getattr__(name)


class SoftplusHeads(nn.Module):
    """A shared 2x64 tanh trunk; returns the means, keeps ``log(softplus(.) + 1e-4)`` apart.

    The floor of 1e-4 keeps the log finite when the softplus underflows. Before the first
    call :attr:`log_std` is the initial value, shaped ``[1, D]``.
    """

    def __init__(self, size: int, actions: int) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(size, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh())
        self.mean = nn.Linear(64, actions)
        self.spread = nn.Linear(64, actions)
        initial = math.log(math.expm1(math.exp(-0.5)))  # softplus(initial) = exp(-0.5)
        with torch.no_grad():
            self.mean.weight.mul_(0.01)
            self.spread.weight.mul_(0.01)
            self.spread.bias.fill_(initial)
        self.log_std = torch.full((1, actions), -0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.trunk(x)
        self.log_std = torch.log(nn.functional.softplus(self.spread(hidden)) + 1e-4)
        mean: torch.Tensor = self.mean(hidden)
        return mean


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


def times(
    scenario: str, n: int, horizon: int, d: int, unit: str = "step"
) -> tuple[list[float], list[float]]:
    """Per-worker virtual times per trajectory gradient (h) and per aggregation (kappa).

    ``unit="step"``: the scenario's ``h_i`` is per env step, so a gradient costs
    ``horizon * h_i``; ``unit="gradient"``: ``h_i`` is per trajectory gradient, the paper's
    ``h_i`` as its complexities use it. ``kappa_i`` is the paper's in both (``sqrt(i)``,
    ``sqrt(i) d^(1/4)``), so per gradient communication weighs ``horizon`` times more.
    """
    per = float(horizon) if unit == "step" else 1.0
    if scenario == "equal":
        return [per] * n, [0.0] * n
    if scenario == "hetero":
        return [per, 10.0 * per], [0.0, 0.0]
    h = [per * math.sqrt(i) for i in range(1, n + 1)]
    kappa = [math.sqrt(i) for i in range(1, n + 1)]
    if scenario == "comm":
        kappa = [k * d**0.25 for k in kappa]
    return h, kappa


def rule(method: str, batch: int, share: int, n: int) -> Any:
    """The aggregation rule of a NIGT method (``n`` workers).

    ``synchronous-same-batch``: every worker computes ``ceil(M / n)`` gradients per round,
    so a round holds at least Rennala's ``M``.
    """
    if method == "rennala":
        return pg.Rennala(batch=batch)
    if method == "malenia":
        return pg.Malenia(batch=batch)
    if method == "synchronous-same-batch":
        return pg.Synchronous(share=math.ceil(batch / n))
    return pg.Synchronous(share=share)


class Setting(NamedTuple):
    """One point of a method's grid: the step size, ``M`` (0: none) and the momentum."""

    lr: float
    batch: int
    alpha: float


def power(value: float) -> str:
    """``0.0078125`` -> ``"2^-7"``; other values as ``%g``."""
    exponent = math.log2(value) if value > 0 else math.nan
    if math.isfinite(exponent) and exponent == round(exponent):
        return f"2^{int(exponent)}"
    return f"{value:g}"


def describe(method: str, setting: Setting) -> str:
    """A choice in fixed form: ``M = 50, lr = 2^-7``; AFedPG: ``alpha = 0.1, lr = 2^-7``."""
    parts = [f"M = {setting.batch}"] if setting.batch else []
    if method == "afedpg":
        parts.append(f"alpha = {setting.alpha:g}")
    return ", ".join([*parts, f"lr = {power(setting.lr)}"])


def grid_of(args: argparse.Namespace, method: str, batch: int | None = None) -> list[Setting]:
    """The settings a method is tuned over.

    Rennala and Malenia: every ``M`` of ``--batch`` by every step size; AFedPG: every
    ``alpha`` of ``--alpha`` by every step size; synchronized NIGT: the step sizes;
    ``synchronous-same-batch``: the step sizes at ``batch`` (the ``M`` Rennala chose).
    """
    if method in ("rennala", "malenia"):
        return [Setting(lr, m, args.momentum) for m in args.batch for lr in args.lr]
    if method == "afedpg":
        return [Setting(lr, 0, a) for a in args.alpha for lr in args.lr]
    if method == "synchronous-same-batch":
        return [Setting(lr, batch or args.batch[0], args.momentum) for lr in args.lr]
    return [Setting(lr, 0, args.momentum) for lr in args.lr]


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
    args: argparse.Namespace, scenario: str, method: str, seed: int, setting: Setting
) -> list[dict[str, Any]]:
    """One simulated training run: a row per round (NIGT) or per server step (AFedPG).

    A run that fails numerically (an aps error or a torch or numpy one on NaN weights) is
    saved as one row with its ``failed`` message, so that tuning rules its setting out.
    """
    torch.manual_seed(seed)
    n = 2 if scenario == "hetero" else args.workers
    kwargs = {**env_kwargs(args), "squash": args.squash}
    factories = [make(args.env, i, **kwargs) for i in range(n)] if scenario == "hetero" else []
    probe = (factories[0] if factories else make(args.env, **kwargs))()
    agent = Agent(probe.observation_space, probe.action_space, std=args.std)
    d = sum(p.numel() for p in agent.parameters())
    h, kappa = times(scenario, n, args.horizon, d, args.time_unit)
    envs: Any = factories or make(args.env, **kwargs)
    common = {
        "h": h,
        "kappa": kappa,
        "lr": setting.lr,
        "momentum": setting.alpha,
        "horizon": args.horizon,
        "gamma": args.gamma,
        "time_budget": args.budget,
        "seed": seed,
    }
    if method == "afedpg":
        steps = afedpg(agent, envs, **common)
    else:
        aggregator = rule(method, setting.batch, args.sync_share, n)
        steps = simulate(
            agent, envs, aggregator=aggregator, envs_per_worker=args.envs_per_worker, **common
        )
    grid = list(np.linspace(0.0, args.budget, args.eval_points + 1))[1:] if factories else []
    rows: list[dict[str, Any]] = []
    initial_evals = evaluate(agent, factories, args) if factories else []
    evals = initial_evals
    base = {"env": args.env, "scenario": scenario, "method": method, "seed": seed,
            "lr": setting.lr, "batch": setting.batch, "alpha": setting.alpha}  # fmt: skip
    try:
        for r in steps:
            row = {
                **base,
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
    except (ApsError, ValueError, RuntimeError, FloatingPointError) as exc:
        failed = {**base, "iteration": 0, "time": args.budget, "compute": 0.0,
                  "communication": 0.0, "used": 0, "delay": 0, "mean_return": math.nan,
                  "failed": f"{type(exc).__name__}: {exc}"[:200]}  # fmt: skip
        return [failed]
    if factories:
        initial = {**rows[0], "iteration": -1, "time": 0.0, "used": 0, "mean_return": math.nan}
        for i, value in enumerate(initial_evals):
            initial[f"eval_{i}"] = value
        initial["eval_avg"] = float(np.mean(initial_evals))
        rows.insert(0, initial)
    return rows


def write(path: Path, rows: list[dict[str, Any]]) -> None:
    """Write rows as CSV, atomically; gzip-compressed when ``path`` ends in ``.gz``.

    The gzip header carries no name and a zero mtime, so the same rows give the same bytes
    (saved runs are kept in the repository, and rewriting one must not change it).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(key for row in rows for key in row))
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=fields)
    writer.writeheader()
    writer.writerows(rows)
    data = text.getvalue().encode()
    if path.suffix == ".gz":
        data = gzip.compress(data, compresslevel=9, mtime=0)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # a run is saved whole or not at all: resuming never sees half a run


def read(path: Path) -> list[dict[str, Any]]:
    """Read rows of a CSV, plain or gzip-compressed (by the ``.gz`` suffix)."""
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return list(csv.DictReader(io.StringIO(data.decode(), newline="")))


def saved_run(runs: Path, name: str) -> Path:
    """Where run ``name`` (``...csv``) is saved: ``name.gz``, or a plain ``name`` from before."""
    plain = runs / name
    return plain if plain.exists() else runs / (name + ".gz")


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
    method: Any = "linear" if np.isfinite(array).all() else "inverted_cdf"
    q = np.quantile(array, [0.2, 0.5, 0.8], method=method)
    return f"median {q[1]:.2f} (20%: {q[0]:.2f}, 80%: {q[2]:.2f})"


Key = tuple[str, str, int, Setting]
Every = dict[Key, list[dict[str, Any]]]
Runs = dict[tuple[str, str, int], list[dict[str, Any]]]


def metric_of(scenario: str) -> str:
    """The metric a scenario is judged by."""
    return "eval_avg" if scenario == "hetero" else "mean_return"


def proposed_of(scenario: str) -> str:
    """The paper's method for a scenario: Malenia with heterogeneous envs, else Rennala."""
    return "malenia" if scenario == "hetero" else "rennala"


def failure(rows: list[dict[str, Any]]) -> str:
    """A failed run's message ('' when it did not fail)."""
    return next((str(r["failed"]) for r in rows if r.get("failed")), "")


def prune(
    args: argparse.Namespace, pilot: Every, scenario: str, method: str, grid: list[Setting]
) -> tuple[list[Setting], list[str]]:
    """The settings a pilot keeps for tuning, and a line for each one it rules out, and why.

    The pilot is one run per setting, on the first tuning seed, over ``--pilot-budget``.
    Ruled out: a run that diverged (failed, or no finite return), one that made no
    progress (its curve ends at or below where it started), and, of the rest, all but the
    ``--pilot-keep`` best by the mean of the curve over time. When no setting progressed,
    the best that did not diverge are kept all the same; so is every setting whose first
    round ended after the pilot's budget (the pilot cannot judge it).
    """
    metric = metric_of(scenario)
    points = np.linspace(0, args.pilot_budget, 200)
    seed = (args.tune_seeds or args.seeds)[0]
    scores: dict[Setting, float] = {}
    reasons: dict[Setting, str] = {}
    unjudged: list[Setting] = []
    for setting in grid:
        rows = pilot.get((scenario, method, seed, setting))
        if rows is None:
            continue
        if failure(rows):
            reasons[setting] = f"diverged ({failure(rows)})"
            continue
        values = curve(rows, points, metric, args.window)
        known = values[np.isfinite(values)]
        if not known.size:
            if any(_finite(r.get("mean_return")) for r in rows if int(r["iteration"]) >= 0):
                unjudged.append(setting)  # its first round ended after the pilot's budget
            else:
                reasons[setting] = "diverged (no finite return)"
            continue
        scores[setting] = float(known.mean())
        if known[-1] <= known[0]:
            reasons[setting] = f"no progress ({known[0]:.1f} to {known[-1]:.1f})"
    progressing = [s for s in scores if s not in reasons]
    keep = sorted(progressing or scores, key=lambda s: -scores[s])[: args.pilot_keep]
    for setting, value in scores.items():
        if setting not in keep and setting not in reasons:
            reasons[setting] = f"below the best {args.pilot_keep} in the pilot ({value:.1f})"
    lines = [f"{describe(method, s)}: {why}" for s, why in sorted(reasons.items()) if s not in keep]
    return sorted([*keep, *unjudged]), lines


def _finite(value: Any) -> bool:
    return value not in (None, "") and math.isfinite(float(value))


def tune(
    args: argparse.Namespace, every: Every, notes: dict[tuple[str, str], list[str]] | None = None
) -> tuple[dict[tuple[str, str], Setting], Runs, list[str]]:
    """Per (scenario, method), the best setting, its runs, and a line that says why.

    The best setting has the highest mean over virtual time of its median curve over the
    tuning seeds (``args.tune_seeds``, or every seed): the area under the curve. A setting
    with a failed run, or no finite value, is ruled out as diverged. The chosen runs are
    those of every seed at the best setting. ``notes`` adds what a pilot ruled out.
    """
    tuning = set(args.tune_seeds or args.seeds)
    grid = np.linspace(0, args.budget, 200)
    best_of: dict[tuple[str, str], Setting] = {}
    chosen: Runs = {}
    lines = []
    for scenario in args.scenarios:
        metric = metric_of(scenario)
        for method in args.methods:
            settings = sorted({k[3] for k in every if k[:2] == (scenario, method)})
            scores: dict[Setting, float] = {}
            ruled = list((notes or {}).get((scenario, method), []))
            for setting in settings:
                group = [
                    rows
                    for (s, m, seed, st), rows in every.items()
                    if (s, m, st) == (scenario, method, setting) and seed in tuning
                ]
                if not group:
                    continue
                failed = next((failure(rows) for rows in group if failure(rows)), "")
                if not failed:
                    with warnings.catch_warnings():  # before a run's first round: nan
                        warnings.simplefilter("ignore", RuntimeWarning)
                        curves = np.stack([curve(r, grid, metric, args.window) for r in group])
                        value = float(np.nanmean(np.nanmedian(curves, axis=0)))
                    if math.isfinite(value):
                        scores[setting] = value
                        continue
                ruled.append(f"{describe(method, setting)}: diverged ({failed or 'no value'})")
            if not scores:
                if ruled:
                    lines.append(f"{args.env} {scenario} {method}: every setting ruled out: "
                                 + "; ".join(ruled))  # fmt: skip
                continue
            best = max(scores, key=lambda st: scores[st])
            best_of[scenario, method] = best
            for (s, m, seed, st), rows in every.items():
                if (s, m, st) == (scenario, method, best):
                    chosen[s, m, seed] = rows
            tried = "; ".join(f"{describe(method, st)}: {v:.2f}" for st, v in scores.items())
            line = (
                f"{args.env} {scenario} {method}: chosen {describe(method, best)}, score "
                f"{scores[best]:.2f} (the mean over time of the median {metric} over seeds "
                f"{sorted(tuning)}); tried {tried}"
            )
            lines.append(line + (f"; ruled out {'; '.join(ruled)}" if ruled else ""))
    return best_of, chosen, lines


def trim(rows: list[dict[str, Any]], budget: float) -> list[dict[str, Any]]:
    """A run's rows up to virtual time ``budget`` (a shorter run, for the budget's effect)."""
    return [r for r in rows if float(r["time"]) <= budget]


def target_of(runs: Runs, scenario: str, metric: str, window: int, budget: float) -> float:
    """80% of the way from the median initial value to the median final value of a scenario.

    Over every chosen run of the scenario (all methods), each cut at ``budget``.
    """
    first, last = [], []
    for key, rows in runs.items():
        if key[0] != scenario:
            continue
        cut = trim(rows, budget)
        _, y = series(cut, metric, window)
        if y.size:
            first.append(y[0])
            last.append(curve(cut, np.array([budget]), metric, window)[-1])
    if not first:
        return math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        start, end = float(np.nanmedian(first)), float(np.nanmedian(last))
    return start + 0.8 * (end - start)


def claim_ratios(
    runs: Runs, scenario: str, proposed: str, baseline: str, window: int, budget: float
) -> tuple[float, list[float]]:
    """The target and, per seed both methods ran, time to it of ``proposed`` / ``baseline``."""
    metric = metric_of(scenario)
    target = target_of(runs, scenario, metric, window, budget)
    ratios = []
    for s, m, seed in sorted(runs):
        if (s, m) == (scenario, proposed) and (scenario, baseline, seed) in runs:
            a = time_to(trim(runs[s, m, seed], budget), target, metric, window)
            b = time_to(trim(runs[scenario, baseline, seed], budget), target, metric, window)
            ratios.append(ratio(a, b))
    return target, ratios


def start_to_end(rows: list[dict[str, Any]], metric: str, window: int, budget: float) -> str:
    """``-42.1 -> -27.3``: a run's metric at its start and at ``budget``."""
    cut = trim(rows, budget)
    _, y = series(cut, metric, window)
    if not y.size:
        return "no value"
    return f"{y[0]:.1f} -> {curve(cut, np.array([budget]), metric, window)[-1]:.1f}"


def summarize(
    args: argparse.Namespace,
    every: Every,
    stem: str,
    notes: dict[tuple[str, str], list[str]] | None = None,
) -> tuple[dict[tuple[str, str], Setting], Runs]:
    """Write the combined CSV, the choices, final values, time-to-reward ratios and figure."""
    out = Path(args.out)
    best_of, runs, lines = tune(args, every, notes)
    grid = np.linspace(0, args.budget, 200)
    # Every run's curve at 100 times, with its totals: small enough to commit (a run's every
    # round stays in runs/).
    points = np.linspace(0, args.budget, 101)[1:]
    compact = []
    for (scenario, method, seed, setting), rows in every.items():
        metric = metric_of(scenario)
        steps = [r for r in rows if int(r["iteration"]) >= 0]
        totals = {
            "rounds": len(steps),
            "used": sum(int(r["used"]) for r in steps),
            "communication": sum(float(r["communication"]) for r in steps),
            "chosen": int(runs.get((scenario, method, seed)) is rows),
        }
        values = curve(rows, points, metric, args.window)
        compact += [
            {"scenario": scenario, "method": method, "lr": setting.lr, "batch": setting.batch,
             "alpha": setting.alpha, "seed": seed, **totals, "metric": metric,
             "time": float(t), "value": float(v)}
            for t, v in zip(points, values, strict=True)
        ]  # fmt: skip
    write(out / f"{stem}.csv", compact)
    scenarios = [s for s in args.scenarios if any(k[0] == s for k in runs)]
    for scenario in scenarios:
        metric = metric_of(scenario)
        proposed = proposed_of(scenario)
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
        for method in args.methods:
            if method == proposed:
                continue
            target, ratios = claim_ratios(
                runs, scenario, proposed, method, args.window, args.budget
            )
            lines.append(
                f"{args.env} {scenario}: time to {metric} {target:.1f}, {proposed} / {method}: "
                f"{quantiles(ratios)} over {len(ratios)} seeds"
            )
    text = "\n".join(lines)
    print(text)
    (out / f"{stem}.txt").write_text(text + "\n")
    plot(args, runs, scenarios, grid, out / f"{stem}.png")
    return best_of, runs


def plot(
    args: argparse.Namespace, runs: Runs, scenarios: list[str], grid: np.ndarray, path: Path
) -> None:
    """Median and (20%, 80%) band over seeds of every method, one panel per scenario."""
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
    if not panels:
        return
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
        ax.set_title(f"{args.env}, n={n}, {scenario}, h per {args.time_unit}\n{label}", fontsize=9)
        ax.set_xlabel("virtual time")
        ax.xaxis.set_major_locator(plt.MaxNLocator(5))  # long budgets: labels apart
    axes[0][0].set_ylabel("episode return")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# What docs/results/nigt_simulated.md reports (measured 2026-12-01): ``python -m
# experiments.nigt --published`` runs each configuration in turn (arguments after it apply
# to every one, e.g. --replot).
PUBLISHED: tuple[tuple[str, ...], ...] = (
    ("--env", "Reacher-v5", "--lr", "2^-9,2^-7,2^-5", "--seeds", "0,1,2,3,4",
     "--tune-seeds", "0,1", "--methods", "rennala,malenia,synchronous,afedpg"),
    ("--env", "Reacher-v5", "--workers", "100", "--scenarios", "sqrt,comm", "--budget", "20000",
     "--lr", "2^-7", "--seeds", "0,1,2,3,4", "--methods", "rennala,malenia,synchronous,afedpg"),
    ("--env", "Reacher-v5", "--workers", "100", "--scenarios", "equal", "--budget", "1500",
     "--lr", "2^-7", "--seeds", "0,1,2,3,4", "--methods", "rennala,malenia,synchronous,afedpg"),
    ("--env", "Pendulum-v1", "--gravity", "2", "--scenarios", "hetero", "--budget", "30000",
     "--envs-per-worker", "8", "--lr", "2^-7,2^-5,2^-3", "--seeds", "0,1,2,3,4",
     "--tune-seeds", "0,1", "--methods", "rennala,malenia,synchronous,afedpg"),
    ("--env", "Hopper-v5", "--horizon", "200", "--scenarios", "comm", "--budget", "150000",
     "--lr", "2^-9,2^-7,2^-5", "--seeds", "0,1,2,3,4", "--tune-seeds", "0,1",
     "--methods", "rennala,malenia,synchronous,afedpg"),
)  # fmt: skip

# The paper's protocol (issue 28): per (scenario, method) M in {20, 30, 50} (Rennala,
# Malenia), the step size over 2^-10 .. 2^-1 and AFedPG's alpha over the paper's momentum
# grid; a pilot on seed 0 rules points out, seeds 0 and 1 tune, the others run at the
# choice; n = 100 tuned again; both synchronized baselines; both time units on Reacher.
GRID = ("--lr", "2^-10,2^-9,2^-8,2^-7,2^-6,2^-5,2^-4,2^-3,2^-2,2^-1", "--batch", "20,30,50",
        "--alpha", "0.001,0.01,0.1", "--tune-seeds", "0,1", "--pilot-keep", "3")  # fmt: skip
SUITE: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reacher", ("--env", "Reacher-v5", "--budget", "40000", "--pilot-budget", "10000",
                 "--seeds", "0,1,2,3,4", *GRID)),
    ("reacher-per-gradient", ("--env", "Reacher-v5", "--time-unit", "gradient",
                              "--budget", "800", "--pilot-budget", "200",
                              "--seeds", "0,1,2,3,4", *GRID)),
    ("reacher-n100", ("--env", "Reacher-v5", "--workers", "100", "--scenarios", "sqrt,comm",
                      "--budget", "20000", "--pilot-budget", "5000", "--seeds", "0,1,2,3,4",
                      *GRID)),
    ("reacher-n100-equal", ("--env", "Reacher-v5", "--workers", "100", "--scenarios", "equal",
                            "--budget", "1500", "--pilot-budget", "750",
                            "--seeds", "0,1,2,3,4", *GRID)),
    ("humanoid", ("--env", "Humanoid-v5", "--horizon", "200", "--budget", "60000",
                  "--pilot-budget", "15000", "--std", "softplus", "--seeds", "0,1,2,3,4",
                  *GRID)),
    ("pendulum-hetero", ("--env", "Pendulum-v1", "--gravity", "2", "--scenarios", "hetero",
                         "--budget", "30000", "--pilot-budget", "7500",
                         "--envs-per-worker", "8", "--seeds", "0,1,2,3,4", *GRID)),
    ("hopper", ("--env", "Hopper-v5", "--horizon", "200", "--scenarios", "comm",
                "--budget", "150000", "--pilot-budget", "40000", "--seeds", "0,1,2,3,4",
                *GRID)),
)  # fmt: skip


def parser() -> argparse.ArgumentParser:
    """The command line of one configuration."""
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--env", default="Reacher-v5")
    p.add_argument("--gravity", type=float, default=None, help="Pendulum's g")
    p.add_argument("--workers", type=int, default=10, help="n (not for hetero: 2)")
    p.add_argument("--batch", type=ints, default=[20], help="M = M_init, or a grid: 20,30,50")
    p.add_argument("--lr", type=step_sizes, default=[2**-5], help="a step size or a grid")
    p.add_argument("--alpha", type=floats, default=None, help="AFedPG's alpha (a grid)")
    p.add_argument("--squash", choices=("tanh", "clip"), default="tanh")
    p.add_argument("--std", choices=("logstd", "softplus"), default="logstd")
    p.add_argument("--time-unit", choices=("step", "gradient"), default="step")
    p.add_argument("--sync-share", type=int, default=1, help="synchronous: gradients per worker")
    p.add_argument("--momentum", type=float, default=0.1)
    p.add_argument("--horizon", type=int, default=50)
    p.add_argument("--gamma", type=float, default=0.99)
    p.add_argument("--budget", type=float, default=40_000.0, help="virtual time per run")
    p.add_argument("--pilot-budget", type=float, default=None, help="rule grid points out")
    p.add_argument("--pilot-keep", type=int, default=3, help="settings a pilot keeps")
    p.add_argument("--seeds", type=ints, default=[0, 1, 2])
    p.add_argument("--tune-seeds", type=ints, default=None, help="tune on these seeds")
    p.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS[:3]))
    p.add_argument("--methods", type=lambda s: s.split(","), default=list(METHODS))
    p.add_argument("--envs-per-worker", type=int, default=1, help="vectorized sampling")
    p.add_argument("--window", type=int, default=100, help="trajectories per return mean")
    p.add_argument("--eval-points", type=int, default=20, help="evaluations (hetero)")
    p.add_argument("--eval-episodes", type=int, default=16, help="per env (hetero)")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--replot", action="store_true")
    return p


def configure(argv: list[str]) -> argparse.Namespace:
    """Parse and check one configuration's arguments."""
    p = parser()
    args = p.parse_args(argv)
    for name, values, known in (
        ("scenarios", args.scenarios, SCENARIOS),
        ("methods", args.methods, METHODS),
    ):
        unknown = [v for v in values if v not in known]
        if unknown:
            p.error(f"unknown {name} {unknown}; choose from {', '.join(known)}")
    if args.alpha is None:
        args.alpha = [args.momentum]
    if any(not 0 < a <= 1 for a in args.alpha) or any(m < 1 for m in args.batch):
        p.error("--alpha needs values in (0, 1] and --batch ints >= 1")
    if args.quick:
        args.budget, args.seeds = 2_000.0, [0]
        args.pilot_budget = None
    if args.pilot_budget is not None and not 0 < args.pilot_budget <= args.budget:
        p.error(f"--pilot-budget must be in (0, --budget], got {args.pilot_budget}")
    return args


def stem_of(args: argparse.Namespace) -> str:
    """The summary files' name: ``nigt_sim_<env>[_n<workers>][_<options>][_<scenarios>]``."""
    stem = f"nigt_sim_{args.env.split('-')[0].lower()}"
    if args.workers != 10 and args.scenarios != ["hetero"]:
        stem += f"_n{args.workers}"
    if args.time_unit != "step":
        stem += f"_per_{args.time_unit}"
    if args.std != "logstd":
        stem += f"_{args.std}"
    if args.scenarios != list(SCENARIOS[:3]):
        stem += "_" + "_".join(args.scenarios)
    return stem


@dataclass
class Result:
    """One configuration's runs: every run, the choices and the chosen runs."""

    args: argparse.Namespace
    every: Every
    best: dict[tuple[str, str], Setting]
    runs: Runs
    stem: str


def run_configuration(args: argparse.Namespace) -> Result:
    """Run what is missing of one configuration (pilot, tuning, other seeds), then summarize."""
    # The policies are tiny: torch's intra-op threads only contend (measured: 2-4x slower
    # per trajectory on 2 cores, benchmarks/simulate_speed.py --threads).
    torch.set_num_threads(1)
    from tqdm import tqdm

    every: Every = {}
    pilot: Every = {}
    notes: dict[tuple[str, str], list[str]] = {}
    g = "" if args.gravity is None else f"_g{args.gravity:g}"
    tag = (
        f"{args.env}{g}_n{args.workers}_e{args.envs_per_worker}_{args.squash}_{args.std}"
        f"_{args.time_unit}_k{args.sync_share}_h{args.horizon}"
    )

    def run_all(todo: list[Key], desc: str, into: Every, budget: float) -> None:
        for scenario, method, seed, st in tqdm(todo, desc=desc):
            name = (
                f"{tag}_b{budget:g}_{scenario}_{method}_lr{st.lr:g}_M{st.batch}"
                f"_a{st.alpha:g}_s{seed}.csv"
            )
            path = saved_run(Path(args.out) / "runs", name)
            if path.exists():
                into[scenario, method, seed, st] = read(path)
            elif not args.replot:
                rows = one_run(argparse.Namespace(**{**vars(args), "budget": budget}),
                               scenario, method, seed, st)  # fmt: skip
                write(path, rows)
                into[scenario, method, seed, st] = read(path)

    tuning = args.tune_seeds or args.seeds

    def tune_methods(methods: list[str], batch: dict[str, int]) -> None:
        """The pilot (with a grid and --pilot-budget), then every kept setting on ``tuning``."""
        for scenario in args.scenarios:
            for method in methods:
                grid = grid_of(args, method, batch.get(scenario))
                if args.pilot_budget is not None and len(grid) > 1:
                    todo = [(scenario, method, tuning[0], st) for st in grid]
                    run_all(todo, f"pilot {scenario} {method}", pilot, args.pilot_budget)
                    grid, notes[scenario, method] = prune(args, pilot, scenario, method, grid)
                todo = [(scenario, method, seed, st) for st in grid for seed in tuning]
                run_all(todo, f"tune {scenario} {method}", every, args.budget)

    first = [m for m in args.methods if m != "synchronous-same-batch"]
    tune_methods(first, {})
    if "synchronous-same-batch" in args.methods:
        best, _, _ = tune(argparse.Namespace(**{**vars(args), "methods": first}), every)
        # The same batch as the paper's method: the M it chose in this scenario.
        batch = {
            s: best[s, proposed_of(s)].batch for s in args.scenarios if (s, proposed_of(s)) in best
        }
        tune_methods(["synchronous-same-batch"], batch)
    best, _, _ = tune(args, every)
    others = [seed for seed in args.seeds if seed not in tuning]
    run_all([(s, m, seed, st) for (s, m), st in best.items() for seed in others], "rest",
            every, args.budget)  # fmt: skip
    stem = stem_of(args)
    if not every:  # --replot before any run was saved: leave earlier summaries alone
        print(f"no saved runs under {Path(args.out) / 'runs'} for {stem}")
        return Result(args, every, {}, {}, stem)
    best, runs = summarize(args, every, stem, notes)
    return Result(args, every, best, runs, stem)


def main(argv: list[str] | None = None) -> list[Result]:
    """Run what is missing, then summarize (``--suite``: the paper's protocol, every one).

    ``--suite --dry-run`` prints each configuration's runs and an estimate of its time;
    ``--suite`` also writes the claims page (:mod:`experiments.nigt.protocol`).
    """
    from experiments.nigt import protocol

    argv = sys.argv[1:] if argv is None else argv
    if "--suite" in argv or "--published" in argv:
        suite = SUITE if "--suite" in argv else tuple((f"c{i}", c) for i, c in
                                                      enumerate(PUBLISHED, 1))  # fmt: skip
        rest = [a for a in argv if a not in ("--suite", "--published", "--dry-run")]
        if "--suite" in argv:  # apart from the published page's files; a later --out wins
            rest = ["--out", "docs/results/protocol", *rest]
        only = None
        if "--only" in rest:  # --only reacher,hopper: a part of the suite (one process each)
            at = rest.index("--only")
            only = rest[at + 1].split(",") if at + 1 < len(rest) else []
            del rest[at : at + 2]
            unknown = sorted(set(only) - {name for name, _ in suite})
            if unknown or not only:
                names = ", ".join(name for name, _ in suite)
                raise SystemExit(f"--only takes suite names ({names}), got {unknown or only}")
            suite = tuple((name, c) for name, c in suite if name in only)
        if "--dry-run" in argv:
            print(protocol.estimate([(n, configure([*c, *rest])) for n, c in suite]))
            return []
        results = []
        for number, (name, config) in enumerate(suite, 1):
            print(f"configuration {number} of {len(suite)} ({name}): {' '.join(config)}")
            results.append(run_configuration(configure([*config, *rest])))
        if "--suite" in argv and results:
            # Claims of configurations not run here stay "pending"; --suite --replot after
            # every part has run writes the whole page.
            names = [name for name, _ in suite]
            page = protocol.page(dict(zip(names, results, strict=True)))
            out = Path(results[0].args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "nigt_protocol.md").write_text(page)
        return results
    return [run_configuration(configure(argv))]


if __name__ == "__main__":
    main()
