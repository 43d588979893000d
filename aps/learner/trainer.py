"""The NIGT trainer: drives Rennala, Malenia or synchronized NIGT over an aps learner.

This module is the I/O side of :mod:`aps.pg`: it sits beside the learner's modes (it drives a
:class:`~aps.learner.Learner`), while the rules it applies (:class:`~aps.pg.NIGTUpdate`,
the aggregation rounds) stay pure in :mod:`aps.pg`. Users reach it as ``aps.pg.NIGT``.

Each iteration broadcasts the extrapolated point; workers sample *and* differentiate at that
point and sum their gradients locally, announcing only their counts. When the aggregation
rule holds over the counts, the learner collects the round: every worker sends its sum once
(one aggregation per round, as in the paper's server variant; messages tagged with another
round are never aggregated), and the learner takes one normalized momentum step. Under
Rennala the learner never waits for a slow worker; under Malenia every worker weighs the
same whatever its speed.

With ``aggregation="allreduce"`` the sums are not sent to the learner: the learner and the
workers run one gloo all-reduce (``torch.distributed``) over them per aggregation, the
paper's other variant, rendezvoused over the workers' authenticated sessions.
"""

from __future__ import annotations

import dataclasses
import math
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

from aps.errors import ConfigError, InvalidState, WorkerLost
from aps.gradients import ring_allreduce_bytes
from aps.learner import Learner
from aps.learner.pool import OnWorkerLost
from aps.pg.aggregate import AggregationRule, Malenia, Rennala
from aps.pg.nigt import NIGTUpdate, flatten, unflatten
from aps.wire import codec
from aps.wire.messages import GradientProgress, GradientsReduced

__all__ = ["AGGREGATIONS", "NIGT", "RoundStats"]

AGGREGATIONS = ("server", "allreduce")
"""How a round's sums reach the learner: each worker sends its sum (``"server"``), or one
all-reduce over the learner and the workers (``"allreduce"``)."""


class _Portal(Protocol):
    def call_learner(self, function: Callable[[Learner], Awaitable[Any]]) -> Any: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class RoundStats:
    """What one NIGT iteration did.

    Attributes:
        iteration: 0, 1, ... (0 is the initial batch at the starting point).
        used: trajectory gradients aggregated.
        discarded: gradients dropped (tagged with an older round, or late).
        contributions: gradients used per worker id.
        seconds: wall time of the round.
        elapsed: wall time since training started.
        bytes_sent: bytes the learner sent in the round: the point, once per worker, and the
            requests for the sums.
        bytes_received: bytes of the messages received in the round: the workers' progress
            counts and their sums, each as encoded on the wire (framing excluded).
        messages_received: the messages those bytes came in.
        aggregations: how many times the workers' sums were collected: 1, or more when a
            worker lost during a collection held gradients the rule had counted (the point
            is then sampled again).
        mean_return: mean undiscounted return of the trajectories used (NaN if none).
        direction_norm: the norm of the momentum direction after the step.
        aggregation: ``"server"`` or ``"allreduce"`` (see :class:`NIGT`).
        aggregation_bytes: the bytes the round's aggregations moved, all senders together.
            Server: the workers' encoded sums (:class:`~aps.wire.messages.GradientReport`,
            framing excluded; also in ``bytes_received``). All-reduce: the payload of a ring
            all-reduce of the float32 vector (the gradient plus one count per worker) over
            the ``k`` ranks, ``2 (k - 1)`` vector sizes in all, computed from the model and
            not measured on the wire (gloo's own handshakes and framing are not counted);
            the rendezvous messages are in ``bytes_sent``.
    """

    iteration: int
    used: int
    discarded: int
    contributions: dict[int, int]
    seconds: float
    elapsed: float
    bytes_sent: int
    bytes_received: int
    messages_received: int
    aggregations: int
    mean_return: float
    direction_norm: float
    aggregation: str = "server"
    aggregation_bytes: int = 0


class NIGT:
    """Normalized Implicit Gradient Transport over asynchronous workers.

    Args:
        policy: the agent being trained (an ``nn.Module`` the policy adapter understands, or
            an :class:`aps.policy.Policy`); its parameters are updated in place after every
            iteration. The learner's ``policy=`` import path must build the same
            architecture on the workers.
        aggregator: :class:`~aps.pg.Rennala` (default, batch 8), :class:`~aps.pg.Malenia` or
            :class:`~aps.pg.Synchronous`.
        lr: the step length alpha (every step moves the parameters by exactly ``lr``).
        momentum: eta in (0, 1]; 1 gives normalized minibatch policy gradient.
        horizon: H, the most steps per trajectory.
        gamma: the discount (absolute: ``gamma^h r_h``).
        initial_batch: the batch of iteration 0 (default: the aggregator's).
        on_worker_lost: the :class:`~aps.Learner`'s words (docs/reliability.md). ``"raise"``
            (default): a worker
            lost mid-round ends training with :class:`~aps.errors.WorkerLost`. ``"drop"``:
            drop it and go on with the others (Rennala and Synchronous only: Malenia's
            objective is the average over all workers' environments, which a lost worker
            changes). ``"wait"`` is refused: waiting for a replacement is the learner's
            choice. ``"continue"``, the old spelling of ``"drop"``, still works and warns.
        aggregation: ``"server"`` (default): when the rule holds each worker sends its sum
            once, over its aps session. ``"allreduce"``: the learner and the workers run
            one gloo all-reduce (``torch.distributed``) over the sums instead, rendezvoused
            over the sessions (see :meth:`aps.Learner.reduce_gradients`); gloo's
            connections are not authenticated or encrypted, so use it on a trusted
            network, and the workers must reach the learner's host on a further port. A
            worker lost during the all-reduce fails it (:class:`~aps.errors.Timeout`), so
            it needs ``on_worker_lost="raise"``.

    Example:
        >>> trainer = NIGT(agent, aggregator=Rennala(batch=16), lr=0.02)  # doctest: +SKIP
        >>> async for stats in trainer.train(learner, iterations=100):  # doctest: +SKIP
        ...     print(stats.iteration, stats.mean_return)
    """

    def __init__(
        self,
        policy: Any,
        *,
        aggregator: AggregationRule | None = None,
        lr: float = 0.01,
        momentum: float = 0.1,
        horizon: int = 200,
        gamma: float = 0.99,
        initial_batch: int | None = None,
        on_worker_lost: OnWorkerLost | Literal["continue"] = "raise",
        aggregation: Literal["server", "allreduce"] = "server",
    ) -> None:
        if on_worker_lost == "continue":
            warnings.warn(
                "on_worker_lost='continue' is now spelled 'drop', as on aps.Learner",
                DeprecationWarning,
                stacklevel=2,
            )
            on_worker_lost = "drop"
        if aggregation not in AGGREGATIONS:
            raise ConfigError(f"aggregation must be 'server' or 'allreduce', got {aggregation!r}")
        if aggregation == "allreduce" and on_worker_lost != "raise":
            raise ConfigError(
                f"aggregation='allreduce' needs on_worker_lost='raise', got {on_worker_lost!r}: "
                "a worker lost during the all-reduce fails the whole group; use "
                "aggregation='server' to train on without it"
            )
        self.aggregation = aggregation
        self.aggregator: AggregationRule = aggregator or Rennala(batch=8)
        self.update = NIGTUpdate(lr=lr, momentum=momentum)
        if not isinstance(horizon, int) or horizon < 1:
            raise ConfigError(f"horizon must be an int >= 1, got {horizon!r}")
        if not 0.0 <= gamma <= 1.0:
            raise ConfigError(f"gamma must be in [0, 1], got {gamma!r}")
        if on_worker_lost == "wait":
            raise ConfigError(
                "on_worker_lost='wait' is the Learner's choice, not the trainer's: give it to "
                "aps.Learner, whose replacement worker joins at the next round; the trainer "
                "decides what the open round does without the lost worker, 'raise' or 'drop'"
            )
        if on_worker_lost not in ("raise", "drop"):
            raise ConfigError(
                f"on_worker_lost must be 'raise' or 'drop' (of 'raise', 'wait', 'drop'), "
                f"got {on_worker_lost!r}"
            )
        if on_worker_lost == "drop" and not self.aggregator.survives_worker_loss:
            raise ConfigError(
                f"{self.aggregator!r} cannot continue without a worker: its objective is the "
                "average over every worker's environment; use on_worker_lost='raise'"
            )
        self.initial = self.aggregator
        if initial_batch is not None and isinstance(self.aggregator, Rennala | Malenia):
            self.initial = dataclasses.replace(self.aggregator, batch=initial_batch)
        self.policy = policy
        self.horizon = horizon
        self.gamma = gamma
        self.on_worker_lost: Literal["raise", "drop"] = on_worker_lost

    def _wrap(self, learner: Learner) -> Any:
        from aps.policy import Policy

        if isinstance(self.policy, Policy):
            return self.policy
        return Policy(self.policy, learner.single_observation_space, learner.single_action_space)

    async def train(self, learner: Learner, iterations: int) -> AsyncIterator[RoundStats]:
        """Run ``iterations`` NIGT iterations on ``learner``'s workers, yielding each one's stats.

        The learner must have a ``policy`` and ``autoreset_mode="SameStep"``. Gradient mode
        ends when the iterator finishes or is closed.

        Raises:
            WorkerLost: a worker was lost and ``on_worker_lost`` is ``"raise"``, or no
                worker is left.
            WorkerError: sampling or differentiating raised on a worker.
        """
        await learner.wait_for_workers()
        policy = self._wrap(learner)
        vector, layout = flatten(policy.get_weights())
        state = self.update.start(vector)
        started = time.monotonic()
        try:
            for iteration in range(iterations):
                rule = self.initial if iteration == 0 else self.aggregator
                workers = [w.worker_id for w in learner.gradient_workers] or [
                    w.worker_id for w in learner.workers
                ]
                round_ = rule.start(state.t, workers, size=layout.size)
                round_began = time.monotonic()
                point = unflatten(state.point, layout)
                sent = await learner.start_round(
                    state.t, point, horizon=self.horizon, gamma=self.gamma
                )
                received = messages = aggregations = moved = 0
                returns: list[float] = []
                # The workers whose sum is awaited, once the rule held over the counts.
                waiting: set[int] | None = None
                while True:
                    if waiting is None and round_.ready:
                        waiting = set(round_.active)
                        round_.begin_collection()
                        aggregations += 1
                        if self.aggregation == "server":
                            sent += await learner.collect_gradients(state.t)
                        else:
                            reduced_bytes, rendezvous = await self._reduce(
                                learner, round_, layout.size
                            )
                            sent += rendezvous
                            moved += reduced_bytes
                    if waiting is not None and not waiting:
                        round_.end_collection()
                        if round_.done:
                            break
                        if self.aggregation == "allreduce":
                            raise InvalidState(
                                f"round {state.t} is not done after its all-reduce: {round_!r}"
                            )
                        # A worker lost while collecting took gradients the rule counted:
                        # sample the same point again for the rest.
                        waiting = None
                        sent += await learner.start_round(
                            state.t, point, horizon=self.horizon, gamma=self.gamma
                        )
                        continue
                    try:
                        worker_id, message = await learner.next_report()
                    except WorkerLost as exc:
                        if self.on_worker_lost == "raise":
                            raise
                        learner.drop_worker(exc.worker_id)
                        round_.remove(exc.worker_id)
                        if waiting is not None:
                            waiting.discard(exc.worker_id)
                        if not round_.can_finish:
                            raise WorkerLost(
                                f"no worker is left to finish round {state.t}",
                                worker_id=exc.worker_id,
                            ) from exc
                        continue
                    size = len(codec.encode(message))
                    received += size
                    messages += 1
                    if worker_id not in round_.workers:
                        continue  # a replacement: it joins at the next round
                    if isinstance(message, GradientProgress):
                        round_.note(worker_id, message.round, message.count)
                        continue
                    if isinstance(message, GradientsReduced):
                        # Its sum is in the all-reduce already; this brings its returns.
                        if waiting is not None and message.round == state.t:
                            waiting.discard(worker_id)
                            returns.extend(float(r) for r in message.episode_return)
                        continue
                    moved += size
                    if waiting is not None and message.round == state.t:
                        waiting.discard(worker_id)
                    if message.count == 0:
                        round_.note(worker_id, message.round, 0)  # its sum holds nothing
                        continue
                    gradient = layout.flatten(message.gradient, fill_missing=True)
                    if round_.add(worker_id, message.round, gradient, message.count):
                        returns.extend(float(r) for r in message.episode_return)
                state = self.update.step(state, round_.result())
                policy.set_weights(unflatten(state.theta, layout))
                now = time.monotonic()
                yield RoundStats(
                    iteration=iteration,
                    used=round_.used,
                    discarded=round_.discarded,
                    contributions=dict(round_.contributions),
                    seconds=now - round_began,
                    elapsed=now - started,
                    bytes_sent=sent,
                    bytes_received=received,
                    messages_received=messages,
                    aggregations=aggregations,
                    mean_return=float(np.mean(returns)) if returns else math.nan,
                    direction_norm=state.direction_norm,
                    aggregation=self.aggregation,
                    aggregation_bytes=moved,
                )
        finally:
            await learner.stop_gradients()

    async def _reduce(self, learner: Learner, round_: Any, size: int) -> tuple[int, int]:
        """One all-reduce over the round's sums, handed to the round.

        Returns the all-reduce's computed payload bytes and the rendezvous bytes sent.
        """
        workers = [w.worker_id for w in learner.gradient_workers]
        reduced, rendezvous = await learner.reduce_gradients(
            round_.round_id, size=size, mean=round_.reduces_means
        )
        counts = {
            worker: round(float(c)) for worker, c in zip(workers, reduced[size:], strict=True)
        }
        round_.add_reduced(round_.round_id, np.asarray(reduced[:size], np.float64), counts)
        ranks = len(workers) + 1
        payload = ring_allreduce_bytes(int(reduced.nbytes), ranks) * ranks
        return payload, rendezvous

    def run(self, envs: _Portal, iterations: int) -> list[RoundStats]:
        """The blocking form of :meth:`train`: on an :class:`aps.ClusterEnv`, return all stats."""

        async def every_round(learner: Learner) -> list[RoundStats]:
            return [stats async for stats in self.train(learner, iterations)]

        result: list[RoundStats] = envs.call_learner(every_round)
        return result
