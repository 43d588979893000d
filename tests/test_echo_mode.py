"""The toy echo mode (tests/echo_mode.py): a mode is its module plus the files docs/modes.md lists.

The echo round-trips through a real learner and real workers over TCP on 127.0.0.1, beside
lockstep steps on the same workers; the mode's module imports only the public registration
points; no module of ``aps`` names it; and ``docs/modes.md`` lists exactly the files a mode
touches, which are the echo mode's.
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

import numpy as np
import pytest

import aps
from aps.errors import ConfigError, WorkerError
from aps.session import protocol
from aps.session.protocol import (
    ANSWERS,
    REQUESTS,
    TRANSITIONS,
    Connection,
    Direction,
    RequestKind,
    Role,
    State,
    register_request,
)
from aps.wire import codec
from aps.wire.codec import decode, encode
from aps.wire.messages import MESSAGE_TYPES, Message, register_message
from tests.conftest import WorkerTasks

TESTS = Path(__file__).parent
REPO = TESTS.parent
APS = Path(aps.__file__).parent

THE_FILES = (
    "aps/learner/<mode>.py",
    "aps/learner/learner.py",
    "tests/test_<mode>.py",
    "docs/modes.md",
)
"""What docs/modes.md says a new mode of numbered requests touches, in its order."""


@pytest.fixture
def mode() -> Iterator[ModuleType]:
    """The echo mode, registered for one test; the tables are as they were afterwards.

    Registered at import, as a mode is, but imported here rather than at the top: the
    other tests of a run read the built-in tables (the codec's list of known tags, say).
    """
    tables: list[dict[Any, Any]] = [
        MESSAGE_TYPES,
        REQUESTS,
        ANSWERS,
        *TRANSITIONS.values(),
        codec._SPECS_BY_TAG,
        codec._SPECS_BY_CLASS,
        codec._ARRAYS_BY_TAG,
    ]
    saved = [dict(table) for table in tables]
    known, counted = codec._KNOWN_TAGS, set(protocol._COUNTED)
    module = importlib.import_module("tests.echo_mode")
    register_request(module.ECHO)  # again: an earlier test's teardown took the row out
    try:
        yield module
    finally:
        for table, before in zip(tables, saved, strict=True):
            table.clear()
            table.update(before)
        codec._KNOWN_TAGS = known
        protocol._COUNTED.clear()
        protocol._COUNTED.update(counted)


THE_ECHO_FILES = ("tests/echo_mode.py", "tests/test_echo_mode.py", "docs/modes.md")
"""What the echo mode touched: its module, its test (which registers it by importing the
module), and its section of docs/modes.md."""


@pytest.mark.timeout(60)
async def test_an_echo_round_trips_through_real_workers_over_tcp(
    workers: WorkerTasks, mode: ModuleType
) -> None:
    echo, Echoed = mode.echo, mode.Echoed
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=2) as learner:
        workers.start(learner.url, num_envs=1)
        workers.start(learner.url, num_envs=3)
        await learner.wait_for_workers()
        payload = {"text": "hello", "numbers": np.arange(5, dtype=np.int32), "nested": (1, 2.5)}
        answers = await echo(learner, payload)
        assert [type(answer) for answer in answers] == [Echoed, Echoed]
        assert [answer.num_envs for answer in answers] == [1, 3]  # each worker's own envs
        for answer in answers:
            assert answer.payload["text"] == "hello"
            assert answer.payload["nested"] == (1, 2.5)
            np.testing.assert_array_equal(answer.payload["numbers"], np.arange(5))
        # Numbered with the modes' other requests on the same workers: steps between echoes.
        await learner.reset(seed=0)
        await learner.step(np.zeros(4, np.int64))
        again = await echo(learner, "second")
        assert [answer.payload for answer in again] == ["second", "second"]
        # A handler that raises is the worker's error, and the worker serves on.
        with pytest.raises(WorkerError, match="asked to raise"):
            await echo(learner, "raise")
        obs, *_ = await learner.step(np.zeros(4, np.int64))
        assert obs.shape == (4, 4)
        assert [answer.payload for answer in await echo(learner, 3)] == [3, 3]


def test_the_row_is_in_every_table_the_protocol_delivery_and_codec_read(mode: ModuleType) -> None:
    Echo, Echoed, ECHO = mode.Echo, mode.Echoed, mode.ECHO
    assert REQUESTS[Echo] is ECHO and ANSWERS[Echo] is Echoed
    assert MESSAGE_TYPES["echo"] is Echo and MESSAGE_TYPES["echoed"] is Echoed
    learner = TRANSITIONS[Role.LEARNER]
    assert learner[State.IDLE, Direction.SEND, Echo] is State.AWAIT_ANSWER
    assert learner[State.AWAIT_ANSWER, Direction.RECEIVE, Echoed] is State.IDLE
    worker = TRANSITIONS[Role.WORKER]
    assert worker[State.IDLE, Direction.RECEIVE, Echo] is State.SERVING
    assert worker[State.SERVING, Direction.SEND, Echoed] is State.IDLE
    # The connection follows the row, and refuses what the row does not allow.
    side = Connection(Role.LEARNER)
    side.state = State.IDLE
    side.send(Echo(payload=1))
    assert side.state is State.AWAIT_ANSWER
    side.receive(Echoed(payload=1, num_envs=1))
    assert side.state is State.IDLE
    with pytest.raises(aps.ProtocolError, match="Echoed while the learner was in state 'idle'"):
        side.receive(Echoed(payload=1, num_envs=1))
    # The codec carries the mode's types, field checks and all.
    message = Echoed(payload={"a": (1, "b")}, num_envs=2, seq=7)
    assert decode(encode(message)) == message
    with pytest.raises(aps.WireError, match="num_envs"):
        encode(Echoed(payload=None, num_envs="two", seq=0))  # type: ignore[arg-type]


def test_a_row_is_registered_once_and_refused_where_it_clashes(mode: ModuleType) -> None:
    Echo, Echoed, ECHO, serve = mode.Echo, mode.Echoed, mode.ECHO, mode.serve
    register_request(ECHO)  # the same row again: nothing changes
    assert REQUESTS[Echo] is ECHO
    with pytest.raises(ConfigError, match="Echo is a request kind already"):
        register_request(RequestKind(Echo, Echoed, serve, awaiting=State.AWAIT_CALL))

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Shout(Message):
        TAG: ClassVar[str] = "shout"
        payload: Any
        seq: int = 0
        acked: int = 0

    # One answer at a time in the rollouts' counted state: an ErrorReport there would lead
    # back to IDLE for this kind and stay COLLECTING for rollouts.
    with pytest.raises(ConfigError, match="clash with rows that lead elsewhere: collecting"):
        register_request(RequestKind(Shout, Echoed, serve, awaiting=State.COLLECTING))

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Unnumbered(Message):
        TAG: ClassVar[str] = "unnumbered"
        payload: Any

    with pytest.raises(ConfigError, match="Unnumbered lack the numbering fields"):
        register_request(RequestKind(Unnumbered, Echoed, serve))

    @dataclass(frozen=True, slots=True, kw_only=True)
    class Impostor(Message):
        TAG: ClassVar[str] = "echo"
        payload: Any

    with pytest.raises(ConfigError, match=r"tag 'echo' of .*Impostor is taken by tests\.echo_mode"):
        register_message(Impostor)
    assert Shout not in REQUESTS and "shout" not in MESSAGE_TYPES
    assert Unnumbered not in REQUESTS and MESSAGE_TYPES["echo"] is Echo


def test_the_mode_imports_only_the_public_registration_points() -> None:
    tree = ast.parse((TESTS / "echo_mode.py").read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aps"):
            imported.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names if alias.name.startswith("aps"))
    assert imported == {
        "aps",  # for the type of the learner whose pool it uses
        "aps.wire.messages.Message",
        "aps.wire.messages.Request",
        "aps.session.protocol.RequestKind",
        "aps.session.protocol.register_request",
    }


def test_no_aps_module_names_the_echo_mode() -> None:
    pattern = re.compile(r"\bEcho(ed)?\b|[\"']echo(ed)?[\"']|echo_mode")
    named = [
        f"{path.relative_to(REPO)}: {match.group(0)}"
        for path in sorted(APS.rglob("*.py"))
        for match in pattern.finditer(path.read_text())
    ]
    assert not named
    assert pattern.search((TESTS / "echo_mode.py").read_text())  # the search can find it


def test_the_tables_are_the_built_in_ones_without_the_mode() -> None:
    # What the fixture restores: no echo in the tables another test of the run reads.
    assert "echo" not in MESSAGE_TYPES and "echo" not in codec._KNOWN_TAGS
    assert {kind.__name__ for kind in REQUESTS} == {
        "ResetRequest",
        "StepRequest",
        "EnvCall",
        "RolloutRequest",
        "JoinWeightGroup",
    }


def _listed(text: str, heading: str) -> list[str]:
    """The first backticked path of each numbered item under ``heading`` in ``text``."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    items: list[str] = []
    inside = False
    for line in section.splitlines():
        if re.match(r"\d+\. ", line):
            items.append(line)
            inside = True
        elif inside and line.startswith("   "):
            items[-1] += line
        else:
            inside = False
    return [re.findall(r"`([^`]+)`", item)[0] for item in items]


def test_the_docs_list_exactly_the_files_a_mode_touches() -> None:
    text = (REPO / "docs" / "modes.md").read_text()
    assert _listed(text, "The files a new mode touches") == list(THE_FILES)
    assert len(THE_FILES) <= 4
    assert _listed(text, "The echo mode, file by file") == list(THE_ECHO_FILES)
    for name in THE_ECHO_FILES:
        assert (REPO / name).is_file(), name
