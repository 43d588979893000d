"""Large ``bytes`` objects filled in place: one allocation and no extra copy per frame.

Frames are ``bytes`` wherever they travel (transports return them, decoded arrays are views
of them), and large ones are expensive to produce the obvious way: reading into a
``bytearray`` and converting copies every byte a second time, into memory the process has
never touched. First-touch memory costs a page fault per 4 KiB page, which on some virtual
machines makes it several times slower to write than memory already in use.

:func:`allocate` therefore does what CPython's own readers (``socket.recv``, ``os.read``) do
in C: it creates an uninitialised ``bytes`` object and hands out a writable view of its
contents, to be filled before anyone else sees the object.

(Advising transparent huge pages for these buffers, as numpy does for its arrays, was tried
and dropped: on virtual machines that hand free memory back to the host, a fresh huge page
can cost more than the 4 KiB faults it saves; a 40 MB frame took 100 ms instead of 27 ms.)

Large buffers are also reused. A publish sends a weights frame of the same size every
time, and a worker receives one: allocating each afresh pays the first-touch cost on every
frame (a 40 MB copy into fresh memory took 25 ms here, into memory in use 3 ms). So
:func:`allocate` keeps the last few buffers of at least :data:`REUSE_MIN` bytes (at most
:data:`REUSE_SLOTS` of them and :data:`REUSE_MAX_BYTES` together, so a process holds at
most that much it would otherwise have freed). It hands one out again once nothing else
refers to it: its reference count shows that only the pool holds it, so no frame, decoded
array or transport write buffer can see it change. A reused ``bytes`` also has its cached
hash cleared.

This is a CPython detail, reached through :mod:`ctypes`. Where it is unavailable (another
interpreter, a build without ``ctypes``), :func:`allocate` returns a ``bytearray`` and
:func:`seal` copies it into ``bytes``: correct, one copy slower, and nothing is reused.
Nothing is reused either where reference counts cannot be trusted for this (a free-threaded
build, or an interpreter whose counts do not behave as a probe at import expects).
"""

from __future__ import annotations

import sys
import threading
from typing import Any

__all__ = ["REUSE_MAX_BYTES", "REUSE_MIN", "REUSE_SLOTS", "allocate", "seal"]

REUSE_MIN = 1 << 20
"""Buffers of at least this many bytes are kept for reuse."""
REUSE_SLOTS = 4
"""How many such buffers are kept (the oldest is let go first)."""
REUSE_MAX_BYTES = 256 << 20
"""The most bytes the kept buffers hold together; a larger buffer is never kept."""


class _Fillable:
    """Uninitialised ``bytes`` and writable views of their contents, in CPython."""

    def __init__(self, ctypes: Any) -> None:
        self._ctypes = ctypes
        self._create = create = ctypes.pythonapi.PyBytes_FromStringAndSize
        create.restype = ctypes.py_object
        create.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
        # The characters of a bytes object start where its fixed part ends, less the one
        # byte reserved for the trailing NUL (PyBytesObject_SIZE is offsetof(ob_sval) + 1);
        # the cached hash (ob_shash, -1 while not computed) is the word before them.
        self._chars = bytes.__basicsize__ - 1
        self._hash = self._chars - ctypes.sizeof(ctypes.c_ssize_t)

    def new(self, size: int) -> tuple[bytes, memoryview]:
        data: bytes = self._create(None, size)
        return data, self.view(data)

    def view(self, data: bytes) -> memoryview:
        address = id(data) + self._chars  # in CPython, id() is the object's address
        return memoryview((self._ctypes.c_ubyte * len(data)).from_address(address)).cast("B")

    def forget_hash(self, data: bytes) -> None:
        self._cached_hash(data).value = -1

    def _cached_hash(self, data: bytes) -> Any:
        return self._ctypes.c_ssize_t.from_address(id(data) + self._hash)

    def works(self) -> bool:
        """Prove the layout on a probe before trusting it."""
        probe, view = self.new(16)
        view[:] = bytes(range(16))
        view.release()
        if probe != bytes(range(16)) or self._cached_hash(probe).value != -1:
            return False
        expected = hash(probe)
        if self._cached_hash(probe).value != expected:
            return False
        self.forget_hash(probe)
        return hash(probe) == expected and self._cached_hash(probe).value == expected


def _fillable() -> _Fillable | None:
    if sys.implementation.name != "cpython":
        return None
    try:
        import ctypes
    except ImportError:
        return None
    fillable = _Fillable(ctypes)
    return fillable if fillable.works() else None


def _counts_references() -> bool:
    """Whether ``sys.getrefcount`` tells when only the pool holds a buffer, proven on a probe.

    Not on free-threaded builds, where other threads change counts without the GIL.
    """
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return False
    kept = [bytes(range(16))]
    alone = sys.getrefcount(kept[0])
    holder = kept[0]
    shared = sys.getrefcount(kept[0])
    del holder
    return alone == 2 and shared == 3


_FILLABLE = _fillable()
_REUSE = _FILLABLE is not None and _counts_references()
_lock = threading.Lock()
_kept: list[bytes] = []  # buffers of REUSE_MIN bytes or more, the newest last


def allocate(size: int) -> tuple[bytes | bytearray, memoryview]:
    """Return a buffer of ``size`` bytes (``size`` >= 1) and a writable view of it.

    The buffer is new, or a kept one that nothing else refers to any more; either way its
    contents are undefined.

    Contract: the caller writes every byte through the view, stops using the view, and only
    then passes the buffer through :func:`seal`. Until then the buffer (a ``bytes`` object
    whose contents are still being written) must not be hashed, compared or shared.
    """
    fillable = _FILLABLE
    if fillable is None or size <= 0:
        buffer = bytearray(size)
        return buffer, memoryview(buffer)
    if size < REUSE_MIN or not _REUSE:
        return fillable.new(size)
    with _lock:  # finding a free buffer and taking it must be one step
        for index in range(len(_kept)):
            # Two references, the list's and getrefcount's argument: anything more is a
            # frame, a decoded array or a transport's write buffer still using it.
            if len(_kept[index]) == size and sys.getrefcount(_kept[index]) == 2:
                data = _kept.pop(index)
                _kept.append(data)
                fillable.forget_hash(data)
                return data, fillable.view(data)
        data, view = fillable.new(size)
        if size <= REUSE_MAX_BYTES:
            _kept.append(data)
            del _kept[:-REUSE_SLOTS]
            while sum(len(kept) for kept in _kept) > REUSE_MAX_BYTES:
                del _kept[0]
        return data, view


def seal(buffer: bytes | bytearray) -> bytes:
    """Return a buffer from :func:`allocate`, completely filled, as ``bytes``."""
    if type(buffer) is bytes:
        return buffer
    return bytes(buffer)
