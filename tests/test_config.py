"""The learner's settings: one frozen config, checked once, that nobody repeats or writes."""

from __future__ import annotations

import ast
import dataclasses
import enum
import inspect
from pathlib import Path
from typing import Any, ForwardRef

import pytest
from gymnasium.vector import AutoresetMode

import aps
from aps import ClusterEnv, Learner
from aps.errors import ConfigError
from aps.learner import config as config_module, learner as learner_module
from aps.learner.config import LearnerConfig, LearnerOptions, ListenOptions
from aps.learner.pool import WorkerPool
from aps.sync import AlwaysSync

URL = "tcp://127.0.0.1:0"
LEARNER = inspect.signature(Learner.__init__).parameters
SETTINGS = {name for name in LEARNER if name not in ("self", "listen", "num_workers")}
"""The learner's settings: every parameter but the address and the count, which each front
door names itself (``ClusterEnv.local``'s ``num_workers`` is not the learner's: it may be
``None`` and is split from ``num_envs``)."""
OWN_ADDRESS = {"token", "insecure", "factory", "launcher"}
"""What ``ClusterEnv.local`` sets itself: its address, that address's token, its launcher."""


def explicit(function: Any) -> set[str]:
    parameters = inspect.signature(function).parameters.values()
    return {p.name for p in parameters if p.kind is not inspect.Parameter.VAR_KEYWORD}


def keys(typed_dict: Any) -> set[str]:
    return set(typed_dict.__required_keys__ | typed_dict.__optional_keys__)


def annotation(value: object) -> str:
    return value.__forward_arg__ if isinstance(value, ForwardRef) else str(value)


# Nobody repeats the learner's parameter list.


def test_the_learner_has_the_settings_this_file_expects() -> None:
    # Guards the checks below against passing on an empty set.
    assert len(SETTINGS) == 15
    assert {"compression", "frame_delta", "policy_kwargs", "token"} <= SETTINGS


@pytest.mark.parametrize(
    "function",
    [ClusterEnv.__init__, ClusterEnv.local, WorkerPool.__init__],
    ids=["ClusterEnv.__init__", "ClusterEnv.local", "WorkerPool.__init__"],
)
def test_no_front_door_repeats_the_learners_settings(function: Any) -> None:
    repeated = explicit(function) & SETTINGS
    assert not repeated, f"{function.__qualname__} repeats Learner's {sorted(repeated)}"


def test_the_pool_takes_the_config_and_the_figures_only() -> None:
    assert explicit(WorkerPool.__init__) == {"self", "config", "figures"}


def test_the_options_are_the_learners_settings_with_the_same_types() -> None:
    assert keys(ListenOptions) == SETTINGS
    assert keys(LearnerOptions) == SETTINGS - OWN_ADDRESS
    assert not ListenOptions.__required_keys__  # a key left out takes the learner's default
    for name in SETTINGS:
        assert annotation(ListenOptions.__annotations__[name]) == LEARNER[name].annotation, name


def test_the_front_doors_take_the_options_typed() -> None:
    doors: list[tuple[Any, str]] = [
        (ClusterEnv.__init__, "ListenOptions"),
        (ClusterEnv.local, "LearnerOptions"),
    ]
    for function, typed_dict in doors:
        options = inspect.signature(function).parameters["options"]
        assert options.kind is inspect.Parameter.VAR_KEYWORD
        assert options.annotation == f"Unpack[{typed_dict}]"


def default_as_documented(default: object) -> str:
    if isinstance(default, enum.Enum):
        return f"{type(default).__name__}.{default.name}"
    return repr(default)


def test_each_option_documents_the_learners_default() -> None:
    # PEP 692 keeps no default in a signature: each key's docstring says it, and must say the
    # learner's.
    tree = ast.parse(Path(config_module.__file__).read_text())
    documented: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name in ("LearnerOptions", "ListenOptions"):
            for key, doc in zip(node.body, node.body[1:], strict=False):
                if isinstance(key, ast.AnnAssign) and isinstance(key.target, ast.Name):
                    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    documented[key.target.id] = " ".join(str(doc.value.value).split())
    assert set(documented) == SETTINGS
    for name, text in documented.items():
        expected = f"Default ``{default_as_documented(LEARNER[name].default)}``."
        assert text.endswith(expected), f"{name}: {text!r} should end with {expected!r}"


def test_build_takes_the_learners_defaults() -> None:
    built = LearnerConfig.build(URL, num_workers=1)
    learners = Learner(URL, num_workers=1)._pool.config
    assert dataclasses.replace(built, factory=None) == dataclasses.replace(learners, factory=None)
    assert type(built.factory) is type(learners.factory)
    assert built.sync == AlwaysSync() and built.timeouts == aps.Timeouts()
    assert (built.compression, built.frame_delta, built.reconnect_timeout) == ("auto", True, 60.0)


# Checked once, then frozen and read.


def test_the_pool_reads_what_the_user_chose() -> None:
    kwargs = {"hidden_size": 8}
    learner = Learner(
        URL,
        num_workers=2,
        token="s3cret",
        autoreset_mode="SameStep",
        policy="aps.testing:make_agent",
        policy_kwargs=kwargs,
        compression="zstd",
        frame_delta=False,
        on_worker_lost="wait",
        reconnect_timeout=5,
    )
    pool = learner._pool
    config = pool.config
    assert config.token == b"s3cret" and pool.joining.config is config
    assert config.autoreset_mode is AutoresetMode.SAME_STEP
    assert (config.compression, config.frame_delta, config.policy_kwargs) == ("zstd", False, kwargs)
    assert config.policy_kwargs is kwargs  # the caller's dict, as before: not a copy
    assert (pool.recovery.on_worker_lost, pool.recovery.reconnect_timeout) == ("wait", 5.0)
    assert isinstance(pool.config.reconnect_timeout, float)
    figures = pool.figures()  # the learner's own, passed in
    assert set(figures) == set(learner.metrics.as_dict()) and figures["version"] == 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        pool.config.compression = "none"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"num_workers": 0}, "num_workers must be an int >= 1, got 0"),
        ({"compression": "gzip"}, "compression must be one of"),
        ({"frame_delta": "yes"}, "frame_delta must be True or False, got 'yes'"),
        ({"token": "  "}, "the token is empty (or only whitespace)"),
        ({"weight_precision": "half"}, "weight_precision must be 'exact' or 'float16'"),
        ({"policy_kwargs": {"n": 1}}, "policy_kwargs without a policy"),
    ],
)
def test_every_door_refuses_a_bad_value_with_the_learners_words(
    options: dict[str, Any], words: str
) -> None:
    kwargs = {"num_workers": 1, **options}
    for make in (lambda: Learner(URL, **kwargs), lambda: ClusterEnv(URL, **kwargs)):
        with pytest.raises(ConfigError) as raised:
            make()
        assert words in str(raised.value)


def test_a_bad_scheme_is_said_before_anything_else() -> None:
    with pytest.raises(ConfigError, match="nope"):
        LearnerConfig.build("nope://127.0.0.1:0", num_workers=0, compression="gzip")


def test_a_misspelt_option_is_the_callers_type_error() -> None:
    with pytest.raises(TypeError, match=r"^ClusterEnv.__init__\(\) got .* 'tokn'$"):
        ClusterEnv(URL, num_workers=1, tokn="x")  # type: ignore[call-arg]
    # local() sets the address, its token and the launcher itself.
    with pytest.raises(TypeError, match=r"^ClusterEnv.local\(\) got .* 'token'$"):
        ClusterEnv.local("CartPole-v1", num_workers=1, token="x")  # type: ignore[call-arg]


@pytest.mark.timeout(60)
def test_local_hands_its_options_to_the_learner() -> None:
    envs = ClusterEnv.local(
        "CartPole-v1",
        num_workers=2,
        transport="memory",
        reconnect_timeout=5.0,
        frame_delta=False,
        compression="none",
        seed=3,
    )
    try:
        config = envs._learner._pool.config
        assert (config.reconnect_timeout, config.frame_delta, config.compression) == (
            5.0,
            False,
            "none",
        )
        assert config.token is not None and config.launcher is not None  # local's own
        obs, _ = envs.reset()
        assert obs.shape == (2, 4)
    finally:
        envs.close()


# The learner hands the settings down; it writes none onto the pool afterwards.


def pool_writes(source: str) -> list[str]:
    """Each statement that sets an attribute of the learner's pool (``self._pool.x = ...``,
    ``+=``, an annotated one, or ``setattr``), also through a local name ``pool``."""

    def is_pool(node: ast.expr) -> bool:
        return ast.unparse(node) in ("self._pool", "pool")

    found = []
    for node in ast.walk(ast.parse(source)):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = [
                t for target in node.targets for t in ast.walk(target) if isinstance(t, ast.expr)
            ]
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and ast.unparse(node.func) == "setattr" and node.args:
            if is_pool(node.args[0]):
                found.append(ast.unparse(node))
        found += [
            ast.unparse(t) for t in targets if isinstance(t, ast.Attribute) and is_pool(t.value)
        ]
    return found


def test_the_learner_writes_no_pool_attribute() -> None:
    source = Path(learner_module.__file__).read_text()
    assert "self._pool = WorkerPool(" in source  # what the check looks beside
    assert pool_writes(source) == []


def test_the_write_check_can_fail() -> None:
    source = (
        "def f(self, pool):\n"
        "    self._pool.compression = 'zstd'\n"
        "    self._pool.hooks += [1]\n"
        "    pool.frame_delta: bool = False\n"
        "    a, pool.figures = 1, dict\n"
        "    setattr(self._pool, 'policy_kwargs', {})\n"
        "    self._pool.hooks.append(2)\n"  # a call on a member, not a write
        "    other.x = 1\n"
    )
    assert pool_writes(source) == [
        "self._pool.compression",
        "self._pool.hooks",
        "pool.frame_delta",
        "pool.figures",
        "setattr(self._pool, 'policy_kwargs', {})",
    ]
