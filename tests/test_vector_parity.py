"""Gymnasium ``VectorEnv`` parity beyond reset/step: envs reached by name, per-env seeds,
frames, the bound URL, and what happens after ``close()`` and at interpreter exit.

Gymnasium (1.x) ships no checker for vector envs (``gymnasium.utils.env_checker`` checks a
single env), so the reference is ``SyncVectorEnv`` over the same env functions, call for call.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import SyncVectorEnv

import aps
from aps.launch.local import terminate
from tests.test_cluster_env import assert_same

NUM_WORKERS, ENVS_PER_WORKER = 2, 2
NUM_ENVS = NUM_WORKERS * ENVS_PER_WORKER
REPO = Path(__file__).resolve().parent.parent


def rgb_cartpole() -> gym.Env[Any, Any]:
    return gym.make("CartPole-v1", render_mode="rgb_array")


@pytest.fixture(params=["memory", "unix"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[aps.ClusterEnv, SyncVectorEnv]]:
    """A ClusterEnv and a SyncVectorEnv over the same rgb_array CartPoles."""
    transport = request.param
    actual = aps.ClusterEnv.local(
        rgb_cartpole if transport == "memory" else "CartPole-v1",
        env_kwargs=None if transport == "memory" else {"render_mode": "rgb_array"},
        num_workers=NUM_WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        transport=transport,
    )
    expected = SyncVectorEnv([rgb_cartpole] * NUM_ENVS)
    try:
        yield actual, expected
    finally:
        actual.close()
        expected.close()


def test_get_attr_set_attr_and_call_by_name_match(
    pair: tuple[aps.ClusterEnv, SyncVectorEnv],
) -> None:
    actual, expected = pair
    assert_same(actual.get_attr("gravity"), expected.get_attr("gravity"), "get_attr")
    values = [9.8, 4.0, 1.6, 24.8]
    actual.set_attr("gravity", values)
    expected.set_attr("gravity", values)
    assert actual.get_attr("gravity") == tuple(values)
    assert_same(actual.get_attr("gravity"), expected.get_attr("gravity"), "after set_attr")
    # A single value (not a list) goes to every env, as Gymnasium does.
    actual.set_attr("length", 0.25)
    expected.set_attr("length", 0.25)
    assert_same(actual.get_attr("length"), expected.get_attr("length"), "set one value")
    # A method with arguments, and an attribute that is not callable (returned as it is).
    assert_same(
        actual.call("get_wrapper_attr", "x_threshold"),
        expected.call("get_wrapper_attr", "x_threshold"),
        "call with an argument",
    )
    assert_same(actual.call("x_threshold"), expected.call("x_threshold"), "call an attribute")
    # Gravity changes the dynamics: stepping with the set values still agrees.
    assert_same(actual.reset(seed=1), expected.reset(seed=1), "reset")
    for t in range(20):
        actions = np.array([t % 2] * NUM_ENVS)
        assert_same(actual.step(actions), expected.step(actions), f"step {t}")


def test_reset_takes_one_seed_per_env(pair: tuple[aps.ClusterEnv, SyncVectorEnv]) -> None:
    actual, expected = pair
    seeds = [7, None, 3, 100]
    obs, info = actual.reset(seed=seeds)
    expected_obs, expected_info = expected.reset(seed=seeds)
    # The None env is unseeded on both sides: every other row must agree.
    rows = [0, 2, 3]
    np.testing.assert_array_equal(obs[rows], expected_obs[rows])
    assert_same(info, expected_info, "info")
    # Seeded twice alike, all rows agree.
    all_seeded = [5, 6, 8, 9]
    assert_same(actual.reset(seed=all_seeded), expected.reset(seed=all_seeded), "list seeds")
    with pytest.raises(aps.ConfigError, match=r"seed must be .* a list of 4 ints"):
        actual.reset(seed=[1, 2, 3])
    with pytest.raises(aps.ConfigError, match=r"seed must be"):
        actual.reset(seed="x")  # type: ignore[arg-type]


def test_render_returns_every_envs_frame(pair: tuple[aps.ClusterEnv, SyncVectorEnv]) -> None:
    actual, expected = pair
    assert actual.render_mode == expected.render_mode == "rgb_array"
    actual.reset(seed=2)
    expected.reset(seed=2)
    actual.step(np.ones(NUM_ENVS, dtype=np.int64))
    expected.step(np.ones(NUM_ENVS, dtype=np.int64))
    frames = actual.render()
    assert frames is not None and len(frames) == NUM_ENVS
    assert_same(frames, expected.render(), "frames")
    assert frames[0].shape == (400, 600, 3) and frames[0].dtype == np.uint8


@pytest.mark.filterwarnings("ignore:.*without specifying any render mode")
def test_render_without_render_mode_returns_what_gymnasium_returns() -> None:
    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=2, transport="memory")
    expected = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="async")
    try:
        assert envs.render_mode is expected.render_mode is None
        envs.reset(seed=0)
        expected.reset(seed=0)
        assert envs.render() == expected.render() == (None, None)
    finally:
        envs.close()
        expected.close()


def test_env_call_errors_name_the_fix() -> None:
    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=2, transport="memory")
    try:
        # A value that cannot travel: the worker's error, and the env keeps working.
        with pytest.raises(aps.WorkerError, match=r"get_attr\('unwrapped'\) returned a value"):
            envs.get_attr("unwrapped")
        # An env's own error is raised as Gymnasium raises it: its built-in type.
        with pytest.raises(AttributeError, match="no_such_attribute"):
            envs.call("no_such_attribute")
        # Arguments that cannot travel are refused before anything is sent.
        with pytest.raises(aps.ConfigError, match="cannot travel to the workers"):
            envs.call("get_wrapper_attr", object())
        with pytest.raises(aps.ConfigError, match="got 3 values for 2 envs"):
            envs.set_attr("gravity", [1.0, 2.0, 3.0])
        with pytest.raises(aps.ConfigError, match=r"call_learner\(function\)"):
            envs.call(lambda learner: learner.rollout(1))  # type: ignore[arg-type]
        envs.reset(seed=0)
        envs.step(np.zeros(2, dtype=np.int64))
        assert envs.get_attr("gravity") == (9.8, 9.8)
    finally:
        envs.close()


def test_url_is_known_before_the_workers_arrive(tmp_path: Path) -> None:
    seen: list[str] = []
    worker: subprocess.Popen[bytes] | None = None

    def start_worker(url: str) -> None:
        nonlocal worker
        seen.append(url)
        worker = subprocess.Popen(
            [sys.executable, "-m", "aps", "worker", url, "--env", "CartPole-v1"],
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )

    try:
        envs = aps.ClusterEnv("tcp://127.0.0.1:0", num_workers=1, on_listening=start_worker)
        try:
            assert envs.url == seen[0] and not envs.url.endswith(":0")
            envs.reset(seed=0)
        finally:
            envs.close()
    finally:
        if worker is not None:
            terminate([worker], grace=5.0)


def test_use_after_close_raises_invalid_state() -> None:
    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=1, transport="memory")
    envs.reset(seed=0)
    envs.close()
    for use in (
        lambda: envs.step(np.zeros(1, dtype=np.int64)),
        lambda: envs.reset(),
        lambda: envs.get_attr("gravity"),
        lambda: envs.step_async(np.zeros(1, dtype=np.int64)),
    ):
        with pytest.raises(aps.InvalidState, match="this ClusterEnv is closed"):
            use()
    envs.close()  # still idempotent


EXIT_SCRIPT = textwrap.dedent(
    """
    import sys
    import aps

    envs = aps.ClusterEnv.local(
        "CartPole-v1", num_workers=2, transport=sys.argv[1], use_uvloop=sys.argv[2] == "1"
    )
    envs.reset(seed=0)
    print("pids", *[w.pid for w in envs.workers], flush=True)
    if sys.argv[3] == "exit":
        sys.exit(3)
    raise KeyError("the training loop failed")
    """
)


@pytest.mark.parametrize("ending", ["exit", "raise"])
@pytest.mark.parametrize("use_uvloop", ["0", "1"])
@pytest.mark.parametrize("transport", ["unix", "tcp"])
def test_exit_without_close_is_silent_and_stops_the_workers(
    tmp_path: Path, transport: str, use_uvloop: str, ending: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(EXIT_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), transport, use_uvloop, ending],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    pids = [int(p) for p in done.stdout.split()[1:]]
    assert len(pids) == 2, done.stdout + done.stderr
    if ending == "exit":
        assert done.returncode == 3
        assert done.stderr == ""
    else:
        # The script's own error, and nothing from aps after it.
        assert done.returncode == 1
        assert done.stderr.rstrip().endswith("KeyError: 'the training loop failed'")
        assert done.stderr.count("Traceback") == 1, done.stderr
    # Stopped (and reaped) before the interpreter exited: checked at once, not after a wait,
    # since workers left alone also end by themselves a little later.
    alive = [pid for pid in pids if _alive(pid)]
    assert not alive, f"workers {alive} outlived the script"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too (reaped by whoever adopted it).
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state != "Z"


# Errors that point the right way.


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("foo://x", "unknown transport scheme 'foo'; known schemes:"),
        ("10.0.0.1:7000", "has no scheme; write it as tcp://host:port"),
        ("tcp:/10.0.0.1:7000", "has no scheme"),
    ],
)
def test_a_url_without_a_known_scheme_says_so_before_tokens(url: str, match: str) -> None:
    with pytest.raises(aps.ConfigError, match=match):
        aps.ClusterEnv(url, num_workers=1)


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ("CartPoleXX-v1", "Environment `CartPoleXX` doesn't exist"),
        ("no_such_module_here:make", "No module named 'no_such_module_here'"),
    ],
)
def test_envs_no_worker_could_build_are_refused_before_any_starts(env: str, words: str) -> None:
    # The local workers share this interpreter's packages: what they would refuse, the
    # caller hears at once, in its own process, with Gymnasium's or Python's words.
    with pytest.raises(aps.ConfigError) as caught:
        aps.ClusterEnv.local(env, num_workers=1, transport="unix")
    assert words in str(caught.value)


def broken_env() -> gym.Env[Any, Any]:
    """An env factory that imports fine and raises when a worker builds it."""
    raise RuntimeError("this env cannot be built here: no display")


def test_a_worker_that_cannot_build_its_envs_is_quoted_in_the_error() -> None:
    with pytest.raises(aps.WorkerLost) as caught:
        aps.ClusterEnv.local(broken_env, num_workers=1, transport="unix")
    assert "this env cannot be built here: no display" in str(caught.value)
    assert "could not build its envs" in str(caught.value)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": "x"}, "seed must be an int or None, got 'x'"),
        ({"seed": 1.5}, "seed must be an int or None, got 1.5"),
        ({"env_kwargs": 3}, "env_kwargs must be a dict of keyword arguments, or a list"),
        ({"timeouts": 3}, "timeouts must be an aps.Timeouts or None, got 3"),
    ],
)
def test_local_checks_its_arguments_before_starting(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(aps.ConfigError, match=match):
        aps.ClusterEnv.local("CartPole-v1", transport="memory", **kwargs)


# What AsyncVectorEnv accepts: a list of env functions (closures), and num_envs.


def make_env(gravity: float) -> Any:
    """A CleanRL-style factory: the thunk it returns is a closure."""

    def thunk() -> gym.Env[Any, Any]:
        env = gym.make("CartPole-v1")
        env.unwrapped.gravity = gravity  # type: ignore[attr-defined]
        return env

    return thunk


@pytest.mark.parametrize("transport", ["memory", "unix"])
def test_local_takes_a_list_of_env_functions(transport: str) -> None:
    thunks = [make_env(g) for g in (9.8, 4.0, 1.6, 24.8)]
    expected = SyncVectorEnv(thunks)
    actual = aps.ClusterEnv.local(thunks, num_workers=2, transport=transport)
    try:
        assert actual.num_envs == 4 and [w.num_envs for w in actual.workers] == [2, 2]
        # Each env was built by its own function, in order.
        assert actual.get_attr("gravity") == (9.8, 4.0, 1.6, 24.8)
        assert_same(actual.reset(seed=0), expected.reset(seed=0), "reset")
        for t in range(30):
            actions = np.array([t % 2, 1, 0, (t // 3) % 2])
            assert_same(actual.step(actions), expected.step(actions), f"step {t}")
    finally:
        actual.close()
        expected.close()


def test_num_envs_splits_over_workers() -> None:
    envs = aps.ClusterEnv.local("CartPole-v1", num_envs=6, num_workers=3, transport="memory")
    try:
        assert envs.num_envs == 6 and [w.num_envs for w in envs.workers] == [2, 2, 2]
    finally:
        envs.close()
    envs = aps.ClusterEnv.local("CartPole-v1", num_envs=4, transport="memory")
    try:
        cpus = os.cpu_count() or 1
        workers = max(d for d in (1, 2, 4) if d <= cpus)
        assert envs.num_envs == 4 and len(envs.workers) == workers
    finally:
        envs.close()


@pytest.mark.parametrize(
    ("env", "kwargs", "match"),
    [
        ("CartPole-v1", {"num_envs": 5, "num_workers": 2}, "num_envs=5 cannot be split"),
        ("CartPole-v1", {"num_envs": 0}, "num_envs must be an int >= 1, got 0"),
        ([make_env(1.0)] * 3, {"num_envs": 4}, "num_envs=4 with 3 env functions"),
        ([make_env(1.0), "CartPole-v1"], {}, "env function 1 is 'CartPole-v1', not a callable"),
        ([make_env(1.0)] * 2, {"vector": "async"}, "use vector='sync'"),
        ([make_env(1.0)] * 2, {"env_kwargs": {"a": 1}}, "the functions take no arguments"),
    ],
)
def test_env_function_and_num_envs_mistakes_are_named(
    env: Any, kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(aps.ConfigError, match=match):
        aps.ClusterEnv.local(env, transport="memory", **kwargs)


def test_env_functions_that_cannot_be_pickled_are_named() -> None:
    lock = __import__("threading").Lock()

    def thunk() -> gym.Env[Any, Any]:
        assert lock is not None  # captures a lock, which no pickler can carry
        return gym.make("CartPole-v1")

    with pytest.raises(aps.ConfigError, match=r"env functions 0\.\.0 .* pickling them failed"):
        aps.ClusterEnv.local([thunk, thunk], num_workers=2, transport="unix")


# Policy factories take keyword arguments that travel as data.

SIZED = f"{Path(__file__).resolve().parent / 'agents_sized.py'}:SizedAgent"


@pytest.mark.parametrize("transport", ["memory", "unix"])
def test_policy_kwargs_reach_the_workers_factory(transport: str) -> None:
    pytest.importorskip("torch")
    from tests.agents_sized import SizedAgent

    envs = aps.ClusterEnv.local(
        "CartPole-v1",
        num_workers=2,
        transport=transport,
        policy=SIZED,
        policy_kwargs={"hidden_size": 8},
    )
    try:
        agent = SizedAgent(envs, hidden_size=8)
        envs.reset(seed=0)
        envs.publish(agent)
        # Weights of 8 hidden units load only into workers that built 8 (the default is 64).
        rollout = envs.rollout(4)
        assert rollout.reward.shape == (4, 2)
    finally:
        envs.close()


def test_policy_kwargs_that_are_not_data_are_refused() -> None:
    with pytest.raises(aps.ConfigError, match="policy_kwargs must be plain data"):
        aps.Learner("memory://", num_workers=1, policy=SIZED, policy_kwargs={"f": object()})
    with pytest.raises(aps.ConfigError, match="policy_kwargs without a policy"):
        aps.Learner("memory://", num_workers=1, policy_kwargs={"hidden_size": 8})


def slow_make_env(gravity: float, delay: float) -> Any:
    def thunk() -> gym.Env[Any, Any]:
        __import__("time").sleep(delay)  # this worker is ready after the others
        return make_env(gravity)()

    return thunk


def test_env_order_follows_the_launch_order_not_the_arrival_order() -> None:
    thunks = [slow_make_env(9.8, 1.0), make_env(4.0), make_env(1.6)]
    envs = aps.ClusterEnv.local(thunks, num_workers=3, transport="unix")
    try:
        assert [w.label for w in envs.workers] == ["0", "1", "2"]
        assert [w.env_offset for w in envs.workers] == [0, 1, 2]
        assert envs.get_attr("gravity") == (9.8, 4.0, 1.6)
    finally:
        envs.close()
