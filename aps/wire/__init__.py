"""The wire: what a message is and how it becomes bytes, with no I/O.

:mod:`~aps.wire.messages` (the message types), :mod:`~aps.wire.codec` (encoding and
decoding, bounded by the frame), with its parts :mod:`~aps.wire._wire`,
:mod:`~aps.wire._fast_pack` and :mod:`~aps.wire._unpack`; :mod:`~aps.wire.compression` and
:mod:`~aps.wire.frame_delta` (what a connection negotiates), :mod:`~aps.wire.spaces` and
:mod:`~aps.wire.batching` (spaces and batches as data), and :mod:`~aps.wire.framing` (frame
boundaries on a byte stream, the one part the transports use).
"""
