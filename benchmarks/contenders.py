"""The contenders the benchmark matrix adds to those of ``throughput.py``.

- ``envpool`` (only if EnvPool is importable and knows the env): EnvPool's C++ envs, all of
  them in the learner process, stepped by as many threads as there are workers. When EnvPool
  lacks the exact id it runs another version of the same env (EnvPool 0.8 has
  ``LunarLander-v2`` but not ``-v3``) and the table says so.
- ``transport-limit``: what the wire allows, with no env. A learner and one process per worker
  exchange aps's step messages over asyncio TCP streams: the learner encodes a
  ``StepRequest`` with :mod:`aps.wire.codec` (msgpack) for each worker, the worker decodes it and
  answers with a ``StepResult`` it encoded once at start from a real step of its envs, so
  both messages have the sizes aps's have; the learner decodes the replies and concatenates
  them. No env, no aps session, learner or worker code.
- ``step-limit``: the transport limit with real envs: each worker process steps its envs (the
  vector env aps's workers step, ``LeanSyncVectorEnv``) with the actions it received and
  encodes the result, as an aps worker must, and nothing more. Everything a lockstep step
  has to do at both ends, with no aps session, learner or worker code: what lockstep over
  this transport delivers when the env's step shares each worker's core with the messages.
- ``bare-ceiling``: lockstep with no aps code at all (``bare.py``): asyncio TCP (uvloop when
  installed), plain msgpack of the arrays' bytes behind a 4-byte length, and workers
  stepping a real Gymnasium ``SyncVectorEnv``. What a library on asyncio and msgpack could
  reach; the step limit beside it encodes with aps's codec and steps aps's vector env.
- ``bare-protocol``: the bare ceiling's strictest form (``bare.py --protocol``): the same
  frames, payloads and envs, with an ``asyncio.Protocol`` at both ends that parses frames
  from its own buffer in ``data_received`` instead of ``StreamReader``: the learner writes
  every worker's actions, and the step completes from the callback that receives the last
  reply, with one future per step and no task per connection.
- ``stream-limit``: DETACH without aps's messaging: one process per worker acts with the
  ``aps-detach`` policy and builds chunks of ``T`` steps (aps's ``Collector``, the loop a
  DETACH worker runs), encodes each and writes it to a plain blocking socket; the learner
  reads them with asyncio streams and decodes them. No aps session, learner, worker loop or
  transport. Its rate is measured as ``aps-detach``'s is.
- ``env-limit``: what one core steps: a ``SyncVectorEnv`` of ONE worker's envs in the learner
  process, nothing else. ``2 x env-limit`` is what two cores could step with no messages.
- ``aps-detach``: worker-side inference (DETACH). The workers act with a 64-64 MLP
  (``mlp_policy.py``, a torch module that :class:`aps.policy.Policy` evaluates with NumPy,
  as it does every plain MLP) and stream chunks of ``T`` steps, ``T = ceil(512 / envs per
  worker)`` by default; the learner takes them from ``aps.Learner.chunks(T,
  max_in_flight=2)`` as fast as they come and counts the env-steps they hold. No lockstep,
  and the workers' inference is inside the figure.

Each window of ``aps-detach`` is one stream, opened at its start and closed at its end (the
chunks still in flight are received and dropped, off the clock). Its rate is the steady rate
of each worker, summed: from the arrival of the worker's first chunk to that of its last,
over the env-steps of the chunks after the first. Neither the wait for the first chunks nor
the dropped ones bias it; the CPU column covers the whole stream (see ``ApsDetach._stream``).

This module is also the ``transport-limit``, ``step-limit`` and ``stream-limit`` worker
program (``--transport-worker``, started by the contenders, not by hand).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import io
import socket
import subprocess
import sys
import time
import warnings
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import bare
import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from throughput import (
    CONTENDERS,
    LOOPBACK,
    START_TIMEOUT,
    STOP_GRACE,
    ApsTcpAsync,
    Array,
    Contender,
    GymSync,
    Setup,
    Window,
    check_alive,
    cpu_seconds,
    timed_steps,
)

import aps
from aps.launch.local import terminate
from aps.session._loop import new_event_loop, run as run_loop
from aps.vector import LeanSyncVectorEnv
from aps.wire import codec
from aps.wire.framing import HEADER_SIZE, frame_header, parse_header
from aps.wire.messages import RolloutChunk, StepRequest, StepResult

ROOT = Path(__file__).resolve().parent
POLICY = f"{ROOT / 'mlp_policy.py'}:Agent"
STEP_TIMEOUT = 60.0  # seconds one step of transport-limit may take before the window fails


# EnvPool.


def _import_envpool() -> Any:
    """Import EnvPool without the notice its ``gym`` dependency prints on import."""
    with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import envpool  # type: ignore[import-not-found, unused-ignore]
    return envpool


def envpool_id(env_id: str) -> str | None:
    """The EnvPool id for ``env_id``: itself, else the newest version of the same env, else None."""
    known = set(_import_envpool().list_all_envs())
    if env_id in known:
        return env_id
    base, sep, _ = env_id.rpartition("-v")
    versions = []
    for other in known:
        other_base, other_sep, version = other.rpartition("-v")
        if sep and other_sep and other_base == base and version.isdigit():
            versions.append((int(version), other))
    return max(versions)[1] if versions else None


class EnvPool(Contender):
    name = "envpool"
    description = (
        "EnvPool (C++ envs), all envs in the learner process, one thread per worker, "
        "synchronous step"
    )

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self._envs: Any = None

    @classmethod
    def unavailable(cls) -> str | None:
        if importlib.util.find_spec("envpool") is None:
            return "envpool is not installed (pip install envpool)"
        return None

    @classmethod
    def unavailable_for(cls, setup: Setup) -> str | None:
        reason = cls.unavailable()
        if reason is None and envpool_id(setup.env_id) is None:
            reason = f"EnvPool {_import_envpool().__version__} has no {setup.env_id} (any version)"
        return reason

    def start(self) -> None:
        setup = self.setup
        envpool = _import_envpool()
        task = envpool_id(setup.env_id)
        assert task is not None  # unavailable_for checked it
        if task != setup.env_id:
            self.note = f"EnvPool {envpool.__version__} has no {setup.env_id}; ran {task}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its Box spaces warn about float64 bounds
            self._envs = envpool.make_gymnasium(
                task,
                num_envs=setup.num_envs,
                batch_size=setup.num_envs,
                num_threads=setup.num_workers,
                seed=setup.seed,
            )
        self._envs.reset()

    def run(self, seconds: float) -> int:
        assert self._envs is not None
        return timed_steps(self._envs.step, self.pool, seconds) * self.setup.num_envs

    def close(self) -> None:
        envs, self._envs = self._envs, None
        if envs is not None:
            envs.close()


# The env limit: one core, one worker's envs.


class EnvLimit(GymSync):
    name = "env-limit"
    description = (
        "single-core env rate: ONE worker's envs in the learner process, in the vector env an "
        "aps worker steps (LeanSyncVectorEnv, copy=False)"
    )

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        # The first worker's part of each batch: its envs see the actions they would in aps.
        super().__init__(setup, [a[: setup.envs_per_worker] for a in pool])
        self.num_envs = setup.envs_per_worker

    def start(self) -> None:
        # The bounds are aps's ceilings, so the env rate is that of the vector env aps's
        # workers step: with Gymnasium's own SyncVectorEnv (slower per step) aps could pass
        # a bound by its env wrapper alone.
        make = partial(gym.make, self.setup.env_id)
        self._envs = LeanSyncVectorEnv([make] * self.num_envs, copy=False)
        self._envs.reset(seed=self.setup.seed)


class EnvParallel(Contender):
    """``workers`` processes stepping their own envs at once, with no messages at all."""

    name = "env-parallel"
    description = (
        "parallel env rate: one process per worker steps a SyncVectorEnv of its envs, all "
        "at once, nothing exchanged (what the cores deliver together)"
    )

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self._pipes: list[Any] = []
        self._processes: list[Any] = []

    def start(self) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        setup = self.setup
        envs = setup.envs_per_worker
        for index in range(setup.num_workers):
            mine, theirs = context.Pipe()
            actions = [a[index * envs : (index + 1) * envs] for a in self.pool]
            seed = setup.seed + index * envs
            process = context.Process(
                target=env_parallel_worker,
                args=(theirs, setup.env_id, envs, seed, actions),
                daemon=True,
            )
            process.start()
            theirs.close()
            self._pipes.append(mine)
            self._processes.append(process)
        for pipe in self._pipes:
            if not pipe.poll(START_TIMEOUT):
                raise RuntimeError("an env-parallel process did not start")
            pipe.recv()  # ready

    def run(self, seconds: float) -> int:
        for pipe in self._pipes:
            pipe.send(seconds)  # all start at once; each steps for ``seconds``
        env_steps = 0
        for pipe in self._pipes:
            if not pipe.poll(seconds + STEP_TIMEOUT):
                raise RuntimeError("an env-parallel process did not answer")
            env_steps += pipe.recv()
        return env_steps

    def close(self) -> None:
        for pipe in self._pipes:
            with contextlib.suppress(OSError):
                pipe.send(None)
            pipe.close()
        for process in self._processes:
            process.join(STOP_GRACE)
            if process.is_alive():
                process.kill()
                process.join()
        self._pipes.clear()
        self._processes.clear()

    def worker_pids(self) -> list[int] | None:
        return [p.pid for p in self._processes]


def env_parallel_worker(
    pipe: Any, env_id: str, num_envs: int, seed: int, pool: list[Array]
) -> None:
    """Step ``num_envs`` envs for each window the pipe asks for; answer the env-steps."""
    envs = SyncVectorEnv([partial(gym.make, env_id)] * num_envs)
    try:
        envs.reset(seed=seed)
        pipe.send("ready")
        while (seconds := pipe.recv()) is not None:
            pipe.send(timed_steps(envs.step, pool, seconds) * num_envs)
    except (EOFError, KeyboardInterrupt):
        pass
    finally:
        envs.close()


class ActLimit(EnvLimit):
    """A DETACH worker's loop without aps: act with the policy, step the envs, on one core."""

    name = "act-limit"
    description = (
        "single-core rate of acting AND stepping: the aps-detach policy (aps.policy.Policy, "
        "NumPy heads, 1 torch thread) acts on ONE worker's envs, which step, in the learner process"
    )

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self._policy: Any = None
        self._obs: Array | None = None

    @classmethod
    def unavailable(cls) -> str | None:
        return ApsDetach.unavailable()

    def start(self) -> None:
        from aps import policy

        # The vector env the DETACH workers step, autoreset as they do it (SameStep): every
        # step is a transition.
        make = partial(gym.make, self.setup.env_id)
        self._envs = envs = LeanSyncVectorEnv(
            [make] * self.num_envs, copy=False, autoreset_mode=AutoresetMode.SAME_STEP
        )
        policy.limit_threads(1)  # as the workers run it
        factory = policy.load_policy_factory(POLICY)
        agent = policy.build_module(
            factory, envs.single_observation_space, envs.single_action_space
        )
        self._policy = policy.Policy(
            agent, envs.single_observation_space, envs.single_action_space, seed=self.setup.seed
        )
        self._obs = envs.reset(seed=self.setup.seed)[0]

    def run(self, seconds: float) -> int:
        envs, policy = self._envs, self._policy
        assert envs is not None
        obs = self._obs
        calls = 0
        deadline = time.perf_counter() + seconds
        while True:
            actions = policy.act(obs)[0]
            obs = envs.step(policy.env_actions(actions))[0]
            calls += 1
            if time.perf_counter() >= deadline:
                self._obs = obs
                return calls * self.num_envs


# The transport limit: aps's step messages over asyncio TCP, pre-built replies.

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    size = parse_header(await reader.readexactly(HEADER_SIZE))
    return await reader.readexactly(size)


def _framed(payload: bytes) -> bytes:
    return frame_header(len(payload)) + payload


class TransportLimit(Contender):
    name = "transport-limit"
    description = (
        "asyncio TCP + msgpack (aps.wire.codec), pre-built replies: aps-sized step messages to one "
        "process per worker, which answers without an env"
    )

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self._runner: asyncio.Runner | None = None
        self._streams: list[Stream] = []
        self._processes: list[subprocess.Popen[bytes]] = []

    def start(self) -> None:
        setup = self.setup
        listening = socket.create_server((LOOPBACK, 0))
        try:
            port = listening.getsockname()[1]
            for index in range(setup.num_workers):
                command = [sys.executable, str(Path(__file__).resolve()), "--transport-worker"]
                command += [f"{LOOPBACK}:{port}", "--env", setup.env_id, "--index", str(index)]
                command += ["--num-envs", str(setup.envs_per_worker)]
                command += ["--seed", str(setup.seed + index * setup.envs_per_worker)]
                command += self.worker_flags()
                self._processes.append(subprocess.Popen(command))
            self._runner = asyncio.Runner(loop_factory=new_event_loop)
            self._runner.run(self._accept(listening))
        finally:
            listening.close()

    async def _accept(self, listening: socket.socket) -> None:
        """Take one connection per worker; each names its index in its first frame."""
        setup = self.setup
        arrived: asyncio.Queue[Stream] = asyncio.Queue()

        def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            arrived.put_nowait((reader, writer))

        server = await asyncio.start_server(on_connect, sock=listening)
        try:
            by_index: dict[int, Stream] = {}
            async with asyncio.timeout(START_TIMEOUT):
                while len(by_index) < setup.num_workers:
                    check_alive(self._processes, f"{self.name} worker")
                    try:
                        stream = await asyncio.wait_for(arrived.get(), 0.1)
                    except TimeoutError:
                        continue
                    self._streams.append(stream)  # closed by close() whatever happens next
                    by_index[int(await _read_frame(stream[0]))] = stream
        finally:
            server.close()
        self._streams = [by_index[i] for i in range(setup.num_workers)]

    def run(self, seconds: float) -> int:
        assert self._runner is not None
        return self._runner.run(self._run(seconds)) * self.setup.num_envs

    async def _run(self, seconds: float) -> int:
        pool, streams = self.pool, self._streams
        workers = self.setup.num_workers
        count = len(pool)
        calls = 0
        deadline = time.perf_counter() + seconds
        async with asyncio.timeout(seconds + STEP_TIMEOUT):
            while True:
                parts = np.split(pool[calls % count], workers)
                for (_, writer), part in zip(streams, parts, strict=True):
                    writer.write(_framed(codec.encode(StepRequest(actions=part))))
                results = []
                for reader, _ in streams:
                    reply = codec.decode(await _read_frame(reader))
                    assert isinstance(reply, StepResult)
                    results.append(reply)
                np.concatenate([r.obs for r in results])
                np.concatenate([r.reward for r in results])
                np.concatenate([r.terminated for r in results])
                np.concatenate([r.truncated for r in results])
                calls += 1
                if time.perf_counter() >= deadline:
                    return calls

    def worker_flags(self) -> list[str]:
        """Extra arguments of the worker program (what ``step-limit`` and others add)."""
        return []

    def close(self) -> None:
        runner, self._runner = self._runner, None
        streams, self._streams = self._streams, []
        try:
            if runner is not None:
                runner.run(self._close_streams(streams))  # EOF: the workers leave
        finally:
            if runner is not None:
                runner.close()
            terminate(list(self._processes), STOP_GRACE)
            self._processes.clear()

    @staticmethod
    async def _close_streams(streams: list[Stream]) -> None:
        for _, writer in streams:
            writer.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(STOP_GRACE):
                await asyncio.gather(*(w.wait_closed() for _, w in streams))

    def worker_pids(self) -> list[int] | None:
        return [p.pid for p in self._processes]


class StepLimit(TransportLimit):
    """The transport limit's learner, with workers that step their real envs."""

    name = "step-limit"
    description = (
        "transport limit + real envs: each worker process steps its envs in aps's vector env "
        "(LeanSyncVectorEnv) with the actions it got and encodes the result; no aps session, "
        "learner or worker code"
    )

    def worker_flags(self) -> list[str]:
        return ["--step-envs"]


def transport_worker(
    address: str, env_id: str, num_envs: int, index: int, seed: int, *, step_envs: bool = False
) -> None:
    """Serve step replies to a ``transport-limit`` (or ``step-limit``) learner until it leaves.

    Without ``step_envs`` the reply is a ``StepResult`` of one real step of ``num_envs`` envs
    of ``env_id``, encoded once; the envs are closed before serving. With it, every request
    steps the envs (aps's ``LeanSyncVectorEnv``, NextStep autoreset as aps's default) with
    the request's actions and answers with that step, encoded then.
    """
    envs = LeanSyncVectorEnv([partial(gym.make, env_id)] * num_envs, copy=False)
    try:
        envs.reset(seed=seed)
        envs.action_space.seed(seed)
        obs, reward, terminated, truncated, info = envs.step(envs.action_space.sample())
        reply = codec.encode(
            StepResult(
                obs=obs, reward=reward, terminated=terminated, truncated=truncated, info=info
            )
        )
        host, _, port = address.rpartition(":")
        with contextlib.suppress(KeyboardInterrupt):
            run_loop(_serve(host, int(port), index, _framed(reply), envs if step_envs else None))
    finally:
        envs.close()


async def _serve(
    host: str, port: int, index: int, reply: bytes, envs: LeanSyncVectorEnv | None
) -> None:
    async with asyncio.timeout(START_TIMEOUT):
        reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_framed(str(index).encode()))
        while True:
            try:
                request = codec.decode(await _read_frame(reader))
            except asyncio.IncompleteReadError:
                return  # the learner closed the connection (or exited): done
            if not isinstance(request, StepRequest):
                raise RuntimeError(f"expected a step request, got {type(request).__name__}")
            if envs is None:
                writer.write(reply)
                continue
            obs, reward, terminated, truncated, info = envs.step(request.actions)
            result = StepResult(
                obs=obs,
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                info=info,
                seq=request.seq,
            )
            writer.write(_framed(codec.encode(result)))
    finally:
        writer.close()


class BareCeiling(TransportLimit):
    """Lockstep with no aps code at either end (see ``bare.py``)."""

    name = "bare-ceiling"
    description = (
        "no aps code at all: asyncio TCP (uvloop when installed), plain msgpack of the "
        "arrays' bytes, workers stepping a real Gymnasium SyncVectorEnv (bare.py)"
    )

    def start(self) -> None:
        setup = self.setup
        listening = socket.create_server((LOOPBACK, 0))
        try:
            port = listening.getsockname()[1]
            for index in range(setup.num_workers):
                command = [sys.executable, str(ROOT / "bare.py"), "--worker", f"{LOOPBACK}:{port}"]
                command += ["--env", setup.env_id, "--index", str(index)]
                command += ["--num-envs", str(setup.envs_per_worker)]
                command += ["--seed", str(setup.seed + index * setup.envs_per_worker)]
                self._processes.append(subprocess.Popen(command))
            self._runner = asyncio.Runner(loop_factory=_bare_loop)
            self._runner.run(self._accept_bare(listening))
        finally:
            listening.close()

    async def _accept_bare(self, listening: socket.socket) -> None:
        setup = self.setup
        arrived: asyncio.Queue[Stream] = asyncio.Queue()
        server = await asyncio.start_server(lambda r, w: arrived.put_nowait((r, w)), sock=listening)
        try:
            by_index: dict[int, Stream] = {}
            async with asyncio.timeout(START_TIMEOUT):
                while len(by_index) < setup.num_workers:
                    check_alive(self._processes, f"{self.name} worker")
                    try:
                        stream = await asyncio.wait_for(arrived.get(), 0.1)
                    except TimeoutError:
                        continue
                    self._streams.append(stream)
                    by_index[int(await bare.read_frame(stream[0]))] = stream
        finally:
            server.close()
        self._streams = [by_index[i] for i in range(setup.num_workers)]

    async def _run(self, seconds: float) -> int:
        pool, streams = self.pool, self._streams
        workers = self.setup.num_workers
        count = len(pool)
        calls = 0
        deadline = time.perf_counter() + seconds
        async with asyncio.timeout(seconds + STEP_TIMEOUT):
            while True:
                parts = np.split(pool[calls % count], workers)
                for (_, writer), part in zip(streams, parts, strict=True):
                    writer.write(bare.encode_actions(part))
                steps = [bare.decode_step(await bare.read_frame(r)) for r, _ in streams]
                for field in range(4):
                    np.concatenate([step[field] for step in steps])
                calls += 1
                if time.perf_counter() >= deadline:
                    return calls


class BareProtocol(BareCeiling):
    """The bare ceiling on ``asyncio.Protocol`` at both ends (see ``bare.FrameProtocol``)."""

    name = "bare-protocol"
    description = (
        "no aps code at all, the strictest form: asyncio.Protocol learner and workers parsing "
        "4-byte-length frames from their own buffer in data_received (uvloop when installed), "
        "plain msgpack of the arrays' bytes, workers stepping a real Gymnasium SyncVectorEnv "
        "(bare.py --protocol)"
    )

    def __init__(self, setup: Setup, pool: list[Array]) -> None:
        super().__init__(setup, pool)
        self._protocols: list[bare.FrameProtocol] = []  # every connection, closed by close()
        self._workers: list[bare.FrameProtocol] = []  # by worker index
        self._index: dict[bare.FrameProtocol, int] = {}
        self._replies: list[bytes] = []
        self._pending = 0
        self._done: asyncio.Future[None] | None = None

    def start(self) -> None:
        setup = self.setup
        listening = socket.create_server((LOOPBACK, 0))
        try:
            port = listening.getsockname()[1]
            for index in range(setup.num_workers):
                command = [sys.executable, str(ROOT / "bare.py"), "--worker", f"{LOOPBACK}:{port}"]
                command += ["--env", setup.env_id, "--index", str(index), "--protocol"]
                command += ["--num-envs", str(setup.envs_per_worker)]
                command += ["--seed", str(setup.seed + index * setup.envs_per_worker)]
                self._processes.append(subprocess.Popen(command))
            self._runner = asyncio.Runner(loop_factory=_bare_loop)
            self._runner.run(self._accept_protocols(listening))
        finally:
            listening.close()

    def _on_frame(self, protocol: bare.FrameProtocol, frame: bytes) -> None:
        index = self._index.get(protocol)
        if index is None:  # the first frame of a connection names the worker's index
            self._index[protocol] = int(frame)
            return
        self._replies[index] = frame
        self._pending -= 1
        if self._pending == 0 and self._done is not None and not self._done.done():
            self._done.set_result(None)

    def _on_lost(self, _: object) -> None:
        # A worker that leaves mid-step would otherwise hold the step until STEP_TIMEOUT.
        if self._done is not None and not self._done.done():
            self._done.set_exception(RuntimeError(f"a {self.name} worker closed its connection"))

    def _connection(self) -> bare.FrameProtocol:
        protocol = bare.FrameProtocol(self._on_frame)
        protocol.closed.add_done_callback(self._on_lost)
        self._protocols.append(protocol)
        return protocol

    async def _accept_protocols(self, listening: socket.socket) -> None:
        setup = self.setup
        loop = asyncio.get_running_loop()
        server = await loop.create_server(self._connection, sock=listening)
        try:
            async with asyncio.timeout(START_TIMEOUT):
                while len(self._index) < setup.num_workers:
                    check_alive(self._processes, f"{self.name} worker")
                    await asyncio.sleep(0.05)
        finally:
            server.close()
        by_index = {index: protocol for protocol, index in self._index.items()}
        self._workers = [by_index[i] for i in range(setup.num_workers)]
        self._replies = [b""] * setup.num_workers

    async def _run(self, seconds: float) -> int:
        pool, workers = self.pool, self._workers
        transports = [protocol.transport for protocol in workers]
        loop = asyncio.get_running_loop()
        count = len(pool)
        calls = 0
        deadline = time.perf_counter() + seconds
        async with asyncio.timeout(seconds + STEP_TIMEOUT):
            while True:
                parts = np.split(pool[calls % count], len(workers))
                self._pending = len(workers)
                self._done = done = loop.create_future()
                for transport, part in zip(transports, parts, strict=True):
                    assert transport is not None
                    transport.write(bare.encode_actions(part))
                await done
                steps = [bare.decode_step(frame) for frame in self._replies]
                for field in range(4):
                    np.concatenate([step[field] for step in steps])
                calls += 1
                if time.perf_counter() >= deadline:
                    return calls

    def close(self) -> None:
        runner, self._runner = self._runner, None
        protocols, self._protocols = self._protocols, []
        self._workers, self._done = [], None
        try:
            if runner is not None:
                runner.run(self._close_protocols(protocols))  # EOF: the workers leave
        finally:
            if runner is not None:
                runner.close()
            terminate(list(self._processes), STOP_GRACE)
            self._processes.clear()

    @staticmethod
    async def _close_protocols(protocols: list[bare.FrameProtocol]) -> None:
        for protocol in protocols:
            if protocol.transport is not None:
                protocol.transport.close()
        with contextlib.suppress(Exception):
            async with asyncio.timeout(STOP_GRACE):
                await asyncio.gather(*(protocol.closed for protocol in protocols))


def _bare_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class StreamLimit(TransportLimit):
    """DETACH's chunks over plain sockets: workers act and stream, the learner decodes."""

    name = "stream-limit"
    description = (
        "DETACH without aps's messaging: each worker process acts with the aps-detach policy "
        "(aps's Collector, chunks of T steps), encodes each chunk and writes it to a plain "
        "socket; the learner decodes them. No aps session, learner, worker loop or transport"
    )

    @classmethod
    def unavailable(cls) -> str | None:
        return ApsDetach.unavailable()

    def worker_flags(self) -> list[str]:
        return ["--stream-steps", str(ApsDetach.steps_per_chunk(self.setup.envs_per_worker))]

    def run(self, seconds: float) -> int:
        return self.window(seconds).env_steps

    def window(self, seconds: float) -> Window:
        assert self._runner is not None
        return self._runner.run(self._stream(seconds))

    async def _stream(self, seconds: float) -> Window:
        """One window: every worker streams for ``seconds``; rates as ``aps-detach``'s."""
        pids = self.worker_pids()
        own_before, workers_before = cpu_seconds(pids)
        start = time.perf_counter()
        for _, writer in self._streams:
            writer.write(_framed(repr(seconds).encode()))
        async with asyncio.timeout(seconds + STEP_TIMEOUT):
            counts = await asyncio.gather(*(self._take(reader) for reader, _ in self._streams))
        elapsed = time.perf_counter() - start
        own_after, workers_after = cpu_seconds(pids)
        workers = None
        if workers_before is not None and workers_after is not None:
            workers = workers_after - workers_before
        env_steps = sum(total for total, _ in counts)
        rate = sum(steady for _, steady in counts)
        return Window(env_steps, elapsed, own_after - own_before, workers, measured_rate=rate)

    @staticmethod
    async def _take(reader: asyncio.StreamReader) -> tuple[int, float]:
        """Decode one worker's chunks up to its empty frame: env-steps, and the steady rate.

        The steady rate counts the chunks after the first, from the first's arrival to the
        last's, as ``aps-detach``'s does.
        """
        total = counted = 0
        first = last = 0.0
        while frame := await _read_frame(reader):
            chunk = codec.decode(frame)
            assert isinstance(chunk, RolloutChunk)
            now = time.perf_counter()
            total += chunk.reward.size
            if first == 0.0:
                first = now
            else:
                counted += chunk.reward.size
                last = now
        return total, counted / (last - first) if last > first else 0.0


def stream_worker(
    address: str, env_id: str, num_envs: int, index: int, seed: int, steps: int
) -> None:
    """Stream chunks of ``steps`` steps to a ``stream-limit`` learner for each window it asks.

    The learner sends a window's length in seconds; the worker acts and sends chunks until
    that time has passed, then an empty frame. It ends when the learner closes.
    """
    from aps.worker.collector import Collector

    envs = LeanSyncVectorEnv(
        [partial(gym.make, env_id)] * num_envs, copy=False, autoreset_mode=AutoresetMode.SAME_STEP
    )
    collector = Collector(envs, POLICY, AutoresetMode.SAME_STEP)
    collector.version = 0  # the module's own initial weights, as the learner publishes them
    collector.observe(envs.reset(seed=seed)[0], None)
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=START_TIMEOUT) as sock:
            sock.settimeout(None)  # between windows the learner may take its time
            sock.sendall(_framed(str(index).encode()))
            while (seconds := _receive_frame(sock)) is not None:
                deadline = time.perf_counter() + float(seconds)
                while time.perf_counter() < deadline:
                    sock.sendall(_framed(codec.encode(collector.collect(steps))))
                sock.sendall(_framed(b""))
    except (ConnectionError, KeyboardInterrupt):
        pass  # the learner went away: done
    finally:
        collector.close()
        envs.close()


def _receive_frame(sock: socket.socket) -> bytes | None:
    """One frame from a blocking socket; ``None`` when the peer closed."""
    header = _receive_exactly(sock, HEADER_SIZE)
    return None if header is None else _receive_exactly(sock, parse_header(header))


def _receive_exactly(sock: socket.socket, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            return None
        data += part
    return bytes(data)


# The await loop over a Unix socket: what same-host workers save by leaving TCP.


class ApsUnix(ApsTcpAsync):
    """``await Learner.step`` as ``aps-tcp-async``, over ``unix://`` instead of loopback TCP."""

    name = "aps-unix"
    description = "await aps.Learner.step over a Unix socket (unix://), 'python -m aps worker'"

    def make_learner(self) -> aps.Learner:
        return aps.Learner("unix://", num_workers=self.setup.num_workers)


# Partial batches: each worker is stepped again as soon as it answers.


class ApsPartial(ApsTcpAsync):
    """``Learner.send``/``recv(min_workers=1)``: EnvPool's asynchronous mode, over TCP.

    Every env still gets an action chosen after its latest observation; what changes is
    that a worker that answered is sent its next actions at once, without waiting for the
    others, so the learner's work and every worker's stepping overlap.
    """

    name = "aps-partial"
    description = (
        "await Learner.send(actions, worker_ids) / Learner.recv(min_workers=1) over tcp: "
        "each worker is stepped again as soon as it answers"
    )

    async def _run(self, seconds: float) -> int:
        learner = self._learner
        assert learner is not None
        pool = self.pool
        count = len(pool)
        envs = self.setup.envs_per_worker
        workers = [info.worker_id for info in learner.workers]
        env_steps = 0
        calls = 0
        deadline = time.perf_counter() + seconds
        await learner.send(pool[0], workers)
        while True:
            info = (await learner.recv(min_workers=1))[4]
            ready = info["worker_id"][::envs].tolist()  # each answered worker, in env order
            env_steps += len(ready) * envs
            calls += 1
            if time.perf_counter() >= deadline:
                break
            await learner.send(pool[calls % count][: len(ready) * envs], ready)
        stepping = len(workers) - len(ready)
        if stepping:
            # The steps still out are delivered inside the window too: count them.
            await learner.recv(min_workers=stepping)
            env_steps += stepping * envs
        return env_steps

    def run(self, seconds: float) -> int:
        assert self._runner is not None
        return self._runner.run(self._run(seconds))


# DETACH: workers act with the MLP of a torch module and stream chunks.


class ApsDetach(ApsTcpAsync):
    """``aps.Learner.chunks`` over TCP: the learner takes chunks as fast as they arrive."""

    name = "aps-detach"
    description = (
        "DETACH over tcp: workers act with a 64-64 MLP (aps.policy.Policy, NumPy heads) "
        "and stream chunks of T steps; the learner consumes Learner.chunks(T, max_in_flight=2)"
    )
    chunk_env_steps: ClassVar[int] = 512  # per worker and chunk; the matrix's --detach-chunk
    max_in_flight: ClassVar[int] = 2

    @classmethod
    def unavailable(cls) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (DETACH workers act with a torch policy)"
        return None

    @classmethod
    def steps_per_chunk(cls, envs_per_worker: int) -> int:
        """T: enough steps for about ``chunk_env_steps`` env-steps per chunk, at least 1."""
        return max(1, -(-cls.chunk_env_steps // envs_per_worker))

    def make_learner(self) -> aps.Learner:
        return aps.Learner(
            f"tcp://{LOOPBACK}:0",
            num_workers=self.setup.num_workers,
            policy=POLICY,
            autoreset_mode="SameStep",  # every step is a transition; the DETACH docs' advice
        )

    def start(self) -> None:
        from aps import policy

        super().start()
        assert self._runner is not None and self._learner is not None
        learner = self._learner
        factory = policy.load_policy_factory(POLICY)
        agent = policy.build_module(
            factory, learner.single_observation_space, learner.single_action_space
        )
        self._runner.run(learner.publish(agent))

    def run(self, seconds: float) -> int:
        return self.window(seconds).env_steps

    def window(self, seconds: float) -> Window:
        assert self._runner is not None
        return self._runner.run(self._stream(seconds))

    async def _stream(self, seconds: float) -> Window:
        """One stream: the steady rate of each worker, summed.

        A worker's rate runs from the arrival of its first chunk to that of its last one,
        and counts the env-steps of the chunks after the first: so neither the time to the
        first chunk (the pipeline filling) nor the chunks in flight at the end (dropped when
        the stream closes) bias it. The stream goes on past ``seconds`` until every worker
        has delivered two chunks. The CPU covers the whole stream up to the last chunk taken,
        per env-step taken.
        """
        learner = self._learner
        assert learner is not None
        pids = self.worker_pids()
        own_before, workers_before = cpu_seconds(pids)
        start = time.perf_counter()
        deadline = start + seconds
        first: dict[int, float] = {}  # worker -> arrival of its first chunk
        last: dict[int, float] = {}  # worker -> arrival of its latest chunk after the first
        counted: dict[int, int] = {}  # worker -> env-steps of its chunks after the first
        env_steps = 0
        stream = learner.chunks(
            self.steps_per_chunk(self.setup.envs_per_worker), max_in_flight=self.max_in_flight
        )
        try:
            async for chunk in stream:
                now = time.perf_counter()
                env_steps += chunk.reward.size
                worker = chunk.worker_id
                if worker not in first:
                    first[worker] = now
                    counted[worker] = 0
                else:
                    counted[worker] += chunk.reward.size
                    last[worker] = now
                if now >= deadline and len(last) == self.setup.num_workers:
                    break
            elapsed = time.perf_counter() - start
            own_after, workers_after = cpu_seconds(pids)
        finally:
            await stream.aclose()  # receives and drops the chunks in flight, off the clock
        rate = sum(counted[w] / (last[w] - first[w]) for w in last)
        workers = None
        if workers_before is not None and workers_after is not None:
            workers = workers_after - workers_before
        return Window(env_steps, elapsed, own_after - own_before, workers, measured_rate=rate)


EXTRA: dict[str, type[Contender]] = {
    c.name: c
    for c in (
        EnvPool,
        TransportLimit,
        StepLimit,
        BareCeiling,
        BareProtocol,
        StreamLimit,
        EnvLimit,
        EnvParallel,
        ActLimit,
        ApsUnix,
        ApsPartial,
        ApsDetach,
    )
}
ALL: dict[str, type[Contender]] = {**CONTENDERS, **EXTRA}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="a transport-, step- or stream-limit worker (started by the benchmark)"
    )
    p.add_argument("--transport-worker", metavar="HOST:PORT", required=True)
    p.add_argument("--env", required=True)
    p.add_argument("--num-envs", type=int, required=True)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--step-envs", action="store_true", help="step the envs for every request")
    p.add_argument("--stream-steps", type=int, default=0, help="stream chunks of this many steps")
    args = p.parse_args(argv)
    where = (args.transport_worker, args.env, args.num_envs, args.index, args.seed)
    if args.stream_steps:
        stream_worker(*where, args.stream_steps)
        return 0
    transport_worker(*where, step_envs=args.step_envs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
