"""Env functions (thunks) for local workers, as ``AsyncVectorEnv`` takes them.

``ClusterEnv.local([make_env(i) for i in range(n)])`` hands each local worker its slice of
the functions: an in-process worker gets them as they are, a worker subprocess gets them
pickled (cloudpickle, so closures and functions of ``__main__`` travel) over its stdin. The
stdin of a child this process started is not the network: the bytes come from the same user
and never cross a socket, exactly as Gymnasium's ``AsyncVectorEnv`` hands its subprocesses
their env functions. Nothing received from the network is ever unpickled.

A worker builds its vector env by calling one env function once per env, in order;
:class:`EnvFns` is that function: its ``k``-th call builds env ``k`` with the ``k``-th thunk.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any, BinaryIO

import gymnasium as gym

__all__ = ["ENV_SPEC", "EnvFns", "next_env", "receive", "stdin_command"]

ENV_SPEC = "aps.launch._thunks:next_env"
"""The ``--env`` of a worker subprocess that received its env functions over stdin."""


class EnvFns:
    """One env function that builds env ``k`` with ``fns[k]`` on its ``k``-th call.

    Calls past the last one start over (a worker that builds its envs again builds them in
    the same order).
    """

    def __init__(self, fns: Sequence[Callable[[], gym.Env[Any, Any]]]) -> None:
        self.fns = list(fns)
        self._calls = 0

    def __call__(self) -> gym.Env[Any, Any]:
        fn = self.fns[self._calls % len(self.fns)]
        self._calls += 1
        return fn()


_received: EnvFns | None = None


def next_env() -> gym.Env[Any, Any]:
    """The next env of the functions this worker process received over its stdin."""
    if _received is None:
        raise RuntimeError(
            f"{ENV_SPEC} builds envs only in a worker started by ClusterEnv.local with a list "
            "of env functions"
        )
    return _received()


def stdin_command() -> list[str]:
    """The command that starts a worker which reads its env functions from stdin first.

    ``aps worker --env-fns-stdin`` (see :func:`receive`); the caller appends the learner's
    address and the worker's arguments.
    """
    # -P: the current directory must not shadow the aps this process runs.
    return [sys.executable, "-P", "-m", "aps", "worker", "--env-fns-stdin"]


def receive(stream: BinaryIO) -> None:
    """Read the pickled env functions a parent wrote to ``stream``; :func:`next_env` uses them.

    Only for ``aps worker --env-fns-stdin``, whose stdin is the pipe of the process that
    started it (:class:`~aps.launch.LocalWorkers`), never a socket.
    """
    global _received
    _received = EnvFns(pickle.loads(stream.read()))  # our parent's bytes, never the network's
