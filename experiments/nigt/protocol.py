"""The paper's claims, settled from a suite's runs: verdicts, sensitivity, the time it takes.

:func:`page` writes ``docs/results/protocol/nigt_protocol.md`` from the results of
``python -m experiments.nigt --suite`` (or ``--suite --replot``, from the saved runs). Per
claim of arXiv 2509.24305 it gives the ratio of the paper's method's time to a target over
the baseline's, per seed, as its median and (20%, 80%) band; every run's start-to-end range
beside it (a ratio between runs that barely learn is noise); and a sensitivity table of the
same ratio under other protocol choices: the other time unit, each ``M``, the other
synchronized baseline and half the budget.

The verdict rule, fixed before any run: a claim that the paper's method is faster is
*reproduced* when the band lies below 1, *contradicted* when it lies above 1, otherwise
*undecided*; a claim of a tie is *reproduced* when the band contains 1 and *contradicted*
when it does not.

:func:`estimate` prints what ``--suite`` will run and how long that takes here, from the
CPU time per trajectory gradient measured at the initial policy (``SECONDS_PER_GRADIENT``).
"""

from __future__ import annotations

import argparse
import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from experiments.nigt.__main__ import (
    Result,
    Runs,
    Setting,
    claim_ratios,
    curve,
    describe,
    grid_of,
    metric_of,
    start_to_end,
    times,
)


@dataclass(frozen=True)
class Claim:
    """A claim of the paper: ``proposed`` reaches the target sooner than ``baseline``, or ties."""

    text: str
    config: str
    scenario: str
    proposed: str
    baseline: str
    side: str = "faster"  # or "tie"
    pair: str | None = None  # the same configuration in the other time unit


CLAIMS: tuple[Claim, ...] = (
    Claim("Humanoid, equal times: the methods are almost identical", "humanoid", "equal",
          "rennala", "synchronous", "tie"),
    Claim("Humanoid, equal times: the methods are almost identical", "humanoid", "equal",
          "rennala", "afedpg", "tie"),
    Claim("Humanoid, h_i = sqrt(i): Rennala NIGT converges faster", "humanoid", "sqrt",
          "rennala", "synchronous"),
    Claim("Humanoid, h_i = sqrt(i): Rennala NIGT converges faster", "humanoid", "sqrt",
          "rennala", "afedpg"),
    Claim("Humanoid, communication-heavy: Rennala NIGT is the most robust", "humanoid", "comm",
          "rennala", "synchronous"),
    Claim("Humanoid, communication-heavy: Rennala NIGT is the most robust", "humanoid", "comm",
          "rennala", "afedpg"),
    Claim("Reacher, communication-heavy: a clear win", "reacher", "comm", "rennala",
          "synchronous", pair="reacher-per-gradient"),
    Claim("Reacher, communication-heavy: a clear win", "reacher", "comm", "rennala", "afedpg",
          pair="reacher-per-gradient"),
    Claim("Reacher, h_i = sqrt(i): Rennala NIGT converges faster", "reacher", "sqrt",
          "rennala", "synchronous", pair="reacher-per-gradient"),
    Claim("Hopper, communication-heavy: Rennala NIGT ahead by a small gap", "hopper", "comm",
          "rennala", "synchronous"),
    Claim("n = 100, equal times: a tie", "reacher-n100-equal", "equal", "rennala",
          "synchronous", "tie"),
    Claim("n = 100, h_i = sqrt(i): Rennala NIGT fastest", "reacher-n100", "sqrt", "rennala",
          "synchronous"),
    Claim("n = 100, communication-heavy: Rennala NIGT fastest", "reacher-n100", "comm",
          "rennala", "synchronous"),
    Claim("n = 100, communication-heavy: Rennala NIGT fastest", "reacher-n100", "comm",
          "rennala", "afedpg"),
    Claim("heterogeneous envs: Malenia NIGT reaches a higher reward than AFedPG",
          "pendulum-hetero", "hetero", "malenia", "afedpg"),
)  # fmt: skip

# CPU seconds per trajectory gradient at the initial policy, measured 2026-12-02 on this
# 2-core machine under load (one torch thread; NIGT rounds of M = 50 sampled together,
# AFedPG one trajectory at a time). Episodes that end early (Hopper, Humanoid) get longer as
# the policy learns, so the estimate is low for them.
SECONDS_PER_GRADIENT: dict[str, tuple[float, float]] = {
    "Reacher-v5": (0.0069, 0.0105),
    "Hopper-v5": (0.041, 0.019),
    "Humanoid-v5": (0.041, 0.081),
    "Pendulum-v1": (0.0029, 0.0071),
}
# CPU seconds per run beyond its gradients (making envs and samplers, writing the CSV):
# a reduced suite here (196 runs, about 15,000 gradients) took 135 s of CPU.
SECONDS_PER_RUN = 0.25


def band(values: list[float]) -> tuple[float, float, float] | None:
    """(20%, median, 80%) of ratios (nan: neither reached the target, left out)."""
    known = np.asarray([v for v in values if not math.isnan(v)], dtype=float)
    if not known.size:
        return None
    method: Any = "linear" if np.isfinite(known).all() else "inverted_cdf"
    low, mid, high = np.quantile(known, [0.2, 0.5, 0.8], method=method)
    return float(low), float(mid), float(high)


def verdict(values: list[float], side: str) -> str:
    """The fixed rule of the module docstring."""
    q = band(values)
    if q is None:
        return "undecided (no run reached the target)"
    low, _, high = q
    if side == "tie":
        return "reproduced" if low <= 1.0 <= high else "contradicted"
    if high < 1.0:
        return "reproduced"
    return "contradicted" if low > 1.0 else "undecided"


def show(values: list[float]) -> str:
    """``0.81 (0.47, 1.04), 5 seeds``, saying which side never reached the target.

    A ratio of 0 is a baseline that never reached the target (``ratio`` of a finite time and
    an infinite one), and inf is the paper's method never reaching it: printed bare, "0.00"
    reads as a measured speed-up, so the count of such seeds is written out beside it. (Both
    methods start from the seed's same policy, so a target met at time 0 is met by both, and
    gives 1.)
    """
    q = band(values)
    if q is None:
        return f"undefined, {len(values)} seeds"
    text = f"{q[1]:.2f} ({q[0]:.2f}, {q[2]:.2f}), {len(values)} seeds"
    baseline_never = sum(v == 0.0 for v in values)
    proposed_never = sum(math.isinf(v) for v in values)
    if baseline_never:
        text += f"; the baseline never reached the target on {baseline_never}"
    if proposed_never:
        text += f"; the paper's method never reached it on {proposed_never}"
    return text


def at_batch(result: Result, claim: Claim, batch: int) -> Runs | None:
    """The chosen runs with the paper's method at ``M = batch`` (its best step size there).

    Only the tuning seeds ran every ``M`` (every seed ran the chosen one), so the proposed
    method's runs are those of the seeds that ran that setting.
    """
    args = result.args
    tuning = set(args.tune_seeds or args.seeds)
    grid = np.linspace(0, args.budget, 200)
    metric = metric_of(claim.scenario)
    scores: dict[Setting, float] = {}
    for s, m, seed, st in result.every:
        if (s, m, st.batch) == (claim.scenario, claim.proposed, batch) and seed in tuning:
            scores.setdefault(st, 0.0)
    best = None
    for st in scores:
        curves = [
            curve(rows, grid, metric, args.window)
            for (s, m, seed, x), rows in result.every.items()
            if (s, m, x) == (claim.scenario, claim.proposed, st) and seed in tuning
        ]
        with warnings.catch_warnings():  # before a run's first round: nan
            warnings.simplefilter("ignore", RuntimeWarning)
            value = float(np.nanmean(np.nanmedian(np.stack(curves), axis=0)))
        if math.isfinite(value) and (best is None or value > scores[best]):
            best = st
        scores[st] = value
    if best is None:
        return None
    runs = {k: v for k, v in result.runs.items() if k[:2] != (claim.scenario, claim.proposed)}
    for (s, m, seed, st), rows in result.every.items():
        if (s, m, st) == (claim.scenario, claim.proposed, best):
            runs[s, m, seed] = rows
    return runs


def page(results: Mapping[str, Result]) -> str:
    """The claims page, in Markdown."""
    lines = [
        "# The paper's claims under its whole protocol (generated)",
        "",
        "Written by `python -m experiments.nigt --suite` (again from the saved runs with",
        "`--suite --replot`); the protocol and the verdict rule are in",
        "`experiments/nigt/protocol.py`. Ratio: the paper's method's virtual time to the",
        "target over the baseline's, per seed; median (20%, 80%). Below 1: the paper's",
        "method was sooner. Verdict: a *faster* claim is reproduced when the band lies below",
        "1, contradicted when above, else undecided; a *tie* is reproduced when the band",
        "contains 1, else contradicted.",
        "",
        "## Verdicts",
        "",
        "| claim | config, scenario | ratio | target "
        "| start -> end per run (paper's; baseline) | verdict |",
        "|---|---|---|---|---|---|",
    ]  # fmt: skip
    rows_sens = []
    for claim in CLAIMS:
        result = results.get(claim.config)
        ran = result is not None and any(k[0] == claim.scenario for k in result.runs)
        if result is None or not ran:
            lines.append(
                f"| {claim.text} ({claim.proposed} / {claim.baseline}) | {claim.config}, "
                f"{claim.scenario} | not run | | | pending |"
            )
            continue
        args = result.args
        target, ratios = claim_ratios(
            result.runs, claim.scenario, claim.proposed, claim.baseline, args.window, args.budget
        )
        metric = metric_of(claim.scenario)
        ranges = "; ".join(
            ", ".join(
                start_to_end(rows, metric, args.window, args.budget)
                for (s, m, _), rows in sorted(result.runs.items())
                if (s, m) == (claim.scenario, method)
            )
            for method in (claim.proposed, claim.baseline)
        )
        lines.append(
            f"| {claim.text} ({claim.proposed} / {claim.baseline}) | {claim.config}, "
            f"{claim.scenario} | {show(ratios)} | {target:.1f} | {ranges} | "
            f"**{verdict(ratios, claim.side)}** |"
        )
        rows_sens.append(sensitivity(results, claim, ratios))
    lines += [
        "",
        "## Sensitivity: which protocol choice moves which claim",
        "",
        "The same ratio under one change each. `M`: the paper's method at that `M` (its best",
        "step size there; the tuning seeds, or every seed for the chosen `M`). Other",
        "baseline: against the other synchronized baseline. Half budget: every run cut at",
        "half the virtual time (target recomputed).",
        "",
        "| claim | full protocol | other time unit | M = 20 | M = 30 | M = 50 "
        "| other synchronized baseline | half budget |",
        "|---|---|---|---|---|---|---|---|",
        *rows_sens,
        "",
        "## Choices",
        "",
        "| config | scenario | method | chosen |",
        "|---|---|---|---|",
    ]
    for name, result in results.items():
        for (scenario, method), st in sorted(result.best.items()):
            lines.append(f"| {name} | {scenario} | {method} | `{describe(method, st)}` |")
    return "\n".join(lines) + "\n"


def sensitivity(results: Mapping[str, Result], claim: Claim, full: list[float]) -> str:
    """One row of the sensitivity table."""
    result = results[claim.config]
    args = result.args
    cells = [show(full)]
    paired = results.get(claim.pair) if claim.pair else None
    if paired is not None and claim.scenario in paired.args.scenarios:
        _, values = claim_ratios(paired.runs, claim.scenario, claim.proposed, claim.baseline,
                                 paired.args.window, paired.args.budget)  # fmt: skip
        cells.append(f"{show(values)} (per {paired.args.time_unit})")
    else:
        cells.append("not run")
    for batch in (20, 30, 50):
        runs = at_batch(result, claim, batch) if claim.proposed in ("rennala", "malenia") else None
        if runs is None:
            cells.append("n/a")
            continue
        _, values = claim_ratios(runs, claim.scenario, claim.proposed, claim.baseline,
                                 args.window, args.budget)  # fmt: skip
        cells.append(show(values))
    other = {"synchronous": "synchronous-same-batch", "synchronous-same-batch": "synchronous"}
    if claim.baseline in other:
        _, values = claim_ratios(result.runs, claim.scenario, claim.proposed,
                                 other[claim.baseline], args.window, args.budget)  # fmt: skip
        cells.append(f"{show(values)} (vs {other[claim.baseline]})")
    else:
        cells.append("n/a")
    _, values = claim_ratios(result.runs, claim.scenario, claim.proposed, claim.baseline,
                             args.window, args.budget / 2)  # fmt: skip
    cells.append(show(values))
    return f"| {claim.text} ({claim.proposed} / {claim.baseline}) | " + " | ".join(cells) + " |"


def runs_of(args: argparse.Namespace) -> list[tuple[str, str, int, float]]:
    """Every run a configuration makes: (scenario, method, count, budget), pilots included."""
    out = []
    tuning = args.tune_seeds or args.seeds
    others = len([s for s in args.seeds if s not in tuning])
    for scenario in args.scenarios:
        for method in args.methods:
            grid = len(grid_of(args, method))
            kept = grid
            if args.pilot_budget is not None and grid > 1:
                out.append((scenario, method, grid, args.pilot_budget))
                kept = min(grid, args.pilot_keep)
            out.append((scenario, method, kept * len(tuning) + others, args.budget))
    return out


def gradients(args: argparse.Namespace, scenario: str, budget: float, d: int) -> float:
    """At most how many trajectory gradients a run computes: ``budget * sum 1 / h_i``."""
    n = 2 if scenario == "hetero" else args.workers
    h, _ = times(scenario, n, args.horizon, d, args.time_unit)
    return budget * sum(1.0 / x for x in h)


def estimate(configs: list[tuple[str, argparse.Namespace]]) -> str:
    """What ``--suite`` runs and how long it takes here: a table of lines."""
    from experiments.nigt.__main__ import Agent, make

    lines = ["config: runs, trajectory gradients (at most), CPU hours (estimate)"]
    total = 0.0
    for name, args in configs:
        probe: Any = make(args.env)()
        d = sum(p.numel() for p in Agent(probe.observation_space, probe.action_space,
                                         std=args.std).parameters())  # fmt: skip
        probe.close()
        nigt, single = SECONDS_PER_GRADIENT.get(args.env, (0.05, 0.05))
        count = grads = seconds = 0.0
        for scenario, method, runs, budget in runs_of(args):
            per = gradients(args, scenario, budget, d)
            count += runs
            grads += runs * per
            seconds += runs * (per * (single if method == "afedpg" else nigt) + SECONDS_PER_RUN)
            if scenario == "hetero":  # the evaluations, off the clock
                steps = 2 * args.eval_points * args.eval_episodes * args.horizon
                seconds += runs * steps * nigt / args.horizon
        total += seconds
        lines.append(f"{name}: {count:.0f} runs, {grads:,.0f} gradients, {seconds / 3600:.2f} h")
    lines.append(
        f"total: {total / 3600:.1f} CPU hours; about {total / 3600 / 2:.1f} h of wall time as "
        "two processes on this 2-core machine with nothing else running (--suite --only NAME, "
        "one each); a shared machine takes longer (a reduced suite took 2.3 times its CPU "
        "time in wall time beside other work)"
    )
    return "\n".join(lines)
