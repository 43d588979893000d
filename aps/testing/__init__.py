"""Public test helpers: the transport conformance suite and a link that fails on demand.

Importing this package does not import pytest; see :mod:`aps.testing.conformance`.
"""

from __future__ import annotations

from aps.testing.chaos import Relay, until
from aps.testing.conformance import (
    CHECK_TIMEOUT,
    TRANSPORT_CHECKS,
    PairMaker,
    TransportCheck,
    check_aclose_wakes_receive,
    check_buffer_types,
    check_cancelled_receive,
    check_cancelled_send,
    check_concurrent_receive,
    check_concurrent_senders,
    check_duplex,
    check_factory,
    check_frame_size_limit,
    check_local_close,
    check_many_frames,
    check_only_transport_errors,
    check_peer_close,
    check_round_trip,
    check_transport,
    pair_from_factory,
)

__all__ = [
    "CHECK_TIMEOUT",
    "Relay",
    "until",
    "TRANSPORT_CHECKS",
    "PairMaker",
    "TransportCheck",
    "check_aclose_wakes_receive",
    "check_buffer_types",
    "check_cancelled_receive",
    "check_cancelled_send",
    "check_concurrent_receive",
    "check_concurrent_senders",
    "check_duplex",
    "check_factory",
    "check_frame_size_limit",
    "check_local_close",
    "check_many_frames",
    "check_only_transport_errors",
    "check_peer_close",
    "check_round_trip",
    "check_transport",
    "pair_from_factory",
]
