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

This is a CPython detail, reached through :mod:`ctypes`. Where it is unavailable (another
interpreter, a build without ``ctypes``), :func:`allocate` returns a ``bytearray`` and
:func:`seal` copies it into ``bytes``: correct, one copy slower.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["allocate", "seal"]


def _fillable_bytes() -> Any:
    """Return ``new(size) -> (bytes, memoryview)`` if this interpreter allows it, else None."""
    if sys.implementation.name != "cpython":
        return None
    try:
        import ctypes
    except ImportError:
        return None
    create = ctypes.pythonapi.PyBytes_FromStringAndSize
    create.restype = ctypes.py_object
    create.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
    # The characters of a bytes object start where its fixed part ends, less the one byte
    # reserved for the trailing NUL (PyBytesObject_SIZE is offsetof(ob_sval) + 1).
    offset = bytes.__basicsize__ - 1

    def new(size: int) -> tuple[bytes, memoryview]:
        data: bytes = create(None, size)
        address = id(data) + offset  # in CPython, id() is the object's address
        view = memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B")
        return data, view

    # Prove the layout once before trusting it: a mismatch falls back to bytearray.
    probe, view = new(16)
    view[:] = bytes(range(16))
    view.release()
    if probe != bytes(range(16)):
        return None
    return new


_new = _fillable_bytes()


def allocate(size: int) -> tuple[bytes | bytearray, memoryview]:
    """Return a new buffer of ``size`` bytes (``size`` >= 1) and a writable view of it.

    Contract: the caller writes every byte through the view, stops using the view, and only
    then passes the buffer through :func:`seal`. Until then the buffer (a ``bytes`` object
    whose contents are still being written) must not be hashed, compared or shared.
    """
    if _new is not None and size > 0:
        data, view = _new(size)
        return data, view
    buffer = bytearray(size)
    return buffer, memoryview(buffer)


def seal(buffer: bytes | bytearray) -> bytes:
    """Return a buffer from :func:`allocate`, completely filled, as ``bytes``."""
    if type(buffer) is bytes:
        return buffer
    return bytes(buffer)
