"""A worker that holds the token is bounded too: what it sends is its own loss, never the learner's.

Real workers over TCP on 127.0.0.1, each changed in one way by an attacker:

- one stalls an answer and keeps heartbeating: it is lost by the step deadline, which counts
  from the request (heartbeats prove the connection, not progress);
- one sends a malformed ``info`` (a key without its mask), or one whose mask covers other
  workers' envs: that is its loss under every ``on_worker_lost``, as a malformed ``obs`` is;
- one raises an exception type that steers the learner's control flow (``StopIteration``)
  or a huge message: only allow-listed types are rebuilt, and the text is capped.
"""

from __future__ import annotations

import asyncio
import builtins
import dataclasses
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

import aps
from aps.errors import MAX_REMOTE_TEXT, REBUILT_TYPES, rebuilt
from aps.session import Session
from aps.testing import envs as test_envs
from aps.wire import codec
from aps.wire.messages import EnvCallResult, Message, ResetResult, StepResult
from tests.conftest import FAST, WorkerTasks

TCP = "tcp://127.0.0.1:0"
ENVS = 2
STEP = 1.0
"""The learner's step deadline in these tests."""
OUTER = 10.0
"""How long a stalled worker may take to be lost here: far less than 'never' (the attacker
heartbeats for as long as the test runs), far more than ``STEP``."""
TIMEOUTS = dataclasses.replace(FAST, step=STEP)


async def until(condition: Any, seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (the learner has no event for these)
            await asyncio.sleep(0.02)


class AlteredSession:
    """A worker's session whose answers of ``kinds`` are changed by ``alter``.

    ``alter`` returns the frame to send instead, or ``None`` to send nothing (a stall). The
    real session's protocol table sees the honest message, and its heartbeats go on.
    """

    def __init__(self, session: Session, kinds: tuple[type[Message], ...], alter: Any) -> None:
        self._session = session
        self._kinds = kinds
        self._alter = alter

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    async def send(self, message: Message, *, frame: bytes | None = None) -> None:
        if isinstance(message, self._kinds):
            frame = self._alter(message)
            if frame is None:
                self._session._connection.send(message)  # as if sent: heartbeats go on
                return
        await self._session.send(message, frame=frame)


class AlteredWorker(aps.Worker):
    """A worker that holds the token and whose answers of ``kinds`` are altered."""

    def __init__(self, *args: Any, kinds: tuple[type[Message], ...], alter: Any, **kw: Any) -> None:
        kw.setdefault("timeouts", FAST)  # heartbeats every 0.2 s
        super().__init__(*args, **kw)
        self._kinds = kinds
        self._alter = alter

    async def _serve(self, session: Session) -> None:
        altered = AlteredSession(session, self._kinds, self._alter)
        await super()._serve(altered)  # type: ignore[arg-type]


def start_altered(
    workers: WorkerTasks, url: str, kinds: tuple[type[Message], ...], alter: Any
) -> tuple[AlteredWorker, asyncio.Task[None]]:
    worker = AlteredWorker(url, "CartPole-v1", num_envs=ENVS, kinds=kinds, alter=alter)
    task = asyncio.create_task(worker.run())
    workers.tasks.append(task)
    return worker, task


def stall(message: Message) -> None:
    return None


ACTIONS = np.zeros(2 * ENVS, np.int64)


# 1. A stalled worker that keeps heartbeating is lost by the step deadline.


@pytest.mark.timeout(60)
@pytest.mark.parametrize("operation", ["reset", "step", "send", "call"])
async def test_a_stalled_worker_that_heartbeats_is_lost_under_raise(
    workers: WorkerTasks, operation: str
) -> None:
    kinds = {"reset": ResetResult, "call": EnvCallResult}.get(operation, StepResult)
    async with aps.Learner(
        TCP, num_workers=2, timeouts=TIMEOUTS, on_worker_lost="raise"
    ) as learner:
        workers.start(learner.url, num_envs=ENVS)
        await until(lambda: len(learner.workers) == 1)
        bad, _ = start_altered(workers, learner.url, (kinds,), stall)
        await learner.wait_for_workers()
        with pytest.raises(aps.WorkerLost, match=f"worker {bad.worker_id}") as caught:
            async with asyncio.timeout(OUTER):
                if operation != "reset":
                    await learner.reset(seed=0)
                if operation == "reset":
                    await learner.reset(seed=0)
                elif operation == "step":
                    await learner.step(ACTIONS)
                elif operation == "send":
                    await learner.send(ACTIONS)
                    await learner.recv(min_workers=2)
                else:
                    await learner.get_attr("metadata")
        cause = caught.value.__cause__
        assert isinstance(cause, aps.Timeout), cause
        assert "heartbeats do not count" in str(cause)


@pytest.mark.timeout(60)
async def test_a_stalled_worker_that_heartbeats_is_replaced_under_wait(
    workers: WorkerTasks,
) -> None:
    async with aps.Learner(
        TCP, num_workers=2, timeouts=TIMEOUTS, on_worker_lost="wait", reconnect_timeout=20
    ) as learner:
        workers.start(learner.url, num_envs=ENVS)
        await until(lambda: len(learner.workers) == 1)
        bad, _ = start_altered(workers, learner.url, (StepResult,), stall)
        await learner.reset(seed=0)
        workers.start(learner.url, num_envs=ENVS)  # the spare
        await until(lambda: learner._pool.joining.describe()[0].spares == 1)
        async with asyncio.timeout(OUTER):
            _, _, _, truncated, info = await learner.step(ACTIONS)
        assert learner.restarts == 1
        assert bad.worker_id not in {w.worker_id for w in learner.workers}
        assert info["worker_restarted"].sum() == ENVS and truncated.sum() == ENVS
        for _ in range(3):  # the honest workers keep stepping
            await learner.step(ACTIONS)


# 2 and 3. A malformed info, or one that covers other workers' envs, is its worker's loss.


def forged(kind: str) -> Any:
    """A step whose info is wrong in one way."""

    def alter(message: Message) -> bytes:
        assert isinstance(message, StepResult)
        if kind == "no_mask":
            info: dict[str, Any] = {"forged": np.ones(ENVS)}
        elif kind == "wide_mask":  # covers every env of the learner, not only its own
            info = {"forged": np.full(3 * ENVS, 7.0), "_forged": np.ones(3 * ENVS, bool)}
        elif kind == "wide_nested":
            inner = {"x": np.full(3 * ENVS, 7.0), "_x": np.ones(3 * ENVS, bool)}
            info = {"forged": inner, "_forged": np.ones(ENVS, bool)}
        elif kind == "short_value":
            info = {"forged": np.ones(ENVS - 1), "_forged": np.ones(ENVS, bool)}
        else:
            assert kind == "scalar"
            info = {"forged": np.float64(7.0), "_forged": np.ones(ENVS, bool)}
        return codec.encode(dataclasses.replace(message, info=info))

    return alter


INFOS = ["no_mask", "wide_mask", "wide_nested", "short_value", "scalar"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", INFOS)
async def test_a_malformed_info_is_its_workers_loss_under_raise(
    workers: WorkerTasks, kind: str
) -> None:
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST, on_worker_lost="raise") as learner:
        workers.start(learner.url, num_envs=ENVS)
        await until(lambda: len(learner.workers) == 1)
        bad, task = start_altered(workers, learner.url, (StepResult,), forged(kind))
        await learner.reset(seed=0)
        with pytest.raises(aps.ProtocolError, match=f"^worker {bad.worker_id} .*info") as caught:
            await learner.step(ACTIONS)
        assert "forged" in str(caught.value)
        await asyncio.wait_for(task, 20)  # disconnected with a goodbye: its run ends


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", INFOS)
async def test_a_malformed_info_is_its_workers_loss_under_wait(
    workers: WorkerTasks, kind: str
) -> None:
    async with aps.Learner(
        TCP, num_workers=3, timeouts=FAST, on_worker_lost="wait", reconnect_timeout=20
    ) as learner:
        workers.start(learner.url, num_envs=ENVS)
        await until(lambda: len(learner.workers) == 1)
        _, task = start_altered(workers, learner.url, (StepResult,), forged(kind))
        await until(lambda: len(learner.workers) == 2)
        workers.start(learner.url, num_envs=ENVS)
        await learner.reset(seed=0)
        workers.start(learner.url, num_envs=ENVS)  # the spare
        await until(lambda: learner._pool.joining.describe()[0].spares == 1)
        _, _, _, _, info = await learner.step(np.zeros(3 * ENVS, np.int64))
        assert "forged" not in info  # no env, honest or not, holds the forged value
        await asyncio.wait_for(task, 20)
        assert learner.restarts == 1
        for _ in range(3):  # the honest workers keep stepping
            _, _, _, _, info = await learner.step(np.zeros(3 * ENVS, np.int64))
            assert "forged" not in info


@pytest.mark.timeout(60)
async def test_a_malformed_info_under_drop_is_that_workers_loss_not_the_learners_end(
    workers: WorkerTasks,
) -> None:
    # Lockstep cannot go on without a worker's envs, so under "drop" the step fails; but it
    # fails as that worker's loss, naming it, and not with a broken merge of every info.
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST, on_worker_lost="drop") as learner:
        workers.start(learner.url, num_envs=ENVS)
        await until(lambda: len(learner.workers) == 1)
        bad, _ = start_altered(workers, learner.url, (StepResult,), forged("no_mask"))
        await learner.reset(seed=0)
        with pytest.raises(aps.WorkerLost, match=f"worker {bad.worker_id}") as caught:
            await learner.step(ACTIONS)
        assert isinstance(caught.value.__cause__, aps.ProtocolError)
        assert "'_forged' mask" in str(caught.value.__cause__)


def disagreeing(message: Message) -> bytes:
    """A well-formed info whose key the honest worker also sends, in another shape."""
    assert isinstance(message, StepResult)
    info = {"shared": np.full((ENVS, 3), 7.0), "_shared": np.ones(ENVS, bool)}
    return codec.encode(dataclasses.replace(message, info=info))


def shares_a_key() -> Any:
    """An honest CartPole whose step info holds ``shared``, one float."""

    class SharesAKey(gym.Wrapper[Any, Any, Any, Any]):
        def step(self, action: Any) -> Any:
            obs, reward, terminated, truncated, _ = super().step(action)
            return obs, reward, terminated, truncated, {"shared": 1.5}

    return SharesAKey(gym.make("CartPole-v1"))


@pytest.mark.timeout(60)
async def test_a_key_that_workers_disagree_on_ends_neither_the_learner_nor_a_worker(
    workers: WorkerTasks,
) -> None:
    # Well-formed on its own, but not mergeable with the honest worker's: the key becomes
    # each env's own value, and every worker goes on stepping.
    async with aps.Learner(TCP, num_workers=2, timeouts=FAST, on_worker_lost="raise") as learner:
        workers.start(learner.url, env=shares_a_key, num_envs=ENVS)
        await until(lambda: len(learner.workers) == 1)
        start_altered(workers, learner.url, (StepResult,), disagreeing)
        await learner.reset(seed=0)
        for _ in range(3):
            _, _, _, _, info = await learner.step(ACTIONS)
            shared = info["shared"]
            assert shared.dtype == object and shared[:ENVS].tolist() == [1.5] * ENVS
            for value in shared[ENVS:]:
                np.testing.assert_array_equal(value, np.full(3, 7.0))
        assert len(learner.workers) == 2


# 4. Only allow-listed exception types are rebuilt on the learner; the text is capped.


class RaisingEnv(test_envs.BoxEnv):
    """Raises the built-in type named ``kind`` on its first step.

    ``forge``: raise an :class:`Exception` of its own that the worker reports under that
    name instead (``builtins.StopIteration``), as an attacker sends any name it likes; the
    types themselves would stop the worker's own loop (a StopIteration raised into a future,
    a KeyboardInterrupt). ``size``: the message's length (``"boom"`` when 0).
    """

    def __init__(self, kind: str, forge: bool = False, size: int = 0) -> None:
        super().__init__()
        self._kind, self._forge, self._size = kind, forge, size

    def step(self, action: Any) -> tuple[Any, float, bool, bool, dict[str, Any]]:
        kind: type[BaseException] = getattr(builtins, self._kind)
        if self._forge:
            kind = type(self._kind, (Exception,), {"__module__": "builtins"})
        raise kind("x" * self._size if self._size else "boom")


def raising(kind: type[BaseException], *, forge: bool = False, size: int = 0) -> aps.ClusterEnv:
    """One worker process over TCP whose two envs raise ``kind`` on their first step."""
    return aps.ClusterEnv.local(
        f"{__name__}:RaisingEnv",
        num_workers=1,
        envs_per_worker=2,
        transport="tcp",
        env_kwargs={"kind": kind.__name__, "forge": forge, "size": size},
    )


REFUSED = [
    StopIteration,
    StopAsyncIteration,
    GeneratorExit,
    KeyboardInterrupt,
    SystemExit,
    MemoryError,
    RecursionError,
    TimeoutError,
    ConnectionResetError,
    ImportError,
]
FORGED = (StopIteration, StopAsyncIteration, GeneratorExit, KeyboardInterrupt, SystemExit)


def step_all(envs: aps.ClusterEnv) -> list[Any]:
    """Step in a loop that a StopIteration would end silently (zero results, no error)."""
    actions = np.zeros((envs.num_envs, 2), np.float32)
    return list(map(lambda _: envs.step(actions), range(1)))  # noqa: C417 (map on purpose)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", REFUSED, ids=lambda k: k.__name__)
def test_an_env_cannot_choose_a_control_flow_exception_on_the_learner(
    kind: type[BaseException],
) -> None:
    with raising(kind, forge=kind in FORGED) as envs:
        envs.reset(seed=0)
        with pytest.raises(aps.WorkerError) as caught:
            step_all(envs)
        assert type(caught.value) is aps.WorkerError
        assert caught.value.remote_type == f"builtins.{kind.__name__}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", [ValueError, KeyError, RuntimeError], ids=lambda k: k.__name__)
def test_an_env_error_of_an_allowed_type_is_raised_as_that_type(
    kind: type[Exception],
) -> None:
    with raising(kind) as envs:
        envs.reset(seed=0)
        with pytest.raises(kind) as caught:
            step_all(envs)
        assert type(caught.value) is kind
        assert isinstance(caught.value.__cause__, aps.WorkerError)


def test_the_allow_list_holds_only_plain_exceptions_that_steer_nothing() -> None:
    for name, kind in REBUILT_TYPES.items():
        assert name == f"builtins.{kind.__name__}" and getattr(builtins, kind.__name__) is kind
        assert issubclass(kind, Exception)
        assert not issubclass(kind, StopIteration | StopAsyncIteration | MemoryError)
        assert not issubclass(kind, RecursionError | TimeoutError | ConnectionError)
        assert not issubclass(kind, ImportError | EOFError)


@pytest.mark.timeout(60)
def test_an_env_errors_message_and_traceback_are_capped() -> None:
    size = 4 * MAX_REMOTE_TEXT
    with raising(RuntimeError, size=size) as envs:
        envs.reset(seed=0)
        with pytest.raises(RuntimeError) as caught:
            step_all(envs)
    error = caught.value.__cause__
    assert isinstance(error, aps.WorkerError)
    for text in (error.message, error.remote_traceback, str(caught.value)):
        assert len(text) < MAX_REMOTE_TEXT + 200
        assert "was cut: " in text
    assert error.message.startswith("x" * 100)
    assert len(str(error)) < 2 * MAX_REMOTE_TEXT + 500


def test_a_worker_error_caps_what_it_is_given() -> None:
    error = aps.WorkerError(
        "m" * 10**6, worker_id=3, remote_type="t" * 10**4, remote_traceback="b" * 10**6
    )
    assert len(error.message) < MAX_REMOTE_TEXT + 100
    assert len(error.remote_traceback) < MAX_REMOTE_TEXT + 100
    assert len(error.remote_type) < 400
    assert "the worker's message was cut: 1000000 characters, 65536 kept" in error.message
    assert rebuilt(error) is error  # a type name that is no built-in's
