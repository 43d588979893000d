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

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType as _ModuleType

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


_MOVED = {
    **{
        f"aps.{name}": f"aps.wire.{name}"
        for name in (
            "messages",
            "codec",
            "compression",
            "frame_delta",
            "spaces",
            "batching",
            "framing",
        )
    },
    **{f"aps.{name}": f"aps.session.{name}" for name in ("protocol", "delivery")},
    "aps.pg.trainer": "aps.learner.trainer",
    "aps.pg.simulate": "aps.learner.simulate",
    "aps.pg.sampling": "aps.worker.sampling",
}
"""Modules that moved into the folders of their layers, by their old import paths.

``import aps.framing`` (a transport plug-in's frame helper) and the others still work: each
old path is the very module of its new one."""


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds a module by its old path (``_MOVED``) and hands over the module itself."""

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> _ModuleType:
        # The module under its new name; its own name and spec stay that one's.
        return importlib.import_module(_MOVED[spec.name])

    def exec_module(self, module: _ModuleType) -> None:
        """Nothing to run: the module was run under its new name."""


if not any(isinstance(finder, _Moved) for finder in sys.meta_path):
    sys.meta_path.append(_Moved())
