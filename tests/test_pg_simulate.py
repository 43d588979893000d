"""aps.pg.simulate: NIGT in virtual time with the networked path's rules and update."""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("torch")

import aps
from aps import pg
from aps.pg.simulate import simulate
from tests.pg_agents import MeanAgent, Reveal


def test_rennala_counts_follow_the_time_model() -> None:
    # Completions: worker 0 at 1, 2, 3, 4; worker 1 at 2, 4; worker 2 at 4: the seventh
    # gradient is ready at t = 4, when the counts are 4, 2 and 1.
    agent = MeanAgent()
    rounds = list(
        simulate(
            agent,
            Reveal,
            h=[1.0, 2.0, 4.0],
            kappa=[0.5, 0.25, 3.0],
            aggregator=pg.Rennala(batch=7),
            lr=0.25,
            momentum=1.0,
            horizon=10,
            gamma=1.0,
            iterations=3,
        )
    )
    for t, r in enumerate(rounds):
        assert r.contributions == {0: 4, 1: 2, 2: 1} and r.used == 7
        assert (r.compute, r.communication) == (4.0, 3.0)  # one aggregation: the slowest link
        assert r.time == pytest.approx(7.0 * (t + 1))
    # The same NIGT step as the networked trainer: mu goes up by exactly lr a round.
    assert agent.mu == pytest.approx(0.75, abs=1e-6)


def test_malenia_waits_until_the_harmonic_mean_of_counts_holds() -> None:
    # n = 2, batch 4: 1/M_0 + 1/M_1 <= 1 first holds at t = 20 (M_1 = 2, M_0 = 20).
    [r] = simulate(
        MeanAgent(),
        [Reveal, lambda: Reveal(length=2)],
        h=[1.0, 10.0],
        aggregator=pg.Malenia(batch=4),
        horizon=10,
        iterations=1,
    )
    assert r.contributions == {0: 20, 1: 2} and r.compute == 20.0 and r.communication == 0.0


def test_synchronous_waits_for_the_slowest_and_the_budget_stops_the_run() -> None:
    rounds = list(
        simulate(
            MeanAgent(),
            Reveal,
            h=[math.sqrt(i + 1) for i in range(10)],
            kappa=1.0,
            aggregator=pg.Synchronous(),
            horizon=10,
            time_budget=10.0,
        )
    )
    slowest = math.sqrt(10)
    assert all(r.compute == slowest and r.used >= 10 for r in rounds)
    assert len(rounds) == math.ceil(10.0 / (slowest + 1.0))
    assert all(np.isfinite(r.mean_return) for r in rounds)


def test_bad_times_are_refused() -> None:
    with pytest.raises(aps.ConfigError, match="h entries must be finite and > 0"):
        next(simulate(MeanAgent(), Reveal, h=[1.0, 0.0], iterations=1))
    with pytest.raises(aps.ConfigError, match="kappa has 3 entries for 2 workers"):
        next(simulate(MeanAgent(), Reveal, h=[1.0, 2.0], kappa=[0, 0, 0], iterations=1))
    with pytest.raises(aps.ConfigError, match="never stops"):
        next(simulate(MeanAgent(), Reveal, h=[1.0]))
