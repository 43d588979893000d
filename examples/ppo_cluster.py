"""PPO where the workers act with their own copy of the policy (DETACH), CleanRL style.

Discrete action spaces get CleanRL's categorical agent; float ``Box`` action spaces (Pendulum,
MuJoCo) get its Gaussian agent, whose log standard deviation is a learned parameter that does
not depend on the state, as in CleanRL's ``ppo_continuous_action.py``. Frames (a 3-d ``Box``
of observations channels last, as MinAtar's ``MinAtar/Breakout-v1``) get a small CNN.

Each iteration the learner publishes its agent as a new policy version, every worker acts
``num_steps`` steps on its envs with the version it holds, and the learner trains on the
batch. The sync strategy decides, per worker and before each rollout, whether the newest
version travels:

- ``--sync always``: every version goes to every worker (no staleness, the most traffic);
- ``--sync fixed --fixed-versions k``: a worker is synced once it is k versions behind;
- ``--sync aps --kl-threshold t``: Adaptive Policy Synchronization. The learner measures
  KL(worker's version || newest version) on the states that worker just acted on and syncs
  it when the KL exceeds t, or once it is ``--max-lag`` versions behind (APS's default
  bound unless given; ``--max-lag 0`` removes it, as in the paper);
- ``--sync relative --drift-updates u``: APS with its threshold in updates' worth of drift
  (:class:`aps.sync.RelativeAPS`): the worker's KL against ``u`` times the KL one update
  moved the policy on the same states, with the same ``--max-lag`` bound.

With ``--overlap-rollouts`` the workers act the next batch while the learner trains on this
one (:meth:`aps.ClusterEnv.rollout_async`), so acting and training share the machine's cores
instead of taking turns; each batch is then acted with weights at least one update behind
those it is trained on (the lag in the metrics counts versions at delivery, so it does not
show this update).

Stale data is corrected by :mod:`aps.correction`, as ``--correction`` says; every choice
uses the behaviour log-probabilities the workers report (the policy that really acted):

- ``decoupled`` (the default): decoupled PPO (Hilton et al., "Batch size-invariance for
  policy optimization"): the clip anchored at the learner's policy before the update, each
  sample weighted by min(1, pi_learner / pi_behaviour); GAE advantages;
- ``vtrace``: V-trace (IMPALA) advantages and value targets against the learner's policy
  before the update, with rho-bar = c-bar = 1 and ``--gae-lambda``, the clip anchored there;
- ``none``: PPO clipped against the behaviour policy (the paper's objective), GAE.

``--decoupled`` and ``--no-decoupled`` are aliases of ``--correction decoupled`` and
``--correction none``. A time limit ends an episode without a bootstrap, as CleanRL's
``dones`` do. Advantages use the learner's critic by default (``--no-recompute-values`` uses
the values the workers' stale critics reported, as the paper's prototype did); the bootstrap
value always comes from the learner's critic.

    python examples/ppo_cluster.py --sync aps --kl-threshold 0.05
    python examples/ppo_cluster.py --sync always --track-tb
    python examples/ppo_cluster.py --overlap-rollouts  # act and train at the same time
    python examples/ppo_cluster.py --sync always --weight-group  # versions leave the learner once
    python examples/ppo_cluster.py --figures runs/figures  # where the time goes: CSV, TensorBoard
    python examples/ppo_cluster.py --env-id LunarLander-v3 --total-timesteps 1000000 \\
        --envs-per-worker 16 --num-steps 128 --learning-rate 5e-4
    python examples/ppo_cluster.py --hidden-size 1024  # 2.1M parameters, 8.45 MB a version
    python examples/ppo_cluster.py --env-id MinAtar/Breakout-v1 --hidden-size 128 \\
        --sync relative --correction vtrace  # pip install minatar: pixels, a small CNN
    python examples/ppo_cluster.py --env-id Pendulum-v1 --total-timesteps 200000 --gamma 0.9 \\
        --num-steps 256 --update-epochs 10 --ent-coef 0 --norm-reward
    python examples/ppo_cluster.py --env-id HalfCheetah-v5 --total-timesteps 1000000 \\
        --num-steps 256 --update-epochs 10 --ent-coef 0 --learning-rate 3e-4 --norm-obs \\
        --norm-reward  # pip install "gymnasium[mujoco]"
    # workers started elsewhere: prints the aps worker command to run on each machine
    python examples/ppo_cluster.py --listen tcp://0.0.0.0:7000 --external-workers

The workers build the agent from this file by import path; the size travels inside that
path (``ppo_cluster.py:sized.h1024x2``, see :data:`sized`), so every worker builds the
learner's architecture whatever the command line.

Across machines, ``--listen URL`` starts no workers and waits for ``--workers`` of them, with
the token in ``$APS_TOKEN`` (or a fresh one written to ``aps-token``); ``--external-workers``
also prints the ``aps worker`` command to run on each worker machine, from a checkout of this
repository (which holds the policy: the command pins it with ``--policy``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
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
from typing import Any, TypeVar

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal

import aps
from aps.correction import decoupled_ppo_loss, gae, vtrace

CORRECTIONS = ("none", "decoupled", "vtrace")
SYNCS = ("aps", "relative", "fixed", "always")
Layer = TypeVar("Layer", nn.Linear, nn.Conv2d)


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
    figures: str | None = arg(None, "write the learner's figures (CSV, TensorBoard) to this dir")
    figures_interval: float = arg(10.0, "seconds between two writes of --figures")

    # Environment and cluster.
    env_id: str = arg("CartPole-v1", "the Gymnasium id of the environment")
    workers: int = arg(2, "number of worker processes")
    envs_per_worker: int = arg(8, "environments per worker")
    transport: str = arg("tcp", "tcp, unix, ws or memory")
    listen: str | None = arg(
        None, "listen here for --workers workers started elsewhere (token: $APS_TOKEN)"
    )
    external_workers: bool = arg(False, "start no workers: print the aps worker command")
    compression: str | None = arg(
        None, "how large arrays travel: auto, zstd, lz4 or none (default: aps's, auto)"
    )
    norm_obs: bool = arg(False, "normalize observations in each env (running mean and std)")
    norm_reward: bool = arg(False, "scale rewards by the running std of the discounted return")

    # Policy size (the weights that travel scale with hidden_size squared times num_layers).
    hidden_size: int = arg(64, "units in each hidden layer of the actor and of the critic")
    num_layers: int = arg(2, "hidden layers of the actor and of the critic")

    # Synchronization.
    sync: str = arg("aps", "aps, relative, fixed or always")
    kl_threshold: float = arg(0.05, "APS: sync a worker when its KL to the learner exceeds this")
    drift_updates: float = arg(
        4.0, "relative: sync a worker once its KL exceeds this many updates' worth of drift"
    )
    weight_precision: str = arg("exact", "how weights travel: exact, or float16 (half the bytes)")
    overlap_weights: bool = arg(
        False, "a chosen version travels while workers act with theirs (applies a chunk later)"
    )
    overlap_rollouts: bool = arg(
        False, "act the next rollout while training on this one (acted one update behind)"
    )
    weight_group: bool = arg(
        False, "versions leave the learner once, through a gloo group of all workers"
    )
    max_lag: int | None = arg(
        None, "APS, relative: also sync a worker this many versions behind (0: no bound)"
    )
    fixed_versions: int = arg(4, "fixed: sync a worker once it is this many versions behind")
    recompute_values: bool = arg(True, "GAE with the learner's critic (else the workers' values)")
    correction: str = arg(
        "decoupled", "stale data: decoupled (clip at the learner's policy), vtrace or none"
    )

    # PPO.
    total_timesteps: int = arg(100_000, "total env steps of the experiment")
    learning_rate: float = arg(1e-3, "the learning rate of the optimizer")
    num_steps: int = arg(32, "steps per env per rollout")
    anneal_lr: bool = arg(True, "anneal the learning rate linearly to 0")
    gamma: float = arg(0.99, "the discount factor")
    gae_lambda: float = arg(0.95, "the lambda of generalized advantage estimation")
    num_minibatches: int = arg(4, "the number of minibatches")
    update_epochs: int = arg(4, "the number of epochs per update")
    norm_adv: bool = arg(True, "normalize advantages")
    clip_coef: float = arg(0.2, "the surrogate clipping coefficient")
    clip_vloss: bool = arg(True, "clip the value loss")
    ent_coef: float = arg(0.01, "coefficient of the entropy bonus")
    vf_coef: float = arg(0.5, "coefficient of the value loss")
    max_grad_norm: float = arg(0.5, "the maximum norm of the gradient")
    target_kl: float | None = arg(None, "stop an update early past this approximate KL")
    final_episodes: int = arg(50, "the final return is the mean over this many last episodes")


def parse_args(argv: list[str] | None = None) -> Args:
    """Build an argparse parser from the Args fields (``--env-id``, ``--no-anneal-lr``, ...)."""
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
    for flag, value in (("--decoupled", "decoupled"), ("--no-decoupled", "none")):
        parser.add_argument(
            flag,
            dest="correction",
            action="store_const",
            const=value,
            default=argparse.SUPPRESS,
            help=f"alias of --correction {value}",
        )
    args = Args(**vars(parser.parse_args(argv)))
    if args.correction not in CORRECTIONS:
        parser.error(
            f"--correction must be one of {', '.join(CORRECTIONS)}, got {args.correction!r}"
        )
    if args.sync not in SYNCS:
        parser.error(f"--sync must be one of {', '.join(SYNCS)}, got {args.sync!r}")
    if args.compression not in (None, *aps.wire.compression.SETTINGS):
        choices = ", ".join(aps.wire.compression.SETTINGS)
        parser.error(f"--compression must be one of {choices}, got {args.compression!r}")
    if args.weight_precision not in ("exact", "float16"):
        parser.error(f"--weight-precision must be exact or float16, got {args.weight_precision!r}")
    for name in ("hidden_size", "num_layers"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            parser.error(f"{flag} must be an int >= 1, got {getattr(args, name)}")
    return args


def make_sync(args: Any) -> Any:
    if args.sync == "always":
        return aps.sync.AlwaysSync()
    if args.sync == "fixed":
        return aps.sync.FixedInterval(versions=args.fixed_versions)
    # Without --max-lag, the strategy's own default staleness bound; 0 removes the bound.
    bound = {} if args.max_lag is None else {"max_lag": args.max_lag or None}
    if args.sync == "relative":
        return aps.sync.RelativeAPS(updates=args.drift_updates, **bound)
    return aps.sync.APS(kl_threshold=args.kl_threshold, **bound)


def layer_init(layer: Layer, std: float = np.sqrt(2), bias_const: float = 0.0) -> Layer:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


def mlp(
    in_size: int, hidden_size: int, num_layers: int, out_size: int, std: float
) -> nn.Sequential:
    """``num_layers`` Tanh layers of ``hidden_size`` units, then a linear output layer."""
    layers: list[nn.Module] = []
    for i in range(num_layers):
        layers += [
            layer_init(nn.Linear(in_size if i == 0 else hidden_size, hidden_size)),
            nn.Tanh(),
        ]
    layers.append(layer_init(nn.Linear(hidden_size, out_size), std=std))
    return nn.Sequential(*layers)


class Agent(nn.Module):
    """CleanRL's discrete PPO agent (64-64 Tanh by default); the workers build it by import path."""

    def __init__(self, envs: Any, hidden_size: int = 64, num_layers: int = 2) -> None:
        super().__init__()
        obs_size = int(np.array(envs.single_observation_space.shape).prod())
        self.critic = mlp(obs_size, hidden_size, num_layers, 1, std=1.0)
        self.actor = mlp(obs_size, hidden_size, num_layers, envs.single_action_space.n, std=0.01)

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = self.actor(x)
        probs = Categorical(logits=logits)
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action), probs.entropy(), self.critic(x)


class GaussianAgent(nn.Module):
    """CleanRL's continuous PPO agent: a Gaussian actor with a learned, state-independent
    log standard deviation (``actor_logstd``), and a critic."""

    def __init__(self, envs: Any, hidden_size: int = 64, num_layers: int = 2) -> None:
        super().__init__()
        obs_size = int(np.array(envs.single_observation_space.shape).prod())
        action_size = int(np.prod(envs.single_action_space.shape))
        self.critic = mlp(obs_size, hidden_size, num_layers, 1, std=1.0)
        self.actor_mean = mlp(obs_size, hidden_size, num_layers, action_size, std=0.01)
        self.actor_logstd = nn.Parameter(torch.zeros(1, action_size))

    def get_value(self, x: torch.Tensor) -> torch.Tensor:
        return self.critic(x)

    def get_action_and_value(
        self, x: torch.Tensor, action: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        action_mean = self.actor_mean(x)
        probs = Normal(action_mean, self.actor_logstd.expand_as(action_mean).exp())
        if action is None:
            action = probs.sample()
        return action, probs.log_prob(action).sum(1), probs.entropy().sum(1), self.critic(x)


class ConvTower(nn.Module):
    """MinAtar's network (Young and Tian, 2019) on frames ``[..., H, W, C]`` channels last:
    one 3x3 conv of 16 filters, ``hidden_size`` ReLU units, then a linear output layer.

    Any leading axes (``[B]``, or the learner's ``[T, E]``) are kept, as ``nn.Linear`` keeps them.
    """

    def __init__(self, shape: tuple[int, ...], hidden_size: int, out_size: int, std: float) -> None:
        super().__init__()
        height, width, channels = shape
        self.net = nn.Sequential(
            layer_init(nn.Conv2d(channels, 16, 3)),
            nn.ReLU(),
            nn.Flatten(),
            layer_init(nn.Linear(16 * (height - 2) * (width - 2), hidden_size)),
            nn.ReLU(),
            layer_init(nn.Linear(hidden_size, out_size), std=std),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames = x.reshape(-1, *x.shape[-3:]).float().permute(0, 3, 1, 2)
        out: torch.Tensor = self.net(frames)
        return out.reshape(*x.shape[:-3], -1)


class ConvAgent(Agent):
    """The categorical agent on small frames (MinAtar): an actor and a critic tower each.

    Two towers, not a shared trunk, so :class:`aps.policy.Policy` calls each head on the
    frames directly; at 10 x 10 pixels the second convolution costs little.
    """

    def __init__(self, envs: Any, hidden_size: int = 128) -> None:
        nn.Module.__init__(self)
        shape = tuple(envs.single_observation_space.shape)
        self.critic = ConvTower(shape, hidden_size, 1, std=1.0)
        self.actor = ConvTower(shape, hidden_size, envs.single_action_space.n, std=0.01)


def make_agent(envs: Any, hidden_size: int = 64, num_layers: int = 2) -> nn.Module:
    """The agent for the envs' spaces: Gaussian for a float Box of actions; else a CNN for
    frames (a 3-d observation Box; ``num_layers`` unused), else CleanRL's categorical MLP."""
    if isinstance(envs.single_action_space, gym.spaces.Box):
        return GaussianAgent(envs, hidden_size=hidden_size, num_layers=num_layers)
    if len(envs.single_observation_space.shape or ()) == 3:
        return ConvAgent(envs, hidden_size=hidden_size)
    return Agent(envs, hidden_size=hidden_size, num_layers=num_layers)


def make_env(env_id: str, norm_obs: bool = False) -> gym.Env[Any, Any]:
    """The env a worker hosts: CleanRL's continuous-control wrappers that keep rewards raw.

    Observations are normalized (and clipped to [-10, 10]) here, on the worker, when
    ``norm_obs``; the learner then trains on exactly what the workers' policies saw. Rewards
    are never changed here, so the returns the workers report are the env's own; the learner
    scales them for training (``--norm-reward``). ``MinAtar/...`` ids are registered here,
    where the env is made (``pip install minatar``).
    """
    if env_id.startswith("MinAtar/") and env_id not in gym.registry:
        from minatar.gym import register_envs

        register_envs()
    env = gym.make(env_id)
    if norm_obs:
        env = gym.wrappers.NormalizeObservation(env)
        env = gym.wrappers.TransformObservation(
            env, lambda obs: np.clip(obs, -10, 10), env.observation_space
        )
    return env


class RewardScaler:
    """Gymnasium's NormalizeReward on the learner: rewards divided by the running standard
    deviation of each env's discounted return, then clipped to [-10, 10]."""

    def __init__(self, num_envs: int, gamma: float) -> None:
        self.gamma, self.discounted = gamma, np.zeros(num_envs)
        self.count, self.mean, self.var = 1e-4, 0.0, 1.0

    def __call__(self, rewards: np.ndarray, dones: np.ndarray) -> np.ndarray:
        """Scale ``rewards [T, E]``; ``dones [T, E]`` end each env's discounted return."""
        returns = np.empty_like(rewards, dtype=np.float64)
        for t in range(rewards.shape[0]):
            self.discounted = self.discounted * self.gamma + rewards[t]
            returns[t] = self.discounted
            self.discounted = self.discounted * (1.0 - dones[t])
        # Welford's parallel update with the batch's moments (gymnasium's RunningMeanStd).
        batch_mean, batch_var, batch_count = returns.mean(), returns.var(), returns.size
        delta, total = batch_mean - self.mean, self.count + batch_count
        self.mean += delta * batch_count / total
        m2 = self.var * self.count + batch_var * batch_count
        self.var = (m2 + delta**2 * self.count * batch_count / total) / total
        self.count = total
        scaled = rewards / math.sqrt(self.var + 1e-8)
        return np.clip(scaled, -10.0, 10.0).astype(np.float32)


class AgentsBySize:
    """Agent factories named by size: ``sized.h256x3`` is ``make_agent(envs, hidden_size=256,
    num_layers=3)``.

    A worker builds its agent from an import path alone, so the path carries the size:
    ``f"{__file__}:sized.h256x3"`` (:func:`policy_path`).
    """

    def __getattr__(self, name: str) -> Callable[[Any], nn.Module]:
        match = re.fullmatch(r"h([1-9][0-9]*)x([1-9][0-9]*)", name)
        if match is None:
            raise AttributeError(f"{name!r} is no agent size; write h<hidden_size>x<num_layers>")
        hidden_size, num_layers = int(match[1]), int(match[2])
        return lambda envs: make_agent(envs, hidden_size=hidden_size, num_layers=num_layers)


sized = AgentsBySize()


def policy_path(args: Args) -> str:
    """The import path the workers build the learner's agent from, size included."""
    return f"{Path(__file__).resolve()}:sized.h{args.hidden_size}x{args.num_layers}"


def compression_kwargs(args: Args) -> dict[str, Any]:
    """``compression=`` for the cluster only when ``--compression`` was given."""
    return {} if args.compression is None else {"compression": args.compression}


def make_envs(args: Args) -> Any:
    """Local workers (the default), or a learner on ``--listen`` that workers dial."""
    if args.listen is None and not args.external_workers:
        return aps.ClusterEnv.local(
            f"{Path(__file__).resolve()}:make_env",
            env_kwargs={"env_id": args.env_id, "norm_obs": args.norm_obs},
            num_workers=args.workers,
            envs_per_worker=args.envs_per_worker,
            transport=args.transport,  # type: ignore[arg-type]
            autoreset_mode="SameStep",
            policy=policy_path(args),
            sync=make_sync(args),
            weight_precision=args.weight_precision,  # type: ignore[arg-type]
            overlap_weights=args.overlap_weights,
            **compression_kwargs(args),
        )
    # aps: a token guards a learner other machines can reach; workers read it from a file.
    token = os.environ.get("APS_TOKEN")
    token_file = Path("aps-token")
    if token is None:
        token = secrets.token_hex(32)  # 256 bits, as aps token writes
        token_file.touch(mode=0o600)
        token_file.write_text(token)
    policy = policy_path(args)
    if args.external_workers:
        # Workers on other machines import the policy from their own checkout.
        policy = f"examples/ppo_cluster.py:sized.h{args.hidden_size}x{args.num_layers}"

    def announce(url: str) -> None:
        if not args.external_workers:
            return
        env = f"--env {args.env_id}"
        if args.norm_obs:
            kwargs = json.dumps({"env_id": args.env_id, "norm_obs": True})
            env = f"--env examples/ppo_cluster.py:make_env --env-kwargs '{kwargs}'"
        print(
            f"waiting for {args.workers} workers; on each worker machine, with the file "
            f"{token_file} copied, run from a checkout of this repository:\n"
            f"  aps worker {aps.launch.dialable_url(url)} {env} "
            f"--num-envs {args.envs_per_worker} --token-file {token_file} --policy {policy}"
            + ("" if args.compression is None else f" --compression {args.compression}"),
            flush=True,
        )

    return aps.ClusterEnv(
        args.listen or "tcp://0.0.0.0:0",
        num_workers=args.workers,
        token=token,
        autoreset_mode="SameStep",
        policy=policy,
        sync=make_sync(args),
        weight_precision=args.weight_precision,  # type: ignore[arg-type]
        overlap_weights=args.overlap_weights,
        on_listening=announce,
        **compression_kwargs(args),
    )


class Progress:
    """A line on stderr rewritten in place: tqdm's bar when it is installed, else a text bar.

    When stderr is not a terminal (a log, a test), one plain line per update instead.
    """

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.tty = sys.stderr.isatty()
        self.bar: Any = None
        if enabled and self.tty:
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
            filled = int(20 * min(self.done / self.total, 1.0))
            text = " ".join(f"{k}={v}" for k, v in postfix.items())
            line = f"[{'#' * filled:<20}] {self.done:,}/{self.total:,} {text}"
            if self.tty:
                print(f"\r{line}\033[K", end="", file=sys.stderr, flush=True)
            else:
                print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.tty:
            print(file=sys.stderr)


def figures_logger(envs: Any, args: Args) -> aps.metrics.MetricsLogger:
    """aps: the learner's figures to ``--figures``/figures.csv and TensorBoard (if it imports).

    Written every ``--figures-interval`` seconds by ``tick()``; without ``--figures`` nowhere.
    """
    writers: list[aps.metrics.MetricsWriter] = []
    if args.figures is not None:
        Path(args.figures).mkdir(parents=True, exist_ok=True)
        writers.append(aps.metrics.CSVWriter(Path(args.figures) / "figures.csv"))
        try:
            writers.append(aps.metrics.TensorBoardWriter(args.figures))
        except aps.MissingDependency:
            print("tensorboard does not import (pip install tensorboard): figures to CSV only")
    return aps.metrics.MetricsLogger(envs, writers, args.figures_interval)


def make_writer(args: Any, run_name: str) -> Any:
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


def lag_percentile(counts: np.ndarray, q: float) -> int:
    """The ``q``-th percentile (lower) of the lags whose transition counts are ``counts``."""
    total = int(counts.sum())
    if total == 0:
        return 0
    return int(np.searchsorted(np.cumsum(counts), math.ceil(q / 100.0 * total)))


def summary_line(result: dict[str, Any]) -> str:
    final = result["final_return"]
    ret = "n/a" if final is None else f"{final:.1f}"
    return (
        f"summary: final mean return {ret} over the last {result['final_episodes']} episodes | "
        f"{result['syncs']} syncs, {result['weight_bytes'] / 1e6:.2f} MB of weights "
        f"({result['versions']} versions published) | lag mean {result['lag_mean']:.2f} "
        f"max {result['lag_max']} | {result['sps']:,.0f} env-steps/s"
    )


def train(
    args: Args, on_iteration: Callable[[dict[str, Any]], None] | None = None
) -> dict[str, Any]:
    """Run the experiment; return the final figures (and write them to ``args.json``)."""
    run_name = f"{args.env_id}__{args.exp_name}__{args.sync}__{args.seed}__{int(time.time())}"
    writer = make_writer(args, run_name)

    # Seeding: the learner (torch, numpy) and the envs (reset(seed=...)). The workers sample
    # their actions with generators aps seeds from the OS, so runs do not repeat exactly.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_num_threads(args.torch_threads)

    envs = make_envs(args)
    num_envs = envs.num_envs  # workers started elsewhere choose their own number of envs
    batch_size = num_envs * args.num_steps
    minibatch_size = max(batch_size // args.num_minibatches, 1)
    num_iterations = max(args.total_timesteps // batch_size, 1)
    scale_rewards = RewardScaler(num_envs, args.gamma) if args.norm_reward else None
    progress = Progress(num_iterations * batch_size, args.progress)
    try:
        first = previous = envs.metrics  # aps: the learner's figures at the start
        figures = figures_logger(envs, args)
        agent = make_agent(envs, hidden_size=args.hidden_size, num_layers=args.num_layers)
        optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
        bytes_per_version = sum(t.numel() * t.element_size() for t in agent.state_dict().values())
        returns: collections.deque[float] = collections.deque(maxlen=args.final_episodes)
        episodes = 0
        global_step = 0
        lag_counts = np.zeros(1, dtype=np.int64)  # transitions per policy lag, for percentiles
        curve: list[dict[str, Any]] = []  # one row per iteration: the learning curve
        start_time = time.perf_counter()
        envs.reset(seed=args.seed)
        if args.weight_group:
            # aps: from the first version on, each leaves the learner once (docs/detach.md).
            envs.form_weight_group()

        for iteration in range(1, num_iterations + 1):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # aps: publish the weights as a new version; the strategy decides who gets it.
            rollout_start = time.perf_counter()
            if not args.overlap_rollouts:
                envs.publish(agent)
                b = envs.rollout(args.num_steps)
            else:
                # The next batch is acted while this one trains, with the versions synced
                # when it starts: acting and training overlap, one update more stale.
                if iteration == 1:
                    envs.publish(agent)
                    envs.rollout_async(args.num_steps)
                b = envs.rollout_wait()
                if iteration < num_iterations:
                    if iteration > 1:
                        envs.publish(agent)  # trained on the last batch since it was published
                    envs.rollout_async(args.num_steps)
            rollout_seconds = time.perf_counter() - rollout_start
            global_step += b.reward.size
            lags = np.bincount(b.lag.reshape(-1))
            if lags.size > lag_counts.size:
                lag_counts = np.pad(lag_counts, (0, lags.size - lag_counts.size))
            lag_counts[: lags.size] += lags
            for ret, length in zip(b.episode_return, b.episode_length, strict=True):
                returns.append(float(ret))
                episodes += 1
                if writer is not None:
                    writer.add_scalar("charts/episodic_return", ret, global_step)
                    writer.add_scalar("charts/episodic_length", length, global_step)

            obs = torch.as_tensor(b.obs, dtype=torch.float32)
            actions = torch.as_tensor(b.actions)
            logprobs = torch.as_tensor(b.logprob)  # behaviour log-probs: the policy that acted
            done_flags = b.terminated | b.truncated
            reward = b.reward if scale_rewards is None else scale_rewards(b.reward, done_flags)

            # Flatten the batch.
            b_obs = obs.reshape((-1, *envs.single_observation_space.shape))
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape((-1, *envs.single_action_space.shape))
            with torch.no_grad():
                if args.recompute_values or b.value is None:
                    values = agent.get_value(obs).squeeze(-1)
                else:
                    values = torch.as_tensor(b.value)
                next_obs = torch.as_tensor(b.next_obs, dtype=torch.float32)  # MuJoCo: float64
                next_value = agent.get_value(next_obs).reshape(-1)
                # The learner's policy before this update (the proximal policy): the clip's
                # anchor and V-trace's target. With no correction the behaviour policy is both.
                if args.correction == "none":
                    b_prox_logprobs = b_logprobs
                else:
                    _, b_prox_logprobs, _, _ = agent.get_action_and_value(b_obs, b_actions)

            # aps.correction: advantages and value targets bootstrapped from next_obs with the
            # learner's critic. done_flags[t]: step t ended an episode (SameStep: obs[t + 1] is
            # already the next one's), a time limit without a bootstrap, as CleanRL's dones.
            if args.correction == "vtrace":
                targets = vtrace(
                    b.logprob,
                    b_prox_logprobs.reshape(b.logprob.shape).numpy(),
                    reward,
                    values.numpy(),
                    next_value.numpy(),
                    done_flags,
                    gamma=args.gamma,
                    lam=args.gae_lambda,
                )
            else:
                targets = gae(
                    reward,
                    values.numpy(),
                    next_value.numpy(),
                    done_flags,
                    gamma=args.gamma,
                    lam=args.gae_lambda,
                )
            b_advantages = torch.as_tensor(targets.advantages, dtype=torch.float32).reshape(-1)
            b_returns = torch.as_tensor(targets.returns, dtype=torch.float32).reshape(-1)
            b_values = values.reshape(-1)
            # The loss weighs each sample by pi_prox / pi_behaviour (capped at 1) under
            # decoupled; V-trace's advantages already carry that weight, so it passes the
            # proximal log-probs twice (a weight of exactly 1), as does no correction.
            b_behaviour = b_logprobs if args.correction == "decoupled" else b_prox_logprobs

            # Optimize the policy and value network.
            b_inds = np.arange(batch_size)
            clipfracs = []
            for _epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for start in range(0, batch_size, minibatch_size):
                    mb_inds = b_inds[start : start + minibatch_size]
                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                        b_obs[mb_inds], b_actions[mb_inds]
                    )
                    logratio = newlogprob - b_prox_logprobs[mb_inds]
                    ratio = logratio.exp()

                    with torch.no_grad():
                        old_approx_kl = (-logratio).mean()
                        approx_kl = ((ratio - 1) - logratio).mean()
                        clipfracs += [((ratio - 1.0).abs() > args.clip_coef).float().mean().item()]

                    mb_advantages = b_advantages[mb_inds]
                    if args.norm_adv:
                        mb_advantages = (mb_advantages - mb_advantages.mean()) / (
                            mb_advantages.std() + 1e-8
                        )

                    # Policy loss: PPO's clipped loss anchored at b_prox_logprobs, weighted.
                    pg_loss = decoupled_ppo_loss(
                        newlogprob,
                        b_prox_logprobs[mb_inds],
                        b_behaviour[mb_inds],
                        mb_advantages,
                        clip_coef=args.clip_coef,
                    ).mean()

                    # Value loss
                    newvalue = newvalue.view(-1)
                    if args.clip_vloss:
                        v_loss_unclipped = (newvalue - b_returns[mb_inds]) ** 2
                        v_clipped = b_values[mb_inds] + torch.clamp(
                            newvalue - b_values[mb_inds], -args.clip_coef, args.clip_coef
                        )
                        v_loss_clipped = (v_clipped - b_returns[mb_inds]) ** 2
                        v_loss = 0.5 * torch.max(v_loss_unclipped, v_loss_clipped).mean()
                    else:
                        v_loss = 0.5 * ((newvalue - b_returns[mb_inds]) ** 2).mean()

                    entropy_loss = entropy.mean()
                    loss = pg_loss - args.ent_coef * entropy_loss + v_loss * args.vf_coef

                    optimizer.zero_grad()
                    loss.backward()
                    nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                    optimizer.step()

                if args.target_kl is not None and approx_kl > args.target_kl:
                    break

            y_pred, y_true = b_values.numpy(), b_returns.numpy()
            var_y = np.var(y_true)
            explained_var = np.nan if var_y == 0 else 1 - np.var(y_true - y_pred) / var_y

            metrics = envs.metrics
            sps = global_step / (time.perf_counter() - start_time)
            mean_return = float(np.mean(returns)) if returns else math.nan
            if writer is not None:
                writer.add_scalar(
                    "charts/learning_rate", optimizer.param_groups[0]["lr"], global_step
                )
                writer.add_scalar("charts/SPS", sps, global_step)
                writer.add_scalar("charts/weight_syncs", metrics.syncs, global_step)
                writer.add_scalar("charts/weight_bytes", metrics.weight_bytes, global_step)
                writer.add_scalar("charts/lag_mean", float(b.lag.mean()), global_step)
                writer.add_scalar("charts/lag_max", int(b.lag.max()), global_step)
                for w in metrics.workers:
                    writer.add_scalar(f"workers/{w.worker_id}/weight_syncs", w.syncs, global_step)
                    if w.divergences:
                        writer.add_scalar(
                            f"workers/{w.worker_id}/divergence", w.divergences[-1], global_step
                        )
                writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
                writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
                writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
                writer.add_scalar("losses/old_approx_kl", old_approx_kl.item(), global_step)
                writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
                writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
                writer.add_scalar("losses/explained_variance", explained_var, global_step)
            window = metrics.since(previous)  # aps: this iteration's figures
            rates, previous = window.rates(), metrics
            progress.update(
                b.reward.size,
                ret=f"{mean_return:.1f}",
                sps=f"{rates['env_steps']:,.0f}",
                lag=f"{window.lag_mean:.2f}",
                wire=f"{(rates['bytes_received'] + rates['bytes_sent']) / 1e6:.2f}MB/s",
                syncs=metrics.syncs,
            )
            figures.tick()
            row = {
                "iteration": iteration,
                "num_iterations": num_iterations,
                "global_step": global_step,
                "seconds": time.perf_counter() - start_time,
                "rollout_seconds": rollout_seconds,  # publish and rollout: syncs happen here
                "mean_return": mean_return,
                "syncs": metrics.syncs,
                "weight_bytes": metrics.weight_bytes,
                "sps": sps,
            }
            curve.append(row)
            if on_iteration is not None:
                on_iteration(row)
        elapsed = time.perf_counter() - start_time
        figures.close()  # a last row, before the learner closes
        metrics = envs.metrics
        group = envs.weight_group
        group_bytes = None if group is None else group.bytes_sent
    finally:
        progress.close()
        envs.close()
        if writer is not None:
            writer.close()

    result = {
        "example": "ppo_cluster",
        "env_id": args.env_id,
        "sync": args.sync,
        "kl_threshold": args.kl_threshold if args.sync == "aps" else None,
        "max_lag": make_sync(args).max_lag if args.sync == "aps" else None,
        "weight_precision": args.weight_precision,
        "overlap_weights": args.overlap_weights,
        "overlap_rollouts": args.overlap_rollouts,
        "weight_group": args.weight_group,
        # What the learner sent in the group's collectives (None: no group, or it ended).
        "weight_group_bytes": group_bytes,
        "compression": args.compression,
        "fixed_versions": args.fixed_versions if args.sync == "fixed" else None,
        "seed": args.seed,
        "workers": args.workers,
        "envs_per_worker": args.envs_per_worker,
        "global_step": global_step,
        "seconds": elapsed,
        "sps": global_step / elapsed,
        "episodes": episodes,
        "final_episodes": len(returns),
        "final_return": float(np.mean(returns)) if returns else None,
        "versions": metrics.version,
        "bytes_per_version": bytes_per_version,
        "syncs": metrics.syncs,
        "weight_bytes": metrics.weight_bytes,
        # In this loop every rollout waits for every worker, so always-sync would send each
        # published version to each worker: exactly this many bytes.
        "always_sync_weight_bytes": metrics.version * args.workers * bytes_per_version,
        "lag_mean": metrics.lag_mean,
        "lag_p95": lag_percentile(lag_counts, 95.0),
        "lag_max": metrics.lag_max,
        "hidden_size": args.hidden_size,
        "num_layers": args.num_layers,
        "correction": args.correction,
        "decoupled": args.correction == "decoupled",
        "metrics": metrics.as_dict(),
        "verdict": aps.metrics.verdict(metrics.since(first)).line,  # what bounded the run
        "curve": curve,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = train(args)
    print(summary_line(result))
    print(f"verdict: {result['verdict']}")


if __name__ == "__main__":
    main()
