"""Attacks on decoding by a peer that holds the token: each is refused, or costs its bytes.

The frames here are what such a peer sent: a frame-delta chunk that declares 2**40 steps of
nothing, one whose steps are real but many, frame-delta arrays where no chunk's obs is, a
heartbeat whose key repeats over an array that inflates to 256 MiB, a Ready that claims a
hundred million envs or Box bounds that inflate to gigabytes, and compressed arrays sent
faster than any aps peer inflates. The wall-clock figures are in
``benchmarks/decode_bound.py``; these tests hold what is refused, and before what.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import tracemalloc
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import msgpack
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import aps
from aps.session.protocol import worker_proof
from aps.wire import codec, compression, frame_delta
from aps.wire._wire import EXT_NDARRAY, WIRE_NAME, Allowance, InflationRate, array_header
from aps.wire.frame_delta import EXT_FRAME_DELTA, Delta
from aps.wire.messages import Challenge, Hello, Ready, StepResult, Weights, Welcome
from aps.wire.spaces import sample_nbytes, space_to_wire
from tests.conftest import FAST, benchmark_module
from tests.test_frame_delta import chunk_of, pong_obs

needs_zstd = pytest.mark.skipif(
    "zstd" not in compression.available(), reason="zstandard is not installed"
)

TCP = "tcp://127.0.0.1:0"


@contextlib.contextmanager
def peak_memory() -> Iterator[list[int]]:
    """The peak of what Python and numpy allocated inside the block, in bytes, at [0]."""
    result = [0]
    tracemalloc.start()
    try:
        yield result
        result[0] = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def plain_ext(array: np.ndarray) -> msgpack.ExtType:
    data = array_header(WIRE_NAME[array.dtype], array.shape) + array.tobytes()
    return msgpack.ExtType(EXT_NDARRAY, data)


def zstd_ext(array: np.ndarray) -> msgpack.ExtType:
    packed = compression.compressor("zstd").pack(array)
    assert packed is not None
    return packed


def with_field(frame: bytes, name: str, value: Any) -> bytes:
    """``frame`` with one field of its map replaced (its tag stays first)."""
    body = msgpack.unpackb(frame, ext_hook=msgpack.ExtType, raw=False)
    body[name] = value
    packed: bytes = msgpack.packb(body, use_bin_type=True)
    return packed


def raw_map(*pairs: tuple[Any, Any]) -> bytes:
    """A msgpack map written pair by pair: keys may repeat, in the order given."""
    assert len(pairs) < 16
    return bytes([0x80 | len(pairs)]) + b"".join(
        msgpack.packb(key, use_bin_type=True) + msgpack.packb(value, use_bin_type=True)
        for key, value in pairs
    )


# --------------------------------------------------------------------------------------------
# 1. Frame delta: the rebuild is vectorized and equals the loop it replaced


def loop_rebuild(delta: Delta) -> np.ndarray:
    """The rebuild as it was, one Python iteration per step: the reference (the benchmark's)."""
    with benchmark_module("decode_bound") as decode_bound:
        rebuilt: np.ndarray = decode_bound.loop_rebuild(delta)
    return rebuilt


@st.composite
def deltas(draw: st.DrawFn) -> Delta:
    steps = draw(st.integers(1, 9))
    envs = draw(st.integers(1, 4))
    depth = draw(st.integers(2, 5))
    frame = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    dtype = np.dtype(draw(st.sampled_from(["uint8", "int16", "float32", "float64", "bool"])))
    bits = draw(st.lists(st.booleans(), min_size=steps * envs, max_size=steps * envs))
    mask = np.array(bits, bool).reshape(steps, envs)
    mask[0] = False
    count = int(mask.sum())
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    raw = rng.integers(0, 256, ((steps * envs - count) * depth + count) * int(np.prod(frame)))
    data = raw.astype(np.uint8).tobytes()
    # Any bytes, NaN payloads and -0.0 included: the rebuild must copy bits, not values.
    size = dtype.itemsize * int(np.prod(frame))
    whole_bytes = (steps * envs - count) * depth * size
    chunk = (data * dtype.itemsize)[: whole_bytes + count * size]
    whole = np.frombuffer(chunk[:whole_bytes], dtype).reshape(-1, depth, *frame)
    newest = np.frombuffer(chunk[whole_bytes:], dtype).reshape(-1, *frame)
    if dtype == np.bool_:
        whole, newest = whole.view(np.uint8) % 2 == 1, newest.view(np.uint8) % 2 == 1
    return Delta(
        shape=(steps, envs, depth, *frame), dtype=dtype, mask=mask, whole=whole, newest=newest
    )


@settings(max_examples=300, deadline=None)
@given(deltas())
def test_the_vectorized_rebuild_equals_the_loop_byte_for_byte(delta: Delta) -> None:
    got = frame_delta.rebuild(delta)
    want = loop_rebuild(delta)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert got.tobytes() == want.tobytes()
    assert got.flags.writeable and got.flags.c_contiguous


def test_real_pong_stacks_rebuild_as_the_loop_did() -> None:
    obs = pong_obs(steps=40, envs=3, max_episode_steps=15)  # several episode boundaries
    delta = frame_delta.split(obs)
    assert delta is not None
    assert frame_delta.rebuild(delta).tobytes() == loop_rebuild(delta).tobytes() == obs.tobytes()


# --------------------------------------------------------------------------------------------
# 1. Frame delta: what split never sends is refused from the header


def delta_ext(shape: tuple[int, ...], mask: bytes, whole: bytes, newest: bytes) -> msgpack.ExtType:
    head = msgpack.packb(["|u1", list(shape)])
    return msgpack.ExtType(EXT_FRAME_DELTA, head + msgpack.packb(mask) + whole + newest)


EMPTY = msgpack.packb(plain_ext(np.zeros((0, 2, 1), np.uint8)))


def chunk_frame() -> bytes:
    rng = np.random.default_rng(1)
    return codec.encode(chunk_of(rng.integers(0, 255, (4, 2, 4, 8, 8), dtype=np.uint8)))


@pytest.mark.parametrize(
    ("shape", "mask", "match"),
    [
        ((2**40, 0, 2, 1), b"", "zero-size dimension"),  # the 62-byte frame that froze a loop
        ((2**40, 1, 2, 0), b"", "zero-size dimension"),
        ((2**40, 1, 2, 1), b"\x00" * 8, "needs a mask of 137438953472 bytes"),
        ((2**40, 1, 2, 4096), b"\x00" * 8, "needs a mask"),
        ((16, 2, 2, 8), b"\x00" * 4, "at least 4096 bytes"),
        ((2**20, 1, 2), b"", "frames of at least one dimension"),
    ],
)
def test_a_delta_that_split_never_sends_is_refused_from_its_header(
    shape: tuple[int, ...], mask: bytes, match: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frame_delta.Pending, "rebuild", _never)
    for body in (
        with_field(chunk_frame(), "obs", delta_ext(shape, mask, EMPTY, EMPTY)),
        raw_map(("t", "chunk"), ("obs", delta_ext(shape, mask, EMPTY, EMPTY))),
    ):
        with pytest.raises(aps.WireError, match=match):
            codec.decode(body, frame_delta=True)


def _never(self: Any) -> Any:
    raise AssertionError("rebuilt before its place in the message was known")


def test_the_62_byte_frame_of_2_to_the_40_steps_is_62_bytes() -> None:
    frame = raw_map(("t", "chunk"), ("obs", delta_ext((2**40, 0, 2, 1), b"", b"", b"")))
    assert len(frame) <= 62
    with pytest.raises(aps.WireError, match="zero-size dimension"):
        codec.decode(frame, frame_delta=True)


def long_delta(steps: int) -> tuple[msgpack.ExtType, np.ndarray]:
    """A valid delta of ``steps`` steps of one env, 2 frames of 1 byte: the long attack."""
    frames = (np.arange(steps + 1) % 251).astype(np.uint8).reshape(-1, 1)
    mask = np.ones((steps, 1), bool)
    mask[0] = False
    obs = np.lib.stride_tricks.sliding_window_view(frames, 2, axis=0)  # (steps, 1, 2)
    obs = np.ascontiguousarray(obs.transpose(0, 2, 1)).reshape(steps, 1, 2, 1)
    delta = Delta(obs.shape, obs.dtype, mask, obs[:1, 0], frames[2:])
    return frame_delta.pack(delta, codec._packb), obs


def test_a_long_but_valid_delta_rebuilds_what_it_says() -> None:
    ext, obs = long_delta(2**16)
    decoded = codec.decode(with_field(chunk_frame(), "obs", ext), frame_delta=True)
    assert decoded.obs.tobytes() == obs.tobytes()  # type: ignore[attr-defined]


@pytest.mark.parametrize("where", ["next_obs", "weights", "heartbeat", "nested", "two"])
def test_a_delta_anywhere_but_a_chunks_obs_is_refused_before_it_is_rebuilt(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frame_delta.Pending, "rebuild", _never)
    ext, _ = long_delta(4096)
    chunk = chunk_frame()
    if where == "next_obs":
        frame = with_field(chunk, "next_obs", ext)
        match = "none of them its obs"
    elif where == "two":
        frame = with_field(with_field(chunk, "obs", ext), "next_obs", ext)
        match = "2 frame-delta arrays"
    elif where == "weights":
        frame = with_field(
            codec.encode(Weights(version=1, arrays={}, epsilon=None)), "arrays", {"a": ext}
        )
        match = "frame-delta array in a weights message"
    elif where == "heartbeat":
        frame = raw_map(("t", "heartbeat"), ("x", ext))
        match = "none of its fields holds arrays"
    else:  # inside an object array of the chunk's obs
        inner = msgpack.packb([[1], [ext]], use_bin_type=True)
        frame = with_field(chunk, "obs", msgpack.ExtType(3, inner))
        match = "none of them its obs"
    with pytest.raises(aps.WireError, match=match):
        codec.decode(frame, frame_delta=True)


# --------------------------------------------------------------------------------------------
# 3. Duplicate keys, and arrays where no field holds one


@needs_zstd
def test_a_heartbeat_with_a_repeated_key_over_a_256_mib_array_inflates_nothing() -> None:
    bomb = zstd_ext(np.zeros(2**28, np.uint8))
    frame = raw_map(("t", "heartbeat"), ("x", bomb), ("x", bomb))
    assert len(frame) < 32 * 1024
    with peak_memory() as peak, pytest.raises(aps.WireError, match="none of its fields"):
        codec.decode(frame, compression="zstd")
    assert peak[0] < 2**20, peak
    # Where arrays may be, the key held twice is still refused (after a bounded inflate).
    step = codec.encode(StepResult(obs=0, reward=np.zeros(1), terminated=np.zeros(1, bool),
                                   truncated=np.zeros(1, bool), info={}, seq=1))  # fmt: skip
    body = msgpack.unpackb(step, raw=False)
    pairs = [*body.items(), ("info", {})]
    with pytest.raises(aps.WireError, match="'info' more than once"):
        codec.decode(raw_map(*pairs))


def test_a_repeated_key_is_refused_at_every_depth() -> None:
    nested = raw_map(("a", 1), ("a", 2))
    frame = raw_map(
        ("t", "step_result"),
        ("obs", 0),
        ("reward", plain_ext(np.zeros(1))),
        ("terminated", plain_ext(np.zeros(1, bool))),
        ("truncated", plain_ext(np.zeros(1, bool))),
        ("seq", 1),
    )
    head = bytes([frame[0] + 1])
    with pytest.raises(aps.WireError, match="'a' more than once"):
        codec.decode(head + frame[1:] + msgpack.packb("info") + nested)
    inner = msgpack.packb([[1], []])[:-1] + b"\x91" + nested
    with pytest.raises(aps.WireError, match="'a' more than once"):
        codec.decode(head + frame[1:] + msgpack.packb("info") + _ext(3, inner))


def test_a_repeated_key_is_refused_before_the_handshake_too() -> None:
    frame = raw_map(("t", "goodbye"), ("reason", "a"), ("reason", "b"))
    with pytest.raises(aps.WireError, match="'reason' more than once"):
        codec.decode_handshake(frame)


def _ext(code: int, data: bytes) -> bytes:
    packed: bytes = msgpack.packb(msgpack.ExtType(code, data))
    return packed


@needs_zstd
def test_a_compressed_array_in_a_frame_whose_tag_is_not_first_is_not_inflated() -> None:
    bomb = zstd_ext(np.zeros(2**26, np.uint8))
    frame = raw_map(
        ("x", bomb), ("t", "weights"), ("version", 1), ("arrays", {}), ("epsilon", None)
    )
    with peak_memory() as peak, pytest.raises(aps.WireError, match="does not start with its tag"):
        codec.decode(frame, compression="zstd")
    assert peak[0] < 2**20, peak


# --------------------------------------------------------------------------------------------
# 2. A Ready is bounded before its spaces are built


def ready(space: gym.Space[Any], num_envs: int) -> Ready:
    return Ready(observation_space=space, action_space=gym.spaces.Discrete(2), num_envs=num_envs)


@pytest.mark.parametrize(
    "space",
    [gym.spaces.Dict({}), gym.spaces.Box(-1, 1, (0,))],
    ids=["empty-dict", "zero-size-box"],
)
def test_a_ready_of_spaces_without_bytes_is_bounded_by_the_step_itself(space: Any) -> None:
    # Reward and flags travel per env whatever the spaces: 10 bytes an env at the least.
    with pytest.raises(aps.WireError, match="100000000 envs of 10 observation bytes"):
        codec.decode(codec.encode(ready(space, 100_000_000)))


def test_a_ready_whose_envs_could_never_step_is_refused() -> None:
    frame = codec.encode(ready(gym.spaces.Box(-1, 1, (4,)), 100_000_000))
    assert len(frame) < 200
    with peak_memory() as peak, pytest.raises(aps.WireError) as caught:
        codec.decode(frame)
    assert peak[0] < 2**20, peak
    message = str(caught.value)
    for part in ("100000000 envs", "16 observation bytes", "268435456", "fewer envs"):
        assert part in message, message
    huge_actions = Ready(
        observation_space=gym.spaces.Discrete(2),
        action_space=gym.spaces.MultiBinary(2**20),
        num_envs=1024,
    )
    with pytest.raises(aps.WireError, match="1048576 action bytes"):
        codec.decode(codec.encode(huge_actions))
    fits = codec.decode(codec.encode(ready(gym.spaces.Box(-1, 1, (4,)), 1000)))
    assert isinstance(fits, Ready) and fits.num_envs == 1000


@needs_zstd
def test_space_bounds_travel_uncompressed_and_compressed_ones_are_refused() -> None:
    box = gym.spaces.Box(-1, 1, (2**12,))
    honest = codec.encode(ready(box, 2), compressor=compression.compressor("zstd"))
    assert bytes([compression.EXT_COMPRESSED]) + b"\x01" not in honest
    decoded = codec.decode(honest, compression="zstd")
    assert isinstance(decoded, Ready) and decoded.observation_space == box
    # The 8 KiB Ready whose Box(33554432,) bounds inflated to 256 MiB.
    bomb = zstd_ext(np.zeros(2**25, np.float32))
    wire = {"type": "Box", "dtype": "float32", "low": bomb, "high": bomb}
    frame = with_field(codec.encode(ready(box, 1)), "observation_space", wire)
    assert len(frame) < 32 * 1024
    with peak_memory() as peak, pytest.raises(aps.WireError, match="travel uncompressed"):
        codec.decode(frame, compression="zstd")
    assert peak[0] < 2**20, peak


def test_sample_bytes_are_read_from_the_description() -> None:
    space = gym.spaces.Dict(
        {
            "a": gym.spaces.Box(0, 1, (3, 4), np.float64),
            "b": gym.spaces.Tuple((gym.spaces.Discrete(5), gym.spaces.MultiBinary([2, 3]))),
            "c": gym.spaces.MultiDiscrete([2, 3], dtype=np.int32),
        }
    )
    assert sample_nbytes(space_to_wire(space)) == 96 + 8 + 6 + 8
    assert sample_nbytes({"type": "Box"}) == 0
    assert sample_nbytes("nonsense") == 0


async def _raw_worker(url: str, token: bytes, ready_frame: bytes) -> bytes:
    """Dial as a worker holding ``token``, send ``ready_frame`` as the Ready; read to EOF."""
    host, port = url.removeprefix("tcp://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:

        async def read() -> bytes:
            (length,) = struct.unpack("<I", await reader.readexactly(4))
            return await reader.readexactly(length)

        def write(frame: bytes) -> None:
            writer.write(struct.pack("<I", len(frame)) + frame)

        challenge = codec.decode(await read())
        assert isinstance(challenge, Challenge)
        mine = b"n" * 32
        hello = Hello(
            protocol_version=challenge.protocol_version,
            proof=worker_proof(token, challenge.nonce, mine),
            env_id="CartPole-v1",
            num_envs=100_000_000,
            seed=None,
            host="attacker",
            pid=1,
            label="",
            nonce=mine,
        )
        write(codec.encode(hello))
        welcome = codec.decode(await read())
        assert isinstance(welcome, Welcome), welcome
        write(ready_frame)
        rest = b""
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
            while chunk := await reader.read(65536):
                rest += chunk
        return rest
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


@pytest.mark.timeout(60)
async def test_a_token_holders_ready_of_a_hundred_million_envs_is_refused_and_honest_workers_step(
    workers: Any,
) -> None:
    token = b"attack token"
    async with aps.Learner(TCP, num_workers=1, token=token, timeouts=FAST) as learner:
        claim = codec.encode(ready(gym.spaces.Box(-1, 1, (4,)), 100_000_000))
        await asyncio.wait_for(_raw_worker(learner.url, token, claim), 20)
        assert learner.workers == ()
        workers.start(learner.url, "CartPole-v1", num_envs=2, token=token)
        await learner.wait_for_workers(timeout=20)
        await learner.reset(seed=0)
        obs, *_ = await learner.step(np.zeros(2, np.int64))
        assert obs.shape == (2, 4)


# --------------------------------------------------------------------------------------------
# 4. Inflation has a rate per connection


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_rate_gives_each_frame_its_credit_then_spends_the_bucket() -> None:
    clock = Clock()
    rate = InflationRate(per_byte=10, per_second=1000, burst=2000, start=300, clock=clock)
    rate.frame(100)
    with pytest.raises(aps.WireError):
        rate.spend(1301, "a")  # a new connection's bucket holds start: no burst on reconnecting
    clock.now = 2.0
    rate.frame(100)  # 1000 of credit, 2000 in the bucket
    rate.spend(2500, "a")
    with pytest.raises(aps.WireError) as caught:
        rate.spend(600, "compressed array (uint8, shape (600,))")
    message = str(caught.value)
    for part in ("shape (600,)", "600 bytes", "500 bytes", "10 per byte", "1000 per second"):
        assert part in message, message
    rate.spend(500, "b")  # a refusal charges nothing
    clock.now = 3.0
    rate.frame(0)  # a second refills 1000
    rate.spend(1000, "c")
    clock.now = 100.0
    rate.frame(0)
    assert rate.tokens == 2000  # never more than the burst
    rate.frame(1)
    rate.spend(2010, "d")  # the frame's own credit is spent first
    rate.frame(1)
    with pytest.raises(aps.WireError):
        rate.spend(11, "e")  # unspent credit does not carry over


@needs_zstd
def test_a_connection_that_inflates_faster_than_its_rate_is_refused() -> None:
    clock = Clock()
    rate = InflationRate(clock=clock)
    bomb = codec.encode(Weights(version=1, arrays={"w": np.zeros(2**25, np.uint8)}, epsilon=None),
                        compressor=compression.compressor("zstd"))  # fmt: skip
    assert len(bomb) < 2048  # 32 MiB from 1 KiB: far past 4096 bytes per byte
    with pytest.raises(aps.WireError, match="this connection may inflate"):
        codec.decode(bomb, compression="zstd", rate=rate)  # the bucket starts at 16 MiB
    clock.now = 10.0
    for _ in range(4):  # the 128 MiB burst
        codec.decode(bomb, compression="zstd", rate=rate)
    with pytest.raises(aps.WireError, match="this connection may inflate"):
        codec.decode(bomb, compression="zstd", rate=rate)
    clock.now += 0.5  # 32 MiB more at 64 MiB/s
    codec.decode(bomb, compression="zstd", rate=rate)
    with pytest.raises(aps.WireError, match="this connection may inflate"):
        codec.decode(bomb, compression="zstd", rate=rate)


@needs_zstd
def test_honest_pong_chunks_inflate_within_the_rate_at_any_pace() -> None:
    obs = pong_obs(steps=32, envs=4, max_episode_steps=1000)
    frame = codec.encode(chunk_of(obs), compressor=compression.compressor("zstd"), frame_delta=True)
    rate = InflationRate(start=0, clock=Clock())  # no time passes: only the frames' credit
    for _ in range(10):
        decoded = codec.decode(frame, compression="zstd", frame_delta=True, rate=rate)
        assert decoded.obs.tobytes() == obs.tobytes()  # type: ignore[attr-defined]


def test_the_rate_is_charged_with_the_frame_limit_and_only_if_that_passes() -> None:
    rate = InflationRate(per_byte=0, per_second=0, burst=100, clock=Clock())
    rate.tokens = 100
    allowance = Allowance(50, rate)
    with pytest.raises(aps.WireError, match="limit of 50 bytes per frame"):
        allowance.take(60, "x")
    assert rate.tokens == 100
    allowance.take(40, "y")
    assert rate.tokens == 60 and allowance.left == 10
