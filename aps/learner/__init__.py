"""The learner role: accept workers and step all their envs as one batch.

A :class:`Learner` listens on one URL, admits ``num_workers`` workers (handshake, token proof,
spaces that agree), and then exposes their envs in one stable order (worker registration
order, then env index) through :meth:`Learner.reset` and :meth:`Learner.step`. Each call sends
one message per worker, never one per env, and stitches the replies with array operations.

A bad peer (malformed frames, a wrong token, the wrong protocol version, disagreeing spaces,
a slow handshake) is refused with a specific error, logged and closed; the learner keeps
serving everyone else.

A worker that is lost (its process died, its connection dropped or it went silent past a
deadline) is handled as ``on_worker_lost`` says: ``"raise"`` :class:`~aps.errors.WorkerLost`
from the pending call, ``"wait"`` up to ``reconnect_timeout`` for the worker to resume its
session or for a replacement to take its env slots, or ``"drop"`` it from chunk streams and
gradient rounds. Requests are numbered (see :mod:`aps.wire.messages`), so a resumed worker's
answers arrive exactly once.

The package, one room each:

- :mod:`~aps.learner.learner`: :class:`Learner`, the public face; it checks each call's
  arguments and hands the call to the pool or a mode.
- :mod:`~aps.learner.config`: the learner's settings, checked once into a frozen
  :class:`~aps.learner.config.LearnerConfig` that the pool reads, and the typed options
  (:class:`~aps.learner.config.LearnerOptions`) that :class:`aps.ClusterEnv` passes on.
- :mod:`~aps.learner.admission`: the gate, everything before a peer has proved the token
  (handshake slots, the challenge, refusals that honest workers survive).
- :mod:`~aps.learner.joining`: admission after the gate (a resume, a new worker welcomed, a
  spare kept).
- :mod:`~aps.learner.pool`: :class:`~aps.learner.pool.WorkerPool`, the workers' lifecycle, the
  lease on them (:mod:`~aps.learner.lease`, the one owner of what they are used for now) and
  one request per worker; it composes :mod:`~aps.learner.slots` (the slot table),
  :mod:`~aps.learner.recovery` (recovery, spares, replacement, ``on_worker_lost``) and
  :mod:`~aps.learner.requests` (the numbered request/answer service every mode uses), which
  the modes reach as ``pool.slots``, ``pool.recovery`` and ``pool.requests``.
- :mod:`~aps.learner.lockstep`: reset, step, and the partial batches of send/recv.
- :mod:`~aps.learner.detach`: published versions, sync decisions, rollouts and chunk streams;
  :mod:`~aps.learner.rollouts`, what it hands the learner.
- :mod:`~aps.learner.rounds`: gradient rounds for :mod:`aps.pg`.
- :mod:`~aps.learner.pump`: one inbox fed by every worker, for the streaming modes.

Modes depend on the pool, never on each other; when a worker resumes or is replaced, the pool
asks each mode (its :class:`~aps.learner.pool.SlotHooks`) what the worker needs first.
"""

from aps.learner.admission import MAX_HANDSHAKES, MAX_HANDSHAKES_PER_HOST
from aps.learner.learner import Learner
from aps.learner.pool import WorkerInfo

__all__ = ["MAX_HANDSHAKES", "MAX_HANDSHAKES_PER_HOST", "Learner", "WorkerInfo"]
