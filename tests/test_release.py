"""The release: the wheel holds the package alone, installs into a fresh venv and runs there.

``make test`` builds the sdist and wheel into ``dist/`` (and ``twine check``s them) before the
tests and names the folder in ``APS_DIST``; without it, this module builds the wheel itself.
The fresh venv installs the wheel and its dependencies from the package index, nothing from
this checkout: it has no access to this environment's packages (whose editable install of aps
would shadow the wheel's), and it runs from an empty directory with no ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
import zipfile
from email.parser import HeaderParser
from pathlib import Path

import pytest

import aps

ROOT = Path(__file__).resolve().parent.parent
DISTRIBUTION = "aps-rl"
WHEEL = f"aps_rl-{aps.__version__}-py3-none-any.whl"
# What pip says when it cannot reach the index at all (as opposed to any other failure).
UNREACHABLE = re.compile(
    r"NewConnectionError|Temporary failure in name resolution|Network is unreachable"
    r"|ConnectTimeoutError|Max retries exceeded|ProxyError|Name or service not known"
)


def clean_env() -> dict[str, str]:
    """This process's environment without anything that points Python at this checkout."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
    }
    env["PYTHONNOUSERSITE"] = "1"
    return env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of this checkout: the one ``make test`` built, or one built here."""
    if dist := os.environ.get("APS_DIST"):
        path = Path(dist) / WHEEL
        assert path.is_file(), f"APS_DIST={dist} holds no {WHEEL}: run `make dist`"
        return path
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode != 0 and UNREACHABLE.search(result.stdout + result.stderr):
        pytest.skip("the package index is unreachable: the build cannot fetch hatchling")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / WHEEL


def test_the_version_has_one_source() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == DISTRIBUTION
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["hatch"]["version"]["path"] == "aps/_version.py"


def test_the_wheel_holds_the_package_alone(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = HeaderParser().parsestr(
            archive.read(f"aps_rl-{aps.__version__}.dist-info/METADATA").decode()
        )
        entry_points = archive.read(f"aps_rl-{aps.__version__}.dist-info/entry_points.txt").decode()
    tops = {name.split("/", 1)[0] for name in names}
    assert tops == {"aps", f"aps_rl-{aps.__version__}.dist-info"}, tops
    assert "aps/py.typed" in names  # mypy users see the annotations
    assert "aps/__init__.py" in names and "aps/cli/__init__.py" in names
    assert metadata["Name"] == DISTRIBUTION and metadata["Version"] == aps.__version__
    # The license the metadata declares travels with the wheel, as MIT requires.
    assert metadata["License-Expression"] == "MIT" and metadata["License-File"] == "LICENSE"
    assert f"aps_rl-{aps.__version__}.dist-info/licenses/LICENSE" in names
    assert "aps = aps.cli:main" in entry_points


@pytest.mark.timeout(600)
def test_the_wheel_installs_and_runs_in_a_fresh_venv(wheel: Path, tmp_path: Path) -> None:
    venv, work = tmp_path / "venv", tmp_path / "work"
    work.mkdir()
    env = clean_env()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120, env=env)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", str(wheel)],
        capture_output=True,
        text=True,
        cwd=work,
        env=env,
        timeout=400,
        check=False,
    )
    if install.returncode != 0 and UNREACHABLE.search(install.stdout + install.stderr):
        pytest.skip(f"the package index is unreachable; pip said:\n{install.stderr[-1500:]}")
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]

    def run(*command: str | Path) -> str:
        result = subprocess.run(
            command, capture_output=True, text=True, cwd=work, env=env, timeout=120, check=False
        )
        assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}"
        return result.stdout

    assert run(venv / "bin" / "aps", "--version").strip() == f"aps {aps.__version__}"
    where = Path(run(python, "-c", "import aps; print(aps.__file__)").strip())
    assert where.is_relative_to(venv), f"aps came from {where}, not from the wheel"

    # The README's first snippet, as a new user runs it, then a check that it stepped.
    readme = (ROOT / "README.md").read_text()
    first = re.search(r"^```python\n(.*?)^```", readme, re.MULTILINE | re.DOTALL)
    assert first is not None and "aps.ClusterEnv" in first.group(1)
    script = first.group(1).replace("envs.close()", "assert obs.shape == (16, 4)\nenvs.close()")
    assert script != first.group(1)
    (work / "first.py").write_text(script)
    run(python, "first.py")
