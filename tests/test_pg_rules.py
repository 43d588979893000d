"""NIGT steps and aggregation rules are pure: hand-computed cases and tables, no event loop."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra import numpy as hnp

import aps.pg
from aps.errors import ConfigError, InvalidState
from aps.pg import (
    AggregationRule,
    Layout,
    Malenia,
    NIGTUpdate,
    Rennala,
    Round,
    Synchronous,
    flatten,
    unflatten,
)


def vec(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float64)


def close(a: Any, b: Any) -> bool:
    return bool(np.allclose(a, b, rtol=1e-12, atol=1e-12))


# -- NIGT ------------------------------------------------------------------------------------


def test_start_broadcasts_the_initial_point() -> None:
    state = NIGTUpdate(lr=0.1, momentum=0.5).start([1.0, 2.0])
    assert state.t == 0
    assert state.direction is None
    assert state.direction_norm == 0.0
    assert close(state.theta, [1, 2]) and close(state.theta_prev, [1, 2])
    assert close(state.point, [1, 2])
    assert state.size == 2
    assert state.theta.dtype == np.float64


def test_two_hand_computed_steps() -> None:
    rule = NIGTUpdate(lr=1.0, momentum=0.5)  # extrapolation (1 - 0.5) / 0.5 = 1
    assert rule.extrapolation == 1.0
    s0 = rule.start([0.0, 0.0])

    # First step: d = g (the initial batch), step of length 1 along it.
    s1 = rule.step(s0, [3.0, 4.0])
    assert s1.t == 1
    assert close(s1.direction, [3, 4])
    assert s1.direction_norm == pytest.approx(5.0)
    assert close(s1.theta, [0.6, 0.8])
    assert close(s1.theta_prev, [0, 0])
    assert close(s1.point, [1.2, 1.6])  # theta1 + 1 * (theta1 - theta0)

    # Second step: d = 0.5 [3, 4] + 0.5 [-3, 4] = [0, 4].
    s2 = rule.step(s1, [-3.0, 4.0])
    assert s2.t == 2
    assert close(s2.direction, [0, 4])
    assert s2.direction_norm == pytest.approx(4.0)
    assert close(s2.theta, [0.6, 1.8])
    assert close(s2.theta_prev, [0.6, 0.8])
    assert close(s2.point, [0.6, 2.8])


def test_momentum_keeps_one_minus_eta_of_the_old_direction() -> None:
    rule = NIGTUpdate(lr=0.5, momentum=0.25)
    s1 = rule.step(rule.start([0.0, 0.0]), [1.0, 0.0])
    s2 = rule.step(s1, [0.0, 1.0])
    assert close(s2.direction, [0.75, 0.25])
    unit = vec(0.75, 0.25) / np.hypot(0.75, 0.25)
    assert close(s2.theta, s1.theta + 0.5 * unit)
    # The extrapolation factor (1 - eta) / eta = 3.
    assert rule.extrapolation == pytest.approx(3.0)
    assert close(s2.point, s2.theta + 3.0 * (s2.theta - s1.theta))


def test_eta_one_is_normalized_minibatch_policy_gradient() -> None:
    rule = NIGTUpdate(lr=0.1, momentum=1.0)
    assert rule.extrapolation == 0.0
    rng = np.random.default_rng(0)
    state = rule.start(rng.normal(size=5))
    theta = state.theta.copy()
    for _ in range(6):
        g = rng.normal(size=5)
        state = rule.step(state, g)
        theta = theta + 0.1 * g / np.linalg.norm(g)
        assert close(state.theta, theta)
        assert close(state.direction, g)  # no memory of older gradients
        assert np.array_equal(state.point, state.theta)  # no extrapolation


def test_zero_direction_does_not_move() -> None:
    rule = NIGTUpdate(lr=1.0, momentum=0.5)
    start = rule.start([1.0, -1.0])
    still = rule.step(start, [0.0, 0.0])
    assert still.t == 1
    assert close(still.theta, [1, -1]) and close(still.theta_prev, [1, -1])
    assert close(still.point, [1, -1])
    assert still.direction_norm == 0.0
    assert close(still.direction, [0, 0])

    # Momentum cancelling the new gradient: d = 0.5 [2, 0] + 0.5 [-2, 0] = 0.
    moved = rule.step(start, [2.0, 0.0])
    stopped = rule.step(moved, [-2.0, 0.0])
    assert close(stopped.direction, [0, 0])
    assert close(stopped.theta, moved.theta)
    assert close(stopped.theta_prev, moved.theta)  # a zero-length step: nothing to extrapolate
    assert close(stopped.point, moved.theta)

    # The zero direction is the momentum of the next step: d = 0.5 [0, 0] + 0.5 [0, 2].
    after = rule.step(stopped, [0.0, 2.0])
    assert close(after.direction, [0, 1])
    assert close(after.theta, moved.theta + vec(0, 1))
    assert close(after.point, after.theta + vec(0, 1))


def test_step_length_survives_huge_and_tiny_directions() -> None:
    rule = NIGTUpdate(lr=0.5, momentum=1.0)
    huge = rule.step(rule.start([0.0, 0.0]), [1e300, 1e300])
    assert close(huge.theta, [0.5 / np.sqrt(2), 0.5 / np.sqrt(2)])
    assert huge.direction_norm == pytest.approx(np.sqrt(2) * 1e300)
    tiny = rule.step(rule.start([0.0, 0.0]), [0.0, 5e-324])
    assert close(tiny.theta, [0, 0.5])


def test_the_norm_is_global_across_named_arrays() -> None:
    weights = {
        "layer.weight": np.zeros((1, 2), dtype=np.float32),
        "layer.bias": np.zeros(1, dtype=np.float32),
    }
    theta, layout = flatten(weights)
    grads = {"layer.weight": np.array([[3.0, 0.0]]), "layer.bias": np.array([4.0])}
    g = layout.flatten(grads)
    state = NIGTUpdate(lr=1.0, momentum=1.0).step(NIGTUpdate(lr=1.0, momentum=1.0).start(theta), g)
    new = unflatten(state.theta, layout)
    # One norm over all entries (5), not one per array (which would give [1, 0] and [1]).
    assert np.allclose(new["layer.weight"], [[0.6, 0.0]])
    assert np.allclose(new["layer.bias"], [0.8])
    assert new["layer.weight"].dtype == np.float32


def test_states_are_immutable_snapshots() -> None:
    rule = NIGTUpdate(lr=1.0, momentum=0.5)
    theta0 = np.array([1.0, 2.0])
    s0 = rule.start(theta0)
    theta0[0] = 99.0  # the state copied it
    assert close(s0.theta, [1, 2])
    g = np.array([1.0, 0.0])
    s1 = rule.step(s0, g)
    g[0] = 99.0
    assert close(s1.direction, [1, 0])
    assert close(s0.theta, [1, 2]) and s0.direction is None and s0.t == 0
    for state in (s0, s1):
        for array in (state.theta, state.theta_prev, state.point, state.direction):
            if array is not None:
                assert not array.flags.writeable
    with pytest.raises(AttributeError):
        s1.t = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"lr": 0.0, "momentum": 0.5}, "lr"),
        ({"lr": -1.0, "momentum": 0.5}, "lr"),
        ({"lr": float("nan"), "momentum": 0.5}, "lr"),
        ({"lr": float("inf"), "momentum": 0.5}, "lr"),
        ({"lr": True, "momentum": 0.5}, "lr"),
        ({"lr": "0.1", "momentum": 0.5}, "lr"),
        ({"lr": 0.1, "momentum": 0.0}, "momentum"),
        ({"lr": 0.1, "momentum": 1.5}, "momentum"),
        ({"lr": 0.1, "momentum": -0.1}, "momentum"),
        ({"lr": 0.1, "momentum": float("nan")}, "momentum"),
    ],
)
def test_bad_step_parameters_are_refused(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        NIGTUpdate(**kwargs)


def test_integer_parameters_become_floats() -> None:
    rule = NIGTUpdate(lr=1, momentum=1)
    assert isinstance(rule.lr, float) and isinstance(rule.momentum, float)


def test_bad_vectors_are_refused() -> None:
    rule = NIGTUpdate(lr=0.1, momentum=0.5)
    with pytest.raises(ConfigError, match="1-d"):
        rule.start(np.zeros((2, 2)))
    with pytest.raises(ConfigError, match="at least one"):
        rule.start(np.zeros(0))
    with pytest.raises(ConfigError, match="non-finite"):
        rule.start([0.0, np.nan])
    state = rule.start([0.0, 0.0])
    with pytest.raises(ConfigError, match="3 entries, the parameters have 2"):
        rule.step(state, [1.0, 2.0, 3.0])
    with pytest.raises(ConfigError, match="non-finite"):
        rule.step(state, [1.0, np.inf])
    with pytest.raises(ConfigError, match="dtype"):
        rule.step(state, np.array([1 + 1j, 0]))


finite = st.floats(-1e6, 1e6, allow_nan=False)


@settings(max_examples=100, deadline=None)
@given(
    gradients=st.lists(hnp.arrays(np.float64, 4, elements=finite), min_size=1, max_size=5),
    lr=st.floats(1e-3, 10.0),
    eta=st.floats(1e-3, 1.0),
)
def test_every_step_has_length_lr_and_extrapolates(
    gradients: list[np.ndarray], lr: float, eta: float
) -> None:
    rule = NIGTUpdate(lr=lr, momentum=eta)
    state = rule.start(np.zeros(4))
    direction = None
    for g in gradients:
        nxt = rule.step(state, g)
        assert nxt.direction is not None
        direction = g if direction is None else (1 - eta) * direction + eta * g
        assert np.allclose(nxt.direction, direction, rtol=1e-9, atol=1e-9)
        assert np.array_equal(nxt.theta_prev, state.theta)
        step = np.linalg.norm(nxt.theta - state.theta)
        if nxt.direction_norm > 0:
            assert step == pytest.approx(lr, rel=1e-9)
        else:
            assert step == 0.0
        expected = nxt.theta + ((1 - eta) / eta) * (nxt.theta - state.theta)
        assert np.allclose(nxt.point, expected, rtol=1e-9, atol=1e-9 * (1 + lr / eta))
        state = nxt


# -- flatten / unflatten ---------------------------------------------------------------------


def test_flatten_round_trips_names_shapes_and_dtypes() -> None:
    weights = {
        "w": np.arange(6, dtype=np.float32).reshape(2, 3) / 7,
        "b": np.array([-1.5, 2.25]),
        "scalar": np.array(3.0, dtype=np.float16),
        "steps": np.array([7, -3], dtype=np.int64),
        "mask": np.array([True, False]),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    vector, layout = flatten(weights)
    assert vector.dtype == np.float64 and vector.shape == (6 + 2 + 1 + 2 + 2,)
    assert layout.size == vector.shape[0]
    assert layout.names == tuple(weights)
    assert layout.shapes == ((2, 3), (2,), (), (2,), (2,), (0, 4))
    assert close(vector[:6], weights["w"].reshape(-1).astype(np.float64))
    back = unflatten(vector, layout)
    assert list(back) == list(weights)
    for name, array in weights.items():
        assert back[name].dtype == array.dtype
        assert back[name].shape == array.shape
        assert np.array_equal(back[name], array)
        assert back[name].flags.writeable and back[name].flags.c_contiguous


def test_unflatten_rounds_integers_and_copies() -> None:
    _, layout = flatten({"n": np.array([0, 0], dtype=np.int32), "x": np.zeros(1)})
    vector = np.array([2.9999999, -1.0000001, 0.5])
    vector.setflags(write=False)  # e.g. NIGTState.point
    back = unflatten(vector, layout)
    assert np.array_equal(back["n"], [3, -1]) and back["n"].dtype == np.int32
    back["x"][0] = 7.0
    assert vector[2] == 0.5


def test_flatten_of_nothing() -> None:
    vector, layout = flatten({})
    assert vector.shape == (0,) and layout.size == 0
    assert unflatten(vector, layout) == {}


def test_layout_flatten_follows_the_layout_order() -> None:
    _, layout = flatten({"a": np.zeros(2), "b": np.zeros((1, 1)), "c": np.zeros(1)})
    grads: dict[str, Any] = {
        "c": np.array([3.0]),
        "a": np.array([1.0, 2.0], dtype=np.float32),
        "b": [[9.0]],
    }
    assert close(layout.flatten(grads), [1, 2, 9, 3])
    assert close(layout.flatten({"a": [1.0, 2.0]}, fill_missing=True), [1, 2, 0, 0])


def test_layout_flatten_lists_every_problem() -> None:
    _, layout = flatten({"a": np.zeros(2), "b": np.zeros(1)})
    with pytest.raises(ConfigError) as info:
        layout.flatten({"a": np.zeros(3), "z": np.zeros(1)})
    message = str(info.value)
    assert "unexpected ['z']" in message
    assert "missing ['b']" in message
    assert "'a' has shape (3,)" in message
    with pytest.raises(ConfigError, match="dtype"):
        layout.flatten({"a": np.array(["x", "y"]), "b": np.zeros(1)})


def test_bad_flatten_inputs() -> None:
    with pytest.raises(ConfigError, match="complex"):
        flatten({"z": np.zeros(2, dtype=np.complex64)})
    _, layout = flatten({"a": np.zeros(2)})
    with pytest.raises(ConfigError, match="2 entries"):
        unflatten(np.zeros(3), layout)
    with pytest.raises(ConfigError, match="2 entries"):
        unflatten(np.zeros((1, 2)), layout)
    with pytest.raises(ConfigError, match="unique"):
        Layout(("a", "a"), ((1,), (1,)), (np.dtype("f8"), np.dtype("f8")))
    with pytest.raises(ConfigError, match="one shape and one dtype"):
        Layout(("a",), (), (np.dtype("f8"),))


@settings(max_examples=50, deadline=None)
@given(
    arrays=st.lists(
        hnp.arrays(
            st.sampled_from([np.float32, np.float64, np.int16]),
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=3),
            elements={"allow_nan": False, "allow_infinity": False},
        ),
        max_size=4,
    )
)
def test_flatten_unflatten_is_exact(arrays: list[np.ndarray]) -> None:
    weights = {f"p{i}": array for i, array in enumerate(arrays)}
    vector, layout = flatten(weights)
    assert vector.shape == (sum(a.size for a in arrays),)
    back = unflatten(vector, layout)
    for name, array in weights.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        assert np.array_equal(back[name], array)
    assert np.array_equal(layout.flatten(weights), vector)


# -- aggregation: tables ---------------------------------------------------------------------

Add = tuple[int, int, Sequence[float], int]  # worker, round id, gradient sum, count
Event = Add | tuple[str, int]  # ("remove", worker)


@dataclass
class Case:
    """A sequence of events fed to one round, and what the round must say afterwards."""

    name: str
    rule: AggregationRule
    workers: Sequence[int]
    events: list[Event]
    accepted: list[bool | None]  # add's answer per event; None for removals
    done: bool
    result: Sequence[float] | None = None
    used: int = 0
    discarded: int = 0
    stale: int = 0
    contributions: dict[int, int] = field(default_factory=dict)
    done_after: int | None = None  # the event index after which done first became True


ROUND = 7  # the current round id in every case; 6 is the stale one

CASES = [
    # Rennala: the first M gradients from whoever finishes; stale and late ones discarded.
    Case(
        "rennala first M from anyone",
        Rennala(batch=3),
        [0, 1, 2],
        [
            (0, ROUND, [1, 0], 1),
            (1, ROUND - 1, [100, 100], 1),
            (0, ROUND, [3, 0], 1),
            (2, ROUND, [0, 6], 1),
            (1, ROUND, [9, 9], 1),
        ],
        [True, False, True, True, False],
        done=True,
        result=[4 / 3, 2],
        used=3,
        discarded=2,
        stale=1,
        contributions={0: 2, 1: 0, 2: 1},
        done_after=3,
    ),
    Case(
        "rennala never waits for a slow worker",
        Rennala(batch=2),
        [0, 1],
        [(0, ROUND, [1, 1], 1), (0, ROUND, [3, 3], 1)],
        [True, True],
        done=True,
        result=[2, 2],
        used=2,
        contributions={0: 2, 1: 0},
        done_after=1,
    ),
    Case(
        "rennala counts a sum of k as k and takes it whole",
        Rennala(batch=4),
        [0, 1],
        [(0, ROUND, [4, 4], 3), (1, ROUND, [2, 0], 2)],
        [True, True],
        done=True,
        result=[6 / 5, 4 / 5],
        used=5,
        contributions={0: 3, 1: 2},
        done_after=1,
    ),
    Case(
        "rennala future round ids are stale too",
        Rennala(batch=1),
        [0],
        [(0, ROUND + 1, [1, 1], 1), (0, ROUND, [2, 2], 1)],
        [False, True],
        done=True,
        result=[2, 2],
        used=1,
        discarded=1,
        stale=1,
        contributions={0: 1},
        done_after=1,
    ),
    Case(
        "rennala only stale reports never finish",
        Rennala(batch=2),
        [0, 1],
        [(0, ROUND - 1, [1, 1], 5), (1, ROUND - 1, [1, 1], 5)],
        [False, False],
        done=False,
        discarded=10,
        stale=10,
        contributions={0: 0, 1: 0},
    ),
    Case(
        "rennala keeps a removed worker's gradients and discards its later ones",
        Rennala(batch=3),
        [0, 1],
        [
            (1, ROUND, [3, 3], 1),
            ("remove", 1),
            (0, ROUND, [0, 3], 1),
            (1, ROUND, [50, 50], 1),
            (0, ROUND, [0, 0], 1),
        ],
        [True, None, True, False, True],
        done=True,
        result=[1, 2],
        used=3,
        discarded=1,
        contributions={0: 2, 1: 1},
        done_after=4,
    ),
    # Malenia: every worker at least once, then the harmonic mean of counts >= M / n.
    Case(
        "malenia weights a fast and a slow worker equally",
        Malenia(batch=3),
        [0, 1],
        [(0, ROUND, [10, 0], 10), (1, ROUND, [0, 1], 1)],
        [True, True],
        done=True,
        result=[0.5, 0.5],  # Rennala would give [10/11, 1/11]
        used=11,
        contributions={0: 10, 1: 1},
        done_after=1,
    ),
    Case(
        "malenia waits for every worker whatever the counts",
        Malenia(batch=1),
        [0, 1, 2],
        [(0, ROUND, [100, 0], 100), (1, ROUND, [0, 1], 1), (2, ROUND, [3, 3], 1)],
        [True, True, True],
        done=True,
        result=[(1 + 0 + 3) / 3, (0 + 1 + 3) / 3],
        used=102,
        contributions={0: 100, 1: 1, 2: 1},
        done_after=2,
    ),
    Case(
        "malenia harmonic mean below M/n keeps the round open",
        Malenia(batch=4),
        [0, 1],
        # counts (10, 1): ((1/10 + 1) / 2)^-1 = 1.82 < 4/2
        [(0, ROUND, [10, 0], 10), (1, ROUND, [0, 1], 1)],
        [True, True],
        done=False,
        used=11,
        contributions={0: 10, 1: 1},
    ),
    Case(
        "malenia stop rule is exact at equality",
        Malenia(batch=9),
        [0, 1, 2],
        # counts (2, 3, 5): sum 1/M = 31/30 > 1 = n^2/M; then (2, 3, 6): sum 1/M = 1 exactly.
        [
            (0, ROUND, [2, 0], 2),
            (1, ROUND, [3, 0], 3),
            (2, ROUND, [5, 0], 5),
            (2, ROUND, [1, 6], 1),
        ],
        [True, True, True, True],
        done=True,
        result=[1, 1 / 3],
        used=11,
        contributions={0: 2, 1: 3, 2: 6},
        done_after=3,
    ),
    Case(
        "malenia discards stale and late reports",
        Malenia(batch=2),
        [0, 1],
        [
            (1, ROUND - 1, [7, 7], 4),
            (0, ROUND, [2, 0], 1),
            (1, ROUND, [0, 2], 1),
            (0, ROUND, [5, 5], 1),
        ],
        [False, True, True, False],
        done=True,
        result=[1, 1],
        used=2,
        discarded=5,
        stale=4,
        contributions={0: 1, 1: 1},
        done_after=2,
    ),
    Case(
        "malenia drops a removed worker and finishes over the others",
        Malenia(batch=4),
        [0, 1, 2],
        [
            (2, ROUND, [0, 9], 1),
            (0, ROUND, [2, 0], 1),
            (1, ROUND, [0, 2], 1),  # counts (1, 1, 1): harmonic 1 < 4/3
            ("remove", 2),  # (1, 1) over n = 2: harmonic 1 < 4/2
            (2, ROUND, [0, 9], 1),
            (0, ROUND, [2, 0], 1),  # (2, 1): 4/3 < 2
            (1, ROUND, [0, 4], 1),  # (2, 2): 2 >= 2
        ],
        [True, True, True, None, False, True, True],
        done=True,
        result=[1, 1.5],
        used=4,
        discarded=2,
        contributions={0: 2, 1: 2, 2: 0},
        done_after=6,
    ),
    Case(
        "malenia removing the only missing worker can close the round",
        Malenia(batch=2),
        [0, 1, 2],
        [(0, ROUND, [2, 0], 1), (1, ROUND, [0, 2], 1), ("remove", 2)],
        [True, True, None],
        done=True,
        result=[1, 1],
        used=2,
        contributions={0: 1, 1: 1, 2: 0},
        done_after=2,
    ),
    # Synchronous: the first report of every worker; the pooled mean.
    Case(
        "synchronous one report per worker",
        Synchronous(),
        [0, 1, 2],
        [
            (0, ROUND, [3, 0], 1),
            (0, ROUND, [100, 0], 1),
            (1, ROUND - 1, [100, 0], 1),
            (1, ROUND, [0, 3], 1),
            (2, ROUND, [3, 3], 1),
            (2, ROUND, [3, 3], 1),
        ],
        [True, False, False, True, True, False],
        done=True,
        result=[2, 2],
        used=3,
        discarded=3,
        stale=1,
        contributions={0: 1, 1: 1, 2: 1},
        done_after=4,
    ),
    Case(
        "synchronous pools a report of several gradients",
        Synchronous(),
        [0, 1],
        [(0, ROUND, [4, 0], 2), (1, ROUND, [0, 3], 1)],
        [True, True],
        done=True,
        result=[4 / 3, 1],
        used=3,
        contributions={0: 2, 1: 1},
        done_after=1,
    ),
    Case(
        "synchronous stops waiting for a removed worker",
        Synchronous(),
        [0, 1, 2],
        [(0, ROUND, [1, 0], 1), (2, ROUND, [0, 1], 1), ("remove", 2), ("remove", 1)],
        [True, True, None, None],
        done=True,
        result=[0.5, 0.5],  # worker 2's report is kept
        used=2,
        contributions={0: 1, 1: 0, 2: 1},
        done_after=3,
    ),
]


def run_case(case: Case) -> tuple[Round, list[bool | None], int | None]:
    round_ = case.rule.start(ROUND, case.workers, size=2)
    answers: list[bool | None] = []
    done_after = None
    for index, event in enumerate(case.events):
        if event[0] == "remove":
            round_.remove(int(event[1]))
            answers.append(None)
        else:
            worker, round_id, grad, count = event  # type: ignore[misc]
            answers.append(round_.add(worker, round_id, np.array(grad, dtype=float), count))
        if round_.done and done_after is None:
            done_after = index
    return round_, answers, done_after


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_aggregation_table(case: Case) -> None:
    round_, answers, done_after = run_case(case)
    assert answers == case.accepted
    assert round_.done is case.done
    assert done_after == case.done_after
    assert round_.used == case.used
    assert round_.discarded == case.discarded
    assert round_.stale == case.stale
    assert round_.contributions == case.contributions
    assert sum(round_.contributions.values()) == round_.used
    if case.result is None:
        with pytest.raises(InvalidState, match=f"round {ROUND} is not done"):
            round_.result()
    else:
        result = round_.result()
        assert close(result, case.result)
        assert result.dtype == np.float64 and not result.flags.writeable
        assert round_.result() is result


def test_rennala_and_malenia_disagree_on_unequal_counts() -> None:
    events = [(0, ROUND, [10.0, 0.0], 10), (1, ROUND, [0.0, 1.0], 1)]
    rennala = Rennala(batch=11).start(ROUND, [0, 1])
    malenia = Malenia(batch=2).start(ROUND, [0, 1])
    for worker, round_id, grad, count in events:
        rennala.add(worker, round_id, np.array(grad), count)
        malenia.add(worker, round_id, np.array(grad), count)
    assert close(rennala.result(), [10 / 11, 1 / 11])
    assert close(malenia.result(), [0.5, 0.5])


def test_malenia_with_batch_at_most_n_needs_one_from_each() -> None:
    round_ = Malenia(batch=3).start(ROUND, [0, 1, 2])
    for worker in (0, 1):
        round_.add(worker, ROUND, np.ones(2), 1)
        assert not round_.done
        assert round_.harmonic_mean == 0.0
    assert round_.missing == (2,)
    with pytest.raises(InvalidState, match=r"workers \[2\] have not contributed"):
        round_.result()
    round_.add(2, ROUND, np.ones(2), 1)
    assert round_.done
    assert round_.harmonic_mean == 1.0


def test_malenia_progress_names_the_harmonic_mean() -> None:
    round_ = Malenia(batch=4).start(ROUND, [0, 1])
    round_.add(0, ROUND, np.ones(2), 10)
    round_.add(1, ROUND, np.ones(2), 1)
    assert round_.harmonic_mean == pytest.approx(2 / 1.1)
    with pytest.raises(InvalidState, match="harmonic mean"):
        round_.result()


def test_a_closed_round_is_final() -> None:
    round_ = Malenia(batch=2).start(ROUND, [0, 1])
    round_.add(0, ROUND, np.array([2.0, 0.0]), 1)
    round_.add(1, ROUND, np.array([0.0, 2.0]), 1)
    result = round_.result().copy()
    round_.remove(1)
    assert round_.done and close(round_.result(), result)
    assert round_.removed == (1,) and round_.active == (0,)
    assert round_.contributions == {0: 1, 1: 1}
    assert not round_.add(0, ROUND, np.ones(2), 3)
    assert round_.discarded == 3


@pytest.mark.parametrize("rule", [Rennala(batch=5), Malenia(batch=5), Synchronous()])
def test_losing_every_worker_leaves_a_round_that_cannot_finish(rule: AggregationRule) -> None:
    round_ = rule.start(ROUND, [3, 4])
    round_.add(3, ROUND, np.ones(2), 1)
    assert round_.can_finish
    round_.remove(3)
    assert round_.can_finish
    round_.remove(4)
    round_.remove(4)  # twice is a no-op
    assert not round_.done and not round_.can_finish
    assert round_.active == () and round_.removed == (3, 4)
    assert not round_.add(3, ROUND, np.ones(2), 1)


def test_survives_worker_loss_tells_the_driver_what_to_do() -> None:
    assert Rennala(batch=3).survives_worker_loss
    assert Synchronous().survives_worker_loss
    assert not Malenia(batch=3).survives_worker_loss
    for rule in (Rennala(batch=3), Malenia(batch=3), Synchronous()):
        assert isinstance(rule, AggregationRule)


def test_missing_lists_the_workers_a_round_waits_on() -> None:
    round_ = Synchronous().start(ROUND, [5, 6, 7])
    assert round_.missing == (5, 6, 7)
    round_.add(6, ROUND, np.ones(2), 1)
    assert round_.missing == (5, 7)
    round_.remove(7)
    assert round_.missing == (5,)
    assert "SynchronousRound(round_id=7, done=False" in repr(round_)


def test_size_is_fixed_by_the_first_accepted_report() -> None:
    round_ = Rennala(batch=3).start(ROUND, [0])
    assert round_.size is None
    round_.add(0, ROUND - 1, np.ones(5), 1)  # stale: fixes nothing
    assert round_.size is None
    round_.add(0, ROUND, np.ones(3, dtype=np.float32), 1)
    assert round_.size == 3
    with pytest.raises(ConfigError, match=r"shape \(4,\), expected \(3,\)"):
        round_.add(0, ROUND, np.ones(4), 1)


def test_reports_are_copied() -> None:
    round_ = Rennala(batch=2).start(ROUND, [0])
    grad = np.array([1.0, 1.0])
    round_.add(0, ROUND, grad, 1)
    grad[:] = 100.0
    round_.add(0, ROUND, np.array([3.0, 3.0]), 1)
    assert close(round_.result(), [2, 2])
    assert close(grad, [100, 100])


@pytest.mark.parametrize(
    ("worker", "grad", "count", "needle"),
    [
        (9, np.ones(2), 1, "worker 9, which is not in round 7"),
        ("0", np.ones(2), 1, "not in round"),
        (0, np.ones(2), 0, "count 0"),
        (0, np.ones(2), -2, "count -2"),
        (0, np.ones(2), 1.0, "count 1.0"),
        (0, np.ones(2), True, "count True"),
        (0, np.ones(3), 1, r"shape \(3,\), expected \(2,\)"),
        (0, np.ones((1, 2)), 1, r"shape \(1, 2\)"),
        (0, np.array([1.0, np.nan]), 1, "non-finite"),
        (0, np.array([1.0, np.inf]), 1, "non-finite"),
        (0, np.array(["a", "b"]), 1, "dtype"),
    ],
)
def test_bad_reports_raise_and_change_nothing(
    worker: Any, grad: np.ndarray, count: Any, needle: str
) -> None:
    for round_id in (ROUND, ROUND - 1):  # stale reports are checked too
        round_ = Rennala(batch=1).start(ROUND, [0, 1], size=2)
        with pytest.raises(ConfigError, match=needle):
            round_.add(worker, round_id, grad, count)
        assert round_.used == 0 and round_.discarded == 0 and round_.reports == 0


def test_numpy_integers_are_ids_and_counts() -> None:
    round_ = Rennala(batch=np.int64(2)).start(np.int64(ROUND), [np.int32(0)])  # type: ignore[arg-type, list-item]
    assert round_.add(np.int64(0), np.int64(ROUND), np.ones(2), np.int64(2))  # type: ignore[arg-type]
    assert round_.done and round_.workers == (0,)


@pytest.mark.parametrize(
    ("call", "needle"),
    [
        (lambda: Rennala(batch=0), "Rennala"),
        (lambda: Rennala(batch=-1), "batch"),
        (lambda: Rennala(batch=2.5), "batch"),  # type: ignore[arg-type]
        (lambda: Malenia(batch=True), "Malenia"),
        (lambda: Malenia(batch=0), "int >= 1"),
        (lambda: Rennala(batch=2).start(ROUND, []), "at least one worker"),
        (lambda: Malenia(batch=2).start(ROUND, [1, 1]), "unique"),
        (lambda: Synchronous().start(ROUND, [0.5]), "ints"),  # type: ignore[list-item]
        (lambda: Synchronous().start("7", [0]), "round_id"),  # type: ignore[arg-type]
        (lambda: Rennala(batch=2).start(ROUND, [0], size=0), "size"),
    ],
)
def test_bad_rules_and_rounds_are_refused(call: Any, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        call()


def test_removing_an_unknown_worker_is_refused() -> None:
    round_ = Rennala(batch=2).start(ROUND, [0])
    with pytest.raises(ConfigError, match="cannot remove worker 3"):
        round_.remove(3)


def test_rules_are_frozen_and_hashable() -> None:
    rule = Rennala(batch=3)
    assert rule == Rennala(batch=3) and hash(rule) == hash(Rennala(batch=3))
    with pytest.raises(AttributeError):
        rule.batch = 4  # type: ignore[misc]


# -- aggregation: properties -----------------------------------------------------------------

reports = st.lists(
    st.tuples(
        st.integers(0, 3),  # worker
        st.booleans(),  # stale?
        st.integers(1, 4),  # count
        hnp.arrays(np.float64, 3, elements=st.floats(-100, 100)),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(events=reports, batch=st.integers(1, 12))
def test_rennala_is_the_pooled_mean_of_the_first_fresh_reports(
    events: list[tuple[int, bool, int, np.ndarray]], batch: int
) -> None:
    round_ = Rennala(batch=batch).start(ROUND, range(4))
    total, count, offered = np.zeros(3), 0, 0
    for worker, stale, n, grad in events:
        offered += n
        wanted = not stale and count < batch
        assert round_.add(worker, ROUND - 1 if stale else ROUND, grad, n) is wanted
        if wanted:
            total, count = total + grad, count + n
        assert round_.done is (count >= batch)
    assert round_.used == count
    assert round_.used + round_.discarded == offered
    if round_.done:
        assert np.allclose(round_.result(), total / count)


@settings(max_examples=100, deadline=None)
@given(
    means=hnp.arrays(np.float64, (3, 2), elements=st.floats(-100, 100)),
    order=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 5)), max_size=40),
    batch=st.integers(1, 30),
)
def test_malenia_gives_each_worker_one_share_whatever_its_count(
    means: np.ndarray, order: list[tuple[int, int]], batch: int
) -> None:
    # Worker i always reports count * means[i]: its mean is means[i] however often it reports.
    round_ = Malenia(batch=batch).start(ROUND, [0, 1, 2])
    counts = [0, 0, 0]
    for worker, n in [*order, (0, 1), (1, 1), (2, 1)]:
        accepted = round_.add(worker, ROUND, n * means[worker], n)
        assert accepted is not round_.done or accepted
        if accepted:
            counts[worker] += n
        if round_.done:
            break
    if round_.done:
        assert min(counts) >= 1
        assert 3 / sum(1 / c for c in counts) >= batch / 3 - 1e-12
        assert np.allclose(round_.result(), means.mean(axis=0), atol=1e-9)
    else:
        assert min(counts) == 0 or 3 / sum(1 / c for c in counts) < batch / 3 + 1e-12


@settings(max_examples=100, deadline=None)
@given(
    grads=hnp.arrays(np.float64, (4, 3, 2), elements=st.floats(-100, 100)),
)
def test_malenia_with_equal_counts_equals_rennala(grads: np.ndarray) -> None:
    # 4 workers take turns, 3 gradients each: both rules end on the last report.
    n, k = grads.shape[0], grads.shape[1]
    rennala = Rennala(batch=n * k).start(ROUND, range(n))
    malenia = Malenia(batch=n * k).start(ROUND, range(n))
    for step in range(k):
        for worker in range(n):
            assert not rennala.done and not malenia.done
            rennala.add(worker, ROUND, grads[worker, step], 1)
            malenia.add(worker, ROUND, grads[worker, step], 1)
    assert rennala.done and malenia.done
    assert np.allclose(malenia.result(), rennala.result(), atol=1e-9)
    assert np.allclose(rennala.result(), grads.reshape(-1, 2).mean(axis=0), atol=1e-9)


@settings(max_examples=100, deadline=None)
@given(
    events=st.lists(
        st.one_of(
            st.tuples(st.integers(0, 2), st.integers(ROUND - 1, ROUND + 1), st.integers(1, 3)),
            st.tuples(st.just(-1), st.integers(0, 2), st.just(0)),  # remove
        ),
        max_size=30,
    ),
    which=st.integers(0, 2),
)
def test_every_gradient_is_used_or_discarded(
    events: list[tuple[int, int, int]], which: int
) -> None:
    rules: list[AggregationRule] = [Rennala(batch=5), Malenia(batch=5), Synchronous()]
    rule = rules[which]
    round_ = rule.start(ROUND, [0, 1, 2], size=1)
    offered = 0
    for a, b, c in events:
        if a == -1:
            round_.remove(b)
        else:
            offered += c
            round_.add(a, b, np.ones(1) * c, c)
    assert round_.used + round_.discarded == offered
    assert sum(round_.contributions.values()) == round_.used
    assert round_.stale <= round_.discarded
    assert round_.can_finish is (round_.done or bool(round_.active))


# -- purity ----------------------------------------------------------------------------------


def test_importing_aps_pg_does_not_load_torch() -> None:
    code = "import sys, aps.pg; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_pg_imports_no_event_loop_socket_or_clock() -> None:
    banned = {"asyncio", "socket", "selectors", "threading", "time", "datetime", "random"}
    root = Path(aps.pg.__file__).parent
    # trainer.py is the one driver (it talks to a Learner, in the roles layer) and
    # sampling.py the workers' sampler (it steps their envs); the rules and the estimator
    # they apply are the pure parts.
    pure = [p for p in sorted(root.glob("*.py")) if p.name not in ("trainer.py", "sampling.py")]
    assert {p.name for p in pure} >= {"nigt.py", "aggregate.py", "reinforce.py"}
    for path in pure:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] not in banned, f"{path.name} imports {name}"
            if path.name != "reinforce.py":
                assert not any(name.split(".")[0] == "torch" for name in names), path.name


# -- counts before sums (per-round aggregation) ------------------------------------------


def test_rennala_is_ready_on_announced_counts_and_takes_every_collected_sum() -> None:
    round_ = Rennala(batch=5).start(7, [0, 1], size=2)
    assert round_.note(0, 7, 3) and not round_.ready
    assert not round_.note(1, 6, 9)  # an earlier round's count is ignored
    assert not round_.ready
    assert round_.note(1, 7, 2) and round_.ready and not round_.done
    round_.begin_collection()
    assert round_.add(0, 7, np.array([4.0, 0.0]), 4)  # it sampled one more before asked
    assert not round_.done  # the rule holds, but the other sum is still on its way
    assert round_.add(1, 7, np.array([0.0, 2.0]), 2)
    round_.end_collection()
    assert round_.done and round_.used == 6
    np.testing.assert_allclose(round_.result(), [4 / 6, 2 / 6])


def test_malenia_is_ready_only_when_every_worker_announced_enough() -> None:
    round_ = Malenia(batch=4).start(0, [0, 1])
    round_.note(0, 0, 100)
    round_.note(1, 0, 0)
    assert not round_.ready
    round_.note(1, 0, 1)
    assert not round_.ready  # 1/100 + 1/1 > 2 * 2 / 4
    round_.note(1, 0, 2)
    assert round_.ready


def test_removing_a_worker_forgets_its_announced_count() -> None:
    round_ = Rennala(batch=4).start(0, [0, 1])
    round_.note(0, 0, 3)
    round_.note(1, 0, 1)
    assert round_.ready
    round_.remove(1)
    assert not round_.ready


@pytest.mark.parametrize("count", [-1, 1.5, "2", None])
def test_a_bad_announced_count_is_refused(count: object) -> None:
    round_ = Rennala(batch=4).start(0, [0])
    with pytest.raises(ConfigError, match="count"):
        round_.note(0, 0, count)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="not in round"):
        round_.note(5, 0, 1)
