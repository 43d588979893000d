"""Throughput: env-steps per second delivered to the learner, aps next to its peers, one run.

CartPole-v1 on 2 workers x E envs per worker (E in 1, 16, 64). The learner sends random
actions every step, taken round-robin from a small pool generated up front, so action
generation is not measured. Contenders:

- ``aps-tcp``: the blocking ``aps.ClusterEnv.local(..., transport="tcp")`` users use;
- ``aps-ws``: the same over WebSocket;
- ``aps-tcp-async``: the await-based ``aps.Learner`` over TCP, with its workers started as
  ``python -m aps worker`` subprocesses (its gap to ``aps-tcp`` is the blocking facade's cost);
- ``gym-sync``: Gymnasium ``SyncVectorEnv`` of all 2 x E envs in the learner process;
- ``gym-async``: Gymnasium ``AsyncVectorEnv`` with one subprocess per aps worker; each hosts
  its E envs as ONE env (a ``SyncVectorEnv`` behind :class:`BatchedEnv`, autoreset inside)
  with shared memory, so a step moves one message per process, as aps does;
- ``zmq-json`` (only if pyzmq is importable): a ROUTER/DEALER learner with JSON-list messages
  and a ``SyncVectorEnv`` per worker, in the style of the ClusterEnv reference prototype;
- ``ray`` (only if ray is importable): one Ray actor per worker holding a ``SyncVectorEnv``.

Method: every contender of one size is started, reset and warmed up; then each timed window
(default 3 s) runs round-robin over the contenders, ``--repeats`` times, the order rotating
each round, so machine noise hits all contenders alike. The table reports the median and the
min-max of the windows, and ratios of the medians (with the min-max of the per-round paired
ratios). Nothing here asserts on wall-clock numbers.

Usage::

    python benchmarks/throughput.py                  # 1,16,64 envs/worker, 3 s windows, 3 rounds
    python benchmarks/throughput.py --quick          # 1,64 envs/worker, 1 s windows
    python benchmarks/throughput.py --contenders aps-tcp,gym-async --sizes 64
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import gymnasium as gym
import numpy as np
from gymnasium.vector import AsyncVectorEnv, AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import batch_space

import aps
from aps.launch.local import terminate
from aps.session._loop import new_event_loop

ROOT = Path(__file__).resolve().parent
DEFAULT_JSON = ROOT / "results" / "throughput.json"
LOOPBACK = "127.0.0.1"
POOL_SIZE = 32  # distinct pre-generated action batches, used round-robin
START_TIMEOUT = 60.0  # seconds for a contender's workers to come up
STOP_GRACE = 5.0  # seconds a subprocess gets to leave on its own before it is terminated

Array = np.ndarray[Any, Any]


@dataclass(frozen=True, slots=True)
class Setup:
    """What every contender runs: ``num_workers`` x ``envs_per_worker`` copies of ``env_id``."""

    env_id: str
    num_workers: int
    envs_per_worker: int
    seed: int = 0

    @property
    def num_envs(self) -> int:
        """All envs together."""
        return self.num_workers * self.envs_per_worker


def make_action_pool(setup: Setup, size: int = POOL_SIZE) -> list[Array]:
    """Return ``size`` random batched actions for all envs, each shaped ``(num_envs, ...)``."""
    probe = gym.make(setup.env_id)
    try:
        space = batch_space(probe.action_space, setup.num_envs)
    finally:
        probe.close()
    space.seed(setup.seed)
    return [np.asarray(space.sample()) for _ in range(size)]


def timed_steps(step: Callable[[Any], object], pool: Sequence[Any], seconds: float) -> int:
    """Call ``step`` on the pool's batches in turn for ``seconds``; return how many calls."""
    count = len(pool)
    calls = 0
    deadline = time.perf_counter() + seconds
    while True:
        step(pool[calls % count])
        calls += 1
        if time.perf_counter() >= deadline:
            return calls


def check_alive(processes: Sequence[subprocess.Popen[bytes]], what: str) -> None:
    """Raise if one of ``processes`` has exited."""
    for process in processes:
        code = process.poll()
        if code is not None:
            raise RuntimeError(f"a {what} process (pid {process.pid}) exited with status {code}")


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_seconds(pids: Sequence[int] | None) -> tuple[float, float | None]:
    """CPU seconds (user + system) used so far by this process, and by ``pids`` together.

    The second is ``None`` when ``pids`` is ``None`` (not known) or one of them cannot be
    read (``/proc`` is Linux only). This process's figure covers all its threads.
    """
    times = os.times()
    own = times.user + times.system
    if pids is None:
        return own, None
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            return own, None
        total += (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
    return own, total


@dataclass(frozen=True, slots=True)
class Window:
    """One timed window of one contender."""

    env_steps: int  # env-steps delivered to the learner
    seconds: float  # the wall-clock time they took
    learner_cpu: float  # CPU seconds of the learner process (this one), all threads
    workers_cpu: float | None  # CPU seconds of the worker processes (None: not known)
    # A rate the contender measured itself (a stream's steady state), instead of steps/seconds.
    measured_rate: float | None = None

    @property
    def rate(self) -> float:
        """Env-steps per second."""
        if self.measured_rate is not None:
            return self.measured_rate
        return self.env_steps / self.seconds


# The contenders.


class Contender(abc.ABC):
    """One way for the learner process to step ``setup.num_envs`` envs."""

    name: ClassVar[str]
    description: ClassVar[str]

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        self.setup = setup
        self.pool = pool
        self.note: str | None = None  # set by start() when it ran something else than asked

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this contender cannot run here, or ``None`` if it can."""
        return None

    @classmethod
    def unavailable_for(cls, setup: Setup) -> str | None:
        """Why this contender cannot run ``setup`` here, or ``None`` if it can."""
        return cls.unavailable()

    @abc.abstractmethod
    def start(self) -> None:
        """Start the envs (and any processes) and reset them with ``setup.seed``."""

    @abc.abstractmethod
    def run(self, seconds: float) -> int:
        """Step the envs for about ``seconds`` (at least once); return the env-steps delivered."""

    def window(self, seconds: float) -> Window:
        """Run one timed window of about ``seconds`` and measure its time and CPU."""
        pids = self.worker_pids()
        own_before, workers_before = cpu_seconds(pids)
        start = time.perf_counter()
        env_steps = self.run(seconds)
        elapsed = time.perf_counter() - start
        own_after, workers_after = cpu_seconds(pids)
        workers = None
        if workers_before is not None and workers_after is not None:
            workers = workers_after - workers_before
        return Window(env_steps, elapsed, own_after - own_before, workers)

    @abc.abstractmethod
    def close(self) -> None:
        """Stop everything this contender started; idempotent."""

    def worker_pids(self) -> list[int] | None:
        """The processes that step envs besides this one (``None``: not known)."""
        return []


class ApsClusterEnv(Contender):
    """The blocking facade, ``aps.ClusterEnv.local``."""

    transport: ClassVar[str]

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self._envs: aps.ClusterEnv | None = None

    def start(self) -> None:
        setup = self.setup
        self._envs = aps.ClusterEnv.local(
            setup.env_id,
            num_workers=setup.num_workers,
            envs_per_worker=setup.envs_per_worker,
            transport=self.transport,  # type: ignore[arg-type]
        )
        self._envs.reset(seed=setup.seed)

    def run(self, seconds: float) -> int:
        assert self._envs is not None
        return timed_steps(self._envs.step, self.pool, seconds) * self.setup.num_envs

    def close(self) -> None:
        envs, self._envs = self._envs, None
        if envs is not None:
            envs.close()

    def worker_pids(self) -> list[int] | None:
        assert self._envs is not None
        return [w.pid for w in self._envs.workers]


class ApsTcp(ApsClusterEnv):
    name = "aps-tcp"
    description = "aps.ClusterEnv.local(transport='tcp'), blocking facade"
    transport = "tcp"


class ApsWs(ApsClusterEnv):
    name = "aps-ws"
    description = "aps.ClusterEnv.local(transport='ws'), blocking facade"
    transport = "ws"

    @classmethod
    def unavailable(cls) -> str | None:
        if importlib.util.find_spec("websockets") is None:
            return "the websockets package is not installed (pip install 'aps-rl[websocket]')"
        return None


class ApsTcpAsync(Contender):
    """The await loop: ``aps.Learner`` and ``python -m aps worker`` subprocesses."""

    name = "aps-tcp-async"
    description = "await aps.Learner.step over tcp, workers from 'python -m aps worker'"

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self._runner: asyncio.Runner | None = None
        self._learner: aps.Learner | None = None
        self._processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        setup = self.setup
        self._runner = runner = asyncio.Runner(loop_factory=new_event_loop)
        self._learner = learner = self.make_learner()
        runner.run(learner.start())
        command = [sys.executable, "-m", "aps", "worker", learner.url, "--env", setup.env_id]
        command += ["--num-envs", str(setup.envs_per_worker), "--log-level", "WARNING"]
        if learner.policy is not None:  # a worker runs only the policy its side names
            command += ["--policy", learner.policy]
        for _ in range(setup.num_workers):
            self._processes.append(subprocess.Popen(command))
        runner.run(self._connect_and_reset(learner))

    def make_learner(self) -> aps.Learner:
        """The learner, not yet started (subclasses add options)."""
        return aps.Learner(f"tcp://{LOOPBACK}:0", num_workers=self.setup.num_workers)

    async def _connect_and_reset(self, learner: aps.Learner) -> None:
        waiting = asyncio.ensure_future(learner.wait_for_workers(timeout=START_TIMEOUT))
        try:
            while not waiting.done():
                check_alive(self._processes, "'python -m aps worker'")
                await asyncio.wait({waiting}, timeout=0.1)
        finally:
            waiting.cancel()
            await asyncio.wait({waiting})
        waiting.result()
        await learner.reset(seed=self.setup.seed)

    def run(self, seconds: float) -> int:
        assert self._runner is not None
        return self._runner.run(self._run(seconds)) * self.setup.num_envs

    async def _run(self, seconds: float) -> int:
        learner = self._learner
        assert learner is not None
        pool = self.pool
        count = len(pool)
        calls = 0
        deadline = time.perf_counter() + seconds
        while True:
            await learner.step(pool[calls % count])
            calls += 1
            if time.perf_counter() >= deadline:
                return calls

    def close(self) -> None:
        runner, self._runner = self._runner, None
        learner, self._learner = self._learner, None
        try:
            if runner is not None and learner is not None:
                runner.run(learner.aclose())  # goodbye: the workers leave on their own
        finally:
            if runner is not None:
                runner.close()
            terminate(list(self._processes), STOP_GRACE)
            self._processes.clear()

    def worker_pids(self) -> list[int] | None:
        return [p.pid for p in self._processes]


class GymSync(Contender):
    name = "gym-sync"
    description = "gymnasium SyncVectorEnv of all envs in the learner process"

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self.num_envs = setup.num_envs  # the envs it hosts
        self._envs: SyncVectorEnv | None = None

    def start(self) -> None:
        make = partial(gym.make, self.setup.env_id)
        self._envs = SyncVectorEnv([make] * self.num_envs)
        self._envs.reset(seed=self.setup.seed)

    def run(self, seconds: float) -> int:
        assert self._envs is not None
        return timed_steps(self._envs.step, self.pool, seconds) * self.num_envs

    def close(self) -> None:
        envs, self._envs = self._envs, None
        if envs is not None:
            envs.close()


class BatchedEnv(gym.Env[Array, Array]):
    """``num_envs`` copies of one env stepped as ONE env: a ``SyncVectorEnv`` behind ``gym.Env``.

    Its spaces are the batched ones and autoreset (``NextStep``) happens inside, so an
    ``AsyncVectorEnv`` of these (with its own autoreset disabled) moves one message per
    process per step, as an aps worker does. Module-level so subprocesses can import it.
    """

    def __init__(self, env_id: str, num_envs: int) -> None:
        self._envs = SyncVectorEnv([partial(gym.make, env_id)] * num_envs, copy=False)
        self.observation_space = self._envs.observation_space
        self.action_space = self._envs.action_space

    def reset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[Array, dict[str, Any]]:
        return self._envs.reset(seed=seed, options=options)

    def step(self, action: Array) -> tuple[Array, Any, Any, Any, dict[str, Any]]:
        return self._envs.step(action)

    def close(self) -> None:
        self._envs.close()


class GymAsync(Contender):
    name = "gym-async"
    description = (
        "gymnasium AsyncVectorEnv, shared memory, one process per worker hosting a "
        "SyncVectorEnv of its envs"
    )

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        setup_shape = (setup.num_workers, setup.envs_per_worker)
        super().__init__(setup, [a.reshape(setup_shape + a.shape[1:]) for a in pool])
        self._envs: AsyncVectorEnv | None = None

    def start(self) -> None:
        setup = self.setup
        make = partial(BatchedEnv, setup.env_id, setup.envs_per_worker)
        self._envs = AsyncVectorEnv(
            [make] * setup.num_workers,
            shared_memory=True,
            context="spawn",  # the learner process has threads (other contenders): no fork
            autoreset_mode=AutoresetMode.DISABLED,  # each BatchedEnv autoresets inside
        )
        seeds: list[int | None] = [
            setup.seed + i * setup.envs_per_worker for i in range(setup.num_workers)
        ]
        self._envs.reset(seed=seeds)

    def run(self, seconds: float) -> int:
        assert self._envs is not None
        return timed_steps(self._envs.step, self.pool, seconds) * self.setup.num_envs

    def close(self) -> None:
        envs, self._envs = self._envs, None
        if envs is not None:
            envs.close(terminate=True)

    def worker_pids(self) -> list[int] | None:
        assert self._envs is not None
        return [p.pid for p in self._envs.processes if p.pid is not None]


class ZmqJson(Contender):
    """JSON lists over ZeroMQ ROUTER/DEALER, as the ClusterEnv reference prototype does it."""

    name = "zmq-json"
    description = "pyzmq ROUTER/DEALER, JSON lists, SyncVectorEnv per worker (reference style)"

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self._context: Any = None
        self._socket: Any = None
        self._identities: list[bytes] = []
        self._processes: list[subprocess.Popen[bytes]] = []

    @classmethod
    def unavailable(cls) -> str | None:
        if importlib.util.find_spec("zmq") is None:
            return "pyzmq is not installed"
        return None

    def start(self) -> None:
        import zmq

        setup = self.setup
        self._context = zmq.Context()
        self._socket = sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # Receives wait in short slices, so Ctrl-C and a dead worker are noticed at once.
        sock.setsockopt(zmq.RCVTIMEO, 100)
        port = sock.bind_to_random_port(f"tcp://{LOOPBACK}")
        for index in range(setup.num_workers):
            command = [sys.executable, str(Path(__file__).resolve()), "--zmq-worker"]
            command += [f"tcp://{LOOPBACK}:{port}", "--env", setup.env_id]
            command += ["--zmq-index", str(index), "--zmq-envs", str(setup.envs_per_worker)]
            self._processes.append(subprocess.Popen(command))
        registered: dict[int, bytes] = {}
        while len(registered) < setup.num_workers:
            identity, payload = self._receive()
            registered[json.loads(payload)["index"]] = identity
        self._identities = [registered[i] for i in sorted(registered)]
        self._exchange(
            [
                {"cmd": "reset", "seed": setup.seed + i * setup.envs_per_worker}
                for i in range(setup.num_workers)
            ]
        )

    def _exchange(self, requests: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
        sock = self._socket
        for identity, request in zip(self._identities, requests, strict=True):
            sock.send_multipart([identity, json.dumps(request).encode()])
        replies: dict[bytes, dict[str, Any]] = {}
        while len(replies) < len(self._identities):
            identity, payload = self._receive()
            replies[identity] = json.loads(payload)
        return [replies[identity] for identity in self._identities]

    def _receive(self) -> tuple[bytes, bytes]:
        import zmq

        deadline = time.monotonic() + START_TIMEOUT
        while True:
            try:
                identity, payload = self._socket.recv_multipart()
                return identity, payload
            except zmq.Again:
                check_alive(self._processes, "zmq worker")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no zmq worker answered for {START_TIMEOUT} s") from None

    def step(self, actions: Array) -> tuple[Array, Array, Array, Array]:
        parts = np.split(actions, self.setup.num_workers)
        replies = self._exchange([{"cmd": "step", "actions": p.tolist()} for p in parts])
        return (
            np.concatenate([np.asarray(r["obs"], dtype=np.float32) for r in replies]),
            np.concatenate([np.asarray(r["reward"], dtype=np.float64) for r in replies]),
            np.concatenate([np.asarray(r["terminated"], dtype=np.bool_) for r in replies]),
            np.concatenate([np.asarray(r["truncated"], dtype=np.bool_) for r in replies]),
        )

    def run(self, seconds: float) -> int:
        return timed_steps(self.step, self.pool, seconds) * self.setup.num_envs

    def close(self) -> None:
        sock, self._socket = self._socket, None
        try:
            if sock is not None:
                for identity in self._identities:
                    with contextlib.suppress(Exception):
                        sock.send_multipart([identity, json.dumps({"cmd": "close"}).encode()])
        finally:
            terminate(list(self._processes), STOP_GRACE)
            self._processes.clear()
            if sock is not None:
                sock.close(linger=0)
            if self._context is not None:
                self._context.term()
                self._context = None

    def worker_pids(self) -> list[int] | None:
        return [p.pid for p in self._processes]


def zmq_worker(url: str, env_id: str, index: int, num_envs: int) -> None:
    """A reference-style worker: DEALER socket, JSON lists, one ``SyncVectorEnv``."""
    import zmq

    parent = os.getppid()
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, f"worker-{index}".encode())
    sock.connect(url)
    envs = SyncVectorEnv([partial(gym.make, env_id)] * num_envs, copy=False)
    try:
        sock.send(json.dumps({"index": index}).encode())
        while True:
            if not sock.poll(1000):
                if os.getppid() != parent:  # the learner is gone: do not linger
                    return
                continue
            request = json.loads(sock.recv())
            if request["cmd"] == "step":
                obs, reward, terminated, truncated, _ = envs.step(np.asarray(request["actions"]))
                reply = {
                    "obs": obs.tolist(),
                    "reward": reward.tolist(),
                    "terminated": terminated.tolist(),
                    "truncated": truncated.tolist(),
                }
            elif request["cmd"] == "reset":
                obs, _ = envs.reset(seed=request["seed"])
                reply = {"obs": obs.tolist()}
            else:
                return
            sock.send(json.dumps(reply).encode())
    except KeyboardInterrupt:
        pass
    finally:
        envs.close()
        sock.close(linger=0)
        context.term()


class RayWorker:
    """A Ray actor body: one ``SyncVectorEnv`` (wrapped with ``ray.remote`` at start)."""

    def __init__(self, env_id: str, num_envs: int) -> None:
        self._envs = SyncVectorEnv([partial(gym.make, env_id)] * num_envs, copy=False)

    def reset(self, seed: int) -> Array:
        obs, _ = self._envs.reset(seed=seed)
        return np.array(obs)

    def step(self, actions: Array) -> tuple[Array, Array, Array, Array]:
        obs, reward, terminated, truncated, _ = self._envs.step(actions)
        return np.array(obs), reward, terminated, truncated


class RayActors(Contender):
    name = "ray"
    description = "one Ray actor per worker holding a SyncVectorEnv, ray.get per step"

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self._actors: list[Any] = []

    @classmethod
    def unavailable(cls) -> str | None:
        if importlib.util.find_spec("ray") is None:
            return "ray is not installed"
        return None

    def start(self) -> None:
        import ray  # type: ignore[import-not-found, unused-ignore]

        if not ray.is_initialized():
            ray.init(
                num_cpus=os.cpu_count() or 1,
                include_dashboard=False,
                log_to_driver=False,
                _node_ip_address=LOOPBACK,
            )
        actor = ray.remote(RayWorker)
        setup = self.setup
        self._actors = [
            actor.remote(setup.env_id, setup.envs_per_worker) for _ in range(setup.num_workers)
        ]
        seeds = [setup.seed + i * setup.envs_per_worker for i in range(setup.num_workers)]
        ray.get([a.reset.remote(s) for a, s in zip(self._actors, seeds, strict=True)])

    def step(self, actions: Array) -> tuple[Array, Array, Array, Array]:
        import ray  # type: ignore[import-not-found, unused-ignore]

        parts = np.split(actions, self.setup.num_workers)
        results = ray.get([a.step.remote(p) for a, p in zip(self._actors, parts, strict=True)])
        obs, reward, terminated, truncated = zip(*results, strict=True)
        return (
            np.concatenate(obs),
            np.concatenate(reward),
            np.concatenate(terminated),
            np.concatenate(truncated),
        )

    def run(self, seconds: float) -> int:
        return timed_steps(self.step, self.pool, seconds) * self.setup.num_envs

    def close(self) -> None:
        actors, self._actors = self._actors, []
        if actors:
            import ray  # type: ignore[import-not-found, unused-ignore]

            for a in actors:
                ray.kill(a)

    def worker_pids(self) -> list[int] | None:
        return None  # Ray's own daemons work too; not counted


CONTENDERS: dict[str, type[Contender]] = {
    c.name: c for c in (ApsTcp, ApsWs, ApsTcpAsync, GymSync, GymAsync, ZmqJson, RayActors)
}


# Running and reporting.


@dataclass(slots=True)
class Series:
    """The windows one contender ran at one size."""

    rates: list[float] = field(default_factory=list)  # env-steps/s, one per window
    rounds: list[int] = field(default_factory=list)  # the round of each window
    cpu_us: list[float] = field(default_factory=list)  # CPU µs per env-step, all processes
    # CPU µs of the learner process per batched step of all envs (per num_envs env-steps).
    learner_us: list[float] = field(default_factory=list)
    error: str | None = None
    skipped: str | None = None  # why it did not run at this setup
    note: str | None = None  # what the contender ran instead of the setup, if anything

    @property
    def median(self) -> float:
        return statistics.median(self.rates)

    def as_json(self) -> dict[str, Any]:
        """Every window and the summary, for the results file."""
        return {
            "rates": self.rates,
            "rounds": self.rounds,
            "median": self.median if self.rates else None,
            "min": min(self.rates) if self.rates else None,
            "max": max(self.rates) if self.rates else None,
            "cpu_us_per_env_step": self.cpu_us,
            "learner_cpu_us_per_step": self.learner_us,
            "error": self.error,
            "skipped": self.skipped,
            "note": self.note,
        }


Results = dict[int, dict[str, Series]]  # envs per worker -> contender -> series


def measure_size(
    names: Sequence[str],
    setup: Setup,
    *,
    seconds: float,
    warmup: float,
    repeats: int,
    registry: Mapping[str, type[Contender]] = CONTENDERS,
) -> dict[str, Series]:
    """Start every contender at one size, then time them round-robin ``repeats`` times.

    ``registry`` maps the ``names`` to contender classes. A contender that cannot run this
    setup (:meth:`Contender.unavailable_for`) is skipped with its reason.
    """
    pool = make_action_pool(setup)
    series = {name: Series() for name in names}
    live: dict[str, Contender] = {}
    try:
        for name in names:
            reason = registry[name].unavailable_for(setup)
            if reason is not None:
                series[name].skipped = reason
                print(f"  skipping {name}: {reason}", flush=True)
                continue
            contender = registry[name](setup, pool)
            live[name] = contender
            print(f"  starting {name} ...", flush=True)
            try:
                contender.start()
                contender.run(warmup)
                series[name].note = contender.note
            except Exception as exc:
                series[name].error = f"{type(exc).__name__}: {exc}"
                print(f"  {name} failed to start: {series[name].error}", flush=True)
                close_all([live.pop(name)])
        for round_ in range(repeats):
            order = list(live)
            shift = round_ % len(order) if order else 0
            for name in order[shift:] + order[:shift]:
                contender = live[name]
                try:
                    contender.run(0.0)  # one step first, so the window starts warm
                    window = contender.window(seconds)
                except Exception as exc:
                    series[name].error = f"{type(exc).__name__}: {exc}"
                    print(f"  {name} failed: {series[name].error}", flush=True)
                    close_all([live.pop(name)])
                    continue
                s = series[name]
                s.rates.append(window.rate)
                s.rounds.append(round_)
                s.learner_us.append(window.learner_cpu * 1e6 * setup.num_envs / window.env_steps)
                cpu = ""
                if window.workers_cpu is not None:
                    cpu_us = (window.learner_cpu + window.workers_cpu) * 1e6 / window.env_steps
                    s.cpu_us.append(cpu_us)
                    cpu = f" {cpu_us:8.1f} CPU us/step"
                print(
                    f"  round {round_ + 1}/{repeats} {name:<16} {window.rate:>12,.0f} steps/s{cpu}",
                    flush=True,
                )
    finally:
        close_all(list(live.values()))
    return series


def stop_ray() -> None:
    """Shut Ray down if a contender started it."""
    if "ray" in sys.modules:
        import ray  # type: ignore[import-not-found, unused-ignore]

        if ray.is_initialized():
            ray.shutdown()


def close_all(contenders: Sequence[Contender]) -> None:
    """Close every contender, even when one of them fails or Ctrl-C lands meanwhile.

    Errors are printed; an interrupt is raised again once all are closed.
    """
    interrupt: BaseException | None = None
    for contender in contenders:
        try:
            contender.close()
        except Exception as exc:
            print(f"  closing {contender.name} failed: {type(exc).__name__}: {exc}")
        except BaseException as exc:  # Ctrl-C: finish closing the others first
            interrupt = interrupt or exc
    if interrupt is not None:
        raise interrupt


def ratio(series: dict[str, Series], top: str, bottom: str) -> dict[str, float] | None:
    """``top / bottom``: the ratio of medians and the min-max of the per-round ratios."""
    a, b = series.get(top), series.get(bottom)
    if a is None or b is None or not a.rates or not b.rates:
        return None
    theirs = dict(zip(b.rounds, b.rates, strict=True))
    paired = [x / theirs[r] for r, x in zip(a.rounds, a.rates, strict=True) if r in theirs]
    if not paired:
        return None
    return {"median": a.median / b.median, "min": min(paired), "max": max(paired)}


RATIOS = (
    ("aps-tcp", "gym-async"),
    ("aps-ws", "gym-async"),
    ("aps-tcp-async", "gym-async"),
    ("aps-tcp", "gym-sync"),
    ("aps-ws", "gym-sync"),
    ("aps-tcp-async", "gym-sync"),
    ("aps-ws", "aps-tcp"),
    ("aps-tcp", "aps-tcp-async"),
)


def all_ratios(series: dict[str, Series]) -> dict[str, dict[str, float]]:
    out = {}
    for top, bottom in RATIOS:
        r = ratio(series, top, bottom)
        if r is not None:
            out[f"{top} / {bottom}"] = r
    return out


def fmt_ratio(r: dict[str, float] | None) -> str:
    if r is None:
        return "-"
    return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def render_table(results: Results, names: Sequence[str]) -> str:
    """A Markdown table: one row per size and contender, with ratios to the Gymnasium peers."""
    lines = [
        "| envs/worker | contender | env-steps/s (median) | min-max | vs gym-async | vs gym-sync "
        "| CPU µs/env-step |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for size, series in results.items():
        for name in names:
            s = series.get(name)
            if s is None:
                continue
            if not s.rates:
                why = f"skipped | {s.skipped}" if s.skipped else f"failed | {s.error}"
                lines.append(f"| {size} | {name} | {why} | - | - | - |")
                continue
            spread = f"{min(s.rates):,.0f}-{max(s.rates):,.0f}"
            vs_async = fmt_ratio(ratio(series, name, "gym-async")) if name != "gym-async" else ""
            vs_sync = fmt_ratio(ratio(series, name, "gym-sync")) if name != "gym-sync" else ""
            cpu = f"{statistics.median(s.cpu_us):.1f}" if s.cpu_us else "-"
            lines.append(
                f"| {size} | {name} | {s.median:,.0f} | {spread} | {vs_async} | {vs_sync} | {cpu} |"
            )
    return "\n".join(lines)


def render_aps_ratios(results: Results) -> str:
    """The aps-internal ratios: ws against tcp, facade against the await loop."""
    lines = ["| envs/worker | aps-ws / aps-tcp | aps-tcp / aps-tcp-async |", "|---:|---:|---:|"]
    for size, series in results.items():
        ws = fmt_ratio(ratio(series, "aps-ws", "aps-tcp"))
        facade = fmt_ratio(ratio(series, "aps-tcp", "aps-tcp-async"))
        lines.append(f"| {size} | {ws} | {facade} |")
    return "\n".join(lines)


def render_targets(results: Results) -> list[str]:
    """The project's two targets, read off the medians."""
    lines = []
    if 64 in results:
        r = ratio(results[64], "aps-tcp", "gym-async")
        if r is not None:
            verdict = "holds" if r["median"] >= 1.0 else "does NOT hold"
            lines.append(
                f"aps-tcp >= gym-async at 64 envs/worker: {verdict} (median ratio {fmt_ratio(r)})"
            )
    for size, series in results.items():
        r = ratio(series, "aps-ws", "aps-tcp")
        if r is not None:
            verdict = "holds" if r["median"] >= 0.8 else "does NOT hold"
            lines.append(
                f"aps-ws within 20% of aps-tcp at {size} envs/worker: {verdict} "
                f"(median ratio {fmt_ratio(r)})"
            )
    return lines


def available(
    names: Sequence[str], registry: Mapping[str, type[Contender]]
) -> tuple[list[str], dict[str, str]]:
    """Split ``names`` into the contenders that can run here and ``{name: why not}``."""
    runnable: list[str] = []
    skipped: dict[str, str] = {}
    for name in names:
        reason = registry[name].unavailable()
        if reason is None:
            runnable.append(name)
        else:
            skipped[name] = reason
            print(f"skipping {name}: {reason}")
    return runnable, skipped


def write_json(path: Path, report: dict[str, Any]) -> None:
    """Write a benchmark's report (creating its folder) and say where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"\nwrote {path}")


def machine(distributions: Sequence[str] = ()) -> dict[str, Any]:
    """What the numbers were measured on.

    ``distributions`` are further installed packages whose versions to record (read from
    their metadata, without importing them).
    """
    versions = {}
    for package in ("aps", "gymnasium", "numpy", "msgpack", "websockets", "uvloop", "zmq", "ray"):
        with contextlib.suppress(ImportError):
            versions[package] = getattr(__import__(package), "__version__", "?")
    for name in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average_at_end": list(os.getloadavg()),
        "uvloop": os.environ.get("APS_UVLOOP", "1") not in ("0", "false", "no")
        and "uvloop" in versions,
        "versions": versions,
    }


def parse_sizes(text: str) -> list[int]:
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"sizes must be positive integers, got {text!r}")
    return sizes


def name_list(known: Collection[str]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated, non-empty subset of ``known``."""

    def parse(text: str) -> list[str]:
        names = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [n for n in names if n not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown contenders {unknown}; choose from {', '.join(known)}"
            )
        return names

    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--env", default="CartPole-v1", help="Gymnasium id (default %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument(
        "--sizes", type=parse_sizes, default=None, help="envs per worker (default 1,16,64)"
    )
    p.add_argument(
        "--contenders",
        type=name_list(CONTENDERS),
        default=list(CONTENDERS),
        help=f"comma-separated subset of {','.join(CONTENDERS)} (default: all available)",
    )
    p.add_argument("--seconds", type=float, default=None, help="timed window (default 3)")
    p.add_argument("--warmup", type=float, default=None, help="warm-up per contender (0.5)")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--quick", action="store_true", help="1 s windows, sizes 1,64")
    p.add_argument(
        "--no-uvloop", action="store_true", help="run aps on asyncio's own loop (APS_UVLOOP=0)"
    )
    p.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the results")
    # A zmq-json worker process (started by the zmq-json contender, not by hand).
    p.add_argument("--zmq-worker", metavar="URL", help=argparse.SUPPRESS)
    p.add_argument("--zmq-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--zmq-envs", type=int, default=1, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.zmq_worker:
        zmq_worker(args.zmq_worker, args.env, args.zmq_index, args.zmq_envs)
        return 0
    if args.no_uvloop:
        os.environ["APS_UVLOOP"] = "0"  # read by aps in this process and in its workers
    sizes = args.sizes or ([1, 64] if args.quick else [1, 16, 64])
    seconds = args.seconds if args.seconds is not None else (1.0 if args.quick else 3.0)
    warmup = args.warmup if args.warmup is not None else (0.2 if args.quick else 0.5)

    names, skipped = available(args.contenders, CONTENDERS)

    print(
        f"{args.env}, {args.workers} workers x {sizes} envs per worker; {seconds:g} s windows, "
        f"{args.repeats} interleaved rounds; {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    load_at_start = list(os.getloadavg())
    results: Results = {}
    try:
        for size in sizes:
            print(f"{size} envs per worker:", flush=True)
            setup = Setup(args.env, args.workers, size)
            results[size] = measure_size(
                names, setup, seconds=seconds, warmup=warmup, repeats=args.repeats
            )
    finally:
        stop_ray()

    print()
    print(f"env-steps/s delivered to the learner, {args.env}, {args.workers} workers")
    print("(median of the rounds; ratios: of medians, with the range of per-round ratios)")
    print()
    print(render_table(results, names))
    print()
    print(render_aps_ratios(results))
    print()
    for line in render_targets(results):
        print(line)

    report = {
        "benchmark": "throughput",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {"load_average_at_start": load_at_start, **machine()},
        "settings": {
            "env": args.env,
            "workers": args.workers,
            "sizes": sizes,
            "seconds": seconds,
            "warmup": warmup,
            "repeats": args.repeats,
            "action_pool": POOL_SIZE,
        },
        "contenders": {name: CONTENDERS[name].description for name in names},
        "skipped": skipped,
        "results": {
            str(size): {
                "num_envs": size * args.workers,
                "contenders": {name: s.as_json() for name, s in series.items()},
                "ratios": all_ratios(series),
            }
            for size, series in results.items()
        },
        "targets": render_targets(results),
    }
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
