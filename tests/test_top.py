"""``aps top``: the live view, its protocol path, and the learner's bounds on views.

Real learners on 127.0.0.1 with a token, real workers acting with tests/agents.py's agent
(DETACH), the CLI as a subprocess, and a real terminal: ``aps top`` inside tmux.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

import aps
import aps.learner.admission as admission
from aps import sync
from aps.cli._probe import CheckResult, Watch, check_learner, watch_learner
from aps.cli._top import View, metrics_of, top
from aps.errors import AuthError, ConfigError, EndOfStream, ProtocolError
from aps.metrics import Metrics, WorkerMetrics
from aps.session._loop import run
from aps.wire import codec
from aps.wire.messages import PROTOCOL_VERSION, ProbeMetrics
from tests.conftest import FAST, WorkerTasks
from tests.test_cli_tools import ROOT, aps_cli, aps_cli_async

TCP = "tcp://127.0.0.1:0"
TOKEN = "a token of enough entropy for a test, 0123456789abcdef"
AGENTS = str(Path(__file__).with_name("agents.py"))
POLICY = f"{AGENTS}:Agent"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "token.txt"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)  # a token file open to others is refused
    return str(path)


@pytest.fixture
async def learner(workers: WorkerTasks) -> AsyncIterator[aps.Learner]:
    """A DETACH learner with 2 workers of 2 envs, every version sent to both: 3 published."""
    pytest.importorskip("torch")
    from tests.agents import Agent

    async with aps.Learner(
        TCP, num_workers=2, token=TOKEN, timeouts=FAST, policy=POLICY, sync=sync.AlwaysSync()
    ) as learner:
        for _ in range(2):
            workers.start(learner.url, num_envs=2, token=TOKEN)
        await learner.reset(seed=0)
        agent = Agent(learner)
        for _ in range(3):
            await learner.publish(agent)
            await learner.rollout(8)
        yield learner


def _window() -> tuple[Metrics, Metrics]:
    """Two snapshots 2 s apart of a known workload: every figure of the view is known."""
    earlier = Metrics(
        version=4,
        workers=(
            WorkerMetrics(worker_id=0, syncs=2, env_steps=1000, env_seconds=0.5, rtt=0.002),
            WorkerMetrics(worker_id=1, syncs=2),
        ),
        taken_at=100.0,
        uptime=10.0,
        cpu_seconds=3.0,
        lockstep_wait_seconds=1.0,
    )
    zero = WorkerMetrics(worker_id=0, syncs=5, env_steps=3000, env_seconds=1.5, rtt=0.004)
    zero.inference_seconds, zero.encode_seconds = 0.2, 0.1
    zero.bytes_received, zero.bytes_received_raw = 40_000, 120_000
    zero.bytes_sent, zero.bytes_sent_raw = 10_000, 30_000
    zero.transitions, zero.lag_sum, zero.resumes = 100, 150, 1
    later = Metrics(
        version=7,
        workers=(zero, WorkerMetrics(worker_id=1, syncs=2)),
        taken_at=102.0,
        uptime=3725.0,
        cpu_seconds=4.0,
        lockstep_wait_seconds=1.5,
        queue_depth=3,
    )
    return earlier, later


def _opened(num_workers: int) -> CheckResult:
    """What a learner of ``num_workers`` workers says when a view opens."""
    return CheckResult(
        url="tcp://h:1",
        protocol_version=PROTOCOL_VERSION,
        connect_seconds=0.001,
        round_trip_seconds=0.001,
        aps_version=aps.__version__,
        num_workers=num_workers,
        workers=0,
        spares=0,
        num_envs=0,
        autoreset_mode="NextStep",
        policy=None,
        observation_space=None,
        action_space=None,
    )


def test_the_view_of_a_known_window() -> None:
    earlier, later = _window()
    lines = View("tcp://h:1", _opened(2)).lines(earlier, later, connected=2)
    assert lines[0] == "aps top  tcp://h:1  version 7  up 1:02:05  workers 2/2"
    assert lines[1] == (
        "env-steps/s 1,000  in 20.0 kB/s  out 5.0 kB/s  cpu 50%  lockstep wait 25%  queue 3  "
        "window 2.00 s"
    )
    assert lines[3].split() == [
        *("worker", "steps/s", "env", "ms", "inf", "ms", "enc", "ms", "in", "kB/s", "out"),
        *("kB/s", "raw/wire", "rtt", "ms", "lag", "syncs", "resumes"),
    ]
    # 2000 steps in 2 s; 1.0 s of env, 0.2 of inference, 0.1 of encoding over them; 40 kB in
    # and 10 kB out in 2 s; 150 kB raw over 50 kB wire; lag 150 over 100 transitions.
    assert lines[4].split() == [
        *("0", "1,000", "0.500", "0.100", "0.050", "20.0", "5.0", "3.00", "4.0", "1.50"),
        *("5", "1"),
    ]
    assert lines[5].split() == ["1", "0.0", "-", "-", "-", "0.0", "0.0", "-", "-", "-", "2", "0"]
    # The whole run when there is one snapshot; no window when the learner does not stamp.
    assert lines[6] == ""
    assert "window whole run" in View("u", _opened(2)).lines(None, later, 1)[1]
    unstamped = Metrics(version=1, workers=())
    view = View("u", _opened(3)).lines(unstamped, unstamped, None)
    assert view[0].endswith("workers ?/3") and "env-steps/s -  in - kB/s" in view[1]
    assert "window none" in view[1] and view[4] == "(no worker has joined yet)"


def test_figures_come_back_as_the_metrics_they_were() -> None:
    _, later = _window()
    later.workers[0].divergences.extend([0.1, 0.3])
    wire = codec.decode(codec.encode(ProbeMetrics(metrics=later.as_dict())))
    assert isinstance(wire, ProbeMetrics)
    again = metrics_of({**wire.metrics, "workers_connected": 2, "a_newer_figure": 1})
    assert again.as_dict() == later.as_dict()
    assert list(again.workers[0].divergences) == [0.3]  # the last one alone travels
    with pytest.raises(ProtocolError, match="worker 0: env_steps='many', expected a number"):
        bad = later.as_dict()
        bad["workers"][0]["env_steps"] = "many"
        metrics_of(bad)
    with pytest.raises(ProtocolError, match="workers=3, expected a list"):
        metrics_of({"version": 1, "workers": 3})


async def _figures_of(learner: aps.Learner) -> dict[str, Any]:
    async with watch_learner(learner.url, token=TOKEN, timeout=10) as watch:
        return await watch.figures()


async def test_a_view_gets_the_learners_figures_and_a_wrong_token_nothing(
    learner: aps.Learner,
) -> None:
    figures = await _figures_of(learner)
    expected = learner.metrics
    assert figures["version"] == expected.version == 3
    assert [w["syncs"] for w in figures["workers"]] == [w.syncs for w in expected.workers]
    assert [w["syncs"] for w in figures["workers"]] == [3, 3]
    assert [w["worker_id"] for w in figures["workers"]] == [0, 1]
    assert figures["workers_connected"] == 2
    assert figures["transitions"] == expected.transitions > 0
    # A wrong or missing token is refused as aps check's is, with no figure in the refusal.
    for token, refusal in (("not " + TOKEN, "token proof is wrong"), (None, "requires a token")):
        with pytest.raises(AuthError, match=refusal):
            async with watch_learner(learner.url, token=token, timeout=10):
                pytest.fail("a view with a wrong token opened")
    await learner._pool.settle_admissions()
    assert learner._pool.refused == 2 and len(learner.workers) == 2


def _table(out: str) -> dict[int, list[str]]:
    """The worker rows of a printed view, by worker id."""
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.split()[:1] == ["worker"]), None)
    rows: dict[int, list[str]] = {}
    if start is None:
        return rows
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        cells = line.split()
        rows[int(cells[0])] = cells
    return rows


async def test_once_prints_the_learners_numbers(learner: aps.Learner, token_file: str) -> None:
    code, out, err = await aps_cli_async(
        "top", learner.url, "--token-file", token_file, "--once", "--interval", "0.2"
    )
    assert code == 0, err
    expected = learner.metrics
    header = out.splitlines()[0]
    assert header.startswith(f"aps top  {learner.url}  version {expected.version}  up ")
    assert header.endswith("workers 2/2") and expected.version == 3
    rows = _table(out)
    assert sorted(rows) == [w.worker_id for w in expected.workers] == [0, 1]
    for worker in expected.workers:
        assert int(rows[worker.worker_id][10]) == worker.syncs == 3  # the syncs column
        assert int(rows[worker.worker_id][11]) == worker.resumes == 0
    assert "window 0.2" in out.splitlines()[1]  # one interval, the learner's clock
    # The same refusal as aps check for a wrong token: nothing on stdout.
    wrong = Path(token_file).with_name("wrong.txt")
    wrong.write_text("not-the-token\n")
    wrong.chmod(0o600)
    code, out, err = await aps_cli_async("top", learner.url, "--token-file", str(wrong), "--once")
    assert code == 1 and out == ""
    assert "AuthError" in err and "token proof is wrong" in err
    code, out, err = await aps_cli_async("top", learner.url, "--interval", "0.01", "--once")
    assert code == 1 and "--interval must be from 0.1 to 10.0 seconds, got 0.01" in err


async def test_views_beyond_the_limit_are_told_the_limit_and_checks_go_on(
    learner: aps.Learner,
) -> None:
    gate = learner._pool._gate
    assert gate is not None
    async with contextlib.AsyncExitStack() as stack:
        views: list[Watch] = []
        for _ in range(admission.MAX_WATCHERS):
            view = await stack.enter_async_context(
                watch_learner(learner.url, token=TOKEN, timeout=10)
            )
            await view.figures()
            views.append(view)
        assert gate.watchers == admission.MAX_WATCHERS == 8
        with pytest.raises(EndOfStream, match="at most 8 live views"):
            async with watch_learner(learner.url, token=TOKEN, timeout=10) as extra:
                await extra.figures()
        # aps check is no view: it gets its answer and leaves, whatever the views.
        result = await check_learner(learner.url, token=TOKEN, timeout=10)
        assert (result.num_workers, result.workers) == (2, 2)
        assert gate.watchers == 8 and learner._pool.refused == 0
        # The views already served go on being served.
        assert [(await view.figures())["version"] for view in views] == [3] * 8
    # Once they leave, their places are free again.
    await _until(lambda: gate.watchers == 0, "views' places freed")
    assert (await _figures_of(learner))["version"] == 3


async def test_a_view_that_asks_faster_is_paced(learner: aps.Learner) -> None:
    loop = asyncio.get_running_loop()
    served: list[float] = []
    figures = learner._pool.figures

    def timed() -> dict[str, Any]:
        served.append(loop.time())
        return figures()

    learner._pool.figures = timed
    async with watch_learner(learner.url, token=TOKEN, timeout=10) as view:
        for _ in range(12):
            await view.figures()  # each asked as soon as the one before was answered
    assert len(served) == 12
    gaps = [b - a for a, b in itertools.pairwise(served)]
    assert admission.WATCH_RATE == 10.0
    assert min(gaps) >= 0.1 - 1e-3, gaps  # ten a second at most, however fast it asks


async def test_a_silent_view_is_closed(
    learner: aps.Learner, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(admission, "WATCH_TIMEOUT", 0.5)
    gate = learner._pool._gate
    assert gate is not None
    async with watch_learner(learner.url, token=TOKEN, timeout=10) as view:
        await view.figures()
        assert gate.watchers == 1
        session = view._session  # silent from here: the learner's goodbye is what comes
        with pytest.raises(EndOfStream):
            await session.receive(timeout=10, operation="the learner's goodbye")
        assert session.goodbye is not None and "no request from this live view for 0.5 s" in (
            session.goodbye
        )
    assert gate.watchers == 0


async def test_the_learners_close_ends_its_views() -> None:
    before = asyncio.all_tasks()
    learner = aps.Learner(TCP, num_workers=1, token=TOKEN, timeouts=FAST)
    await learner.start()
    try:
        async with contextlib.AsyncExitStack() as stack:
            views = [
                await stack.enter_async_context(watch_learner(learner.url, token=TOKEN, timeout=10))
                for _ in range(2)
            ]
            for view in views:
                figures = await view.figures()
                assert figures["version"] == 0 and figures["workers"] == ()
                assert figures["workers_connected"] == 0
            await learner.aclose()
            for view in views:
                with pytest.raises(EndOfStream):
                    await view.figures()
                assert view._session.goodbye == "the learner is closing"
    finally:
        await learner.aclose()
    left = {t for t in asyncio.all_tasks() - before if t is not asyncio.current_task()}
    assert not left, left


LEARNER_SCRIPT = """
import asyncio, sys
import aps
from tests.agents import Agent

token, policy, allowed = sys.argv[1:]


async def main() -> None:
    timeouts = aps.Timeouts(connect=10.0, handshake=2.0, step=10.0, heartbeat_timeout=10.0)
    async with aps.Learner(
        "tcp://127.0.0.1:0", num_workers=2, token=token, policy=policy, timeouts=timeouts
    ) as learner:
        workers = [
            asyncio.create_task(
                aps.Worker(
                    learner.url, "CartPole-v1", num_envs=2, token=token, timeouts=timeouts,
                    allow_policy=[allowed],
                ).run()
            )
            for _ in range(2)
        ]
        await learner.reset(seed=0)
        agent = Agent(learner)
        print(learner.url, flush=True)
        while True:  # until the test ends this process
            await learner.publish(agent)
            await learner.rollout(16)
            await asyncio.sleep(0.2)


asyncio.run(main())
"""


class Tmux:
    """One tmux server of the test's own (its own socket name), killed at the end."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __call__(self, *args: str) -> str:
        result = subprocess.run(
            ["tmux", "-L", self.name, *args], capture_output=True, text=True, timeout=10
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "top")

    def pane(self, flag: str) -> str:
        return self("display-message", "-p", "-t", "top", f"#{{{flag}}}").strip()


async def _until(check: Any, what: str, seconds: float = 20.0) -> Any:
    try:
        async with asyncio.timeout(seconds):
            while not (value := check()):  # noqa: ASYNC110 - a screen and a file: no event
                await asyncio.sleep(0.1)
    except TimeoutError:
        raise AssertionError(f"no {what} within {seconds} s") from None
    return value


def _version(screen: str) -> int | None:
    for line in screen.splitlines():
        words = line.split()
        if words[:1] == ["aps"] and "version" in words:
            return int(words[words.index("version") + 1])
    return None


@pytest.mark.timeout(90)
async def test_top_in_a_real_terminal_refreshes_and_ends_on_ctrl_c(
    tmp_path: Path, token_file: str
) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed: the real-terminal test runs aps top inside tmux")
    pytest.importorskip("torch")
    script = tmp_path / "learner.py"
    script.write_text(LEARNER_SCRIPT)
    process = await asyncio.create_subprocess_exec(
        sys.executable, str(script), TOKEN, POLICY, f"{AGENTS}:*",
        stdout=asyncio.subprocess.PIPE, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    tmux = Tmux(f"aps-test-{os.getpid()}")
    status = tmp_path / "status"
    try:
        assert process.stdout is not None
        url = (await asyncio.wait_for(process.stdout.readline(), 30)).decode().strip()
        assert url.startswith("tcp://127.0.0.1:"), url
        command = (
            f"{sys.executable} -m aps top {url} --token-file {token_file} --interval 0.3; "
            f"echo $? > {status}; sleep 60"
        )
        tmux("new-session", "-d", "-s", "top", "-x", "160", "-y", "40", "-c", str(ROOT), command)
        first = await _until(
            lambda: (s := tmux.screen()) and _table(s).keys() == {0, 1} and _version(s) and s,
            "view with both workers' rows",
        )
        assert tmux.pane("alternate_on") == "1" and tmux.pane("cursor_flag") == "0"
        assert f"aps top  {url}  version" in first and "workers 2/2" in first
        # The view refreshes: the learner publishes a new version every few tenths of a second.
        await _until(lambda: (_version(tmux.screen()) or 0) > (_version(first) or 0), "refresh")
        tmux("send-keys", "-t", "top", "C-c")
        await _until(status.exists, "exit after Ctrl-C")
        await _until(lambda: status.read_text().strip(), "exit status")
        assert status.read_text().strip() == "0"
        # The terminal is as it was: the main screen back, the cursor shown, no view left.
        assert tmux.pane("alternate_on") == "0" and tmux.pane("cursor_flag") == "1"
        assert "aps top" not in tmux.screen()
    finally:
        with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
            tmux("kill-server")
        if process.returncode is None:
            process.kill()
        await process.wait()


def test_the_interval_is_bounded() -> None:
    with pytest.raises(ConfigError, match=r"--interval must be from 0\.1 to 10\.0 seconds, got 20"):
        run(top("tcp://127.0.0.1:1", token=None, interval=20, screen=False, out=sys.stdout))


def test_help_says_how_a_view_ends_and_what_bounds_it() -> None:
    out = aps_cli("top", "--help").stdout
    assert "Ctrl-C exits (status 0)" in out and "--once" in out
    assert "10 requests a second" in out and "serves 8 at once" in out
