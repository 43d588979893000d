"""Type aliases shared across aps."""

from __future__ import annotations

from typing import Any

import numpy.typing as npt

__all__ = ["Array", "ArrayTree", "Frame", "Info"]

Array = npt.NDArray[Any]
"""A numpy array of any dtype."""

ArrayTree = Array | dict[str, Any] | tuple[Any, ...]
"""A numpy array, or a dict (``str`` keys) or tuple of array trees: a batch of a ``Dict`` or
``Tuple`` observation space (nested) holds its arrays so, in the space's structure."""

Frame = bytes | bytearray | memoryview
"""What a transport accepts to send; it always receives ``bytes``."""

Info = dict[str, Any]
"""A Gymnasium info dict (batched: values are arrays with ``_key`` masks)."""
