"""What a new user meets in the first hour: mistakes that fail fast, with the cause named."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import aps
from tests.conftest import FAST, WorkerTasks
from tests.test_vector_backends import ExplodingEnv


def test_a_typo_in_the_env_id_is_refused_before_any_dialing() -> None:
    # No learner runs at this address: the refusal cannot come from dialing.
    with pytest.raises(aps.ConfigError, match=r"CartPol-v1.*Did you mean: `CartPole`"):
        aps.Worker("tcp://127.0.0.1:9", "CartPol-v1")
    with pytest.raises(aps.ConfigError, match=r"CartPole-v9.*v9"):
        aps.Worker("tcp://127.0.0.1:9", "CartPole-v9")
    with pytest.raises(aps.ConfigError, match=r"'no_such_module_xyz' does not import"):
        aps.Worker("tcp://127.0.0.1:9", "no_such_module_xyz:Thing-v0")
    # What gym.make resolves by itself still passes: the newest version of an id without one.
    aps.Worker("tcp://127.0.0.1:9", "CartPole")


def test_aps_worker_with_a_typo_in_the_env_id_exits_at_once() -> None:
    # The connect timeout is long: only an answer before any dialing ends this in time.
    done = subprocess.run(
        [sys.executable, "-m", "aps", "worker", "tcp://127.0.0.1:9", "--env", "CartPol-v1",
         "--connect-timeout", "300"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "no Gymnasium env 'CartPol-v1'" in done.stderr
    assert "Did you mean: `CartPole`" in done.stderr


@pytest.mark.parametrize("scheme", ["tcp", "ws"])
async def test_a_learner_host_that_does_not_resolve_is_named_as_such(scheme: str) -> None:
    # .invalid never resolves (RFC 6761); the connect window is long, so only a refusal
    # that does not wait for it ends the run in time.
    url = f"{scheme}://no-such-learner.invalid:7000"
    timeouts = aps.Timeouts(connect=300, handshake=FAST.handshake)
    worker = aps.Worker(url, "CartPole-v1", timeouts=timeouts)
    with pytest.raises(aps.ConfigError, match=r"no-such-learner\.invalid.*does not resolve"):
        await asyncio.wait_for(worker.run(), 60)


EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _options(help_text: str) -> dict[str, str]:
    """Each option of an argparse ``--help`` and the text of its help, flattened."""
    body = help_text.split("options:", 1)[1]
    options: dict[str, str] = {}
    current = None
    for line in body.splitlines():
        match = re.match(r"^  (-[-\w]+)", line)
        if match:
            current = match.group(1)
            options[current] = line
        elif current is not None and line.strip():
            options[current] += " " + line.strip()
    return options


@pytest.mark.parametrize(
    "example",
    sorted(p.name for p in EXAMPLES.glob("*.py") if "argparse" in p.read_text()),
)
def test_every_example_help_shows_each_default(example: str) -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / example), "--help"],
        capture_output=True, text=True, timeout=120, check=True,
        env={**os.environ, "COLUMNS": "100"},
    )  # fmt: skip
    options = _options(done.stdout)
    assert len(options) > 3, done.stdout
    usage = done.stdout.split("options:")[0]
    missing = {
        name
        for name, text in options.items()
        # A flag without a value (store_true, shown as "[--flag]") is off unless given.
        if name != "-h" and "(default:" not in text and f"[{name}]" not in usage
    }
    assert not missing, f"{example}: --help shows no default for {sorted(missing)}"


def test_ppo_atari_default_budget_is_minutes_and_the_paper_scale_is_one_flag_away() -> None:
    spec = importlib.util.spec_from_file_location("ppo_atari_example", EXAMPLES / "ppo_atari.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    default = module.parse_args([])
    # At this machine's 40-70 env-steps/s a default run ends within minutes.
    assert default.total_timesteps <= 20_000
    assert module.parse_args(["--total-timesteps", "10000000"]).num_iterations > 1000


REPO = EXAMPLES.parent


def test_every_pip_install_of_aps_names_the_distribution_aps_rl() -> None:
    # "aps" on the package index is another project: an install line that says aps[...]
    # or plain aps installs it, or nothing at all.
    texts = [REPO / "README.md", *REPO.glob("docs/**/*.md"), *REPO.glob("aps/**/*.py")]
    texts += [*REPO.glob("examples/**/*.py"), *REPO.glob("benchmarks/*.py")]
    wrong = re.compile(r"pip install\s+(?:-\S+\s+)*['\"]?aps(?:\[|['\"\s]|$)", re.MULTILINE)
    found = [
        f"{path.relative_to(REPO)}: {match.group(0)!r}"
        for path in texts
        for match in wrong.finditer(path.read_text())
    ]
    assert not found, found
    # The check sees what it is meant to.
    assert wrong.search("pip install 'aps[compression]'")
    assert wrong.search("pip install aps")
    assert not wrong.search("pip install 'aps-rl[compression]'")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_step_after_close_says_closed_even_after_a_failed_step() -> None:
    envs = aps.ClusterEnv.local(ExplodingEnv, num_workers=2, envs_per_worker=1, transport="memory")
    actions = np.zeros((2, 2), dtype=np.float32)
    envs.reset(seed=0)
    envs.step(actions)
    envs.step(actions)
    with pytest.raises(RuntimeError, match="the env exploded"):
        envs.step(actions)
    envs.close()
    for call in (envs.step, envs.step_async):
        with pytest.raises(aps.InvalidState, match="this ClusterEnv is closed"):
            call(actions)


def _into_a_closed_pipe(*command: str) -> tuple[int, str]:
    """Run ``python -m aps *command`` with a stdout whose reader has gone; status, stderr."""
    process = subprocess.Popen(
        [sys.executable, "-m", "aps", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before the interpreter has even started
    with process.stderr:
        stderr = process.stderr.read().decode()
    return process.wait(timeout=60), stderr


async def test_aps_check_into_a_reader_that_stops_early_ends_quietly() -> None:
    # `aps check URL | head -1`: the reader has gone before the report is written.
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=1, timeouts=FAST) as learner:
        status, stderr = await asyncio.to_thread(_into_a_closed_pipe, "check", learner.url)
    assert status == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr, stderr


def test_aps_token_into_a_closed_pipe_ends_quietly() -> None:
    status, stderr = _into_a_closed_pipe("token")
    assert status == 141, stderr
    assert "Traceback" not in stderr, stderr


async def test_a_refused_worker_never_says_it_serves(
    workers: WorkerTasks, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="aps")
    async with aps.Learner("tcp://127.0.0.1:0", num_workers=2, timeouts=FAST) as learner:
        workers.start(learner.url, num_envs=1, label="first")
        while not learner._pool.slots.admitted:  # noqa: ASYNC110 - polling a test-only condition
            await asyncio.sleep(0.01)
        odd = workers.start(learner.url, env="Pendulum-v1", label="odd")
        with pytest.raises(aps.ConfigError, match="same spaces"):
            await asyncio.wait_for(odd, 10)
        workers.start(learner.url, num_envs=1, label="second")
        await learner.reset(seed=0)
    said = [r.getMessage() for r in caplog.records]
    assert any("built 1 x Pendulum-v1" in line and "offers them" in line for line in said)
    assert not any("[odd] serves" in line for line in said), said
    assert sum("serves the learner" in line for line in said) == 2, said


@pytest.mark.parametrize(("typo", "meant"), [("tpc", "tcp"), ("wss2", "wss"), ("unx", "unix")])
async def test_a_scheme_with_a_typo_gets_a_did_you_mean(typo: str, meant: str) -> None:
    with pytest.raises(aps.ConfigError, match=rf"'{typo}' \(did you mean '{meant}'\?\)"):
        async with aps.Learner(f"{typo}://127.0.0.1:0", num_workers=1):
            pass
    worker = aps.Worker(f"{typo}://127.0.0.1:7000", "CartPole-v1", timeouts=FAST)
    with pytest.raises(aps.ConfigError, match=rf"did you mean '{meant}'"):
        await asyncio.wait_for(worker.run(), 30)
    # A scheme far from every known one gets the list alone.
    with pytest.raises(aps.ConfigError, match=r"'quic'; known schemes") as refused:
        aps.transports.get_factory("quic")
    assert "did you mean" not in str(refused.value)


def test_the_readme_installs_by_hand_what_make_installs() -> None:
    # Following the README by hand, a newcomer gets the extras and groups the tests need.
    def install(text: str) -> set[str]:
        line = next(x for x in text.splitlines() if "pip install" in x and "-e '." in x)
        extras = re.search(r"-e '\.\[([^\]]*)\]'", line)
        assert extras is not None, line
        return {*extras.group(1).split(","), *re.findall(r"--group (\S+)", line)}

    make = install((REPO / "Makefile").read_text())
    assert install((REPO / "README.md").read_text()) == make
    assert {"sb3", "envpool", "test"} <= make


def test_aps_worker_builds_its_env_before_dialing(tmp_path: Path) -> None:
    envs = tmp_path / "envs.py"
    envs.write_text("def make():\n    raise RuntimeError('no ROM for this game here')\n")
    done = subprocess.run(
        [sys.executable, "-m", "aps", "worker", "tcp://127.0.0.1:9", "--env", f"{envs}:make",
         "--connect-timeout", "300"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1
    assert "could not build the env" in done.stderr
    assert "RuntimeError: no ROM for this game here" in done.stderr
