"""A bad worker is that worker's problem: a malformed answer is handled like its loss.

A real worker over TCP on 127.0.0.1 that holds the token and answers wrongly (a wrong
observation shape or dtype, a wrong reward length, a wrong sequence number, a message of the
wrong kind), in every mode: ``raise`` raises a :class:`aps.ProtocolError` naming the worker,
``wait`` disconnects it and a replacement takes its envs over, ``drop`` goes on with the
others. In each case the bad worker is disconnected (its run ends: the learner said goodbye).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")

import aps
from aps.session import Session
from aps.wire import codec
from aps.wire.messages import GradientProgress, GradientReport, Message, RolloutChunk, StepResult
from tests.conftest import FAST, TEST_POLICIES, WorkerTasks
from tests.pg_agents import MeanAgent, Reveal

TCP = "tcp://127.0.0.1:0"
POLICY = f"{Path(__file__).with_name('agents.py')}:Agent"
PG_POLICY = f"{Path(__file__).with_name('pg_agents.py')}:MeanAgent"
ENVS = 2
ALLOWED = (*TEST_POLICIES, PG_POLICY)


def tampered(message: Message, tamper: str) -> Message:
    """``message`` made wrong in one way."""
    if tamper == "kind":  # a message that answers nothing the learner asked
        if isinstance(message, GradientProgress | GradientReport):
            return StepResult(
                obs=np.zeros((ENVS, 1), np.float32),
                reward=np.zeros(ENVS),
                terminated=np.zeros(ENVS, bool),
                truncated=np.zeros(ENVS, bool),
                info={},
            )
        return GradientProgress(round=0, count=1)
    if tamper == "seq":
        return dataclasses.replace(message, seq=message.seq + 1)  # type: ignore[attr-defined]
    if tamper == "reward_length":
        reward = message.reward  # type: ignore[attr-defined]
        return dataclasses.replace(message, reward=reward[..., :-1])
    obs = message.obs  # type: ignore[attr-defined]
    if tamper == "obs_shape":
        return dataclasses.replace(message, obs=obs[..., :-1])
    assert tamper == "obs_dtype"
    return dataclasses.replace(message, obs=obs.astype(np.float64))


class TamperedSession:
    """A worker's session whose frames of one message type are replaced by wrong ones.

    The protocol table sees the honest message; the learner receives the tampered frame.
    """

    def __init__(self, session: Session, kinds: tuple[type[Message], ...], tamper: str) -> None:
        self._session = session
        self._kinds = kinds
        self._tamper = tamper

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    async def send(self, message: Message, *, frame: bytes | None = None) -> None:
        if isinstance(message, self._kinds):
            frame = codec.encode(tampered(message, self._tamper))
        await self._session.send(message, frame=frame)


class BadWorker(aps.Worker):
    """An honest worker whose answers of ``kinds`` are tampered with."""

    def __init__(self, *args: Any, kinds: tuple[type[Message], ...], tamper: str, **kw: Any):
        kw.setdefault("timeouts", FAST)
        kw.setdefault("allow_policy", ALLOWED)
        super().__init__(*args, **kw)
        self._kinds = kinds
        self._tamper = tamper

    async def _serve(self, session: Session) -> None:
        await super()._serve(TamperedSession(session, self._kinds, self._tamper))  # type: ignore[arg-type]


MODES = {
    "step": (StepResult,),
    "send": (StepResult,),
    "rollout": (RolloutChunk,),
    "chunks": (RolloutChunk,),
    "rounds": (GradientProgress, GradientReport),
}
"""What each mode receives from a worker, and so what a bad worker tampers with."""

FIELDS = {
    "obs_shape": "obs",
    "obs_dtype": "obs",
    "reward_length": "reward",
    "seq": "answering request",
    "kind": "GradientProgress",
}
"""What the error names for each malformation (in gradient mode the wrong kind is a step)."""


def env_of(mode: str) -> Any:
    return Reveal if mode == "rounds" else "CartPole-v1"


def policy_of(mode: str) -> str | None:
    return {"rollout": POLICY, "chunks": POLICY, "rounds": PG_POLICY}.get(mode)


async def until(condition: Any, seconds: float = 20.0) -> None:
    async with asyncio.timeout(seconds):
        while not condition():  # noqa: ASYNC110 (the learner has no event for these)
            await asyncio.sleep(0.02)


async def prepare(learner: aps.Learner, mode: str) -> None:
    await learner.reset(seed=0) if mode != "rounds" else await learner.wait_for_workers()
    if mode in ("rollout", "chunks"):
        from tests.agents import Agent
        from tests.test_detach import Spaces

        await learner.publish(Agent(Spaces("CartPole-v1")))


async def operate(learner: aps.Learner, mode: str, times: int = 1) -> Any:
    """Run the mode's operation ``times`` times; the last result."""
    result: Any = None
    for _ in range(times):
        if mode == "step":
            result = await learner.step(np.zeros(learner.num_envs, np.int64))
        elif mode == "send":
            await learner.send(np.zeros(learner.num_envs, np.int64))
            result = await learner.recv(min_workers=len(learner.workers))
        elif mode == "rollout":
            result = await learner.rollout(4)
        elif mode == "chunks":
            stream = learner.chunks(4)
            result = [await anext(stream) for _ in range(2 * len(learner.workers))]
            await stream.aclose()
        else:
            agent = MeanAgent()
            weights = {k: v.detach().numpy() for k, v in agent.state_dict().items()}
            await learner.start_round(0, weights, horizon=3, gamma=1.0)
            result = [await learner.next_report() for _ in range(4)]
            await learner.stop_gradients()
    return result


def start_honest(workers: WorkerTasks, url: str, mode: str) -> asyncio.Task[None]:
    return workers.start(url, env_of(mode), num_envs=ENVS, allow_policy=ALLOWED)


def start_bad(workers: WorkerTasks, url: str, mode: str, tamper: str) -> tuple[BadWorker, Any]:
    bad = BadWorker(url, env_of(mode), num_envs=ENVS, kinds=MODES[mode], tamper=tamper)
    task = asyncio.create_task(bad.run())
    workers.tasks.append(task)
    return bad, task


CASES = [
    (mode, tamper)
    for mode in MODES
    for tamper in FIELDS
    if mode != "rounds" or tamper == "kind"  # gradient reports carry no obs, reward or seq
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "tamper"), CASES)
async def test_raise_names_the_bad_worker_and_disconnects_it(
    workers: WorkerTasks, mode: str, tamper: str
) -> None:
    async with aps.Learner(
        TCP,
        num_workers=2,
        policy=policy_of(mode),
        autoreset_mode="SameStep",
        timeouts=FAST,
        on_worker_lost="raise",
    ) as learner:
        start_honest(workers, learner.url, mode)
        await until(lambda: len(learner.workers) == 1)
        bad, task = start_bad(workers, learner.url, mode, tamper)
        await prepare(learner, mode)
        with pytest.raises(aps.ProtocolError) as caught:
            await operate(learner, mode, times=3)
        message = str(caught.value)
        assert message.startswith(f"worker {bad.worker_id}"), message
        field = "StepResult" if mode == "rounds" else FIELDS[tamper]
        assert field in message, message
        await asyncio.wait_for(task, 20)  # the learner said goodbye: the bad worker's run ends
        assert task.exception() is None


@pytest.mark.timeout(60)
async def test_raise_names_a_bad_worker_whose_chunk_came_after_the_last_one_taken(
    workers: WorkerTasks,
) -> None:
    # The caller takes one chunk and ends the stream while the bad worker's chunk is in the
    # learner's inbox or on its way: its end raises the ProtocolError, not a vaguer error
    # later (which one of the two chunks comes first is up to the workers' timing).
    async with aps.Learner(
        TCP, num_workers=2, policy=POLICY, autoreset_mode="SameStep", timeouts=FAST,
        on_worker_lost="raise",
    ) as learner:  # fmt: skip
        start_honest(workers, learner.url, "chunks")
        await until(lambda: len(learner.workers) == 1)
        bad, task = start_bad(workers, learner.url, "chunks", "obs_shape")
        await prepare(learner, "chunks")
        stream = learner.chunks(4)
        with pytest.raises(aps.ProtocolError, match=f"^worker {bad.worker_id}"):
            try:
                await anext(stream)
                await asyncio.sleep(0.5)  # the bad worker's chunk arrives meanwhile
            finally:
                await stream.aclose()
        await asyncio.wait_for(task, 20)
        assert task.exception() is None


@pytest.mark.timeout(60)
async def test_a_break_noticed_by_a_cancelled_task_is_raised_by_the_next_receive(
    workers: WorkerTasks,
) -> None:
    # A chunk stream's pump notices a protocol break, and the learner disconnects the worker;
    # the pump is cancelled (the stream ended) before it can raise the break. The receive
    # that then finds the connection closed (the stream's drain) must raise the break, not a
    # lost worker: found on a loaded machine, one run in many, and forced here.
    async with aps.Learner(TCP, num_workers=1, timeouts=FAST, on_worker_lost="raise") as learner:
        workers.start(learner.url)
        await asyncio.wait_for(learner.wait_for_workers(), 20)
        slot = learner._pool.slots.admitted[0]
        recovery, generation = learner._pool.recovery, slot.generation
        closed, never = asyncio.Event(), asyncio.Event()
        close = slot.session.aclose

        async def close_then_linger(*args: Any, **kwargs: Any) -> None:
            await close(*args, **kwargs)
            closed.set()
            await never.wait()  # where the noticing task is cancelled

        slot.session.aclose = close_then_linger  # type: ignore[method-assign]
        break_ = aps.ProtocolError("sent a chunk whose reward does not fit")
        noticing = asyncio.create_task(recovery.fail(slot, generation, "chunks", break_))
        await asyncio.wait_for(closed.wait(), 10)
        noticing.cancel()
        with pytest.raises(asyncio.CancelledError):
            await noticing
        del slot.session.aclose  # the session's own again, for the learner's close
        lost = aps.TransportClosed("cannot receive: this transport is closed")
        with pytest.raises(aps.ProtocolError, match=r"^worker 0: sent a chunk whose reward"):
            await recovery.fail(slot, generation, "the end of the chunk stream", lost)


WAIT_CASES = [("step", "reward_length"), ("send", "obs_shape"), ("rollout", "obs_dtype")]
WAIT_CASES += [("chunks", "seq"), ("rounds", "kind"), ("step", "kind")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("mode", "tamper"), WAIT_CASES)
async def test_wait_disconnects_the_bad_worker_and_a_spare_takes_over(
    workers: WorkerTasks, mode: str, tamper: str
) -> None:
    async with aps.Learner(
        TCP,
        num_workers=2,
        policy=policy_of(mode),
        autoreset_mode="SameStep",
        timeouts=FAST,
        on_worker_lost="wait",
        reconnect_timeout=20,
    ) as learner:
        start_honest(workers, learner.url, mode)
        await until(lambda: len(learner.workers) == 1)
        bad, task = start_bad(workers, learner.url, mode, tamper)
        await prepare(learner, mode)
        start_honest(workers, learner.url, mode)  # the spare
        await until(lambda: learner._pool.joining.describe()[0].spares == 1)
        if mode == "rounds":
            # The replacement is announced as the bad worker's loss; the round goes on.
            with pytest.raises(aps.WorkerLost, match=f"worker {bad.worker_id}"):
                await operate(learner, mode)
        else:
            await operate(learner, mode)
        await asyncio.wait_for(task, 20)
        assert bad.worker_id not in {w.worker_id for w in learner.workers}
        assert learner.restarts == 1
        if mode != "rounds":
            await operate(learner, mode, times=2)  # the honest workers keep stepping


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("mode", "tamper"), [("chunks", "obs_shape"), ("rounds", "kind")])
async def test_drop_goes_on_with_the_honest_workers(
    workers: WorkerTasks, mode: str, tamper: str
) -> None:
    async with aps.Learner(
        TCP,
        num_workers=2,
        policy=policy_of(mode),
        autoreset_mode="SameStep",
        timeouts=FAST,
        on_worker_lost="drop",
    ) as learner:
        honest = start_honest(workers, learner.url, mode)
        await until(lambda: len(learner.workers) == 1)
        good = learner.workers[0].worker_id
        bad, task = start_bad(workers, learner.url, mode, tamper)
        await prepare(learner, mode)
        if mode == "chunks":
            stream = learner.chunks(4)
            seen: list[int] = []
            async with asyncio.timeout(20):  # until the learner hung up on the bad worker
                while len(seen) < 6 or not task.done():
                    seen.append((await anext(stream)).worker_id)
            await stream.aclose()
            assert set(seen) == {good}
        else:
            agent = MeanAgent()
            weights = {k: v.detach().numpy() for k, v in agent.state_dict().items()}
            await learner.start_round(0, weights, horizon=3, gamma=1.0)
            reporters: list[int] = []
            lost = False
            while len(reporters) < 3:
                try:
                    worker_id, _ = await learner.next_report()
                except aps.WorkerLost as exc:
                    assert exc.worker_id == bad.worker_id
                    lost = True
                    continue
                reporters.append(worker_id)
            assert lost or bad.worker_id not in reporters
            assert set(reporters[-2:]) == {good}
            assert learner.gradient_workers == tuple(
                w for w in learner.workers if w.worker_id == good
            )
        await asyncio.wait_for(task, 20)
        assert not honest.done()
