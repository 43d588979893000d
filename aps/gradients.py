"""Gloo groups over aps's sessions: gradient rounds' all-reduce and the weight group's fan-out.

:class:`RoundStore` is the rendezvous the learner hosts; :func:`join_group` builds one gloo
group (``torch.distributed``) through it. :func:`allreduce_sum` is the all-reduce aggregation
of gradient rounds (``aggregation="allreduce"``, one group per round); :func:`spread` is one
version's fan-out in the weight group (:mod:`aps.fanout`). The worker's gradient sampling
lives with the other policy-gradient parts, in :mod:`aps.worker.sampling`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime
import functools
import secrets
import socket
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from aps.errors import MissingDependency

T = TypeVar("T")

__all__ = [
    "RoundStore",
    "allreduce_sum",
    "in_own_thread",
    "join_group",
    "ring_allreduce_bytes",
    "route_to",
    "spread",
    "spread_buffer",
    "spread_bytes",
]


# -- all-reduce aggregation ------------------------------------------------------------------


def ring_allreduce_bytes(vector_bytes: int, ranks: int) -> int:
    """Payload bytes one rank sends in a ring all-reduce of ``vector_bytes`` over ``ranks``.

    A ring all-reduce (reduce-scatter, then all-gather) sends ``2 (k - 1) / k`` of the vector
    per rank. This is the model's figure, computed, not measured on the wire: gloo may pick
    another algorithm for some sizes, and framing and its own handshake are not counted.
    """
    if ranks <= 1:
        return 0
    return (2 * (ranks - 1) * vector_bytes + ranks - 1) // ranks


async def in_own_thread(function: Callable[..., T], /, **kwargs: Any) -> T:
    """``function(**kwargs)`` in a thread of its own, awaited: for a blocking collective.

    Not the event loop's shared pool (``asyncio.to_thread``): a collective blocks its thread
    until every rank has joined, so a process of more workers than that pool has threads
    (``min(32, cpus + 4)``) would wait forever for its last ranks, until gloo's timeout.
    """
    thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="aps-collective")
    try:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(thread, functools.partial(function, **kwargs))
    finally:
        thread.shutdown(wait=False)


def route_to(host: str) -> str:
    """The local address this machine uses to reach ``host`` (no packet is sent)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))
            address: str = probe.getsockname()[0]
            return address
    except OSError:
        return host


def _dist() -> Any:
    try:
        import torch.distributed as dist
    except ImportError as exc:  # pragma: no cover - aps.pg's users have installed torch
        raise MissingDependency(
            "aggregation='allreduce' needs torch with torch.distributed, which is not installed; "
            "pip install torch (aps-rl has no torch extra) or use aggregation='server'"
        ) from exc
    if not dist.is_available() or not dist.is_gloo_available():
        raise MissingDependency(
            "aggregation='allreduce' needs torch.distributed with the gloo backend, which "
            "this torch build lacks; use aggregation='server'"
        )
    return dist


class RoundStore:
    """The rendezvous of one all-reduce: a ``torch.distributed.TCPStore`` the learner hosts.

    It listens on ``host`` only (port chosen by the system) for as long as the round's
    all-reduce runs; :meth:`close` ends it. Keys live under :attr:`prefix`, a fresh random
    string sent to the workers over their authenticated sessions only.

    Security: neither the store nor gloo's connections are authenticated or encrypted. The
    prefix keeps a stranger who finds the port from joining the group by accident, not an
    attacker on the network; use the all-reduce only on a network you trust (the server
    aggregation travels over aps's own, token-proven and optionally TLS, sessions).
    """

    def __init__(self, host: str, world_size: int, timeout: float) -> None:
        dist = _dist()
        self.host = host
        self.prefix = f"aps-{secrets.token_hex(16)}/"
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.bind((host, 0))
            listener.listen(world_size)
            self.port: int = listener.getsockname()[1]
            # The store takes the bound socket (and closes it): it listens on host only.
            self.store: Any = dist.TCPStore(
                host,
                self.port,
                world_size,
                True,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=False,
                master_listen_fd=listener.fileno(),
                use_libuv=False,
            )
        except BaseException:
            listener.close()
            raise
        listener.detach()

    def close(self) -> None:
        """Stop listening: the store's server ends with its last reference."""
        self.store = None


def allreduce_sum(
    vector: np.ndarray[Any, Any],
    *,
    host: str,
    port: int,
    prefix: str,
    rank: int,
    world_size: int,
    timeout: float,
    store: Any = None,
    bind: str | None = None,
) -> np.ndarray[Any, Any]:
    """Sum ``vector`` over the group by one gloo all-reduce; blocking (run it in a thread).

    Joins the group through the store at ``host:port`` (or ``store``, the learner's own),
    runs one ``allreduce`` (sum) over a copy of ``vector``, shuts the group down and returns
    the sum. Nothing global is set: the process group is built directly, not through
    ``init_process_group``, so several rounds (and several learners in one process) never
    clash.

    Args:
        vector: a 1-d float32 or float64 array; every rank gives the same length and dtype.
        host: the store's host (the learner's address).
        port: the store's port.
        prefix: the round's key prefix.
        rank: 0 for the learner, 1.. for the workers.
        world_size: the ranks in all (the workers and the learner).
        timeout: seconds the rendezvous and the all-reduce may take.
        store: the store object itself on the learner (rank 0).
        bind: the local address gloo listens on (default: the route to ``host``; a wildcard
            address: the address this machine's hostname resolves to).

    Raises:
        RuntimeError: gloo failed (a rank did not join in time, a connection dropped).
    """
    import torch

    group = join_group(
        host=host,
        port=port,
        prefix=prefix,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
        store=store,
        bind=bind,
    )
    try:
        tensor = torch.from_numpy(np.array(vector, copy=True))
        group.allreduce([tensor]).wait()
        return tensor.numpy()
    finally:
        group.shutdown()


def join_group(
    *,
    host: str,
    port: int,
    prefix: str,
    rank: int,
    world_size: int,
    timeout: float,
    store: Any = None,
    bind: str | None = None,
) -> Any:
    """Build a gloo process group through the store at ``host:port``; blocking.

    Nothing global is set: the group is built directly, not through ``init_process_group``,
    so several groups (and several learners in one process) never clash. It returns once all
    ``world_size`` ranks have joined, within ``timeout`` seconds, which also bounds each of the
    group's collectives. The caller calls its ``shutdown()``. Arguments as
    :func:`allreduce_sum`'s.

    Raises:
        RuntimeError: gloo failed (a rank did not join in time).
    """
    dist = _dist()
    delta = datetime.timedelta(seconds=timeout)
    if store is None:
        store = dist.TCPStore(host, port, world_size, False, timeout=delta, use_libuv=False)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = delta
    gloo = dist.ProcessGroupGloo
    if bind in ("0.0.0.0", "::"):
        options._devices = [gloo.create_default_device()]
    else:
        options._devices = [gloo.create_device(hostname=bind or route_to(host))]
    return gloo(dist.PrefixStore(prefix, store), rank, world_size, options)


def spread_bytes(nbytes: int, ranks: int) -> int:
    """Payload bytes the root sends in :func:`spread` of ``nbytes`` over ``ranks`` ranks.

    The root scatters ``ranks - 1`` pieces of ``ceil(nbytes / ranks)`` bytes, then sends its
    own piece to the others in the all-gather: at most twice the payload, however many
    ranks (a ring all-gather sends each rank's piece once; a direct one ``ranks - 1`` times,
    from the root only its own piece). The model's figure, not measured on the wire.
    """
    if ranks <= 1:
        return 0
    piece = -(-nbytes // ranks)
    return 2 * (ranks - 1) * piece


def spread_buffer(nbytes: int, world_size: int) -> Any:
    """A zeroed uint8 tensor that holds ``nbytes`` and splits into ``world_size`` equal pieces."""
    import torch

    return torch.zeros(-(-nbytes // world_size) * world_size, dtype=torch.uint8)


def spread(group: Any, rank: int, world_size: int, buffer: Any) -> None:
    """Fan ``buffer`` (from :func:`spread_buffer`; filled on rank 0) out to every rank; blocking.

    One scatter from rank 0 and one all-gather (van de Geijn's broadcast): the root sends
    each other rank one piece, then every rank gathers the pieces of all, so the root's bytes
    stay under twice the payload however many ranks there are, where a tree broadcast's
    root sends ``log2(ranks)`` copies. Every rank passes a buffer of the same length (the
    others' contents are ignored) and holds rank 0's in it afterwards.
    """
    import torch

    piece = buffer.numel() // world_size
    pieces = [buffer[i * piece : (i + 1) * piece] for i in range(world_size)]
    mine = torch.empty(piece, dtype=torch.uint8)
    group.scatter([mine], [pieces] if rank == 0 else [], _scatter_options()).wait()
    group.allgather([pieces], [mine]).wait()


def _scatter_options() -> Any:
    options = _dist().ScatterOptions()
    options.rootRank = 0
    return options
