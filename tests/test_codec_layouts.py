"""A chunk frame laid out like one decoded before is read without msgpack: the same message.

:mod:`aps.wire._layouts` learns the layout of each chunk frame the codec decodes in full and
reads the next frames of that layout directly. Here the two ways are compared on honest frames
of many layouts and on frames with any one byte changed (a peer's bad input): whatever the
full decode makes of a frame (a message, or a WireError naming the problem), decoding it with
its layout known makes the same.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aps.errors import WireError
from aps.wire import _layouts, _wire, codec
from aps.wire.messages import TIMINGS_FORMAT, RolloutChunk, StepResult


@pytest.fixture(autouse=True)
def _no_layouts(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # Every frame decoded in full is learned here, not one in LEARN_EVERY (tested apart).
    monkeypatch.setattr(_layouts, "LEARN_EVERY", 1)
    _layouts._LAYOUTS.clear()
    yield
    _layouts._LAYOUTS.clear()


def chunk(
    steps: int = 4,
    envs: int = 2,
    *,
    seed: int = 0,
    version: int = 3,
    seq: int = 7,
    episodes: int = 1,
    cuts: int = 0,
    value: bool = True,
    obs_dtype: Any = np.float32,
) -> RolloutChunk:
    rng = np.random.default_rng(seed)
    truncated = np.zeros((steps, envs), bool)
    truncated.flat[:cuts] = True
    return RolloutChunk(
        version=version,
        obs=rng.normal(size=(steps, envs, 3)).astype(obs_dtype),
        actions=rng.integers(0, 4, (steps, envs)),
        logprob=rng.normal(size=(steps, envs)).astype(np.float32),
        value=rng.normal(size=(steps, envs)).astype(np.float32) if value else None,
        reward=rng.normal(size=(steps, envs)),
        terminated=rng.random((steps, envs)) < 0.2,
        truncated=truncated,
        next_obs=rng.normal(size=(envs, 3)).astype(obs_dtype),
        episode_return=rng.normal(size=episodes),
        episode_length=rng.integers(1, 100, episodes),
        episode_env=rng.integers(0, envs, episodes),
        truncated_obs=rng.normal(size=(cuts, 3)).astype(obs_dtype),
        truncated_index=np.argwhere(truncated),
        seq=seq,
        timings=TIMINGS_FORMAT.pack(*rng.random(3)),
    )


def full(frame: bytes, **kwargs: Any) -> Any:
    """What the full decode makes of ``frame``: a message or the WireError's text."""
    _layouts._LAYOUTS.clear()
    try:
        return codec.decode(frame, **kwargs)
    except WireError as exc:
        return f"WireError: {exc}"
    finally:
        _layouts._LAYOUTS.clear()


def with_layout(known: bytes, frame: bytes, **kwargs: Any) -> tuple[Any, bool]:
    """What decoding ``frame`` makes of it once ``known``'s layout is learned, and whether
    the layout read it."""
    _layouts._LAYOUTS.clear()
    codec.decode(known)
    assert _layouts._LAYOUTS, "the honest frame's layout is learned"
    read = _layouts.recognize(frame) is not None
    try:
        return codec.decode(frame, **kwargs), read
    except WireError as exc:
        return f"WireError: {exc}", read


def same(a: Any, b: Any) -> bool:
    """Whether two decodings are the same: equal fields of the same types, arrays alike."""
    if type(a) is not type(b):
        return False
    if not dataclasses.is_dataclass(a):
        return bool(a == b)
    for field in dataclasses.fields(a):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if type(x) is not type(y):
            return False
        if type(x) is np.ndarray:
            if not (
                x.dtype == y.dtype
                and x.shape == y.shape
                and x.tobytes() == y.tobytes()
                and not x.flags.writeable
                and not y.flags.writeable
                and x.flags.aligned == y.flags.aligned
            ):
                return False
        elif x != y:
            return False
    return True


LAYOUTS = [
    {},
    {"episodes": 0},
    {"episodes": 3, "cuts": 2},
    {"value": False},
    {"steps": 1, "envs": 1},
    {"steps": 16, "envs": 1, "obs_dtype": np.uint8},
    {"version": 0, "seq": 0},
    {"version": 200, "seq": 70_000},
    {"version": 2**40, "seq": 2**63 + 5},
    {"version": -1, "seq": -200},
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[str(kw) for kw in LAYOUTS])
def test_a_frame_of_a_known_layout_decodes_as_in_full(layout: dict[str, Any]) -> None:
    known = codec.encode(chunk(seed=1, **layout))
    for seed in range(2, 6):
        frame = codec.encode(chunk(seed=seed, **layout))
        assert len(frame) == len(known)
        decoded, read = with_layout(known, frame)
        assert read, "read by its layout"
        assert same(decoded, full(frame))
        assert same(decoded, codec.decode(codec.encode(decoded)))


def test_ints_of_another_width_or_sign_take_the_full_decode() -> None:
    known = codec.encode(chunk(version=5, seq=9))
    for version, seq in [(5, 200), (200, 9), (-3, 9), (5, -9), (2**33, 9)]:
        frame = codec.encode(chunk(version=version, seq=seq))
        decoded, read = with_layout(known, frame)
        assert not read
        assert same(decoded, full(frame))


CONNECTIONS = [{}, {"compression": "lz4", "frame_delta": True}]


@pytest.mark.parametrize("connection", CONNECTIONS, ids=["plain", "lz4 and frame delta"])
@pytest.mark.parametrize("layout", [{}, {"episodes": 0, "version": 300}])
def test_any_byte_changed_decodes_as_in_full(
    layout: dict[str, Any], connection: dict[str, Any]
) -> None:
    # Every position, with values that keep or break what a byte there means (the ext
    # codes of compressed and frame-delta arrays among them): the layout reads a frame only
    # where the full decode makes the same message of it.
    if connection.get("compression") == "lz4":
        pytest.importorskip("lz4")
    known = codec.encode(chunk(seed=1, **layout))
    honest = codec.encode(chunk(seed=2, **layout))
    read_some = False
    for at in range(len(honest)):
        for byte in {0x00, 0x01, 0x04, 0x05, 0x7F, 0x80, 0xC0, 0xCC, 0xD3, 0xFF, honest[at] ^ 1}:
            frame = honest[:at] + bytes([byte]) + honest[at + 1 :]
            decoded, read = with_layout(known, frame, **connection)
            read_some |= read
            expected = full(frame, **connection)
            assert same(decoded, expected), (at, byte, decoded, expected)
    assert read_some


def test_frames_it_does_not_learn_are_decoded_in_full() -> None:
    recurrent = dataclasses.replace(
        chunk(),
        initial_state=[np.zeros((1, 2, 4), np.float32)],
        episode_start=np.ones((4, 2), bool),
    )
    step = StepResult(
        obs=np.zeros((2, 3), np.float32),
        reward=np.zeros(2),
        terminated=np.zeros(2, bool),
        truncated=np.zeros(2, bool),
        info={},
    )
    for message in (recurrent, step):
        frame = codec.encode(message)
        codec.decode(frame)
        assert _layouts.recognize(frame) is None
        assert not _layouts._LAYOUTS


def test_layouts_are_bounded() -> None:
    for steps in range(1, _layouts.MAX_LAYOUTS + 10):
        codec.decode(codec.encode(chunk(steps=steps)))
        assert sum(map(len, _layouts._LAYOUTS.values())) <= _layouts.MAX_LAYOUTS


@pytest.mark.parametrize(("compression", "frame_delta"), [("lz4", False), ("none", True)])
def test_on_a_compressing_connection_a_known_layout_decodes_as_in_full(
    compression: str, frame_delta: bool
) -> None:
    if compression != "none":
        pytest.importorskip(compression)
    # A chunk under the compressor's threshold travels plain; its data holds the bytes of
    # the compressed and frame-delta ext codes, so the full decode takes the hook that
    # inflates. Learned there or on a plain connection, the layout reads it the same.
    kwargs = {"compression": compression, "frame_delta": frame_delta}
    known = codec.encode(chunk(16, 4, seed=1))
    frames = [codec.encode(chunk(16, 4, seed=seed)) for seed in range(2, 8)]
    assert all(bytes([4]) in f and bytes([5]) in f for f in frames)
    expected = []
    for frame in frames:
        _layouts._LAYOUTS.clear()
        expected.append(codec.decode(frame, **kwargs))
        # ... and it was learned on the way, even though its hook could inflate.
        assert _layouts.recognize(frame) is not None
    _layouts._LAYOUTS.clear()
    codec.decode(known, **kwargs)
    rate = _wire.InflationRate()
    for frame, wanted in zip(frames, expected, strict=True):
        assert _layouts.recognize(frame) is not None
        assert same(codec.decode(frame, rate=rate, **kwargs), wanted)
    assert rate.expanded == 0


def test_one_layout_is_learned_per_learn_every_frames_decoded_in_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Learning costs a millisecond: chunks of ever new layouts cost a few us more each.
    monkeypatch.setattr(_layouts, "LEARN_EVERY", 8)
    monkeypatch.setattr(_layouts, "_unlearned", 8)
    frames = [codec.encode(chunk(steps=steps)) for steps in range(1, 26)]
    for frame in frames:
        codec.decode(frame)
    learned = [f for f in frames if _layouts.recognize(f) is not None]
    assert learned == [frames[0], frames[8], frames[16], frames[24]]
