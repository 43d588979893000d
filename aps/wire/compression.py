"""Compressed arrays on the wire: the codecs, their negotiation, and the bounded inflate.

A connection compresses when both ends agree in the handshake: the worker's
:class:`~aps.wire.messages.Hello` lists the codecs it can use (those it can import and its own
``compression`` setting allows), the learner chooses one (:func:`choose`) and names it in
its :class:`~aps.wire.messages.Welcome`, and from then on both directions send every numeric
array of at least :data:`THRESHOLD` bytes compressed, when that saves at least an eighth of
its bytes (see :data:`MAX_RATIO`). Control messages, small arrays and what does not
compress stay plain, so a message needs no code of its own to be compressed: observations,
``final_obs``, DETACH chunks, weights and env-call results all carry arrays.

A compressed array is the msgpack extension :data:`EXT_COMPRESSED`, whose payload is:

- one byte, the codec's id (:data:`CODEC_IDS`: 1 zstd, 2 lz4);
- the array header ``[dtype.str, shape]`` of :data:`~aps.wire.codec.EXT_NDARRAY`, unpadded,
  which declares the decompressed size (the dtype's item size times the shape's product);
- the compressed bytes of the array's little-endian C-order data: one zstd frame that
  carries its content size, or one raw lz4 block.

The receiving side refuses, as a :class:`~aps.errors.WireError` that its session turns into
a :class:`~aps.errors.ProtocolError` naming the peer: a codec the connection did not
negotiate; a declared size that, with the arrays already inflated from the same frame, is
more than the frame limit it configured (checked before anything is allocated, so nothing
from the network makes a side allocate more than its limit per frame); a declared size
over what the connection may still inflate (:class:`~aps.wire.codec.InflationRate`: 4096 bytes
per byte received plus 64 MiB/s, so that small frames of zeros cannot keep a side
inflating); a compressed array in a message none of whose fields holds arrays, or in a
space description (a :class:`~aps.wire.messages.Ready`'s Box bounds travel uncompressed, so that
a space costs what its frame costs), both refused before anything is inflated; a zstd frame
that declares another size than the header; and data that does not decompress to exactly
the declared size.

Frame delta (:mod:`aps.wire.frame_delta`) is negotiated along with the codec, as one more name in
the Hello's list (:data:`FRAME_DELTA`) and after the codec in the Welcome
(:func:`accepted`, :func:`parse_accepted`); the learner takes it where its setting
compresses (:func:`choose_frame_delta`).

The libraries are `zstandard <https://pypi.org/project/zstandard/>`_ and `lz4
<https://pypi.org/project/lz4/>`_, the ``compression`` extra. A side that lacks one cannot
offer or choose it: it falls back to no compression, says so once in the log, and works.
"""

from __future__ import annotations

import importlib.util
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import msgpack
import numpy as np

from aps.errors import ConfigError, ProtocolError, WireError
from aps.wire._wire import (
    EXT_COMPRESSED,
    LONGEST_HEADER,
    SWAPPED,
    WIRE_NAME,
    Allowance,
    dtype_error,
    parse_payload,
    unpadded_header,
)
from aps.wire.frame_delta import NAME as FRAME_DELTA

__all__ = [
    "CODECS",
    "CODEC_IDS",
    "EXT_COMPRESSED",
    "FRAME_DELTA",
    "LEVELS",
    "MAX_RATIO",
    "SETTINGS",
    "THRESHOLD",
    "Compressor",
    "accepted",
    "available",
    "check_setting",
    "choose",
    "choose_frame_delta",
    "compressor",
    "offer",
    "parse_accepted",
]

log = logging.getLogger("aps.wire.compression")

CODECS: Final = ("zstd", "lz4")
"""The codecs aps can use, in the order ``"auto"`` prefers them."""

SETTINGS: Final = ("auto", "zstd", "lz4", "none")
"""The values of every ``compression=`` argument and ``--compression`` flag."""

CODEC_IDS: Final = {"zstd": 1, "lz4": 2}
"""The byte that names a codec in a compressed array's payload."""

_NAMES = {code: name for name, code in CODEC_IDS.items()}

THRESHOLD: Final = 4096
"""Arrays of fewer bytes than this travel plain.

Measured with ``benchmarks/compression.py`` (``benchmarks/results/compression-*.json``):
at 1 KiB and under, MuJoCo and CartPole float observations do not shrink at all (ratio
1.01 to 1.04 with zstd and lz4) and a call's fixed cost holds both codecs to 30 to 400
MB/s; at 4 KiB Humanoid's float64 observations shrink to 0.75 and Pong frames to 0.04, at
250 to 1,000 MB/s. Below 4 KiB an array saves under 4 KiB whatever it holds, while
every array there would pay the fixed cost.
"""

LEVELS: Final = {"zstd": 1, "lz4": 0}
"""The level each codec runs at (zstd's 1; lz4's block default, its fastest mode).

Measured with ``benchmarks/compression.py``: on Humanoid float64 observations of 16 KiB
and more, zstd 3 compresses at half to two thirds of level 1's speed for a ratio better
by under 0.01 (0.684 against 0.690), and zstd 6 at a sixth of it; on Pong frames every
level already reaches 0.01 or less from 16 KiB. lz4's high-compression mode (9) runs 5 to
100 times slower than its default for a ratio better by 0.01 to 0.02.
"""

MAX_RATIO: Final = 0.875
"""An array whose compressed bytes are more than this share of its raw bytes travels plain.

Measured: CartPole float32 observations only reach 0.94 with zstd (1.004 with lz4) and
random bytes 1.00, not worth the receiver's inflate; MuJoCo float64 observations (0.69
with zstd, 0.73 with lz4) and pixels (0.01 to 0.04) pass."""

_PACKAGES = {"zstd": "zstandard", "lz4": "lz4"}


def check_setting(value: object, what: str = "compression") -> str:
    """Return ``value`` if it is one of :data:`SETTINGS`.

    Raises:
        ConfigError: anything else, listing the valid values.
    """
    if isinstance(value, str) and value in SETTINGS:
        return value
    valid = ", ".join(repr(s) for s in SETTINGS)
    raise ConfigError(
        f"{what} must be one of {valid}, got {value!r}; 'auto' compresses for peers that are "
        "not on this host"
    )


def available() -> tuple[str, ...]:
    """The codecs whose library this process can import, in :data:`CODECS` order."""
    return tuple(c for c in CODECS if _importable(_PACKAGES[c]))


_FOUND: dict[str, bool] = {}


def _importable(package: str) -> bool:
    found = _FOUND.get(package)
    if found is None:
        found = _FOUND[package] = importlib.util.find_spec(package) is not None
    return found


_said: set[str] = set()
_said_lock = threading.Lock()


def _once(key: str, level: int, text: str, *args: object) -> None:
    """Log ``text`` the first time ``key`` comes up in this process, at debug level after."""
    with _said_lock:
        first = key not in _said
        _said.add(key)
    log.log(level if first else logging.DEBUG, text, *args)


def _missing(codec: str, who: str) -> None:
    _once(
        f"missing {who} {codec}",
        logging.WARNING,
        "compression=%r asked for, but this %s cannot import %s; its arrays travel "
        "uncompressed (install the compression extra: pip install 'aps-rl[compression]')",
        codec,
        who,
        _PACKAGES[codec],
    )


def offer(setting: str, *, frame_delta: bool = False) -> tuple[str, ...]:
    """The codecs a worker started with ``setting`` lists in its Hello.

    ``"auto"``: every codec it can import; a codec name: that one, if it can import it (if
    not, one log line says so and the worker offers none); ``"none"``: none. With
    ``frame_delta`` and any setting but ``"none"``, :data:`aps.wire.frame_delta.NAME` follows
    them (it needs no library).
    """
    check_setting(setting)
    if setting == "none":
        return ()
    delta = (FRAME_DELTA,) if frame_delta else ()
    have = available()
    if setting == "auto":
        return have + delta
    if setting not in have:
        _missing(setting, "worker")
        return delta
    return (setting, *delta)


def choose(setting: str, offered: Sequence[str], *, local: bool, peer: str) -> str:
    """The codec a learner started with ``setting`` picks for one worker, or ``"none"``.

    Args:
        setting: the learner's ``compression`` setting.
        offered: the codecs the worker's Hello listed (names this release does not know are
            ignored: a newer worker may know more).
        local: whether the worker's transport is on this host
            (:func:`aps.transports.is_local`); ``"auto"`` compresses only when it is not.
        peer: the worker's address, for the log.

    ``"auto"`` takes the first of :data:`CODECS` that both sides can use, and says once
    that it compresses. A codec the worker did not offer or this side cannot import means
    no compression, said once in the log.
    """
    check_setting(setting)
    if setting == "none" or (setting == "auto" and local):
        return "none"
    have = available()
    wanted = CODECS if setting == "auto" else (setting,)
    for codec in wanted:
        if codec in offered and codec in have:
            if setting == "auto":
                _once(
                    "auto",
                    logging.INFO,
                    "compression='auto': %s is not on this host, so arrays of %d bytes or "
                    "more travel %s-compressed (pass compression='none' to turn it off)",
                    peer,
                    THRESHOLD,
                    codec,
                )
            return codec
    if setting != "auto" and setting not in have:
        _missing(setting, "learner")
    else:
        _once(
            f"not offered {setting}",
            logging.INFO,
            "the worker at %s offers no codec of compression=%r (it offers %s: it lacks the "
            "library or was started with --compression none); its arrays travel uncompressed",
            peer,
            setting,
            list(offered) or "none",
        )
    return "none"


def choose_frame_delta(
    setting: str, offered: Sequence[str], *, local: bool, enabled: bool = True
) -> bool:
    """Whether a learner started with ``setting`` takes frame delta from one worker.

    Frame delta (:mod:`aps.wire.frame_delta`): the worker's chunks send frame stacks as their
    newest frames. Yes when the learner's ``frame_delta`` is ``enabled``, the worker offered
    it, and the learner's setting compresses for this worker: not ``"none"``, and for
    ``"auto"`` a worker that is not on this host. Whether a codec library is at hand does
    not matter: frame delta needs none.
    """
    check_setting(setting)
    if not enabled or FRAME_DELTA not in offered:
        return False
    return setting != "none" and not (setting == "auto" and local)


def accepted(codec: str, frame_delta: bool) -> str:
    """What a Welcome's ``compression`` says: the codec, then ``,frame-delta`` if chosen."""
    return f"{codec},{FRAME_DELTA}" if frame_delta else codec


def parse_accepted(value: str, offered: Sequence[str], *, peer: str) -> tuple[str, bool]:
    """The codec and frame delta a learner's Welcome chose, checked against ``offered``.

    Raises:
        ProtocolError: the learner chose something this worker did not offer, or wrote
            something that is not a choice.
    """
    codec, *rest = value.split(",")
    frame_delta = rest == [FRAME_DELTA]
    if (
        (rest and not frame_delta)
        or (codec != "none" and codec not in offered)
        or codec == FRAME_DELTA
        or (frame_delta and FRAME_DELTA not in offered)
    ):
        raise ProtocolError(
            f"the learner at {peer} chose compression {value!r}, which this worker did not "
            f"offer (it offered {list(offered) or 'none'}); the learner is not a compatible "
            "aps learner"
        )
    return codec, frame_delta


# --------------------------------------------------------------------------------------------
# Compressing

# zstandard's contexts are not safe to share between threads (the codec is): one per thread,
# made on first use and reused, since making one costs far more than compressing a frame.
_local = threading.local()


def _zstd_compress(data: Any, level: int) -> bytes:
    contexts: dict[int, Any] | None = getattr(_local, "zstd", None)
    if contexts is None:
        contexts = _local.zstd = {}
    context = contexts.get(level)
    if context is None:
        import zstandard

        # The content size in the frame header is what the receiver checks before inflating.
        context = contexts[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    result: bytes = context.compress(data)
    return result


def _lz4_compress(data: Any, level: int) -> bytes:
    import lz4.block

    mode = "high_compression" if level > 0 else "default"
    result: bytes = lz4.block.compress(data, mode=mode, compression=level, store_size=False)
    return result


_COMPRESS: dict[str, Callable[[Any, int], bytes]] = {"zstd": _zstd_compress, "lz4": _lz4_compress}


@dataclass(frozen=True, slots=True)
class Compressor:
    """How one connection compresses the arrays it sends.

    Attributes:
        name: the codec, one of :data:`CODECS`.
        level: the codec's level (see :data:`LEVELS`).
        threshold: arrays of fewer bytes travel plain.
    """

    name: str
    level: int
    threshold: int = THRESHOLD
    saved: list[int] | None = field(default=None, compare=False)
    """A one-item counter of the bytes compression saved, for a connection's figures: each
    array packed adds its size less its payload's (``None``: not counted). Give each
    connection its own: ``dataclasses.replace(compressor(name), saved=[0])``."""

    def compress(self, data: Any) -> bytes:
        """The compressed bytes of ``data`` (any C-contiguous buffer), as this codec writes."""
        return _COMPRESS[self.name](data, self.level)

    def pack(self, array: np.ndarray[Any, Any]) -> msgpack.ExtType | None:
        """``array`` as an :data:`EXT_COMPRESSED` extension, or ``None`` to send it plain.

        ``None`` when the array is smaller than :attr:`threshold`, holds objects, or does
        not shrink to :data:`MAX_RATIO` of its size.

        Raises:
            WireError: the array's dtype cannot travel.
        """
        if array.nbytes < self.threshold or array.dtype.hasobject:
            return None
        name = WIRE_NAME.get(array.dtype)
        if name is None:
            little = SWAPPED.get(array.dtype.str)
            if little is None:
                raise dtype_error(array.dtype)
            array = array.astype(little)
            name = little.str
        data = np.ascontiguousarray(array)
        packed = self.compress(data.reshape(-1).view(np.uint8))
        if len(packed) > MAX_RATIO * array.nbytes:
            return None
        head = bytes([CODEC_IDS[self.name]]) + unpadded_header(name, array.shape)
        if self.saved is not None:
            self.saved[0] += array.nbytes - len(head) - len(packed)
        ext: msgpack.ExtType = tuple.__new__(msgpack.ExtType, (EXT_COMPRESSED, head + packed))
        return ext


_COMPRESSORS = {name: Compressor(name, LEVELS[name]) for name in CODECS}


def compressor(name: str) -> Compressor | None:
    """The compressor of a negotiated codec name (``"none"``: ``None``).

    Raises:
        ConfigError: ``name`` is neither a codec nor ``"none"``.
    """
    if name == "none":
        return None
    found = _COMPRESSORS.get(name)
    if found is None:
        raise ConfigError(
            f"unknown codec {name!r}; known: {', '.join(CODECS)} (or 'none' for no compression)"
        )
    return found


# --------------------------------------------------------------------------------------------
# Inflating, bounded


def _zstd_inflate(data: memoryview, size: int) -> bytes:
    import zstandard

    # The frame's own content size decides what zstandard allocates (max_output_size does
    # not bound a frame that declares one): check it against the array's before inflating.
    try:
        declared = zstandard.frame_content_size(data)
    except zstandard.ZstdError as exc:
        raise WireError(f"compressed array is not a zstd frame: {exc}") from exc
    if declared != size:
        raise WireError(
            f"compressed array's zstd frame declares {declared} bytes but its header "
            f"{size}; the peer's compressor is broken or lying"
        )
    contexts: dict[int, Any] | None = getattr(_local, "unzstd", None)
    if contexts is None:
        contexts = _local.unzstd = {}
    context = contexts.get(0)
    if context is None:
        context = contexts[0] = zstandard.ZstdDecompressor()
    try:
        result: bytes = context.decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise WireError(f"compressed array does not inflate with zstd: {exc}") from exc
    return result


def _lz4_inflate(data: memoryview, size: int) -> bytes:
    import lz4.block

    try:
        # The output buffer is exactly the declared size: the block cannot write past it.
        result: bytes = lz4.block.decompress(data, uncompressed_size=size)
    except lz4.block.LZ4BlockError as exc:
        raise WireError(
            f"compressed array does not inflate with lz4 to its {size} bytes: {exc}"
        ) from exc
    return result


_INFLATE: dict[str, Callable[[memoryview, int], bytes]] = {
    "zstd": _zstd_inflate,
    "lz4": _lz4_inflate,
}


def inflater(name: str, budget: int | Allowance) -> Callable[[bytes], np.ndarray[Any, Any]]:
    """A function that turns :data:`EXT_COMPRESSED` payloads of one frame into arrays.

    Args:
        name: the codec the connection negotiated (``"none"``: every compressed array is
            refused).
        budget: the most bytes the arrays of one frame may inflate to, together: the
            receiving side's frame limit, or the :class:`~aps.wire._wire.Allowance` the frame's
            other arrays (:mod:`aps.wire.frame_delta`) are charged to as well.

    The function refuses, with :class:`~aps.errors.WireError`, a payload that is malformed,
    names a codec other than ``name``, declares more bytes than are left of ``budget``
    (before anything is allocated), or does not inflate to exactly the declared size. The
    arrays it returns are read-only.
    """
    allowance = budget if isinstance(budget, Allowance) else Allowance(budget)
    inflate = _INFLATE.get(name)

    def unpack(payload: bytes) -> np.ndarray[Any, Any]:
        if not payload:
            raise WireError("compressed array payload is empty")
        code = payload[0]
        if inflate is None or code != CODEC_IDS[name]:
            used = _NAMES.get(code, f"unknown codec id {code}")
            raise WireError(
                f"array compressed with {used}, which this connection did not negotiate "
                f"(negotiated: {name}); the peer is not a compatible aps peer"
            )
        # The header is parsed from a bounded copy: a few hundred bytes at most.
        dtype, shape, end, nbytes = parse_payload(payload[1 : 1 + LONGEST_HEADER])
        allowance.take(nbytes, f"compressed array ({dtype}, shape {shape})")
        with memoryview(payload) as view:
            raw = inflate(view[1 + end :], nbytes)
        if len(raw) != nbytes:
            raise WireError(
                f"compressed array inflates to {len(raw)} bytes, not the {nbytes} its "
                f"header declares ({dtype}, shape {shape})"
            )
        allowance.expanded += nbytes - len(payload)
        try:
            # A view of the inflated bytes: read-only, like every decoded array.
            return np.ndarray(shape, dtype, raw, 0)
        except ValueError as exc:  # zero-size arrays with absurd dims pass the length check
            raise WireError(f"array of shape {shape} cannot be built: {exc}") from exc

    return unpack
