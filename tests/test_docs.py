"""Every code block in the docs that is meant to run is run, so no recipe rots.

The pages are the README, ``docs/**/*.md`` and ``benchmarks/README.md``. A fenced
```` ```python ```` or ```` ```sh ```` block runs, unless the line before it is one of:

- ``<!-- not run: REASON -->``: the block is shown, not run (it needs a cluster, say);
- ``<!-- file: PATH -->``: the block (any language) is the content of ``PATH``, written for the
  blocks after it;
- ``<!-- needs: COMMAND ... -->``: the block runs, unless one of the commands is missing here
  (``slurmd``, say), which skips it and the rest of the page.

Each page runs in a fresh directory and a fresh virtual environment layered on this one, so a
page's ``pip install`` stays in it; its blocks run in order, each in its own process, and see
the files the blocks before them wrote. Python blocks run as ``python block.py``, shell blocks
with ``bash -euo pipefail``; ``python``, ``pip`` and ``aps`` are the layered environment's.
Blocks of other languages (toml, yaml, output listings) are not run.

Pages name fixed ports in the 47000s (``tcp://127.0.0.1:47000``) so that a reader can follow
them; each run of a page gets free ports in their place, the same one for the same port
throughout the page, so two runs of the suite on one machine never contend for a port.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *(ROOT / "docs").rglob("*.md")]
)
RUN = ("python", "sh")
MARK = re.compile(r"^<!-- (not run|file|needs): (.+?) -->$")
FENCE = re.compile(r"^(`{3,})(\S*)")
BLOCK_TIMEOUT = 300.0
EXAMPLE_PORT = re.compile(r"(?<=127\.0\.0\.1:)47\d{3}\b")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    code: str
    mark: str | None  # "not run", "file" or "needs"
    argument: str | None  # the reason, the path or the commands

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The page's fenced blocks, each with the mark on the line before it, if any."""
    found: list[Block] = []
    lines = page.read_text().splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index].lstrip())
        if opening is None:
            index += 1
            continue
        indent = len(lines[index]) - len(lines[index].lstrip())
        fence, language = opening.groups()
        end = index + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        assert end < len(lines), f"{page.relative_to(ROOT)}:{index + 1}: unclosed code block"
        code = "\n".join(line[indent:] for line in lines[index + 1 : end]) + "\n"
        mark = MARK.match(lines[index - 1].strip()) if index else None
        found.append(
            Block(
                page,
                index + 1,
                language,
                code,
                mark.group(1) if mark else None,
                mark.group(2) if mark else None,
            )
        )
        index = end + 1
    return found


def layered_venv(directory: Path) -> Path:
    """A virtual environment that sees this one's packages and installs into its own."""
    venv = directory / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "_aps_docs_parent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = venv / "bin" / "pip"
    pip.write_text(f'#!/bin/sh\nexec "{python}" -m pip "$@"\n')
    pip.chmod(0o755)
    aps = venv / "bin" / "aps"
    aps.write_text(f'#!/bin/sh\nexec "{python}" -m aps "$@"\n')
    aps.chmod(0o755)
    return venv


def run_block(block: Block, cwd: Path, env: dict[str, str]) -> None:
    if block.language == "python":
        script = cwd / f"block_{block.line}.py"
        script.write_text(block.code)
        command = [str(Path(env["VIRTUAL_ENV"]) / "bin" / "python"), script.name]
    else:
        command = ["bash", "-euo", "pipefail", "-c", block.code]
    process = subprocess.Popen(
        command,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends all it started
    )
    try:
        output, _ = process.communicate(timeout=BLOCK_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"{block} did not finish within {BLOCK_TIMEOUT} s:\n{output[-4000:]}")
    finally:
        # Anything the block left running in the background ends with it.
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert process.returncode == 0, (
        f"{block} ({block.language}) exited with {process.returncode}:\n"
        f"{textwrap.indent(block.code, '    ')}\noutput:\n{output[-4000:]}"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def with_free_ports(blocks: list[Block]) -> list[Block]:
    """``blocks`` with each example port (:data:`EXAMPLE_PORT`) replaced by a free one, the
    same port for the same number in every block."""
    ports: dict[str, str] = {}

    def swap(match: re.Match[str]) -> str:
        return ports.setdefault(match[0], str(free_port()))

    return [replace(block, code=EXAMPLE_PORT.sub(swap, block.code)) for block in blocks]


def test_example_ports_are_replaced_consistently() -> None:
    code = "dial tcp://127.0.0.1:47000 then 127.0.0.1:47001 and 127.0.0.1:47000; keep :7000"
    (block,) = with_free_ports([Block(ROOT / "README.md", 1, "sh", code, None, None)])
    first, second, again = re.findall(r"127\.0\.0\.1:(\d+)", block.code)
    assert first == again != second and "47000" not in block.code
    assert block.code.endswith("keep :7000")


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_page_runs(page: Path, tmp_path: Path) -> None:
    runnable = [b for b in blocks(page) if b.mark == "file" or (b.language in RUN and not b.mark)]
    runnable += [b for b in blocks(page) if b.mark == "needs" and b.language in RUN]
    runnable.sort(key=lambda block: block.line)
    if not runnable:
        pytest.skip("no block to run on this page")
    runnable = with_free_ports(runnable)
    venv = layered_venv(tmp_path)
    env = {
        **os.environ,
        "VIRTUAL_ENV": str(venv),
        "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": str(ROOT),  # the aps of this checkout
        # Installs come from what is here, never from an index.
        "PIP_NO_INDEX": "1",
        "PIP_NO_BUILD_ISOLATION": "0",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    work = tmp_path / "work"
    work.mkdir()
    for block in runnable:
        if block.mark == "file":
            assert block.argument is not None
            path = work / block.argument
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.code)
            continue
        if block.mark == "needs":
            assert block.argument is not None
            search = os.pathsep.join([env["PATH"], "/usr/sbin", "/sbin"])
            missing = [c for c in block.argument.split() if not shutil.which(c, path=search)]
            if missing:
                pytest.skip(f"{block} needs {', '.join(missing)}, which this machine lacks")
        run_block(block, work, env)


def test_every_block_is_run_or_says_why_not() -> None:
    problems = []
    for page in PAGES:
        for block in blocks(page):
            if block.mark in ("not run", "needs") and block.language not in RUN:
                problems.append(f"{block}: {block.mark!r} on a {block.language or 'plain'} block")
            if block.mark == "file" and Path(block.argument or "/").is_absolute():
                problems.append(f"{block}: file marks name relative paths")
            if block.language in ("bash", "shell", "console", "py", "python3"):
                problems.append(f"{block}: write ```sh or ```python, which the docs test runs")
    assert not problems, "\n".join(problems)


def test_blocks_are_found_with_their_marks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- not run: needs a cluster -->\n```sh\nsbatch x\n```\n\n"
        "<!-- file: pkg/a.py -->\n```python\nX = 1\n```\n\n- item:\n\n  ```python\n"
        "  import pkg.a\n  ```\n"
    )
    found = blocks(page)
    assert [(b.language, b.mark, b.argument) for b in found] == [
        ("sh", "not run", "needs a cluster"),
        ("python", "file", "pkg/a.py"),
        ("python", None, None),
    ]
    assert found[2].code == "import pkg.a\n"  # the list item's indent is removed
