"""What the pages say about aps's behaviour is what the code does.

Each test reads a claim from a page (or a ``--help`` text) and holds it against the code:
a documented number against the constant it names, a documented exit status against the
command's own.
"""

from __future__ import annotations

import re
from pathlib import Path

from aps.learner.rounds import REPORT_BACKLOG

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
