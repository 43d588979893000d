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


def namespaces(pid: int) -> list[str]:
    """The namespaces of the benchmark run whose process is ``pid`` (another run, a second
    test suite's, may hold its own at the same time)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listed.splitlines() if line.startswith(f"apsbench-{pid}-")]


@pytest.mark.timeout(170)
@pytest.mark.skipif(
    sys.platform != "linux" or os.geteuid() != 0 or load().skip_reason() is not None,
    reason="needs Linux, root, ip and tc",
)
def test_tiny_shaped_run_reports_and_removes_its_namespaces(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    out = tmp_path / "cluster.json"
    with subprocess.Popen(
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
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=160)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert proc.returncode == 0, stdout[-2000:] + stderr[-4000:]
    assert namespaces(proc.pid) == []
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
    # The with-block closes the pipe even when an assertion fails inside it.
    with subprocess.Popen(
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
    ) as proc:
        try:
            deadline = time.monotonic() + 60
            # switch, learner, 2 workers
            while len(namespaces(proc.pid)) < 4 and time.monotonic() < deadline:
                time.sleep(0.1)
            assert len(namespaces(proc.pid)) == 4
            proc.send_signal(signal.SIGTERM)
            output, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert "stopped by signal" in output
    assert namespaces(proc.pid) == []
    assert not (tmp_path / "cluster.json").exists()


def test_seeds_and_flags_are_parsed_and_checked() -> None:
    cluster = load()
    args = cluster.parse_args(["--seeds", "1,2,3,4,5", "--rates", "20mbit"])
    assert args.seeds == [1, 2, 3, 4, 5]
    assert args.rate_list == ["20mbit"]
    assert args.target == 195.0  # a fixed number, not always-sync's per-seed final
    assert cluster.parse_args([]).seeds == [1]  # --seed alone
    quick = cluster.parse_args(["--quick", "--seeds", "3,4"])
    assert quick.seeds == [3] and len(quick.rate_list) == 1
    assert quick.total_timesteps < cluster.parse_args([]).total_timesteps
    pong = cluster.parse_args(["--workload", "pong", "--compressions", "none,zstd"])
    assert pong.compression_list == ["none", "zstd"]
    assert pong.out.name == "cluster-pong.json"
    for bad in (["--seeds", "1,x"], ["--seeds", "1,1"], ["--compressions", "gzip"]):
        with pytest.raises(SystemExit):
            cluster.parse_args(bad)
    with pytest.raises(SystemExit):
        cluster.parse_args(["--rates", "20MB/s"])


def test_the_pong_detach_run_calls_the_example_with_flags_it_takes(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    cluster = load()
    spec = importlib.util.spec_from_file_location("ppo_atari", cluster.PIXEL_EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    args = cluster.parse_args(["--quick", "--workload", "pong", "--seeds", "7"])
    out = tmp_path / "run.json"
    for compression in (None, "zstd"):
        command = cluster.pixel_detach_command("tcp://10.0.0.1:7000", compression, args, out)
        assert command[1] == str(cluster.PIXEL_EXAMPLE)
        parsed = example.parse_args(command[2:])  # an unknown flag exits here
        assert (parsed.listen, parsed.mode, parsed.seed) == ("tcp://10.0.0.1:7000", "detach", 7)
        assert (parsed.workers, parsed.envs_per_worker) == (args.workers, args.envs_per_worker)
        assert parsed.total_timesteps == args.pixel_timesteps and parsed.json == str(out)
        assert parsed.compression == compression


def test_median_interval_counts_runs_that_never_reached() -> None:
    cluster = load()
    figures = cluster.median_interval([10.0, 20.0, None, 30.0, None])
    assert figures["n"] == 5 and figures["reached"] == 3
    # Order statistics of 10, 20, 30, inf, inf: the 80% quantile is a run that never got there.
    assert (figures["q20"], figures["median"], figures["q80"]) == (10.0, 30.0, None)
    none = cluster.median_interval([None, None])
    assert none["reached"] == 0 and none["median"] is None


def test_mean_interval_brackets_the_mean() -> None:
    cluster = load()
    figures = cluster.mean_interval([1.0, 2.0, 3.0, None])
    assert figures["n"] == 4 and figures["present"] == 3
    assert figures["mean"] == 2.0
    assert 1.0 <= figures["low"] < 2.0 < figures["high"] <= 3.0
    one = cluster.mean_interval([5.0])
    assert one["low"] == one["mean"] == one["high"] == 5.0
    assert cluster.mean_interval([None])["mean"] is None


def figures(returns: list[float], seconds: list[float], syncs: list[int]) -> dict[str, object]:
    """A DETACH run's figures as examples/ppo_cluster.py writes them, with this curve."""
    curve = [
        {"seconds": s, "mean_return": r, "syncs": n, "rollout_seconds": 0.1}
        for r, s, n in zip(returns, seconds, syncs, strict=True)
    ]
    return {
        "curve": curve,
        "final_return": returns[-1],
        "seconds": seconds[-1],
        "sps": 1000.0,
        "syncs": syncs[-1],
        "weight_bytes": syncs[-1] * 100,
        "bytes_per_version": 100,
        "lag_mean": 0.0,
        "lag_max": 0,
    }


def synthetic_report(cluster: ModuleType) -> dict[str, object]:
    args = cluster.parse_args(["--seeds", "1,2", "--rates", "20mbit", "--target", "100"])
    results = {
        "20mbit": {
            "always": {
                1: figures([50.0, 120.0, 150.0], [2.0, 4.0, 6.0], [2, 4, 6]),
                2: figures([40.0, 90.0, 110.0], [2.0, 4.0, 6.0], [2, 4, 6]),
            },
            "aps-0.05": {
                1: figures([80.0, 130.0], [1.0, 2.0], [1, 2]),
                2: figures([30.0, 60.0], [1.5, 3.0], [1, 1]),
            },
        }
    }
    rows = cluster.summarize(results, args)
    return {
        "benchmark": "cluster",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "command": "python benchmarks/cluster.py --seeds 1,2",
        "date": "synthetic",
        "rows": rows,
        "aggregate": cluster.aggregate(rows),
        "lockstep": [{"rate": "20mbit", "steps": 10, "step_ms_p50": 1.0, "step_ms_p95": 2.0}],
        "pixels": cluster.compression_costs(
            [
                {
                    "rate": "20mbit",
                    "mode": "lockstep",
                    "compression": c,
                    "env_steps": 1000,
                    "seconds": 1.0,
                    "sps": 1000.0,
                    "bytes_in_per_step": b,
                    "bytes_out_per_step": 10.0,
                    "learner_cpu_s": cpu,
                    "workers_cpu_s": w,
                }
                for c, b, cpu, w in (("none", 30_000.0, 1.0, 4.0), ("zstd", 6_000.0, 1.6, 7.0))
            ]
        ),
    }


def test_summary_uses_the_fixed_target_on_every_seed() -> None:
    cluster = load()
    report = synthetic_report(cluster)
    rows = {(r["strategy"], r["seed"]): r for r in report["rows"]}
    assert rows["always", 1]["seconds_to_target"] == 4.0
    assert rows["always", 2]["seconds_to_target"] == 6.0
    assert rows["aps-0.05", 1]["seconds_to_target"] == 2.0
    assert rows["aps-0.05", 2]["seconds_to_target"] is None  # never reached 100
    assert rows["aps-0.05", 1]["time_ratio_vs_always"] == 0.5
    # Equal wall time: the shortest run of the rate (2.0 s); each run's return by then.
    assert {r["equal_wall_s"] for r in rows.values()} == {2.0}
    assert rows["always", 1]["return_at_equal_wall"] == 50.0
    assert rows["aps-0.05", 1]["return_at_equal_wall"] == 130.0
    assert rows["aps-0.05", 2]["return_at_equal_wall"] == 30.0
    aggregate = {r["strategy"]: r for r in report["aggregate"]}
    assert aggregate["aps-0.05"]["seconds_to_target"]["reached"] == 1
    assert aggregate["always"]["seconds_to_target"]["reached"] == 2
    assert aggregate["aps-0.05"]["weight_bytes"]["mean"] == 150.0  # 200 and 100 bytes
    # Always reached on both seeds; aps-0.05 did on seed 1 at half always's time.
    ratio = aggregate["aps-0.05"]["time_ratio_vs_always"]
    assert (ratio["n"], ratio["reached"], ratio["q20"]) == (2, 1, 0.5)


def test_compression_costs_against_the_plain_run() -> None:
    cluster = load()
    pixels = {r["compression"]: r for r in synthetic_report(cluster)["pixels"]}
    zstd = pixels["zstd"]
    assert zstd["wire_ratio_in"] == pytest.approx(0.2)
    # 30 MB of frames as none carried them; 0.6 and 3.0 CPU seconds more than none.
    assert zstd["learner_cpu_per_mb"] == pytest.approx(0.6 / 30)
    assert zstd["workers_cpu_per_mb"] == pytest.approx(3.0 / 30)
    assert pixels["none"]["learner_cpu_per_mb"] == pytest.approx(0.0)


def test_pixel_rounds_compare_each_setting_with_none_in_the_same_round() -> None:
    cluster = load()

    def row(round_: int, compression: str, sps: float) -> dict[str, object]:
        return {"rate": "1gbit", "mode": "lockstep", "compression": compression,
                "sps": sps, "round": round_}  # fmt: skip

    rows = [row(0, "none", 100.0), row(0, "zstd", 90.0), row(1, "none", 50.0)]
    rows += [row(1, "zstd", 60.0), row(2, "none", 80.0), row(2, "zstd", 80.0)]
    summary = {r["compression"]: r for r in cluster.pixel_rounds(rows)}
    zstd = summary["zstd"]
    assert zstd["rounds"] == 3 and zstd["sps_median"] == 80.0
    # Per round 0.9, 1.2 and 1.0: the median ratio is not the ratio of the medians (80/80).
    assert (zstd["vs_none_min"], zstd["vs_none_median"], zstd["vs_none_max"]) == (0.9, 1.0, 1.2)
    assert summary["none"]["vs_none_median"] == 1.0
    # Costs pair a run with the plain run of its own round.
    with_cpu = [{**r, "env_steps": 100, "bytes_in_per_step": 10.0, "learner_cpu_s": 1.0,
                 "workers_cpu_s": float(r["round"])} for r in rows]  # fmt: skip
    costed = cluster.compression_costs(with_cpu)
    assert all(c["workers_cpu_per_mb"] == 0.0 for c in costed)


def test_results_page_from_synthetic_json(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # the page imports its siblings
    cluster = load()
    spec = importlib.util.spec_from_file_location(
        "results_page", ROOT / "benchmarks" / "results_page.py"
    )
    assert spec is not None and spec.loader is not None
    page = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(page)
    report = tmp_path / "cluster.json"
    report.write_text(json.dumps(synthetic_report(cluster)))
    e2e = tmp_path / "ppo_end_to_end.json"
    sample = {"sps": 100.0, "env_steps": 1024, "seconds": 10.24, "final_return": 20.0}
    e2e.write_text(
        json.dumps(
            {
                "benchmark": "ppo_end_to_end",
                "config": {
                    "env_id": "Hopper-v5",
                    "workers": 2,
                    "envs_per_worker": 8,
                    "total_timesteps": 1024,
                },
                "envs": {
                    "Hopper-v5": {
                        "samples": {
                            "gym-sync": [sample],
                            "aps-lockstep": [{**sample, "sps": 160.0}],
                        },
                        "medians": {"gym-sync": 100.0, "aps-lockstep": 160.0},
                    }
                },
            }
        )
    )
    out = tmp_path / "workloads.md"
    inputs = [str(report), str(e2e), str(tmp_path / "absent.json")]
    assert page.main(["--inputs", *inputs, "--out", str(out)]) == 0
    text = out.read_text()
    assert "target return 100" in text
    assert "| 20mbit | aps-0.05 | 2.0, 1/2 reached" not in text  # two seeds: an interval
    assert "1/2 reached" in text and "not reached" in text
    assert "| 20mbit | lockstep | zstd | 1,000 | 6,000 | 10 | 0.20 | 0.020 | 0.100 |" in text
    assert "| aps-lockstep | 160 | 1.60x | 20.0 |" in text
    assert "Not run yet: no `absent.json`." in text


def test_cpu_wrapper_logs_its_child_cpu_when_the_group_is_stopped(tmp_path: Path) -> None:
    cluster = load()
    log = tmp_path / "worker.log"
    busy = (
        "import time\n"
        "end = time.process_time() + 0.2\n"
        "while time.process_time() < end: pass\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)"
    )
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", cluster.CPU_WRAPPER, sys.executable, "-c", busy],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 30
        while "ready" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "ready" in log.read_text()
        cluster.stop(proc, grace=20)  # SIGTERM to the group, as the benchmark ends workers
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    cpu = cluster.logged_cpu(log)
    assert cpu is not None and cpu >= 0.2


def test_only_a_dead_runs_namespaces_are_stale() -> None:
    # Two runs on one machine (two suites at once) must not remove each other's namespaces.
    cluster = load()
    assert cluster.RUN == f"apsbench-{os.getpid()}-"
    assert not cluster.is_stale(f"{cluster.RUN}sw")  # this process: alive
    assert not cluster.is_stale("apsbench-1-sw")  # init: alive
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    assert cluster.is_stale(f"apsbench-{dead.pid}-l")
    assert cluster.is_stale("apsbench-sw")  # the earlier naming, which named no run
