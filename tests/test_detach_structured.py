"""DETACH with Dict and Tuple observations (nested): workers act, chunks carry the structure.

Differential: real workers (tasks over memory://, and over tcp:// on 127.0.0.1) act with a
tiny dict-observation agent; every chunk must equal what the same policy, seeded the same,
gives in-process on a gymnasium SyncVectorEnv with the same seeds, seed for seed. Lockstep
stepping with the actions the workers chose must give the same observations again. Then the
learner's side: APS's divergence on structured states, the chunk check, and the codec
(frame delta and compression per array of a structured obs).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.vector import AutoresetMode, SyncVectorEnv

torch = pytest.importorskip("torch")

import aps  # noqa: E402
from aps import sync  # noqa: E402
from aps.policy import Policy, VectorEnvSpaces  # noqa: E402
from aps.testing import envs as test_envs  # noqa: E402
from aps.wire import codec, compression, frame_delta  # noqa: E402
from aps.wire.batching import check_space, map_arrays  # noqa: E402
from aps.wire.messages import RolloutChunk  # noqa: E402
from aps.worker.steps import StepServer  # noqa: E402
from tests.agents import DictAgent  # noqa: E402
from tests.conftest import FAST, WorkerTasks  # noqa: E402

POLICY = f"{Path(__file__).with_name('agents.py')}:DictAgent"
ENVS: dict[str, type[test_envs.TinyEnv]] = {
    "dict": test_envs.DictObsEnv,
    "tuple": test_envs.TupleObsEnv,
    "nested": test_envs.NestedObsEnv,
    # Every array space too, through the same agent and the same reference.
    "box": test_envs.ArrayObsEnv,
    "discrete": test_envs.DiscreteObsEnv,
    "multidiscrete": test_envs.MultiDiscreteObsEnv,
    "multibinary": test_envs.MultiBinaryObsEnv,
}
BATCH_TYPES = {"dict": dict, "tuple": tuple, "nested": dict}
NUM_WORKERS, NUM_ENVS, STEPS, SEED = 2, 3, 12, 7

pytestmark = pytest.mark.timeout(60)


def make_agent(env_cls: type[test_envs.TinyEnv]) -> DictAgent:
    env = env_cls()
    torch.manual_seed(0)
    return DictAgent(VectorEnvSpaces.of(env.observation_space, env.action_space))


def leaves(tree: Any, path: str = "") -> list[tuple[str, np.ndarray]]:
    """(path, array) of each array of a dict or tuple of arrays (nested), in order."""
    if isinstance(tree, dict):
        return [leaf for key, item in tree.items() for leaf in leaves(item, f"{path}[{key!r}]")]
    if isinstance(tree, tuple):
        return [leaf for i, item in enumerate(tree) for leaf in leaves(item, f"{path}[{i}]")]
    return [(path, tree)]


def assert_trees_equal(actual: Any, expected: Any, what: str) -> None:
    got, want = leaves(actual), leaves(expected)
    assert [p for p, _ in got] == [p for p, _ in want], what
    for (path, a), (_, e) in zip(got, want, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape, f"{what}{path}: {a.shape} {e.shape}"
        np.testing.assert_array_equal(a, e, err_msg=f"{what}{path}")


def reference(
    env_cls: type[test_envs.TinyEnv], agent: DictAgent, mode: AutoresetMode, offset: int
) -> dict[str, Any]:
    """One worker's chunk, acted in-process: its envs seeded from ``offset``, as aps seeds."""
    envs = SyncVectorEnv([env_cls] * NUM_ENVS, autoreset_mode=mode)
    space = envs.single_observation_space
    policy = Policy(copy.deepcopy(agent), space, envs.single_action_space, seed=SEED + offset)
    obs, _ = envs.reset(seed=SEED + offset)
    steps: list[Any] = []
    out: dict[str, list[Any]] = {k: [] for k in ("actions", "logprob", "value", "reward")}
    out.update(terminated=[], truncated=[])
    cut: list[tuple[int, int, Any]] = []
    for t in range(STEPS):
        steps.append(map_arrays(np.array, obs))
        actions, logprob, value = policy.act(obs)
        obs, reward, terminated, truncated, info = envs.step(actions)
        for name, value_ in zip(
            out, (actions, logprob, value, reward, terminated, truncated), strict=True
        ):
            out[name].append(value_)
        for env in np.flatnonzero(truncated):
            if mode is AutoresetMode.SAME_STEP:  # the env's own observation, kept per env
                last = info["final_obs"][env]
            else:
                last = map_arrays(lambda a, env=env: a[env], obs)
            cut.append((t, int(env), map_arrays(np.array, last)))
    envs.close()
    result: dict[str, Any] = {name: np.stack(values) for name, values in out.items()}
    result["obs"] = map_arrays(lambda *a: np.stack(a), *steps)
    result["next_obs"] = map_arrays(np.array, obs)
    result["truncated_index"] = np.array([c[:2] for c in cut], np.int64).reshape(-1, 2)
    result["truncated_obs"] = (
        map_arrays(lambda *a: np.stack(a).astype(a[0].dtype), *[c[2] for c in cut]) if cut else None
    )
    return result


def expected_rollout(
    env_cls: type[test_envs.TinyEnv], agent: DictAgent, mode: AutoresetMode
) -> dict[str, Any]:
    """What every worker's reference chunk gives, joined along the env axis as Rollout joins."""
    parts = [reference(env_cls, agent, mode, w * NUM_ENVS) for w in range(NUM_WORKERS)]
    joined: dict[str, Any] = {}
    for name in ("actions", "logprob", "value", "reward", "terminated", "truncated"):
        joined[name] = np.concatenate([p[name] for p in parts], axis=1)
    joined["obs"] = map_arrays(lambda *a: np.concatenate(a, axis=1), *[p["obs"] for p in parts])
    joined["next_obs"] = map_arrays(lambda *a: np.concatenate(a), *[p["next_obs"] for p in parts])
    joined["truncated_index"] = np.concatenate(
        [p["truncated_index"] + [0, w * NUM_ENVS] for w, p in enumerate(parts)]
    )
    joined["truncated_obs"] = [p["truncated_obs"] for p in parts]
    return joined


async def acted(
    workers: WorkerTasks,
    env_cls: type[test_envs.TinyEnv],
    mode: str,
    url: str = "memory://",
    **learner_kwargs: Any,
) -> tuple[aps.Learner, DictAgent, Any]:
    learner = aps.Learner(
        url,
        num_workers=NUM_WORKERS,
        policy=POLICY,
        autoreset_mode=mode,
        timeouts=FAST,
        **learner_kwargs,
    )
    await learner.start()
    for _ in range(NUM_WORKERS):
        workers.start(learner.url, env=f"aps.testing.envs:{env_cls.__name__}", num_envs=NUM_ENVS)
    await learner.reset(seed=SEED)
    agent = make_agent(env_cls)
    await learner.publish(agent)
    return learner, agent, await learner.rollout(STEPS)


def assert_rollout_is_the_reference(batch: Any, expected: dict[str, Any]) -> None:
    assert_trees_equal(batch.obs, expected["obs"], "obs")
    assert_trees_equal(batch.next_obs, expected["next_obs"], "next_obs")
    for name in ("actions", "reward", "terminated", "truncated"):
        np.testing.assert_array_equal(getattr(batch, name), expected[name], err_msg=name)
    np.testing.assert_allclose(batch.logprob, expected["logprob"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(batch.value, expected["value"], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(batch.truncated_index, expected["truncated_index"])
    assert batch.truncated.any(), "the test must see truncations"
    at = 0
    for part in expected["truncated_obs"]:
        if part is None:
            continue
        count = len(leaves(part)[0][1])
        assert_trees_equal(
            map_arrays(lambda a, at=at, count=count: a[at : at + count], batch.truncated_obs),
            part,
            "truncated_obs",
        )
        at += count
    assert at == len(batch.truncated_index)


@pytest.mark.parametrize("kind", sorted(ENVS))
def test_each_test_env_draws_from_a_space_of_its_own(kind: str) -> None:
    # Workers in one process step their envs on threads of their own; an observation space
    # shared by every instance (a class attribute) let one worker's reseed land between
    # another's seed and sample, and the reference differential failed one run in hundreds.
    first, second = ENVS[kind](), ENVS[kind]()
    assert first.observation_space is not second.observation_space
    assert first.observation_space == second.observation_space


@pytest.mark.parametrize("mode", ["SameStep", "NextStep"])
@pytest.mark.parametrize("kind", sorted(ENVS))
async def test_detach_rollouts_equal_the_same_policy_in_process(
    workers: WorkerTasks, kind: str, mode: str
) -> None:
    env_cls = ENVS[kind]
    learner, agent, batch = await acted(workers, env_cls, mode)
    async with learner:
        assert type(batch.obs) is BATCH_TYPES.get(kind, np.ndarray)
        autoreset = AutoresetMode.SAME_STEP if mode == "SameStep" else AutoresetMode.NEXT_STEP
        assert_rollout_is_the_reference(batch, expected_rollout(env_cls, agent, autoreset))
        # Lockstep, with the actions the workers chose, steps through the same observations.
        obs, _ = await learner.reset(seed=SEED)
        assert_trees_equal(obs, map_arrays(lambda a: a[0], batch.obs), "reset obs")
        for t in range(STEPS):
            obs, reward, terminated, truncated, _ = await learner.step(batch.actions[t])
            np.testing.assert_array_equal(reward, batch.reward[t])
            np.testing.assert_array_equal(
                terminated | truncated, batch.terminated[t] | batch.truncated[t]
            )
            following = (
                batch.next_obs if t + 1 == STEPS else map_arrays(lambda a, t=t: a[t + 1], batch.obs)
            )
            assert_trees_equal(obs, following, f"lockstep obs at step {t}")


async def test_detach_over_tcp_with_compression_equals_the_same_policy_in_process(
    workers: WorkerTasks,
) -> None:
    pytest.importorskip("zstandard")
    env_cls = test_envs.NestedObsEnv
    learner, agent, batch = await acted(
        workers, env_cls, "SameStep", "tcp://127.0.0.1:0", compression="zstd"
    )
    async with learner:
        assert_rollout_is_the_reference(
            batch, expected_rollout(env_cls, agent, AutoresetMode.SAME_STEP)
        )
        chunks = []
        async for chunk in learner.chunks(STEPS, max_in_flight=1):
            chunks.append(chunk)
            if len(chunks) == NUM_WORKERS:
                break
        for chunk in chunks:
            assert chunk.obs["image"].shape == (STEPS, NUM_ENVS, 2, 3, 3)
            assert chunk.obs["parts"][1]["gears"].shape == (STEPS, NUM_ENVS, 2)


async def test_aps_divergence_is_the_kl_on_the_structured_states_acted_on(
    workers: WorkerTasks,
) -> None:
    env_cls = test_envs.NestedObsEnv
    learner, agent, batch = await acted(
        workers, env_cls, "SameStep", sync=sync.APS(kl_threshold=0.0)
    )
    async with learner:
        behaviour = copy.deepcopy(agent)
        with torch.no_grad():
            for p in agent.parameters():
                p.add_(0.3 * torch.randn_like(p))
        await learner.publish(agent)
        await learner.rollout(1)
        measured = [w.divergences[0] for w in learner.metrics.workers]
    env = env_cls()
    space, actions = env.observation_space, env.action_space
    old, new = Policy(behaviour, space, actions), Policy(agent, space, actions)
    for worker, value in enumerate(measured):
        envs = slice(worker * NUM_ENVS, (worker + 1) * NUM_ENVS)
        states = map_arrays(lambda a, envs=envs: a[:, envs], batch.obs)
        with torch.no_grad():
            flat = map_arrays(
                lambda a: torch.as_tensor(a.reshape(-1, *a.shape[2:]), dtype=torch.float32),
                states,
            )
            p = torch.distributions.Categorical(logits=behaviour.actor(flat))
            q = torch.distributions.Categorical(logits=agent.actor(flat))
            expected = torch.distributions.kl_divergence(p, q).mean().item()
        assert value == pytest.approx(expected, rel=1e-4)
        assert old.kl(new, states) == pytest.approx(expected, rel=1e-4)


class BadLeafServer(StepServer):
    """An honest DETACH step server whose chunks then lose a step of one array of ``obs``."""

    async def _rollout(self, request: Any) -> Any:
        chunk = await super()._rollout(request)
        obs = dict(chunk.obs)
        obs["image"] = obs["image"][:-1]
        return dataclasses.replace(chunk, obs=obs)


class BadLeafWorker(aps.Worker):
    def _new_server(self, envs: Any, collector: Any) -> StepServer:
        return BadLeafServer(envs, collector, None)


async def test_a_chunk_whose_structured_obs_does_not_fit_is_refused(workers: WorkerTasks) -> None:
    async with aps.Learner("memory://", num_workers=1, policy=POLICY, timeouts=FAST) as learner:
        bad = BadLeafWorker(
            learner.url, "aps.testing.envs:NestedObsEnv", num_envs=2, timeouts=FAST, policy=POLICY
        )
        workers.tasks.append(asyncio.create_task(bad.run()))
        await learner.reset(seed=0)
        await learner.publish(make_agent(test_envs.NestedObsEnv))
        with pytest.raises(aps.ProtocolError, match="not a compatible aps worker") as caught:
            await learner.rollout(6)
        assert "obs['image'] is an array of shape (5, 2, 2, 3, 3)" in str(caught.value)
        assert "expected an array of shape (6, 2, 2, 3, 3)" in str(caught.value)


def test_spaces_a_worker_cannot_act_on_are_refused_naming_the_leaf() -> None:
    assert check_space(test_envs.NestedObsEnv().observation_space, "worker-side inference")
    assert not check_space(spaces.Box(0, 1, (2,)), "worker-side inference")
    bad = spaces.Dict({"ok": spaces.Discrete(2), "text": spaces.Text(5)})
    with pytest.raises(aps.ConfigError, match="cannot take the Text space"):
        check_space(bad, "worker-side inference")
    with pytest.raises(aps.ConfigError, match="empty space"):
        check_space(spaces.Tuple(()), "worker-side inference")
    agent = make_agent(test_envs.NestedObsEnv)
    with pytest.raises(aps.ConfigError, match="is not supported"):
        Policy(agent, spaces.Text(3), spaces.Discrete(2))
    with pytest.raises(aps.ConfigError, match="a policy cannot take the Text space"):
        Policy(agent, bad, spaces.Discrete(2))


def test_the_policy_hands_heads_the_observation_in_the_spaces_structure() -> None:
    env = test_envs.NestedObsEnv()
    agent = make_agent(test_envs.NestedObsEnv)
    seen: list[Any] = []
    agent.actor[0].register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    policy = Policy(agent, env.observation_space, env.action_space, seed=0)
    assert policy.inference == "torch"
    batch = map_arrays(lambda *a: np.stack(a), *[env.observation_space.sample() for _ in range(4)])
    actions, logprob, value = policy.act(batch)
    assert actions.shape == logprob.shape == (4,) and value is not None and value.shape == (4,)
    tree = seen[-1]
    assert set(tree) == {"image", "parts"} and isinstance(tree["parts"], tuple)
    assert tree["parts"][1]["velocity"].dtype == torch.float32
    assert tree["image"].shape == (4, 2, 3, 3)
    assert policy.log_prob(batch, actions).shape == (4,)
    with pytest.raises(aps.ConfigError, match=r"observations\['image'\]"):
        policy.act({**batch, "image": batch["image"][:, :1]})
    with pytest.raises(aps.ConfigError, match="must be a dict"):
        policy.act(batch["image"])


# --------------------------------------------------------------------------------------------
# The codec: frame delta and compression per array of a structured obs


def stacks(steps: int, envs: int, depth: int = 4, size: int = 16) -> np.ndarray:
    """Frame stacks that shift by one frame each step, as a frame-stack wrapper's do."""
    frames = np.random.default_rng(0).integers(0, 255, (steps + depth, envs, size, size), np.uint8)
    return np.stack([frames[t : t + depth].transpose(1, 0, 2, 3) for t in range(steps)])


def chunk_of(obs: Any, next_obs: Any = None, truncated_obs: Any = None) -> RolloutChunk:
    steps, envs = 8, 3
    flat = np.zeros((steps, envs), np.float32)
    empty = map_arrays(lambda a: np.zeros((0, *a.shape[2:]), a.dtype), obs)
    return RolloutChunk(
        version=1,
        obs=obs,
        actions=np.zeros((steps, envs), np.int64),
        logprob=flat,
        value=None,
        reward=flat.astype(np.float64),
        terminated=flat.astype(bool),
        truncated=flat.astype(bool),
        next_obs=map_arrays(lambda a: np.array(a[-1]), obs) if next_obs is None else next_obs,
        episode_return=np.zeros(0),
        episode_length=np.zeros(0, np.int64),
        episode_env=np.zeros(0, np.int64),
        truncated_obs=empty if truncated_obs is None else truncated_obs,
        truncated_index=np.zeros((0, 2), np.int64),
    )


def structured_obs() -> dict[str, Any]:
    return {
        "pixels": stacks(8, 3),
        "state": (np.arange(48, dtype=np.float32).reshape(8, 3, 2), {"depth": stacks(8, 3, 2, 8)}),
    }


@pytest.mark.parametrize("codec_name", ["none", "zstd"])
def test_each_frame_stack_of_a_structured_obs_is_delta_coded_on_its_own(codec_name: str) -> None:
    compressor = None
    if codec_name != "none":
        pytest.importorskip("zstandard")
        compressor = compression.compressor(codec_name)
    message = chunk_of(structured_obs())
    plain = codec.encode(message, compressor=compressor)
    frame = codec.encode(message, compressor=compressor, frame_delta=True)
    raw = codec.encode(message)
    if compressor is None:
        assert len(frame) < len(raw) * 0.6  # the stacks' repeated frames left out
    else:  # each array compressed on its own, nested or not (repeats found by the codec)
        assert len(plain) < len(raw) * 0.6
    decoded = codec.decode(frame, compression=codec_name, frame_delta=True)
    assert isinstance(decoded, RolloutChunk)
    assert_trees_equal(decoded.obs, message.obs, "obs")
    assert_trees_equal(decoded.next_obs, message.next_obs, "next_obs")
    assert not decoded.obs["pixels"].flags.writeable
    again = codec.decode(plain, compression=codec_name)
    assert_trees_equal(again.obs, message.obs, "obs")  # type: ignore[attr-defined]


def _never(self: Any) -> Any:
    raise AssertionError("rebuilt before its place in the message was known")


@pytest.mark.parametrize("where", ["next_obs", "truncated_obs", "both"])
def test_a_delta_in_a_structured_field_other_than_obs_is_refused_before_it_is_rebuilt(
    where: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(frame_delta.Pending, "rebuild", _never)
    obs = structured_obs()
    delta = frame_delta.split(obs["pixels"])
    assert delta is not None
    spec = codec._SPECS_BY_CLASS[RolloutChunk]
    body = codec._body(spec, chunk_of(obs))
    if where in ("next_obs", "both"):
        body["next_obs"] = {**body["next_obs"], "pixels": delta}
    if where in ("truncated_obs", "both"):
        body["truncated_obs"] = {**body["truncated_obs"], "state": (delta, {"depth": delta})}
    if where == "both":
        body["obs"] = {**body["obs"], "pixels": delta}
    frame = codec._pack_frame(body)
    with pytest.raises(aps.WireError, match="only a rollout chunk's obs"):
        codec.decode(frame, frame_delta=True)
    with pytest.raises(aps.WireError, match="did not negotiate frame delta"):
        codec.decode(frame, frame_delta=False)


def test_an_obs_that_is_no_tree_of_arrays_is_refused() -> None:
    good = chunk_of({"x": np.zeros((8, 3))})
    for bad in ({"a": np.zeros((8, 3), object)}, {"a": [np.zeros((8, 3))]}, {"a": "text"}):
        with pytest.raises(aps.WireError, match="field 'obs'"):
            codec.encode(dataclasses.replace(good, obs=bad))
    deep: Any = np.zeros((8, 3))
    for _ in range(codec.MAX_OBJECT_DEPTH + 1):
        deep = (deep,)
    body = codec._body(codec._SPECS_BY_CLASS[RolloutChunk], good)
    body["obs"] = deep
    with pytest.raises(aps.WireError, match="field 'obs' must be a numpy array, or a dict"):
        codec.decode(codec._packb(body))


def test_gym_spaces_are_used_as_the_batch_layout() -> None:
    space = test_envs.NestedObsEnv().observation_space
    batch = gym.vector.utils.create_empty_array(space, 3)
    assert [p for p, _ in leaves(batch)] == [
        "['image']",
        "['parts'][0]",
        "['parts'][1]['gears']",
        "['parts'][1]['velocity']",
        "['parts'][2]",
    ]


# --------------------------------------------------------------------------------------------
# The SB3 adapter over the same kind of observations (SB3 takes flat Dict spaces only)


class FlatDictObsEnv(test_envs.TinyEnv):
    """A flat Dict of every leaf type (SB3's VecEnvs refuse nested spaces), Discrete actions."""

    def __init__(self) -> None:
        super().__init__(
            spaces.Dict(
                {
                    "position": spaces.Box(-2.0, 2.0, (2,), np.float64),
                    "count": spaces.Discrete(4),
                    "flags": spaces.MultiBinary(2),
                    "gears": spaces.MultiDiscrete([2, 3]),
                }
            ),
            spaces.Discrete(3),
            rich_info=False,
        )


def test_sb3_adapter_equals_dummy_vec_env_on_dict_observations() -> None:
    pytest.importorskip("stable_baselines3")
    from stable_baselines3.common.vec_env import DummyVecEnv

    from aps.integrations.sb3 import ClusterVecEnv

    actual = ClusterVecEnv.local(
        FlatDictObsEnv, num_workers=2, envs_per_worker=2, transport="memory"
    )
    expected = DummyVecEnv([FlatDictObsEnv] * 4)
    try:
        assert actual.observation_space == expected.observation_space
        for vec in (actual, expected):
            vec.seed(3)
        assert_trees_equal(actual.reset(), expected.reset(), "reset obs")
        rng = np.random.default_rng(0)
        ended = 0
        for t in range(40):
            actions = rng.integers(0, 3, 4)
            got, want = actual.step(actions), expected.step(actions)
            assert_trees_equal(got[0], want[0], f"obs at step {t}")
            np.testing.assert_array_equal(got[1], want[1], err_msg=f"rewards at step {t}")
            np.testing.assert_array_equal(got[2], want[2], err_msg=f"dones at step {t}")
            for env in np.flatnonzero(want[2]):
                final_got = got[3][env]["terminal_observation"]
                final_want = want[3][env]["terminal_observation"]
                assert_trees_equal(final_got, final_want, f"terminal obs at step {t}")
                ended += 1
        assert ended > 0
    finally:
        actual.close()
        expected.close()


def test_an_empty_structure_is_refused_as_a_config_error() -> None:
    # Never StopIteration, which would end a caller's loop silently.
    space = spaces.Dict({"a": spaces.Box(-1.0, 1.0, (2,), np.float32)})
    policy = Policy(
        DictAgent(VectorEnvSpaces.of(space, spaces.Discrete(3))), space, spaces.Discrete(3)
    )
    for empty in ({}, ()):
        with pytest.raises(aps.ConfigError, match="empty dict or tuple"):
            policy.act(empty)
