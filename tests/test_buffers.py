"""Large buffers: reused only once nothing refers to them, never changed while in use."""

from __future__ import annotations

import sys

import numpy as np
import pytest

import aps._base._buffers
from aps.wire import codec
from aps.wire.messages import Weights

pytestmark = pytest.mark.skipif(
    sys.implementation.name != "cpython" or not aps._base._buffers._REUSE,
    reason="filling and reusing bytes in place is a CPython detail (GIL builds)",
)
SIZE = aps._base._buffers.REUSE_MIN


@pytest.fixture(autouse=True)
def empty_pool() -> None:
    """Start each test with no kept buffers, whatever ran before."""
    aps._base._buffers._kept.clear()


def fill(value: int, size: int = SIZE) -> bytes:
    data, view = aps._base._buffers.allocate(size)
    view[:] = bytes([value]) * size
    view.release()
    return aps._base._buffers.seal(data)


def test_a_buffer_is_reused_only_once_nothing_refers_to_it() -> None:
    frame = fill(1)
    assert hash(frame) == hash(b"\x01" * SIZE)  # caches the hash in the object
    array = np.frombuffer(frame, np.uint8)[10:20]  # a decoded array: a view of the frame
    address = id(frame)
    del frame
    other = fill(2)
    assert id(other) != address  # the array still refers to the first: a new buffer
    assert bytes(array) == b"\x01" * 10
    del array
    reused = fill(3)
    assert id(reused) == address  # nothing refers to the first one any more
    assert reused == b"\x03" * SIZE
    assert hash(reused) == hash(b"\x03" * SIZE)  # the cached hash was forgotten
    bigger = fill(4, SIZE + 1)
    assert len(bigger) == SIZE + 1  # only a buffer of the very size is reused


def test_small_buffers_are_never_kept() -> None:
    small = fill(5, SIZE - 1)
    address = id(small)
    del small
    assert all(id(kept) != address for kept in aps._base._buffers._kept)


def weights(value: float) -> Weights:
    return Weights(version=1, arrays={"w": np.full(SIZE // 4, value, np.float32)}, epsilon=None)


def test_frames_in_use_never_change_while_others_are_encoded() -> None:
    slots = aps._base._buffers.REUSE_SLOTS
    held = [codec.encode(weights(float(i))) for i in range(slots)]
    for round_ in range(3 * slots):  # every kept buffer is in use: each encode allocates
        codec.encode(weights(100.0 + round_))
    for i, frame in enumerate(held):
        decoded = codec.decode(frame, max_frame_size=2 * SIZE)
        assert isinstance(decoded, Weights)
        np.testing.assert_array_equal(decoded.arrays["w"], np.full(SIZE // 4, float(i)))
    assert len({id(frame) for frame in held}) == slots


def test_the_kept_buffers_hold_at_most_their_byte_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aps._base._buffers, "REUSE_MAX_BYTES", 3 * SIZE)
    held = [fill(i, SIZE + i) for i in range(4)]  # 4 sizes: nothing to reuse
    assert sum(len(kept) for kept in aps._base._buffers._kept) <= 3 * SIZE
    too_big = fill(9, 4 * SIZE)
    assert all(kept is not too_big for kept in aps._base._buffers._kept)
    del held
