"""The all-reduce aggregation of gradient rounds (``aggregation="allreduce"``).

:func:`allreduce_sum` and :class:`RoundStore`: one gloo all-reduce (``torch.distributed``)
over the learner and the workers, rendezvoused at a store the learner opens for one round.
The worker's gradient sampling lives with the other policy-gradient parts, in
:mod:`aps.worker.sampling`.
"""

from __future__ import annotations

import datetime
import secrets
import socket
from typing import Any

import numpy as np

from aps.errors import MissingDependency

__all__ = ["RoundStore", "allreduce_sum", "ring_allreduce_bytes", "route_to"]


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
    group = gloo(dist.PrefixStore(prefix, store), rank, world_size, options)
    try:
        tensor = torch.from_numpy(np.array(vector, copy=True))
        group.allreduce([tensor]).wait()
        return tensor.numpy()
    finally:
        group.shutdown()
