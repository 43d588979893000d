"""What compressing arrays on the wire costs and saves: per codec and level, and on Pong.

Two parts, both printed as tables (``--out FILE`` also writes them as JSON):

``codecs``
    Per kind of data, array size (256 B to 4 MiB) and codec at each level: the ratio
    (compressed bytes / raw bytes; lower is better), and compression and decompression
    speed in raw MB per second of CPU (best of three runs of at least 20 ms each, one
    thread, through the same calls :mod:`aps.wire.compression` makes). The kinds: Pong frames
    (EnvPool ``Pong-v5``, a stack of 4 x 84 x 84 uint8 frames per env-step, random
    actions), MuJoCo float observations (Gymnasium ``Humanoid-v5``, 348 float64 per step),
    CartPole floats (4 float32 per step) and random bytes. An array of ``size`` bytes is the
    first ``size`` bytes of consecutive observations, as a batch of envs lays them out.
    This is what chose :data:`aps.wire.compression.THRESHOLD`, :data:`~aps.wire.compression.LEVELS`
    and :data:`~aps.wire.compression.MAX_RATIO`.

``pong``
    A real learner and a real worker process (``aps worker --vector envpool``), Pong-v5 x 8
    envs, lockstep with random actions, once per compression setting (``none``, ``zstd``,
    ``lz4``; the learner's listener says its peers are not on this host, as ``auto`` would
    see a remote worker). Reported: bytes on the wire per env-step each way (counted by the
    learner's transport, frames only), the worker process's CPU per step (from ``/proc``,
    its EnvPool threads included), and the CPU per step of encoding the step results this
    run received again here with the codec (the whole encode, compression included: an
    upper bound of compression's cost), as a share of the worker's CPU per step, and of
    decoding them (what inflating costs the learner). The issue's goals: zstd at <= 0.3x
    raw bytes, compression at <= 10% of the worker's CPU.

``delta``
    Frame delta on Pong DETACH chunks (:mod:`aps.wire.frame_delta`). A real learner and a real
    worker (in this process, ``vector="envpool"``, Pong-v5 x 8 envs, a tiny linear policy
    that acts in well under a millisecond, so the chunks are Pong's) over TCP on 127.0.0.1,
    ``--chunk-steps`` steps a chunk, zstd with frame delta; the learner counts the bytes it
    receives. The chunks it received (equal to the worker's byte for byte) are then encoded
    again here as a session would send them, for each codec (``none``, ``zstd``, ``lz4``)
    with and without frame delta: bytes per env-step, and encode and decode CPU per
    env-step. Reported besides: the CPU per env-step of the check
    (:func:`~aps.wire.frame_delta.split`, on the worker) and of the rebuild
    (:func:`~aps.wire.frame_delta.rebuild`, on the learner), against EnvPool's own CPU per
    env-step of Pong (measured in this process, its threads included). ``none`` with frame
    delta is what a connection carries when ``compression`` asks for a codec that one side
    cannot import.

Nothing asserts on timings. The host's load moves the MB/s and CPU figures; ratios and
bytes do not move.

Usage::

    python benchmarks/compression.py                  # both parts, a minute or two
    python benchmarks/compression.py --part codecs --quick
    python benchmarks/compression.py --part pong --steps 300 --out results/compression.json
    python benchmarks/compression.py --part delta --chunk-steps 128
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from throughput import cpu_seconds  # noqa: E402

import aps  # noqa: E402
from aps import transports  # noqa: E402
from aps.wire import codec, compression, frame_delta  # noqa: E402
from aps.wire.messages import RolloutChunk, StepResult  # noqa: E402

SIZES = (256, 1024, 4096, 16384, 65536, 262144, 1048576, 4194304)
LEVELS = {"zstd": (1, 3, 6), "lz4": (0, 9)}  # lz4 0: its default (fast) block mode; 9: HC
DEADLINE = 120.0  # seconds for the worker to arrive, and for any one step


# --------------------------------------------------------------------------------------------
# Data


def pong_bytes(total: int) -> bytes:
    import envpool

    envs = envpool.make("Pong-v5", env_type="gymnasium", num_envs=8, seed=0)
    obs, _ = envs.reset()
    parts = [obs.tobytes()]
    rng = np.random.default_rng(0)
    while sum(len(p) for p in parts) < total:
        obs, *_ = envs.step(rng.integers(0, 6, 8))
        parts.append(obs.tobytes())
    envs.close()
    return b"".join(parts)[:total]


def gym_bytes(env_id: str, total: int) -> bytes:
    import gymnasium as gym

    env = gym.make(env_id)
    obs, _ = env.reset(seed=0)
    parts = [np.asarray(obs).tobytes()]
    size = len(parts[0])
    while size * len(parts) < total:
        obs, _, terminated, truncated, _ = env.step(env.action_space.sample())
        parts.append(np.asarray(obs).tobytes())
        if terminated or truncated:
            obs, _ = env.reset()
    env.close()
    return b"".join(parts)[:total]


def kinds(total: int) -> dict[str, bytes]:
    return {
        "pong uint8 frames": pong_bytes(total),
        "mujoco Humanoid float64": gym_bytes("Humanoid-v5", total),
        "cartpole float32": gym_bytes("CartPole-v1", total),
        "random bytes": os.urandom(total),
    }


# --------------------------------------------------------------------------------------------
# Part 1: codecs


def best_rate(action: Callable[[], object], nbytes: int, *, quick: bool) -> float:
    """Raw MB per CPU second of ``action`` (best of three runs of at least 20 ms)."""
    runs = 1 if quick else 3
    least = 0.01 if quick else 0.02
    best = float("inf")
    for _ in range(runs):
        count = 0
        start = time.thread_time()
        while True:
            action()
            count += 1
            spent = time.thread_time() - start
            if spent >= least:
                break
        best = min(best, spent / count)
    return nbytes / best / 1e6


def codecs_part(quick: bool) -> list[dict[str, Any]]:
    sizes = SIZES[::2] if quick else SIZES
    data = kinds(max(sizes))
    rows: list[dict[str, Any]] = []
    for kind, raw in data.items():
        for size in sizes:
            piece = np.frombuffer(raw, np.uint8, size)
            for name, levels in LEVELS.items():
                for level in levels[:1] if quick else levels:
                    packer = compression.Compressor(name, level)
                    packed = packer.compress(piece)
                    inflate = compression._INFLATE[name]  # what a receiving session calls
                    view = memoryview(packed)
                    assert inflate(view, size) == piece.tobytes()
                    rows.append(
                        {
                            "kind": kind,
                            "size": size,
                            "codec": name,
                            "level": level,
                            "ratio": len(packed) / size,
                            "compress_mb_s": best_rate(
                                lambda p=packer, x=piece: p.compress(x), size, quick=quick
                            ),
                            "decompress_mb_s": best_rate(
                                lambda f=inflate, v=view, n=size: f(v, n), size, quick=quick
                            ),
                        }
                    )
    return rows


def print_codecs(rows: Sequence[dict[str, Any]]) -> None:
    print(f"{'kind':<24} {'size':>8} {'codec':<7} {'ratio':>6} {'comp MB/s':>10} {'dec MB/s':>9}")
    for row in rows:
        codec_name = f"{row['codec']}:{row['level']}"
        print(
            f"{row['kind']:<24} {row['size']:>8} {codec_name:<7} {row['ratio']:>6.3f} "
            f"{row['compress_mb_s']:>10.0f} {row['decompress_mb_s']:>9.0f}"
        )


# --------------------------------------------------------------------------------------------
# Part 2: Pong end to end


class Counting:
    """A learner-side transport that counts frame bytes each way and is not on this host."""

    is_local = False

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.sent = 0
        self.received = 0

    @property
    def peer(self) -> str:
        return str(self._inner.peer)

    @property
    def max_frame_size(self) -> int:
        return int(self._inner.max_frame_size)

    @max_frame_size.setter
    def max_frame_size(self, size: int) -> None:
        self._inner.max_frame_size = size

    async def send(self, frame: Any) -> None:
        self.sent += memoryview(frame).nbytes
        await self._inner.send(frame)

    async def receive(self) -> bytes:
        frame: bytes = await self._inner.receive()
        self.received += len(frame)
        return frame

    async def aclose(self) -> None:
        await self._inner.aclose()


class CountingListener:
    is_local = False

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.accepted: list[Counting] = []

    @property
    def url(self) -> str:
        return str(self._inner.url)

    async def accept(self) -> Counting:
        transport = Counting(await self._inner.accept())
        self.accepted.append(transport)
        return transport

    async def aclose(self) -> None:
        await self._inner.aclose()


async def pong_run(setting: str, steps: int, num_envs: int) -> dict[str, Any]:
    token = secrets.token_hex(16)
    inner = await transports.get_factory("tcp").listen("tcp://127.0.0.1:0")
    listener = CountingListener(inner)
    with tempfile.TemporaryDirectory() as scratch:
        token_file = Path(scratch) / "token"
        token_file.write_text(token)
        timeouts = aps.Timeouts(connect=DEADLINE, step=DEADLINE)
        async with aps.Learner(
            listener, num_workers=1, token=token, timeouts=timeouts, compression=setting
        ) as learner:
            command = [
                *(sys.executable, "-m", "aps", "worker", learner.url),
                *("--env", "Pong-v5", "--vector", "envpool", "--num-envs", str(num_envs)),
                *("--token-file", str(token_file), "--compression", "auto"),
            ]
            process = await asyncio.create_subprocess_exec(*command)
            try:
                await learner.wait_for_workers()
                await learner.reset(seed=0)
                rng = np.random.default_rng(0)
                for _ in range(10):  # warm up
                    await learner.step(rng.integers(0, 6, num_envs))
                link = listener.accepted[-1]
                sent, received = link.sent, link.received
                _, cpu_before = cpu_seconds([process.pid])
                wall = time.perf_counter()
                results = []
                for _ in range(steps):
                    results.append(await learner.step(rng.integers(0, 6, num_envs)))
                wall = time.perf_counter() - wall
                _, cpu_after = cpu_seconds([process.pid])
                sent, received = link.sent - sent, link.received - received
                used = learner._pool.slots.admitted[0].session.compression
            finally:
                if process.returncode is None:
                    process.terminate()
                await process.wait()
    worker_cpu = (
        None if cpu_before is None or cpu_after is None else (cpu_after - cpu_before) / steps
    )
    env_steps = steps * num_envs
    return {
        "setting": setting,
        "used": used,
        "steps": steps,
        "num_envs": num_envs,
        "bytes_in_per_env_step": received / env_steps,
        "bytes_out_per_env_step": sent / env_steps,
        "worker_cpu_ms_per_step": None if worker_cpu is None else worker_cpu * 1e3,
        "wall_ms_per_step": wall / steps * 1e3,
        **codec_cpu(results, used),
        "raw_obs_bytes_per_env_step": results[0][0].nbytes / num_envs,
    }


def codec_cpu(results: Sequence[tuple[Any, ...]], used: str) -> dict[str, float]:
    """CPU ms per step of encoding (the worker's side) and decoding (the learner's) the step
    results of the run with ``used``, best of three passes; plain too, for reference.

    The whole encode and decode, not their difference from plain ones: the difference is
    below this host's noise (a plain encode copies the frame into fresh memory, which
    costs about what compressing it does), so the whole is the honest upper bound.
    """
    messages = [
        StepResult(obs=o, reward=r, terminated=te, truncated=tr, info=i)
        for o, r, te, tr, i in results
    ]
    packer = compression.compressor(used)

    def timed(action: Callable[[], object]) -> float:
        best = float("inf")
        for _ in range(3):
            start = time.thread_time()
            action()
            best = min(best, time.thread_time() - start)
        return best / len(messages) * 1e3

    plain_frames = [codec.encode(m) for m in messages]
    packed_frames = [codec.encode(m, compressor=packer) for m in messages]
    return {
        "encode_plain_cpu_ms_per_step": timed(lambda: [codec.encode(m) for m in messages]),
        "compress_cpu_ms_per_step": timed(
            lambda: [codec.encode(m, compressor=packer) for m in messages]
        ),
        "decode_plain_cpu_ms_per_step": timed(lambda: [codec.decode(f) for f in plain_frames]),
        "inflate_cpu_ms_per_step": timed(
            lambda: [codec.decode(f, compression=used) for f in packed_frames]
        ),
    }


def pong_part(steps: int, num_envs: int) -> list[dict[str, Any]]:
    rows = []
    for setting in ("none", "zstd", "lz4"):
        rows.append(asyncio.run(pong_run(setting, steps, num_envs)))
    raw = rows[0]["bytes_in_per_env_step"]
    plain_cpu = rows[0]["worker_cpu_ms_per_step"]
    for row in rows:
        cpu = row["worker_cpu_ms_per_step"]
        row["worker_cpu_vs_none"] = None if not (cpu and plain_cpu) else cpu / plain_cpu
        row["bytes_in_vs_raw"] = row["bytes_in_per_env_step"] / raw
        cpu = row["worker_cpu_ms_per_step"]
        row["compress_share_of_worker_cpu"] = (
            None if not cpu else row["compress_cpu_ms_per_step"] / cpu
        )
    return rows


def print_pong(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"{'setting':<8} {'B/env-step in':>14} {'vs raw':>7} {'B/env-step out':>15} "
        f"{'worker CPU ms/step':>19} {'vs none':>8} {'encode ms/step':>15} {'share':>6} "
        f"{'decode ms/step':>15} {'wall ms/step':>13}"
    )
    for row in rows:
        cpu = row["worker_cpu_ms_per_step"]
        share = row["compress_share_of_worker_cpu"]
        versus = row["worker_cpu_vs_none"]
        print(
            f"{row['setting']:<8} {row['bytes_in_per_env_step']:>14.0f} "
            f"{row['bytes_in_vs_raw']:>7.3f} {row['bytes_out_per_env_step']:>15.1f} "
            f"{'?' if cpu is None else f'{cpu:.2f}':>19} "
            f"{'?' if versus is None else f'{versus:.2f}':>8} "
            f"{row['compress_cpu_ms_per_step']:>15.3f} "
            f"{'?' if share is None else f'{share:.1%}':>6} "
            f"{row['inflate_cpu_ms_per_step']:>15.3f} {row['wall_ms_per_step']:>13.1f}"
        )


# --------------------------------------------------------------------------------------------
# Part 3: frame delta on Pong DETACH chunks


@functools.cache
def _tiny_agent_class() -> Any:
    import torch
    from torch import nn

    class TinyAgentModule(nn.Module):
        """A CleanRL-shaped agent that costs next to nothing: frames are what is measured.

        Its heads read a 2 x 2 average of the newest frame's pixels, so acting costs well
        under a millisecond for 8 envs and the worker's CPU is EnvPool's.
        """

        def __init__(self, envs: Any) -> None:
            super().__init__()
            actions = int(envs.single_action_space.n)
            self.actor = nn.Sequential(_Newest(), nn.Linear(42 * 42, actions))
            self.critic = nn.Sequential(_Newest(), nn.Linear(42 * 42, 1))

    class _Newest(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            frame = x[:, -1].float() / 255.0
            return nn.functional.avg_pool2d(frame[:, None], 2).flatten(1)

    return TinyAgentModule


def __getattr__(name: str) -> Any:
    # The worker imports the policy by path: build the torch class on first use only, so
    # the other parts run without torch.
    if name == "TinyAgentModule":
        return _tiny_agent_class()
    raise AttributeError(name)


POLICY = f"{Path(__file__).resolve()}:TinyAgentModule"


def as_message(chunk: Any) -> RolloutChunk:
    """The :class:`RolloutChunk` a learner's :class:`~aps.learner.Chunk` was sent as."""
    names = [f.name for f in dataclasses.fields(RolloutChunk) if f.name != "seq"]
    # The worker's timings are the learner's figures, not the Chunk's: left out here.
    fields = {name: getattr(chunk, name, None) for name in names}
    return RolloutChunk(**fields)


async def delta_run(chunk_steps: int, num_envs: int, chunks: int) -> dict[str, Any]:
    """Real DETACH chunks of Pong over TCP, zstd with frame delta; what the learner got."""
    inner = await transports.get_factory("tcp").listen("tcp://127.0.0.1:0")
    listener = CountingListener(inner)
    timeouts = aps.Timeouts(connect=DEADLINE, step=DEADLINE)
    token = secrets.token_hex(16)
    async with aps.Learner(
        listener,
        num_workers=1,
        token=token,
        timeouts=timeouts,
        policy=POLICY,
        compression="zstd",
    ) as learner:
        worker = aps.Worker(
            learner.url,
            "Pong-v5",
            vector="envpool",
            num_envs=num_envs,
            seed=0,
            token=token,
            timeouts=timeouts,
            allow_policy=(POLICY,),
        )
        task = asyncio.create_task(worker.run())
        try:
            await learner.wait_for_workers()
            encoding = learner._pool.slots.admitted[0].session.encoding
            await learner.reset(seed=0)
            await learner.publish(_tiny_agent_class()(learner))
            link = listener.accepted[-1]
            received = link.received
            got = []
            stream = learner.chunks(chunk_steps, max_in_flight=1)
            async for chunk in stream:
                got.append(as_message(chunk))
                if len(got) == chunks:
                    break
            wire = link.received - received  # before the chunk still in flight arrives
            await stream.aclose()
        finally:
            task.cancel()
            await asyncio.wait([task], timeout=10)
    return {"encoding": encoding, "chunks": got, "wire_bytes": wire}


def best_cpu(action: Callable[[], object], runs: int = 3) -> float:
    """The least CPU seconds (this thread) of ``runs`` calls of ``action``."""
    best = float("inf")
    for _ in range(runs):
        start = time.thread_time()
        action()
        best = min(best, time.thread_time() - start)
    return best


def envpool_cpu_per_env_step(num_envs: int, steps: int = 200) -> float:
    """EnvPool Pong's CPU seconds per env-step in this process, its threads included."""
    import envpool

    env = envpool.make("Pong-v5", env_type="gymnasium", num_envs=num_envs, seed=1)
    env.reset()
    rng = np.random.default_rng(1)
    actions = [rng.integers(0, 6, num_envs) for _ in range(steps)]
    start = time.process_time()
    for action in actions:
        env.step(action)
    spent = time.process_time() - start
    env.close()
    return spent / (steps * num_envs)


def delta_part(chunk_steps: int, num_envs: int, chunks: int) -> dict[str, Any]:
    run = asyncio.run(delta_run(chunk_steps, num_envs, chunks))
    messages: list[RolloutChunk] = run["chunks"]
    env_steps = sum(m.obs.shape[0] * m.obs.shape[1] for m in messages)
    rows = []
    for name in ("none", "zstd", "lz4"):
        packer = compression.compressor(name)
        for delta in (False, True):
            frames = [codec.encode(m, compressor=packer, frame_delta=delta) for m in messages]
            for frame, message in zip(frames, messages, strict=True):
                back = codec.decode(frame, compression=name, frame_delta=delta)
                assert isinstance(back, RolloutChunk)
                assert back.obs.tobytes() == message.obs.tobytes()  # exact, every time
            rows.append(
                {
                    "codec": name,
                    "frame_delta": delta,
                    "bytes_per_env_step": sum(len(f) for f in frames) / env_steps,
                    "encode_us_per_env_step": best_cpu(
                        lambda p=packer, d=delta: [
                            codec.encode(m, compressor=p, frame_delta=d) for m in messages
                        ]
                    )
                    / env_steps
                    * 1e6,
                    "decode_us_per_env_step": best_cpu(
                        lambda fs=frames, n=name, d=delta: [
                            codec.decode(f, compression=n, frame_delta=d) for f in fs
                        ]
                    )
                    / env_steps
                    * 1e6,
                }
            )
    raw = np.mean([m.obs[0, 0].nbytes for m in messages])
    plain = rows[0]["bytes_per_env_step"]
    for row in rows:
        row["vs_plain"] = row["bytes_per_env_step"] / plain
    deltas = [frame_delta.split(m.obs) for m in messages]
    coded = sum(int(d.mask.sum()) for d in deltas if d is not None)
    split_s = best_cpu(lambda: [frame_delta.split(m.obs) for m in messages])
    rebuild_s = best_cpu(lambda: [frame_delta.rebuild(d) for d in deltas if d is not None])
    env_s = envpool_cpu_per_env_step(num_envs)
    return {
        "chunk_steps": chunk_steps,
        "num_envs": num_envs,
        "chunks": len(messages),
        "env_steps": env_steps,
        "raw_obs_bytes_per_env_step": float(raw),
        "delta_coded_share": coded / env_steps,
        "wire": {
            "encoding": run["encoding"],
            "bytes_per_env_step": run["wire_bytes"] / env_steps,
        },
        "split_us_per_env_step": split_s / env_steps * 1e6,
        "rebuild_us_per_env_step": rebuild_s / env_steps * 1e6,
        "env_step_cpu_us_per_env_step": env_s * 1e6,
        "rows": rows,
    }


def print_delta(report: dict[str, Any]) -> None:
    print(
        f"Pong-v5 DETACH chunks: {report['chunks']} x {report['chunk_steps']} steps x "
        f"{report['num_envs']} envs, raw obs {report['raw_obs_bytes_per_env_step']:.0f} B per "
        f"env-step, {report['delta_coded_share']:.1%} of (t, e) sent as their newest frame"
    )
    wire = report["wire"]
    print(
        f"on the wire ({wire['encoding']}, learner's count, heartbeats included): "
        f"{wire['bytes_per_env_step']:.0f} B per env-step"
    )
    print(
        f"{'codec':<6} {'delta':<6} {'B/env-step':>11} {'vs plain':>9} {'enc us':>8} {'dec us':>8}"
    )
    for row in report["rows"]:
        print(
            f"{row['codec']:<6} {'yes' if row['frame_delta'] else 'no':<6} "
            f"{row['bytes_per_env_step']:>11.0f} {row['vs_plain']:>9.3f} "
            f"{row['encode_us_per_env_step']:>8.1f} {row['decode_us_per_env_step']:>8.1f}"
        )
    env = report["env_step_cpu_us_per_env_step"]
    for name in ("split", "rebuild"):
        cost = report[f"{name}_us_per_env_step"]
        print(
            f"{name:<8} {cost:6.1f} us CPU per env-step, {cost / env:.1%} of EnvPool's {env:.0f} us"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--part", choices=("codecs", "pong", "delta", "both"), default="both")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, levels and runs")
    parser.add_argument("--steps", type=int, default=200, help="Pong lockstep steps per setting")
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--chunk-steps", type=int, default=128, help="steps per DETACH chunk")
    parser.add_argument("--chunks", type=int, default=4, help="DETACH chunks to measure")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    missing = [c for c in compression.CODECS if c not in compression.available()]
    if missing:
        print(f"compression.py: install the compression extra first (missing {missing})")
        return 2
    report: dict[str, Any] = {}
    if args.part in ("codecs", "both"):
        report["codecs"] = codecs_part(args.quick)
        print_codecs(report["codecs"])
    if args.part in ("pong", "both"):
        report["pong"] = pong_part(args.steps, args.num_envs)
        print_pong(report["pong"])
    if args.part == "delta":
        report["delta"] = delta_part(args.chunk_steps, args.num_envs, args.chunks)
        print_delta(report["delta"])
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
