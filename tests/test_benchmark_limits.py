"""The matrix's measured limits run their worker processes, deliver whole steps or chunks,
and leave no process behind.

``step-limit`` and ``stream-limit`` (benchmarks/contenders.py) are the rows that say how much
of a gap is aps's own; a limit that broke, or left processes running into the next rows'
windows, would make every later matrix wrong. Each is started for 2 workers x 2 envs of
CartPole, timed for one short window and closed.
"""

from __future__ import annotations

import ast
import asyncio
import os
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.conftest import BENCHMARKS, benchmark_module


@pytest.fixture(scope="module")
def contenders() -> Iterator[ModuleType]:
    with benchmark_module("contenders") as module:
        yield module


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A child that exited but was not reaped is gone for our purpose.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0] != "Z"


def window_of(contenders: Any, name: str) -> tuple[Any, list[int]]:
    import throughput

    setup = throughput.Setup("CartPole-v1", num_workers=2, envs_per_worker=2)
    contender = contenders.ALL[name](setup, throughput.make_action_pool(setup, size=8))
    try:
        contender.start()
        pids = list(contender.worker_pids())
        assert len(pids) == 2 and all(alive(pid) for pid in pids)
        window = contender.window(0.3)
    finally:
        contender.close()
    return window, pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_step_limit_delivers_steps_and_cleans_up(contenders: ModuleType) -> None:
    window, pids = window_of(contenders, "step-limit")
    assert window.env_steps > 0 and window.env_steps % 4 == 0  # whole steps of 4 envs
    assert window.workers_cpu is not None and window.workers_cpu > 0
    assert not any(alive(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_bare_ceiling_delivers_steps_runs_no_aps_and_cleans_up(contenders: ModuleType) -> None:
    window, pids = window_of(contenders, "bare-ceiling")
    assert window.env_steps > 0 and window.env_steps % 4 == 0  # whole steps of 4 envs
    assert window.workers_cpu is not None and window.workers_cpu > 0
    assert not any(alive(pid) for pid in pids)
    # The worker program imports no aps module.
    tree = ast.parse((BENCHMARKS / "bare.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(name.split(".")[0] in ("aps", "throughput", "contenders") for name in imported)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_stream_limit_streams_chunks_and_cleans_up(contenders: ModuleType) -> None:
    pytest.importorskip("torch")
    window, pids = window_of(contenders, "stream-limit")
    steps = contenders.ApsDetach.steps_per_chunk(2)
    assert window.env_steps > 0 and window.env_steps % (2 * steps) == 0  # whole chunks
    assert window.rate > 0  # more than one chunk from a worker: a steady rate
    assert not any(alive(pid) for pid in pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(120)
def test_bare_protocol_delivers_steps_and_cleans_up(contenders: ModuleType) -> None:
    window, pids = window_of(contenders, "bare-protocol")
    assert window.env_steps > 0 and window.env_steps % 4 == 0  # whole steps of 4 envs
    assert window.workers_cpu is not None and window.workers_cpu > 0
    assert not any(alive(pid) for pid in pids)


def test_frame_protocol_parses_frames_split_and_joined_anywhere() -> None:
    frames = [b"", b"a", b"bc" * 300, bytes(range(256)) * 40]
    wire = b"".join(len(frame).to_bytes(4, "little") + frame for frame in frames) * 2

    with benchmark_module("bare") as bare:
        for cuts in ([], [1], [3, 4, 5], list(range(1, len(wire))), [len(wire) // 2]):
            assert asyncio.run(feed(bare, wire, cuts)) == frames * 2


async def feed(bare: Any, wire: bytes, cuts: list[int]) -> list[bytes]:
    """The frames a FrameProtocol hands on when ``wire`` arrives cut at ``cuts``."""
    received: list[bytes] = []
    protocol = bare.FrameProtocol(lambda _, frame: received.append(bytes(frame)))
    for start, stop in zip([0, *cuts], [*cuts, len(wire)], strict=True):
        protocol.data_received(wire[start:stop])
    return received
