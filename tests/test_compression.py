"""Compression negotiated in the handshake: the choice, exact arrays, and lying payloads refused.

Learners and workers meet over real sockets (TCP on 127.0.0.1, and one WebSocket case). A
peer "not on this host" is a TCP connection wrapped in :class:`Offsite`, whose ``is_local``
is False: the honest way to have a remote peer on one machine, since ``"auto"`` reads only
that capability. A side that "lacks" a library is simulated in this process either by the
worker's own setting (``compression="none"``: it offers nothing) or by monkeypatching
:func:`aps.wire.compression.available`, which then holds for both ends of the test.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tracemalloc
from pathlib import Path
from typing import Any

import gymnasium as gym
import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

zstandard = pytest.importorskip("zstandard")
lz4_block = pytest.importorskip("lz4.block")

import aps  # noqa: E402
from aps import transports  # noqa: E402
from aps.cli import main as cli_main  # noqa: E402
from aps.session.protocol import worker_proof  # noqa: E402
from aps.transports.tcp import TCPFactory  # noqa: E402
from aps.wire import codec, compression  # noqa: E402
from aps.wire._wire import unpadded_header  # noqa: E402
from aps.wire.compression import CODEC_IDS, EXT_COMPRESSED, choose, offer  # noqa: E402
from aps.wire.messages import (  # noqa: E402
    PROTOCOL_VERSION,
    Challenge,
    GradientProgress,
    GradientRound,
    Hello,
    Ready,
    ResetResult,
    StepResult,
    Weights,
    Welcome,
)
from tests.conftest import FAST  # noqa: E402

TCP = "tcp://127.0.0.1:0"
TOKEN = "compression-test-token"
HERE = Path(__file__)


# --------------------------------------------------------------------------------------------
# An env with pixel observations: mostly background, a bright square that the action moves.


class PixelEnv(gym.Env[np.ndarray, np.int64]):
    """4 x 32 x 32 uint8 frames (4 KiB per env, like a small Atari frame stack)."""

    def __init__(self, max_steps: int = 4) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (4, 32, 32), np.uint8)
        self.action_space = gym.spaces.Discrete(2)
        self.max_steps = max_steps
        self.big = np.arange(20_000, dtype=np.int32) // 64  # an attribute worth compressing

    def _frame(self) -> np.ndarray:
        frame = np.zeros((4, 32, 32), np.uint8)
        for k in range(4):
            x = (self.x + k) % 28
            frame[k, self.y : self.y + 4, x : x + 4] = 200 + k
        frame[:, 0, :] = self.t  # a row that changes every step
        return frame

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.x = int(self.np_random.integers(0, 28))
        self.y = int(self.np_random.integers(0, 28))
        self.t = 0
        return self._frame(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        self.x = (self.x + (1 if int(action) else -1)) % 28
        reward = float(self.x) + float(self.np_random.random())
        return self._frame(), reward, False, self.t >= self.max_steps, {}


def make_pixel_env() -> PixelEnv:
    return PixelEnv()


ENV = f"{HERE}:make_pixel_env"

torch = pytest.importorskip("torch")
nn = torch.nn


class PixelAgent(nn.Module):
    """A CleanRL-shaped agent for pixels whose weights start at zero (so they compress)."""

    def __init__(self, envs: Any) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape))
        self.critic = nn.Sequential(nn.Flatten(), nn.Linear(size, 1))
        self.actor = nn.Sequential(nn.Flatten(), nn.Linear(size, int(envs.single_action_space.n)))
        for parameter in self.parameters():
            nn.init.zeros_(parameter)


POLICY = f"{HERE}:PixelAgent"


# --------------------------------------------------------------------------------------------
# A transport whose peer is not on this host, and that counts the bytes it receives.


class Offsite:
    """Wraps a transport: ``is_local`` is what the test says; received bytes are counted."""

    def __init__(self, inner: Any, local: bool) -> None:
        self._inner = inner
        self.is_local = local
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
        await self._inner.send(frame)

    async def receive(self) -> bytes:
        frame: bytes = await self._inner.receive()
        self.received += len(frame)
        return frame

    async def aclose(self) -> None:
        await self._inner.aclose()


class OffsiteListener:
    """A listener whose accepted connections are :class:`Offsite` ones."""

    def __init__(self, inner: Any, local: bool) -> None:
        self._inner = inner
        self.is_local = local
        self.accepted: list[Offsite] = []

    @property
    def url(self) -> str:
        return str(self._inner.url)

    async def accept(self) -> Offsite:
        transport = Offsite(await self._inner.accept(), self.is_local)
        self.accepted.append(transport)
        return transport

    async def aclose(self) -> None:
        await self._inner.aclose()


async def listen(url: str = TCP, *, local: bool, factory: Any = None) -> OffsiteListener:
    factory = factory or transports.get_factory(transports.scheme_of(url))
    return OffsiteListener(await factory.listen(url), local)


async def run_workers(learner: aps.Learner, count: int, **kwargs: Any) -> list[asyncio.Task[None]]:
    kwargs.setdefault("timeouts", FAST)
    kwargs.setdefault("token", TOKEN)
    kwargs.setdefault("allow_policy", (f"{HERE}:*",))
    tasks = [
        asyncio.create_task(aps.Worker(learner.url, ENV, **kwargs).run()) for _ in range(count)
    ]
    await learner.wait_for_workers()
    return tasks


async def stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=5)


def sessions(learner: aps.Learner) -> list[str]:
    return [remote.session.compression for remote in learner._pool.slots.admitted]


# --------------------------------------------------------------------------------------------
# Settings


def test_an_unknown_setting_is_a_config_error_listing_the_valid_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    for bad in ("gzip", "ZSTD", "", None, 1):
        with pytest.raises(aps.ConfigError, match="'auto', 'zstd', 'lz4', 'none'"):
            aps.Learner(TCP, num_workers=1, compression=bad)  # type: ignore[arg-type]
    with pytest.raises(aps.ConfigError, match="got 'gzip'"):
        aps.Worker("tcp://127.0.0.1:1", "CartPole-v1", compression="gzip")
    with pytest.raises(aps.ConfigError, match="got 'brotli'"):
        aps.ClusterEnv.local("CartPole-v1", num_workers=1, compression="brotli")
    code = cli_main(["worker", "tcp://127.0.0.1:1", "--env", "CartPole-v1", "--compression", "xz"])
    assert code == 1 and "'auto', 'zstd', 'lz4', 'none', got 'xz'" in capsys.readouterr().err


# Written out by hand: (learner setting, worker setting, peer local?, codecs importable) ->
# what the connection uses.
MATRIX = [
    ("auto", "auto", True, ("zstd", "lz4"), "none"),
    ("auto", "auto", False, ("zstd", "lz4"), "zstd"),
    ("auto", "lz4", False, ("zstd", "lz4"), "lz4"),
    ("auto", "none", False, ("zstd", "lz4"), "none"),
    ("auto", "auto", False, ("lz4",), "lz4"),
    ("auto", "auto", False, (), "none"),
    ("zstd", "auto", True, ("zstd", "lz4"), "zstd"),
    ("zstd", "lz4", False, ("zstd", "lz4"), "none"),
    ("zstd", "zstd", False, ("lz4",), "none"),
    ("lz4", "auto", True, ("zstd", "lz4"), "lz4"),
    ("lz4", "zstd", True, ("zstd", "lz4"), "none"),
    ("none", "auto", False, ("zstd", "lz4"), "none"),
    ("none", "zstd", True, ("zstd", "lz4"), "none"),
]


@pytest.mark.parametrize(("learner", "worker", "local", "have", "expected"), MATRIX)
def test_the_learner_chooses_from_what_the_worker_offers(
    monkeypatch: pytest.MonkeyPatch,
    learner: str,
    worker: str,
    local: bool,
    have: tuple[str, ...],
    expected: str,
) -> None:
    monkeypatch.setattr(compression, "available", lambda: have)
    offered = offer(worker)
    assert set(offered) <= set(have)
    assert choose(learner, offered, local=local, peer="tcp://10.0.0.2:1") == expected


# Over real sockets: the Welcome carries the choice and both ends use it.
SOCKET_CASES = [
    ("auto", "auto", True, "none"),
    ("auto", "auto", False, "zstd"),
    ("auto", "lz4", False, "lz4"),
    ("zstd", "auto", True, "zstd"),
    ("lz4", "none", False, "none"),
    ("none", "auto", False, "none"),
]


@pytest.mark.parametrize(("learner_setting", "worker_setting", "local", "expected"), SOCKET_CASES)
async def test_the_handshake_settles_the_codec_for_both_ends(
    learner_setting: str, worker_setting: str, local: bool, expected: str
) -> None:
    listener = await listen(local=local)
    async with aps.Learner(
        listener, num_workers=1, token=TOKEN, timeouts=FAST, compression=learner_setting
    ) as learner:
        tasks = await run_workers(learner, 1, compression=worker_setting)
        try:
            obs, _ = await learner.reset(seed=3)
            await learner.step(np.ones(1, np.int64))
            assert sessions(learner) == [expected]
            assert obs.shape == (1, 4, 32, 32)
        finally:
            await stop(tasks)


async def test_a_side_without_the_library_falls_back_to_none_with_one_log_line(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # In this process both ends lack zstandard: the worker asked for zstd offers nothing.
    monkeypatch.setattr(compression, "available", lambda: ("lz4",))
    monkeypatch.setattr(compression, "_said", set())
    caplog.set_level(logging.DEBUG, logger="aps.wire.compression")
    async with aps.Learner(
        TCP, num_workers=2, token=TOKEN, timeouts=FAST, compression="zstd"
    ) as learner:
        tasks = await run_workers(learner, 2, compression="zstd")
        try:
            await learner.reset(seed=0)
            assert sessions(learner) == ["none", "none"]
        finally:
            await stop(tasks)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    worker_lines = [r for r in warnings if "this worker cannot import zstandard" in r.message]
    learner_lines = [r for r in warnings if "this learner cannot import zstandard" in r.message]
    assert len(worker_lines) == 1 and len(learner_lines) == 1, [r.message for r in warnings]


async def test_auto_compresses_for_offsite_peers_only_and_says_so_once(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(compression, "_said", set())
    caplog.set_level(logging.INFO, logger="aps.wire.compression")
    for local, expected in ((True, "none"), (False, "zstd")):
        listener = await listen(local=local)
        async with aps.Learner(listener, num_workers=2, token=TOKEN, timeouts=FAST) as learner:
            tasks = await run_workers(learner, 2)
            try:
                await learner.reset(seed=0)
                assert sessions(learner) == [expected, expected]
            finally:
                await stop(tasks)
    said = [r for r in caplog.records if r.levelno == logging.INFO and "'auto'" in r.message]
    assert len(said) == 1 and "zstd-compressed" in said[0].message


# --------------------------------------------------------------------------------------------
# Compressed steps equal uncompressed ones, bit for bit


async def lockstep_run(
    url: str, setting: str, mode: str, steps: int = 9
) -> tuple[list[Any], int, list[str]]:
    listener = await listen(url, local=False)
    out: list[Any] = []
    async with aps.Learner(
        listener,
        num_workers=2,
        token=TOKEN,
        timeouts=FAST,
        compression=setting,
        autoreset_mode=mode,
    ) as learner:
        tasks = await run_workers(learner, 2, num_envs=2)
        try:
            out.append(await learner.reset(seed=11))
            rng = np.random.default_rng(5)
            for _ in range(steps):
                out.append(await learner.step(rng.integers(0, 2, size=4)))
            used = sessions(learner)
        finally:
            await stop(tasks)
    return out, sum(t.received for t in listener.accepted), used


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.dtype == b.dtype and a.shape == b.shape
        if a.dtype == object:
            for x, y in zip(a.flat, b.flat, strict=True):
                assert_same(x, y)
        else:
            assert a.tobytes() == b.tobytes()
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, tuple | list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize(
    ("url", "setting", "mode"),
    [
        (TCP, "zstd", "NextStep"),
        (TCP, "lz4", "SameStep"),
        (TCP, "zstd", "SameStep"),  # final_obs: an object array of frames
        ("ws://127.0.0.1:0", "zstd", "SameStep"),
    ],
)
async def test_compressed_lockstep_equals_uncompressed_bit_for_bit(
    url: str, setting: str, mode: str
) -> None:
    if url.startswith("ws"):
        pytest.importorskip("websockets")
    plain, plain_bytes, plain_used = await lockstep_run(url, "none", mode)
    packed, packed_bytes, packed_used = await lockstep_run(url, setting, mode)
    assert plain_used == ["none", "none"] and packed_used == [setting, setting]
    assert_same(plain, packed)
    if mode == "SameStep":
        assert any("final_obs" in step[4] for step in packed[1:])
    # Frames of background and a square: the workers' answers shrink several-fold.
    assert packed_bytes < plain_bytes / 3, (packed_bytes, plain_bytes)


async def test_detach_chunks_and_weights_travel_compressed_and_exact() -> None:
    listener = await listen(local=False)
    async with aps.Learner(
        listener,
        num_workers=1,
        token=TOKEN,
        timeouts=FAST,
        policy=POLICY,
        autoreset_mode="SameStep",
    ) as learner:
        worker = aps.Worker(
            learner.url, ENV, num_envs=2, token=TOKEN, timeouts=FAST, allow_policy=(f"{HERE}:*",)
        )
        task = asyncio.create_task(worker.run())
        try:
            await learner.wait_for_workers()
            assert sessions(learner) == ["zstd"]
            await learner.reset(seed=21)
            agent = PixelAgent(learner)
            with torch.no_grad():
                agent.actor[1].bias.copy_(torch.tensor([0.25, -0.5]))
            version = await learner.publish(agent)
            rollout = await learner.rollout(6)
            # The weights the worker acts with are the learner's, bit for bit.
            assert worker._server is not None and worker._server.collector is not None
            held = worker._server.collector.policy.get_weights()
            versions = learner._detach.versions
            assert versions is not None
            sent = versions.weights(version)
            assert held.keys() == sent.keys()
            for name in sent:
                assert np.asarray(held[name]).tobytes() == np.asarray(sent[name]).tobytes()
            assert len(versions.frame(version, "zstd")) < len(versions.frame(version)) / 10
        finally:
            task.cancel()
            await asyncio.wait([task], timeout=5)
    # The chunk's observations are the env's for the actions the worker chose: replay them.
    envs = gym.vector.SyncVectorEnv(
        [make_pixel_env, make_pixel_env], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    obs, _ = envs.reset(seed=21)
    for t in range(6):
        assert obs.tobytes() == np.asarray(rollout.obs[t]).tobytes()
        obs, reward, _, _, _ = envs.step(np.asarray(rollout.actions[t]))
        assert reward.tobytes() == np.asarray(rollout.reward[t]).tobytes()
    envs.close()
    assert listener.accepted[0].received < 6 * 2 * 4096  # less than the raw frames alone


async def test_a_gradient_round_travels_compressed_where_negotiated() -> None:
    listener = await listen(local=False)
    async with aps.Learner(
        listener,
        num_workers=2,
        token=TOKEN,
        timeouts=FAST,
        policy=POLICY,
        autoreset_mode="SameStep",
    ) as learner:
        tasks = [
            asyncio.create_task(
                aps.Worker(
                    learner.url,
                    ENV,
                    num_envs=2,
                    token=TOKEN,
                    timeouts=FAST,
                    allow_policy=(f"{HERE}:*",),
                    compression=setting,
                ).run()
            )
            for setting in ("zstd", "none")
        ]
        try:
            await learner.wait_for_workers()
            assert sorted(sessions(learner)) == ["none", "zstd"]
            agent = PixelAgent(learner)
            arrays = {k: v.detach().numpy() for k, v in agent.state_dict().items()}
            message = GradientRound(round=0, arrays=arrays, horizon=3, gamma=1.0)
            plain = len(codec.encode(message))
            packed = len(codec.encode(message, compressor=compression.compressor("zstd")))
            assert packed < plain / 10  # the zero weights compress: the codec is worth it
            # Each worker gets the round in its connection's codec, encoded once per codec.
            assert await learner.start_round(0, arrays, horizon=3, gamma=1.0) == plain + packed
            counted: set[int] = set()
            async with asyncio.timeout(30):
                while len(counted) < 2:  # both decoded the round and sample at its point
                    worker_id, report = await learner.next_report()
                    if isinstance(report, GradientProgress) and report.count:
                        counted.add(worker_id)
            await learner.stop_gradients()
        finally:
            await stop(tasks)


async def test_env_call_results_travel_compressed_and_exact() -> None:
    listener = await listen(local=False)
    async with aps.Learner(listener, num_workers=1, token=TOKEN, timeouts=FAST) as learner:
        tasks = await run_workers(learner, 1, num_envs=2)
        try:
            before = listener.accepted[0].received
            values = await learner.get_attr("big")
            received = listener.accepted[0].received - before
        finally:
            await stop(tasks)
    expected = PixelEnv().big
    assert len(values) == 2 and all(v.tobytes() == expected.tobytes() for v in values)
    assert received < expected.nbytes / 4


# --------------------------------------------------------------------------------------------
# The codec's part


def test_arrays_of_every_layout_round_trip_and_small_ones_stay_plain() -> None:
    rng = np.random.default_rng(0)
    zstd, lz4 = compression.compressor("zstd"), compression.compressor("lz4")
    frames = np.zeros((8, 4, 84, 84), np.uint8)
    frames[:, :, 20:30, 40:44] = 255
    values = {
        "pixels": frames,
        "big_endian": np.arange(4096, dtype=">f8") % 7,
        "strided": np.zeros((64, 128), np.float32)[:, ::2],
        "bools": np.zeros(10_000, bool),
        "noise": rng.integers(0, 256, 8192).astype(np.uint8),  # does not shrink: plain
        "small": np.zeros(100, np.float32),
    }
    nested = np.empty(2, object)
    nested[0], nested[1] = frames[0], {"deep": frames[1]}
    message = StepResult(
        obs=values,
        reward=np.zeros(8, np.float32),
        terminated=np.zeros(8, bool),
        truncated=np.zeros(8, bool),
        info={"final_obs": nested},
    )
    for compressor in (zstd, lz4):
        assert compressor is not None
        frame = codec.encode(message, compressor=compressor)
        decoded = codec.decode(frame, compression=compressor.name)
        assert isinstance(decoded, StepResult)
        assert_same(
            decoded.obs,
            {k: np.ascontiguousarray(v, v.dtype.newbyteorder("<")) for k, v in values.items()},
        )
        assert_same(decoded.info, message.info)
        assert not decoded.obs["pixels"].flags.writeable
        assert len(frame) < 0.1 * len(codec.encode(message))
    # A message without large arrays is the same frame compressed or not.
    small = ResetResult(obs=np.zeros((2, 4), np.float32), info={})
    assert codec.encode(small, compressor=zstd) == codec.encode(small)
    # Noise and small arrays travel as plain array extensions even on a compressed connection.
    alone = ResetResult(obs={"noise": values["noise"], "small": values["small"]}, info={})
    assert codec.encode(alone, compressor=zstd) == codec.encode(alone)


# --------------------------------------------------------------------------------------------
# Payloads that lie, from a hand-rolled worker that proved the token


def ext(codec_id: int, dtype: str, shape: tuple[int, ...], data: bytes) -> msgpack.ExtType:
    header = unpadded_header(np.dtype(dtype).newbyteorder("<").str, shape)
    return msgpack.ExtType(EXT_COMPRESSED, bytes([codec_id]) + header + data)


ZSTD, LZ4 = CODEC_IDS["zstd"], CODEC_IDS["lz4"]


def zstd_of(size: int) -> bytes:
    data: bytes = zstandard.ZstdCompressor(level=1).compress(bytes(size))
    return data


def lz4_of(size: int) -> bytes:
    data: bytes = lz4_block.compress(bytes(size), store_size=False)
    return data


LIMIT = 2**20  # the learner's frame limit in these cases

U8 = "uint8"
LIES = {
    # A frame of a few hundred bytes that would inflate to 4x the frame limit.
    "declares_above_the_limit": (
        "zstd",
        ext(ZSTD, U8, (4096, 1024), zstd_of(4 * LIMIT)),
        "over the",
    ),
    # The header says 4 KiB; the zstd frame inside says (and holds) 100 kB.
    "zstd_declares_more_than_the_header": (
        "zstd",
        ext(ZSTD, U8, (64, 64), zstd_of(100_000)),
        "declares 100000 bytes",
    ),
    "lz4_holds_more_than_declared": (
        "lz4",
        ext(LZ4, U8, (64, 64), lz4_of(100_000)),
        "does not inflate with lz4",
    ),
    "lz4_holds_less_than_declared": (
        "lz4",
        ext(LZ4, U8, (64, 64), lz4_of(1000)),
        "inflates to 1000 bytes",
    ),
    "zstd_garbage": ("zstd", ext(ZSTD, U8, (64, 64), os.urandom(300)), "zstd"),
    "lz4_garbage": ("lz4", ext(LZ4, U8, (64, 64), b"\xff" * 300), "lz4"),
    "codec_not_negotiated": (
        "zstd",
        ext(LZ4, U8, (64, 64), lz4_of(4096)),
        "did not negotiate",
    ),
    "unknown_codec_id": ("zstd", ext(9, U8, (64, 64), zstd_of(4096)), "unknown codec id 9"),
    "compressed_on_a_plain_connection": (
        "none",
        ext(ZSTD, U8, (64, 64), zstd_of(4096)),
        "negotiated no compression",
    ),
}


def reset_result(obs: Any) -> bytes:
    """A ResetResult frame holding ``obs``, packed by hand as a lying peer would."""
    frame: bytes = msgpack.packb(
        {"t": "reset_result", "obs": obs, "info": {}, "seq": 0, "timings": None}, use_bin_type=True
    )
    return frame


@pytest.mark.parametrize("case", sorted(LIES))
async def test_a_payload_that_lies_is_that_workers_protocol_error(case: str) -> None:
    setting, obs, words = LIES[case]
    token = TOKEN.encode()
    factory = TCPFactory(max_frame_size=LIMIT)
    async with aps.Learner(
        TCP, num_workers=1, token=TOKEN, timeouts=FAST, compression=setting, factory=factory
    ) as learner:
        transport = await factory.connect(learner.url, timeout=5)
        try:
            challenge = codec.decode_handshake(await transport.receive())
            assert isinstance(challenge, Challenge)
            nonce = os.urandom(32)
            hello = Hello(
                protocol_version=PROTOCOL_VERSION,
                proof=worker_proof(token, challenge.nonce, nonce),
                env_id="pixels",
                num_envs=1,
                seed=None,
                host="elsewhere",
                pid=1,
                label="",
                nonce=nonce,
                compression="zstd,lz4",
            )
            await transport.send(codec.encode(hello))
            welcome = codec.decode_handshake(await transport.receive())
            assert isinstance(welcome, Welcome) and welcome.compression == setting
            space = gym.spaces.Box(0, 255, (64, 64), np.uint8)
            ready = Ready(observation_space=space, action_space=gym.spaces.Discrete(2), num_envs=1)
            await transport.send(codec.encode(ready))
            reset = asyncio.create_task(learner.reset(seed=0))
            request = codec.decode(await transport.receive(), compression=setting)
            assert type(request).__name__ == "ResetRequest"
            await transport.send(reset_result(obs))
            with pytest.raises(aps.ApsError) as caught:
                await asyncio.wait_for(reset, 10)
        finally:
            await transport.aclose()
    chain = []
    error: BaseException | None = caught.value
    while error is not None:
        chain.append(error)
        error = error.__cause__
    protocol = [e for e in chain if isinstance(e, aps.ProtocolError)]
    assert protocol, chain
    text = str(protocol[0])
    assert "127.0.0.1" in text and words in text, text


def test_a_lying_size_is_refused_before_anything_is_allocated() -> None:
    # A 4 GiB array declared in a frame of a few hundred bytes: refused by its header.
    bomb = reset_result(ext(ZSTD, U8, (2**16, 2**16), zstd_of(LIMIT)))
    tracemalloc.start()
    try:
        with pytest.raises(aps.WireError, match="over the"):
            codec.decode(bomb, compression="zstd", max_frame_size=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < LIMIT // 4, peak
    # Arrays of one frame share the limit: two of 600 KiB do not fit in 1 MiB together.
    pair = reset_result([ext(ZSTD, U8, (600, 1024), zstd_of(600 * 1024))] * 2)
    with pytest.raises(aps.WireError, match="left of this side's limit"):
        codec.decode(pair, compression="zstd", max_frame_size=LIMIT)
    assert codec.decode(pair, compression="zstd", max_frame_size=2 * LIMIT)


async def test_a_worker_refuses_a_codec_it_did_not_offer() -> None:
    listener = await transports.get_factory("tcp").listen(TCP)
    worker = aps.Worker(listener.url, ENV, timeouts=FAST, compression="zstd", reconnect=False)
    task = asyncio.create_task(worker.run())
    transport = await listener.accept()
    try:
        await transport.send(
            codec.encode(Challenge(protocol_version=PROTOCOL_VERSION, nonce=b"n" * 32))
        )
        hello = codec.decode_handshake(await transport.receive())
        assert isinstance(hello, Hello) and hello.compression == "zstd,frame-delta"
        welcome = Welcome(worker_id=0, autoreset_mode="NextStep", policy=None, compression="lz4")
        await transport.send(codec.encode(welcome))
        with pytest.raises(aps.ProtocolError, match="chose compression 'lz4'"):
            await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
        await asyncio.wait([task], timeout=5)
        await transport.aclose()
        await listener.aclose()


def test_weights_decode_equal_from_a_compressed_frame() -> None:
    arrays = {"w": np.zeros((256, 256), np.float32), "b": np.linspace(0, 1, 4096, dtype=np.float32)}
    message = Weights(version=3, arrays=arrays, epsilon=None)
    for name in compression.CODECS:
        frame = codec.encode(message, compressor=compression.compressor(name))
        decoded = codec.decode(frame, compression=name)
        assert isinstance(decoded, Weights)
        assert_same(decoded.arrays, arrays)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    codec_id=st.sampled_from([ZSTD, LZ4, 0, 255]),
    shape=st.lists(st.integers(0, 2**20), max_size=3).map(tuple),
    body=st.one_of(
        st.binary(max_size=64),
        st.integers(0, 5000).map(zstd_of),
        st.integers(0, 5000).map(lz4_of),
    ),
    cut=st.integers(0, 8),
)
def test_any_compressed_payload_decodes_or_is_a_wire_error(
    codec_id: int, shape: tuple[int, ...], body: bytes, cut: int
) -> None:
    payload = ext(codec_id, U8, shape, body).data
    frame = reset_result(msgpack.ExtType(EXT_COMPRESSED, payload[: len(payload) - cut]))
    frames = [frame, bytearray(frame), memoryview(frame)]
    for frame in frames:
        for negotiated in ("zstd", "lz4", "none"):
            try:
                message = codec.decode(frame, compression=negotiated, max_frame_size=LIMIT)
            except aps.WireError:
                continue
            assert isinstance(message, ResetResult)
            assert message.obs.shape == shape and not message.obs.flags.writeable


def test_small_compressed_frames_decode_from_any_buffer() -> None:
    """A 4 KiB array of zeros compresses to a frame of a few dozen bytes; any buffer holds it."""
    message = ResetResult(obs=np.zeros((64, 64), np.uint8), info={})
    for name in compression.CODECS:
        frame = codec.encode(message, compressor=compression.compressor(name))
        assert len(frame) < 100
        for buffer in (frame, bytearray(frame), memoryview(frame)):
            decoded = codec.decode(buffer, compression=name)
            assert isinstance(decoded, ResetResult)
            assert decoded.obs.tobytes() == message.obs.tobytes()
        with pytest.raises(aps.WireError, match="negotiated no compression"):
            codec.decode(memoryview(frame))


@pytest.mark.parametrize("url", [TCP, "unix://", "memory://"])
async def test_auto_stays_plain_over_the_real_local_transports(url: str) -> None:
    async with aps.Learner(url, num_workers=1, token=TOKEN, timeouts=FAST) as learner:
        tasks = await run_workers(learner, 1)
        try:
            await learner.reset(seed=0)
            assert sessions(learner) == ["none"]
            assert transports.is_local(learner._pool.slots.admitted[0].session._transport)
        finally:
            await stop(tasks)
