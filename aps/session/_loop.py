"""Event loops: uvloop when it is installed, unless the user opts out."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["new_event_loop", "run"]

T = TypeVar("T")


def _want_uvloop(use_uvloop: bool | None) -> bool:
    if use_uvloop is None:
        # APS_UVLOOP=0 opts out without touching code (for debugging or comparisons).
        return os.environ.get("APS_UVLOOP", "1") not in ("0", "false", "no")
    return use_uvloop


def new_event_loop(use_uvloop: bool | None = None) -> asyncio.AbstractEventLoop:
    """Return a new event loop: uvloop's if installed and wanted, else asyncio's.

    Args:
        use_uvloop: ``True`` or ``False`` to decide; ``None`` uses uvloop when it is
            installed and the ``APS_UVLOOP`` environment variable is not ``0``.
    """
    if _want_uvloop(use_uvloop):
        try:
            import uvloop
        except ImportError:
            pass
        else:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool | None = None) -> T:
    """Run ``main`` to completion on a new loop chosen by :func:`new_event_loop`."""
    with asyncio.Runner(loop_factory=lambda: new_event_loop(use_uvloop)) as runner:
        return runner.run(main)
