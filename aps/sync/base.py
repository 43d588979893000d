"""The sync contract: what a strategy sees (:class:`SyncContext`) and what it is.

A strategy decides, per worker and per decision point, whether the learner's newest weight
version travels to that worker. It holds only parameters; the role (the learner) owns every
piece of mutable state and hands it over in a fresh :class:`SyncContext` for each decision.
Strategies are pure: no event loop, no sockets, no clock reads, so a decision table tests them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from aps.errors import ConfigError, InvalidState

__all__ = ["SyncContext", "SyncStrategy"]


def _no_divergence() -> float:
    raise InvalidState(
        "this SyncContext was built without measure_divergence; "
        "pass a callable that returns the divergence of the worker's version"
    )


def _no_update_drift() -> float:
    raise InvalidState(
        "this SyncContext was built without measure_update_drift; pass a callable that "
        "returns the divergence of the learner's previous version from its newest"
    )


@dataclass(frozen=True, slots=True)
class SyncContext:
    """Everything a strategy may look at for one worker at one decision point.

    The role builds a fresh context per decision. The first deployment is not a strategy
    decision: a worker that holds no version yet (``worker_version == -1``) always receives the
    learner's current version, and the role does not consult the strategy for it. (The built-in
    strategies answer ``True`` for such a worker anyway, and never measure a divergence for it,
    so a role that does consult them stays correct.)

    Attributes:
        worker_id: the worker this decision is about.
        worker_version: the weight version the worker holds; ``-1`` when it holds none yet.
        learner_version: the learner's newest published version (``>= 0`` once one exists).
        steps_since_sync: env steps the worker took (summed over its envs, one per env per
            step) since it last received weights. ``>= 0``.
        seconds_since_sync: seconds since the worker last received weights, as measured by the
            role. ``>= 0``.
        measure_divergence: a zero-argument callable returning the divergence of the worker's
            version from the learner's (for APS: the mean KL of the behaviour policy from the
            learner's policy over the states the worker just acted on; ``>= 0``, may be
            ``inf``). It is called at most once per context, through :meth:`divergence`, and
            only by strategies that need it; strategies that never call it cost nothing. The
            default raises :class:`~aps.errors.InvalidState`.
        measure_update_drift: a zero-argument callable returning one update's own drift: the
            same divergence, on the same states, of the learner's previous version
            (``learner_version - 1``) from its newest (``>= 0``; NaN when the previous
            version is no longer kept). Called at most once per context, through
            :meth:`update_drift`, by strategies that scale their threshold by it
            (:class:`~aps.sync.RelativeAPS`). The default raises
            :class:`~aps.errors.InvalidState`.

    Raises:
        ConfigError: a version below ``-1`` or a negative step count or duration.
    """

    worker_id: int
    worker_version: int
    learner_version: int
    steps_since_sync: int = 0
    seconds_since_sync: float = 0.0
    measure_divergence: Callable[[], float] = field(default=_no_divergence, repr=False)
    measure_update_drift: Callable[[], float] = field(default=_no_update_drift, repr=False)
    _divergence: list[float] = field(
        default_factory=list, init=False, repr=False, compare=False, hash=False
    )
    _update_drift: list[float] = field(
        default_factory=list, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        if self.worker_version < -1:
            raise ConfigError(
                f"worker_version must be -1 (no version yet) or a version >= 0, "
                f"got {self.worker_version}"
            )
        if self.steps_since_sync < 0:
            raise ConfigError(f"steps_since_sync must be >= 0, got {self.steps_since_sync}")
        if not self.seconds_since_sync >= 0.0:  # also refuses NaN
            raise ConfigError(f"seconds_since_sync must be >= 0, got {self.seconds_since_sync}")

    @property
    def lag(self) -> int:
        """How many versions the worker is behind: ``learner_version - worker_version``.

        ``0`` when the worker holds the current version (no strategy syncs then), and
        ``learner_version + 1`` for a worker that holds none.
        """
        return self.learner_version - self.worker_version

    @property
    def holds_weights(self) -> bool:
        """Whether the worker holds any version at all (``worker_version >= 0``)."""
        return self.worker_version >= 0

    def divergence(self) -> float:
        """The divergence of the worker's version from the learner's, measured on first use.

        Calls :attr:`measure_divergence` the first time and returns the cached value after
        that, so several strategies combined with :class:`~aps.sync.AnyOf` pay for one
        measurement at most.

        Returns:
            The divergence as a float (``inf`` allowed). A NaN is returned as is and exceeds
            no threshold.

        Raises:
            InvalidState: the context was built without ``measure_divergence``.
            Exception: whatever ``measure_divergence`` raises, unchanged (nothing is cached).
        """
        if not self._divergence:
            self._divergence.append(float(self.measure_divergence()))
        return self._divergence[0]

    def update_drift(self) -> float:
        """One update's own drift on the worker's states, measured on first use.

        Calls :attr:`measure_update_drift` the first time and returns the cached value after
        that, as :meth:`divergence` does.

        Raises:
            InvalidState: the context was built without ``measure_update_drift``.
            Exception: whatever ``measure_update_drift`` raises, unchanged (nothing is cached).
        """
        if not self._update_drift:
            self._update_drift.append(float(self.measure_update_drift()))
        return self._update_drift[0]

    @property
    def divergence_measured(self) -> bool:
        """Whether :meth:`divergence` has been computed for this context (for the metrics)."""
        return bool(self._divergence)


@runtime_checkable
class SyncStrategy(Protocol):
    """Decides whether the learner's newest version travels to one worker.

    Any object with this method is a strategy; ``isinstance(obj, SyncStrategy)`` checks that it
    has it. A strategy must be a pure function of its parameters and the context: the role may
    consult it at any time, any number of times, and from any worker's point of view.

    Contract for implementations: return ``False`` when ``ctx.lag <= 0`` (the worker already
    holds the current version, or a newer one), and call ``ctx.divergence()`` only when the
    answer depends on it, since measuring it costs forward passes on the learner.
    """

    def should_sync(self, ctx: SyncContext) -> bool:
        """Return ``True`` to send the learner's current version to ``ctx.worker_id`` now."""
        ...
