"""Sync strategies are pure decision objects: decision tables, no event loop."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from aps.errors import ConfigError, InvalidState
from aps.sync import (
    APS,
    AllOf,
    AlwaysSync,
    AnyOf,
    FixedInterval,
    Never,
    SyncContext,
    SyncStrategy,
)


def ctx(
    worker: int,
    learner: int,
    *,
    steps: int = 0,
    seconds: float = 0.0,
    kl: float | None = None,
) -> SyncContext:
    """A context whose divergence is ``kl``; without ``kl``, measuring it fails the test."""
    measure: Callable[[], float]
    if kl is None:
        measure = forbidden
    else:
        value = kl

        def measure() -> float:
            return value

    return SyncContext(
        worker_id=0,
        worker_version=worker,
        learner_version=learner,
        steps_since_sync=steps,
        seconds_since_sync=seconds,
        measure_divergence=measure,
    )


def forbidden() -> float:
    raise AssertionError("the divergence was measured but must not have been")


# (strategy, context, expected decision). A context built without kl= raises if the strategy
# measures the divergence, so every row also checks that no needless measurement happens.
TABLE: list[tuple[SyncStrategy, SyncContext, bool]] = [
    # AlwaysSync: exactly when the worker lacks the current version.
    (AlwaysSync(), ctx(3, 3), False),
    (AlwaysSync(), ctx(2, 3), True),
    (AlwaysSync(), ctx(0, 100), True),
    (AlwaysSync(), ctx(4, 3), False),
    (AlwaysSync(), ctx(-1, 0), True),
    (AlwaysSync(), ctx(5, 5, steps=10**9, seconds=1e9), False),
    # Never: not even a worker far behind.
    (Never(), ctx(0, 100), False),
    (Never(), ctx(3, 3), False),
    (Never(), ctx(-1, 0), False),
    # FixedInterval(versions=k): lag >= k.
    (FixedInterval(versions=1), ctx(2, 3), True),
    (FixedInterval(versions=1), ctx(3, 3), False),
    (FixedInterval(versions=3), ctx(0, 2), False),
    (FixedInterval(versions=3), ctx(0, 3), True),
    (FixedInterval(versions=3), ctx(0, 4), True),
    (FixedInterval(versions=3), ctx(5, 3), False),
    (FixedInterval(versions=3), ctx(0, 2, steps=10**6), False),
    (FixedInterval(versions=3), ctx(-1, 0), True),
    # FixedInterval(steps=n): steps_since_sync >= n and lag > 0.
    (FixedInterval(steps=100), ctx(0, 1, steps=99), False),
    (FixedInterval(steps=100), ctx(0, 1, steps=100), True),
    (FixedInterval(steps=100), ctx(0, 1, steps=5000), True),
    (FixedInterval(steps=100), ctx(1, 1, steps=5000), False),
    (FixedInterval(steps=100), ctx(2, 1, steps=5000), False),
    (FixedInterval(steps=100), ctx(0, 50, steps=0), False),
    (FixedInterval(steps=100), ctx(-1, 0, steps=0), True),
    # APS without max_lag: divergence > threshold, strictly; never measured at lag <= 0.
    (APS(kl_threshold=0.1, max_lag=None), ctx(3, 3), False),
    (APS(kl_threshold=0.1, max_lag=None), ctx(4, 3), False),
    (APS(kl_threshold=0.1, max_lag=None), ctx(2, 3, kl=0.05), False),
    (APS(kl_threshold=0.1, max_lag=None), ctx(2, 3, kl=0.1), False),
    (APS(kl_threshold=0.1, max_lag=None), ctx(2, 3, kl=0.1000001), True),
    (APS(kl_threshold=0.1, max_lag=None), ctx(2, 3, kl=5.0), True),
    (APS(kl_threshold=0.1, max_lag=None), ctx(2, 3, kl=float("inf")), True),
    (APS(kl_threshold=0.1, max_lag=None), ctx(2, 3, kl=float("nan")), False),
    (APS(kl_threshold=0.1, max_lag=None), ctx(0, 1000, kl=0.0), False),
    (APS(kl_threshold=0.0, max_lag=None), ctx(2, 3, kl=0.0), False),
    (APS(kl_threshold=0.0, max_lag=None), ctx(2, 3, kl=1e-12), True),
    (APS(kl_threshold=0.1, max_lag=None), ctx(-1, 0), True),
    # APS's default max_lag (16) bounds staleness: a worker 16 versions behind is synced.
    (APS(kl_threshold=0.1), ctx(0, 15, kl=0.0), False),
    (APS(kl_threshold=0.1), ctx(0, 16), True),
    (APS(kl_threshold=0.1), ctx(0, 1000), True),
    # APS with max_lag: forced at lag >= max_lag, without measuring.
    (APS(kl_threshold=0.1, max_lag=4), ctx(0, 4), True),
    (APS(kl_threshold=0.1, max_lag=4), ctx(0, 9), True),
    (APS(kl_threshold=0.1, max_lag=4), ctx(0, 3, kl=0.01), False),
    (APS(kl_threshold=0.1, max_lag=4), ctx(0, 3, kl=0.2), True),
    (APS(kl_threshold=0.1, max_lag=4), ctx(4, 4), False),
    (APS(kl_threshold=0.1, max_lag=1), ctx(2, 3), True),
    # AnyOf: any member; cheap members first avoid the measurement.
    (AnyOf(FixedInterval(versions=4), APS(0.1)), ctx(0, 4), True),
    (AnyOf(FixedInterval(versions=4), APS(0.1)), ctx(0, 3, kl=0.01), False),
    (AnyOf(FixedInterval(versions=4), APS(0.1)), ctx(0, 3, kl=0.5), True),
    (AnyOf(FixedInterval(versions=4), APS(0.1)), ctx(3, 3), False),
    (AnyOf(Never(), FixedInterval(steps=10)), ctx(0, 1, steps=10), True),
    (AnyOf(Never()), ctx(0, 1), False),
    # AllOf: every member; a failing cheap member avoids the measurement.
    (AllOf(FixedInterval(steps=100), APS(0.1)), ctx(0, 1, steps=50), False),
    (AllOf(FixedInterval(steps=100), APS(0.1)), ctx(0, 1, steps=150, kl=0.5), True),
    (AllOf(FixedInterval(steps=100), APS(0.1)), ctx(0, 1, steps=150, kl=0.05), False),
    (AllOf(FixedInterval(steps=100), APS(0.1)), ctx(1, 1, steps=150), False),
    (AllOf(AlwaysSync()), ctx(0, 1), True),
    # Nesting.
    (AnyOf(AllOf(FixedInterval(steps=10), APS(0.1)), FixedInterval(versions=8)), ctx(0, 8), True),
]


@pytest.mark.parametrize(("strategy", "context", "expected"), TABLE, ids=lambda v: repr(v))
def test_decision_table(strategy: SyncStrategy, context: SyncContext, expected: bool) -> None:
    assert strategy.should_sync(context) is expected


class AlwaysYes:
    """A user strategy that breaks the contract by answering yes at lag 0."""

    def should_sync(self, ctx: SyncContext) -> bool:
        return True


def test_combinators_never_sync_a_current_worker_even_if_a_member_would() -> None:
    assert AlwaysYes().should_sync(ctx(3, 3)) is True
    assert AnyOf(AlwaysYes()).should_sync(ctx(3, 3)) is False
    assert AllOf(AlwaysYes()).should_sync(ctx(3, 3)) is False
    assert AnyOf(AlwaysYes()).should_sync(ctx(2, 3)) is True


class Counting:
    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.calls = 0

    def should_sync(self, ctx: SyncContext) -> bool:
        self.calls += 1
        return self.answer


def test_any_of_short_circuits_in_order() -> None:
    first, second = Counting(True), Counting(True)
    assert AnyOf(first, second).should_sync(ctx(0, 1)) is True
    assert (first.calls, second.calls) == (1, 0)
    first, second = Counting(False), Counting(True)
    assert AnyOf(first, second).should_sync(ctx(0, 1)) is True
    assert (first.calls, second.calls) == (1, 1)


def test_all_of_short_circuits_in_order() -> None:
    first, second = Counting(False), Counting(True)
    assert AllOf(first, second).should_sync(ctx(0, 1)) is False
    assert (first.calls, second.calls) == (1, 0)


def test_aps_never_measures_at_equal_versions_or_past_max_lag() -> None:
    strategy = APS(kl_threshold=0.0, max_lag=3)
    for worker, learner in [(0, 0), (7, 7), (8, 7), (0, 3), (0, 30), (-1, 0)]:
        context = ctx(worker, learner)  # measuring would raise AssertionError
        strategy.should_sync(context)
        assert not context.divergence_measured


def test_divergence_is_measured_once_per_context() -> None:
    calls = []

    def measure() -> float:
        calls.append(1)
        return 0.5

    context = SyncContext(0, 1, 3, measure_divergence=measure)
    assert AnyOf(APS(1.0), APS(0.7), APS(0.1)).should_sync(context) is True
    assert context.divergence() == 0.5
    assert len(calls) == 1
    assert context.divergence_measured


def test_a_failing_measurement_is_not_cached() -> None:
    answers: list[float | Exception] = [RuntimeError("boom"), 0.25]

    def measure() -> float:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    context = SyncContext(0, 1, 3, measure_divergence=measure)
    with pytest.raises(RuntimeError, match="boom"):
        context.divergence()
    assert not context.divergence_measured
    assert context.divergence() == 0.25


def test_context_without_a_measure_says_so() -> None:
    context = SyncContext(worker_id=1, worker_version=0, learner_version=1)
    with pytest.raises(InvalidState, match="measure_divergence"):
        context.divergence()
    assert AlwaysSync().should_sync(context) is True


def test_context_lag_and_fields() -> None:
    context = SyncContext(worker_id=2, worker_version=3, learner_version=7, steps_since_sync=11)
    assert context.lag == 4
    assert context.holds_weights
    assert not SyncContext(0, -1, 0).holds_weights
    assert SyncContext(0, -1, 0).lag == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        context.worker_version = 4  # type: ignore[misc]
    assert "measure_divergence" not in repr(context)
    assert "worker_version=3" in repr(context)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"worker_version": -2}, "worker_version must be -1"),
        ({"steps_since_sync": -1}, "steps_since_sync must be >= 0, got -1"),
        ({"seconds_since_sync": -0.5}, "seconds_since_sync must be >= 0, got -0.5"),
        ({"seconds_since_sync": float("nan")}, "seconds_since_sync must be >= 0, got nan"),
    ],
)
def test_context_validation(kwargs: dict[str, float], match: str) -> None:
    fields: dict[str, object] = {"worker_id": 0, "worker_version": 0, "learner_version": 1}
    fields.update(kwargs)
    with pytest.raises(ConfigError, match=match):
        SyncContext(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda: FixedInterval(), "exactly one of versions= or steps="),
        (lambda: FixedInterval(versions=2, steps=3), "got versions=2, steps=3"),
        (lambda: FixedInterval(versions=0), r"versions=\.\.\.\) must be an int >= 1, got 0"),
        (lambda: FixedInterval(versions=True), "got True"),
        (lambda: FixedInterval(steps=2.5), "got 2.5"),  # type: ignore[arg-type]
        (lambda: FixedInterval(steps=-3), "got -3"),
        (lambda: APS(kl_threshold=-0.1), "finite number >= 0.*got -0.1"),
        (lambda: APS(kl_threshold=float("nan")), "got nan"),
        (lambda: APS(kl_threshold=float("inf")), "got inf"),
        (lambda: APS(kl_threshold="0.1"), "got '0.1'"),  # type: ignore[arg-type]
        (lambda: APS(kl_threshold=True), "got True"),
        (lambda: APS(0.1, max_lag=0), r"APS\(max_lag=\.\.\.\) must be an int >= 1 .*None.*got 0"),
        (lambda: APS(0.1, max_lag=2.5), "or None for no staleness bound, got 2.5"),  # type: ignore[arg-type]
        (lambda: AnyOf(), r"AnyOf\(\) needs at least one strategy"),
        (lambda: AllOf(), r"AllOf\(\) needs at least one strategy"),
        (lambda: AnyOf(AlwaysSync(), 0.1), "argument 1 is 0.1 .float., not a sync strategy"),  # type: ignore[arg-type]
        (lambda: AllOf(lambda c: True), "not a sync strategy"),  # type: ignore[arg-type]
    ],
)
def test_parameter_validation(build: Callable[[], object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        build()


def test_reprs_are_readable() -> None:
    assert repr(AlwaysSync()) == "AlwaysSync()"
    assert repr(Never()) == "Never()"
    assert repr(FixedInterval(versions=4)) == "FixedInterval(versions=4, steps=None)"
    assert repr(APS(0.05)) == "APS(kl_threshold=0.05, max_lag=16)"
    assert repr(APS(0.05, max_lag=None)) == "APS(kl_threshold=0.05, max_lag=None)"
    assert repr(APS(1, max_lag=8)) == "APS(kl_threshold=1.0, max_lag=8)"
    assert (
        repr(AnyOf(FixedInterval(steps=10), APS(0.1)))
        == "AnyOf(FixedInterval(versions=None, steps=10), APS(kl_threshold=0.1, max_lag=16))"
    )
    assert repr(AllOf(Never())) == "AllOf(Never())"


def test_strategies_are_frozen_hashable_values() -> None:
    assert APS(0.1, max_lag=3) == APS(0.1, max_lag=3)
    assert AnyOf(AlwaysSync(), APS(0.1)) == AnyOf(AlwaysSync(), APS(0.1))
    assert len({APS(0.1), APS(0.1), FixedInterval(steps=5)}) == 2
    with pytest.raises(dataclasses.FrozenInstanceError):
        APS(0.1).kl_threshold = 0.2  # type: ignore[misc]


def test_user_strategy_is_a_sync_strategy() -> None:
    class EveryOtherVersion:
        def should_sync(self, ctx: SyncContext) -> bool:
            return ctx.lag >= 2

    user = EveryOtherVersion()
    assert isinstance(user, SyncStrategy)
    assert AnyOf(user).should_sync(ctx(0, 2)) is True
    for builtin in (AlwaysSync(), Never(), FixedInterval(versions=1), APS(0.1), AnyOf(Never())):
        assert isinstance(builtin, SyncStrategy)
    assert not isinstance(object(), SyncStrategy)
    assert not isinstance(0.1, SyncStrategy)
