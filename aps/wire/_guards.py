"""What a frame is refused for before it is decoded, and the cheap looks that decide it.

The tag a frame's map starts with, whether a small frame can hold an extension at all, the
ext hook that inflates and rebuilds only where the message type may hold such arrays, and
the bound on a ``Ready``'s envs against the frame limit (see
``docs/security.md``). Part of :mod:`aps.wire.codec`, which assembles them; nothing here
imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from aps._base._typing import Frame
from aps.errors import WireError
from aps.wire import frame_delta as frame_delta_
from aps.wire._unpack import make_ext_hook
from aps.wire._wire import MAX_OBJECT_DEPTH, Allowance
from aps.wire.compression import EXT_COMPRESSED, inflater
from aps.wire.frame_delta import EXT_FRAME_DELTA
from aps.wire.spaces import sample_nbytes

NO_ARRAYS, PLAIN_ARRAYS, ANY_ARRAYS = 0, 1, 2
"""What the fields of a message type may hold: no numpy value at all; plain arrays only (a
space description, whose Box bounds travel uncompressed so that a space costs what its frame
costs); or any."""

SMALL_FRAME = 4096
COMPRESSED_CODE = bytes([EXT_COMPRESSED])
FRAME_DELTA_CODE = bytes([EXT_FRAME_DELTA])


def may_hold(code: bytes, frame: Frame, size: int) -> bool:
    """Whether ``frame`` may hold an ext of ``code``: ``False`` only if it cannot."""
    if size > SMALL_FRAME:
        return True  # scanning a large frame costs more than the hook
    data = frame if type(frame) is bytes or type(frame) is bytearray else bytes(frame)
    return code in data


def peek_tag(frame: Frame) -> str | None:
    """The tag of ``frame``'s message when its map starts with it, as :func:`encode` writes."""
    head = frame[:40]  # a map header, "t", and a tag of at most 32 bytes
    if type(head) is not bytes:
        head = bytes(head)
    if not head:
        return None
    first = head[0]
    at = 1 if 0x81 <= first <= 0x8F else 3 if first == 0xDE else 0
    if not at or head[at : at + 2] != b"\xa1t" or len(head) <= at + 2:
        return None
    kind = head[at + 2]
    if not 0xA0 <= kind <= 0xBF:
        return None  # every tag is a fixstr
    start = at + 3
    tag = head[start : start + (kind & 0x1F)]
    return tag.decode("ascii", "replace") if len(tag) == kind & 0x1F else None


def refuse(problem: Callable[[], str]) -> Callable[[bytes], Any]:
    """An ext payload handler that refuses every payload; the message is made on refusal."""

    def refuse(payload: bytes) -> Any:
        raise WireError(problem())

    return refuse


STEP_BYTES = 10
"""What a step answer carries per env besides its observation: reward, terminated, truncated."""


def check_ready(body: dict[str, Any], max_frame_size: int) -> None:
    """Refuse a Ready whose envs could never step within ``max_frame_size``.

    Runs on the wire description, before the spaces are built: what the learner builds
    per env (batched spaces, step buffers) is then bounded by the frame limit it set.
    """
    num_envs = body.get("num_envs")
    if type(num_envs) is not int:
        return  # _message names the wrong type (and the pool refuses fewer than 1 env)
    for name in ("observation", "action"):
        # At least a step's reward and flags (8 + 1 + 1 bytes) travel per env, whatever the
        # spaces: an empty Dict or a zero-size Box bounds nothing by itself.
        per_env = max(sample_nbytes(body.get(f"{name}_space")), STEP_BYTES)
        if num_envs * per_env > max_frame_size:
            raise WireError(
                f"ready message declares {num_envs} envs of {per_env} {name} bytes each "
                f"({num_envs * per_env} bytes a step), more than this side's max_frame_size "
                f"of {max_frame_size} bytes: a step's {name}s could never travel; run fewer "
                "envs per worker, or raise max_frame_size on both sides"
            )


def inflating_hook(
    tag: str | None,
    arrays: int,
    delta: bool,
    delta_fields: Callable[[], str],
    compression: str,
    frame_delta: bool,
    allowance: Allowance,
    pending: list[frame_delta_.Pending],
) -> Callable[[int, bytes], Any]:
    """The ext hook of a frame whose message has ``tag`` (``None``: unknown, or not first).

    ``arrays`` is what the type's fields may hold (:data:`NO_ARRAYS`, :data:`PLAIN_ARRAYS`,
    :data:`ANY_ARRAYS`; -1: no known type), ``delta`` whether a field of it may hold a
    frame-delta array, ``delta_fields`` the words that say which may. Compressed arrays are
    inflated, and frame-delta arrays made placeholders (appended to ``pending``), only where
    the message type's fields may hold them: refused anywhere else before any work is done.
    """
    if arrays == NO_ARRAYS:

        def refuse_all(code: int, data: bytes) -> Any:
            raise WireError(
                f"{tag} message holds a msgpack extension (code {code}), but none of its "
                "fields holds arrays; the peer is not a compatible aps peer"
            )

        return refuse_all
    inflate: Callable[[bytes], Any] | None = None

    def where() -> str:  # called only where a frame is refused: most frames never are
        return f"a {tag} message" if arrays >= 0 else "a frame that does not start with its tag"

    if compression != "none":
        if arrays == ANY_ARRAYS:
            inflate = inflater(compression, allowance)
        else:
            inflate = refuse(
                lambda: (
                    f"compressed array in {where()}; "
                    + (
                        "a space description's arrays travel uncompressed"
                        if arrays == PLAIN_ARRAYS
                        else "an aps peer writes the tag first"
                    )
                    + ": the peer is not a compatible aps peer"
                )
            )
    rebuild: Callable[[bytes], Any] | None = None
    if frame_delta:
        if delta:
            unpack = frame_delta_.unpacker(allowance, make_ext_hook(MAX_OBJECT_DEPTH, inflate))

            def rebuild(payload: bytes) -> frame_delta_.Pending:
                placeholder = unpack(payload)
                pending.append(placeholder)  # where it may appear is checked once decoded
                return placeholder

        else:
            rebuild = refuse(lambda: f"frame-delta array in {where()}; only {delta_fields()}")
    return make_ext_hook(0, inflate, rebuild)
