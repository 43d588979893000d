"""Decoding costs what the frame costs: a fuzzer of structures, measured with tracemalloc.

A frame within the frame limit, from a peer that holds the token, must not make the decoding
side allocate more than a small multiple of its size, whatever its structure: msgpack builds
one Python object per msgpack object, and a 1-byte empty map becomes a 64-byte dict. The
families of benchmarks/decode_bound.py are the cheapest ways, per byte, to make msgpack,
numpy or the ext hooks build many objects (empty and one-element containers, deep nesting,
small ints and floats, tiny strs and bins, tiny arrays, numpy scalars and object arrays, maps
of one entry, and random trees of all of them); here each frame is a few MiB, and is decoded
or refused with a :class:`~aps.WireError` while :mod:`tracemalloc` (which sees numpy's
allocations too) records the peak. Legitimate messages with many arrays still decode, within
the same bound.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path
from types import ModuleType

import pytest

import aps
from aps import transports
from aps.session.protocol import learner_proof
from aps.wire import codec
from aps.wire._unpack import DECODE_FLOOR, DECODE_RATIO, decode_budget, scan
from aps.wire.messages import PROTOCOL_VERSION, Challenge, Hello, Ready, Welcome

SIZE = 4 * 2**20  # a few MiB: the floor of the budget is small against it
LIMIT = 3.0  # the goal: under 3x the frame's size
TOKEN = "a token of enough entropy for a test, 0123456789abcdef"


def _benchmark() -> ModuleType:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_bound.py"
    spec = importlib.util.spec_from_file_location("decode_bound_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _benchmark()
FAMILIES = bench.families(SIZE)
LEGITIMATE = bench.legitimate(SIZE)


def _peak(frame: bytes) -> tuple[float, str]:
    ratio, outcome, _ = bench.peak(frame, timed=False)
    return ratio, outcome


@pytest.mark.parametrize("family", FAMILIES)
def test_no_structure_costs_more_than_three_times_its_frame(family: str) -> None:
    frame = bench.frame_of(FAMILIES[family]())
    assert len(frame) > 2**20
    ratio, outcome = _peak(frame)
    assert ratio < LIMIT, f"{family}: decoding cost {ratio:.2f}x the frame ({outcome[:200]})"
    if outcome.startswith("WireError"):
        assert "bytes" in outcome and "limit" in outcome


def test_a_frame_of_tiny_objects_is_refused_naming_the_count_and_the_limit() -> None:
    frame = bench.frame_of([{}] * SIZE)
    with pytest.raises(aps.WireError) as refused:
        codec.decode(frame)
    message = str(refused.value)
    assert f"frame of {len(frame)} bytes" in message
    assert f"limit of {decode_budget(len(frame))} bytes" in message
    assert "fewer, larger numpy arrays" in message  # what a sender does instead


@pytest.mark.parametrize("name", LEGITIMATE)
def test_legitimate_messages_decode_within_the_bound(name: str) -> None:
    message = LEGITIMATE[name]()
    frame = codec.encode(message)
    ratio, outcome = _peak(frame)
    assert outcome == type(message).__name__, outcome
    assert ratio * len(frame) < decode_budget(len(frame))
    if len(frame) > 2**20:
        assert ratio < LIMIT


def test_the_budget_is_a_ratio_above_a_floor() -> None:
    assert decode_budget(0) == DECODE_FLOOR
    assert decode_budget(SIZE) == DECODE_RATIO * SIZE + DECODE_FLOOR
    assert decode_budget(SIZE) < LIMIT * SIZE


async def test_a_worker_refuses_an_amplifying_frame_from_its_learner() -> None:
    # A learner that holds the token sends one frame of empty maps: the worker's session
    # refuses it like any malformed frame, before building it.
    listener = await transports.get_factory("tcp").listen("tcp://127.0.0.1:0")
    timeouts = aps.Timeouts(connect=10, handshake=5, heartbeat_interval=0.5)
    worker = aps.Worker(
        listener.url, "CartPole-v1", token=TOKEN, timeouts=timeouts, reconnect=False
    )
    task = asyncio.create_task(worker.run())
    try:
        async with asyncio.timeout(30):
            learner = await listener.accept()
            nonce = os.urandom(32)
            await learner.send(
                codec.encode(Challenge(protocol_version=PROTOCOL_VERSION, nonce=nonce))
            )
            hello = codec.decode_handshake(await learner.receive())
            assert isinstance(hello, Hello)
            welcome = Welcome(
                worker_id=0,
                autoreset_mode="NextStep",
                policy=None,
                session_id=b"s" * 16,
                proof=learner_proof(TOKEN.encode(), nonce, hello.nonce),
            )
            await learner.send(codec.encode(welcome))
            assert isinstance(codec.decode(await learner.receive()), Ready)
            await learner.send(bench.frame_of([{}] * SIZE))
            with pytest.raises(aps.ApsError, match="too many small objects"):
                await task
        await learner.aclose()
    finally:
        task.cancel()
        await asyncio.wait([task])
        await listener.aclose()


UNDER_THE_BUDGET = [
    "empty maps",
    "one-element arrays",
    "maps of one entry",
    "uint16s",
    "tiny strs",
    "tiny arrays",
    "numpy scalars",
    "tiny object arrays",
    "random trees",
]


@pytest.mark.parametrize("family", UNDER_THE_BUDGET)
def test_tiny_objects_padded_to_just_under_the_budget_decode_within_three_times(
    family: str,
) -> None:
    # The walk's charges must bound what decoding really allocates: tiny objects padded
    # with one large bin until the frame is just within its budget, then decoded for real.
    objects = bench.families(SIZE // 16)[family]()

    def fits(padding: int) -> bool:
        frame = bench.frame_of({"tiny": objects, "padding": b"\0" * padding})
        try:
            scan(frame, len(frame), find_large=True)
        except aps.WireError:
            return False
        return True

    low, high = 0, 2**20
    while not fits(high):
        low, high = high, 2 * high
    for _ in range(6):  # within 1/64 of the least padding that fits
        middle = (low + high) // 2
        low, high = (low, middle) if fits(middle) else (middle, high)
    frame = bench.frame_of({"tiny": objects, "padding": b"\0" * high})
    ratio, outcome = _peak(frame)
    assert outcome == "Weights", outcome
    assert ratio < LIMIT, f"{family}: {ratio:.2f}x of {len(frame)} bytes"
