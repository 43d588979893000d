"""Type aliases shared across aps."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

__all__ = ["Array", "Frame", "Info"]

Array = npt.NDArray[Any]
"""A numpy array of any dtype."""

Frame = bytes | bytearray | memoryview
"""What a transport accepts to send; it always receives ``bytes``."""

Info = dict[str, Any]
"""A Gymnasium info dict (batched: values are arrays with ``_key`` masks)."""
