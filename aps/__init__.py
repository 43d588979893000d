"""aps: run Gymnasium environments on remote workers over asyncio; learning stays central.

Three ways in:

- an await loop: ``async with aps.Learner("tcp://127.0.0.1:0", num_workers=2) as learner``;
- a blocking Gymnasium vector env: ``aps.ClusterEnv.local("CartPole-v1", num_workers=2)``;
- transport plug-ins: :mod:`aps.transports` and the conformance suite in :mod:`aps.testing`.

Workers either step with the learner's actions (lockstep) or act with their own copy of the
policy (DETACH: ``publish``, ``rollout``, ``chunks``); :mod:`aps.sync` decides when a new
policy version travels, Adaptive Policy Synchronization (:class:`aps.sync.APS`) among them.
"""

from __future__ import annotations

from aps._version import __version__ as __version__
from aps.cluster_env import ClusterEnv
from aps.errors import (
    ApsError,
    AuthError,
    ConfigError,
    ConnectError,
    ConnectionLost,
    EndOfStream,
    FrameTooLarge,
    InvalidState,
    LaunchError,
    MissingDependency,
    ProtocolError,
    Timeout,
    TransportClosed,
    TransportError,
    VersionMismatch,
    WireError,
    WorkerError,
    WorkerLost,
)
from aps.learner import Learner, WorkerInfo
from aps.learner.rollouts import Chunk, Metrics, Rollout, WorkerMetrics
from aps.session import Timeouts
from aps.worker import Worker

__all__ = [
    # Roles and the blocking facade.
    "ClusterEnv",
    "Learner",
    "Timeouts",
    "Worker",
    "WorkerInfo",
    # Worker-side inference (DETACH): what rollouts and chunk streams return.
    "Chunk",
    "Metrics",
    "Rollout",
    "WorkerMetrics",
    # Errors (the tree is drawn in aps.errors).
    "ApsError",
    "AuthError",
    "ConfigError",
    "ConnectError",
    "ConnectionLost",
    "EndOfStream",
    "FrameTooLarge",
    "InvalidState",
    "LaunchError",
    "MissingDependency",
    "ProtocolError",
    "Timeout",
    "TransportClosed",
    "TransportError",
    "VersionMismatch",
    "WireError",
    "WorkerError",
    "WorkerLost",
]
