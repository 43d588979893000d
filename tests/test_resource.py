"""The resource base: ``async with`` ends in ``aclose``, defined once for every resource."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

import aps
from aps import transports
from aps._base._resource import AsyncResource
from aps.transports.memory import MemoryListener, MemoryTransport
from aps.transports.tcp import TCPListener, TCPTransport
from aps.transports.unix import UnixListener, UnixTransport

ROOT = Path(aps.__file__).parent


class Counted(AsyncResource):
    def __init__(self) -> None:
        self.closes = 0

    async def aclose(self) -> None:
        self.closes += 1


def test_a_resource_without_aclose_cannot_be_made() -> None:
    class Unclosable(AsyncResource):
        pass

    with pytest.raises(TypeError, match="aclose"):
        Unclosable()  # type: ignore[abstract]


async def test_the_block_gets_the_resource_and_its_end_closes_it() -> None:
    resource = Counted()
    async with resource as entered:
        assert entered is resource
        assert resource.closes == 0
    assert resource.closes == 1


async def test_an_exception_closes_the_resource_and_goes_on() -> None:
    resource = Counted()
    with pytest.raises(ValueError, match="inside"):
        async with resource:
            raise ValueError("inside")
    assert resource.closes == 1


async def test_a_cancelled_block_closes_the_resource() -> None:
    resource = Counted()
    entered = asyncio.Event()

    async def hold() -> None:
        async with resource:
            entered.set()
            await asyncio.Event().wait()

    task = asyncio.create_task(hold())
    await asyncio.wait_for(entered.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert resource.closes == 1


@pytest.mark.parametrize(
    "kind",
    [
        aps.Learner,
        TCPTransport,
        TCPListener,
        UnixTransport,
        UnixListener,
        MemoryTransport,
        MemoryListener,
    ],
)
def test_the_resources_share_the_base(kind: type) -> None:
    assert issubclass(kind, AsyncResource)
    assert kind.__aexit__ is AsyncResource.__aexit__


def test_the_websocket_resources_share_the_base() -> None:
    websocket = pytest.importorskip("aps.transports.websocket")
    for kind in (websocket.WebSocketTransport, websocket.WebSocketListener):
        assert issubclass(kind, AsyncResource)
        assert kind.__aenter__ is AsyncResource.__aenter__
        assert kind.__aexit__ is AsyncResource.__aexit__


def test_only_the_base_defines_aexit() -> None:
    defining = sorted(
        str(path.relative_to(ROOT))
        for path in ROOT.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.AsyncFunctionDef) and node.name == "__aexit__"
    )
    # A lease's exit is no close: it reads how the block ended (a worker's failure breaks
    # the workers, see aps.learner.lease), so it defines its own.
    assert defining == ["_base/_resource.py", "learner/lease.py"]


async def test_a_learners_block_binds_on_entry_and_unbinds_at_its_end() -> None:
    async with aps.Learner("memory://", num_workers=1) as learner:
        url = learner.url
        client = await transports.connect(url, timeout=5)
        await client.aclose()
    with pytest.raises(aps.ConnectError):
        await transports.connect(url, timeout=5)
