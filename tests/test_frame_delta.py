"""Frame delta: a DETACH chunk's frame stacks travel as their newest frames, rebuilt exactly.

The split and the rebuild are tested on synthetic stacks (episode boundaries, t=0, float
frames whose bits matter) and on real Pong frames from EnvPool; the negotiation and the
lying peers over real sockets on 127.0.0.1, through a real Learner and real Workers whose
envs are Gymnasium's ``FrameStackObservation``. A lying worker is an honest one whose chunk
frames are rewritten on the way out, so the learner reads exactly the bytes a bad peer would
send, and the honest worker next to it keeps going.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
import tracemalloc
from pathlib import Path
from typing import Any

import gymnasium as gym
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import aps
from aps.cli import main as cli_main
from aps.session import Session
from aps.vector import make_vector_env
from aps.wire import codec, compression, frame_delta
from aps.wire._wire import EXT_NDARRAY, WIRE_NAME, array_header, unpadded_header
from aps.wire.compression import choose_frame_delta, offer, parse_accepted
from aps.wire.frame_delta import EXT_FRAME_DELTA, Delta
from aps.wire.messages import Message, RolloutChunk, StepRequest, StepResult
from aps.worker.steps import StepServer
from tests.conftest import FAST

HERE = Path(__file__)
TCP = "tcp://127.0.0.1:0"
CODECS = ["none", *compression.available()]


# --------------------------------------------------------------------------------------------
# Synthetic stacks: what FrameStackObservation makes of a stream of frames.


def stacks(frames: np.ndarray, starts: np.ndarray, depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The stacked observations of ``frames`` ``(T, E, ...)``, and where they shift.

    ``starts[t, e]``: an episode starts at step ``t`` of env ``e`` (always at ``t = 0``);
    its stack is then its first frame repeated, as ``FrameStackObservation`` pads. Returns
    the ``(T, E, K, ...)`` stacks and the mask the split must find: a step that is not a
    start shifts its stack by one frame.
    """
    steps, envs = frames.shape[:2]
    out = np.empty((steps, envs, depth, *frames.shape[2:]), frames.dtype)
    for e in range(envs):
        for t in range(steps):
            if t == 0 or starts[t, e]:
                out[t, e] = frames[t, e]
            else:
                out[t, e, :-1] = out[t - 1, e, 1:]
                out[t, e, -1] = frames[t, e]
    shifts = ~starts.copy()
    shifts[0] = False
    return out, shifts


def chunk_of(obs: np.ndarray, **fields: Any) -> RolloutChunk:
    steps, envs = obs.shape[:2]
    zeros = np.zeros((steps, envs), np.float32)
    values: dict[str, Any] = {
        "version": 3,
        "obs": obs,
        "actions": np.arange(steps * envs).reshape(steps, envs),
        "logprob": zeros,
        "value": None,
        "reward": zeros + 1,
        "terminated": zeros.astype(bool),
        "truncated": zeros.astype(bool),
        "next_obs": obs[-1],
        "episode_return": np.zeros(0),
        "episode_length": np.zeros(0, np.int64),
        "episode_env": np.zeros(0, np.int64),
        "truncated_obs": obs[:0, 0],
        "truncated_index": np.zeros((0, 2), np.int64),
        "seq": 5,
    }
    values.update(fields)
    return RolloutChunk(**values)


def round_trip(message: Message, codec_name: str, **decode: Any) -> tuple[Message, bytes]:
    frame = codec.encode(message, compressor=compression.compressor(codec_name), frame_delta=True)
    decoded = codec.decode(frame, compression=codec_name, frame_delta=True, **decode)
    return decoded, frame


def assert_same_chunk(a: RolloutChunk, b: RolloutChunk) -> None:
    for field in dataclasses.fields(RolloutChunk):
        x, y = getattr(a, field.name), getattr(b, field.name)
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and x.shape == y.shape, field.name
            assert x.tobytes() == y.tobytes(), field.name
        else:
            assert x == y, field.name


@pytest.mark.parametrize("codec_name", CODECS)
def test_synthetic_stacks_rebuild_exactly_across_episode_boundaries(codec_name: str) -> None:
    rng = np.random.default_rng(0)
    steps, envs, depth = 24, 5, 4
    frames = rng.integers(0, 4, (steps, envs, 12, 12), dtype=np.uint8) * 60  # compressible
    starts = rng.random((steps, envs)) < 0.1
    starts[0] = True
    starts[:, 2] = False  # one env never ends
    starts[7, :] = True  # every env starts again at once
    obs, shifts = stacks(frames, starts, depth)
    delta = frame_delta.split(obs)
    assert delta is not None
    assert (delta.mask == shifts).all() and not delta.mask[0].any()
    assert delta.whole.shape == (int((~shifts).sum()), depth, 12, 12)
    assert delta.newest.shape == (int(shifts.sum()), 12, 12)
    assert frame_delta.rebuild(delta).tobytes() == obs.tobytes()
    chunk = chunk_of(obs)
    decoded, frame = round_trip(chunk, codec_name)
    assert isinstance(decoded, RolloutChunk)
    assert_same_chunk(decoded, chunk)
    assert not decoded.obs.flags.writeable  # like every decoded array
    plain = codec.encode(chunk, compressor=compression.compressor(codec_name))
    assert len(frame) < len(plain)


def test_a_stack_that_shifts_only_in_value_travels_whole() -> None:
    # Bytewise, not by value: -0.0 == 0.0 and NaN != NaN must not fool the check.
    rng = np.random.default_rng(1)
    frames = rng.standard_normal((6, 2, 256)).astype(np.float32)
    frames[2, 0, 3] = np.nan  # shifts through env 0's stacks bit for bit
    frames[2, 1, 5] = 0.0
    starts = np.zeros((6, 2), bool)
    starts[0] = True
    obs, shifts = stacks(frames, starts, 4)
    # Step 3 of env 1 holds frame 2 as -0.0: equal in value to the 0.0 of step 2's stack,
    # not in bits, so neither step 3 nor step 4 (which shifts from it) is delta-coded.
    assert obs[3, 1, 2, 5] == 0.0
    obs[3, 1, 2, 5] = np.float32(-0.0)
    shifts[3, 1] = shifts[4, 1] = False
    delta = frame_delta.split(obs)
    assert delta is not None
    assert (delta.mask == shifts).all()
    assert delta.mask[3, 0] and delta.mask[4, 0]
    decoded, _ = round_trip(chunk_of(obs), "none")
    assert isinstance(decoded, RolloutChunk) and decoded.obs.tobytes() == obs.tobytes()


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [((40, 3, 2, 64), np.float64), ((9, 4, 5, 7, 3), np.int16), ((3, 1, 8, 600), np.uint8)],
)
def test_any_stack_depth_frame_shape_and_dtype_rebuilds(shape: tuple[int, ...], dtype: Any) -> None:
    rng = np.random.default_rng(2)
    steps, envs, depth = shape[:3]
    frames = rng.integers(-50, 50, (steps, envs, *shape[3:])).astype(dtype)
    starts = rng.random((steps, envs)) < 0.2
    starts[0] = True
    obs, shifts = stacks(frames, starts, depth)
    assert obs.shape == shape
    delta = frame_delta.split(obs)
    assert delta is not None and (delta.mask == shifts).all()
    for name in CODECS:
        decoded, _ = round_trip(chunk_of(obs), name)
        assert isinstance(decoded, RolloutChunk)
        assert decoded.obs.dtype == obs.dtype and decoded.obs.tobytes() == obs.tobytes()


@settings(max_examples=60, deadline=None)
@given(
    steps=st.integers(1, 8),
    envs=st.integers(1, 4),
    depth=st.integers(1, 4),
    width=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    p_start=st.floats(0, 1),
    p_noise=st.floats(0, 0.3),
)
def test_any_chunk_decodes_to_the_bytes_it_was(
    steps: int, envs: int, depth: int, width: int, seed: int, p_start: float, p_noise: float
) -> None:
    rng = np.random.default_rng(seed)
    frames = rng.integers(0, 3, (steps, envs, 4, width), dtype=np.uint8)
    starts = rng.random((steps, envs)) < p_start
    starts[0] = True
    obs, _ = stacks(frames, starts, depth)
    noise = rng.random(obs.shape[:3]) < p_noise  # some stacks changed in an older frame
    obs[noise] ^= 1
    decoded, _ = round_trip(chunk_of(obs), "none")
    assert isinstance(decoded, RolloutChunk) and decoded.obs.tobytes() == obs.tobytes()
    delta = frame_delta.split(obs)
    if delta is not None:
        assert frame_delta.rebuild(delta).tobytes() == obs.tobytes()


def test_what_is_not_a_shifting_stack_travels_plain() -> None:
    rng = np.random.default_rng(3)
    obs, _ = stacks(rng.integers(0, 255, (8, 2, 32, 32), dtype=np.uint8), np.eye(8, 2) > 2, 4)
    assert frame_delta.split(obs) is not None
    for case in (
        obs[:1],  # one step: nothing to shift from
        obs[:, :, :1],  # K = 1
        obs[..., 0, 0],  # (T, E, K): frames of one number are not frames
        obs[:, :, :, :4, :4],  # under the threshold
        obs.astype(">u2"),  # a dtype that travels swapped
        rng.integers(0, 255, obs.shape, dtype=np.uint8),  # no stack shifted
    ):
        assert frame_delta.split(case) is None
        chunk = chunk_of(np.ascontiguousarray(case))
        frame = codec.encode(chunk, frame_delta=True)
        assert frame == codec.encode(chunk)  # byte for byte the plain frame
    # Only chunks: a step's observations are never delta-coded.
    step = StepResult(
        obs=obs[0],
        reward=np.zeros(2),
        terminated=np.zeros(2, bool),
        truncated=np.zeros(2, bool),
        info={},
    )
    assert codec.encode(step, frame_delta=True) == codec.encode(step)


# --------------------------------------------------------------------------------------------
# Real Pong frames


def pong_obs(steps: int, envs: int, max_episode_steps: int, seed: int = 0) -> np.ndarray:
    """``(T, E, 4, 84, 84)`` observations of EnvPool's Pong with random actions.

    Short episodes (``max_episode_steps``) put boundaries inside the chunk: EnvPool's
    next-step autoreset makes the step after a truncation the next episode's first stack.
    """
    pool = pytest.importorskip("envpool")
    env = pool.make(
        "Pong-v5",
        env_type="gymnasium",
        num_envs=envs,
        seed=seed,
        max_episode_steps=max_episode_steps,
    )
    rng = np.random.default_rng(seed)
    obs, _ = env.reset()
    out = [obs]
    for _ in range(steps - 1):
        obs, *_ = env.step(rng.integers(0, 6, envs))
        out.append(obs)
    env.close()
    return np.stack(out)


@pytest.mark.parametrize("codec_name", CODECS)
def test_real_pong_chunks_rebuild_exactly(codec_name: str) -> None:
    obs = pong_obs(steps=64, envs=4, max_episode_steps=20)  # episodes end inside the chunk
    delta = frame_delta.split(obs)
    assert delta is not None
    # t = 0 travels whole, every other step of a running episode as its newest frame, and
    # the first stack of each new episode (a reset: no shift) whole again.
    assert not delta.mask[0].any()
    restarts = int((~delta.mask[1:]).sum())
    assert 4 <= restarts < obs.shape[0] * obs.shape[1] // 4, restarts
    for t, e in zip(*np.nonzero(~delta.mask[1:]), strict=True):
        assert obs[t + 1, e, :-1].tobytes() != obs[t, e, 1:].tobytes()
    decoded, frame = round_trip(chunk_of(obs), codec_name, max_frame_size=2 * obs.nbytes)
    assert isinstance(decoded, RolloutChunk) and decoded.obs.tobytes() == obs.tobytes()
    plain = codec.encode(chunk_of(obs), compressor=compression.compressor(codec_name))
    assert len(frame) < len(plain)


# --------------------------------------------------------------------------------------------
# Lying peers, frame by frame


def ext_array(array: np.ndarray) -> bytes:
    """One plain array ext, as msgpack bytes."""
    name = WIRE_NAME[array.dtype]
    data = array_header(name, array.shape) + np.ascontiguousarray(array).tobytes()
    packed: bytes = msgpack.packb(msgpack.ExtType(EXT_NDARRAY, data))
    return packed


def payload(delta: Delta, *, shape: Any = None, bits: Any = None, extra: bytes = b"") -> bytes:
    """A frame-delta payload written by hand, with any part replaced."""
    mask = np.packbits(delta.mask).tobytes() if bits is None else bits
    head = unpadded_header(WIRE_NAME[delta.dtype], delta.shape if shape is None else shape)
    return (
        head
        + msgpack.packb(mask, use_bin_type=True)
        + ext_array(delta.whole)
        + ext_array(delta.newest)
        + extra
    )


def lie(frame: bytes, tamper: str) -> bytes:
    """The honest chunk ``frame`` (frame delta, no codec) made to lie in one way."""
    body = msgpack.unpackb(frame, ext_hook=msgpack.ExtType, raw=False)
    obs = body["obs"]
    if tamper == "not_a_delta_chunk":
        return frame
    assert obs.code == EXT_FRAME_DELTA
    honest = codec.decode(frame, frame_delta=True)
    assert isinstance(honest, RolloutChunk)
    delta = frame_delta.split(np.asarray(honest.obs))
    assert delta is not None
    mask = delta.mask.copy()
    steps, envs = mask.shape
    if tamper == "delta_at_t0":
        mask[0, 0] = True
        new = payload(dataclasses.replace(delta, mask=mask))
    elif tamper == "fewer_newest_than_the_mask":
        new = payload(dataclasses.replace(delta, newest=delta.newest[:-1]))
    elif tamper == "more_whole_than_the_mask":
        new = payload(dataclasses.replace(delta, whole=np.concatenate([delta.whole] * 2)))
    elif tamper == "newest_of_another_dtype":
        new = payload(dataclasses.replace(delta, newest=delta.newest.astype(np.int16)))
    elif tamper == "whole_of_another_frame_shape":
        new = payload(dataclasses.replace(delta, whole=delta.whole[..., :-1]))
    elif tamper == "declares_above_the_limit":
        # 16 GiB of stacks declared around a few KiB of parts.
        new = payload(delta, shape=(steps, envs, 4, 2**16, 2**14))
    elif tamper == "mask_too_short":
        new = payload(delta, bits=np.packbits(mask).tobytes()[:-1])
    elif tamper == "mask_padding_set":
        bits = bytearray(np.packbits(mask).tobytes())
        bits[-1] |= 1
        new = payload(delta, bits=bytes(bits))
    elif tamper == "bytes_after_the_parts":
        new = payload(delta, extra=b"\x00")
    elif tamper == "stack_of_one_frame":
        new = payload(delta, shape=(steps, envs, 1, *delta.shape[2:]))
    elif tamper == "in_next_obs":
        body["next_obs"] = obs
        plain = np.asarray(honest.obs)
        head = array_header(WIRE_NAME[plain.dtype], plain.shape)
        body["obs"] = msgpack.ExtType(EXT_NDARRAY, head + plain.tobytes())
        packed: bytes = msgpack.packb(body, use_bin_type=True)
        return packed
    else:
        raise AssertionError(tamper)
    body["obs"] = msgpack.ExtType(EXT_FRAME_DELTA, new)
    packed = msgpack.packb(body, use_bin_type=True)
    return packed


LIES = {
    "delta_at_t0": "at t=0",
    "fewer_newest_than_the_mask": "newest frames are uint8 of shape",
    "more_whole_than_the_mask": "whole stacks are uint8 of shape",
    "newest_of_another_dtype": "newest frames are int16",
    "whole_of_another_frame_shape": "whole stacks are uint8 of shape",
    "declares_above_the_limit": "over the",
    "mask_too_short": "frame-delta mask must be",
    "mask_padding_set": "bits set past its last",
    "bytes_after_the_parts": "bytes after its parts",
    "stack_of_one_frame": "K >= 2",
    "in_next_obs": "only a rollout chunk's obs",
}


def honest_frame() -> tuple[bytes, np.ndarray]:
    rng = np.random.default_rng(4)
    starts = np.zeros((6, 3), bool)
    starts[0] = starts[3, 1] = True
    obs, _ = stacks(rng.integers(0, 255, (6, 3, 16, 16), dtype=np.uint8), starts, 4)
    return codec.encode(chunk_of(obs), frame_delta=True), obs


@pytest.mark.parametrize("tamper", sorted(LIES))
def test_a_lying_delta_chunk_is_a_wire_error_naming_the_value(tamper: str) -> None:
    frame, _ = honest_frame()
    with pytest.raises(aps.WireError, match=LIES[tamper]):
        codec.decode(lie(frame, tamper), frame_delta=True, max_frame_size=2**24)


def test_a_delta_chunk_without_frame_delta_negotiated_is_refused() -> None:
    frame, obs = honest_frame()
    with pytest.raises(aps.WireError, match="did not negotiate frame delta"):
        codec.decode(frame)
    with pytest.raises(aps.WireError, match="did not negotiate frame delta"):
        codec.decode(frame, compression="zstd")
    decoded = codec.decode(frame, frame_delta=True)
    assert isinstance(decoded, RolloutChunk) and decoded.obs.tobytes() == obs.tobytes()


def test_a_lying_size_is_refused_before_anything_is_allocated() -> None:
    frame, _ = honest_frame()
    bomb = lie(frame, "declares_above_the_limit")
    tracemalloc.start()
    try:
        with pytest.raises(aps.WireError, match="over the"):
            codec.decode(bomb, frame_delta=True, max_frame_size=2**20)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**18, peak
    # The rebuilt array and the arrays inflated for it share the frame limit.
    obs = pong_obs(steps=16, envs=2, max_episode_steps=1000)  # 903 KB of stacks
    frame = codec.encode(chunk_of(obs), compressor=compression.compressor("lz4"), frame_delta=True)
    assert len(frame) < obs.nbytes // 10
    with pytest.raises(aps.WireError, match="left of this side's limit"):
        codec.decode(frame, compression="lz4", frame_delta=True, max_frame_size=obs.nbytes + 2000)
    decoded = codec.decode(
        frame, compression="lz4", frame_delta=True, max_frame_size=4 * obs.nbytes
    )
    assert isinstance(decoded, RolloutChunk) and decoded.obs.tobytes() == obs.tobytes()


# --------------------------------------------------------------------------------------------
# The negotiation


NEGOTIATION = [
    # (learner compression, learner frame_delta, worker compression, worker frame_delta,
    #  peer local?) -> frame delta on?
    ("auto", True, "auto", True, False, True),
    ("auto", True, "auto", True, True, False),  # auto leaves local peers plain
    ("zstd", True, "auto", True, True, True),
    ("lz4", True, "zstd", True, False, True),  # no common codec: still frame delta
    ("none", True, "auto", True, False, False),
    ("auto", True, "none", True, False, False),
    ("auto", False, "auto", True, False, False),
    ("auto", True, "auto", False, False, False),
]


@pytest.mark.parametrize(
    ("learner", "learner_delta", "worker", "worker_delta", "local", "expected"), NEGOTIATION
)
def test_the_learner_takes_frame_delta_where_it_compresses(
    learner: str, learner_delta: bool, worker: str, worker_delta: bool, local: bool, expected: bool
) -> None:
    offered = offer(worker, frame_delta=worker_delta)
    assert (frame_delta.NAME in offered) == (worker_delta and worker != "none")
    chosen = choose_frame_delta(learner, offered, local=local, enabled=learner_delta)
    assert chosen is expected
    codec_name = compression.choose(learner, offered, local=local, peer="tcp://10.0.0.2:1")
    value = compression.accepted(codec_name, chosen)
    assert parse_accepted(value, offered, peer="p") == (codec_name, chosen)


def test_a_worker_refuses_a_choice_it_did_not_offer() -> None:
    for value, offered in [
        ("zstd,frame-delta", ("zstd",)),
        ("none,frame-delta", ()),
        ("frame-delta", ("zstd", "frame-delta")),
        ("zstd,frame-delta,lz4", ("zstd", "lz4", "frame-delta")),
        ("zstd,gzip", ("zstd", "frame-delta")),
    ]:
        with pytest.raises(aps.ProtocolError, match="tcp://learner:1 chose compression"):
            parse_accepted(value, offered, peer="tcp://learner:1")


def test_frame_delta_must_be_a_bool_and_the_cli_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(aps.ConfigError, match="frame_delta must be True or False, got 'no'"):
        aps.Learner(TCP, num_workers=1, frame_delta="no")  # type: ignore[arg-type]
    with pytest.raises(aps.ConfigError, match="frame_delta must be True or False, got 0"):
        aps.Worker("tcp://127.0.0.1:1", "CartPole-v1", frame_delta=0)  # type: ignore[arg-type]
    made: list[aps.Worker] = []

    class Recorded(aps.Worker):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

        async def run(self) -> None:
            return None

    monkeypatch.setattr("aps.cli.Worker", Recorded)
    for flags, expected in (([], True), (["--no-frame-delta"], False)):
        argv = ["worker", "tcp://127.0.0.1:1", "--env", "CartPole-v1", *flags]
        assert cli_main(argv) == 0
        assert made[-1].frame_delta is expected


# --------------------------------------------------------------------------------------------
# Over real sockets: a Learner and Workers whose envs stack frames with Gymnasium's wrapper


class SquareEnv(gym.Env[np.ndarray, np.int64]):
    """16 x 16 uint8 frames, a bright square the action moves; episodes of 5 to 9 steps."""

    def __init__(self) -> None:
        self.observation_space = gym.spaces.Box(0, 255, (16, 16), np.uint8)
        self.action_space = gym.spaces.Discrete(2)

    def _frame(self) -> np.ndarray:
        frame = np.zeros((16, 16), np.uint8)
        frame[self.y : self.y + 3, self.x : self.x + 3] = 250
        frame[15, self.t] = self.t + 1  # every frame differs from the one before
        return frame

    def reset(self, *, seed: int | None = None, options: Any = None) -> tuple[np.ndarray, dict]:
        super().reset(seed=seed)
        self.x, self.y = (int(v) for v in self.np_random.integers(0, 13, 2))
        self.t = 0
        self.length = int(self.np_random.integers(5, 10))
        return self._frame(), {}

    def step(self, action: np.int64) -> tuple[np.ndarray, float, bool, bool, dict]:
        self.t += 1
        self.x = (self.x + (1 if int(action) else -1)) % 13
        return self._frame(), float(self.x), self.t >= self.length, False, {}


def make_stacked_env() -> gym.Env[Any, Any]:
    return gym.wrappers.FrameStackObservation(SquareEnv(), 4)


ENV = f"{HERE}:make_stacked_env"

torch = pytest.importorskip("torch")
nn = torch.nn


class StackAgent(nn.Module):
    """A CleanRL-shaped agent over flattened stacks."""

    def __init__(self, envs: Any) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape))
        self.critic = nn.Sequential(nn.Flatten(), nn.Linear(size, 1))
        self.actor = nn.Sequential(nn.Flatten(), nn.Linear(size, int(envs.single_action_space.n)))


POLICY = f"{HERE}:StackAgent"
ALLOW = (f"{HERE}:*",)


class LyingSession:
    """A worker's session whose chunk frames are rewritten to lie (see :func:`lie`)."""

    def __init__(self, session: Session, tamper: str) -> None:
        self._session = session
        self._tamper = tamper

    def __getattr__(self, name: str) -> Any:
        return getattr(self._session, name)

    def encode(self, message: Message) -> bytes:
        if not isinstance(message, RolloutChunk):
            return self._session.encode(message)
        honest = codec.encode(message, frame_delta=True)  # lie() rewrites a plain-array frame
        return lie(honest, self._tamper)

    async def send(self, message: Message, *, frame: bytes | None = None) -> None:
        if isinstance(message, RolloutChunk) and frame is None:
            frame = self.encode(message)
        await self._session.send(message, frame=frame)


class LyingWorker(aps.Worker):
    def __init__(self, *args: Any, tamper: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._tamper = tamper

    async def _serve(self, session: Session) -> None:
        await super()._serve(LyingSession(session, self._tamper))  # type: ignore[arg-type]


def worker(url: str, cls: type[aps.Worker] = aps.Worker, **kwargs: Any) -> aps.Worker:
    kwargs.setdefault("timeouts", FAST)
    kwargs.setdefault("allow_policy", ALLOW)
    kwargs.setdefault("num_envs", 3)
    return cls(url, ENV, **kwargs)


async def stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.wait(tasks, timeout=5)


def replay(rollout: aps.Rollout, seed: int, envs: int) -> np.ndarray:
    """The observations the envs give for the rollout's actions, replayed here."""
    vector = gym.vector.SyncVectorEnv(
        [make_stacked_env] * envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    obs, _ = vector.reset(seed=seed)
    seen = []
    for t in range(np.asarray(rollout.obs).shape[0]):
        seen.append(obs)
        obs, *_ = vector.step(np.asarray(rollout.actions[t]))
    vector.close()
    return np.stack(seen)


def stack_learner(num_workers: int = 1, **kwargs: Any) -> aps.Learner:
    """A learner over TCP on loopback for the frame-stack workers of these tests."""
    return aps.Learner(
        TCP, num_workers=num_workers, timeouts=FAST, policy=POLICY, autoreset_mode="SameStep",
        **kwargs,
    )  # fmt: skip


@pytest.mark.timeout(60)
@pytest.mark.parametrize("setting", ["zstd", "none-codec"])
async def test_detach_chunks_travel_as_newest_frames_and_equal_the_envs(
    monkeypatch: pytest.MonkeyPatch, setting: str
) -> None:
    if setting == "none-codec":
        # The learner asks for zstd, but neither side can import it: frame delta alone.
        monkeypatch.setattr(compression, "available", lambda: ())
    async with stack_learner(compression="zstd") as learner:
        one = worker(learner.url)
        tasks = [asyncio.create_task(one.run())]
        try:
            await learner.wait_for_workers()
            session = learner._pool.slots.admitted[0].session
            assert session.frame_delta
            codec_name = "zstd" if setting == "zstd" else "none"
            assert session.encoding == f"{codec_name},frame-delta"
            await learner.reset(seed=11)
            await learner.publish(StackAgent(learner))
            rollout = await learner.rollout(12)
        finally:
            await stop(tasks)
    obs = np.asarray(rollout.obs)
    assert obs.shape == (12, 3, 4, 16, 16)
    assert obs.tobytes() == replay(rollout, 11, 3).tobytes()
    delta = frame_delta.split(obs)
    assert delta is not None and (~delta.mask[1:]).any()  # episodes ended inside the chunk


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("learner_kwargs", "worker_kwargs", "expected"),
    [
        ({"compression": "lz4"}, {}, "lz4,frame-delta"),
        ({"compression": "lz4", "frame_delta": False}, {}, "lz4"),
        ({"compression": "lz4"}, {"frame_delta": False}, "lz4"),
        ({}, {}, "none"),  # auto: a local peer stays plain
        ({"compression": "zstd"}, {"compression": "none"}, "none"),
    ],
)
async def test_the_handshake_settles_frame_delta_for_both_ends(
    learner_kwargs: dict[str, Any], worker_kwargs: dict[str, Any], expected: str
) -> None:
    async with stack_learner(**learner_kwargs) as learner:
        one = worker(learner.url, **worker_kwargs)
        tasks = [asyncio.create_task(one.run())]
        try:
            await learner.wait_for_workers()
            assert learner._pool.slots.admitted[0].session.encoding == expected
            await learner.reset(seed=3)
            await learner.publish(StackAgent(learner))
            rollout = await learner.rollout(6)
        finally:
            await stop(tasks)
    assert np.asarray(rollout.obs).tobytes() == replay(rollout, 3, 3).tobytes()


SOCKET_LIES = [
    "delta_at_t0",
    "fewer_newest_than_the_mask",
    "newest_of_another_dtype",
    "declares_above_the_limit",
    "in_next_obs",
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tamper", [*SOCKET_LIES, "not_negotiated"])
async def test_a_lying_worker_is_its_own_protocol_error_and_the_honest_one_goes_on(
    tamper: str, caplog: pytest.LogCaptureFixture
) -> None:
    async with stack_learner(num_workers=2, compression="zstd", on_worker_lost="drop") as learner:
        honest = worker(learner.url)
        tasks = [asyncio.create_task(honest.run())]
        async with asyncio.timeout(20):
            while len(learner.workers) < 1:  # noqa: ASYNC110 (no event for this)
                await asyncio.sleep(0.02)
        good = learner.workers[0].worker_id
        if tamper == "not_negotiated":
            # An honest-looking worker that never offered frame delta sends it anyway.
            bad = worker(learner.url, LyingWorker, tamper="not_a_delta_chunk", frame_delta=False)
        else:
            bad = worker(learner.url, LyingWorker, tamper=tamper)
        tasks.append(asyncio.create_task(bad.run()))
        try:
            await learner.reset(seed=5)
            await learner.publish(StackAgent(learner))
            stream = learner.chunks(6)
            seen: list[int] = []
            async with asyncio.timeout(20):  # until the learner hung up on the liar
                while len(seen) < 5 or not tasks[1].done():
                    seen.append((await anext(stream)).worker_id)
            await stream.aclose()
            assert set(seen[-3:]) == {good}
            await tasks[1]
            assert not tasks[0].done()
        finally:
            await stop(tasks)
    lost = [r.getMessage() for r in caplog.records if "127.0.0.1" in r.getMessage()]
    words = "did not negotiate frame delta" if tamper == "not_negotiated" else LIES[tamper]
    assert any(words in text for text in lost), lost


# --------------------------------------------------------------------------------------------
# The worker's answer cache


class Recording:
    """The part of a session the step server uses: its encoding, encode and send."""

    def __init__(self, codec_name: str, delta: bool) -> None:
        self.compression = codec_name
        self.encoding = compression.accepted(codec_name, delta)
        self._compressor = compression.compressor(codec_name)
        self._delta = delta
        self.sent: list[bytes | None] = []

    def encode(self, message: Message) -> bytes:
        return codec.encode(message, compressor=self._compressor, frame_delta=self._delta)

    async def send(self, message: Message, *, frame: bytes | None = None) -> None:
        self.sent.append(frame)


async def test_a_kept_answer_is_encoded_again_where_frame_delta_changed() -> None:
    envs = make_vector_env(
        "sync", make_stacked_env, num_envs=2, autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP
    )
    envs.reset(seed=0)
    server = StepServer(envs, None, seed=0)
    try:
        request = StepRequest(actions=np.array([0, 1]), seq=0, acked=0)
        first = Recording("none", True)
        assert not await server.answer(first, request)  # type: ignore[arg-type]
        kept = first.sent[0]
        assert kept is not None
        # The connection resumed without frame delta (same codec): the kept frame is not
        # what this connection would write, so it is encoded again.
        plain = Recording("none", False)
        assert await server.answer(plain, request)  # type: ignore[arg-type]
        assert plain.sent == [None]
        again = Recording("none", True)
        assert await server.answer(again, request)  # type: ignore[arg-type]
        assert again.sent == [kept]
    finally:
        server.close()


# --------------------------------------------------------------------------------------------
# The benchmark's part, on a tiny budget (its figures are in docs/compression.md)


@pytest.mark.timeout(300)
def test_the_benchmark_part_runs_and_reports_every_encoding(tmp_path: Path) -> None:
    pytest.importorskip("envpool")
    if compression.available() != compression.CODECS:
        pytest.skip("the benchmark needs both codecs")
    out = tmp_path / "delta.json"
    script = HERE.parent.parent / "benchmarks" / "compression.py"
    argv = [sys.executable, str(script), "--part", "delta", "--chunk-steps", "8"]
    argv += ["--chunks", "1", "--num-envs", "2", "--out", str(out)]
    subprocess.run(argv, check=True, timeout=240, capture_output=True)
    report = json.loads(out.read_text())["delta"]
    assert report["env_steps"] == 16 and report["wire"]["encoding"] == "zstd,frame-delta"
    rows = {(row["codec"], row["frame_delta"]): row for row in report["rows"]}
    assert set(rows) == {(c, d) for c in ("none", "zstd", "lz4") for d in (False, True)}
    for name in ("none", "zstd", "lz4"):
        assert rows[name, True]["bytes_per_env_step"] < rows[name, False]["bytes_per_env_step"]
    assert report["split_us_per_env_step"] > 0 and report["env_step_cpu_us_per_env_step"] > 0


@pytest.mark.timeout(60)
async def test_under_raise_the_lie_is_a_protocol_error_naming_the_peer_and_the_value() -> None:
    async with stack_learner(compression="zstd", on_worker_lost="raise") as learner:
        bad = worker(learner.url, LyingWorker, tamper="fewer_newest_than_the_mask")
        tasks = [asyncio.create_task(bad.run())]
        try:
            await learner.reset(seed=2)
            await learner.publish(StackAgent(learner))
            with pytest.raises(aps.ProtocolError) as caught:
                await learner.rollout(6)
        finally:
            await stop(tasks)
    chain: list[BaseException] = []
    error: BaseException | None = caught.value
    while error is not None:
        chain.append(error)
        error = error.__cause__
    text = " | ".join(str(e) for e in chain)
    assert str(caught.value).startswith(f"worker {bad.worker_id}"), text
    assert "127.0.0.1" in text and "newest frames are uint8 of shape (" in text, text
