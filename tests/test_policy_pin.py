"""The policy pin, attacked: every name of the traversal family runs nothing it should not.

A worker imports only what its operator named (``policy``) or allowed (``allow_policy``
patterns). The learner, holding the token, chooses the name; these tests choose it as an
attacker would: ``..`` segments, absolute paths after a module prefix, symlinks out of the
allowed directory, percent-escapes, Unicode look-alikes and ``*`` stretched across ``.``,
``/`` and ``:``. Each refused name would, if imported, leave a marker file: none may.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import aps
from aps._base._imports import PolicyPin, import_object

TOKEN = "a token of enough entropy for a test, 0123456789abcdef"


@dataclass(frozen=True)
class Tree:
    """A worker's file system: an allowed agents directory, a package, and code outside."""

    root: Path
    agents: Path
    marker: Path

    def ran(self) -> bool:
        return self.marker.exists()


@pytest.fixture
def tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Tree:
    marker = tmp_path / "outside code ran"
    evil = f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\nAgent = object\n"
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "good.py").write_text("def Agent(envs):\n    return None\n")
    (agents / "_private.py").write_text(evil)
    (agents / "__init__.py").write_text(evil)
    (tmp_path / "evil.py").write_text(evil)
    (agents / "link.py").symlink_to(tmp_path / "evil.py")  # a link out of the directory
    (tmp_path / "alias").symlink_to(agents, target_is_directory=True)  # the operator's link
    package = tmp_path / "site" / "mypkg"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "agents.py").write_text("def make_agent(envs):\n    return None\nos = 1\n")
    (package / "evil.py").write_text(evil)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.chdir(tmp_path)
    return Tree(tmp_path, agents, marker)


def _attempt(pin: PolicyPin, name: str) -> None:
    """What a worker does with the learner's name: check it, then import what it allows."""
    import_object(pin.check(name), what="policy")


# (patterns, the learner's name); {root} and {agents} are the tree's absolute directories.
REFUSED = [
    # `..` after the allowed directory, in every position a pattern can take.
    (["{agents}/*.py:Agent"], "{agents}/../evil.py:Agent"),
    (["{agents}/*.py:Agent"], "{agents}/../agents/../evil.py:Agent"),
    (["agents/*.py:Agent"], "agents/../evil.py:Agent"),
    (["agents/*.py:Agent"], "agents/./../evil.py:Agent"),
    (["{agents}/*.py:Agent"], "{agents}//../evil.py:Agent"),
    # An absolute path after a module prefix (the attack of issue 29), and its variants.
    (["mypkg.agents:*"], "mypkg.agents:{root}/evil.py:Agent"),
    (["mypkg.agents:*"], "mypkg.agents:/../../../../{root}/evil.py:Agent"),
    (["mypkg.*:*"], "mypkg.agents:/{root}/evil.py:Agent"),
    (["mypkg.agents:*"], "{root}/evil.py:Agent"),
    # A relative pattern does not allow the absolute path elsewhere, nor the reverse.
    (["agents/*.py:Agent"], "{root}/evil.py:Agent"),
    (["{agents}/*.py:Agent"], "evil.py:Agent"),
    # `*` never crosses `.`, `/` or `:`.
    (["mypkg.*:make_agent"], "mypkg.agents.evil:make_agent"),
    (["mypkg.*:*"], "mypkg.evil.x:Agent"),
    (["mypkg.agents:*"], "mypkg.agents:os.system"),
    (["{root}/*.py:Agent"], "{root}/agents/link.py:Agent"),
    (["{agents}/*.py:Agent"], "{agents}/good.x.py:Agent"),
    (["agents/*.py:Agent"], "agents/x/../../evil.py:Agent"),
    (["*:Agent"], "mypkg.evil:Agent"),
    # A symlink the learner's part of the name goes through must not lead out.
    (["{agents}/*.py:Agent"], "{agents}/link.py:Agent"),
    (["alias/*.py:Agent"], "alias/link.py:Agent"),
    # Percent-escapes are never decoded, and refused outright.
    (["{agents}/*.py:Agent"], "{agents}/%2e%2e/evil.py:Agent"),
    (["{agents}/*.py:Agent"], "{agents}/%2E%2E%2Fevil.py:Agent"),
    (["mypkg.*:make_agent"], "mypkg.%65vil:make_agent"),
    # Unicode look-alikes: fullwidth letters and dots, a one-dot leader, a Cyrillic a.
    (["mypkg.*:make_agent"], "mypkg.\uff45vil:make_agent"),
    (["mypkg.agents:*"], "mypkg\uff0eagents:make_agent"),
    (["{agents}/*.py:Agent"], "{agents}/\u2024\u2024/evil.py:Agent"),
    (["mypkg.agents:*"], "mypkg.\u0430gents:make_agent"),
    (["{agents}/*.py:Agent"], "{agents}/good.py:\u0410gent"),
    # Private modules, files and attributes are never what a `*` stands for.
    (["{agents}/*.py:Agent"], "{agents}/_private.py:Agent"),
    (["{agents}/*.py:Agent"], "{agents}/__init__.py:Agent"),
    (["mypkg.agents:*"], "mypkg.agents:__loader__"),
    (["mypkg.*:*"], "mypkg.__init__:Agent"),
    # Backslashes, NUL, spaces and a second colon are no part of an import path here.
    (["{agents}/*.py:Agent"], "{agents}/..\\evil.py:Agent"),
    (["{agents}/*.py:Agent"], "{agents}/good.py\x00/../../evil.py:Agent"),
    (["{agents}/*.py:Agent"], "{agents}/ /../evil.py:Agent"),
    (["{agents}/*.py:*"], "{agents}/good.py:Agent:x"),
    # Nothing allowed at all.
    ([], "mypkg.agents:make_agent"),
]


@pytest.mark.parametrize(("patterns", "name"), REFUSED)
def test_the_traversal_family_runs_nothing(tree: Tree, patterns: list[str], name: str) -> None:
    fill = {"root": str(tree.root), "agents": str(tree.agents)}
    pin = PolicyPin(None, [p.format(**fill) for p in patterns])
    with pytest.raises(aps.ConfigError, match="not allowed to run") as refused:
        _attempt(pin, name.format(**fill))
    assert "--allow-policy" in str(refused.value)  # the fix is named
    assert not tree.ran()
    assert "mypkg.evil" not in sys.modules


ALLOWED = [
    # (pattern, name, the file or module that must be imported)
    ("{agents}/*.py:Agent", "{agents}/good.py:Agent", "{agents}/good.py"),
    ("{agents}/good.py:*", "{agents}/good.py:Agent", "{agents}/good.py"),
    ("agents/*.py:Agent", "agents/good.py:Agent", "{agents}/good.py"),
    ("alias/*.py:Agent", "alias/good.py:Agent", "{agents}/good.py"),  # the operator's link
    ("{root}/*/good.py:Agent", "{root}/agents/good.py:Agent", "{agents}/good.py"),
    ("mypkg.agents:*", "mypkg.agents:make_agent", "mypkg.agents"),
    ("mypkg.*:make_*", "mypkg.agents:make_agent", "mypkg.agents"),
]


@pytest.mark.parametrize(("pattern", "name", "imported"), ALLOWED)
def test_a_legitimate_match_imports_what_the_pattern_names(
    tree: Tree, pattern: str, name: str, imported: str
) -> None:
    fill = {"root": str(tree.root), "agents": str(tree.agents)}
    pin = PolicyPin(None, [pattern.format(**fill)])
    path = pin.check(name.format(**fill))
    location = path.partition(":")[0]
    if imported.endswith(".py"):
        assert location == str(Path(imported.format(**fill)).resolve())  # the checked file
    else:
        assert location == imported
    assert callable(import_object(path, what="policy"))
    assert not tree.ran()


def test_the_operators_own_policy_is_taken_as_written(tree: Tree) -> None:
    # The operator may write any path (`..` included): it is theirs, not the learner's.
    mine = "agents/../agents/good.py:Agent"
    pin = PolicyPin(mine, [])
    assert pin.check(mine) == mine
    with pytest.raises(aps.ConfigError, match="not allowed to run"):
        pin.check("agents/../evil.py:Agent")


@pytest.mark.parametrize(
    "pattern",
    [
        "mypkg.agents",  # no attribute
        "mypkg:agents:*",  # two colons
        "agents/../*.py:Agent",  # `..` in the operator's pattern is refused too
        "./agents/*.py:Agent",
        "agents//*.py:Agent",
        "%2e%2e/*.py:Agent",
        "mypkg.\uff41gents:*",  # outside ASCII: could never match a name
        "mypkg.agents:Agent()",
        "mypkg/agents:*",  # a path that is no .py file
    ],
)
def test_a_malformed_pattern_is_refused_when_the_worker_starts(pattern: str) -> None:
    with pytest.raises(aps.ConfigError, match="allow_policy pattern"):
        aps.Worker("tcp://127.0.0.1:1", "CartPole-v1", allow_policy=[pattern])


async def test_a_learner_naming_a_path_out_of_the_pattern_runs_nothing(tree: Tree) -> None:
    # End to end: a learner holding the token names `..` out of the allowed directory.
    timeouts = aps.Timeouts(connect=10, handshake=5, step=60)
    allowed = [f"{tree.agents}/*.py:Agent"]
    name = f"{tree.agents}/../evil.py:Agent"
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=1, token=TOKEN, policy=name, timeouts=timeouts
    ) as learner:
        worker = aps.Worker(
            learner.url, "CartPole-v1", token=TOKEN, timeouts=timeouts, allow_policy=allowed
        )
        with pytest.raises(aps.ConfigError, match=r"not allowed to run.*'\.\.' segment"):
            await asyncio.wait_for(worker.run(), 30)
    assert not tree.ran()
