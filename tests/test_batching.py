"""concat/split/check_batch/merge_infos, differentially against a real SyncVectorEnv."""

from __future__ import annotations

import itertools
from typing import Any

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.vector import AutoresetMode, SyncVectorEnv
from gymnasium.vector.utils import batch_space

from aps.errors import ConfigError, ProtocolError
from aps.testing.envs import ALL_ENVS, BoxEnv, DiscreteEnv, TinyEnv
from aps.wire import codec
from aps.wire.batching import check_batch, concat, merge_infos, split
from aps.wire.messages import ResetResult, StepRequest, StepResult

MODES = [AutoresetMode.NEXT_STEP, AutoresetMode.SAME_STEP]
SPLITS = [(3, 2), (1, 4, 2), (2, 1, 1)]


def assert_same(got: Any, want: Any, path: str = "value") -> None:
    """Equal values of equal types, dtypes, shapes and key orders, recursively."""
    if isinstance(want, np.ndarray):
        assert isinstance(got, np.ndarray), f"{path}: {type(got)}"
        assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        if want.dtype == object:
            for where in np.ndindex(want.shape):
                assert_same(got[where], want[where], f"{path}[{where}]")
        else:
            np.testing.assert_array_equal(got, want, err_msg=path)
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{path}: {type(got)}"
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for key in want:
            assert_same(got[key], want[key], f"{path}[{key!r}]")
    elif isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want), f"{path}: {got!r}"
        for index, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, f"{path}[{index}]")
    else:
        assert type(got) is type(want), f"{path}: {type(got)} != {type(want)}"
        assert got == want, f"{path}: {got!r} != {want!r}"


def travel(message: Any) -> Any:
    """What the peer receives."""
    return codec.decode(codec.encode(message))


def offsets_of(counts: tuple[int, ...]) -> list[int]:
    return [0, *itertools.accumulate(counts)][:-1]


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.name)
@pytest.mark.parametrize("env_cls", ALL_ENVS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("counts", SPLITS, ids=str)
def test_workers_match_one_sync_vector_env(
    env_cls: type[TinyEnv], counts: tuple[int, ...], mode: AutoresetMode
) -> None:
    num_envs = sum(counts)
    offsets = offsets_of(counts)
    full = SyncVectorEnv([env_cls] * num_envs, autoreset_mode=mode)
    workers = [SyncVectorEnv([env_cls] * c, autoreset_mode=mode) for c in counts]
    obs_space, act_space = full.single_observation_space, full.single_action_space
    seed = 7 * sum(counts) + len(counts)

    want_obs, want_info = full.reset(seed=seed)
    replies = [
        travel(ResetResult(obs=obs, info=info))
        for obs, info in (w.reset(seed=seed + o) for w, o in zip(workers, offsets, strict=True))
    ]
    assert_same(concat(obs_space, [r.obs for r in replies]), want_obs, "reset obs")
    merged = merge_infos(list(zip(offsets, (r.info for r in replies), strict=True)), num_envs)
    assert_same(merged, want_info, "reset info")

    full.action_space.seed(seed)
    for step in range(12):
        actions = check_batch(act_space, full.action_space.sample(), num_envs)
        want = full.step(actions)
        results = []
        for worker, part in zip(workers, split(act_space, actions, counts), strict=True):
            request = travel(StepRequest(actions=part))
            obs, reward, terminated, truncated, info = worker.step(request.actions)
            results.append(
                travel(
                    StepResult(
                        obs=obs,
                        reward=reward,
                        terminated=terminated,
                        truncated=truncated,
                        info=info,
                    )
                )
            )
        got_obs = concat(obs_space, [r.obs for r in results])
        assert_same(got_obs, want[0], f"step {step} obs")
        assert_same(np.concatenate([r.reward for r in results]), want[1], f"step {step} reward")
        assert_same(np.concatenate([r.terminated for r in results]), want[2], f"step {step} term")
        assert_same(np.concatenate([r.truncated for r in results]), want[3], f"step {step} trunc")
        merged = merge_infos(list(zip(offsets, (r.info for r in results), strict=True)), num_envs)
        assert_same(merged, want[4], f"step {step} info")
    full.close()
    for worker in workers:
        worker.close()


def test_the_differential_run_sees_the_interesting_cases() -> None:
    # Guards the test above against envs that stop producing what it means to check.
    env = SyncVectorEnv([DiscreteEnv] * 6, autoreset_mode=AutoresetMode.SAME_STEP)
    env.reset(seed=1)
    seen: set[str] = set()
    dtypes: set[str] = set()
    for _ in range(12):
        *_, info = env.step(env.action_space.sample())
        seen.update(info)
        if "mixed" in info:
            dtypes.add(info["mixed"].dtype.name)
        if "_final_obs" in info and not info["_final_obs"].all():
            seen.add("partial final_obs")
    assert {"final_obs", "final_info", "nested", "label", "np_bool", "nothing"} <= seen
    assert "partial final_obs" in seen
    assert dtypes == {"int64", "float64"}


# --------------------------------------------------------------------------------------------
# concat and split


SPACES = [env_cls().observation_space for env_cls in ALL_ENVS] + [
    env_cls().action_space for env_cls in ALL_ENVS
]


@pytest.mark.parametrize("space", SPACES, ids=str)
def test_concat_matches_batch_space_and_split_inverts_it(space: gym.Space[Any]) -> None:
    counts = [2, 0, 3]
    batched = batch_space(space, sum(counts))
    batched.seed(3)
    batch = batched.sample()
    parts = split(space, batch, counts)
    assert len(parts) == 3
    joined = concat(space, parts)
    assert_same(joined, batch)
    assert batched.contains(joined)

    def leaves(value: Any) -> list[np.ndarray[Any, Any]]:
        if isinstance(value, dict):
            return [leaf for v in value.values() for leaf in leaves(v)]
        if isinstance(value, tuple):
            return [leaf for v in value for leaf in leaves(v)]
        return [value]

    for part, count in zip(parts, counts, strict=True):
        for leaf in leaves(part):
            assert leaf.shape[0] == count
            assert leaf.flags.c_contiguous
    for leaf in leaves(joined):
        assert leaf.flags.writeable and leaf.flags.c_contiguous


def test_split_returns_views_of_a_contiguous_batch() -> None:
    space = gym.spaces.Box(0, 1, (2,))
    batch = np.zeros((5, 2), np.float32)
    first, second = split(space, batch, [2, 3])
    assert np.shares_memory(first, batch) and np.shares_memory(second, batch)
    transposed = np.zeros((2, 5), np.float32).T
    parts = split(space, transposed, [4, 1])
    assert all(p.flags.c_contiguous for p in parts)


def test_split_refuses_counts_that_do_not_add_up() -> None:
    with pytest.raises(ConfigError, match=r"has shape \(5,\), expected a leading axis of 6"):
        split(gym.spaces.Discrete(2), np.zeros(5, np.int64), [3, 3])
    with pytest.raises(ConfigError, match="non-negative"):
        split(gym.spaces.Discrete(2), np.zeros(5, np.int64), [6, -1])


def test_concat_refuses_parts_that_do_not_match_the_space() -> None:
    space = gym.spaces.Box(0, 1, (2,), np.float32)
    with pytest.raises(ProtocolError, match=r"part 1 of batch is an array of shape \(3, 3\)"):
        concat(space, [np.zeros((1, 2), np.float32), np.zeros((3, 3), np.float32)])
    with pytest.raises(ProtocolError, match="dtype float64"):
        concat(space, [np.zeros((1, 2), np.float64)])
    with pytest.raises(ProtocolError, match="keys"):
        concat(gym.spaces.Dict({"a": space}), [{"b": np.zeros((1, 2), np.float32)}])
    with pytest.raises(ProtocolError, match="tuple of 1"):
        concat(gym.spaces.Tuple([space]), [np.zeros((1, 2), np.float32)])
    with pytest.raises(ConfigError, match="at least one part"):
        concat(space, [])
    with pytest.raises(ConfigError, match="cannot batch a Text space"):
        concat(gym.spaces.Text(3), [("a",)])


# --------------------------------------------------------------------------------------------
# check_batch


def test_check_batch_accepts_lists_and_returns_arrays() -> None:
    out = check_batch(gym.spaces.Discrete(3), [0, 2, 1], 3)
    assert isinstance(out, np.ndarray) and out.dtype == np.int64
    bools = check_batch(gym.spaces.MultiBinary(2), np.zeros((3, 2), bool), 3)
    assert bools.dtype == np.bool_
    actions = np.ones((2, 2), np.float64)
    assert check_batch(gym.spaces.Box(-1, 1, (2,)), actions, 2) is actions
    nested = check_batch(
        gym.spaces.Dict(
            {"b": gym.spaces.Discrete(2), "a": gym.spaces.Tuple([gym.spaces.Discrete(2)])}
        ),
        {"a": [[1, 0]], "b": [0, 1]},
        2,
    )
    assert list(nested) == ["a", "b"]  # the space sorts its keys
    assert isinstance(nested["a"], tuple) and nested["a"][0].tolist() == [1, 0]


def test_check_batch_names_the_shape_the_expected_shape_and_the_fix() -> None:
    with pytest.raises(ConfigError) as info:
        check_batch(gym.spaces.Discrete(2), np.zeros(5, np.int64), 6)
    assert str(info.value) == (
        "actions has shape (5,), expected (6,) = (num_envs,) + single_action_space.shape; "
        "pass one action per env"
    )
    with pytest.raises(ConfigError, match=r"actions has shape \(4, 3\), expected \(4, 2\)"):
        check_batch(gym.spaces.Box(0, 1, (2,)), np.zeros((4, 3)), 4)
    with pytest.raises(
        ConfigError, match=r"actions\['a'\] has shape \(3,\), .* single_action_space\['a'\]\.shape"
    ):
        check_batch(gym.spaces.Dict({"a": gym.spaces.Discrete(2)}), {"a": [0, 1, 0]}, 2)


def test_check_batch_refuses_wrong_dtypes() -> None:
    with pytest.raises(
        ConfigError, match=r"actions has dtype float32, expected an integer or bool"
    ):
        check_batch(gym.spaces.Discrete(2), np.zeros(2, np.float32), 2)
    with pytest.raises(ConfigError, match=r"astype\(np.int64\)"):
        check_batch(gym.spaces.MultiDiscrete([2, 2]), np.zeros((2, 2)), 2)
    with pytest.raises(ConfigError, match=r"dtype <U1, expected a numeric dtype"):
        check_batch(gym.spaces.Box(0, 1, (1,)), np.array([["a"], ["b"]]), 2)
    with pytest.raises(ConfigError, match="dtype object"):
        check_batch(gym.spaces.MultiBinary(1), np.array([[None], [None]]), 2)


def test_check_batch_refuses_wrong_structure() -> None:
    space = gym.spaces.Dict({"a": gym.spaces.Discrete(2), "b": gym.spaces.Discrete(2)})
    with pytest.raises(ConfigError, match=r"missing \['b'\], extra \['c'\]"):
        check_batch(space, {"a": [0], "c": [1]}, 1)
    with pytest.raises(ConfigError, match="expected a dict"):
        check_batch(space, [0, 1], 1)
    pair = gym.spaces.Tuple([gym.spaces.Discrete(2)] * 2)
    with pytest.raises(ConfigError, match="is of length 1, expected a tuple of 2"):
        check_batch(pair, ([0],), 1)
    with pytest.raises(ConfigError, match="cannot be turned into an array"):
        check_batch(gym.spaces.Box(0, 1, (2,)), [[0.0, 1.0], [1.0]], 2)
    with pytest.raises(ConfigError, match="cannot batch a Text space"):
        check_batch(gym.spaces.Text(3), ["a"], 1)


# --------------------------------------------------------------------------------------------
# merge_infos


def test_merge_infos_casts_into_the_first_workers_dtype() -> None:
    # Gymnasium stores later values in the array the first env with the key created.
    a = {"x": np.array([1, 0]), "_x": np.array([True, False])}
    b = {"x": np.array([2.7, 0.0]), "_x": np.array([True, False])}
    merged = merge_infos([(0, a), (2, b)], 5)
    assert merged["x"].dtype == np.int64
    assert merged["x"].tolist() == [1, 0, 2, 0, 0]
    assert merged["_x"].tolist() == [True, False, True, False, False]


def test_merge_infos_ignores_workers_whose_envs_all_lack_the_key() -> None:
    a = {"x": np.zeros(2, np.float32), "_x": np.zeros(2, bool)}
    b = {"x": np.array([3, 4]), "_x": np.array([True, True])}
    merged = merge_infos([(0, a), (2, b)], 4)
    assert merged["x"].dtype == np.int64
    assert merged["x"].tolist() == [0, 0, 3, 4]


def test_merge_infos_returns_fresh_writable_arrays() -> None:
    info = codec.decode(
        codec.encode(
            StepResult(
                obs=np.zeros(2),
                reward=np.zeros(2),
                terminated=np.zeros(2, bool),
                truncated=np.zeros(2, bool),
                info={"x": np.array([1.0, 2.0]), "_x": np.array([True, True])},
            )
        )
    ).info
    assert not info["x"].flags.writeable
    merged = merge_infos([(0, info)], 2)
    assert merged["x"].flags.writeable and merged["_x"].flags.writeable
    assert not np.shares_memory(merged["x"], info["x"])


def test_merge_infos_of_nothing_is_empty() -> None:
    assert merge_infos([(0, {}), (3, {})], 5) == {}


@pytest.mark.parametrize(
    ("info", "match"),
    [
        ({"x": np.zeros(2)}, "has no '_x' mask"),
        ({"x": np.zeros(2), "_x": np.zeros(2)}, "must be a 1-d bool array"),
        ({"x": np.zeros(3), "_x": np.zeros(3, bool)}, r"covers envs 4\.\.6, outside the 6 envs"),
        ({"x": np.zeros(1), "_x": np.zeros(2, bool)}, "leading axis of 2 envs"),
        ({"x": 3, "_x": np.zeros(2, bool)}, "must be a dict or an array"),
        ({1: np.zeros(2)}, "non-str key"),
    ],
)
def test_merge_infos_refuses_malformed_parts(info: dict[Any, Any], match: str) -> None:
    good = {"x": np.zeros(4), "_x": np.zeros(4, bool)}
    with pytest.raises(ProtocolError, match=match):
        merge_infos([(0, good), (4, info)], 6)


@pytest.mark.parametrize(
    "other",
    [
        np.array([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]),  # another per-env shape
        np.array(["a", "b"]),  # a dtype that does not cast to float
        {"y": np.array([7, 8]), "_y": np.array([True, False])},  # a dict
    ],
    ids=["shape", "dtype", "dict"],
)
def test_workers_that_disagree_on_a_key_get_each_envs_own_value(other: Any) -> None:
    # Neither worker is wrong alone: the key holds each env's own value, nothing is lost.
    first = {"x": np.array([0.5, 1.5, 2.5, 3.5]), "_x": np.array([True, True, False, True])}
    second = {"x": other, "_x": np.array([True, True])}
    merged = merge_infos([(0, first), (4, second)], 6)
    values = merged["x"]
    assert values.dtype == object and values.shape == (6,)
    assert values[:4].tolist() == [0.5, 1.5, None, 3.5]
    np.testing.assert_array_equal(merged["_x"], [True, True, False, True, True, True])
    if isinstance(other, dict):
        assert values[4] == {"y": 7} and values[5] == {}
    else:
        for got, want in zip(values[4:], other, strict=True):
            np.testing.assert_array_equal(got, want)


def test_a_disagreed_key_whose_dict_is_malformed_is_a_protocol_error() -> None:
    # The per-env split walks a worker's whole dict: a missing mask deep inside is refused
    # as a ProtocolError, not a KeyError.
    first = {"x": np.array([0.5, 1.5]), "_x": np.array([True, True])}
    second = {"x": {"y": np.array([7, 8])}, "_x": np.array([True, True])}
    with pytest.raises(ProtocolError, match="has no '_y' mask"):
        merge_infos([(0, first), (2, second)], 4)


def test_merge_infos_refuses_a_non_dict() -> None:
    with pytest.raises(ProtocolError, match="is not a dict"):
        merge_infos([(0, (1, 2))], 2)  # type: ignore[list-item]


def test_box_env_reward_depends_on_actions() -> None:
    env = BoxEnv()
    env.reset(seed=0)
    _, r1, *_ = env.step(np.zeros(2, np.float32))
    env.reset(seed=0)
    _, r2, *_ = env.step(np.ones(2, np.float32))
    assert r2 == r1 + 2.0
