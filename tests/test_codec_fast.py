"""The codec's fast paths for small messages: byte-identical frames, identical decoding."""

from __future__ import annotations

import gc

import numpy as np

from aps import codec
from aps.messages import ResetRequest


def test_the_generic_encoder_leaves_no_cyclic_garbage() -> None:
    # A dict value takes the generic path, whose Packer calls back into Python for the
    # numpy scalar; the packer and its default() must not keep each other alive.
    message = ResetRequest(seed=1, options={"a": (1, np.float32(2.0))})
    codec.encode(message)
    enabled = gc.isenabled()
    gc.disable()
    try:
        gc.collect()
        for _ in range(3):
            codec.encode(message)
        assert gc.collect() == 0
    finally:
        if enabled:
            gc.enable()
