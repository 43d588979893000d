"""Off-policy DQN on a stream of chunks from aps workers, CleanRL style, with the await API.

The workers keep acting with an epsilon-greedy copy of the Q-network and stream chunks of
``num_steps`` steps; the learner puts every chunk into a replay buffer, takes
``gradient_steps`` gradient steps on it, and publishes a new policy version after EVERY
gradient step (with the current epsilon of a linear schedule). That is many versions per
chunk, the case where sending every version to every worker (``--sync always``) is
expensive and Adaptive Policy Synchronization (``--sync aps``) sends only the versions whose
greedy actions moved far enough from what a worker holds.

    python examples/dqn_async.py --sync aps --kl-threshold 0.05
    python examples/dqn_async.py --sync always --track-tb
    python examples/dqn_async.py --hidden-size 1024 --num-layers 2  # 1.06M parameters

The workers build the Q-network from this file by import path; the layer widths travel
inside that path (``dqn_async.py:sized.h120_84``, see :data:`sized`).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import itertools
import json
import math
import os
import random
import re
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim

import aps
import aps.launch

URLS = {"tcp": "tcp://127.0.0.1:0", "ws": "ws://127.0.0.1:0", "memory": "memory://"}
TOKEN_FILE = Path("aps-token")  # written for workers started elsewhere (--listen)


def arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class Args:
    exp_name: str = arg(Path(__file__).stem, "the name of this experiment")
    seed: int = arg(1, "seed of the experiment (torch, numpy, env resets)")
    torch_deterministic: bool = arg(True, "torch.backends.cudnn.deterministic")
    torch_threads: int = arg(1, "torch CPU threads of the learner (small nets: 1 is fastest)")
    track_tb: bool = arg(False, "log to TensorBoard (needs the tensorboard package)")
    logdir: str = arg("runs", "where TensorBoard runs are written")
    progress: bool = arg(True, "show a progress bar")
    json: str | None = arg(None, "write the final figures to this JSON file")

    # Environment and cluster.
    env_id: str = arg("CartPole-v1", "the Gymnasium id of the environment")
    workers: int = arg(2, "number of worker processes")
    envs_per_worker: int = arg(4, "environments per worker")
    transport: str = arg("tcp", "tcp, ws or memory")
    listen: str | None = arg(
        None, "listen here for --workers workers started elsewhere (token: $APS_TOKEN)"
    )
    external_workers: bool = arg(False, "start no workers: print the aps worker command")
    num_steps: int = arg(16, "steps per env in each chunk a worker sends")
    max_in_flight: int = arg(2, "chunk requests outstanding per worker")

    # Q-network size (the weights that travel scale with hidden_size squared times num_layers).
    hidden_size: int | None = arg(None, "units per hidden layer (default: CleanRL's 120, 84)")
    num_layers: int | None = arg(None, "hidden layers of --hidden-size units (default: 2)")

    # Synchronization.
    sync: str = arg("aps", "aps, fixed or always")
    kl_threshold: float = arg(0.05, "APS: sync a worker when its KL to the learner exceeds this")
    max_lag: int | None = arg(
        None, "APS: also sync a worker this many versions behind (0: no bound; default: APS's)"
    )
    fixed_versions: int = arg(64, "fixed: sync a worker once it is this many versions behind")

    # DQN.
    total_timesteps: int = arg(50_000, "total env steps of the experiment")
    learning_rate: float = arg(2.5e-4, "the learning rate of the optimizer")
    buffer_size: int = arg(50_000, "the replay memory buffer size")
    gamma: float = arg(0.99, "the discount factor")
    tau: float = arg(1.0, "the target network update rate")
    target_network_frequency: int = arg(100, "gradient steps between target network updates")
    batch_size: int = arg(128, "the batch size of sample from the replay memory")
    start_e: float = arg(1.0, "the starting epsilon for exploration")
    end_e: float = arg(0.05, "the ending epsilon for exploration")
    exploration_fraction: float = arg(0.2, "fraction of total_timesteps to reach end_e")
    learning_starts: int = arg(2_000, "env steps before learning starts")
    gradient_steps: int = arg(8, "gradient steps per chunk (each one publishes a version)")
    final_episodes: int = arg(50, "the final return is the mean over this many last episodes")


def parse_args(argv: list[str] | None = None) -> Args:
    """Build an argparse parser from the Args fields (``--env-id``, ``--no-progress``, ...)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    types = {"int": int, "float": float, "str": str}
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        kind = str(f.type).replace(" | None", "")
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            parser.add_argument(flag, type=types[kind], default=f.default)
        parser._actions[-1].help = f.metadata["help"] + " (default: %(default)s)"
    args = Args(**vars(parser.parse_args(argv)))
    if args.sync not in ("aps", "fixed", "always"):
        parser.error(f"--sync must be aps, fixed or always, got {args.sync!r}")
    if args.transport not in URLS:
        parser.error(f"--transport must be one of {', '.join(URLS)}, got {args.transport!r}")
    for name in ("hidden_size", "num_layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be an int >= 1, got {value}")
    if args.num_layers is not None and args.hidden_size is None:
        parser.error("--num-layers needs --hidden-size (the default layers are 120 and 84 units)")
    return args


def hidden_sizes(args: Args) -> tuple[int, ...]:
    """The widths of the hidden layers: CleanRL's (120, 84) unless --hidden-size is given."""
    if args.hidden_size is None:
        return (120, 84)
    return (args.hidden_size,) * (2 if args.num_layers is None else args.num_layers)


def make_sync(args: Args) -> Any:
    if args.sync == "always":
        return aps.sync.AlwaysSync()
    if args.sync == "fixed":
        return aps.sync.FixedInterval(versions=args.fixed_versions)
    if args.max_lag is None:
        return aps.sync.APS(kl_threshold=args.kl_threshold)  # the default staleness bound
    return aps.sync.APS(kl_threshold=args.kl_threshold, max_lag=args.max_lag or None)


class QNetwork(nn.Module):
    """CleanRL's DQN network (ReLU layers of 120 and 84 units by default)."""

    def __init__(self, envs: Any, hidden_sizes: tuple[int, ...] = (120, 84)) -> None:
        super().__init__()
        sizes = [int(np.array(envs.single_observation_space.shape).prod()), *hidden_sizes]
        layers: list[nn.Module] = []
        for n_in, n_out in itertools.pairwise(sizes):
            layers += [nn.Linear(n_in, n_out), nn.ReLU()]
        layers.append(nn.Linear(sizes[-1], envs.single_action_space.n))
        self.network = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)


class QNetworksBySize:
    """Q-network factories named by layer widths: ``sized.h256_256`` is
    ``QNetwork(envs, hidden_sizes=(256, 256))``.

    A worker builds its agent from an import path alone, so the path carries the widths
    (:func:`policy_path`).
    """

    def __getattr__(self, name: str) -> Callable[[Any], QNetwork]:
        if re.fullmatch(r"h[1-9][0-9]*(_[1-9][0-9]*)*", name) is None:
            raise AttributeError(f"{name!r} is no Q-network size; write h<width>_<width>...")
        sizes = tuple(int(width) for width in name[1:].split("_"))
        return lambda envs: QNetwork(envs, hidden_sizes=sizes)


sized = QNetworksBySize()


def policy_path(args: Args) -> str:
    """The import path the workers build the learner's Q-network from, widths included."""
    widths = "_".join(map(str, hidden_sizes(args)))
    return f"{Path(__file__).resolve()}:sized.h{widths}"


def linear_schedule(start_e: float, end_e: float, duration: int, t: int) -> float:
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


class ReplayBuffer:
    """A ring buffer of transitions in numpy arrays."""

    def __init__(self, size: int, obs_shape: tuple[int, ...], rng: np.random.Generator) -> None:
        self.obs = np.zeros((size, *obs_shape), dtype=np.float32)
        self.next_obs = np.zeros((size, *obs_shape), dtype=np.float32)
        self.actions = np.zeros(size, dtype=np.int64)
        self.rewards = np.zeros(size, dtype=np.float32)
        self.dones = np.zeros(size, dtype=np.float32)
        self.size, self.pos, self.full, self.rng = size, 0, False, rng

    def add(self, obs: Any, next_obs: Any, actions: Any, rewards: Any, dones: Any) -> None:
        for i in range(len(actions)):
            self.obs[self.pos] = obs[i]
            self.next_obs[self.pos] = next_obs[i]
            self.actions[self.pos] = actions[i]
            self.rewards[self.pos] = rewards[i]
            self.dones[self.pos] = dones[i]
            self.pos = (self.pos + 1) % self.size
            self.full = self.full or self.pos == 0

    def sample(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        index = self.rng.integers(0, self.size if self.full else self.pos, size=batch_size)
        return tuple(
            torch.as_tensor(a[index])
            for a in (self.obs, self.actions, self.rewards, self.next_obs, self.dones)
        )


class Progress:
    """tqdm when it is installed, otherwise a one-line text bar on stderr."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="step", unit_scale=True, dynamic_ncols=True)

    def update(self, n: int, **postfix: Any) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.set_postfix(postfix, refresh=False)
            self.bar.update(n)
        elif self.enabled:
            filled = int(30 * min(self.done / self.total, 1.0))
            text = " ".join(f"{k}={v}" for k, v in postfix.items())
            line = f"\r[{'#' * filled:<30}] {self.done:,}/{self.total:,} {text}"
            print(line.ljust(100), end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def make_writer(args: Args, run_name: str) -> Any:
    """A TensorBoard SummaryWriter, or None (saying why once) without the tensorboard package."""
    if not args.track_tb:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print("tensorboard is not installed (pip install tensorboard); not logging to it")
        return None
    writer = SummaryWriter(f"{args.logdir}/{run_name}")
    table = "\n".join(f"|{k}|{v}|" for k, v in vars(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer


def lag_percentile(counts: collections.Counter[int], q: float) -> int:
    """The ``q``-th percentile (lower) of the lags counted in ``counts`` (transitions per lag)."""
    total = sum(counts.values())
    seen = 0
    for lag in sorted(counts):
        seen += counts[lag]
        if seen >= math.ceil(q / 100.0 * total):
            return lag
    return 0


def summary_line(result: dict[str, Any]) -> str:
    final = result["final_return"]
    ret = "n/a" if final is None else f"{final:.1f}"
    return (
        f"summary: final mean return {ret} over the last {result['final_episodes']} episodes | "
        f"{result['syncs']} syncs, {result['weight_bytes'] / 1e6:.2f} MB of weights "
        f"({result['versions']} versions published) | lag mean {result['lag_mean']:.2f} "
        f"max {result['lag_max']} | {result['sps']:,.0f} env-steps/s"
    )


def external_token() -> str:
    """``$APS_TOKEN``, or a fresh token written to :data:`TOKEN_FILE` for the workers."""
    token = os.environ.get("APS_TOKEN")
    if token is None:
        token = secrets.token_hex(32)  # 256 bits, as aps token writes
        TOKEN_FILE.touch(mode=0o600)
        TOKEN_FILE.write_text(token)
    return token


async def train(args: Args) -> dict[str, Any]:
    """Run the experiment; return the final figures."""
    run_name = f"{args.env_id}__{args.exp_name}__{args.sync}__{args.seed}__{int(time.time())}"
    writer = make_writer(args, run_name)
    # Seeding: the learner (torch, numpy, replay sampling) and the envs (reset(seed=...)). The
    # workers sample actions with generators aps seeds from the OS, and chunks arrive in the
    # order the workers finish them, so runs do not repeat exactly.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.torch_threads)

    # aps: a learner that listens, and worker processes (tasks for memory://) that dial it,
    # or, with --listen / --external-workers, workers started on other machines.
    external = args.listen is not None or args.external_workers
    token = external_token() if external else secrets.token_hex(16)
    policy = policy_path(args)
    if args.external_workers:
        # Workers on other machines import the policy from their own checkout.
        policy = f"examples/dqn_async.py:sized.h{'_'.join(map(str, hidden_sizes(args)))}"
    learner = aps.Learner(
        (args.listen or "tcp://0.0.0.0:0") if external else URLS[args.transport],
        num_workers=args.workers,
        token=token,
        policy=policy,
        sync=make_sync(args),
        autoreset_mode="SameStep",
    )
    workers = (
        None
        if external
        else aps.launch.LocalWorkers(
            args.env_id,
            num_workers=args.workers,
            envs_per_worker=args.envs_per_worker,
            token=token,
            policy=policy,
        )
    )
    progress = Progress(args.total_timesteps, args.progress)
    try:
        await learner.start()
        if args.external_workers:
            print(
                f"waiting for {args.workers} workers; on each worker machine, with the file "
                f"{TOKEN_FILE} copied, run from a checkout of this repository:\n"
                f"  aps worker {aps.launch.dialable_url(learner.url)} --env {args.env_id} "
                f"--num-envs {args.envs_per_worker} --token-file {TOKEN_FILE} --policy {policy}",
                flush=True,
            )
        if workers is not None:
            await workers.start(learner.url)
        await learner.reset(seed=args.seed)  # waits for the workers

        q_network = QNetwork(learner, hidden_sizes=hidden_sizes(args))
        optimizer = optim.Adam(q_network.parameters(), lr=args.learning_rate)
        target_network = QNetwork(learner, hidden_sizes=hidden_sizes(args))
        target_network.load_state_dict(q_network.state_dict())
        rb = ReplayBuffer(
            args.buffer_size,
            learner.single_observation_space.shape,
            np.random.default_rng(args.seed),
        )
        bytes_per_version = sum(
            t.numel() * t.element_size() for t in q_network.state_dict().values()
        )
        duration = max(int(args.exploration_fraction * args.total_timesteps), 1)
        epsilon = linear_schedule(args.start_e, args.end_e, duration, 0)
        await learner.publish(q_network, epsilon=epsilon)

        returns: collections.deque[float] = collections.deque(maxlen=args.final_episodes)
        episodes = updates = global_step = 0
        lags: collections.Counter[int] = collections.Counter()  # transitions per policy lag
        curve: list[dict[str, Any]] = []  # one row per chunk: the learning curve
        start_time = time.perf_counter()
        async for chunk in learner.chunks(args.num_steps, max_in_flight=args.max_in_flight):
            steps = chunk.reward.size
            global_step += steps
            lags[chunk.lag] += steps
            for ret, length in zip(chunk.episode_return, chunk.episode_length, strict=True):
                returns.append(float(ret))
                episodes += 1
                if writer is not None:
                    writer.add_scalar("charts/episodic_return", ret, global_step)
                    writer.add_scalar("charts/episodic_length", length, global_step)

            # Transitions: obs[t] -> obs[t + 1] (next_obs after the last step). SameStep
            # autoreset puts the next episode's first observation after an episode's end:
            # harmless after a termination (no bootstrap), wrong after a truncation, which
            # bootstraps from the observation the episode ended in. The chunk carries those
            # (truncated_obs, at truncated_index: step and global env index).
            next_obs = np.concatenate([chunk.obs[1:], chunk.next_obs[None]], axis=0)
            cut_step, cut_env = chunk.truncated_index.T
            next_obs[cut_step, cut_env - chunk.env_offset] = chunk.truncated_obs
            obs_shape = chunk.obs.shape[2:]
            rb.add(
                chunk.obs.reshape(-1, *obs_shape),
                next_obs.reshape(-1, *obs_shape),
                chunk.actions.reshape(-1),
                chunk.reward.reshape(-1),
                chunk.terminated.reshape(-1),
            )

            epsilon = linear_schedule(args.start_e, args.end_e, duration, global_step)
            if global_step > args.learning_starts:
                for _ in range(args.gradient_steps):
                    obs_b, actions_b, rewards_b, next_obs_b, dones_b = rb.sample(args.batch_size)
                    with torch.no_grad():
                        target_max, _ = target_network(next_obs_b).max(dim=1)
                        td_target = rewards_b + args.gamma * target_max * (1 - dones_b)
                    old_val = q_network(obs_b).gather(1, actions_b[:, None]).squeeze(1)
                    loss = F.mse_loss(td_target, old_val)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                    updates += 1
                    if updates % args.target_network_frequency == 0:
                        for target_param, param in zip(
                            target_network.parameters(), q_network.parameters(), strict=True
                        ):
                            target_param.data.copy_(
                                args.tau * param.data + (1.0 - args.tau) * target_param.data
                            )
                    # aps: every gradient step is a new version; the strategy decides who gets it.
                    await learner.publish(q_network, epsilon=epsilon)

            metrics = learner.metrics
            sps = global_step / (time.perf_counter() - start_time)
            mean_return = float(np.mean(returns)) if returns else math.nan
            if writer is not None:
                writer.add_scalar("charts/SPS", sps, global_step)
                writer.add_scalar("charts/epsilon", epsilon, global_step)
                writer.add_scalar("charts/weight_syncs", metrics.syncs, global_step)
                writer.add_scalar("charts/weight_bytes", metrics.weight_bytes, global_step)
                writer.add_scalar("charts/lag", chunk.lag, global_step)
                writer.add_scalar("charts/lag_mean", metrics.lag_mean, global_step)
                writer.add_scalar("charts/policy_version", metrics.version, global_step)
                worker = metrics.workers[chunk.worker_id]
                if worker.divergences:
                    writer.add_scalar(
                        f"workers/{chunk.worker_id}/divergence", worker.divergences[-1], global_step
                    )
                if updates:
                    writer.add_scalar("losses/td_loss", loss.item(), global_step)
                    writer.add_scalar("losses/q_values", old_val.mean().item(), global_step)
            progress.update(steps, ret=f"{mean_return:.1f}", syncs=metrics.syncs, sps=f"{sps:,.0f}")
            curve.append(
                {
                    "global_step": global_step,
                    "seconds": time.perf_counter() - start_time,
                    "mean_return": mean_return,
                    "syncs": metrics.syncs,
                    "weight_bytes": metrics.weight_bytes,
                }
            )
            if global_step >= args.total_timesteps:
                break
        elapsed = time.perf_counter() - start_time
        metrics = learner.metrics
    finally:
        progress.close()
        await learner.aclose()
        if workers is not None:
            await workers.stop()
        if writer is not None:
            writer.close()

    result = {
        "example": "dqn_async",
        "env_id": args.env_id,
        "sync": args.sync,
        "kl_threshold": args.kl_threshold if args.sync == "aps" else None,
        "max_lag": make_sync(args).max_lag if args.sync == "aps" else None,
        "fixed_versions": args.fixed_versions if args.sync == "fixed" else None,
        "seed": args.seed,
        "workers": args.workers,
        "envs_per_worker": args.envs_per_worker,
        "global_step": global_step,
        "seconds": elapsed,
        "sps": global_step / elapsed,
        "episodes": episodes,
        "gradient_steps": updates,
        "final_episodes": len(returns),
        "final_return": float(np.mean(returns)) if returns else None,
        "versions": metrics.version,
        "bytes_per_version": bytes_per_version,
        "syncs": metrics.syncs,
        "weight_bytes": metrics.weight_bytes,
        "lag_mean": metrics.lag_mean,
        "lag_p95": lag_percentile(lags, 95.0),
        "lag_max": metrics.lag_max,
        "hidden_sizes": list(hidden_sizes(args)),
        "metrics": metrics.as_dict(),
        "curve": curve,
    }
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = asyncio.run(train(args))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(summary_line(result))


if __name__ == "__main__":
    main()
