"""Gymnasium's attributes, errors and fork behaviour, against ``SyncVectorEnv`` and
``AsyncVectorEnv`` over the same envs.

Each test builds the reference from Gymnasium itself (``gym.make_vec`` or the vector classes)
and holds ``ClusterEnv`` to what it returns: ``metadata``, ``spec``, ``get_attr`` of the
spaces, the spec and ``np_random``, ``np_random_seed``, ``observation_mode``; an env that
raises in ``step``; and a process that forks beside a ``ClusterEnv``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv

import aps
from aps.cluster_env import as_raised
from aps.testing import envs as test_envs
from tests.test_cluster_env import assert_same
from tests.test_vector_backends import ExplodingEnv

NUM_WORKERS, ENVS_PER_WORKER = 2, 2
NUM_ENVS = NUM_WORKERS * ENVS_PER_WORKER
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(params=["memory", "unix"])
def trio(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[aps.ClusterEnv, SyncVectorEnv, AsyncVectorEnv]]:
    """A ClusterEnv, and Gymnasium's two vector envs, made by ``make_vec``, over CartPole."""
    actual = aps.ClusterEnv.local(
        "CartPole-v1",
        num_workers=NUM_WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        transport=request.param,
    )
    made = [
        gym.make_vec("CartPole-v1", num_envs=NUM_ENVS, vectorization_mode=mode)
        for mode in ("sync", "async")
    ]
    try:
        sync, async_ = made
        assert isinstance(sync, SyncVectorEnv) and isinstance(async_, AsyncVectorEnv)
        yield actual, sync, async_
    finally:
        actual.close()
        for envs in made:
            envs.close()


def test_metadata_spec_and_modes_are_gymnasiums(
    trio: tuple[aps.ClusterEnv, SyncVectorEnv, AsyncVectorEnv],
) -> None:
    actual, sync, async_ = trio
    for expected in (sync, async_):
        assert actual.metadata == expected.metadata
        assert actual.render_mode == expected.render_mode
        assert actual.observation_mode == expected.observation_mode == "same"
    assert actual.metadata["render_fps"] == gym.make("CartPole-v1").metadata["render_fps"]
    # The spec make_vec gives an AsyncVectorEnv of these envs: it makes them again locally.
    assert actual.spec == async_.spec
    assert actual.spec is not None
    remade = gym.make_vec(actual.spec)
    try:
        assert isinstance(remade, AsyncVectorEnv) and remade.num_envs == NUM_ENVS
    finally:
        remade.close()


def test_get_attr_of_spaces_and_spec_is_data(
    trio: tuple[aps.ClusterEnv, SyncVectorEnv, AsyncVectorEnv],
) -> None:
    actual, sync, async_ = trio
    for name in ("observation_space", "action_space", "spec", "render_mode"):
        got = actual.get_attr(name)
        assert len(got) == NUM_ENVS
        for expected in (sync.get_attr(name), async_.get_attr(name)):
            assert got == expected, name
    # Lists travel as tuples (aps's wire format has one sequence type).
    metadata = actual.get_attr("metadata")
    assert metadata == ({"render_modes": ("human", "rgb_array"), "render_fps": 50},) * NUM_ENVS
    space = actual.get_attr("observation_space")[0]
    assert type(space) is gym.spaces.Box and space == sync.single_observation_space


def test_np_random_and_its_seed_are_gymnasiums(
    trio: tuple[aps.ClusterEnv, SyncVectorEnv, AsyncVectorEnv],
) -> None:
    actual, sync, async_ = trio
    for envs in (actual, sync, async_):
        envs.reset(seed=9)
    assert actual.np_random_seed == sync.np_random_seed == async_.np_random_seed
    assert actual.np_random_seed == tuple(9 + i for i in range(NUM_ENVS))
    for _ in range(3):  # the random state moves on with the episodes
        actions = np.zeros(NUM_ENVS, dtype=np.int64)
        for envs in (actual, sync, async_):
            envs.step(actions)
    generators = actual.np_random
    for expected in (sync.np_random, async_.np_random):
        assert len(generators) == len(expected) == NUM_ENVS
        for got, want in zip(generators, expected, strict=True):
            assert type(got) is np.random.Generator
            assert got.bit_generator.state == want.bit_generator.state
    # A copy: drawing from it gives the env's next draws, and leaves the env alone.
    draws = generators[0].random(3)
    np.testing.assert_array_equal(draws, sync.np_random[0].random(3))
    again = actual.get_attr("np_random")[0]
    np.testing.assert_array_equal(again.random(3), draws)


# Gymnasium's AsyncVectorEnv reports its subprocesses' errors through warnings too.
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_an_env_error_is_raised_as_gymnasium_raises_it_and_stepping_stops() -> None:
    actual = aps.ClusterEnv.local(
        ExplodingEnv, num_workers=NUM_WORKERS, envs_per_worker=1, transport="memory"
    )
    expected = AsyncVectorEnv([ExplodingEnv] * NUM_WORKERS)
    actions = np.zeros((NUM_WORKERS, 2), dtype=np.float32)
    try:
        for envs in (actual, expected):
            envs.reset(seed=0)
            envs.step(actions)
            envs.step(actions)
        with pytest.raises(RuntimeError, match="the env exploded") as gymnasiums:
            expected.step(actions)
        with pytest.raises(RuntimeError, match="the env exploded") as ours:
            actual.step(actions)
        assert type(ours.value) is type(gymnasiums.value) is RuntimeError
        cause = ours.value.__cause__
        assert isinstance(cause, aps.WorkerError)
        assert cause.remote_type == "builtins.RuntimeError"
        assert "Traceback" in cause.remote_traceback and "in step" in cause.remote_traceback
        # Part of the batch stepped: both refuse to go on until a reset.
        with pytest.raises(aps.InvalidState, match=r"call reset\(\) before stepping again"):
            actual.step(actions)
        with pytest.raises(aps.InvalidState, match=r"raised builtins\.RuntimeError"):
            actual.step_async(actions)
        with pytest.raises(AttributeError):  # Gymnasium's: the failed env's pipe is gone
            expected.step(actions)
        obs, _ = actual.reset(seed=1)
        assert obs.shape[0] == NUM_WORKERS
        actual.step(actions)  # in step again
    finally:
        actual.close()
        expected.close(terminate=True)


class ExplodingInOwnType(ExplodingEnv):
    """Raises an exception type of its own on its third step."""

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        try:
            return super().step(action)
        except RuntimeError as exc:
            raise EnvTrouble(str(exc)) from None


class EnvTrouble(Exception):
    """An env's own exception type: not built in, so it arrives as a WorkerError."""


def test_an_error_of_the_envs_own_type_is_a_worker_error_naming_it() -> None:
    envs = aps.ClusterEnv.local(ExplodingInOwnType, num_workers=1, transport="memory")
    actions = np.zeros((1, 2), dtype=np.float32)
    try:
        envs.reset(seed=0)
        envs.step_async(actions)
        envs.step_wait()
        envs.step(actions)
        envs.step_async(actions)
        with pytest.raises(aps.WorkerError, match="EnvTrouble: the env exploded") as caught:
            envs.step_wait()
        assert caught.value.remote_type.endswith("EnvTrouble")
        with pytest.raises(aps.InvalidState, match="EnvTrouble in the last step"):
            envs.step(actions)
    finally:
        envs.close()


def worker_error(remote_type: str, message: str = "boom") -> aps.WorkerError:
    return aps.WorkerError(message, worker_id=3, remote_type=remote_type, remote_traceback="tb")


@pytest.mark.parametrize(
    ("remote_type", "raised"),
    [
        ("builtins.RuntimeError", RuntimeError),
        ("builtins.ValueError", ValueError),
        ("builtins.AssertionError", AssertionError),
        ("builtins.KeyError", KeyError),
        ("builtins.NotImplementedError", NotImplementedError),
        # Not exceptions, or not built in: the WorkerError itself, naming the type.
        ("builtins.SystemExit", aps.WorkerError),
        ("builtins.KeyboardInterrupt", aps.WorkerError),
        ("builtins.print", aps.WorkerError),
        ("builtins.int", aps.WorkerError),
        ("builtins.NoSuchError", aps.WorkerError),
        ("os.RuntimeError", aps.WorkerError),
        ("RuntimeError", aps.WorkerError),
        ("mypackage.builtins.RuntimeError", aps.WorkerError),
        ("gymnasium.error.ResetNeeded", aps.WorkerError),
        # A built-in type whose constructor wants more than a message.
        ("builtins.UnicodeDecodeError", aps.WorkerError),
    ],
)
def test_only_builtin_exception_types_are_raised_as_themselves(
    remote_type: str, raised: type[Exception]
) -> None:
    error = worker_error(remote_type)
    result = as_raised(error)
    assert type(result) is raised
    if result is not error:
        assert result.__cause__ is error and result.args == ("boom",)


def test_sb3_adapter_raises_env_errors_and_refuses_to_step_after_one() -> None:
    pytest.importorskip("stable_baselines3")
    from aps.integrations.sb3 import ClusterVecEnv

    vec_env = ClusterVecEnv.local(ExplodingEnv, num_workers=2, transport="memory")
    actions = np.zeros((2, 2), dtype=np.float32)
    try:
        vec_env.reset()
        vec_env.step(actions)
        vec_env.step(actions)
        with pytest.raises(RuntimeError, match="the env exploded"):
            vec_env.step(actions)
        with pytest.raises(aps.InvalidState, match=r"call reset\(\)"):
            vec_env.step(actions)
        with pytest.raises(AttributeError, match="no_such_attribute"):
            vec_env.get_attr("no_such_attribute")
        vec_env.reset()
        vec_env.step(actions)
    finally:
        vec_env.close()


FORK_SCRIPT = textwrap.dedent(
    """
    import multiprocessing
    import sys

    import gymnasium as gym
    import numpy as np

    import aps

    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=2, transport=sys.argv[1])
    envs.reset(seed=0)
    # Gymnasium forks its subprocesses here (the default on Linux, named to be sure).
    evaluation = gym.vector.AsyncVectorEnv(
        [lambda: gym.make("CartPole-v1")] * 2, context="fork"
    )
    evaluation.reset(seed=0)
    evaluation.step(np.zeros(2, dtype=np.int64))
    evaluation.close()
    print("children", *[p.exitcode for p in evaluation.processes], flush=True)
    # The parent's env still steps: no child touched its connections.
    envs.step(np.zeros(2, dtype=np.int64))
    envs.close()
    print("closed", flush=True)
    """
)


@pytest.mark.parametrize("transport", ["unix", "tcp", "memory"])
def test_async_vector_env_forked_beside_a_cluster_env_closes(
    tmp_path: Path, transport: str
) -> None:
    script = tmp_path / "fork_beside.py"
    script.write_text(FORK_SCRIPT)
    try:
        done = subprocess.run(
            [sys.executable, str(script), transport],
            capture_output=True,
            text=True,
            timeout=90,
            cwd=REPO,
        )
    except subprocess.TimeoutExpired as exc:  # the hang this guards against
        pytest.fail(f"the forked children did not exit: {exc.stdout!r} {exc.stderr!r}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["children", "0", "0", "closed"], done.stderr


def _use_in_child(envs: aps.ClusterEnv, answers: Any) -> None:
    try:
        envs.step(np.zeros(1, dtype=np.int64))
    except aps.InvalidState as exc:
        answers.put(f"InvalidState: {exc}")
    else:
        answers.put("stepped")
    envs.close()  # in the child: only marks its copy closed


def test_a_forked_child_cannot_use_the_parents_env() -> None:
    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    context = multiprocessing.get_context("fork")
    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=1, transport="unix")
    try:
        envs.reset(seed=0)
        answers = context.Queue()
        child = context.Process(target=_use_in_child, args=(envs, answers))
        child.start()
        try:
            answer = answers.get(timeout=60)
        finally:
            child.join(timeout=60)
            if child.is_alive():
                child.kill()
        assert child.exitcode == 0
        assert answer.startswith("InvalidState: this ClusterEnv belongs to process")
        assert "a fork of it" in answer
        envs.step(np.zeros(1, dtype=np.int64))  # the parent's env goes on
        assert not envs.closed
    finally:
        envs.close()


class TextEnv(gym.Env[str, int]):
    """An env whose observations are text: a space that cannot travel."""

    observation_space = gym.spaces.Text(8)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[str, dict[str, Any]]:
        super().reset(seed=seed)
        return "a", {}

    def step(self, action: int) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return "b", 0.0, False, False, {}


@pytest.mark.parametrize("transport", ["memory", "unix"])
def test_a_worker_that_cannot_serve_its_env_reaches_the_user_with_its_reason(
    transport: str,
) -> None:
    env: Any = TextEnv if transport == "memory" else f"{Path(__file__)}:TextEnv"
    with pytest.raises(aps.WorkerLost) as caught:
        aps.ClusterEnv.local(env, num_workers=1, transport=transport)
    message = str(caught.value)
    assert "EndOfStream: the worker left: ConfigError: space is a Text" in message
    assert "FlattenObservation" in message  # the fix, in the worker's own words
    assert "bye" not in message


def test_a_worker_logs_a_line_when_told_goodbye(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="aps.worker")
    envs = aps.ClusterEnv.local("CartPole-v1", num_workers=1, transport="memory")
    envs.close()
    lines = [r.getMessage() for r in caplog.records if "said goodbye" in r.getMessage()]
    assert len(lines) == 1 and "the learner is closing" in lines[0], lines


def test_a_worker_logs_a_line_when_it_gives_up(caplog: pytest.LogCaptureFixture) -> None:
    with socket.socket() as placeholder:  # a port nobody listens on
        placeholder.bind(("127.0.0.1", 0))
        port = placeholder.getsockname()[1]
    worker = aps.Worker(
        f"tcp://127.0.0.1:{port}", "CartPole-v1", timeouts=aps.Timeouts(connect=0.3), label="w7"
    )
    with pytest.raises(aps.Timeout, match="could not reach the learner"):
        asyncio.run(asyncio.wait_for(worker.run(), 30))
    lines = [r.getMessage() for r in caplog.records if "gives up" in r.getMessage()]
    assert len(lines) == 1 and "[w7]" in lines[0] and "could not reach" in lines[0], lines


def test_spec_of_a_factory_env_is_none_as_gymnasiums() -> None:
    envs = aps.ClusterEnv.local(ExplodingEnv, num_workers=1, transport="memory")
    expected = SyncVectorEnv([ExplodingEnv])
    try:
        assert envs.spec is expected.spec is None
        assert envs.get_attr("spec") == expected.get_attr("spec") == (None,)
        assert envs.metadata == expected.metadata
    finally:
        envs.close()
        expected.close()


def test_a_spec_with_a_callable_entry_point_travels_as_its_import_path() -> None:
    spec = dataclasses.replace(gym.spec("CartPole-v1"), entry_point=ExplodingEnv, kwargs={"a": 1})
    from aps.wire import codec
    from aps.wire.messages import EnvCallResult
    from aps.wire.spaces import value_from_wire, value_to_wire

    frame = codec.encode(EnvCallResult(values=(value_to_wire(spec),), seq=0))
    message = codec.decode(frame)
    assert isinstance(message, EnvCallResult)
    back = value_from_wire(message.values[0])
    assert back == dataclasses.replace(
        spec, entry_point=f"{ExplodingEnv.__module__}:{ExplodingEnv.__qualname__}"
    )


@pytest.mark.parametrize("mode", [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP])
def test_metadata_names_the_autoreset_mode(mode: AutoresetMode) -> None:
    envs = aps.ClusterEnv.local(
        "CartPole-v1", num_workers=1, transport="memory", autoreset_mode=mode
    )
    expected = gym.make_vec(
        "CartPole-v1", num_envs=1, vectorization_mode="sync", vector_kwargs={"autoreset_mode": mode}
    )
    try:
        assert envs.metadata == expected.metadata
        assert envs.metadata["autoreset_mode"] is mode
        assert_same(envs.reset(seed=2), expected.reset(seed=2), "reset")
    finally:
        envs.close()
        expected.close()


@pytest.mark.parametrize(("transport", "vector"), [("memory", "sync"), ("unix", "async")])
def test_disabled_autoreset_equals_gymnasiums(transport: str, vector: str) -> None:
    # Nothing resets by itself: the caller resets the ended envs with a reset_mask, which
    # reaches each worker as its part (a worker none of whose envs it marks keeps them).
    mode = AutoresetMode.DISABLED
    env: Any = "aps.testing.envs:BoxEnv"
    actual = aps.ClusterEnv.local(
        env,
        num_workers=NUM_WORKERS,
        envs_per_worker=ENVS_PER_WORKER,
        transport=transport,
        vector=vector,
        autoreset_mode=mode,
    )
    fns = [test_envs.BoxEnv] * NUM_ENVS
    references = [
        SyncVectorEnv(fns, autoreset_mode=mode),
        AsyncVectorEnv(fns, autoreset_mode=mode),
    ]
    rng = np.random.default_rng(0)
    try:
        assert actual.metadata["autoreset_mode"] is mode
        results = [envs.reset(seed=4) for envs in (actual, *references)]
        for expected in results[1:]:
            assert_same(results[0], expected, "reset")
        partial = 0
        for t in range(40):
            actions = rng.uniform(-1, 1, (NUM_ENVS, *test_envs.BoxEnv().action_space.shape))
            actions = actions.astype(np.float32)
            results = [envs.step(actions) for envs in (actual, *references)]
            for expected in results[1:]:
                assert_same(results[0], expected, f"step {t}")
            _, _, terminated, truncated, _ = results[0]
            ended = terminated | truncated
            if ended.any():
                options = {"reset_mask": ended}
                results = [envs.reset(options=dict(options)) for envs in (actual, *references)]
                for expected in results[1:]:
                    assert_same(results[0], expected, f"partial reset at {t}")
                partial += int(
                    not ended[:ENVS_PER_WORKER].any() or not ended[ENVS_PER_WORKER:].any()
                )
        assert partial > 0  # a reset where one worker's envs were all left alone
    finally:
        actual.close()
        for envs in references:
            envs.close()


def test_disabled_refuses_to_step_an_ended_env_as_gymnasium() -> None:
    mode = AutoresetMode.DISABLED
    actual = aps.ClusterEnv.local(
        "CartPole-v1",
        num_workers=1,
        transport="memory",
        autoreset_mode=mode,
        env_kwargs={"max_episode_steps": 2},
    )
    expected = SyncVectorEnv(
        [lambda: gym.make("CartPole-v1", max_episode_steps=2)], autoreset_mode=mode
    )
    actions = np.zeros(1, dtype=np.int64)
    try:
        for envs in (actual, expected):
            envs.reset(seed=0)
            envs.step(actions)
            assert envs.step(actions)[3].tolist() == [True]  # truncated
        with pytest.raises(AssertionError):
            expected.step(actions)
        with pytest.raises(AssertionError):
            actual.step(actions)
        with pytest.raises(aps.ConfigError, match=r"reset_mask'\] must be a numpy bool array"):
            actual.reset(options={"reset_mask": np.zeros(1, dtype=np.bool_)})
        with pytest.raises(aps.ConfigError, match=r"of shape \(1,\)"):
            actual.reset(options={"reset_mask": [True]})
        actual.reset(options={"reset_mask": np.ones(1, dtype=np.bool_)})
        actual.step(actions)
    finally:
        actual.close()
        expected.close()
