"""The weight group: versions fan out through one gloo group instead of once per worker.

Real workers (tasks on the test's loop) join a real gloo group over 127.0.0.1 with the learner;
the learner publishes, the strategies decide per worker, and the chunks show the workers acted
with exactly the weights published. A member that is replaced ends the group, and versions
travel over the sessions again.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():  # pragma: no cover
    pytest.skip("this torch has no gloo", allow_module_level=True)

import aps  # noqa: E402
from aps import sync  # noqa: E402
from aps.errors import ProtocolError  # noqa: E402
from aps.gradients import spread_bytes  # noqa: E402
from aps.wire.messages import GroupWeights, JoinWeightGroup  # noqa: E402
from aps.worker.fanout import GroupReceiver  # noqa: E402
from tests.agents import Agent  # noqa: E402
from tests.conftest import FAST, TEST_POLICIES, WorkerTasks  # noqa: E402
from tests.test_detach import POLICY, Spaces, perturb  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def behaviour_logprob(agent: Any, batch: aps.Rollout) -> np.ndarray[Any, Any]:
    with torch.no_grad():
        logp = torch.log_softmax(agent.actor(torch.as_tensor(batch.obs)), -1)
        taken = torch.as_tensor(batch.actions)[..., None]
        result: np.ndarray[Any, Any] = logp.gather(-1, taken)[..., 0].numpy()
        return result


async def test_versions_fan_out_and_workers_act_with_them_exactly(workers: WorkerTasks) -> None:
    async with aps.Learner(
        "memory://", num_workers=3, policy=POLICY, sync=sync.AlwaysSync(), timeouts=FAST
    ) as learner:
        for _ in range(3):
            workers.start(learner.url, num_envs=2)
        await learner.reset(seed=0)
        agent = Agent(Spaces("CartPole-v1"))
        await learner.publish(agent)  # before the group: over the sessions
        group = await asyncio.wait_for(learner.form_weight_group(timeout=20), 60)
        assert learner.weight_group is group and group.world_size == 4
        for version in (2, 3):
            perturb(agent, 0.5)
            assert await learner.publish(agent) == version
            batch = await learner.rollout(6)
            assert (batch.policy_version == version).all()
            # Acted with exactly the published weights: the behaviour log-probs match.
            np.testing.assert_allclose(
                batch.logprob, behaviour_logprob(agent, batch), rtol=1e-5, atol=1e-6
            )
        assert group.versions == 2
        frame = learner._detach.versions.frame(3)  # type: ignore[union-attr]
        # The learner's share of a version: under two copies, for three workers.
        assert group.bytes_sent == 2 * spread_bytes(len(frame), 4) < 2 * 2 * len(frame)
        assert all(w.version == 3 for w in learner.metrics.workers)


async def test_aps_still_decides_per_worker(workers: WorkerTasks) -> None:
    """Every member receives every version; only the chosen ones act with it."""
    async with aps.Learner(
        "memory://",
        num_workers=2,
        policy=POLICY,
        sync=sync.FixedInterval(versions=2),
        timeouts=FAST,
    ) as learner:
        for _ in range(2):
            workers.start(learner.url, num_envs=2)
        await learner.reset(seed=0)
        agent = Agent(Spaces("CartPole-v1"))
        await learner.publish(agent)
        await learner.form_weight_group(timeout=20)
        seen = []
        for _ in range(4):
            perturb(agent, 0.5)
            await learner.publish(agent)
            batch = await learner.rollout(4)
            seen.append(int(batch.policy_version.max()))
        assert seen == [1, 3, 3, 5]  # a version every second publish, as without a group
        group = learner.weight_group
        assert group is not None and group.versions == 4


async def test_a_new_group_carries_only_what_it_fanned_out(workers: WorkerTasks) -> None:
    """A version the previous group carried goes over the sessions once a new group forms."""
    async with aps.Learner(
        "memory://",
        num_workers=2,
        policy=POLICY,
        sync=sync.FixedInterval(versions=2),
        timeouts=FAST,
    ) as learner:
        for _ in range(2):
            workers.start(learner.url, num_envs=2)
        await learner.reset(seed=0)
        agent = Agent(Spaces("CartPole-v1"))
        await learner.publish(agent)
        await learner.form_weight_group(timeout=20)
        perturb(agent, 0.5)
        await learner.publish(agent)  # version 2, by the first group; nobody acts with it yet
        assert (await learner.rollout(2)).policy_version.max() == 1
        second = await learner.form_weight_group(timeout=20)
        learner.sync = sync.AlwaysSync()
        batch = await learner.rollout(3)  # version 2 now, which the second group never carried
        assert (batch.policy_version == 2).all() and second.versions == 0
        np.testing.assert_allclose(
            batch.logprob, behaviour_logprob(agent, batch), rtol=1e-5, atol=1e-6
        )


async def test_a_chunk_stream_publishes_through_the_group(workers: WorkerTasks) -> None:
    """Versions published inside the stream's loop fan out while chunks are in flight."""
    async with aps.Learner(
        "memory://", num_workers=2, policy=POLICY, sync=sync.AlwaysSync(), timeouts=FAST
    ) as learner:
        for _ in range(2):
            workers.start(learner.url, num_envs=2)
        await learner.reset(seed=0)
        agent = Agent(Spaces("CartPole-v1"))
        await learner.form_weight_group(timeout=20)
        await learner.publish(agent)  # the first version, too, by the group
        last: dict[int, int] = {}
        count = 0
        async for chunk in learner.chunks(4, max_in_flight=2):
            assert chunk.version >= last.get(chunk.worker_id, 0)
            last[chunk.worker_id] = chunk.version
            perturb(agent, 0.01)
            await learner.publish(agent)
            count += 1
            if count == 10:
                break
        group = learner.weight_group
        assert group is not None and group.versions == learner.version == 11
        assert max(last.values()) > 1  # the workers acted with versions from the group
        batch = await learner.rollout(3)
        assert (batch.policy_version == 11).all()
        np.testing.assert_allclose(
            batch.logprob, behaviour_logprob(agent, batch), rtol=1e-5, atol=1e-6
        )


async def test_a_replaced_member_ends_the_group(workers: WorkerTasks) -> None:
    async with aps.Learner(
        "memory://",
        num_workers=2,
        policy=POLICY,
        sync=sync.AlwaysSync(),
        timeouts=FAST,
        on_worker_lost="wait",
        reconnect_timeout=20,
    ) as learner:
        first = workers.start(learner.url, num_envs=2)
        workers.start(learner.url, num_envs=2)
        await learner.reset(seed=0)
        agent = Agent(Spaces("CartPole-v1"))
        await learner.publish(agent)
        await learner.form_weight_group(timeout=20)
        first.cancel()
        await asyncio.wait([first], timeout=10)
        workers.start(learner.url, num_envs=2)  # takes the lost worker's slot over
        perturb(agent, 0.5)
        # The next rollout waits for the replacement; the publish before it ends the group.
        await learner.publish(agent)
        batch = await asyncio.wait_for(learner.rollout(4), 60)
        assert learner.weight_group is None
        assert (batch.policy_version == 2).all()
        np.testing.assert_allclose(
            batch.logprob, behaviour_logprob(agent, batch), rtol=1e-5, atol=1e-6
        )


async def test_a_worker_refuses_a_bad_announcement() -> None:
    """An announcement over the frame limit or out of order is refused before any collective."""
    request = JoinWeightGroup(
        host="127.0.0.1", port=1, prefix="p/", rank=1, world_size=2, timeout=1.0
    )
    receiver = GroupReceiver(object(), request, max_frame_size=1000)
    digest = bytes(32)
    with pytest.raises(ProtocolError, match="1 to 1000 bytes"):
        receiver.announce(GroupWeights(version=1, nbytes=1001, sha256=digest))
    with pytest.raises(ProtocolError, match="1 to 1000 bytes"):
        receiver.announce(GroupWeights(version=1, nbytes=0, sha256=digest))
    with pytest.raises(ProtocolError, match="digest of 3 bytes"):
        receiver.announce(GroupWeights(version=1, nbytes=10, sha256=b"abc"))
    receiver._announced = 5
    with pytest.raises(ProtocolError, match="after version 5"):
        receiver.announce(GroupWeights(version=5, nbytes=10, sha256=digest))
    with pytest.raises(ProtocolError, match="did not announce it"):
        await receiver.take(7)
    bad_rank = JoinWeightGroup(
        host="127.0.0.1", port=1, prefix="p/", rank=2, world_size=2, timeout=1.0
    )
    with pytest.raises(ProtocolError, match=r"rank must be in 1\.\.world_size - 1"):
        await GroupReceiver.join(bad_rank, "127.0.0.1", 1000)


# Attacks by a member holding the token: it may disrupt the group, never forge a version.


def member(workers: WorkerTasks, url: str) -> aps.Worker:
    """A worker on the test's loop whose server the test can reach."""
    worker = aps.Worker(url, "CartPole-v1", num_envs=2, timeouts=FAST, allow_policy=TEST_POLICIES)
    workers.tasks.append(asyncio.create_task(worker.run()))
    return worker


def receiver_of(worker: aps.Worker) -> GroupReceiver:
    server = worker._server
    assert server is not None and server.weight_group is not None
    return server.weight_group


async def test_a_member_that_alters_its_pieces_is_caught_by_the_digest(
    workers: WorkerTasks,
) -> None:
    async with aps.Learner(
        "memory://", num_workers=3, policy=POLICY, sync=sync.AlwaysSync(), timeouts=FAST
    ) as learner:
        crowd = [member(workers, learner.url) for _ in range(3)]
        await learner.reset(seed=0)
        agent = Agent(Spaces("CartPole-v1"))
        await learner.publish(agent)
        await learner.form_weight_group(timeout=20)
        liar = receiver_of(crowd[2])

        def altered(version: int, nbytes: int, digest: bytes) -> bytes:
            # Its part of spread(), with its piece changed before it passes it on.
            group, world = liar._group, liar._world
            piece = -(-nbytes // world)
            padded = torch.zeros(piece * world, dtype=torch.uint8)
            pieces = [padded[i * piece : (i + 1) * piece] for i in range(world)]
            mine = torch.empty(piece, dtype=torch.uint8)
            options = dist.ScatterOptions()
            options.rootRank = 0
            group.scatter([mine], [], options).wait()
            mine ^= 0xFF
            group.allgather([pieces], [mine]).wait()
            return bytes(nbytes)

        liar._collect = altered  # type: ignore[method-assign]
        perturb(agent, 0.5)
        await learner.publish(agent)
        with pytest.raises(aps.WorkerError, match="altered") as caught:
            await learner.rollout(4)
        assert "SHA-256" in str(caught.value)


async def test_a_member_that_skips_the_collectives_ends_the_group(workers: WorkerTasks) -> None:
    async with aps.Learner(
        "memory://", num_workers=3, policy=POLICY, sync=sync.AlwaysSync(), timeouts=FAST
    ) as learner:
        crowd = [member(workers, learner.url) for _ in range(3)]
        await learner.reset(seed=0)
        agent = Agent(Spaces("CartPole-v1"))
        await learner.publish(agent)
        await learner.form_weight_group(timeout=5)  # also each collective's deadline
        server = crowd[1]._server
        assert server is not None
        server.announce_weights = lambda message: None  # type: ignore[method-assign]
        perturb(agent, 0.5)
        await learner.publish(agent)  # its collective times out: the group ends
        assert learner.weight_group is None
        batch = await learner.rollout(4)  # every worker gets version 2 over its session
        assert (batch.policy_version == 2).all()
        np.testing.assert_allclose(
            batch.logprob, behaviour_logprob(agent, batch), rtol=1e-5, atol=1e-6
        )
