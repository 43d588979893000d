"""Start workers as one Slurm job: ``srun`` runs one ``aps worker`` per task.

:func:`sbatch_script` writes a readable batch script (also for users who submit by hand:
``aps slurm-script ...``); :class:`SlurmJob` writes it, submits it with ``sbatch
--parsable``, tracks the job id, reports the job's state (``squeue``, ``sacct``), and cancels
it (``scancel``) when the learner closes.

The token never appears in the script or on a command line: it goes to a file only its
owner can read (mode 0600), which the workers read with ``--token-file``; the file is removed
when the launcher stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import logging
import os
import secrets
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from aps.errors import ConfigError, InvalidState, LaunchError
from aps.launch.base import TOKEN_ENV, LaunchStatus, WorkerSpec, dialable_url, env_import_path
from aps.session import Timeouts
from aps.worker import EnvSpec

__all__ = ["SlurmJob", "sbatch_script"]

log = logging.getLogger("aps.launch")

ACTIVE_STATES = frozenset(
    {
        "PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
        "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED",
        "RESV_DEL_HOLD",
    }
)  # fmt: skip
"""Slurm job states in which the job may still run workers; any other state is final."""


def _sbatch_option(option: str) -> str:
    text = option.strip()
    if text.startswith("#SBATCH"):
        text = text[len("#SBATCH") :].strip()
    if not text.startswith("-") or "\n" in text or "\r" in text:
        raise ConfigError(
            f"extra_sbatch entries are sbatch options such as '--qos=high' or "
            f"'--constraint=skylake', one per entry; got {option!r}"
        )
    return text


def sbatch_script(
    spec: WorkerSpec,
    *,
    nodes: int = 1,
    tasks_per_node: int = 1,
    partition: str | None = None,
    time: str | None = None,
    cpus_per_task: int | None = None,
    gpus_per_task: int | None = None,
    job_name: str = "aps-workers",
    output: str | None = None,
    extra_sbatch: Sequence[str] = (),
    python: str | None = None,
    token_file: str | None = None,
) -> str:
    """A batch script that runs ``nodes * tasks_per_node`` aps workers dialing ``spec.url``.

    Task ``i`` (``SLURM_PROCID``) is worker ``i``: it seeds its envs from
    ``spec.seed + i * spec.envs_per_worker`` and takes the ``i``-th entry of the per-worker
    kwargs and delays.

    Args:
        spec: what each worker runs; ``spec.url`` must be set. ``spec.token`` is never
            written: the script reads ``token_file``, or (without one) the workers read
            ``APS_TOKEN`` from the environment ``sbatch`` exported.
        nodes: ``--nodes``.
        tasks_per_node: ``--ntasks-per-node``; one task is one worker.
        partition: ``--partition`` (default the cluster's default partition).
        time: ``--time``, as Slurm takes it (``"01:00:00"``).
        cpus_per_task: ``--cpus-per-task``.
        gpus_per_task: ``--gpus-per-task``.
        job_name: ``--job-name``.
        output: the job's log (``--output``; ``%j`` is the job id).
        extra_sbatch: more sbatch options, one per entry, e.g. ``["--qos=high"]``.
        python: the Python that runs aps on the nodes (default this one, whose path the
            nodes must share).
        token_file: the token file's path as the nodes see it.

    Raises:
        ConfigError: a missing URL, a spec whose env is not a string, a worker count that
            does not match ``nodes * tasks_per_node``, or a malformed sbatch option.
    """
    for name, value in (("nodes", nodes), ("tasks_per_node", tasks_per_node)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
    tasks = nodes * tasks_per_node
    if spec.num_workers != tasks:
        raise ConfigError(
            f"the spec has {spec.num_workers} workers but the job runs {nodes} nodes x "
            f"{tasks_per_node} tasks = {tasks}; one task is one worker"
        )
    if spec.url is None:
        raise ConfigError("the spec has no learner URL; use spec.for_learner(url, ...)")
    options = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}"]
    if cpus_per_task is not None:
        options.append(f"--cpus-per-task={cpus_per_task}")
    if gpus_per_task is not None:
        options.append(f"--gpus-per-task={gpus_per_task}")
    if partition is not None:
        options.append(f"--partition={partition}")
    if time is not None:
        options.append(f"--time={time}")
    if output is not None:
        options.append(f"--output={output}")
    options += [_sbatch_option(o) for o in extra_sbatch]
    for option in options:
        if "\n" in option or "\r" in option:
            raise ConfigError(f"an sbatch option holds a line break: {option!r}")

    # The worker's command, one option per line; user values are quoted, the per-task
    # expansions (seed, kwargs) are the script's own.
    lines = [shlex.join([python or sys.executable, "-P", "-m", "aps", "worker", spec.url])]
    static = spec.worker_arguments(None)
    if token_file is not None:
        static += ["--token-file", token_file]
    per_task: list[str] = []
    if spec.seed is not None:
        per_task.append(f"local SEED={spec.seed} ENVS_PER_WORKER={spec.envs_per_worker}")
        lines.append('--seed "$((SEED + SLURM_PROCID * ENVS_PER_WORKER))"')
    lines.append('--label "$SLURM_PROCID"')
    cases: dict[int, list[str]] = {}
    for option, values in (
        ("--env-kwargs", [spec.env_kwargs_of(i) for i in range(tasks)]),
        ("--compute-delay", [spec.compute_delay_of(i) for i in range(tasks)]),
        ("--comm-delay", [spec.comm_delay_of(i) for i in range(tasks)]),
    ):
        if not any(values):
            continue
        if all(v == values[0] for v in values):
            static += [option, _text(values[0])]
            continue
        for index, entry in enumerate(values):
            if entry:  # no kwargs, no delay: the worker's defaults
                cases.setdefault(index, []).extend([option, _text(entry)])
    lines[1:1] = _option_lines(static)
    if cases:
        per_task.append("local PER_TASK=()")
        per_task.append('case "$SLURM_PROCID" in')
        for index, arguments in sorted(cases.items()):
            per_task.append(f"    {index}) PER_TASK=({shlex.join(arguments)}) ;;")
        per_task.append("esac")
        lines.append('"${PER_TASK[@]}"')

    env_name = spec.env if isinstance(spec.env, str) else "?"
    text = [
        "#!/bin/bash",
        f"# aps workers for the learner at {spec.url}:",
        f"# {nodes} node(s) x {tasks_per_node} task(s) = {tasks} workers, each one `aps worker`"
        f" hosting {spec.envs_per_worker} x {env_name}.",
        "# Workers dial out to the learner: start the learner first; only its port must be",
        "# reachable from the nodes.",
    ]
    if token_file is not None:
        text.append(f"# The token is read from {token_file} (keep it mode 0600), never from argv.")
    else:
        text.append(f"# Token: workers read {TOKEN_ENV} from the environment sbatch exports, e.g.")
        text.append(f"#   {TOKEN_ENV}=$(cat token.txt) sbatch THIS_SCRIPT")
    text += [f"#SBATCH {option}" for option in options]
    seeds = (
        f"seeds its envs from {spec.seed} + i * {spec.envs_per_worker}"
        if spec.seed is not None
        else "is unseeded until the learner's reset(seed=...)"
    )
    text += [
        "",
        "set -euo pipefail",
        "",
        f"# One aps worker per Slurm task. Task i (SLURM_PROCID) {seeds}.",
        "aps_worker() {",
        *(f"    {line}" for line in per_task),
        "    exec " + " \\\n        ".join(lines),
        "}",
        "export -f aps_worker",
        "",
        "# A task that fails does not end the others; the learner reports the lost worker.",
        "srun --kill-on-bad-exit=0 bash -c aps_worker",
        "",
    ]
    return "\n".join(text)


def _text(value: Any) -> str:
    return json.dumps(value) if isinstance(value, dict) else repr(float(value))


class SlurmJob:
    """Runs ``nodes * tasks_per_node`` aps workers as one Slurm job; a Launcher.

    On :meth:`start` it writes the token file (mode 0600) and the batch script into
    ``directory`` (which the nodes must see: a shared filesystem), and submits the script
    with ``sbatch --parsable``. :meth:`status` asks ``squeue`` (``sacct`` once the job has
    left the queue); :meth:`watch` raises when the job ends while the learner still waits;
    :meth:`stop` lets the job finish after the learner's goodbye, cancels it with
    ``scancel`` otherwise, and removes the token file. The script and the job's log
    (``aps-workers-JOBID.out``) stay in ``directory``. ``nodes``, ``tasks_per_node``,
    ``partition``, ``time``, ``cpus_per_task``, ``gpus_per_task``, ``job_name``,
    ``extra_sbatch`` and ``python`` are :func:`sbatch_script`'s; ``env_kwargs``, ``seed``,
    ``compute_delays``, ``comm_delays``, ``log_level``, ``connect_timeout``, ``tls_ca`` and
    ``vector`` are :class:`~aps.launch.WorkerSpec`'s.

    Args:
        env: a Gymnasium id, ``"module:factory"``, ``"path.py:factory"`` or a module-level
            function, importable on the nodes.
        envs_per_worker: envs hosted by each worker (task).
        directory: where the script, the token file and the log go (default
            ``./aps-slurm``); must be visible from the nodes.
        learner_host: the name or address the nodes dial when the learner listens on a
            wildcard address (``0.0.0.0``); default this machine's host name.
        poll_interval: seconds between two ``squeue`` calls of :meth:`watch`.

    Raises:
        ConfigError: bad arguments.
    """

    def __init__(
        self,
        env: EnvSpec,
        *,
        nodes: int = 1,
        tasks_per_node: int = 1,
        envs_per_worker: int = 1,
        partition: str | None = None,
        time: str | None = None,
        cpus_per_task: int | None = None,
        gpus_per_task: int | None = None,
        job_name: str = "aps-workers",
        extra_sbatch: Sequence[str] = (),
        python: str | None = None,
        directory: str | os.PathLike[str] | None = None,
        learner_host: str | None = None,
        env_kwargs: dict[str, Any] | Sequence[dict[str, Any]] | None = None,
        seed: int | None = None,
        compute_delays: Sequence[float] | None = None,
        comm_delays: Sequence[float] | None = None,
        log_level: str = "INFO",
        connect_timeout: float = Timeouts().connect,
        tls_ca: str | None = None,
        vector: str = "sync",
        poll_interval: float = 2.0,
    ) -> None:
        for name, value in (("nodes", nodes), ("tasks_per_node", tasks_per_node)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an int >= 1, got {value!r}")
        num_workers = nodes * tasks_per_node
        self._spec = WorkerSpec.of(
            env_import_path(env),
            num_workers=num_workers,
            envs_per_worker=envs_per_worker,
            env_kwargs=env_kwargs,
            seed=seed,
            compute_delays=compute_delays,
            comm_delays=comm_delays,
            log_level=log_level,
            connect_timeout=connect_timeout,
            tls_ca=tls_ca,
            vector=vector,
        )
        self._options: dict[str, Any] = {
            "nodes": nodes,
            "tasks_per_node": tasks_per_node,
            "partition": partition,
            "time": time,
            "cpus_per_task": cpus_per_task,
            "gpus_per_task": gpus_per_task,
            "job_name": job_name,
            "extra_sbatch": [_sbatch_option(o) for o in extra_sbatch],
            "python": python,
        }
        if not poll_interval > 0:
            raise ConfigError(f"poll_interval must be > 0 seconds, got {poll_interval!r}")
        self.num_workers = num_workers
        self.directory = Path(directory if directory is not None else "aps-slurm").absolute()
        self._learner_host = learner_host
        self._poll_interval = poll_interval
        self.job_id: str | None = None
        """The submitted job's id (``None`` until :meth:`start`)."""
        self.script_path: Path | None = None
        self.token_path: Path | None = None
        self._stopped = False

    @property
    def spec(self) -> WorkerSpec:
        """What each worker runs."""
        return self._spec

    @property
    def log_path(self) -> Path | None:
        """The job's log file, once submitted."""
        if self.job_id is None:
            return None
        return self.directory / f"{self._options['job_name']}-{self.job_id}.out"

    def script(self, url: str, spec: WorkerSpec | None = None) -> str:
        """The batch script :meth:`start` would submit for a learner at ``url``."""
        spec = replace(spec or self._spec, url=dialable_url(url, self._learner_host))
        token_file = None if spec.token is None else str(self._token_file())
        output = str(self.directory / f"{self._options['job_name']}-%j.out")
        return sbatch_script(spec, output=output, token_file=token_file, **self._options)

    def _token_file(self) -> Path:
        if self.token_path is None:
            self.token_path = self.directory / f".aps-token-{secrets.token_hex(8)}"
        return self.token_path

    async def start(self, url: str, spec: WorkerSpec | None = None) -> None:
        """Write the token file and the script, and submit the job.

        Raises:
            LaunchError: ``sbatch`` is missing or refused the job; ``stderr`` holds its words.
        """
        if self.job_id is not None or self._stopped:
            raise InvalidState("this Slurm launcher already submitted its job; make a new one")
        spec = spec or self._spec
        self.directory.mkdir(parents=True, exist_ok=True)
        text = self.script(url, spec)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.script_path = self.directory / f"{self._options['job_name']}-{stamp}.sbatch"
        self.script_path.write_text(text)
        if spec.token is not None:
            path = self._token_file()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as file:
                file.write(spec.token + "\n")
        result = await _slurm(["sbatch", "--parsable", str(self.script_path)], what="submit")
        if result.returncode != 0:
            self._remove_token()
            raise LaunchError(
                f"sbatch refused the job (exit status {result.returncode}); the script is "
                f"{self.script_path}",
                stderr=result.stderr,
            )
        self.job_id = result.stdout.strip().split(";")[0]
        log.info("submitted Slurm job %s: %d workers for %s", self.job_id, self.num_workers, url)

    async def status(self) -> LaunchStatus:
        """The job's state as Slurm reports it (``PENDING``, ``RUNNING``, ``COMPLETED``...)."""
        if self.job_id is None:
            return LaunchStatus("slurm", "stopped" if self._stopped else "not started")
        state, reason, nodes = await self._query()
        detail = f"job {self.job_id}"
        if reason and reason not in ("None", "(null)"):
            detail += f", reason {reason}"
        if nodes:
            detail += f", nodes {nodes}"
        return LaunchStatus("slurm", state, (), detail)

    async def _query(self) -> tuple[str, str, str]:
        """(state, reason, nodes) from squeue, else sacct, else ``UNKNOWN``."""
        job = str(self.job_id)
        result = await _slurm(
            ["squeue", "--noheader", "--states=all", "--jobs", job, "--format=%T|%r|%N"],
            what="query",
            missing_ok=True,
        )
        line = result.stdout.strip().splitlines()[0] if result.stdout.strip() else ""
        if result.returncode == 0 and line:
            state, _, rest = line.partition("|")
            reason, _, nodes = rest.partition("|")
            return state.strip(), reason.strip(), nodes.strip()
        result = await _slurm(
            ["sacct", "--noheader", "--parsable2", "--allocations", "--jobs", job,
             "--format=State,Reason,NodeList"],
            what="query",
            missing_ok=True,
        )  # fmt: skip
        line = result.stdout.strip().splitlines()[0] if result.stdout.strip() else ""
        if result.returncode == 0 and line:
            state, _, rest = line.partition("|")
            reason, _, nodes = rest.partition("|")
            # sacct says "CANCELLED by 0"; the first word is the state.
            return (state.split() or ["UNKNOWN"])[0], reason, nodes
        return "UNKNOWN", "no longer known to squeue or sacct", ""

    async def watch(self) -> None:
        """Return never while the job may run workers; raise when it ends first.

        Raises:
            LaunchError: the job ended (failed, cancelled, timed out, or its workers all
                exited) before the learner closed; ``stderr`` holds the end of its log.
        """
        while True:
            if self.job_id is not None:
                state, reason, _ = await self._query()
                if state not in ACTIVE_STATES and state != "UNKNOWN":
                    raise LaunchError(
                        f"Slurm job {self.job_id} ended ({state}, reason {reason}) before the "
                        f"learner closed; its log is {self.log_path}",
                        stderr=self._log_tail(),
                    )
            await asyncio.sleep(self._poll_interval)

    def _log_tail(self, lines: int = 30) -> str:
        path = self.log_path
        if path is None:
            return ""
        try:
            text = path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def stop(self, grace: float = 5.0) -> None:
        """End the job; idempotent.

        It gets ``grace`` seconds to end after the learner's goodbye; then it is cancelled,
        and this waits until it has left the queue. The token file is removed.
        """
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.job_id is None:
                return
            loop = asyncio.get_running_loop()
            deadline = loop.time() + grace
            state = (await self._query())[0]
            # A job that never started has no workers to wait for.
            while state in ACTIVE_STATES - {"PENDING"} and loop.time() < deadline:
                await asyncio.sleep(0.25)
                state = (await self._query())[0]
            if state not in ACTIVE_STATES:
                return
            result = await _slurm(["scancel", self.job_id], what="cancel", missing_ok=True)
            if result.returncode != 0:
                log.warning(
                    "scancel %s failed (exit status %d): %s",
                    self.job_id,
                    result.returncode,
                    result.stderr.strip(),
                )
                return
            deadline = loop.time() + 30.0
            while state in ACTIVE_STATES and loop.time() < deadline:
                await asyncio.sleep(0.25)
                state = (await self._query())[0]
            log.info("cancelled Slurm job %s (%s)", self.job_id, state)
        finally:
            self._remove_token()

    def _remove_token(self) -> None:
        if self.token_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self.token_path.unlink()


async def _slurm(
    command: list[str], *, what: str, missing_ok: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run a Slurm command off the event loop.

    Raises:
        LaunchError: the command is not installed (unless ``missing_ok``: status 127).
    """
    if shutil.which(command[0]) is None:
        if missing_ok:
            return subprocess.CompletedProcess(command, 127, "", f"{command[0]}: not found")
        raise LaunchError(
            f"cannot {what} the Slurm job: {command[0]!r} is not on PATH; run on a Slurm "
            "login node, or print the script with 'aps slurm-script' and submit it there",
            stderr=f"{command[0]}: command not found",
        )
    return await asyncio.to_thread(
        subprocess.run, command, capture_output=True, text=True, check=False, timeout=60
    )


def _option_lines(arguments: list[str]) -> list[str]:
    """``aps worker`` options one per line: each ``--option`` with its values, if any."""
    groups: list[list[str]] = []
    for argument in arguments:
        if argument.startswith("--") or not groups:
            groups.append([argument])
        else:
            groups[-1].append(argument)
    return [shlex.join(group) for group in groups]
