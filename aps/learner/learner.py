"""The :class:`Learner`: one public face over the worker pool and its three modes."""

from __future__ import annotations

import math
import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Self

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode
from gymnasium.vector.utils import batch_space

from aps._base._resource import AsyncResource
from aps._base._typing import Array, Info
from aps.errors import ConfigError, InvalidState, WorkerLost
from aps.learner.config import LearnerConfig
from aps.learner.detach import Detach
from aps.learner.fanout import WeightGroup
from aps.learner.joining import Launcher
from aps.learner.lockstep import Lockstep, StepReturn
from aps.learner.pool import OnWorkerLost, WorkerInfo, WorkerPool
from aps.learner.rollouts import Chunk, Metrics, Rollout, WeightPrecision
from aps.learner.rounds import GradientRounds
from aps.session import Timeouts
from aps.sync import SyncStrategy
from aps.transports.base import Listener, TransportFactory
from aps.wire.messages import (
    ENV_CALL_KINDS,
    GradientProgress,
    GradientReport,
    GradientsReduced,
)
from aps.wire.spaces import value_from_wire

__all__ = ["Learner"]


class Learner(AsyncResource):
    """Admits workers and steps their envs as one batch; an async context manager.

    Args:
        listen: the URL to bind (``"tcp://127.0.0.1:0"``, ``"ws://0.0.0.0:7000"``,
            ``"memory://"``) or a bound :class:`~aps.transports.Listener`.
        num_workers: how many workers to wait for.
        token: a shared secret workers must prove they know (HMAC challenge; the token never
            crosses the wire). Required when listening on a non-loopback address.
        autoreset_mode: Gymnasium's autoreset mode, applied on the workers.
        timeouts: the deadlines, see :class:`~aps.session.Timeouts`.
        insecure: allow a non-loopback address without a token.
        factory: the transport factory to listen with, instead of the URL scheme's; this is
            where TLS and a frame size limit other than 256 MiB are set, e.g.
            ``TCPFactory(ssl_context=..., max_frame_size=...)``.
        policy: import path of the policy workers act with (``"pkg.module:make_agent"`` or
            ``"path/to/script.py:Agent"``, called with the single observation and action
            spaces); enables :meth:`publish`, :meth:`rollout` and :meth:`chunks`.
        sync: when a worker gets a newly published version (:mod:`aps.sync`); default
            :class:`~aps.sync.AlwaysSync`.
        launcher: an :class:`aps.launch.Launcher` (``aps.launch.local/ray/slurm(...)``) that
            starts the workers: the learner starts it once bound (handing it the URL, the
            token and the policy), watches it while waiting for the workers (a launch that
            fails ends the wait at once), and stops it when it closes or when the workers do
            not all arrive in time.
        on_worker_lost: what a lost worker does to the call that notices it. ``"raise"``
            (default): :class:`~aps.errors.WorkerLost`, and the learner is unusable.
            ``"wait"``: wait up to ``reconnect_timeout`` seconds for the worker to resume its
            session (the call then completes as if nothing happened) or for a new worker with
            the same number of envs to take its slots (a :meth:`step` then reports those envs
            ``truncated`` with ``info["worker_restarted"]``). While every slot is taken, new
            workers are kept as spares for this. ``"drop"``: chunk streams and gradient
            rounds go on with the other workers; lockstep calls raise.
        reconnect_timeout: seconds ``"wait"`` waits for a resume or a replacement.
        weight_precision: how published weights travel: ``"exact"`` (default), or
            ``"float16"``, which rounds float weights to float16 (half a float32 policy's
            bytes). Workers then act with the rounded weights, and APS measures divergence
            against them; behaviour log-probabilities stay the workers' own, so PPO's
            correction stays exact.
        overlap_weights: let a version the sync strategy chose travel while the worker acts
            the request it was decided for with the version it holds (``False``, default:
            the version goes first and the worker waits for it). It applies between chunks,
            from the worker's next request on, so each synced worker acts one request more
            with its older version; chunks still carry the version they were acted with, and
            a worker that holds none still waits for its first. See DETACH in the docs.
        policy_kwargs: keyword arguments for the ``policy`` factory (``hidden_size=256``), so
            one factory builds every network size. Plain data: workers receive them in their
            welcome, never code.
        compression: how arrays of 4 KiB or more travel, both ways (:mod:`aps.wire.compression`):
            ``"auto"`` (default) compresses with zstd (else lz4) for workers that are not on
            this host, and not for loopback, Unix or in-memory ones; ``"zstd"`` or ``"lz4"``
            for every worker that offers it; ``"none"`` never. A worker that lacks the
            library (the ``compression`` extra) or was started with ``--compression none``
            gets no compression, said once in the log.
        frame_delta: accept rollout chunks whose frame stacks travel as their newest frames
            (:mod:`aps.wire.frame_delta`) from workers that offer it, wherever ``compression``
            compresses (by default; ``False``: chunks travel whole). The rebuilt
            observations equal the worker's byte for byte.

    Entering the context binds the address (see :attr:`url`); the first :meth:`reset` waits
    for the workers (or call :meth:`wait_for_workers`).

    Example:
        >>> async def main():  # doctest: +SKIP
        ...     async with Learner("tcp://127.0.0.1:0", num_workers=2) as learner:
        ...         print(learner.url)  # start the workers against this URL
        ...         obs, info = await learner.reset(seed=0)
        ...         obs, rew, term, trunc, info = await learner.step(learner.action_space.sample())
    """

    def __init__(
        self,
        listen: str | Listener = "tcp://127.0.0.1:0",
        *,
        num_workers: int,
        token: str | bytes | None = None,
        autoreset_mode: AutoresetMode | str = AutoresetMode.NEXT_STEP,
        timeouts: Timeouts | None = None,
        insecure: bool = False,
        factory: TransportFactory | None = None,
        policy: str | None = None,
        sync: SyncStrategy | None = None,
        launcher: Launcher | None = None,
        on_worker_lost: OnWorkerLost = "raise",
        reconnect_timeout: float = 60.0,
        weight_precision: WeightPrecision = "exact",
        policy_kwargs: dict[str, Any] | None = None,
        overlap_weights: bool = False,
        compression: str = "auto",
        frame_delta: bool = True,
    ) -> None:
        config = LearnerConfig.build(
            listen,
            num_workers=num_workers,
            token=token,
            autoreset_mode=autoreset_mode,
            timeouts=timeouts,
            insecure=insecure,
            factory=factory,
            policy=policy,
            sync=sync,
            launcher=launcher,
            on_worker_lost=on_worker_lost,
            reconnect_timeout=reconnect_timeout,
            weight_precision=weight_precision,
            policy_kwargs=policy_kwargs,
            overlap_weights=overlap_weights,
            compression=compression,
            frame_delta=frame_delta,
        )
        self.num_workers = config.num_workers
        self.autoreset_mode = config.autoreset_mode
        self.policy = config.policy
        self.launcher = config.launcher
        self.on_worker_lost: OnWorkerLost = config.on_worker_lost
        self.reconnect_timeout = config.reconnect_timeout
        self.policy_kwargs = config.policy_kwargs
        self._pool = WorkerPool(config, figures=lambda: self.metrics.as_dict())
        self._lockstep = Lockstep(self._pool)
        self._detach = Detach(
            self._pool,
            config.policy,
            config.sync,
            config.weight_precision,
            config.overlap_weights,
        )
        # Where the figures' uptime and CPU count from: start(), or here until then.
        self._started_at, self._cpu_at_start = time.monotonic(), time.process_time()
        self._timed = False
        self._rounds = GradientRounds(self._pool)
        self._pool.modes.extend([self._detach, self._rounds, self._lockstep])

    # Lifecycle.

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def start(self) -> None:
        """Bind the address and start admitting workers; idempotent.

        Raises:
            ConfigError: a non-loopback address without a token (and not ``insecure``), or a
                malformed URL.
            ConnectError: the address cannot be bound.
            LaunchError | MissingDependency: the launcher could not start the workers (the
                learner is closed again).
        """
        if not self._timed:  # the first start: idempotent, as start() is
            self._timed = True
            self._started_at, self._cpu_at_start = time.monotonic(), time.process_time()
        await self._pool.start()

    @property
    def url(self) -> str:
        """The bound address, with port 0 resolved; workers dial it."""
        return self._pool.url

    async def aclose(self) -> None:
        """Say goodbye to every worker and stop listening; idempotent."""
        if self._pool.closed:
            return
        self._pool.begin_close()  # nothing below waits for a lost worker to resume
        for mode in self._pool.modes:
            await mode.aclose()
        await self._pool.aclose()

    async def wait_for_workers(self, timeout: float | None = None) -> None:
        """Wait until all ``num_workers`` workers are admitted.

        Args:
            timeout: seconds to wait; default ``timeouts.connect``.

        With a launcher, the wait also watches it: workers that die before they connect end
        the wait at once, and on any failure the launcher is stopped (its job cancelled).

        Raises:
            Timeout: not all workers arrived in time; the message says how many did, why any
                were refused, and what the launcher reports (a Slurm job's state).
            WorkerLost | LaunchError: the launcher's workers died before they all connected.
        """
        try:
            await self._pool.wait_for_workers(timeout)
        except WorkerLost as exc:
            # A launched worker that ended before it joined was often refused first (an env
            # id it cannot make, a policy it cannot import): its own words, not "see its
            # output", which a notebook never shows.
            pool = self._pool
            await pool.settle_admissions()  # a handshake the worker ended by leaving ends now
            refused = pool.refusals
            if not refused:
                raise
            raise WorkerLost(
                f"{exc}; the learner's last refusal: {refused[-1]}", worker_id=exc.worker_id
            ) from exc

    # The batch.

    @property
    def workers(self) -> tuple[WorkerInfo, ...]:
        """The admitted workers in env order."""
        return tuple(r.info for r in self._pool.slots.admitted)

    @property
    def restarts(self) -> int:
        """Workers that replaced lost ones."""
        return self._pool.recovery.restarts

    @property
    def num_envs(self) -> int:
        """Total envs over all workers (known once the workers are admitted)."""
        self._pool.slots.require_workers()
        return sum(self._pool.slots.counts)

    @property
    def single_observation_space(self) -> gym.Space[Any]:
        """The observation space of one env, as the workers reported it."""
        return self._pool.slots.require_workers()[0]

    @property
    def single_action_space(self) -> gym.Space[Any]:
        """The action space of one env, as the workers reported it."""
        return self._pool.slots.require_workers()[1]

    @property
    def observation_space(self) -> gym.Space[Any]:
        """The batched observation space over all envs."""
        return batch_space(self.single_observation_space, self.num_envs)

    @property
    def action_space(self) -> gym.Space[Any]:
        """The batched action space over all envs."""
        return batch_space(self.single_action_space, self.num_envs)

    # Lockstep: the learner chooses every action.

    async def reset(
        self,
        *,
        seed: int | Sequence[int | None] | None = None,
        options: dict[str, Any] | None = None,
    ) -> tuple[Any, Info]:
        """Reset every env; waits for the workers first if needed.

        Args:
            seed: global env ``i`` is seeded with ``seed + i``, as Gymnasium's vector envs do,
                or with ``seed[i]`` for a list of one int (or ``None``) per env. ``None``
                lets each worker use its own seed on its first reset.
            options: passed to every env's ``reset``. ``options["reset_mask"]`` (a bool
                array with one element per env, as Gymnasium's vector envs take it, mostly
                with ``autoreset_mode="Disabled"``) resets only the envs it marks; the
                others keep their observations, and the infos hold only the reset envs'.

        Returns:
            ``(observations, infos)`` batched over all envs.

        Raises:
            ConfigError: ``seed`` is not an int, ``None`` or one int or ``None`` per env, or
                a ``reset_mask`` that is not a bool array of one element per env with at
                least one ``True``.
            WorkerError: an env raised on a worker.
            WorkerLost: a worker disconnected; this learner can no longer step.
            Timeout: a worker took longer than ``timeouts.step``.
        """
        await self.wait_for_workers()
        seeds = _check_seed(seed, self.num_envs)
        if options is not None and "reset_mask" in options:
            _check_reset_mask(options["reset_mask"], self.num_envs)
        return await self._lockstep.reset(seed=seeds, options=options)

    async def step(self, actions: Any) -> StepReturn:
        """Step every env with its action.

        Args:
            actions: one batched action for all envs, shaped like :attr:`action_space`.

        Returns:
            ``(observations, rewards, terminations, truncations, infos)``, as a Gymnasium
            vector env returns them (autoreset as :attr:`autoreset_mode` says). Envs whose
            worker was replaced during the step (``on_worker_lost="wait"``) end their episode
            there: ``truncated``, reward 0, ``info["worker_restarted"]``, and the observation
            is the replacement's reset observation; under ``NextStep`` their next step is the
            reset step.

        Raises:
            ConfigError: ``actions`` has the wrong shape or dtype (nothing was sent).
            InvalidState: called before :meth:`reset`, or concurrently.
            WorkerError: an env raised on a worker.
            WorkerLost: a worker was lost (and did not come back in time under ``"wait"``);
                this learner can no longer step.
            Timeout: a worker took longer than ``timeouts.step``.
        """
        return await self._lockstep.step(actions)

    async def send(self, actions: Any, worker_ids: Sequence[int] | None = None) -> None:
        """Step the envs of some workers without waiting for them; :meth:`recv` takes results.

        With this and :meth:`recv` a learner overlaps its own work (inference, updates) with
        the workers' stepping, and never waits for the slowest worker: send to the workers
        :meth:`recv` returned, while the others are still stepping.

        Args:
            actions: a batch of actions for the envs of ``worker_ids``, in that order
                (``sum`` of their ``num_envs`` rows).
            worker_ids: the workers to step (default: every worker); none may have a step
                sent and not yet received.

        Raises:
            ConfigError: an unknown or repeated worker id, or actions of the wrong shape
                (nothing was sent).
            InvalidState: called before :meth:`reset`, for a worker whose last step is not
                received yet, or while another kind of operation runs.
        """
        await self._lockstep.send(actions, worker_ids)

    async def recv(self, min_workers: int = 1) -> StepReturn:
        """Wait until ``min_workers`` of the workers sent to have answered; return their envs.

        Returns every worker that has answered by then (at least ``min_workers``), in env
        order, batched like :meth:`step`; ``info["env_id"]`` holds each row's global env
        index (as EnvPool does) and ``info["worker_id"]`` the id of the worker that stepped
        it, so ``np.unique(info["worker_id"])`` are the workers to :meth:`send` to next.

        Raises:
            ConfigError: ``min_workers`` is not between 1 and the workers awaited.
            InvalidState: nothing was sent, another ``recv()`` is waiting, or the steps it
                waits for were cancelled meanwhile (by :meth:`aclose`, or a :meth:`send`
                that lost a worker).
            WorkerError | WorkerLost | Timeout: as :meth:`step`.
        """
        return await self._lockstep.recv(min_workers)

    # Each env by name, as Gymnasium's VectorEnv reaches its envs: one request per worker.

    async def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        """Call method ``name(*args, **kwargs)`` of every env, on the workers.

        An attribute that is not callable is returned as it is (Gymnasium's ``call``).

        Returns:
            One value per env, in env order.

        Raises:
            ConfigError: an argument is not plain data (numbers, strings, numpy arrays,
                tuples, dicts with str keys); nothing was sent.
            WorkerError: an env raised, or returned a value that is not plain data.
            InvalidState | WorkerLost | Timeout: as :meth:`step`.
        """
        return await self.env_call("call", name, args=args, kwargs=kwargs or None)

    async def get_attr(self, name: str) -> tuple[Any, ...]:
        """The value of attribute ``name`` of every env, in env order; see :meth:`call`."""
        return await self.env_call("get_attr", name)

    async def set_attr(self, name: str, values: Any) -> None:
        """Set attribute ``name`` of every env to ``values[i]`` (or to ``values`` on all).

        As Gymnasium's ``set_attr``: a list or tuple holds one value per env; anything else
        is set on every env. Values travel as data (see :meth:`call`).

        Raises:
            ConfigError: a list or tuple whose length is not :attr:`num_envs`, or values that
                are not plain data.
        """
        await self.wait_for_workers()
        n = self.num_envs
        if isinstance(values, list | tuple):
            if len(values) != n:
                raise ConfigError(
                    f"set_attr({name!r}) got {len(values)} values for {n} envs; pass one value "
                    "per env, or a single value (not a list or tuple) for all of them"
                )
            per_env = tuple(values)
        else:
            per_env = (values,) * n
        await self.env_call("set_attr", name, values=per_env)

    async def render(self) -> tuple[Any, ...]:
        """Every env's ``render()``, in env order (frames for ``render_mode="rgb_array"``)."""
        return await self.env_call("render", "render")

    async def env_call(
        self,
        kind: str,
        name: str,
        *,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
        values: Sequence[Any] | None = None,
        indices: Sequence[int] | None = None,
    ) -> tuple[Any, ...]:
        """The general form of :meth:`call`, :meth:`get_attr`, :meth:`set_attr`, :meth:`render`.

        Args:
            kind: ``"call"``, ``"get_attr"``, ``"set_attr"``, ``"render"`` or
                ``"is_wrapped"`` (``name`` is then a wrapper class's ``"module.QualName"``:
                whether it, or a subclass, wraps each env).
            name: the method, attribute or class name.
            args: positional arguments of ``"call"``.
            kwargs: keyword arguments of ``"call"``.
            values: for ``"set_attr"``, one value per env reached.
            indices: the envs to reach, in the order of the values returned (``None``: all).
                Reaching chosen envs needs workers that hold their envs in their own
                process (``vector="sync"``, the default), except for ``"is_wrapped"``,
                which every worker backend answers.

        Returns:
            One value per env reached. Spaces, env specs and numpy Generators come back
            rebuilt from data (a Generator as a copy; see :func:`aps.wire.spaces.value_to_wire`).

        Raises:
            ConfigError: a bad kind, name, index or value count, or arguments that are not
                plain data; nothing was sent.
            WireError: a worker sent a space, env spec or Generator that is not valid.
            WorkerError: an env raised, or returned a value that is not plain data.
            InvalidState | WorkerLost | Timeout: as :meth:`step`.
        """
        if kind not in ENV_CALL_KINDS:
            raise ConfigError(f"kind must be one of {sorted(ENV_CALL_KINDS)}, got {kind!r}")
        _check_name(name)
        await self.wait_for_workers()
        n = self.num_envs
        if indices is not None:
            indices = list(indices)
            if not all(_is_int(i) and 0 <= int(i) < n for i in indices):
                raise ConfigError(f"indices must be env indices in [0, {n}), got {indices!r}")
            indices = [int(i) for i in indices]
        reached = n if indices is None else len(indices)
        if kind == "set_attr" and (values is None or len(values) != reached):
            raise ConfigError(
                f"set_attr({name!r}) needs one value per env reached ({reached}), got "
                f"{values!r:.200}"
            )
        results = await self._lockstep.env_call(kind, name, args, kwargs, values, indices)
        # Spaces, env specs and Generators travel as tagged maps (aps.wire.spaces.value_to_wire).
        return tuple(value_from_wire(value) for value in results)

    # DETACH: workers act with their own policy copy.

    @property
    def version(self) -> int:
        """The newest published policy version (0 before the first :meth:`publish`)."""
        return self._detach.version

    @property
    def sync(self) -> SyncStrategy:
        """The sync strategy; assigning one applies from the next decision on."""
        return self._detach.sync

    @sync.setter
    def sync(self, strategy: SyncStrategy) -> None:
        if not isinstance(strategy, SyncStrategy):
            raise ConfigError(
                f"sync must have a should_sync(ctx) method (see aps.sync), got {strategy!r}"
            )
        self._detach.sync = strategy

    @property
    def metrics(self) -> Metrics:
        """Syncs, weight bytes, divergences and policy lag, per worker and in total.

        Workers that were replaced keep their entries, before the current ones.
        """
        pool = self._pool
        workers = (*pool.slots.former, *(r.metrics for r in pool.slots.admitted))
        now = time.monotonic()
        requests = pool.requests
        return Metrics(
            version=self.version,
            workers=tuple(w.snapshot() for w in workers),
            taken_at=now,
            uptime=now - self._started_at,
            cpu_seconds=time.process_time() - self._cpu_at_start,
            lockstep_calls=requests.calls,
            lockstep_wait_seconds=requests.wait_seconds,
            queue_depth=self._detach.queue_depth,
            chunk_wait_seconds=self._detach.chunk_wait,
        )

    async def publish(self, agent: Any, *, epsilon: float | None = None) -> int:
        """Make ``agent``'s current weights a new policy version.

        Workers that hold no version yet get it at once; for the others the sync strategy
        decides, before each of their next rollouts, whether it travels.

        Args:
            agent: the ``nn.Module`` being trained (a CleanRL-style agent; see
                :mod:`aps.policy`) or an :class:`aps.policy.Policy`.
            epsilon: exploration rate for epsilon-greedy Q-policies (``None``: unchanged).

        Returns:
            The new version number (1, 2, ...).

        Raises:
            InvalidState: the learner has no ``policy``.
            ConfigError: the agent is not a policy aps can run.
            WorkerLost: a worker disconnected while receiving its first version.
        """
        await self.wait_for_workers()
        return await self._detach.publish(agent, epsilon=epsilon)

    async def rollout(self, num_steps: int) -> Rollout:
        """Have every worker act ``num_steps`` times with its policy copy; gather the batch.

        Before asking a worker, the sync strategy decides whether it gets the newest version.
        All workers act at once; the result is ``[num_steps, num_envs]`` in env order.

        Raises:
            InvalidState: no policy, nothing published, no reset yet, or another call running.
            WorkerError: an env or the policy raised on a worker.
            WorkerLost | Timeout | ProtocolError: a worker failed; the learner is unusable.
        """
        if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
            raise ConfigError(f"num_steps must be an int >= 1, got {num_steps!r}")
        await self.wait_for_workers()
        return await self._detach.rollout(num_steps)

    def chunks(self, num_steps: int, *, max_in_flight: int = 2) -> AsyncGenerator[Chunk, None]:
        """Stream chunks of ``num_steps`` steps from every worker, as they arrive.

        Each worker keeps acting without waiting for the others: it has up to
        ``max_in_flight`` requests outstanding, and a new one is sent when the caller takes
        one of its chunks (so a slow consumer bounds the memory on both sides, and a chunk
        is at most ``max_in_flight`` chunks older than the consumer). The sync strategy runs
        before each request. Publish from inside the loop to train off-policy.

        Leaving the loop (break, an error, or the next reset/step/rollout) stops the
        stream; chunks still in flight are received and dropped (counted in
        :attr:`metrics` as ``dropped_chunks``).

        Raises:
            InvalidState: no policy, nothing published, no reset yet, or another call running.
            WorkerError: an env or the policy raised on a worker.
            WorkerLost | Timeout | ProtocolError: a worker failed; the learner is unusable.
        """
        return self._detach.chunks(num_steps, max_in_flight)

    async def form_weight_group(self, *, timeout: float | None = None) -> WeightGroup:
        """Fan versions out through a gloo group of the learner and its workers from now on.

        Each version published afterwards leaves the learner once, in one collective in which
        the learner sends less than two copies however many workers there are (see
        :mod:`aps.learner.fanout`); the sync strategy still decides per worker when it acts
        with it, and the session carries only that decision. Every worker admitted now
        joins (each needs torch with gloo). The group ends for good, and versions travel over
        the sessions again, when a member is lost, replaced or resumes, or a collective
        fails; form a new one then. Gloo's connections are not authenticated: use a group on
        a network you trust.

        Args:
            timeout: seconds the group may take to form, and each collective (default
                ``timeouts.step``).

        Returns:
            The group (:attr:`weight_group` until it ends): its ``versions`` and
            ``bytes_sent``.

        Raises:
            InvalidState: no policy, or another call is running.
            WorkerError: a worker could not join (no torch there, say).
            Timeout: the group did not form in time.
        """
        await self.wait_for_workers()
        seconds = self._pool.config.timeouts.step if timeout is None else timeout
        if not isinstance(seconds, int | float) or not 0 < seconds < math.inf:
            raise ConfigError(f"timeout must be a positive number of seconds, got {timeout!r}")
        return await self._detach.form_group(float(seconds))

    @property
    def weight_group(self) -> WeightGroup | None:
        """The weight group versions fan out through (:meth:`form_weight_group`), or ``None``."""
        return self._detach.group

    # Gradient rounds (Rennala / Malenia NIGT); aps.pg.NIGT drives these.

    @property
    def gradient_workers(self) -> tuple[WorkerInfo, ...]:
        """The workers taking part in gradient rounds (all, minus those dropped)."""
        return self._rounds.workers

    async def start_round(
        self, round_id: int, arrays: dict[str, Array], *, horizon: int, gamma: float
    ) -> int:
        """Broadcast a gradient round: every worker samples at ``arrays`` from now on.

        Workers sum their gradients locally and announce only their counts (see
        :meth:`next_report`) until :meth:`collect_gradients`. The first call enters gradient
        mode; later calls replace the round (workers drop what they summed of the last one).
        A worker that replaced a lost one joins at the next call.

        Returns:
            The bytes put on the wire: the encoded round, once per worker, compressed for
            the workers whose connection negotiated a codec (:mod:`aps.wire.compression`).

        Raises:
            InvalidState: no policy, or another operation is running.
            WorkerLost: a worker disconnected (see :meth:`drop_worker`).
        """
        await self.wait_for_workers()
        if self.policy is None:
            raise InvalidState(
                "start_round() needs workers that act: create the learner with "
                "policy='package.module:make_agent' (or 'path/to/script.py:Agent')"
            )
        return await self._rounds.start_round(round_id, arrays, horizon=horizon, gamma=gamma)

    async def collect_gradients(self, round_id: int) -> int:
        """Ask every worker of the round under way for its sum: one report each follows.

        Each worker answers with one :class:`~aps.wire.messages.GradientReport` holding every
        gradient it summed in the round (``count`` 0 and an empty gradient when it has none),
        then samples nothing until the next :meth:`start_round`.

        Returns:
            The bytes put on the wire.

        Raises:
            InvalidState: not in gradient mode.
            ConfigError: ``round_id`` is not the round under way.
        """
        return await self._rounds.collect(round_id)

    async def reduce_gradients(
        self, round_id: int, *, size: int, mean: bool = False
    ) -> tuple[Array, int]:
        """All-reduce the workers' sums of the round under way instead of collecting them.

        The learner opens a ``torch.distributed`` store on its listening address for this
        call only, sends each worker its rank over its session, and takes part in one gloo
        all-reduce (sum) as rank 0. The result has ``size + n`` float32 entries for ``n``
        workers: the sum of the workers' gradient sums (of their means when ``mean``), then
        each worker's count in the order of :attr:`gradient_workers`. Each worker then
        answers one :class:`~aps.wire.messages.GradientsReduced` (count and returns) through
        :meth:`next_report`. Gloo's connections are not authenticated: use this on a
        trusted network only.

        Returns:
            The reduced vector and the bytes of the aps messages sent.

        Raises:
            InvalidState: not in gradient mode.
            ConfigError: ``round_id`` is not the round under way, or a bad ``size``.
            Timeout: the all-reduce did not finish in ``timeouts.step`` seconds.
            MissingDependency: torch lacks ``torch.distributed`` or gloo.
        """
        return await self._rounds.reduce(round_id, size=size, mean=mean)

    async def next_report(
        self,
    ) -> tuple[int, GradientProgress | GradientReport | GradientsReduced]:
        """Wait for the next message of any worker: ``(worker_id, progress or report)``.

        :class:`~aps.wire.messages.GradientProgress` says how many gradients a worker has summed
        in a round (sent whenever it grows); :class:`~aps.wire.messages.GradientReport` is its sum,
        sent once per :meth:`collect_gradients`; :class:`~aps.wire.messages.GradientsReduced`
        ends a worker's part of :meth:`reduce_gradients`. All carry their round id: messages
        of an earlier round may still arrive.

        Raises:
            InvalidState: not in gradient mode.
            WorkerError: sampling or differentiating raised on a worker.
            WorkerLost: a worker disconnected; :meth:`drop_worker` it to go on without it
                (under ``on_worker_lost="drop"`` it is dropped already; under ``"wait"`` this
                announces a replacement, whose reports count from the next round).
            Timeout: no report for ``timeouts.step`` seconds.
        """
        return await self._rounds.next_report()

    def drop_worker(self, worker_id: int) -> None:
        """Leave a lost worker out of the rest of gradient mode.

        The learner's env batch no longer matches its workers afterwards, so lockstep calls
        (reset, step, rollout) refuse from then on. Dropping a worker that was dropped or
        replaced already does nothing.
        """
        self._rounds.drop_worker(worker_id)

    async def stop_gradients(self) -> None:
        """Leave gradient mode: every worker stops and confirms; late reports are dropped."""
        await self._rounds.aclose()


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def _check_name(name: object) -> str:
    if not isinstance(name, str) or not name:
        raise ConfigError(
            f"name must be the name of an env method or attribute (a str), got {name!r}"
        )
    return name


def _check_reset_mask(mask: object, num_envs: int) -> None:
    """Refuse a ``reset_mask`` Gymnasium's vector envs would refuse (with ConfigError)."""
    if (
        not isinstance(mask, np.ndarray)
        or mask.dtype != np.bool_
        or mask.shape != (num_envs,)
        or not mask.any()
    ):
        raise ConfigError(
            f"options['reset_mask'] must be a numpy bool array of shape ({num_envs},) with at "
            f"least one True (the envs to reset), got {mask!r:.200}"
        )


def _check_seed(seed: object, num_envs: int) -> int | tuple[int | None, ...] | None:
    """``seed`` as :meth:`Learner.reset` takes it, checked against ``num_envs`` envs."""
    if seed is None:
        return None
    if _is_int(seed):
        return int(seed)  # type: ignore[call-overload, no-any-return]
    if isinstance(seed, list | tuple) and len(seed) == num_envs:
        if all(s is None or _is_int(s) for s in seed):
            return tuple(None if s is None else int(s) for s in seed)
    raise ConfigError(
        f"seed must be an int, None, or a list of {num_envs} ints or Nones (one per env), "
        f"got {seed!r}"
    )
