"""The ``aps`` command line: ``aps worker URL --env ENV --num-envs N``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from aps._loop import run
from aps.errors import ApsError, ConfigError
from aps.launch.local import TOKEN_ENV
from aps.session import Timeouts
from aps.worker import Worker

__all__ = ["main"]

_WORKER_HELP = """\
Host Gymnasium envs for an aps learner. The worker dials the learner at URL
(tcp://HOST:PORT, ws://HOST:PORT/, wss://..., or a plug-in scheme), runs its envs as
one Gymnasium SyncVectorEnv and serves reset/step requests until the learner closes.
"""

_ENV_HELP = """\
what to run: a Gymnasium id (CartPole-v1), an import path 'package.module:factory',
or a file path 'path/to/envs.py:factory' (the factory returns a new env)"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aps", description="aps: Gymnasium envs on remote workers, learning stays central."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    worker = commands.add_parser(
        "worker",
        help="host envs for a learner",
        description=_WORKER_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    worker.add_argument(
        "url", metavar="URL", help="the learner's address, e.g. tcp://10.0.0.5:7000"
    )
    worker.add_argument("--env", required=True, help=_ENV_HELP)
    worker.add_argument(
        "--num-envs", type=int, default=1, metavar="N", help="envs on this worker (default 1)"
    )
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
        "--env-kwargs",
        type=json.loads,
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
        "--no-uvloop",
        action="store_true",
        help="use asyncio's own event loop even if uvloop is installed",
    )
    worker.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="default INFO",
    )
    return parser


def _read_token(path: Path | None) -> str | None:
    if path is not None:
        try:
            return path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read the token file {str(path)!r}: {exc.strerror}") from exc
    return os.environ.get(TOKEN_ENV) or None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the process exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    try:
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
            compute_delay=args.compute_delay,
            comm_delay=args.comm_delay,
        )
        run(worker.run(), use_uvloop=False if args.no_uvloop else None)
    except ApsError as exc:
        print(f"aps worker: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
