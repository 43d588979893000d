"""Start a learner's workers: on this machine, as Ray actors, or as a Slurm job.

Every launcher implements :class:`Launcher` (start, status, watch, stop) for a
:class:`WorkerSpec`; give one to :class:`aps.ClusterEnv` or :class:`aps.Learner` as
``launcher=`` and the learner starts it once bound, watches it while waiting for the workers
and stops it when it closes::

    launcher = aps.launch.slurm("CartPole-v1", nodes=4, tasks_per_node=8, envs_per_worker=16,
                                partition="cpu", time="02:00:00")
    envs = aps.ClusterEnv("tcp://0.0.0.0:7000", num_workers=32, token=token, launcher=launcher)

The functions :func:`local`, :func:`ray` and :func:`slurm` build the launchers
(:class:`LocalWorkers`, :class:`RayWorkers`, :class:`SlurmJob`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from aps.launch.base import Launcher, LaunchStatus, WorkerSpec, dialable_url, env_import_path
from aps.launch.local import LocalWorkers
from aps.launch.ray import Placement, RayWorkers
from aps.launch.slurm import SlurmJob, sbatch_script
from aps.session import Timeouts
from aps.worker import EnvSpec

# The functions below share their names with the submodules; they are defined after the
# submodules are imported, so ``aps.launch.ray`` is the function and
# ``from aps.launch.ray import RayWorkers`` still reaches the module.

__all__ = [
    "LaunchStatus",
    "Launcher",
    "LocalWorkers",
    "RayWorkers",
    "SlurmJob",
    "WorkerSpec",
    "dialable_url",
    "env_import_path",
    "local",
    "ray",
    "sbatch_script",
    "slurm",
]


def local(
    env: EnvSpec,
    *,
    num_workers: int,
    envs_per_worker: int = 1,
    env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
    seed: int | None = None,
    compute_delays: Sequence[float] | None = None,
    comm_delays: Sequence[float] | None = None,
    timeouts: Timeouts | None = None,
    use_uvloop: bool | None = None,
    log_level: str = "WARNING",
    restart: bool = False,
    max_restarts: int = 100,
    vector: str = "sync",
    tls_ca: str | None = None,
) -> LocalWorkers:
    """Workers on this machine: subprocesses, or tasks for ``memory://``.

    Subprocesses serve ``tcp://``, ``unix://``, ``ws://`` and plug-in URLs. See
    :class:`LocalWorkers`; the learner hands them its token. ``restart=True`` replaces workers
    that end early (use it with ``on_worker_lost="wait"``).
    """
    return LocalWorkers(
        env,
        num_workers=num_workers,
        envs_per_worker=envs_per_worker,
        env_kwargs=env_kwargs,
        seed=seed,
        compute_delays=compute_delays,
        comm_delays=comm_delays,
        timeouts=timeouts,
        use_uvloop=use_uvloop,
        log_level=log_level,
        restart=restart,
        max_restarts=max_restarts,
        vector=vector,
        tls_ca=tls_ca,
    )


def ray(
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
    **kwargs: Any,
) -> RayWorkers:
    """Workers as Ray actors, one process each, with per-worker resource requests.

    See :class:`RayWorkers` for every argument (``init_kwargs``, ``runtime_env``,
    ``learner_host``, ``env_kwargs``, ``seed``...).

    Raises:
        MissingDependency: Ray is not installed (``pip install 'aps-rl[ray]'``).
    """
    return RayWorkers(
        env,
        num_workers=num_workers,
        envs_per_worker=envs_per_worker,
        num_cpus=num_cpus,
        num_gpus=num_gpus,
        resources=resources,
        placement=placement,
        address=address,
        restart=restart,
        max_restarts=max_restarts,
        **kwargs,
    )


def slurm(
    env: EnvSpec,
    *,
    nodes: int = 1,
    tasks_per_node: int = 1,
    envs_per_worker: int = 1,
    partition: str | None = None,
    time: str | None = None,
    extra_sbatch: Sequence[str] = (),
    **kwargs: Any,
) -> SlurmJob:
    """Workers as one Slurm job of ``nodes * tasks_per_node`` tasks, one worker per task.

    See :class:`SlurmJob` for every argument (``cpus_per_task``, ``directory``,
    ``learner_host``, ``seed``...).
    """
    return SlurmJob(
        env,
        nodes=nodes,
        tasks_per_node=tasks_per_node,
        envs_per_worker=envs_per_worker,
        partition=partition,
        time=time,
        extra_sbatch=extra_sbatch,
        **kwargs,
    )
