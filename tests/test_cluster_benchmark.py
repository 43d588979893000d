"""benchmarks/cluster.py: refuses hosts it cannot shape, and leaves no namespace behind."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "cluster.py"


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("cluster_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rates_are_tc_rates() -> None:
    cluster = load()
    assert cluster.rate_bits("20mbit") == 20e6
    assert cluster.rate_bits("1gbit") == 1e9
    with pytest.raises(ValueError, match="must end in bit, kbit, mbit or gbit"):
        cluster.rate_bits("20MB/s")


def test_skips_without_root(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = load()
    monkeypatch.setattr(cluster.platform, "system", lambda: "Linux")
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 1000)
    assert "needs root" in cluster.skip_reason()
    monkeypatch.setattr(cluster.platform, "system", lambda: "Darwin")
    assert "needs Linux network namespaces" in cluster.skip_reason()


def namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith("apsbench-")]


@pytest.mark.timeout(170)
@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or load().skip_reason() is not None,
    reason="needs Linux, root, ip and tc",
)
def test_tiny_shaped_run_reports_and_removes_its_namespaces(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "cluster.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--rates",
            "50mbit",
            "--strategies",
            "always,aps-0.05",
            "--hidden-size",
            "32",
            "--num-steps",
            "16",
            "--envs-per-worker",
            "2",
            "--total-timesteps",
            "256",
            "--lockstep-steps",
            "20",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=160,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert namespaces() == []
    report = json.loads(out.read_text())
    rows = {row["strategy"]: row for row in report["rows"]}
    assert set(rows) == {"always", "aps-0.05"}
    for row in rows.values():
        assert row["rate"] == "50mbit"
        assert row["weight_bytes"] == row["syncs"] * row["bytes_per_version"]
    assert rows["always"]["syncs"] == 4 * 2  # 256 steps / (16 steps x 4 envs): 4 versions
    assert report["lockstep"][0]["steps"] == 10  # 20 steps, the first 10 dropped as warm-up


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or load().skip_reason() is not None,
    reason="needs Linux, root, ip and tc",
)
def test_sigterm_removes_the_namespaces(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            str(SCRIPT),
            "--rates",
            "50mbit",
            "--hidden-size",
            "32",
            "--lockstep-steps",
            "100000",
            "--out",
            str(tmp_path / "cluster.json"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while len(namespaces()) < 4 and time.monotonic() < deadline:  # switch, learner, 2 workers
            time.sleep(0.1)
        assert len(namespaces()) == 4
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "stopped by signal" in output
    assert namespaces() == []
    assert not (tmp_path / "cluster.json").exists()
