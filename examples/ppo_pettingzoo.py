"""Parameter-sharing PPO on a PettingZoo env (mpe2's simple_spread) through aps.ClusterEnv.

CleanRL's ``ppo.py`` with one policy for every agent: the workers host copies of a PettingZoo
``ParallelEnv`` and aps lays each agent of each copy out as one env slot
(:mod:`aps.multiagent`), so the learner sees a Gymnasium vector env of
``workers x copies x agents`` slots with the agents' shared spaces and acts for all of them
in one batch. Look for ``# aps:`` for what differs from a single-agent script: the env
(an import path of a factory returning a ParallelEnv) and the live-agent mask.

The mask ``info["agent_active"]`` comes with every observation: a slot whose mask is False
holds no live agent (its agent left, or its copy is between episodes), so its transition is
padding and is left out of the loss. simple_spread's agents all stay to the end of each
episode, so its mask is always True; an env whose agents die needs it.

Autoreset is ``SameStep``, the semantics CleanRL's loop was written for: when a copy's
episode ends, the step returns the next episode's first observations.

    pip install 'aps-rl[pettingzoo]' mpe2
    python examples/ppo_pettingzoo.py --workers 2 --copies-per-worker 4
    python examples/ppo_pettingzoo.py --figures runs/spread  # figures: CSV, TensorBoard
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical

import aps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--seed", type=int, default=1, help="seed of the experiment")
    add("--torch-threads", type=int, default=1, help="torch CPU threads of the learner")
    add(
        "--env",
        default="mpe2.simple_spread_v3:parallel_env",
        help="import path of a factory that returns a PettingZoo ParallelEnv",
    )
    add("--env-kwargs", default='{"continuous_actions": false}', help="the factory's kwargs")
    add("--workers", type=int, default=2, help="number of worker processes")
    add("--copies-per-worker", type=int, default=4, help="env copies per worker")
    add("--transport", default="tcp", choices=["tcp", "unix", "ws", "memory"], help="transport")
    add("--total-timesteps", type=int, default=300_000, help="agent-steps in all")
    add("--learning-rate", type=float, default=2.5e-4, help="Adam's learning rate")
    add("--num-steps", type=int, default=128, help="steps per rollout (per slot)")
    add("--gamma", type=float, default=0.99, help="discount")
    add("--gae-lambda", type=float, default=0.95, help="GAE lambda")
    add("--num-minibatches", type=int, default=4, help="minibatches per epoch")
    add("--update-epochs", type=int, default=4, help="epochs per update")
    add("--clip-coef", type=float, default=0.2, help="PPO clip coefficient")
    add("--ent-coef", type=float, default=0.01, help="entropy coefficient")
    add("--vf-coef", type=float, default=0.5, help="value loss coefficient")
    add("--max-grad-norm", type=float, default=0.5, help="gradient clipping norm")
    add("--figures", default=None, help="write the learner's figures to this directory")
    add("--figures-interval", type=float, default=10.0, help="seconds between two --figures")
    return parser.parse_args(argv)


def layer_init(layer: nn.Linear, std: float = float(np.sqrt(2)), bias: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias)
    return layer


class Agent(nn.Module):
    """One actor-critic shared by every agent (parameter sharing)."""

    def __init__(self, envs: aps.ClusterEnv) -> None:
        super().__init__()
        size = int(np.prod(envs.single_observation_space.shape))
        actions = int(envs.single_action_space.n)
        self.critic = nn.Sequential(
            layer_init(nn.Linear(size, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor = nn.Sequential(
            layer_init(nn.Linear(size, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, actions), std=0.01),
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


def figures_logger(envs: aps.ClusterEnv, args: argparse.Namespace) -> aps.metrics.MetricsLogger:
    """The learner's figures to ``--figures``/figures.csv and TensorBoard (if it imports).

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


def show(line: str, last: bool) -> None:
    """The progress line: rewritten in place on a terminal, one line per call in a log."""
    tty = sys.stdout.isatty()
    print(f"\r{line}\033[K" if tty else line, end="\n" if last or not tty else "", flush=True)


def main(argv: list[str] | None = None) -> dict[str, float]:
    import json

    args = parse_args(argv)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)

    # aps: the workers build copies of a ParallelEnv; each agent of each copy is one slot.
    envs = aps.ClusterEnv.local(
        args.env,
        num_workers=args.workers,
        envs_per_worker=args.copies_per_worker,
        env_kwargs=json.loads(args.env_kwargs),
        transport=args.transport,
        autoreset_mode="SameStep",
    )
    try:
        return train(args, envs)
    finally:
        envs.close()


def train(args: argparse.Namespace, envs: aps.ClusterEnv) -> dict[str, float]:
    n = envs.num_envs
    batch_size = args.num_steps * n
    minibatch_size = batch_size // args.num_minibatches
    num_iterations = max(1, args.total_timesteps // batch_size)
    print(f"{n} agent slots ({args.workers} workers x {args.copies_per_worker} copies x agents)")
    first_snapshot = previous = envs.metrics  # aps: the learner's figures
    figures = figures_logger(envs, args)

    agent = Agent(envs)
    optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
    obs_shape = envs.single_observation_space.shape
    obs = torch.zeros((args.num_steps, n, *obs_shape))
    actions = torch.zeros((args.num_steps, n), dtype=torch.long)
    logprobs = torch.zeros((args.num_steps, n))
    rewards = torch.zeros((args.num_steps, n))
    dones = torch.zeros((args.num_steps, n))
    values = torch.zeros((args.num_steps, n))
    active = torch.zeros((args.num_steps, n))  # aps: the live-agent mask of each obs

    next_obs_np, info = envs.reset(seed=args.seed)
    next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32)
    next_active = torch.as_tensor(info["agent_active"], dtype=torch.float32)
    next_done = torch.zeros(n)
    episode_return = np.zeros(n)
    returns: list[float] = []
    global_step = last_step = 0
    last_time = time.time()
    for iteration in range(1, num_iterations + 1):
        for step in range(args.num_steps):
            global_step += int(next_active.sum())
            obs[step] = next_obs
            dones[step] = next_done
            active[step] = next_active
            with torch.no_grad():
                action, logprob, _, value = agent.get_action_and_value(next_obs)
                values[step] = value.flatten()
            actions[step] = action
            logprobs[step] = logprob
            next_obs_np, reward, terminations, truncations, info = envs.step(action.numpy())
            done = np.logical_or(terminations, truncations)
            rewards[step] = torch.as_tensor(reward, dtype=torch.float32)
            next_obs = torch.as_tensor(next_obs_np, dtype=torch.float32)
            next_done = torch.as_tensor(done, dtype=torch.float32)
            next_active = torch.as_tensor(info["agent_active"], dtype=torch.float32)
            episode_return += reward * active[step].numpy()
            for slot in np.flatnonzero(done):
                returns.append(float(episode_return[slot]))
                episode_return[slot] = 0.0

        with torch.no_grad():
            next_value = agent.get_value(next_obs).reshape(1, -1)
            advantages = torch.zeros_like(rewards)
            lastgaelam = torch.zeros(n)
            for t in reversed(range(args.num_steps)):
                if t == args.num_steps - 1:
                    nextnonterminal = 1.0 - next_done
                    nextvalues = next_value
                else:
                    nextnonterminal = 1.0 - dones[t + 1]
                    nextvalues = values[t + 1]
                delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                lastgaelam = delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                advantages[t] = lastgaelam
            returns_t = advantages + values

        # aps: only transitions of live agents train the policy and the critic.
        keep = active.reshape(-1) > 0
        b_obs = obs.reshape((-1, *obs_shape))[keep]
        b_logprobs = logprobs.reshape(-1)[keep]
        b_actions = actions.reshape(-1)[keep]
        b_advantages = advantages.reshape(-1)[keep]
        b_returns = returns_t.reshape(-1)[keep]
        kept = len(b_obs)
        size = max(1, min(minibatch_size, kept))
        for _ in range(args.update_epochs):
            order = torch.randperm(kept)
            for begin in range(0, kept, size):
                mb = order[begin : begin + size]
                _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                    b_obs[mb], b_actions[mb]
                )
                ratio = (newlogprob - b_logprobs[mb]).exp()
                mb_adv = b_advantages[mb]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std(unbiased=False) + 1e-8)
                pg_loss = torch.max(
                    -mb_adv * ratio,
                    -mb_adv * torch.clamp(ratio, 1 - args.clip_coef, 1 + args.clip_coef),
                ).mean()
                v_loss = 0.5 * ((newvalue.view(-1) - b_returns[mb]) ** 2).mean()
                loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
                optimizer.zero_grad()
                loss.backward()
                nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
                optimizer.step()

        recent = float(np.mean(returns[-100:])) if returns else float("nan")
        now, metrics = time.time(), envs.metrics
        window = metrics.since(previous)  # aps: this iteration's figures
        rates = window.rates()
        show(
            f"iteration {iteration}/{num_iterations} | "
            f"{(global_step - last_step) / (now - last_time):,.0f} agent-steps/s | "
            f"return {recent:.2f} | lag {window.lag_mean:.2f} | "
            f"{(rates['bytes_received'] + rates['bytes_sent']) / 1e6:.2f} MB/s wire",
            last=iteration == num_iterations,
        )
        last_step, last_time, previous = global_step, now, metrics
        figures.tick()
    figures.close()  # a last row
    window = envs.metrics.since(first_snapshot)
    first = float(np.mean(returns[:100])) if returns else float("nan")
    final = float(np.mean(returns[-100:])) if returns else float("nan")
    print(f"summary: first mean agent return {first:.2f}, final {final:.2f}")
    print(f"verdict: {aps.metrics.verdict(window).line}")  # aps: what bounded the run
    return {"first": first, "final": final, "global_step": float(global_step)}


if __name__ == "__main__":
    main()
