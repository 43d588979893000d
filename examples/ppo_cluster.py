"""PPO where the workers act with their own copy of the policy (DETACH), CleanRL style.

Each iteration the learner publishes its agent as a new policy version, every worker acts
``num_steps`` steps on its envs with the version it holds, and the learner trains on the
batch. The sync strategy decides, per worker and before each rollout, whether the newest
version travels:

- ``--sync always``: every version goes to every worker (no staleness, the most traffic);
- ``--sync fixed --fixed-versions k``: a worker is synced once it is k versions behind;
- ``--sync aps --kl-threshold t``: Adaptive Policy Synchronization. The learner measures
  KL(worker's version || newest version) on the states that worker just acted on and syncs
  it when the KL exceeds t (``--max-lag`` bounds the staleness as well).

PPO stays correct with stale workers because the probability ratio uses the behaviour
log-probabilities the workers report (the policy that really acted). Advantages use the
learner's critic by default (``--no-recompute-values`` uses the values the workers' stale
critics reported, as the paper's prototype did); the bootstrap value always comes from the
learner's critic.

    python examples/ppo_cluster.py --sync aps --kl-threshold 0.05
    python examples/ppo_cluster.py --sync always --track-tb
    python examples/ppo_cluster.py --env-id LunarLander-v3 --total-timesteps 1000000 \\
        --envs-per-worker 16 --num-steps 128 --learning-rate 5e-4

Across machines: ``--listen tcp://0.0.0.0:7000 --external-workers`` starts no workers; it
writes a token file and prints the ``aps worker`` command to run on each worker machine (from
a checkout of this repository, which holds the policy, ``examples/ppo_cluster.py:Agent``).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import random
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
import torch.optim as optim
from torch.distributions.categorical import Categorical

import aps


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
    envs_per_worker: int = arg(8, "environments per worker")
    transport: str = arg("tcp", "tcp, unix, ws or memory")
    listen: str | None = arg(None, "listen on this URL (e.g. tcp://0.0.0.0:7000), with a token")
    external_workers: bool = arg(False, "start no workers: print the aps worker command instead")

    # Synchronization.
    sync: str = arg("aps", "aps, fixed or always")
    kl_threshold: float = arg(0.05, "APS: sync a worker when its KL to the learner exceeds this")
    max_lag: int | None = arg(None, "APS: also sync a worker this many versions behind")
    fixed_versions: int = arg(4, "fixed: sync a worker once it is this many versions behind")
    recompute_values: bool = arg(True, "GAE with the learner's critic (else the workers' values)")
    decoupled: bool = arg(True, "clip against the learner's policy, reweight by behaviour")

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
    args = Args(**vars(parser.parse_args(argv)))
    if args.sync not in ("aps", "fixed", "always"):
        parser.error(f"--sync must be aps, fixed or always, got {args.sync!r}")
    return args


def make_envs(args: Args) -> aps.ClusterEnv:
    """Local workers (the default), or a learner on ``--listen`` that workers dial."""
    policy = f"{Path(__file__).resolve()}:Agent"
    if args.listen is None and not args.external_workers:
        return aps.ClusterEnv.local(
            args.env_id,
            num_workers=args.workers,
            envs_per_worker=args.envs_per_worker,
            transport=args.transport,  # type: ignore[arg-type]
            autoreset_mode="SameStep",
            policy=policy,
            sync=make_sync(args),
        )
    # aps: a token guards a learner that other machines can reach; workers read it from a file.
    token = secrets.token_hex(16)
    token_file = Path("aps-token")
    token_file.touch(mode=0o600)
    token_file.write_text(token)
    launcher = None
    if args.external_workers:
        # Workers on other machines import the policy from their own checkout.
        policy = "examples/ppo_cluster.py:Agent"
    else:
        launcher = aps.launch.local(
            args.env_id, num_workers=args.workers, envs_per_worker=args.envs_per_worker
        )

    def announce(url: str) -> None:
        if args.external_workers:
            print(
                f"waiting for {args.workers} workers; on each worker machine, with the file "
                f"{token_file} copied, run from a checkout of this repository:\n"
                f"  aps worker {aps.launch.dialable_url(url)} --env {args.env_id} "
                f"--num-envs {args.envs_per_worker} --token-file {token_file} --policy {policy}",
                flush=True,
            )

    return aps.ClusterEnv(
        args.listen or "tcp://0.0.0.0:0",
        num_workers=args.workers,
        token=token,
        autoreset_mode="SameStep",
        policy=policy,
        sync=make_sync(args),
        launcher=launcher,
        on_listening=announce,
    )


def make_sync(args: Any) -> Any:
    if args.sync == "always":
        return aps.sync.AlwaysSync()
    if args.sync == "fixed":
        return aps.sync.FixedInterval(versions=args.fixed_versions)
    return aps.sync.APS(kl_threshold=args.kl_threshold, max_lag=args.max_lag)


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    """CleanRL's discrete PPO agent; the workers build it from this file by import path."""

    def __init__(self, envs: Any) -> None:
        super().__init__()
        obs_size = int(np.array(envs.single_observation_space.shape).prod())
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_size, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(obs_size, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, envs.single_action_space.n), std=0.01),
        )

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
    num_envs = args.workers * args.envs_per_worker
    batch_size = num_envs * args.num_steps
    minibatch_size = max(batch_size // args.num_minibatches, 1)
    num_iterations = max(args.total_timesteps // batch_size, 1)
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
    progress = Progress(num_iterations * batch_size, args.progress)
    try:
        agent = Agent(envs)
        optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
        bytes_per_version = sum(t.numel() * t.element_size() for t in agent.state_dict().values())
        returns: collections.deque[float] = collections.deque(maxlen=args.final_episodes)
        episodes = 0
        global_step = 0
        start_time = time.perf_counter()
        envs.reset(seed=args.seed)

        for iteration in range(1, num_iterations + 1):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            # aps: publish the weights as a new version; the strategy decides who gets it.
            envs.publish(agent)
            b = envs.rollout(args.num_steps)
            global_step += b.reward.size
            for ret, length in zip(b.episode_return, b.episode_length, strict=True):
                returns.append(float(ret))
                episodes += 1
                if writer is not None:
                    writer.add_scalar("charts/episodic_return", ret, global_step)
                    writer.add_scalar("charts/episodic_length", length, global_step)

            obs = torch.as_tensor(b.obs, dtype=torch.float32)
            actions = torch.as_tensor(b.actions)
            logprobs = torch.as_tensor(b.logprob)  # behaviour log-probs: the policy that acted
            rewards = torch.as_tensor(b.reward, dtype=torch.float32)
            dones = torch.as_tensor(b.terminated | b.truncated, dtype=torch.float32)

            # Advantages: GAE, bootstrapped from next_obs with the learner's critic. dones[t]
            # means step t ended an episode (SameStep: obs[t + 1] is already the next one).
            with torch.no_grad():
                if args.recompute_values or b.value is None:
                    values = agent.get_value(obs).squeeze(-1)
                else:
                    values = torch.as_tensor(b.value)
                next_value = agent.get_value(torch.as_tensor(b.next_obs)).reshape(1, -1)
                advantages = torch.zeros_like(rewards)
                lastgaelam = torch.zeros(num_envs)
                for t in reversed(range(args.num_steps)):
                    nextvalues = next_value[0] if t == args.num_steps - 1 else values[t + 1]
                    nextnonterminal = 1.0 - dones[t]
                    delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                    lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                    advantages[t] = lastgaelam
                returns_t = advantages + values

            # Flatten the batch.
            b_obs = obs.reshape((-1, *envs.single_observation_space.shape))
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape(-1)
            b_advantages = advantages.reshape(-1)
            b_returns = returns_t.reshape(-1)
            b_values = values.reshape(-1)
            # --decoupled (Hilton et al. 2021, "Batch size-invariance for policy optimization"):
            # clip the ratio against the learner's policy before this update (the proximal
            # policy) instead of the workers' stale one, and correct for the behaviour policy
            # with importance weights pi_prox / pi_behaviour, truncated at 1 as in V-trace.
            if args.decoupled:
                with torch.no_grad():
                    _, b_prox_logprobs, _, _ = agent.get_action_and_value(b_obs, b_actions)
                    b_weights = (b_prox_logprobs - b_logprobs).exp().clamp(max=1.0)
            else:
                b_prox_logprobs, b_weights = b_logprobs, torch.ones_like(b_logprobs)

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

                    # Policy loss
                    pg_loss1 = -mb_advantages * ratio
                    pg_loss2 = -mb_advantages * torch.clamp(
                        ratio, 1 - args.clip_coef, 1 + args.clip_coef
                    )
                    pg_loss = (b_weights[mb_inds] * torch.max(pg_loss1, pg_loss2)).mean()

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
            progress.update(
                b.reward.size, ret=f"{mean_return:.1f}", syncs=metrics.syncs, sps=f"{sps:,.0f}"
            )
            if on_iteration is not None:
                on_iteration(
                    {
                        "iteration": iteration,
                        "num_iterations": num_iterations,
                        "global_step": global_step,
                        "mean_return": mean_return,
                        "syncs": metrics.syncs,
                        "weight_bytes": metrics.weight_bytes,
                        "sps": sps,
                    }
                )
        elapsed = time.perf_counter() - start_time
        metrics = envs.metrics
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
        "max_lag": args.max_lag if args.sync == "aps" else None,
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
        "lag_max": metrics.lag_max,
        "metrics": metrics.as_dict(),
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(summary_line(train(args)))


if __name__ == "__main__":
    main()
