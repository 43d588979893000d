"""MkDocs hooks: the README as the home page, and repository files outside docs/ in the site.

The pages link to files as they lie in the repository (``../examples/k8s/workers.yaml``,
``../benchmarks/README.md``), so the links work on a repository host too. The site mounts
``examples/`` and ``benchmarks/`` at the same paths and rewrites each relative link from the
page's place in the repository to its place in the site. A link to a file that does not exist
is left alone, so the strict build reports it.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
MOUNTED = ("examples", "benchmarks")
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)((?:#[^)\s]*)?\))")


def _site_path(repo_path: str) -> str:
    """Where a repository file lies in the site (relative to the site's root)."""
    if repo_path == "README.md":
        return "index.md"
    if repo_path.startswith("docs/"):
        return repo_path.removeprefix("docs/")
    return repo_path


def _repo_path(site_path: str) -> str:
    """Where a site page came from in the repository."""
    if site_path == "index.md":
        return "README.md"
    if site_path.split("/", 1)[0] in MOUNTED:
        return site_path
    return f"docs/{site_path}"


def on_files(files: Files, config: Any) -> Files:
    """Add the README as ``index.md`` and every file under the mounted folders."""
    files.append(File.generated(config, "index.md", abs_src_path=str(ROOT / "README.md")))
    for folder in MOUNTED:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                uri = path.relative_to(ROOT).as_posix()
                files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    """Rewrite relative links from the page's place in the repository to its place here."""
    site_dir = posixpath.dirname(page.file.src_uri)
    repo_dir = posixpath.dirname(_repo_path(page.file.src_uri))

    def rewrite(match: re.Match[str]) -> str:
        head, target, tail = match.groups()
        if "://" in target or target.startswith(("/", "mailto:")):
            return match.group(0)
        repo_target = posixpath.normpath(posixpath.join(repo_dir, target))
        if not (ROOT / repo_target).exists():
            return match.group(0)
        site_target = posixpath.relpath(_site_path(repo_target), site_dir or ".")
        return f"{head}{site_target}{tail}"

    return LINK.sub(rewrite, markdown)
