"""Start workers as Ray actors: one actor, one process, one aps worker dialing the learner.

Ray schedules the actors (per-worker CPU, GPU and custom resource requests, spread over the
nodes or packed onto few through a placement group) and reports their death; aps does the
rest as usual. Ray is optional: ``pip install 'aps-rl[ray]'``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal

from aps.errors import ApsError, ConfigError, InvalidState, MissingDependency, WorkerLost
from aps.launch.base import LaunchStatus, WorkerSpec, dialable_url, env_import_path
from aps.session import Timeouts
from aps.worker import EnvSpec

__all__ = ["RayWorkers"]

log = logging.getLogger("aps.launch")

Placement = Literal["spread", "pack", "strict_spread", "strict_pack"]
_PLACEMENTS = ("spread", "pack", "strict_spread", "strict_pack")


def import_ray() -> Any:
    """Import Ray, or say how to install it.

    Raises:
        MissingDependency: Ray is not installed.
    """
    try:
        import ray
    except ImportError as exc:
        raise MissingDependency(
            "the Ray launcher needs Ray, which is not installed; pip install 'aps-rl[ray]'"
        ) from exc
    return ray


class _WorkerActor:
    """Runs in its own Ray worker process: one aps worker that dials the learner.

    Ray re-runs the constructor when it restarts the actor, and retries :meth:`serve` there
    (with ``restart=True``), so a restarted actor dials the learner again.
    """

    def __init__(self, index: int, spec: WorkerSpec, use_uvloop: bool | None) -> None:
        self.index = index
        self.spec = spec
        self.use_uvloop = use_uvloop

    def where(self) -> tuple[str, int]:
        """``(host name, pid)`` of this actor's process; answers while :meth:`serve` runs."""
        import os
        import socket

        return socket.gethostname(), os.getpid()

    def serve(self) -> None:
        """Serve the learner until it says goodbye.

        Raises:
            RuntimeError: the worker failed; the message is the aps error's type and text
                (aps errors with keyword arguments do not survive Ray's pickling).
        """
        from aps.launch.base import client_factory
        from aps.session._loop import run
        from aps.worker import Worker

        spec, index = self.spec, self.index
        logging.basicConfig(
            level=spec.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
        )
        assert spec.url is not None
        try:
            worker = Worker(
                spec.url,
                spec.env,
                num_envs=spec.envs_per_worker,
                seed=spec.seed_of(index),
                token=spec.token,
                env_kwargs=spec.env_kwargs_of(index),
                timeouts=Timeouts(connect=spec.connect_timeout),
                factory=client_factory(spec.url, spec.tls_ca),
                compute_delay=spec.compute_delay_of(index),
                comm_delay=spec.comm_delay_of(index),
                label=str(index),
                policy=spec.policy,
                vector=spec.vector,
            )
            run(worker.run(), use_uvloop=self.use_uvloop)
        except ApsError as exc:
            raise RuntimeError(f"{type(exc).__name__}: {exc}") from None


class RayWorkers:
    """Runs ``num_workers`` aps workers as Ray actors; a :class:`~aps.launch.Launcher`.

    Uses Ray as this process already runs it (after a ``ray.init``), else calls
    ``ray.init(address=address, **init_kwargs)`` (and ``ray.shutdown()`` on
    :meth:`stop`). Each actor reserves
    ``num_cpus``, ``num_gpus`` and ``resources``; with a placement group the whole set is
    reserved at once (``"spread"`` over the nodes, ``"pack"`` onto as few as possible, or
    their ``strict_`` forms). ``env_kwargs``, ``seed``, ``compute_delays``, ``comm_delays``,
    ``log_level``, ``connect_timeout``, ``tls_ca`` and ``vector`` are
    :class:`~aps.launch.WorkerSpec`'s.

    Args:
        env: a Gymnasium id, ``"module:factory"``, ``"path.py:factory"`` or a module-level
            function, importable on every node.
        num_workers: how many actors (workers).
        envs_per_worker: envs hosted by each worker.
        num_cpus: CPUs each actor reserves (Ray also sets its ``OMP_NUM_THREADS``).
        num_gpus: GPUs each actor reserves (Ray sets its ``CUDA_VISIBLE_DEVICES``).
        resources: custom resources each actor reserves, e.g. ``{"env_node": 1}``.
        placement: ``"spread"`` (default), ``"pack"``, ``"strict_spread"``,
            ``"strict_pack"``, or ``None`` for Ray's default scheduling without a
            placement group.
        address: the Ray cluster to join when Ray is not running here yet (``"auto"``,
            ``"ray://head:10001"``); ``None`` starts a local Ray.
        restart: let Ray restart a dead actor (up to ``max_restarts`` times); the restarted
            actor dials the learner again as a new worker. A learner with
            ``on_worker_lost="wait"`` gives it the lost worker's env slots; under
            ``"raise"`` it is refused once all workers are admitted, and restarts only help
            with deaths during start-up (a preempted node).
        max_restarts: how many restarts per actor with ``restart=True``.
        init_kwargs: more ``ray.init`` arguments, used only when this launcher starts Ray.
        runtime_env: Ray's runtime environment for the actors (``working_dir``, ``pip``,
            ``env_vars``), e.g. to ship a local env module to the nodes.
        learner_host: the name or address actors dial when the learner listens on a
            wildcard address (``0.0.0.0``); default the driver node's IP as Ray sees it.
        use_uvloop: the actors' event loop (default: uvloop when installed).
        poll_interval: seconds between two checks of :meth:`watch`.

    Raises:
        MissingDependency: Ray is not installed.
        ConfigError: bad arguments.
    """

    def __init__(
        self,
        env: EnvSpec,
        *,
        num_workers: int,
        envs_per_worker: int = 1,
        num_cpus: float = 1,
        num_gpus: float = 0,
        resources: Mapping[str, float] | None = None,
        placement: Placement | None = "spread",
        address: str | None = None,
        restart: bool = False,
        max_restarts: int = 3,
        init_kwargs: Mapping[str, Any] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        learner_host: str | None = None,
        env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        seed: int | None = None,
        compute_delays: Sequence[float] | None = None,
        comm_delays: Sequence[float] | None = None,
        log_level: str = "WARNING",
        connect_timeout: float = Timeouts().connect,
        tls_ca: str | None = None,
        vector: str = "sync",
        use_uvloop: bool | None = None,
        poll_interval: float = 0.2,
    ) -> None:
        import_ray()
        self._spec = WorkerSpec.of(
            env_import_path(env),
            num_workers=num_workers,
            envs_per_worker=envs_per_worker,
            env_kwargs=env_kwargs,
            seed=seed,
            compute_delays=compute_delays,
            comm_delays=comm_delays,
            log_level=log_level,
            connect_timeout=connect_timeout,
            tls_ca=tls_ca,
            vector=vector,
        )
        for name, value in (("num_cpus", num_cpus), ("num_gpus", num_gpus)):
            if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"{name} must be a number >= 0, got {value!r}")
        self._resources = {str(k): float(v) for k, v in (resources or {}).items()}
        if placement is not None and placement not in _PLACEMENTS:
            raise ConfigError(f"placement must be one of {_PLACEMENTS} or None, got {placement!r}")
        bundle = {"CPU": float(num_cpus), "GPU": float(num_gpus), **self._resources}
        self._bundle = {k: v for k, v in bundle.items() if v > 0}
        if placement is not None and not self._bundle:
            raise ConfigError(
                "a placement group needs each worker to reserve something; give num_cpus > 0 "
                "(or num_gpus, resources), or placement=None"
            )
        if not isinstance(max_restarts, int) or max_restarts < 0:
            raise ConfigError(f"max_restarts must be an int >= 0, got {max_restarts!r}")
        if not poll_interval > 0:
            raise ConfigError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        self.num_workers = num_workers
        self._num_cpus = float(num_cpus)
        self._num_gpus = float(num_gpus)
        self._placement = placement
        self._address = address
        self._restart = bool(restart)
        self._max_restarts = max_restarts
        self._init_kwargs = dict(init_kwargs or {})
        self._runtime_env = dict(runtime_env) if runtime_env is not None else None
        self._learner_host = learner_host
        self._use_uvloop = use_uvloop
        self._poll_interval = poll_interval
        self._owns_ray = False
        self._placement_group: Any = None
        self._actors: list[Any] = []
        self._runs: list[Any] = []
        self._ended: dict[int, str] = {}
        self._state = "not started"

    @property
    def spec(self) -> WorkerSpec:
        """What each worker runs."""
        return self._spec

    @property
    def actors(self) -> tuple[Any, ...]:
        """The Ray actor handles, in worker order (e.g. for ``ray.kill``)."""
        return tuple(self._actors)

    async def start(self, url: str, spec: WorkerSpec | None = None) -> None:
        """Start the actors (after starting or joining Ray); returns once they are submitted.

        Raises:
            MissingDependency: Ray is not installed.
            LaunchError: Ray could not start or join the cluster.
        """
        if self._state != "not started":
            raise InvalidState(f"this Ray launcher is {self._state}; make a new one")
        ray = import_ray()
        await asyncio.to_thread(self._init_ray, ray)
        # A wildcard address becomes the driver node's IP, which the other nodes reach.
        url = dialable_url(url, self._learner_host, default_host=ray.util.get_node_ip_address())
        spec = replace(spec or self._spec, url=url)
        spec = replace(spec, env=env_import_path(spec.env))
        self._state = "starting"
        await asyncio.to_thread(self._start_actors, ray, spec)
        self._state = "running"
        log.info("started %d Ray worker actors dialing %s", spec.num_workers, spec.url)

    def _init_ray(self, ray: Any) -> None:
        if ray.is_initialized():
            return
        from aps.errors import LaunchError

        try:
            ray.init(address=self._address, **self._init_kwargs)
        except Exception as exc:  # Ray raises ConnectionError, ValueError, RuntimeError...
            raise LaunchError(
                f"could not start or join Ray (address={self._address!r}): {exc}",
                stderr=str(exc),
            ) from exc
        self._owns_ray = True

    def _start_actors(self, ray: Any, spec: WorkerSpec) -> None:
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._placement is not None:
            self._placement_group = placement_group(
                [dict(self._bundle) for _ in range(spec.num_workers)],
                strategy=self._placement.upper(),
            )
        actor_class = ray.remote(_WorkerActor)
        for index in range(spec.num_workers):
            options: dict[str, Any] = {
                "num_cpus": self._num_cpus,
                "num_gpus": self._num_gpus,
                "max_restarts": self._max_restarts if self._restart else 0,
                # With restarts, Ray runs serve() again on the restarted actor.
                "max_task_retries": -1 if self._restart else 0,
                # serve() holds one thread for the actor's life; where() gets the other.
                "max_concurrency": 2,
            }
            if self._resources:
                options["resources"] = self._resources
            if self._runtime_env is not None:
                options["runtime_env"] = self._runtime_env
            if self._placement_group is not None:
                options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                    placement_group=self._placement_group,
                    placement_group_bundle_index=index,
                )
            actor = actor_class.options(**options).remote(index, spec, self._use_uvloop)
            self._actors.append(actor)
            self._runs.append(actor.serve.remote())

    async def status(self) -> LaunchStatus:
        """The launch state, the placement group's and each actor's, as far as known."""
        await asyncio.to_thread(self._collect)
        workers = tuple(
            f"actor {index} {self._ended.get(index, 'running')}" for index in range(len(self._runs))
        )
        detail = ""
        if self._placement_group is not None:
            detail = f"placement group {await asyncio.to_thread(self._placement_state)}"
        return LaunchStatus("ray", self._state, workers, detail)

    def _placement_state(self) -> str:
        from ray.util.placement_group import placement_group_table

        try:
            table = placement_group_table(self._placement_group)
        except Exception as exc:  # a report must not fail on a vanished group
            return f"unknown ({exc})"
        return f"{table.get('strategy', '?')} {table.get('state', '?')}"

    def _collect(self) -> None:
        """Note every actor whose serve() call has ended, and how."""
        pending = [r for i, r in enumerate(self._runs) if i not in self._ended]
        if not pending:
            return
        ray = import_ray()
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0)
        for ref in ready:
            index = self._runs.index(ref)
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._ended[index] = f"died: {_first_line(exc)}"
            except ray.exceptions.RayTaskError as exc:
                self._ended[index] = f"failed: {_first_line(exc.cause or exc)}"
            except Exception as exc:
                self._ended[index] = f"failed: {_first_line(exc)}"
            else:
                self._ended[index] = "finished"

    async def watch(self) -> None:
        """Return never while the actors serve; raise when one ends first.

        Raises:
            WorkerLost: an actor died (killed, its node lost, out of memory, out of
                restarts) or its worker failed or left; ``worker_id`` is the actor's index.
        """
        while True:
            await asyncio.to_thread(self._collect)
            for index, how in sorted(self._ended.items()):
                raise WorkerLost(
                    f"Ray worker actor {index} ({_actor_name(self._actors[index])}) {how} "
                    "before the learner closed",
                    worker_id=index,
                )
            await asyncio.sleep(self._poll_interval)

    async def stop(self, grace: float = 5.0) -> None:
        """End the actors; idempotent.

        They get ``grace`` seconds to end after the learner's goodbye; then they are killed,
        the placement group is removed, and Ray is shut down if this launcher started it.
        """
        if self._state in ("not started", "stopped"):
            self._state = "stopped"
            return
        self._state = "stopped"
        ray = import_ray()
        await asyncio.to_thread(self._stop, ray, grace)

    def _stop(self, ray: Any, grace: float) -> None:
        from ray.util.placement_group import remove_placement_group

        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=grace)
        self._collect()
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already gone
                log.debug("killing a Ray actor: %r", exc)
        if self._placement_group is not None:
            try:
                remove_placement_group(self._placement_group)
            except Exception as exc:
                log.debug("removing the placement group: %r", exc)
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _actor_name(actor: Any) -> str:
    actor_id = getattr(actor, "_actor_id", None)  # Ray has no public accessor on a handle
    return f"actor id {actor_id.hex()}" if actor_id is not None else repr(actor)
