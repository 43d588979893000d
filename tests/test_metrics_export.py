"""Exporting a learner's figures: CSV, JSON lines, TensorBoard, and the Prometheus endpoint.

Every file is read back with its real reader (``csv``, ``json``, TensorBoard's
``EventAccumulator``, ``prometheus_client``'s parsers) and checked against figures built here
with known numbers, or against a real learner's ``metrics``.
"""

from __future__ import annotations

import asyncio
import collections
import csv
import json
import logging
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import gymnasium as gym
import pytest

import aps
from aps.errors import ConfigError, InvalidState, MissingDependency, Timeout
from aps.metrics import (
    CSVWriter,
    JSONLinesWriter,
    Metrics,
    MetricsLogger,
    PrometheusCollector,
    TensorBoardWriter,
    WorkerMetrics,
    prometheus as prometheus_module,
    serve_prometheus,
    window_rates,
)
from tests.conftest import FAST, WorkerTasks

prometheus_parser = pytest.importorskip("prometheus_client.parser")
openmetrics_parser = pytest.importorskip("prometheus_client.openmetrics.parser")

POLICY = f"{Path(__file__).with_name('agents.py')}:Agent"


def worker(worker_id: int, scale: int, *, rtt: float | None = None) -> WorkerMetrics:
    """A worker's figures, each a known multiple of ``scale`` (and of its id)."""
    figures = WorkerMetrics(
        worker_id=worker_id,
        version=scale,
        syncs=2 * scale,
        weight_bytes=1000 * scale,
        divergences=collections.deque([0.01 * scale, 0.02 * scale]),
        transitions=64 * scale,
        lag_sum=16 * scale,
        lag_max=2,
        chunks=scale,
        env_steps=100 * scale * (worker_id + 1),
        answers=10 * scale,
        env_seconds=0.5 * scale,
        inference_seconds=0.25 * scale,
        encode_seconds=0.125 * scale,
        bytes_received=4000 * scale * (worker_id + 1),
        bytes_received_raw=8000 * scale,
        bytes_sent=500 * scale,
        bytes_sent_raw=600 * scale,
        decode_seconds=0.0625 * scale,
        stalled=worker_id == 1,
        stalls=worker_id,
    )
    figures.rtt = rtt
    return figures


def snapshot(seconds: float, scale: int, ids: tuple[int, ...] = (0, 1)) -> Metrics:
    """A learner's figures ``seconds`` after it started, its workers at ``scale``."""
    return Metrics(
        version=scale,
        workers=tuple(worker(i, scale, rtt=0.003 if i == 0 else None) for i in ids),
        taken_at=1000.0 + seconds,
        uptime=seconds,
        cpu_seconds=0.5 * seconds,
        lockstep_calls=7 * scale,
        lockstep_wait_seconds=0.75 * scale,
        queue_depth=scale,
    )


# Two snapshots 2 s apart: env-steps 300 -> 600 (workers 0 and 1 at 100 and 200 per scale).
FIRST, SECOND = snapshot(10.0, 1), snapshot(12.0, 2)


def test_window_rates_are_the_figures_between_two_snapshots() -> None:
    window = window_rates(SECOND, FIRST)
    assert window == {
        "seconds": 2.0,
        "env_steps_per_second": (600 - 300) / 2,
        "bytes_received_per_second": (24000 - 12000) / 2,
        "bytes_sent_per_second": (2000 - 1000) / 2,
        "cpu_seconds_per_second": 0.5,
    }
    # The first window is the whole run.
    assert window_rates(FIRST, None)["env_steps_per_second"] == 300 / 10


def test_csv_rows_hold_every_figure_and_the_window(tmp_path: Path) -> None:
    path = tmp_path / "figures.csv"
    with CSVWriter(path) as writer:
        writer.write(FIRST)
        writer.write(SECOND)
    with path.open(newline="") as file:
        rows = list(csv.DictReader(file))
    assert len(rows) == 2
    for row, metrics in zip(rows, (FIRST, SECOND), strict=True):
        for name, value in metrics.scalars().items():
            assert float(row[name]) == value, name
        assert float(row["time"]) > 0
        assert row["worker/1/rtt"] == ""  # not measured: an empty cell, not a made-up 0
    assert float(rows[0]["window/env_steps_per_second"]) == 30.0
    assert float(rows[1]["window/env_steps_per_second"]) == 150.0
    assert float(rows[1]["window/seconds"]) == 2.0
    assert float(rows[1]["worker/0/rtt"]) == 0.003
    assert float(rows[1]["worker/1/env_steps"]) == 400


def test_a_worker_that_joins_later_adds_columns_to_every_row(tmp_path: Path) -> None:
    path = tmp_path / "figures.csv"
    third = snapshot(14.0, 3, ids=(0, 1, 2))
    with CSVWriter(path) as writer:
        writer.write(FIRST)
        writer.write(SECOND)
        writer.write(third)
        writer.write(snapshot(16.0, 4, ids=(0, 1, 2)))
    with path.open(newline="") as file:
        reader = csv.reader(file)
        header = next(reader)
        rows = list(reader)
    assert len(rows) == 4 and all(len(row) == len(header) for row in rows)
    assert len(set(header)) == len(header)
    table = [dict(zip(header, row, strict=True)) for row in rows]
    assert table[0]["worker/2/env_steps"] == table[1]["worker/2/env_steps"] == ""
    assert float(table[2]["worker/2/env_steps"]) == 100 * 3 * 3
    assert float(table[3]["worker/2/env_steps"]) == 100 * 4 * 3
    # The earlier rows kept their values through the rewrite.
    assert float(table[0]["env_steps"]) == 300 and float(table[1]["env_steps"]) == 600
    assert float(table[2]["window/env_steps_per_second"]) == (1800 - 600) / 2
    assert not path.with_name(path.name + ".new").exists()


def test_json_lines_hold_the_figures_and_the_window(tmp_path: Path) -> None:
    path = tmp_path / "figures.jsonl"
    with JSONLinesWriter(path) as writer:
        writer.write(FIRST)
        writer.write(SECOND)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == 2
    for line, metrics in zip(lines, (FIRST, SECOND), strict=True):
        expected = json.loads(json.dumps(metrics.as_dict()))
        assert {key: line[key] for key in expected} == expected
    assert lines[1]["window"] == window_rates(SECOND, FIRST)
    assert lines[0]["window"] == window_rates(FIRST, None)
    assert lines[1]["workers"][1]["rtt"] is None
    assert lines[1]["env_steps"] == 600


def test_tensorboard_scalars_are_the_figures_at_their_env_steps(tmp_path: Path) -> None:
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    with TensorBoardWriter(tmp_path / "run") as writer:
        writer.write(FIRST)
        writer.write(SECOND)
    events = accumulator.EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {f"aps/{name}" for name in SECOND.scalars()} <= tags
    for tag, expected in (
        ("aps/env_steps", [300.0, 600.0]),
        ("aps/worker/1/bytes_received", [8000.0, 16000.0]),
        ("aps/lockstep_wait_seconds", [0.75, 1.5]),
        ("aps/window/env_steps_per_second", [30.0, 150.0]),
        ("aps/window/seconds", [10.0, 2.0]),
    ):
        points = events.Scalars(tag)
        assert [p.step for p in points] == [300, 600], tag
        assert [p.value for p in points] == pytest.approx(expected), tag
    assert "aps/worker/1/rtt" not in tags  # never measured: never written


def test_tensorboard_without_either_package_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A None entry in sys.modules makes the import fail as a missing package does.
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    with pytest.raises(MissingDependency, match=r"pip install 'aps-rl\[metrics\]'"):
        TensorBoardWriter(tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_closed_writer_refuses_to_write(tmp_path: Path) -> None:
    writer = JSONLinesWriter(tmp_path / "figures.jsonl")
    writer.close()
    writer.close()  # idempotent
    with pytest.raises(InvalidState, match="JSONLinesWriter is closed"):
        writer.write(FIRST)


class Collected:
    """A writer that keeps what it was given."""

    def __init__(self) -> None:
        self.written: list[Metrics] = []
        self.closed = False

    def write(self, metrics: Metrics) -> None:
        self.written.append(metrics)

    def close(self) -> None:
        self.closed = True


def test_the_logger_writes_once_per_interval_and_at_the_end() -> None:
    now = [0.0]
    taken = iter([FIRST, SECOND, snapshot(14.0, 3), snapshot(16.0, 4)])
    sink = Collected()
    logger = MetricsLogger(lambda: next(taken), [sink], interval=10.0, clock=lambda: now[0])
    wrote = []
    for moment in (0.0, 4.0, 9.9, 10.0, 15.0, 20.5):
        now[0] = moment
        wrote.append(logger.tick())
    assert wrote == [True, False, False, True, False, True]
    with logger:
        pass  # leaving writes the last snapshot and closes the writers
    assert [m.version for m in sink.written] == [1, 2, 3, 4]
    assert sink.closed
    with pytest.raises(InvalidState, match="MetricsLogger is closed"):
        logger.write()


def test_the_logger_checks_its_arguments() -> None:
    with pytest.raises(ConfigError, match=r"interval must be a number of seconds >= 0, got -1"):
        MetricsLogger(lambda: FIRST, [], interval=-1)
    with pytest.raises(ConfigError, match="got 'learner'"):
        MetricsLogger("learner", [])  # type: ignore[arg-type]


@pytest.mark.timeout(60)
async def test_a_real_learners_figures_written_match_its_metrics(
    tmp_path: Path, workers: WorkerTasks
) -> None:
    pytest.importorskip("torch")
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    from tests.agents import Agent

    learner = aps.Learner("memory://", num_workers=1, policy=POLICY, timeouts=FAST)
    async with learner:
        await learner.start()
        workers.start(learner.url, num_envs=2)
        await learner.reset(seed=0)
        env = gym.make("CartPole-v1")
        agent = Agent(type("Spaces", (), {
            "single_observation_space": env.observation_space,
            "single_action_space": env.action_space,
        }))  # fmt: skip
        writers = [
            CSVWriter(tmp_path / "figures.csv"),
            JSONLinesWriter(tmp_path / "figures.jsonl"),
            TensorBoardWriter(tmp_path / "run"),
        ]
        with MetricsLogger(learner, writers, interval=3600.0) as logger:
            for _ in range(3):
                await learner.publish(agent)
                await learner.rollout(8)
                logger.write()
            expected = learner.metrics
        # Closing wrote a last snapshot: nothing moved since the third, so it equals it.
    assert (expected.version, expected.transitions) == (3, 3 * 8 * 2)
    assert expected.syncs >= 3
    with (tmp_path / "figures.csv").open(newline="") as file:
        last = list(csv.DictReader(file))[-1]
    assert float(last["version"]) == expected.version
    assert float(last["syncs"]) == expected.syncs
    assert float(last["transitions"]) == expected.transitions
    assert float(last["worker/0/transitions"]) == expected.workers[0].transitions
    line = json.loads((tmp_path / "figures.jsonl").read_text().splitlines()[-1])
    assert (line["version"], line["syncs"], line["transitions"]) == (
        expected.version,
        expected.syncs,
        expected.transitions,
    )
    events = accumulator.EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0})
    events.Reload()
    assert events.Scalars("aps/version")[-1].value == expected.version
    assert events.Scalars("aps/syncs")[-1].value == expected.syncs
    assert [p.value for p in events.Scalars("aps/transitions")] == [16, 32, 48, 48]


# The Prometheus endpoint.


class Answer(NamedTuple):
    status: int
    content_type: str
    text: str


def scrape(url: str, accept: str | None = None) -> Answer:
    """GET ``url`` (a 5 s deadline), whatever the status."""
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as answer:
            return Answer(answer.status, answer.headers["Content-Type"], answer.read().decode())
    except urllib.error.HTTPError as error:
        with error:
            return Answer(error.code, error.headers["Content-Type"], error.read().decode())


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a text exposition: (name, sorted labels) -> value."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_endpoint_serves_the_figures_with_their_names_types_and_labels() -> None:
    with serve_prometheus(lambda: SECOND) as server:
        assert server.host == "127.0.0.1"
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"
        status, content_type, text = scrape(server.url)
    assert status == 200 and content_type.startswith("text/plain")
    found = samples(text)
    families = {f.name: f.type for f in prometheus_parser.text_string_to_metric_families(text)}
    # Counters are exposed with _total; the parser names their family without it.
    exposed = {name + ("_total" if kind == "counter" else "") for name, kind in families.items()}
    assert exposed == set(prometheus_module.metric_names())
    assert families["aps_env_steps"] == "counter"
    assert families["aps_queue_depth"] == "gauge"
    assert families["aps_worker_policy_lag"] == "summary"
    assert found[("aps_env_steps_total", ())] == 600
    assert found[("aps_bytes_received_total", ())] == 24000
    assert found[("aps_lockstep_wait_seconds_total", ())] == 1.5
    assert found[("aps_policy_version", ())] == 2
    assert found[("aps_workers_stalled", ())] == 1
    assert found[("aps_uptime_seconds", ())] == 12.0
    one = (("worker", "1"),)
    assert found[("aps_worker_env_steps_total", one)] == 400
    assert found[("aps_worker_bytes_received_total", one)] == 16000
    assert found[("aps_worker_stalled", one)] == 1
    assert found[("aps_worker_stalled", (("worker", "0"),))] == 0
    assert found[("aps_worker_divergence", one)] == pytest.approx(0.04)
    assert found[("aps_worker_policy_lag_sum", one)] == 32
    assert found[("aps_worker_policy_lag_count", one)] == 128
    assert found[("aps_worker_rtt_seconds", (("worker", "0"),))] == 0.003
    assert ("aps_worker_rtt_seconds", one) not in found  # not measured: no sample


def test_the_collector_serves_a_registry_of_ones_own() -> None:
    registry_module = pytest.importorskip("prometheus_client.registry")
    from prometheus_client.exposition import generate_latest

    registry = registry_module.CollectorRegistry(auto_describe=True)
    taken = iter([FIRST, SECOND])
    registry.register(PrometheusCollector(lambda: next(taken)))  # describing takes one
    found = samples(generate_latest(registry).decode())
    assert found[("aps_env_steps_total", ())] == 600
    assert found[("aps_worker_chunks_total", (("worker", "1"),))] == 2


def test_every_metric_name_is_documented_in_the_module() -> None:
    doc = prometheus_module.__doc__ or ""
    documented = {word.strip("`") for word in doc.split() if word.startswith("``aps_")}
    assert documented == set(prometheus_module.metric_names())


def test_the_endpoint_answers_openmetrics_when_asked() -> None:
    with serve_prometheus(lambda: FIRST) as server:
        _, content_type, text = scrape(server.url, accept="application/openmetrics-text")
    assert content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in openmetrics_parser.text_string_to_metric_families(text)}
    assert families["aps_env_steps"].samples[0].value == 300


def test_each_scrape_takes_a_fresh_snapshot_and_other_paths_are_not_found() -> None:
    taken = iter([FIRST, SECOND])
    with serve_prometheus(lambda: next(taken)) as server:
        first = samples(scrape(server.url).text)[("aps_env_steps_total", ())]
        second = samples(scrape(server.url).text)[("aps_env_steps_total", ())]
        missing = scrape(server.url.removesuffix("metrics") + "other")
    assert (first, second) == (300, 600)
    assert missing.status == 404


def test_it_binds_loopback_by_default_and_closing_releases_the_port(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="aps.metrics"):
        server = serve_prometheus(lambda: FIRST)
        with serve_prometheus(lambda: FIRST, host="localhost") as named:
            assert named.host == "127.0.0.1"
    assert server._server.socket.getsockname()[0] == "127.0.0.1"
    assert not caplog.records  # loopback: nothing to warn about
    server.close()
    server.close()  # idempotent
    with pytest.raises(urllib.error.URLError):
        scrape(server.url)


def test_a_loop_that_does_not_take_the_snapshot_fails_the_scrape_with_503(
    caplog: pytest.LogCaptureFixture,
) -> None:
    idle = asyncio.new_event_loop()  # never run: a snapshot handed to it waits in vain
    try:
        with pytest.raises(Timeout, match=r"within 0\.1 s"):
            PrometheusCollector(lambda: FIRST, loop=idle, timeout=0.1).snapshot()
        with serve_prometheus(lambda: FIRST, loop=idle, timeout=0.1) as server:
            failed = scrape(server.url)
        assert failed.status == 503
        assert "did not take a snapshot within 0.1 s" in failed.text
    finally:
        idle.close()
    with pytest.raises(InvalidState, match="event loop is closed"):
        PrometheusCollector(lambda: FIRST, loop=idle).snapshot()
    assert any("got no figures" in r.getMessage() for r in caplog.records)


def test_the_collector_checks_its_arguments() -> None:
    with pytest.raises(ConfigError, match="got 'learner'"):
        PrometheusCollector("learner")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"timeout must be a number of seconds > 0, got 0"):
        PrometheusCollector(lambda: FIRST, timeout=0)


@pytest.mark.timeout(60)
async def test_a_learner_is_scraped_on_its_loop_from_the_servers_thread(
    workers: WorkerTasks,
) -> None:
    learner = aps.Learner("memory://", num_workers=2, timeouts=FAST)
    async with learner:
        await learner.start()
        workers.start(learner.url, num_envs=2)
        workers.start(learner.url, num_envs=3)
        await learner.reset(seed=0)
        with serve_prometheus(learner) as server:
            # The loop stays free while another thread scrapes, so it takes the snapshot.
            text = (await asyncio.to_thread(scrape, server.url)).text
            expected = learner.metrics
        with serve_prometheus(learner, timeout=0.2) as server:
            outcome = held_loop_scrape(server.url)
    assert outcome.status == 503
    found = samples(text)
    ids = sorted(w.worker_id for w in expected.workers)
    assert len(ids) == 2
    assert worker_labels(found) == ids
    assert found[("aps_policy_version", ())] == expected.version
    assert found[("aps_syncs_total", ())] == expected.syncs


def held_loop_scrape(url: str) -> Answer:
    """Scrape ``url`` from a thread while this thread's loop is held, as a long update holds it.

    Returns the scrape's answer.
    """
    outcome: list[Answer] = []

    thread = threading.Thread(target=lambda: outcome.append(scrape(url)))
    thread.start()
    thread.join(timeout=10)  # blocks the loop until the scrape has its answer
    assert not thread.is_alive()
    return outcome[0]


def worker_labels(found: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> list[int]:
    """The worker ids the scrape has a policy version for."""
    return sorted(
        int(dict(labels)["worker"]) for name, labels in found if name == "aps_worker_policy_version"
    )


@pytest.mark.timeout(60)
def test_a_cluster_env_is_scraped_through_its_own_loop() -> None:
    with aps.ClusterEnv.local("CartPole-v1", num_workers=2, transport="memory") as envs:
        envs.reset(seed=0)
        for _ in range(3):
            envs.step(envs.action_space.sample())
        with serve_prometheus(envs) as server:
            found = samples(scrape(server.url).text)
        expected = envs.metrics
    assert found[("aps_policy_version", ())] == expected.version
    assert found[("aps_lockstep_calls_total", ())] == expected.lockstep_calls
    assert found[("aps_env_steps_total", ())] == expected.env_steps
    assert worker_labels(found) == sorted(w.worker_id for w in expected.workers)
