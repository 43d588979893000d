"""What a new user meets in the first hour: mistakes that fail fast, with the cause named."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

import aps
from tests.conftest import FAST


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
