"""The strict docs build fails when it should: a page left out of the nav aborts it.

It also renders what it should: the launcher functions ``aps.launch.local``, ``ray`` and
``slurm`` in the API reference (docs/_griffe_launchers.py).

The build runs on a copy of the site's sources in a temporary folder (``mkdocs.yml``, the
README, ``docs/``; ``aps``, ``examples`` and ``benchmarks`` linked), first as it is, which must
pass, then with one more page that no nav entry names, which must fail and name the page.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import aps
from aps.wire.messages import PROTOCOL_VERSION

ROOT = Path(__file__).resolve().parent.parent


def build(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml")],
        capture_output=True,
        text=True,
        cwd=root,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)},
        timeout=300,
        check=False,
    )


@pytest.fixture
def site_copy(tmp_path: Path) -> Path:
    pytest.importorskip("mkdocs", reason="the docs group is not installed: --group docs")
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy(ROOT / "mkdocs.yml", root)
    shutil.copy(ROOT / "README.md", root)
    shutil.copytree(ROOT / "docs", root / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    for linked in ("aps", "examples", "benchmarks"):
        (root / linked).symlink_to(ROOT / linked, target_is_directory=True)
    return root


@pytest.mark.timeout(600)
def test_an_orphan_page_fails_the_strict_build(site_copy: Path) -> None:
    clean = build(site_copy)
    assert clean.returncode == 0, clean.stderr[-4000:]
    # The launcher functions, which share their names with submodules, render an entry.
    launch = (site_copy / "site" / "api" / "launch" / "index.html").read_text()
    for name in ("local", "ray", "slurm"):
        assert f'id="aps.launch.{name}"' in launch, name
    # ClusterEnv.close, inherited from Gymnasium in name only, has an entry of its own.
    reference = (site_copy / "site" / "api" / "aps" / "index.html").read_text()
    assert 'id="aps.ClusterEnv.close"' in reference
    (site_copy / "docs" / "orphan.md").write_text("# Orphan\n\nNo nav entry names this page.\n")
    orphaned = build(site_copy)
    assert orphaned.returncode != 0
    assert "orphan.md" in orphaned.stderr and "nav" in orphaned.stderr


def test_make_docs_is_strict_and_not_quiet() -> None:
    makefile = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^docs:.*\n((?:\t.*\n)+)", makefile, re.MULTILINE)
    assert recipe is not None
    assert "mkdocs build --strict" in recipe.group(1)
    assert "--quiet" not in recipe.group(1) and " -q" not in recipe.group(1)
    assert "pipefail" in makefile  # the filter of INFO lines keeps mkdocs's exit status


def test_the_cli_page_shows_this_protocol_and_release() -> None:
    # The listing is what `aps check` prints; the numbers in it drift unless checked.
    page = (ROOT / "docs" / "cli.md").read_text()
    shown = re.findall(r"^learner: +\S+, protocol (\d+), aps (\S+)$", page, re.MULTILINE)
    assert shown, "docs/cli.md shows no `aps check` listing"
    for protocol, release in shown:
        assert int(protocol) == PROTOCOL_VERSION, (
            f"docs/cli.md shows protocol {protocol}; aps.wire.messages.PROTOCOL_VERSION is "
            f"{PROTOCOL_VERSION}: update the listing"
        )
        assert release == aps.__version__
