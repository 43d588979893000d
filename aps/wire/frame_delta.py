"""Frame stacks in DETACH chunks: each step's stack travels as its newest frame.

An observation that stacks the last ``K`` frames (Atari's ``(4, 84, 84)``) repeats ``K - 1``
of them from the step before: in a chunk's ``obs`` of shape ``(T, E, K, ...)``, for most
steps ``t > 0`` and envs ``e``, ``obs[t, e, :-1]`` holds the bytes of ``obs[t - 1, e, 1:]``.
A worker whose connection negotiated frame delta sends such a chunk's observations as
:data:`EXT_FRAME_DELTA` (:func:`split`, :func:`pack`): for each ``(t, e)`` where that holds
byte for byte, only the newest frame ``obs[t, e, -1]``; every other stack (``t = 0``, an
episode's first observation, a stack that did not shift) whole. The learner rebuilds the
array (:func:`unpacker`), equal byte for byte to the worker's. A Pong chunk shrinks to about
a quarter of its raw bytes before the connection's codec compresses what is left.

The extension's payload is:

- the array header ``[dtype.str, shape]`` of :data:`~aps.wire.codec.EXT_NDARRAY`, unpadded,
  which declares the rebuilt array (``shape`` is ``(T, E, K, ...)``, ``K >= 2``);
- a msgpack bin, the mask: which ``(t, e)`` travel as their newest frame, ``T * E`` bits
  in C order, packed most significant bit first (:func:`numpy.packbits`), the padding bits 0;
- the whole stacks, one array (plain or compressed) of shape ``(W, K, ...)``, in C order of
  ``(t, e)``, where ``W`` is the number of 0 bits;
- the newest frames, one array of shape ``(N, ...)``, likewise, ``N`` the number of 1 bits.

The receiver refuses, as a :class:`~aps.errors.WireError` that its session turns into a
:class:`~aps.errors.ProtocolError` naming the peer: the extension on a connection that did
not negotiate frame delta, or anywhere but a :class:`~aps.wire.messages.RolloutChunk`'s ``obs``
or an array of an ``obs`` that is a dict or tuple of arrays (a ``Dict`` or ``Tuple``
observation space's: each array that is a frame stack is split on its own; see
:func:`aps.wire.codec.decode`: found there before any part is inflated or anything rebuilt); a
shape that :func:`split` never sends (fewer than 4 dimensions, ``K < 2``, a zero-size
dimension, under :data:`THRESHOLD` bytes) and a mask of more bits than the payload
has bytes for, both from the header alone; a rebuilt size (with the rebuild's index scratch)
over what is left of its frame limit or of the connection's inflation rate (checked before
anything is allocated); a mask of the wrong length, with padding bits set or with a bit set at
``t = 0``; parts whose count, shape or dtype disagree with the mask and the header; and
anything after the parts. What the rebuild costs is thus proportional to the bytes received
and the size charged: it is vectorized, with no Python loop over steps.

Only rollout chunks carry it: a lockstep step's answer holds one step, and rebuilding it from
the step before would need state kept across messages (and across a resume).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import numpy as np

from aps.errors import WireError
from aps.wire._wire import (
    EXT_FRAME_DELTA,
    LONGEST_HEADER,
    WIRE_NAME,
    Allowance,
    parse_payload,
    unpadded_header,
)

__all__ = [
    "EXT_FRAME_DELTA",
    "NAME",
    "THRESHOLD",
    "Delta",
    "Pending",
    "check",
    "pack",
    "rebuild",
    "scratch",
    "split",
    "unpacker",
]

NAME: Final = "frame-delta"
"""How a Hello offers frame delta and a Welcome accepts it, among the codec names."""

THRESHOLD: Final = 4096
"""Chunks whose ``obs`` is smaller than this many bytes travel plain: what frame delta could
save there is less than a compressor's threshold (:data:`aps.wire.compression.THRESHOLD`)."""


@dataclass(frozen=True, slots=True)
class Delta:
    """A chunk's observations with the repeated frames left out.

    Attributes:
        shape: the observations' shape ``(T, E, K, ...)``.
        dtype: their dtype.
        mask: ``(T, E)`` bools, ``True`` where only the newest frame travels; never at ``t = 0``.
        whole: the stacks where ``mask`` is ``False``, ``(W, K, ...)``, in C order of ``(t, e)``.
        newest: the newest frames where ``mask`` is ``True``, ``(N, ...)``, likewise.
    """

    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    mask: np.ndarray[Any, np.dtype[np.bool_]]
    whole: np.ndarray[Any, Any]
    newest: np.ndarray[Any, Any]


# The widest unsigned type whose size divides a frame's byte count: comparing frames as such
# words is bytewise equality at a fraction of the element count.
_WORDS = (np.dtype(np.uint64), np.dtype(np.uint32), np.dtype(np.uint16), np.dtype(np.uint8))


def split(obs: Any) -> Delta | None:
    """``obs`` (``(T, E, K, ...)``) as a :class:`Delta`, or ``None`` to send it whole.

    A ``(t, e)`` with ``t > 0`` is delta-coded when ``obs[t, e, :-1]`` and
    ``obs[t - 1, e, 1:]`` hold the same bytes (not merely equal values: ``-0.0`` and NaNs
    compare by their bits). ``None`` for anything that is not such a stack: fewer than 4
    dimensions (each frame at least 1-D), ``T < 2`` or ``K < 2``, a dtype that does not
    travel as a plain array, fewer than :data:`THRESHOLD` bytes, or no stack that shifted.
    """
    if type(obs) is not np.ndarray or obs.ndim < 4 or obs.dtype not in WIRE_NAME:
        return None
    steps, envs, depth = obs.shape[:3]
    if steps < 2 or depth < 2 or obs.nbytes < THRESHOLD:
        return None
    frame_bytes = obs[0, 0, 0].nbytes
    word = next(w for w in _WORDS if frame_bytes % w.itemsize == 0)
    words = np.ascontiguousarray(obs).view(np.uint8).reshape(steps, envs, depth, frame_bytes)
    words = words.view(word)
    mask = np.zeros((steps, envs), np.bool_)
    for t in range(1, steps):
        # One step at a time: the comparison's temporary is one step's stacks, not the chunk's.
        same = words[t, :, :-1] == words[t - 1, :, 1:]
        mask[t] = same.reshape(envs, -1).all(axis=1)
    if not mask.any():
        return None
    return Delta(
        shape=obs.shape,
        dtype=obs.dtype,
        mask=mask,
        whole=obs[~mask],
        newest=obs[:, :, -1][mask],
    )


def rebuild(delta: Delta) -> np.ndarray[Any, Any]:
    """The observations ``delta`` stands for (a new, writable array).

    Vectorized, with no loop over steps. Each env's frames are laid out as one sequence in
    time order: a stack that travelled whole as its ``K`` frames, each delta-coded step as its
    newest frame after them. Every stack is then ``K`` consecutive frames of that sequence
    (those ending at its newest frame), so the result is one gather of windows, indexed per
    ``(t, e)``. Besides the result it allocates the parts' bytes once (the sequence) and
    :func:`scratch` bytes of indices.

    Raises:
        WireError: the parts disagree with the mask or the shape (see :func:`check`).
    """
    check(delta)
    shape = delta.shape
    steps, envs, depth = shape[:3]
    frame_bytes = delta.dtype.itemsize
    for dim in shape[3:]:
        frame_bytes *= dim
    if steps * envs * frame_bytes == 0:
        return np.empty(shape, delta.dtype)
    mask = delta.mask
    # Frames each (t, e) adds to its env's sequence, and where they start there: the
    # sequences follow each other env by env, so the running sum goes in (e, t) order.
    counts = np.where(mask, 1, depth).T.reshape(-1)
    # One past each (t, e)'s last frame, in C order of (t, e) as the parts travel.
    ends: np.ndarray[Any, Any] = np.cumsum(counts).reshape(envs, steps).T.reshape(-1)
    coded = mask.reshape(-1)
    sequence = np.empty((int(counts.sum()), frame_bytes), np.uint8)
    whole = np.ascontiguousarray(delta.whole).view(np.uint8).reshape(-1, depth, frame_bytes)
    sequence[(ends[~coded] - depth)[:, None] + np.arange(depth)] = whole
    newest = np.ascontiguousarray(delta.newest).view(np.uint8).reshape(-1, frame_bytes)
    sequence[ends[coded] - 1] = newest
    # Every window of depth frames, as a view; each (t, e) takes the one ending at its end.
    windows = np.lib.stride_tricks.as_strided(
        sequence,
        shape=(len(sequence) - depth + 1, depth, frame_bytes),
        strides=(frame_bytes, frame_bytes, 1),
        writeable=False,
    )
    out: np.ndarray[Any, Any] = windows[ends - depth]
    return out.view(delta.dtype).reshape(shape)


def scratch(shape: tuple[int, ...]) -> int:
    """An upper bound of the bytes of indices :func:`rebuild` allocates, for ``shape``.

    A few int64 per ``(t, e)`` and per frame of a whole stack. The frame sequence (the
    parts' frames, whose count the mask says) comes on top.
    """
    steps, envs, depth = shape[:3]
    cells = steps * envs
    return 16 * cells * depth + 96 * cells


def check(delta: Delta) -> None:
    """Refuse a :class:`Delta` whose parts do not rebuild its shape.

    Raises:
        WireError: the shape is not ``(T, E, K >= 2, ...)``, the mask is not ``(T, E)`` or has
            a bit set at ``t = 0``, or ``whole`` or ``newest`` has another dtype than the
            shape's or another shape than the mask's counts ask for.
    """
    shape = delta.shape
    if len(shape) < 3 or shape[2] < 2:
        raise WireError(
            f"frame-delta array of shape {shape} is not a chunk of frame stacks "
            "(T, E, K, ...) with K >= 2"
        )
    steps, envs = shape[:2]
    mask = delta.mask
    if mask.shape != (steps, envs) or mask.dtype != np.bool_:
        raise WireError(
            f"frame-delta mask has shape {mask.shape} ({mask.dtype}), not ({steps}, {envs}) "
            f"bools for the array of shape {shape}"
        )
    if steps and mask[0].any():
        raise WireError(
            f"frame-delta mask codes {int(mask[0].sum())} stacks at t=0 as their newest frame, "
            "but there is no step before them to shift from"
        )
    count = int(mask.sum())
    for part, name, want in (
        (delta.whole, "whole stacks", (steps * envs - count, *shape[2:])),
        (delta.newest, "newest frames", (count, *shape[3:])),
    ):
        if part.dtype != delta.dtype or part.shape != want:
            raise WireError(
                f"frame-delta {name} are {part.dtype} of shape {part.shape}, but its mask "
                f"({count} of {steps * envs} newest frames) and header ({delta.dtype}, shape "
                f"{shape}) ask for {delta.dtype} of shape {want}"
            )


# --------------------------------------------------------------------------------------------
# On the wire


def pack(delta: Delta, pack_array: Callable[[np.ndarray[Any, Any]], bytes]) -> msgpack.ExtType:
    """``delta`` as an :data:`EXT_FRAME_DELTA` extension.

    ``pack_array`` writes one array as the codec does on this connection (compressed when it
    is worth it), so the parts are compressed like any other array.
    """
    head = unpadded_header(WIRE_NAME[delta.dtype], delta.shape)
    mask = msgpack.packb(np.packbits(delta.mask).tobytes(), use_bin_type=True)
    payload = b"".join((head, mask, pack_array(delta.whole), pack_array(delta.newest)))
    ext: msgpack.ExtType = tuple.__new__(msgpack.ExtType, (EXT_FRAME_DELTA, payload))
    return ext


class Pending:
    """A frame-delta array whose header was checked, not yet rebuilt (see :func:`unpacker`).

    Decoding a frame leaves each such array as this placeholder, so that the codec can
    refuse one anywhere but a :class:`~aps.wire.messages.RolloutChunk`'s ``obs`` before its parts
    are inflated or anything is rebuilt; :meth:`rebuild` does the rest.
    """

    __slots__ = ("_allowance", "_array_hook", "dtype", "end", "nbytes", "payload", "shape")

    def __init__(
        self,
        payload: bytes,
        header: tuple[np.dtype[Any], tuple[int, ...], int, int],
        allowance: Allowance,
        array_hook: Callable[[int, bytes], Any],
    ) -> None:
        self.payload = payload
        self.dtype, self.shape, self.end, self.nbytes = header
        self._allowance = allowance
        self._array_hook = array_hook

    def rebuild(self) -> np.ndarray[Any, Any]:
        """The array (read-only), its size and scratch charged to the allowance first.

        Raises:
            WireError: the parts are malformed or disagree with the header (see the module).
        """
        payload, dtype, shape, end = self.payload, self.dtype, self.shape, self.end
        what = f"frame-delta array ({dtype}, shape {shape})"
        allowance = self._allowance
        allowance.take(self.nbytes + scratch(shape), what)
        # The array's growth is its full size less its payload: what its parts grew by
        # (compressed, inside the payload) is part of that, not more.
        expanded = allowance.expanded
        steps, envs = shape[:2]
        cells = steps * envs
        array_hook = self._array_hook

        def part_hook(code: int, data: bytes) -> Any:
            if code == EXT_FRAME_DELTA:
                raise WireError("frame-delta array nested in another; its parts are plain arrays")
            return array_hook(code, data)

        parts = msgpack.Unpacker(
            None,
            ext_hook=part_hook,
            use_list=False,
            raw=False,
            max_buffer_size=max(len(payload), 1),
            max_str_len=0,
            max_array_len=0,
            max_map_len=0,
        )
        parts.feed(memoryview(payload)[end:])
        try:
            bits, whole, newest = parts.unpack(), parts.unpack(), parts.unpack()
        except WireError:
            raise
        except Exception as exc:
            raise WireError(
                f"frame-delta array of shape {shape} must hold a mask and two arrays: {exc}"
            ) from exc
        if parts.tell() != len(payload) - end:
            raise WireError(
                f"frame-delta array of shape {shape} has {len(payload) - end - parts.tell()} "
                "bytes after its parts"
            )
        if type(bits) is not bytes or len(bits) != -(-cells // 8):
            got = f"{len(bits)} bytes" if type(bits) is bytes else type(bits).__qualname__
            raise WireError(
                f"frame-delta mask must be {-(-cells // 8)} bytes ({cells} bits for shape "
                f"{shape}), got {got}"
            )
        flat = np.unpackbits(np.frombuffer(bits, np.uint8))
        if flat[cells:].any():
            raise WireError("frame-delta mask has bits set past its last (t, e)")
        for name, part in (("whole stacks", whole), ("newest frames", newest)):
            if type(part) is not np.ndarray:
                raise WireError(
                    f"frame-delta {name} must be a numeric array, got {type(part).__qualname__}"
                )
        mask = flat[:cells].reshape(steps, envs).astype(np.bool_)
        # The rebuild lays the parts' frames out once more, in its frame sequence.
        count = int(mask.sum())
        self._allowance.take(
            ((cells - count) * shape[2] + count) * (self.nbytes // (cells * shape[2])),
            f"{what}'s frame sequence",
        )
        del parts
        out = rebuild(Delta(shape=shape, dtype=dtype, mask=mask, whole=whole, newest=newest))
        out.flags.writeable = False  # like every decoded array
        allowance.expanded = expanded + self.nbytes - len(payload)
        return out


def unpacker(
    allowance: Allowance, array_hook: Callable[[int, bytes], Any]
) -> Callable[[bytes], Pending]:
    """A function that turns :data:`EXT_FRAME_DELTA` payloads of one frame into placeholders.

    Args:
        allowance: what the arrays of the frame may still inflate and rebuild to; the rebuilt
            array and the rebuild's scratch are charged before anything is allocated.
        array_hook: the ext hook for the parts (plain and compressed arrays, the latter
            charged to the same allowance); anything else it returns is refused.

    The function checks what costs nothing to check, in time proportional to the header:
    it refuses, with :class:`~aps.errors.WireError`, a shape that :func:`split` never
    sends (fewer than 4 dimensions, ``K < 2``, a zero-size dimension, fewer than
    :data:`THRESHOLD` bytes) and a mask of more bits than the payload has. It returns a
    :class:`Pending` whose :meth:`~Pending.rebuild` makes the read-only array and refuses
    the rest of what the module's docstring lists.
    """

    def unpack(payload: bytes) -> Pending:
        # The header is parsed from a bounded copy: a few hundred bytes at most.
        header = parse_payload(payload[:LONGEST_HEADER])
        dtype, shape, end, nbytes = header
        if len(shape) < 4 or shape[2] < 2:
            raise WireError(
                f"frame-delta array of shape {shape} is not a chunk of frame stacks "
                "(T, E, K, ...) with K >= 2 and frames of at least one dimension"
            )
        if 0 in shape or nbytes < THRESHOLD:
            # split() sends nothing smaller: a zero-size dimension would make T * E steps
            # of work for no bytes at all.
            raise WireError(
                f"frame-delta array of shape {shape} ({dtype}) holds {nbytes} bytes; frame "
                f"delta is used for chunks of at least {THRESHOLD} bytes with no zero-size "
                "dimension, else the chunk travels plain"
            )
        cells = shape[0] * shape[1]
        if -(-cells // 8) > len(payload) - end:
            raise WireError(
                f"frame-delta array of shape {shape} needs a mask of {-(-cells // 8)} bytes "
                f"({cells} bits) but its payload has {len(payload) - end} bytes after the header"
            )
        return Pending(payload, header, allowance, array_hook)

    return unpack
