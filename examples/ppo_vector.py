"""CleanRL's PPO on aps.ClusterEnv: the envs step on worker processes, the learner acts.

This is CleanRL's ``ppo.py`` (discrete actions) with the vector env swapped: the learner
computes every action and ``envs.step(actions)`` sends them to the workers (remote-step
mode). Look for ``# aps:`` to find the one line that differs from a ``SyncVectorEnv`` script.

A float ``Box`` action space (Hopper, Humanoid, Pendulum) gets the agent of CleanRL's
``ppo_continuous_action.py`` instead: a Gaussian actor whose log standard deviation is a
learned parameter independent of the state. Its sampled actions are stored unclipped (the
log-probabilities are theirs) and clipped to the space's bounds only on their way to the
env, as CleanRL's ``ClipAction`` wrapper does. Discrete spaces keep ``ppo.py``'s agent and
its exact sequence of random draws.

Autoreset: the envs use Gymnasium's ``SameStep`` mode, the semantics CleanRL's loop was
written for (gym < 1.0): when a step ends an episode it returns the first observation of the
next one, so ``obs[t + 1]`` after ``dones[t + 1]`` belongs to a new episode and the GAE mask
``1 - dones[t + 1]`` cuts the bootstrap there. Under Gymnasium 1.x's default ``NextStep`` the
step after an episode's end would be a reset step whose action is ignored, which this loop
would wrongly train on.

    python examples/ppo_vector.py --workers 2 --envs-per-worker 4
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim
from torch.distributions.categorical import Categorical
from torch.distributions.normal import Normal

import aps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--exp-name", default=Path(__file__).stem, help="the name of this experiment")
    add("--seed", type=int, default=1, help="seed of the experiment")
    add("--torch-threads", type=int, default=1, help="torch CPU threads of the learner")
    add("--track-tb", action="store_true", help="log to TensorBoard (needs tensorboard)")
    add("--logdir", default="runs", help="where TensorBoard runs are written")
    add("--env-id", default="CartPole-v1", help="the id of the environment")
    add("--workers", type=int, default=2, help="number of worker processes")
    add("--envs-per-worker", type=int, default=2, help="environments per worker")
    add("--transport", default="tcp", choices=["tcp", "ws", "memory"], help="the transport")
    add(
        "--backend",
        default="aps",
        choices=["aps", "gym-sync", "gym-async"],
        help="aps: ClusterEnv.local; gym-sync / gym-async: the same envs in Gymnasium's "
        "SyncVectorEnv / AsyncVectorEnv (the references benchmarks/ppo_end_to_end.py uses)",
    )
    add(
        "--compression",
        default=None,
        help="aps backend: passed to ClusterEnv.local as compression= (None: aps's own)",
    )
    add("--total-timesteps", type=int, default=100_000, help="total env steps")
    add("--learning-rate", type=float, default=2.5e-4, help="the learning rate")
    add("--num-steps", type=int, default=128, help="steps per env per rollout")
    add(
        "--anneal-lr",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="anneal the learning rate",
    )
    add("--gamma", type=float, default=0.99, help="the discount factor")
    add("--gae-lambda", type=float, default=0.95, help="the lambda of GAE")
    add("--num-minibatches", type=int, default=4, help="the number of minibatches")
    add("--update-epochs", type=int, default=4, help="the number of epochs per update")
    add(
        "--norm-adv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="normalize advantages",
    )
    add("--clip-coef", type=float, default=0.2, help="the surrogate clipping coefficient")
    add(
        "--clip-vloss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="clip the value loss",
    )
    add("--ent-coef", type=float, default=0.01, help="coefficient of the entropy")
    add("--vf-coef", type=float, default=0.5, help="coefficient of the value function")
    add("--max-grad-norm", type=float, default=0.5, help="the maximum norm of the gradient")
    add("--target-kl", type=float, default=None, help="the target KL divergence threshold")
    args = parser.parse_args(argv)
    args.num_envs = args.workers * args.envs_per_worker
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = max(args.batch_size // args.num_minibatches, 1)
    args.num_iterations = max(args.total_timesteps // args.batch_size, 1)
    return args


def layer_init(layer: nn.Linear, std: float = np.sqrt(2), bias_const: float = 0.0) -> nn.Linear:
    torch.nn.init.orthogonal_(layer.weight, std)
    torch.nn.init.constant_(layer.bias, bias_const)
    return layer


class Agent(nn.Module):
    def __init__(self, envs: gym.vector.VectorEnv) -> None:
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


class GaussianAgent(nn.Module):
    """CleanRL's ``ppo_continuous_action.py`` agent: a Gaussian actor with a learned,
    state-independent log standard deviation, and a critic (64-64 Tanh each)."""

    def __init__(self, envs: gym.vector.VectorEnv) -> None:
        super().__init__()
        obs_size = int(np.array(envs.single_observation_space.shape).prod())
        action_size = int(np.prod(envs.single_action_space.shape))
        self.critic = nn.Sequential(
            layer_init(nn.Linear(obs_size, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 1), std=1.0),
        )
        self.actor_mean = nn.Sequential(
            layer_init(nn.Linear(obs_size, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, 64)),
            nn.Tanh(),
            layer_init(nn.Linear(64, action_size), std=0.01),
        )
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


def make_envs(args: argparse.Namespace) -> gym.vector.VectorEnv:
    """The vector env of ``--backend``: aps workers, or Gymnasium's in-process vector envs."""
    if args.backend in ("gym-sync", "gym-async"):  # CleanRL's own line, for comparison
        return gym.make_vec(
            args.env_id,
            args.num_envs,
            vectorization_mode="sync" if args.backend == "gym-sync" else "async",
            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
        )
    # Only when asked: a compression= that this aps does not know is its error to report.
    extra = {} if args.compression is None else {"compression": args.compression}
    return aps.ClusterEnv.local(  # aps: the only line that differs from CleanRL
        args.env_id,
        num_workers=args.workers,
        envs_per_worker=args.envs_per_worker,
        transport=args.transport,
        autoreset_mode="SameStep",
        **extra,
    )


def main(
    argv: list[str] | None = None,
    envs_factory: Callable[[argparse.Namespace], gym.vector.VectorEnv] | None = None,
) -> None:
    """Train; ``envs_factory`` replaces :func:`make_envs` (a benchmark's other vector env)."""
    args = parse_args(argv)
    run_name = f"{args.env_id}__{args.exp_name}__{args.seed}__{int(time.time())}"
    writer = None
    if args.track_tb:
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(f"{args.logdir}/{run_name}")
        except ImportError:
            print("tensorboard is not installed (pip install tensorboard); not logging to it")

    # TRY NOT TO MODIFY: seeding
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = True
    torch.set_num_threads(args.torch_threads)

    # env setup
    envs = (envs_factory or make_envs)(args)
    envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    space = envs.single_action_space
    continuous = isinstance(space, gym.spaces.Box)
    assert continuous or isinstance(space, gym.spaces.Discrete), "Discrete or Box actions only"

    try:
        agent = GaussianAgent(envs) if continuous else Agent(envs)
        optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)

        # ALGO Logic: Storage setup
        obs = torch.zeros((args.num_steps, args.num_envs, *envs.single_observation_space.shape))
        actions = torch.zeros((args.num_steps, args.num_envs, *envs.single_action_space.shape))
        logprobs = torch.zeros((args.num_steps, args.num_envs))
        rewards = torch.zeros((args.num_steps, args.num_envs))
        dones = torch.zeros((args.num_steps, args.num_envs))
        values = torch.zeros((args.num_steps, args.num_envs))

        # TRY NOT TO MODIFY: start the game
        global_step = 0
        episode_returns: list[float] = []
        start_time = time.time()
        next_obs_np, _ = envs.reset(seed=args.seed)
        next_obs = torch.Tensor(next_obs_np)
        next_done = torch.zeros(args.num_envs)

        for iteration in range(1, args.num_iterations + 1):
            # Annealing the rate if instructed to do so.
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / args.num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate

            for step in range(args.num_steps):
                global_step += args.num_envs
                obs[step] = next_obs
                dones[step] = next_done

                # ALGO LOGIC: action logic
                with torch.no_grad():
                    action, logprob, _, value = agent.get_action_and_value(next_obs)
                    values[step] = value.flatten()
                actions[step] = action
                logprobs[step] = logprob

                # TRY NOT TO MODIFY: execute the game and log data.
                # A Box's actions reach the env clipped to its bounds (CleanRL's ClipAction).
                env_action = np.clip(action.numpy(), space.low, space.high) if continuous else None
                next_obs_np, reward, terminations, truncations, infos = envs.step(
                    action.numpy() if env_action is None else env_action
                )
                next_done_np = np.logical_or(terminations, truncations)
                rewards[step] = torch.tensor(reward).view(-1)
                next_obs, next_done = torch.Tensor(next_obs_np), torch.Tensor(next_done_np)

                if "episode" in infos:
                    for i in np.flatnonzero(infos["_episode"]):
                        episode_returns.append(float(infos["episode"]["r"][i]))
                        if writer is not None:
                            writer.add_scalar(
                                "charts/episodic_return", infos["episode"]["r"][i], global_step
                            )
                            writer.add_scalar(
                                "charts/episodic_length", infos["episode"]["l"][i], global_step
                            )

            # bootstrap value if not done
            with torch.no_grad():
                next_value = agent.get_value(next_obs).reshape(1, -1)
                advantages = torch.zeros_like(rewards)
                lastgaelam = 0
                for t in reversed(range(args.num_steps)):
                    if t == args.num_steps - 1:
                        nextnonterminal = 1.0 - next_done
                        nextvalues = next_value
                    else:
                        nextnonterminal = 1.0 - dones[t + 1]
                        nextvalues = values[t + 1]
                    delta = rewards[t] + args.gamma * nextvalues * nextnonterminal - values[t]
                    advantages[t] = lastgaelam = (
                        delta + args.gamma * args.gae_lambda * nextnonterminal * lastgaelam
                    )
                returns = advantages + values

            # flatten the batch
            b_obs = obs.reshape((-1, *envs.single_observation_space.shape))
            b_logprobs = logprobs.reshape(-1)
            b_actions = actions.reshape((-1, *envs.single_action_space.shape))
            b_advantages = advantages.reshape(-1)
            b_returns = returns.reshape(-1)
            b_values = values.reshape(-1)

            # Optimizing the policy and value network
            b_inds = np.arange(args.batch_size)
            clipfracs = []
            for _epoch in range(args.update_epochs):
                np.random.shuffle(b_inds)
                for start in range(0, args.batch_size, args.minibatch_size):
                    end = start + args.minibatch_size
                    mb_inds = b_inds[start:end]

                    _, newlogprob, entropy, newvalue = agent.get_action_and_value(
                        b_obs[mb_inds],
                        b_actions[mb_inds] if continuous else b_actions.long()[mb_inds],
                    )
                    logratio = newlogprob - b_logprobs[mb_inds]
                    ratio = logratio.exp()

                    with torch.no_grad():
                        # calculate approx_kl http://joschu.net/blog/kl-approx.html
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
                    pg_loss = torch.max(pg_loss1, pg_loss2).mean()

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

            sps = int(global_step / (time.time() - start_time))
            recent = np.mean(episode_returns[-20:]) if episode_returns else float("nan")
            if iteration % 10 == 0 or iteration == args.num_iterations:
                print(f"iteration {iteration}: step {global_step}, return {recent:.1f}, SPS {sps}")
            if writer is not None:
                lr = optimizer.param_groups[0]["lr"]
                writer.add_scalar("charts/learning_rate", lr, global_step)
                writer.add_scalar("losses/value_loss", v_loss.item(), global_step)
                writer.add_scalar("losses/policy_loss", pg_loss.item(), global_step)
                writer.add_scalar("losses/entropy", entropy_loss.item(), global_step)
                writer.add_scalar("losses/old_approx_kl", old_approx_kl.item(), global_step)
                writer.add_scalar("losses/approx_kl", approx_kl.item(), global_step)
                writer.add_scalar("losses/clipfrac", np.mean(clipfracs), global_step)
                writer.add_scalar("losses/explained_variance", explained_var, global_step)
                writer.add_scalar("charts/SPS", sps, global_step)
    finally:
        envs.close()
        if writer is not None:
            writer.close()

    final = np.mean(episode_returns[-50:]) if episode_returns else float("nan")
    elapsed = time.time() - start_time
    print(
        f"summary: final mean return {final:.1f} over the last {min(len(episode_returns), 50)} "
        f"episodes | {global_step:,} env-steps in {elapsed:.1f} s, "
        f"{global_step / elapsed:,.0f} env-steps/s"
    )


if __name__ == "__main__":
    main()
