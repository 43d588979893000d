"""The learner's settings: checked once, then handed down frozen.

:class:`aps.Learner` takes its settings as explicit keyword parameters (users read them there)
and builds one :class:`LearnerConfig` from them with :meth:`LearnerConfig.build`, where every
check lives; the :class:`~aps.learner.pool.WorkerPool` (and, through it, the gate) reads that
object and nothing else, so no setting is written onto the pool from outside after it exists.

The front doors that only pass the settings on (:class:`aps.ClusterEnv` and its
:meth:`~aps.ClusterEnv.local`) take them as ``**options`` typed by :class:`LearnerOptions` and
:class:`ListenOptions` (PEP 692): a type checker still checks each name and type at the call,
and the learner's own checks apply unchanged, with the same defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self, TypedDict, Unpack

from gymnasium.vector import AutoresetMode

from aps import transports
from aps.errors import ConfigError, WireError
from aps.learner.recovery import OnWorkerLost
from aps.learner.rollouts import WeightPrecision
from aps.session import Timeouts
from aps.sync import AlwaysSync, SyncStrategy
from aps.transports.base import Listener, TransportFactory
from aps.wire import codec
from aps.wire.compression import check_setting as check_compression
from aps.wire.messages import Welcome

if TYPE_CHECKING:  # joining.py imports this module; the protocol is only a type here
    from aps.learner.joining import Launcher

__all__ = ["LearnerConfig", "LearnerOptions", "ListenOptions", "refuse_unknown"]


class LearnerOptions(TypedDict, total=False):
    """The learner's settings that every front door passes on.

    Each key is :class:`aps.Learner`'s argument of the same name, with the same type and
    checks; a key left out takes the learner's default.
    """

    autoreset_mode: AutoresetMode | str
    """Gymnasium's autoreset mode, applied on the workers: ``NEXT_STEP``, ``SAME_STEP`` or
    ``DISABLED`` (the caller resets ended envs with ``reset(options={"reset_mask": mask})``).
    Default ``AutoresetMode.NEXT_STEP``."""
    timeouts: Timeouts | None
    """The deadlines, see :class:`~aps.session.Timeouts`; ``None`` is ``Timeouts()``.
    Default ``None``."""
    policy: str | None
    """Import path of the policy workers act with (``"pkg.module:make_agent"``), for
    ``rollout`` and chunk streams. Default ``None``."""
    sync: SyncStrategy | None
    """When a worker gets a newly published version (:mod:`aps.sync`); ``None`` is
    :class:`~aps.sync.AlwaysSync`. Default ``None``."""
    on_worker_lost: OnWorkerLost
    """What a lost worker does to the call that notices it: ``"raise"``, ``"wait"`` (for a
    resume or a replacement, whose envs' episodes end ``truncated``) or ``"drop"`` (which
    :class:`aps.ClusterEnv` refuses: a vector env steps all of its envs every call); see
    :class:`aps.Learner`. Default ``'raise'``."""
    reconnect_timeout: float
    """Seconds ``"wait"`` waits for a resume or a replacement. Default ``60.0``."""
    weight_precision: WeightPrecision
    """How published weights travel: ``"exact"`` or ``"float16"``; see :class:`aps.Learner`.
    Default ``'exact'``."""
    policy_kwargs: dict[str, Any] | None
    """Keyword arguments for the ``policy`` factory, as plain data. Default ``None``."""
    overlap_weights: bool
    """Let a chosen version travel while the worker keeps acting with the one it holds; see
    :class:`aps.Learner`. Default ``False``."""
    compression: str
    """How arrays of 4 KiB or more travel: ``"auto"``, ``"zstd"``, ``"lz4"`` or ``"none"``;
    see :class:`aps.Learner` and :mod:`aps.wire.compression`. Default ``'auto'``."""
    frame_delta: bool
    """Accept rollout chunks whose frame stacks travel as their newest frames, wherever
    ``compression`` compresses; see :mod:`aps.wire.frame_delta`. Default ``True``."""


class ListenOptions(LearnerOptions, total=False):
    """:class:`LearnerOptions` and the settings of an address the caller chose.

    Who may join it (``token``, ``insecure``), how it is bound (``factory``) and who starts
    the workers against it (``launcher``).
    """

    token: str | bytes | None
    """The shared secret workers must prove; required off loopback. Default ``None``."""
    insecure: bool
    """Allow a non-loopback address without a token. Default ``False``."""
    factory: TransportFactory | None
    """The transport factory to listen with instead of the URL scheme's (TLS, a frame size
    limit). Default ``None``."""
    launcher: Launcher | None
    """Starts the workers (``aps.launch.local/ray/slurm(...)``); they are stopped when the
    learner closes. Default ``None``."""


def refuse_unknown(options: Mapping[str, object], allowed: type[Any], where: str) -> None:
    """Raise the :class:`TypeError` Python raises for a keyword ``where`` does not take.

    ``**options`` accepts any name at run time; this keeps a misspelt one an error of the call
    that took it, as an explicit parameter list would. ``allowed`` is a ``TypedDict`` class.
    """
    keys: frozenset[str] = allowed.__required_keys__ | allowed.__optional_keys__
    for name in options:
        if name not in keys:
            raise TypeError(f"{where}() got an unexpected keyword argument {name!r}")


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    """The learner's settings, checked and in their one form; made by :meth:`build`.

    Fields are :class:`aps.Learner`'s arguments of the same names, normalized: the token as
    bytes, ``autoreset_mode`` as an :class:`~gymnasium.vector.AutoresetMode`, ``timeouts`` and
    ``sync`` never ``None``, ``factory`` the URL scheme's when none was given.
    """

    listen: str | Listener
    num_workers: int
    token: bytes | None
    autoreset_mode: AutoresetMode
    timeouts: Timeouts
    insecure: bool
    factory: TransportFactory | None
    policy: str | None
    sync: SyncStrategy
    launcher: Launcher | None
    on_worker_lost: OnWorkerLost
    reconnect_timeout: float
    weight_precision: WeightPrecision
    policy_kwargs: dict[str, Any] | None
    """Sent in every welcome; the caller's dict, not a copy."""
    overlap_weights: bool
    compression: str
    frame_delta: bool

    @classmethod
    def build(
        cls, listen: str | Listener, *, num_workers: int, **options: Unpack[ListenOptions]
    ) -> Self:
        """AnswerCheck the user's arguments and make the config.

        A key left out takes :class:`aps.Learner`'s default.

        Raises:
            ConfigError: the first bad value, named with what it must be; a URL whose scheme
                aps cannot listen on is said first.
        """
        factory = options.get("factory")
        if isinstance(listen, str) and factory is None:
            # The scheme first: a URL aps cannot listen on says so, before anything is
            # said about tokens or workers.
            factory = transports.get_factory(transports.scheme_of(listen))
        if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 1:
            raise ConfigError(f"num_workers must be an int >= 1, got {num_workers!r}")
        timeouts = options.get("timeouts")
        if timeouts is not None and not isinstance(timeouts, Timeouts):
            raise ConfigError(f"timeouts must be an aps.Timeouts or None, got {timeouts!r}")
        on_worker_lost = options.get("on_worker_lost", "raise")
        if on_worker_lost not in ("raise", "wait", "drop"):
            raise ConfigError(
                f"on_worker_lost must be 'raise', 'wait' or 'drop', got {on_worker_lost!r}"
            )
        reconnect_timeout = options.get("reconnect_timeout", 60.0)
        if (
            not isinstance(reconnect_timeout, int | float)
            or isinstance(reconnect_timeout, bool)
            or not reconnect_timeout > 0
        ):
            raise ConfigError(
                f"reconnect_timeout must be a positive number of seconds, got {reconnect_timeout!r}"
            )
        autoreset_mode = options.get("autoreset_mode", AutoresetMode.NEXT_STEP)
        try:
            mode = AutoresetMode(autoreset_mode)
        except ValueError:
            choices = ", ".join(repr(m.value) for m in AutoresetMode)
            raise ConfigError(
                f"autoreset_mode must be one of {choices}, got {autoreset_mode!r}"
            ) from None
        policy = options.get("policy")
        if policy is not None and (not isinstance(policy, str) or ":" not in policy):
            raise ConfigError(
                f"policy must be an import path 'package.module:factory' or "
                f"'path/to/file.py:factory', got {policy!r}"
            )
        policy_kwargs = options.get("policy_kwargs")
        _check_policy_kwargs(policy_kwargs, policy)
        sync = options.get("sync")
        sync = AlwaysSync() if sync is None else sync
        if not isinstance(sync, SyncStrategy):
            raise ConfigError(
                f"sync must have a should_sync(ctx) method (see aps.sync), got {sync!r}"
            )
        token = options.get("token")
        token = token.encode() if isinstance(token, str) else token
        if token is not None and not token.strip():
            raise ConfigError(
                "the token is empty (or only whitespace), which anyone can prove; pass a "
                "random one (aps token makes one), or token=None on a loopback address"
            )
        compression = check_compression(options.get("compression", "auto"))
        frame_delta = options.get("frame_delta", True)
        if not isinstance(frame_delta, bool):
            raise ConfigError(f"frame_delta must be True or False, got {frame_delta!r}")
        weight_precision = options.get("weight_precision", "exact")
        if weight_precision not in ("exact", "float16"):
            raise ConfigError(
                f"weight_precision must be 'exact' or 'float16', got {weight_precision!r}"
            )
        overlap_weights = options.get("overlap_weights", False)
        if not isinstance(overlap_weights, bool):
            raise ConfigError(f"overlap_weights must be True or False, got {overlap_weights!r}")
        return cls(
            listen=listen,
            num_workers=num_workers,
            token=token,
            autoreset_mode=mode,
            timeouts=timeouts or Timeouts(),
            insecure=options.get("insecure", False),
            factory=factory,
            policy=policy,
            sync=sync,
            launcher=options.get("launcher"),
            on_worker_lost=on_worker_lost,
            reconnect_timeout=float(reconnect_timeout),
            weight_precision=weight_precision,
            policy_kwargs=policy_kwargs,
            overlap_weights=overlap_weights,
            compression=compression,
            frame_delta=frame_delta,
        )


def _check_policy_kwargs(policy_kwargs: object, policy: str | None) -> None:
    if policy_kwargs is None:
        return
    if policy is None:
        raise ConfigError("policy_kwargs without a policy: give policy='module:factory' too")
    if not isinstance(policy_kwargs, dict) or not all(isinstance(k, str) for k in policy_kwargs):
        raise ConfigError(f"policy_kwargs must be a dict with str keys, got {policy_kwargs!r}")
    try:
        codec.encode(
            Welcome(worker_id=0, autoreset_mode="", policy=policy, policy_kwargs=policy_kwargs)
        )
    except WireError as exc:
        raise ConfigError(
            f"policy_kwargs must be plain data (numbers, strings, tuples, dicts with str keys), "
            f"which workers receive in their welcome: {exc}"
        ) from None
