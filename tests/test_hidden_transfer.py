"""A new version travels while workers act (``overlap_weights``), and workers read it meanwhile.

Workers act each chunk in a thread of their own, so their event loop keeps reading frames: a
version sent right behind a request (``overlap_weights=True``) arrives while the worker acts
that request with the version it holds, and applies between chunks. Real sockets on
127.0.0.1 (through a relay that counts the bytes it forwards), real worker processes, and a
policy of 11M parameters (44 MB a version, more than the sockets' buffers hold).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import aps  # noqa: E402
from aps import sync  # noqa: E402
from aps.testing import until  # noqa: E402
from aps.worker.steps import StepServer  # noqa: E402
from tests.agents import Agent  # noqa: E402
from tests.agents_sized import SizedAgent  # noqa: E402
from tests.conftest import FAST, TEST_POLICIES, WorkerTasks  # noqa: E402

TESTS = Path(__file__).resolve().parent
SIZED = f"{TESTS / 'agents_sized.py'}:SizedAgent"
SLOW_ENV = f"{Path(__file__).resolve()}:slow_cartpole"
HIDDEN = 1_000_000  # SizedAgent(hidden_size=HIDDEN): 11M parameters, 44 MB a version
POLICY = f"{TESTS / 'agents.py'}:Agent"


class SlowStep(gym.Wrapper[Any, Any, Any, Any]):
    """CartPole whose steps take ``delay`` seconds: a chunk lasts long enough to watch."""

    def __init__(self, env: gym.Env[Any, Any], delay: float) -> None:
        super().__init__(env)
        self.delay = delay

    def step(self, action: Any) -> Any:
        time.sleep(self.delay)
        return super().step(action)


def slow_cartpole(delay: float = 0.01) -> gym.Env[Any, Any]:
    """CartPole-v1 with ``delay`` seconds per step (importable by worker processes)."""
    return SlowStep(gym.make("CartPole-v1"), delay)


class Spaces:
    single_observation_space = gym.make("CartPole-v1").observation_space
    single_action_space = gym.make("CartPole-v1").action_space


def perturb(agent: torch.nn.Module, scale: float) -> None:
    with torch.no_grad():
        for p in agent.parameters():
            p.add_(scale * torch.randn_like(p))


class CountingRelay:
    """Forwards TCP connections to the learner and counts the bytes forwarded to workers.

    It writes to the worker no faster than the worker reads (it waits for its buffer to
    drain), so the count runs ahead of what the worker has read by the sockets' buffers only.
    """

    def __init__(self, learner_url: str) -> None:
        host, port = learner_url.removeprefix("tcp://").rsplit(":", 1)
        self._target = (host, int(port))
        self.to_worker = 0
        self.url = ""
        self._writers: list[asyncio.StreamWriter] = []
        self._server: asyncio.Server | None = None

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"tcp://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:  # the learner is gone: so is this connection
            writer.transport.abort()
            return
        self._writers += [writer, up_writer]
        await asyncio.gather(
            self._pipe(reader, up_writer, False), self._pipe(up_reader, writer, True)
        )

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, counted: bool
    ) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
                if counted:
                    self.to_worker += len(data)
        except OSError:
            writer.transport.abort()  # the link died: so does the other side
        else:
            writer.close()  # the peer closed: deliver what is left (a goodbye), then close

    def cut(self) -> None:
        """Reset every connection (both ends see the link die)."""
        for writer in self._writers:
            writer.transport.abort()
        self._writers.clear()

    async def aclose(self) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()


class RecordingServer(StepServer):
    """Records the relay's count at the end of each chunk, before the next frame is read."""

    relay: CountingRelay
    at_chunk_end: list[int]

    async def _rollout(self, request: Any) -> Any:
        chunk = await super()._rollout(request)
        self.at_chunk_end.append(self.relay.to_worker)
        return chunk


class Recording(aps.Worker):
    def __init__(self, *args: Any, relay: CountingRelay, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.relay = relay
        self.at_chunk_end: list[int] = []

    def _new_server(self, envs: Any, collector: Any) -> StepServer:
        server = RecordingServer(envs, collector, None)
        server.relay, server.at_chunk_end = self.relay, self.at_chunk_end
        return server


async def big_learner(**kwargs: Any) -> aps.Learner:
    learner = aps.Learner(
        "tcp://127.0.0.1:0",
        num_workers=1,
        policy=SIZED,
        policy_kwargs={"hidden_size": HIDDEN},
        sync=sync.AlwaysSync(),
        overlap_weights=True,
        autoreset_mode="SameStep",
        timeouts=FAST,
        **kwargs,
    )
    await learner.start()
    return learner


async def test_a_version_in_flight_is_read_while_the_worker_acts() -> None:
    learner = await big_learner()
    relay = CountingRelay(learner.url)
    await relay.start()
    worker = Recording(
        relay.url,
        slow_cartpole,
        num_envs=2,
        timeouts=FAST,
        allow_policy=(SIZED,),
        relay=relay,
    )
    task = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(100):
            await learner.reset(seed=0)
            agent = SizedAgent(Spaces(), hidden_size=HIDDEN)
            await learner.publish(agent)
            first = await learner.rollout(2)  # the first version: the worker waits for it
            assert (first.policy_version == 1).all()
            for version in (2, 3):
                perturb(agent, 0.01)
                await learner.publish(agent)
                # Sent behind the request: acted with the version held, applied after it.
                batch = await learner.rollout(100)  # 100 steps of 10 ms
                assert (batch.policy_version == version - 1).all()
                assert (batch.lag == 1).all()
                # While that chunk was acted the worker read the whole new version: the relay
                # had forwarded every version sent so far (it cannot run ahead of the
                # worker's reading by more than the sockets' buffers, far below 44 MB).
                assert worker.at_chunk_end[-1] >= learner.metrics.weight_bytes
            assert learner.metrics.syncs == 3
    finally:
        await learner.aclose()
        # The learner said goodbye: the worker ends on its own (cancelled only if it hangs).
        done, _ = await asyncio.wait([task], timeout=10)
        if not done:
            task.cancel()
            await asyncio.wait([task], timeout=5)
        await relay.aclose()


async def test_a_link_cut_while_a_version_travels_recovers(workers: WorkerTasks) -> None:
    learner = await big_learner(on_worker_lost="wait", reconnect_timeout=30.0)
    relay = CountingRelay(learner.url)
    await relay.start()
    workers.start(relay.url, env=slow_cartpole, num_envs=2, allow_policy=(SIZED,))
    try:
        async with asyncio.timeout(100):
            await learner.reset(seed=0)
            agent = SizedAgent(Spaces(), hidden_size=HIDDEN)
            await learner.publish(agent)
            await learner.rollout(2)
            perturb(agent, 0.01)
            await learner.publish(agent)
            sent = relay.to_worker
            rollout = asyncio.create_task(learner.rollout(100))
            # Part of version 2 has reached the worker, not all of it: cut the link.
            await until(lambda: relay.to_worker > sent + 2**20, timeout=30)
            relay.cut()
            batch = await rollout
            # Acted with version 1 (answered before the cut, resent) or 2 (sent again
            # before the request on the resumed connection): one version, never a mix.
            assert len(set(batch.policy_version.ravel().tolist())) == 1
            assert batch.policy_version[0, 0] in (1, 2)
            perturb(agent, 0.01)
            await learner.publish(agent)
            batch = await learner.rollout(4)
            assert (batch.policy_version == 2).all()
            assert learner.metrics.workers[0].resumes >= 1
    finally:
        await learner.aclose()
        await relay.aclose()


async def test_aps_measures_the_version_the_worker_holds(workers: WorkerTasks) -> None:
    learner = aps.Learner(
        "memory://",
        num_workers=1,
        policy=POLICY,
        sync=sync.APS(kl_threshold=0.0),
        overlap_weights=True,
        autoreset_mode="SameStep",
        timeouts=FAST,
    )
    await learner.start()
    workers.start(learner.url, num_envs=3, allow_policy=TEST_POLICIES)
    try:
        async with asyncio.timeout(60):
            await learner.reset(seed=0)
            agent = Agent(Spaces())
            await learner.publish(agent)  # the worker holds none: version 1 goes first
            v1 = {k: v.clone() for k, v in agent.state_dict().items()}
            batch_a = await learner.rollout(8)
            assert (batch_a.policy_version == 1).all()
            perturb(agent, 0.3)
            await learner.publish(agent)  # 2: chosen (KL > 0), sent behind the request
            v2 = {k: v.clone() for k, v in agent.state_dict().items()}
            batch_b = await learner.rollout(8)
            assert (batch_b.policy_version == 1).all()
            perturb(agent, 0.3)
            await learner.publish(agent)  # 3
            batch_c = await learner.rollout(8)
            # Its last chunk was acted with 1, but the worker holds 2 now: APS measured 2.
            assert (batch_c.policy_version == 2).all()
            first, second = learner.metrics.workers[0].divergences
            assert first == pytest.approx(kl(v1, v2, batch_a.obs), rel=1e-4)
            assert second == pytest.approx(kl(v2, agent.state_dict(), batch_b.obs), rel=1e-4)
            assert learner.metrics.syncs == 3
    finally:
        await learner.aclose()


def kl(behaviour: dict[str, Any], target: dict[str, Any], obs: np.ndarray) -> float:
    """Mean KL(behaviour || target) of the actors on ``obs``."""
    p_agent, q_agent = Agent(Spaces()), Agent(Spaces())
    p_agent.load_state_dict(behaviour)
    q_agent.load_state_dict(target)
    with torch.no_grad():
        states = torch.as_tensor(obs.reshape(-1, 4))
        p = torch.distributions.Categorical(logits=p_agent.actor(states))
        q = torch.distributions.Categorical(logits=q_agent.actor(states))
        return float(torch.distributions.kl_divergence(p, q).mean())


def test_worker_processes_stamp_each_chunk_with_the_version_that_acted() -> None:
    envs = aps.ClusterEnv.local(
        SLOW_ENV,
        env_kwargs={"delay": 0.002},
        num_workers=2,
        envs_per_worker=2,
        transport="tcp",
        policy=SIZED,
        policy_kwargs={"hidden_size": HIDDEN},
        sync=sync.AlwaysSync(),
        overlap_weights=True,
        autoreset_mode="SameStep",
    )
    try:
        agent = SizedAgent(envs, hidden_size=HIDDEN)
        envs.reset(seed=1)
        returns: list[float] = []
        for version in range(1, 5):
            perturb(agent, 0.01)
            envs.publish(agent)
            batch = envs.rollout(50)
            # Version 1 first (nothing held); then each rollout acts with the one before.
            assert (batch.policy_version == max(version - 1, 1)).all()
            returns += batch.episode_return.tolist()
        metrics = envs.metrics
        assert metrics.syncs == 2 * 4
        assert metrics.lag_max == 1
        assert all(0 < r <= 500 for r in returns)
    finally:
        envs.close()


async def test_a_chunk_stream_acts_each_request_with_the_version_sent_before_it(
    workers: WorkerTasks,
) -> None:
    learner = aps.Learner(
        "memory://",
        num_workers=1,
        policy=POLICY,
        sync=sync.AlwaysSync(),
        overlap_weights=True,
        autoreset_mode="SameStep",
        timeouts=FAST,
    )
    await learner.start()
    workers.start(learner.url, num_envs=2, allow_policy=TEST_POLICIES)
    try:
        async with asyncio.timeout(60):
            await learner.reset(seed=0)
            agent = Agent(Spaces())
            await learner.publish(agent)
            versions = []
            async for chunk in learner.chunks(4, max_in_flight=1):
                versions.append(chunk.version)
                if len(versions) == 6:
                    break
                perturb(agent, 0.1)
                await learner.publish(agent)  # chosen, and sent behind the next request
            # Chunk k was requested after version k was published; it acts with k - 1.
            assert versions == [1, 1, 2, 3, 4, 5]
            assert learner.metrics.syncs == 6
    finally:
        await learner.aclose()


def test_overlap_weights_must_be_a_bool() -> None:
    with pytest.raises(aps.ConfigError, match="overlap_weights must be True or False, got 'yes'"):
        aps.Learner("memory://", num_workers=1, overlap_weights="yes")  # type: ignore[arg-type]
