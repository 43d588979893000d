"""An admission storm at a size CI carries: every worker dials at once, and all get in.

96 workers, 24 from each of 4 loopback source addresses (``TCPFactory(source=...)``), start
at one instant with the token on. That is more than the pre-auth budget holds from one
address (16) and in all (64), so connections are evicted or told the learner is busy and
dial again; the test asserts only the outcome: every worker is admitted before a generous
deadline, none gave up, each address is seen, and one lockstep step reaches them all.
``benchmarks/fleet.py`` measures the same storm at up to 1,024 workers, with its times.
"""

from __future__ import annotations

import asyncio
import collections
import sys

import numpy as np
import pytest

import aps
from aps.transports.tcp import TCPFactory

TOKEN = "storm-test-token"
ADDRESSES = [f"127.0.0.{i}" for i in range(2, 6)]
PER_ADDRESS = 24
DEADLINE = 90.0  # seconds for the whole storm; generous, a loaded CI machine is slow


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="127.0.0.0/8 is all loopback")
@pytest.mark.timeout(180)
async def test_a_storm_from_several_addresses_is_admitted_and_none_gives_up() -> None:
    count = PER_ADDRESS * len(ADDRESSES)
    timeouts = aps.Timeouts(connect=DEADLINE, handshake=10.0, step=30.0)
    tasks: list[asyncio.Task[None]] = []
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=count, token=TOKEN, timeouts=timeouts
    ) as learner:
        try:
            factories = [TCPFactory(source=address) for address in ADDRESSES]
            workers = [
                aps.Worker(
                    learner.url,
                    "CartPole-v1",
                    token=TOKEN,
                    timeouts=timeouts,
                    factory=factories[i % len(factories)],
                    label=str(i),
                )
                for i in range(count)
            ]
            # Built first, started together: the storm.
            tasks = [asyncio.create_task(worker.run()) for worker in workers]
            await learner.wait_for_workers(timeout=DEADLINE)
            gave_up = [t for t in tasks if t.done()]
            assert not gave_up, [t.exception() for t in gave_up]
            hosts = collections.Counter(
                info.peer.removeprefix("tcp://").rpartition(":")[0] for info in learner.workers
            )
            assert hosts == dict.fromkeys(ADDRESSES, PER_ADDRESS)
            assert sorted(int(info.label) for info in learner.workers) == list(range(count))
            async with asyncio.timeout(60):
                await learner.reset(seed=0)
                obs, *_ = await learner.step(np.zeros(learner.num_envs, dtype=np.int64))
            assert obs.shape == (count, 4)
        finally:
            await learner.aclose()  # says goodbye: the workers' run() returns
            if tasks:
                _, pending = await asyncio.wait(tasks, timeout=30)
                for task in pending:
                    task.cancel()
                await asyncio.wait(tasks, timeout=5)
    assert all(t.done() and not t.cancelled() and t.exception() is None for t in tasks)
