"""What the pages say about aps's behaviour is what the code does.

Each test reads a claim from a page (or a ``--help`` text) and holds it against the code:
a documented number against the constant it names, a documented exit status against the
command's own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import aps
from aps.cli import _CHECK_HELP
from aps.errors import ConfigError
from aps.learner.rounds import REPORT_BACKLOG
from tests.conftest import FAST, WorkerTasks
from tests.test_cli_tools import aps_cli_async

ROOT = Path(__file__).resolve().parent.parent


def _page(name: str) -> str:
    """The page's text with its line breaks as spaces, so a claim may wrap."""
    return " ".join((ROOT / name).read_text().split())


def test_reliability_gives_the_report_backlog_the_learner_uses() -> None:
    claims = re.findall(
        r"at most (\d+) (?:messages )?per worker \(`REPORT_BACKLOG`", _page("docs/reliability.md")
    )
    assert claims, "docs/reliability.md no longer says how many reports the learner buffers"
    assert [int(claim) for claim in claims] == [REPORT_BACKLOG]


@pytest.mark.timeout(60)
async def test_check_exits_0_for_a_full_learner_that_refuses_another_worker(
    workers: WorkerTasks,
) -> None:
    """``aps check`` proves the token; it does not ask for a slot, so 0 is no promise of one."""
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=1, timeouts=FAST) as learner:
        workers.start(learner.url, num_envs=1)
        await learner.reset(seed=0)
        code, out, err = await aps_cli_async("check", learner.url)
        assert code == 0, err
        assert "workers:      1 of 1 connected, 1 envs\n" in out
        extra = workers.start(learner.url, num_envs=1, reconnect=False)
        with pytest.raises(ConfigError, match="already has its 1 workers"):
            await extra
    help_text = " ".join(_CHECK_HELP.split())
    assert "could join" not in help_text
    assert "Exits 0 when the learner took the token" in help_text


def test_every_test_the_envs_page_names_exists() -> None:
    # docs/envs.md holds each cell of its tables by naming a test: the name must be real.
    import ast

    page = (ROOT / "docs" / "envs.md").read_text()
    named = set(re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", page))
    assert len(named) >= 15, named
    missing = []
    for path, name in sorted(named):
        tree = ast.parse((ROOT / path).read_text())
        defined = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        }
        if name not in defined:
            missing.append(f"{path}::{name}")
    assert not missing, missing
