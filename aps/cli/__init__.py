"""The ``aps`` command line.

``aps worker URL --env ENV --num-envs N`` hosts envs for a learner;
``aps slurm-script URL --env ENV --nodes N ...`` prints a Slurm batch script of workers;
``aps token`` makes a token; ``aps check URL`` dials a learner, proves the token and prints
what the learner says about itself (workers, spaces), without joining; ``aps --version``
prints the version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import secrets
import signal
import stat
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aps
from aps.cli._probe import CheckResult, check_learner
from aps.cli._top import top
from aps.errors import ApsError, ConfigError
from aps.launch import _thunks
from aps.launch.base import LOG_LEVELS, TOKEN_ENV, WorkerSpec, client_factory
from aps.launch.slurm import sbatch_script
from aps.session import Timeouts
from aps.session._loop import run
from aps.vector import VECTOR_BACKENDS
from aps.worker import Worker
from aps.worker.envs import make_env

__all__ = ["main"]

_WORKER_HELP = """\
Host Gymnasium envs for an aps learner. The worker dials the learner at URL
(tcp://HOST:PORT, unix:///PATH, ws://HOST:PORT/, wss://..., or a plug-in scheme), runs
its envs as one Gymnasium vector env (see --vector) and serves reset/step requests until
the learner closes.
"""

_VECTOR_HELP = """how the envs run: 'sync' one after another in this process (default), 'async' one
subprocess each (Gymnasium's AsyncVectorEnv, for hosts with more cores than workers),
'envpool' EnvPool's envs (--env an EnvPool id; pip install 'aps-rl[envpool]')"""

_ENV_HELP = """\
what to run: a Gymnasium id (CartPole-v1), an import path 'package.module:factory',
or a file path 'path/to/envs.py:factory' (the factory returns a new env). A factory
that returns a PettingZoo ParallelEnv (mpe2.simple_spread_v3:parallel_env) hosts its
agents: each agent of each copy is one env slot for the learner, with the live-agent mask
info['agent_active'] (--vector sync only)"""


def _json_object(text: str) -> dict[str, object]:
    """``--env-kwargs``: a JSON object, or argparse's usage error naming the value and the fix."""
    example = """--env-kwargs '{"gravity": 9.8}'"""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not valid JSON ({exc.msg[:1].lower()}{exc.msg[1:]} at column "
            f"{exc.colno}); pass a JSON object in single quotes, keys in double quotes: {example}"
        ) from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(
            f"{text!r} is JSON but not an object (a {type(value).__name__}); pass keyword "
            f"arguments as a JSON object: {example}"
        )
    return value


def _command(
    commands: argparse._SubParsersAction[argparse.ArgumentParser],
    name: str,
    summary: str,
    description: str,
) -> argparse.ArgumentParser:
    """Add the subcommand ``name``: ``summary`` in ``aps --help``, ``description`` in its own."""
    return commands.add_parser(
        name,
        help=summary,
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aps", description="aps: Gymnasium envs on remote workers, learning stays central."
    )
    parser.add_argument("--version", action="version", version=f"aps {aps.__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    worker = _command(commands, "worker", "host envs for a learner", _WORKER_HELP)
    worker.add_argument(
        "url", metavar="URL", help="the learner's address, e.g. tcp://10.0.0.5:7000"
    )
    worker.add_argument("--env", help=_ENV_HELP)
    worker.add_argument(
        "--no-check-env",
        action="store_true",
        help="do not build one env before dialing; by default a worker builds one (and closes "
        "it) so that an env that cannot be built fails in seconds, before any learner is "
        "found; the launchers pass this, as their learner reports a failed build itself",
    )
    worker.add_argument(
        "--env-fns-stdin",
        action="store_true",
        help="read pickled env functions from stdin first (how ClusterEnv.local starts a "
        "worker process it hands a list of env functions; its stdin is that parent's pipe, "
        "never the network); --env defaults to them",
    )
    worker.add_argument(
        "--num-envs",
        type=int,
        default=1,
        metavar="N",
        help="envs on this worker (default 1); of a PettingZoo ParallelEnv, env copies: the "
        "learner gets N x len(possible_agents) slots",
    )
    worker.add_argument("--vector", default="sync", choices=VECTOR_BACKENDS, help=_VECTOR_HELP)
    worker.add_argument(
        "--seed",
        type=int,
        default=None,
        metavar="S",
        help="seed of the first reset when the learner gives none: env j gets S + j",
    )
    worker.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="F",
        help=f"file holding the learner's token (or set {TOKEN_ENV}); never pass it on the "
        "command line, where other users can read it",
    )
    worker.add_argument(
        "--policy",
        default=None,
        metavar="IMPORT_PATH",
        help="the policy this worker may run ('pkg.module:make_agent' or "
        "'path/to/script.py:Agent'); a learner that names another is refused. The launchers "
        "(aps.launch.local, ray, slurm) pass the learner's own policy here",
    )
    worker.add_argument(
        "--allow-policy",
        action="append",
        default=[],
        metavar="PATTERN",
        help="also allow policies matching this import path pattern (repeatable): "
        "'mypkg.agents:*' or '/srv/agents/*.py:Agent', where * stands for part of one name or "
        "path segment, never crossing . / or :; without --policy or --allow-policy the worker "
        "runs no policy",
    )
    worker.add_argument(
        "--allow-private-env-calls",
        action="store_true",
        help="let the learner's env calls (call, get_attr, set_attr) reach private and dunder "
        "names such as _max_episode_steps; by default only public names",
    )
    worker.add_argument(
        "--compression",
        default="auto",
        metavar="CODEC",
        help="codecs this worker offers for arrays of 4 KiB or more: auto (every one it can "
        "import; the learner compresses only off this host), zstd, lz4 or none (default: "
        "auto)",
    )
    worker.add_argument(
        "--no-frame-delta",
        action="store_true",
        help="send DETACH chunks' frame stacks whole; by default, where the learner "
        "compresses, each stack that shifted by one frame travels as its newest frame",
    )
    worker.add_argument(
        "--env-kwargs",
        type=_json_object,
        default=None,
        metavar="JSON",
        help="keyword arguments for the env factory, as a JSON object, e.g. '{\"g\": 9.8}'",
    )
    worker.add_argument(
        "--connect-timeout",
        type=float,
        default=Timeouts().connect,
        metavar="SECONDS",
        help="keep dialing a learner that is not up yet for this long (default %(default)s)",
    )
    worker.add_argument(
        "--no-reconnect",
        action="store_true",
        help="end when the connection drops, instead of dialing again (for --connect-timeout) "
        "and resuming the session",
    )
    worker.add_argument(
        "--label",
        default="",
        metavar="TEXT",
        help="free text the learner shows for this worker (launchers pass the worker's index)",
    )
    worker.add_argument(
        "--compute-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long after every env step of a policy-gradient round, to simulate a "
        "slower machine (default 0)",
    )
    worker.add_argument(
        "--comm-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="sleep this long before sending each gradient report, to simulate a slower link",
    )
    worker.add_argument(
        "--tls-ca",
        default=None,
        metavar="FILE",
        help="dial with TLS (tcp:// or wss://) and check the learner's certificate against "
        "the CA certificates in FILE (PEM)",
    )
    worker.add_argument(
        "--no-uvloop",
        action="store_true",
        help="use asyncio's own event loop even if uvloop is installed",
    )
    worker.add_argument(
        "--log-level",
        default="INFO",
        choices=LOG_LEVELS,
        help="default INFO",
    )
    _add_slurm_script(commands)
    _add_token(commands)
    _add_check(commands)
    _add_top(commands)
    return parser


TOKEN_BYTES = 32
"""Random bytes in a token from ``aps token``: 256 bits, printed as 64 hex digits."""

_TOKEN_HELP = f"""\
Print a fresh random token ({TOKEN_BYTES} random bytes from the operating system, as hex) for
a learner and its workers. Keep it in a file only you can read and give that file to the
workers with --token-file:

    aps token --output token.txt      # created with mode 0600, never overwritten
    (umask 077 && aps token > token.txt)

Never pass a token on a command line, where other users of the machine can read it.
"""


def _add_token(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    token = _command(commands, "token", "print a fresh random token for --token-file", _TOKEN_HELP)
    token.add_argument(
        "--output",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the token to FILE (created with mode 0600; an existing FILE is refused) "
        "instead of printing it",
    )


def _make_token(output: Path | None) -> None:
    token = secrets.token_hex(TOKEN_BYTES)
    if output is None:
        print(token)
        return
    try:
        # O_EXCL: never truncate a token a running learner or its workers still use.
        fd = os.open(output, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigError(
            f"{str(output)!r} exists; aps token never overwrites a token file: remove it "
            "first or choose another name"
        ) from None
    except OSError as exc:
        raise ConfigError(f"cannot create the token file {str(output)!r}: {exc.strerror}") from exc
    with os.fdopen(fd, "w") as file:
        file.write(token + "\n")


_CHECK_HELP = """\
Dial the learner at URL as a worker would, prove the token and leave without joining. Once
the token checked out (both ways), the learner answers the check instead of admitting it:
its protocol and aps versions, the workers it expects and has, its autoreset mode and
policy, and its observation and action spaces (known once a worker has joined). The check
never takes a worker's slot. Prints these, the time to connect and one round trip (--json:
one JSON object). Exits 0 when the learner took the token (whether it has room for one more
worker shows in its worker count), 1 otherwise, saying why.
"""


def _add_check(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    check = _command(
        commands, "check", "dial a learner and prove the token, without joining", _CHECK_HELP
    )
    check.add_argument("url", metavar="URL", help="the learner's address, as workers dial it")
    check.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="F",
        help=f"file holding the learner's token (or set {TOKEN_ENV})",
    )
    check.add_argument("--tls-ca", default=None, metavar="FILE", help="see aps worker --help")
    check.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="the longest the check may take (default %(default)s)",
    )
    check.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (spaces as their repr, null until known) for scripts",
    )


def _check(args: argparse.Namespace) -> None:
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    token = _read_token(args.token_file)
    result = run(
        check_learner(
            args.url,
            token=token,
            factory=client_factory(args.url, args.tls_ca),
            timeout=args.timeout,
        ),
        use_uvloop=False,
    )
    proof = "accepted" if token is not None else "none given, none needed"
    if args.json:
        fields = {f.name: getattr(result, f.name) for f in dataclasses.fields(result)}
        for name in ("observation_space", "action_space"):
            fields[name] = None if fields[name] is None else repr(fields[name])
        print(json.dumps({**fields, "token": proof}))
    else:
        print(_check_report(result, proof))


_TOP_HELP = """\
Watch the learner at URL live: dial it as aps check does (the token proved both ways), then
ask for its figures every --interval seconds and redraw the terminal: the learner's version,
uptime and workers (connected/expected), env-steps/s, bytes/s each way, its CPU and its
lockstep wait share or chunk queue over the last interval, one row per worker, and a last
line for the verdict on what bounds the run. Without a terminal, or with --once, prints
one plain view of one interval and exits. Ctrl-C exits (status 0). Read-only: the learner
changes nothing for a view, paces it to 10 requests a second and serves 8 at once.
"""


def _add_top(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    command = _command(commands, "top", "watch a learner's figures live, per worker", _TOP_HELP)
    command.add_argument("url", metavar="URL", help="the learner's address, as workers dial it")
    command.add_argument(
        "--token-file",
        type=Path,
        default=None,
        metavar="F",
        help=f"file holding the learner's token (or set {TOKEN_ENV})",
    )
    command.add_argument("--tls-ca", default=None, metavar="FILE", help="see aps worker --help")
    command.add_argument(
        "--interval",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="seconds between two views, from 0.1 to 10 (default %(default)s)",
    )
    command.add_argument(
        "--once",
        action="store_true",
        help="print one plain view of one interval and exit (the default without a terminal)",
    )
    command.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="the longest the opening, and each answer, may take (default %(default)s)",
    )


def _top(args: argparse.Namespace) -> None:
    if not args.timeout > 0:
        raise ConfigError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    view = top(
        args.url,
        token=_read_token(args.token_file),
        factory=client_factory(args.url, args.tls_ca),
        interval=args.interval,
        screen=not args.once and sys.stdout.isatty(),
        out=sys.stdout,
        timeout=args.timeout,
    )
    try:
        run(view, use_uvloop=False)
    except KeyboardInterrupt:
        pass  # Ctrl-C is how a live view ends: the view restored the terminal


_UNKNOWN_SPACE = "not known yet: no worker has joined"


def _check_report(result: CheckResult, proof: str) -> str:
    """The readable block ``aps check`` prints."""
    workers = f"{result.workers} of {result.num_workers} connected, {result.num_envs} envs"
    if result.spares:
        workers += f", {result.spares} spares waiting"
    policy = result.policy or "none: the learner chooses the actions"
    lines = [
        ("learner", f"{result.url}, protocol {result.protocol_version}, aps {result.aps_version}"),
        ("token", proof),
        ("workers", workers),
        ("policy", policy),
        ("autoreset", result.autoreset_mode),
        (
            "observations",
            _UNKNOWN_SPACE if result.observation_space is None else repr(result.observation_space),
        ),
        ("actions", _UNKNOWN_SPACE if result.action_space is None else repr(result.action_space)),
        ("connect", f"{result.connect_seconds * 1e3:.1f} ms"),
        ("round trip", f"{result.round_trip_seconds * 1e3:.1f} ms"),
    ]
    return "\n".join(f"{name + ':':<14}{value}" for name, value in lines)


_SLURM_HELP = """\
Print a Slurm batch script that runs NODES x TASKS-PER-NODE aps workers (one per task,
with srun) dialing the learner at URL. Task i seeds its envs from SEED + i * NUM-ENVS.
Submit it with sbatch once the learner listens. The token is never written into the
script: give --token-file (a file the nodes can read, mode 0600), or export APS_TOKEN
when you submit (sbatch passes your environment on).
"""


def _add_slurm_script(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    script = _command(
        commands, "slurm-script", "print a Slurm batch script of workers", _SLURM_HELP
    )
    script.add_argument("url", metavar="URL", help="the learner's address as the nodes dial it")
    script.add_argument("--env", required=True, help=_ENV_HELP)
    script.add_argument("--num-envs", type=int, default=1, metavar="N", help="envs per worker")
    script.add_argument("--vector", default="sync", choices=VECTOR_BACKENDS, help=_VECTOR_HELP)
    script.add_argument("--nodes", type=int, default=1, metavar="N", help="default 1")
    script.add_argument("--tasks-per-node", type=int, default=1, metavar="N", help="default 1")
    script.add_argument("--partition", default=None, metavar="NAME")
    script.add_argument("--time", default=None, metavar="LIMIT", help="e.g. 02:00:00")
    script.add_argument("--cpus-per-task", type=int, default=None, metavar="N")
    script.add_argument("--gpus-per-task", type=int, default=None, metavar="N")
    script.add_argument("--job-name", default="aps-workers", metavar="NAME")
    script.add_argument(
        "--output", default=None, metavar="FILE", help="the job's log; %%j is the job id"
    )
    script.add_argument(
        "--extra-sbatch",
        action="append",
        default=[],
        metavar="OPTION",
        help="another sbatch option, repeatable; write it with '=': --extra-sbatch=--qos=high",
    )
    script.add_argument("--seed", type=int, default=None, metavar="S", help="first seed")
    script.add_argument(
        "--env-kwargs", type=_json_object, default=None, metavar="JSON", help="env factory kwargs"
    )
    script.add_argument(
        "--token-file", default=None, metavar="F", help="token file path as the nodes see it"
    )
    script.add_argument("--tls-ca", default=None, metavar="FILE", help="see aps worker --help")
    script.add_argument(
        "--python",
        default=None,
        metavar="PATH",
        help="the Python with aps installed on the nodes (default: this one)",
    )
    script.add_argument(
        "--connect-timeout", type=float, default=Timeouts().connect, metavar="SECONDS"
    )
    script.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="default INFO")


def _slurm_script(args: argparse.Namespace) -> str:
    if args.env_kwargs is not None and not isinstance(args.env_kwargs, dict):
        raise ConfigError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
    if args.nodes < 1 or args.tasks_per_node < 1:
        raise ConfigError("--nodes and --tasks-per-node must be >= 1")
    num_workers = args.nodes * args.tasks_per_node
    spec = WorkerSpec(
        env=args.env,
        num_workers=num_workers,
        envs_per_worker=args.num_envs,
        env_kwargs=(args.env_kwargs,) * num_workers if args.env_kwargs else (),
        seed=args.seed,
        url=args.url,
        log_level=args.log_level,
        connect_timeout=args.connect_timeout,
        tls_ca=args.tls_ca,
        vector=args.vector,
    )
    return sbatch_script(
        spec,
        nodes=args.nodes,
        tasks_per_node=args.tasks_per_node,
        partition=args.partition,
        time=args.time,
        cpus_per_task=args.cpus_per_task,
        gpus_per_task=args.gpus_per_task,
        job_name=args.job_name,
        output=args.output,
        extra_sbatch=args.extra_sbatch,
        python=args.python,
        token_file=args.token_file,
    )


def _read_token(path: Path | None) -> str | None:
    """The token from ``path`` (``--token-file``), else from ``$APS_TOKEN``, else ``None``.

    A token file that its group or others may read or write is refused, as ssh refuses such
    a private key: whoever can read it can prove the token, join as a worker or act as the
    learner, and a warning would scroll by unread in a cluster's logs.

    Raises:
        ConfigError: the file cannot be read, is not UTF-8, is blank, or is open to others.
    """
    if path is not None:
        try:
            with open(path, "rb") as file:
                # The mode of the file that is read, not of whatever the name points to later.
                mode = os.fstat(file.fileno()).st_mode
                if os.name == "posix" and mode & 0o077:
                    raise ConfigError(
                        f"the token file {str(path)!r} has mode {stat.S_IMODE(mode):04o}: its "
                        "group or others may read it, so anyone there could copy the token; "
                        f"aps refuses it, as ssh refuses such keys: chmod 600 {str(path)!r} "
                        "(aps token --output writes it so), or give the token in "
                        f"{TOKEN_ENV} instead"
                    )
                token = file.read().decode().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {str(path)!r}: {exc.strerror}") from exc
        except UnicodeDecodeError as exc:
            raise ConfigError(
                f"the token file {str(path)!r} is not UTF-8 text ({exc.reason} at byte "
                f"{exc.start}); write it with aps token --output FILE"
            ) from exc
        if not token:
            raise ConfigError(
                f"the token file {str(path)!r} is blank, and an empty token is no secret; "
                "write one with aps token --output FILE"
            )
        return token
    return os.environ.get(TOKEN_ENV) or None


def _build_one(env: str, env_kwargs: dict[str, Any]) -> None:
    """Build one env and close it, before any dialing.

    An env that cannot be built (a missing ROM, a factory that raises) fails here, in
    seconds, rather than once the worker has found its learner, which may not be up yet.

    Raises:
        ConfigError: building the env raised; the message quotes why.
    """
    try:
        make_env(env, env_kwargs).close()
    except ApsError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"could not build the env {env!r} (before dialing the learner): "
            f"{type(exc).__name__}: {exc}"
        ) from exc


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status.

    A reader that stops early (``aps check URL | head -3``) ends the command quietly with
    status 141, as a command killed by ``SIGPIPE`` ends in a shell, not with a traceback.
    """
    try:
        status = _main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's last flush
    except BrokenPipeError:
        # Python's own advice: point stdout at /dev/null, so the flush at exit stays quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return status


def _main(argv: Sequence[str] | None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=getattr(args, "log_level", "WARNING"),
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    if args.command != "worker":
        try:
            if args.command == "slurm-script":
                print(_slurm_script(args), end="")
            elif args.command == "token":
                _make_token(args.output)
            elif args.command == "top":
                _top(args)
            else:
                _check(args)
        except ApsError as exc:
            print(f"aps {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130
        return 0
    try:
        if args.env_fns_stdin:
            _thunks.receive(sys.stdin.buffer)
            args.env = args.env or _thunks.ENV_SPEC
        if args.env is None:
            raise ConfigError("aps worker needs --env (a Gymnasium id or 'module:factory')")
        if args.env_kwargs is not None and not isinstance(args.env_kwargs, dict):
            raise ConfigError(f"--env-kwargs must be a JSON object, got {args.env_kwargs!r}")
        worker = Worker(
            args.url,
            args.env,
            num_envs=args.num_envs,
            seed=args.seed,
            token=_read_token(args.token_file),
            env_kwargs=args.env_kwargs,
            timeouts=Timeouts(connect=args.connect_timeout),
            factory=client_factory(args.url, args.tls_ca),
            compute_delay=args.compute_delay,
            label=args.label,
            reconnect=not args.no_reconnect,
            comm_delay=args.comm_delay,
            vector=args.vector,
            policy=args.policy,
            allow_policy=args.allow_policy,
            compression=args.compression,
            allow_private_env_calls=args.allow_private_env_calls,
            frame_delta=not args.no_frame_delta,
        )
        if not (args.no_check_env or args.env_fns_stdin or args.vector == "envpool"):
            _build_one(args.env, args.env_kwargs or {})
        run(worker.run(), use_uvloop=False if args.no_uvloop else None)
    except ApsError as exc:
        print(f"aps worker: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
