"""Shared fixtures: fast timeouts and helpers to run workers as tasks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import aps

FAST = aps.Timeouts(
    connect=10.0, handshake=2.0, step=10.0, heartbeat_interval=0.2, heartbeat_timeout=10.0
)


@pytest.fixture
def fast_timeouts() -> aps.Timeouts:
    return FAST


class WorkerTasks:
    """Runs workers as tasks on the test's loop and cancels leftovers at the end."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def start(self, url: str, env: Any = "CartPole-v1", **kwargs: Any) -> asyncio.Task[None]:
        kwargs.setdefault("timeouts", FAST)
        worker = aps.Worker(url, env, **kwargs)
        task = asyncio.create_task(worker.run())
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.tasks:
            await asyncio.wait(self.tasks, timeout=5)


@pytest.fixture
async def workers() -> AsyncIterator[WorkerTasks]:
    tasks = WorkerTasks()
    try:
        yield tasks
    finally:
        await tasks.close()


def make_env_fn(env_cls: Callable[..., Any], **kwargs: Any) -> Callable[[], Any]:
    return lambda: env_cls(**kwargs)
