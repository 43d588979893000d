"""CleanRL's ppo_atari_envpool.py on aps: Atari frames stepped on worker processes.

The envs are EnvPool's Atari games (``--backend envpool``, ids such as ``Pong-v5``) or ALE's
through Gymnasium's Atari wrappers (``--backend ale``: :func:`aps.vector.atari_env`, no-op
resets, frame skip 4, 84x84 grayscale, 4 stacked frames), built on the workers from names
decided here. Observations are ``uint8 [4, 84, 84]``, 28,224 bytes per env-step. The agent
is :class:`aps.policy.NatureCNN` (the Nature DQN conv stack), which the workers build from
its import path.

- ``--mode lockstep``: the learner computes every action; ``envs.step(actions)`` sends them
  to the workers and brings the frames back (no weights travel).
- ``--mode detach``: each worker acts ``num_steps`` steps on its envs with its own copy of
  the agent on its CPU and sends the chunk back; ``--sync`` decides whether the newest
  weights travel before each rollout (``aps``: when KL(worker's version || newest) on the
  states it acted on exceeds ``--kl-threshold``; ``always``; ``fixed``: every
  ``--fixed-versions`` versions).
- ``--mode inprocess``: no aps at all, CleanRL's ``ppo_atari_envpool.py`` shape: the same
  ``workers x envs-per-worker`` EnvPool envs in the learner's process (the vector env the
  workers build, :class:`aps.vector.EnvPoolVectorEnv`), the learner acting. The reference
  the other modes are measured against (``benchmarks/ppo_end_to_end.py --pixels``).

Rewards are clipped to their sign on the learner (EnvPool's ``reward_clip``); the returns
printed are the games' own.

``--correction`` says how stale data is corrected, through :mod:`aps.correction`:
``decoupled`` (the default: the clip anchored at the learner's policy before the update, each
sample weighted by min(1, pi_learner / pi_behaviour)), ``vtrace`` (V-trace advantages and
value targets against the learner's policy, rho-bar = c-bar = 1, ``--gae-lambda``) or
``none`` (PPO clipped against the behaviour policy that acted, GAE). The default is the
MinAtar staleness study's choice (``benchmarks/staleness_study.py``, ``docs/pixels.md``); with
no stale data (lockstep, in process, always-sync) every choice is the same PPO update.
``--decoupled`` and ``--no-decoupled`` are aliases of ``--correction decoupled`` and
``--correction none``.

    python examples/ppo_atari.py  # 10,240 env-steps: a few minutes on a CPU
    python examples/ppo_atari.py --mode detach --sync aps --total-timesteps 10000000  # CleanRL's
    python examples/ppo_atari.py --mode lockstep --backend ale --env-id Breakout-v5
    python examples/ppo_atari.py --backend ale --env-id Breakout-v5 --correction vtrace
    python examples/ppo_atari.py --figures runs/pong  # where the time goes: CSV, TensorBoard
    python examples/ppo_atari.py --listen tcp://0.0.0.0:7000 --compression zstd  # prints
        # the ``aps worker`` command to run on each worker machine
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np
import torch
import torch.nn as nn
import torch.optim as optim

import aps
from aps.correction import decoupled_ppo_loss, gae, vtrace
from aps.policy import NatureCNN


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--seed", type=int, default=1, help="seed of the experiment")
    p.add_argument("--torch-threads", type=int, default=1, help="learner's torch threads")
    p.add_argument(
        "--cuda",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="train on the learner's GPU if torch sees one (workers act on their CPUs)",
    )
    p.add_argument("--env-id", default="Pong-v5", help="EnvPool id; ale uses ALE/<id>")
    p.add_argument(
        "--backend", default="envpool", choices=("envpool", "ale"), help="whose Atari envs"
    )
    p.add_argument(
        "--mode",
        default="detach",
        choices=("lockstep", "detach", "inprocess"),
        help="who acts, and where the envs run (inprocess: EnvPool here, no aps)",
    )
    p.add_argument(
        "--sync",
        default="aps",
        choices=("aps", "always", "fixed"),
        help="detach: when weights travel",
    )
    p.add_argument("--kl-threshold", type=float, default=0.05, help="APS threshold, nats")
    p.add_argument(
        "--fixed-versions", type=int, default=4, help="--sync fixed: versions between syncs"
    )
    p.add_argument("--workers", type=int, default=2, help="number of worker processes")
    p.add_argument("--envs-per-worker", type=int, default=4, help="envs per worker")
    p.add_argument(
        "--transport", default="tcp", choices=("tcp", "unix", "ws", "memory"), help="the transport"
    )
    p.add_argument(
        "--listen",
        default=None,
        help="listen here for --workers workers started elsewhere (token: $APS_TOKEN)",
    )
    p.add_argument(
        "--compression",
        default=None,
        choices=aps.wire.compression.SETTINGS,
        help="how frames and weights travel (None: aps's own; auto: compressed off this host)",
    )
    p.add_argument(
        "--total-timesteps",
        type=int,
        default=10_240,
        help="env steps of the run: minutes on a CPU; CleanRL's Atari budget is 10000000",
    )
    p.add_argument("--learning-rate", type=float, default=2.5e-4, help="the learning rate")
    p.add_argument("--num-steps", type=int, default=128, help="steps per env per rollout")
    p.add_argument(
        "--anneal-lr",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="anneal the learning rate",
    )
    p.add_argument("--gamma", type=float, default=0.99, help="the discount factor")
    p.add_argument("--gae-lambda", type=float, default=0.95, help="the lambda of GAE")
    p.add_argument("--num-minibatches", type=int, default=4, help="minibatches per epoch")
    p.add_argument("--update-epochs", type=int, default=4, help="epochs per update")
    p.add_argument(
        "--norm-adv",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="normalize advantages",
    )
    p.add_argument(
        "--clip-coef", type=float, default=0.1, help="the surrogate clipping coefficient"
    )
    p.add_argument(
        "--correction",
        default="decoupled",
        choices=("none", "decoupled", "vtrace"),
        help="stale data: none (clip at the behaviour policy), decoupled or vtrace",
    )
    for flag, value in (("--decoupled", "decoupled"), ("--no-decoupled", "none")):
        p.add_argument(
            flag,
            dest="correction",
            action="store_const",
            const=value,
            default=argparse.SUPPRESS,
            help=f"alias of --correction {value}",
        )
    p.add_argument(
        "--clip-vloss",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="clip the value loss",
    )
    p.add_argument("--ent-coef", type=float, default=0.01, help="coefficient of the entropy")
    p.add_argument("--vf-coef", type=float, default=0.5, help="coefficient of the value function")
    p.add_argument(
        "--max-grad-norm", type=float, default=0.5, help="the maximum norm of the gradient"
    )
    p.add_argument("--final-episodes", type=int, default=20, help="mean return over these")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="stop after the iteration that passes this wall time (the learning rate still "
        "anneals over --total-timesteps); the JSON says complete: false",
    )
    p.add_argument("--figures", default=None, help="write the learner's figures to this directory")
    p.add_argument(
        "--figures-interval", type=float, default=10.0, help="seconds between two --figures"
    )
    args = p.parse_args(argv)
    args.num_envs = args.workers * args.envs_per_worker
    args.batch_size = args.num_envs * args.num_steps
    args.minibatch_size = max(args.batch_size // args.num_minibatches, 1)
    args.num_iterations = max(args.total_timesteps // args.batch_size, 1)
    return args


def make_sync(args: argparse.Namespace) -> Any:
    if args.sync == "always":
        return aps.sync.AlwaysSync()
    if args.sync == "fixed":
        return aps.sync.FixedInterval(versions=args.fixed_versions)
    return aps.sync.APS(kl_threshold=args.kl_threshold)


def make_inprocess_envs(args: argparse.Namespace) -> Any:
    """EnvPool's envs in this process, as a worker builds them (envpool backend only)."""
    if args.backend != "envpool":
        raise SystemExit("--mode inprocess runs EnvPool's envs: use --backend envpool")
    return aps.vector.make_vector_env(
        "envpool",
        lambda: gym.make(args.env_id),  # unused: EnvPool builds its own envs from the id
        num_envs=args.num_envs,
        autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP,
        env=args.env_id,
    )


def make_envs(args: argparse.Namespace) -> aps.ClusterEnv:
    """The workers' envs: EnvPool's by id, or ALE's through aps.vector.atari_env."""
    if args.backend == "envpool":
        env, env_kwargs, vector, autoreset = args.env_id, None, "envpool", "NextStep"
    else:
        ale_id = args.env_id if "/" in args.env_id else f"ALE/{args.env_id}"
        env, env_kwargs, vector, autoreset = (
            "aps.vector:atari_env",
            {"env_id": ale_id},
            "sync",
            "SameStep",
        )
    detach = args.mode == "detach"
    policy = "aps.policy:NatureCNN" if detach else None
    sync = make_sync(args) if detach else None
    extra = {} if args.compression is None else {"compression": args.compression}
    if args.listen is None:
        return aps.ClusterEnv.local(  # was: envpool.make(args.env_id, env_type="gym", ...)
            env,
            env_kwargs=env_kwargs,
            num_workers=args.workers,
            envs_per_worker=args.envs_per_worker,
            transport=args.transport,
            vector=vector,
            autoreset_mode=autoreset,
            policy=policy,
            sync=sync,
            **extra,
        )
    # aps: a token guards a learner other machines can reach; workers read it from a file.
    token = os.environ.get("APS_TOKEN")
    token_file = Path("aps-token")
    if token is None:
        token = secrets.token_hex(32)  # 256 bits, as aps token writes
        token_file.touch(mode=0o600)
        token_file.write_text(token)

    def announce(url: str) -> None:
        command = f"aps worker {aps.launch.dialable_url(url)} --env {env} --vector {vector}"
        if env_kwargs is not None:
            command += f" --env-kwargs '{json.dumps(env_kwargs)}'"
        command += f" --num-envs {args.envs_per_worker} --token-file {token_file}"
        command += "" if policy is None else f" --policy {policy}"
        command += "" if args.compression is None else f" --compression {args.compression}"
        print(
            f"waiting for {args.workers} workers; on each worker machine, with the file "
            f"{token_file} copied, run:\n  {command}",
            flush=True,
        )

    return aps.ClusterEnv(
        args.listen,
        num_workers=args.workers,
        token=token,
        autoreset_mode=autoreset,
        policy=policy,
        sync=sync,
        on_listening=announce,
        **extra,
    )


def corrected(
    args: argparse.Namespace, agent: NatureCNN, r: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Advantages, value targets and proximal log-probs for ``--correction``, ``[T, E]``.

    The proximal policy is the learner's before this update: the clip's anchor and V-trace's
    target (with no correction, the behaviour policy is both). ``dones[t]`` means step t ended
    its episode; a time limit ends it without a bootstrap, as CleanRL's ``dones``.
    """
    if args.correction == "none":
        proximal = r["logprobs"]
    else:
        with torch.no_grad():
            flat = r["obs"].reshape((-1, *r["obs"].shape[2:]))
            _, proximal, _, _ = agent.get_action_and_value(flat, r["actions"].reshape(-1))
        proximal = proximal.reshape(r["logprobs"].shape)
    arrays = {name: r[name].cpu().numpy() for name in ("rewards", "values", "next_value")}
    dones = r["dones"].cpu().numpy()
    if args.correction == "vtrace":
        targets = vtrace(
            r["logprobs"].cpu().numpy(),
            proximal.cpu().numpy(),
            arrays["rewards"],
            arrays["values"],
            arrays["next_value"],
            dones,
            gamma=args.gamma,
            lam=args.gae_lambda,
        )
    else:
        targets = gae(
            arrays["rewards"],
            arrays["values"],
            arrays["next_value"],
            dones,
            gamma=args.gamma,
            lam=args.gae_lambda,
        )
    device = r["rewards"].device
    advantages = torch.as_tensor(targets.advantages, dtype=torch.float32, device=device)
    returns = torch.as_tensor(targets.returns, dtype=torch.float32, device=device)
    return advantages, returns, proximal


def ppo_update(
    args: argparse.Namespace,
    agent: NatureCNN,
    optimizer: optim.Optimizer,
    b_obs: torch.Tensor,
    b_actions: torch.Tensor,
    b_logprobs: torch.Tensor,
    b_advantages: torch.Tensor,
    b_returns: torch.Tensor,
    b_values: torch.Tensor,
    b_behaviour: torch.Tensor,
) -> dict[str, float]:
    """CleanRL's clipped PPO update on a flat batch; the ratio is against ``b_logprobs``.

    Each sample's loss is weighted by min(1, pi(b_logprobs) / pi(b_behaviour))
    (:func:`aps.correction.decoupled_ppo_loss`): exactly 1 where the two are the same.
    """
    b_inds = np.arange(b_obs.shape[0])
    clipfracs: list[float] = []
    for _epoch in range(args.update_epochs):
        np.random.shuffle(b_inds)
        for start in range(0, b_obs.shape[0], args.minibatch_size):
            mb = b_inds[start : start + args.minibatch_size]
            _, newlogprob, entropy, newvalue = agent.get_action_and_value(b_obs[mb], b_actions[mb])
            logratio = newlogprob - b_logprobs[mb]
            ratio = logratio.exp()
            with torch.no_grad():
                approx_kl = ((ratio - 1) - logratio).mean()
                clipfracs.append(((ratio - 1.0).abs() > args.clip_coef).float().mean().item())
            mb_adv = b_advantages[mb]
            if args.norm_adv:
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
            pg_loss = decoupled_ppo_loss(
                newlogprob, b_logprobs[mb], b_behaviour[mb], mb_adv, clip_coef=args.clip_coef
            ).mean()
            newvalue = newvalue.view(-1)
            if args.clip_vloss:
                v_unclipped = (newvalue - b_returns[mb]) ** 2
                v_clipped = b_values[mb] + torch.clamp(
                    newvalue - b_values[mb], -args.clip_coef, args.clip_coef
                )
                v_loss = 0.5 * torch.max(v_unclipped, (v_clipped - b_returns[mb]) ** 2).mean()
            else:
                v_loss = 0.5 * ((newvalue - b_returns[mb]) ** 2).mean()
            loss = pg_loss - args.ent_coef * entropy.mean() + v_loss * args.vf_coef
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(agent.parameters(), args.max_grad_norm)
            optimizer.step()
    return {
        "approx_kl": approx_kl.item(),
        "clipfrac": float(np.mean(clipfracs)),
        "v_loss": v_loss.item(),
    }


def lockstep_rollout(
    args: argparse.Namespace,
    envs: Any,
    agent: NatureCNN,
    state: dict[str, Any],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """CleanRL's rollout: the learner acts, the workers step."""
    shape = envs.single_observation_space.shape
    steps, n = args.num_steps, args.num_envs
    obs = torch.zeros((steps, n, *shape), dtype=torch.uint8, device=device)
    actions = torch.zeros((steps, n), dtype=torch.int64, device=device)
    logprobs = torch.zeros((steps, n), device=device)
    rewards = torch.zeros((steps, n), device=device)
    dones = torch.zeros((steps, n), device=device)
    values = torch.zeros((steps, n), device=device)
    next_obs = state["next_obs"]
    for step in range(args.num_steps):
        obs[step] = next_obs
        with torch.no_grad():
            action, logprob, _, value = agent.get_action_and_value(next_obs)
        actions[step], logprobs[step], values[step] = action, logprob, value.flatten()
        next_obs_np, reward, terminations, truncations, infos = envs.step(action.cpu().numpy())
        rewards[step] = torch.as_tensor(np.sign(reward), dtype=torch.float32, device=device)
        done = np.logical_or(terminations, truncations)
        dones[step] = torch.as_tensor(done, dtype=torch.float32, device=device)
        next_obs = torch.as_tensor(next_obs_np, device=device)
        if "episode" in infos:
            for i in np.flatnonzero(infos["_episode"]):
                state["returns"].append(float(infos["episode"]["r"][i]))
                state["episodes"] += 1
    state["next_obs"] = next_obs
    with torch.no_grad():
        next_value = agent.get_value(next_obs).reshape(-1)
    return {
        "obs": obs,
        "actions": actions,
        "logprobs": logprobs,
        "rewards": rewards,
        "dones": dones,
        "values": values,
        "next_value": next_value,
    }


def detach_rollout(
    args: argparse.Namespace,
    envs: aps.ClusterEnv,
    agent: NatureCNN,
    state: dict[str, Any],
    device: torch.device,
) -> dict[str, torch.Tensor]:
    """The workers act with their versions; the learner's critic values the states."""
    envs.publish(agent)  # aps: a new version; the sync strategy decides who gets it
    b = envs.rollout(args.num_steps)
    state["returns"].extend(float(r) for r in b.episode_return)
    state["episodes"] += len(b.episode_return)
    state["lags"].append(float(b.lag.mean()))
    obs = torch.as_tensor(b.obs, device=device)
    with torch.no_grad():
        flat = obs.reshape((-1, *obs.shape[2:]))
        values = agent.get_value(flat).reshape(obs.shape[:2])
        next_value = agent.get_value(torch.as_tensor(b.next_obs, device=device)).reshape(-1)
    done = b.terminated | b.truncated
    return {
        "obs": obs,
        "actions": torch.as_tensor(b.actions, dtype=torch.int64, device=device),
        # behaviour log-probs: the version that acted
        "logprobs": torch.as_tensor(b.logprob, device=device),
        "rewards": torch.as_tensor(np.sign(b.reward), dtype=torch.float32, device=device),
        "dones": torch.as_tensor(done, dtype=torch.float32, device=device),
        "values": values,
        "next_value": next_value,
    }


def report(
    args: argparse.Namespace,
    agent: NatureCNN,
    metrics: Any,
    state: dict[str, Any],
    device: torch.device,
    *,
    complete: bool,
) -> dict[str, Any]:
    """The run's figures so far; written to ``--json`` after every iteration."""
    global_step, elapsed = (state["curve"][-1][:2]) if state["curve"] else (0, 0.0)
    return {
        "example": "ppo_atari",
        "env_id": args.env_id,
        "backend": args.backend,
        "mode": args.mode,
        "sync": args.sync if args.mode == "detach" else None,
        "kl_threshold": args.kl_threshold if args.sync == "aps" else None,
        "correction": args.correction,
        "seed": args.seed,
        "workers": args.workers,
        "envs_per_worker": args.envs_per_worker,
        "compression": args.compression,
        "device": device.type,
        "total_timesteps": args.total_timesteps,
        "complete": complete,  # False: cut short by --max-seconds or not finished yet
        "global_step": global_step,
        "seconds": elapsed,
        "sps": global_step / elapsed if elapsed else 0.0,
        "episodes": state["episodes"],
        "final_episodes": len(state["returns"]),
        "final_return": float(np.mean(state["returns"])) if state["returns"] else None,
        "bytes_per_version": sum(t.numel() * t.element_size() for t in agent.state_dict().values()),
        "versions": 0 if metrics is None else metrics.version,
        "syncs": 0 if metrics is None else metrics.syncs,
        "weight_bytes": 0 if metrics is None else metrics.weight_bytes,
        "lag_mean": float(np.mean(state["lags"])) if state["lags"] else 0.0,
        # APS: each worker's last measured KL(its version || the newest), in nats
        "last_divergences": []
        if metrics is None
        else [w.divergences[-1] for w in metrics.workers if w.divergences],
        # the run's bound, from aps's figures (none in process)
        "verdict": None
        if metrics is None
        else aps.metrics.verdict(metrics.since(state["first"])).line,
        "curve": [
            {"step": step, "seconds": sec, "return": ret, "weight_bytes": wb}
            for step, sec, ret, wb in state["curve"]
        ],
    }


def write_json(path: str | None, result: dict[str, Any]) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(result, indent=2) + "\n")


def figures_logger(envs: aps.ClusterEnv, args: argparse.Namespace) -> aps.metrics.MetricsLogger:
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


def show(line: str, last: bool) -> None:
    """The progress line: rewritten in place on a terminal, one line per call in a log."""
    tty = sys.stdout.isatty()
    print(f"\r{line}\033[K" if tty else line, end="\n" if last or not tty else "", flush=True)


def train(args: argparse.Namespace) -> dict[str, Any]:
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.torch_threads)
    device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")

    cluster = None if args.mode == "inprocess" else make_envs(args)
    envs: Any = cluster if cluster is not None else make_inprocess_envs(args)
    if args.mode != "detach":
        envs = gym.wrappers.vector.RecordEpisodeStatistics(envs)
    try:
        agent = NatureCNN(envs).to(device)
        optimizer = optim.Adam(agent.parameters(), lr=args.learning_rate, eps=1e-5)
        state: dict[str, Any] = {
            "returns": collections.deque(maxlen=args.final_episodes),
            "lags": [],
            "episodes": 0,
            "curve": [],  # (env-steps, seconds, mean return, weight bytes) per iteration
            "first": None if cluster is None else cluster.metrics,  # aps: figures at the start
        }
        previous = state["first"]
        figures = None if cluster is None else figures_logger(cluster, args)
        global_step, done = 0, False
        start_time = time.perf_counter()
        next_obs, _ = envs.reset(seed=args.seed)
        state["next_obs"] = torch.as_tensor(next_obs, device=device)
        for iteration in range(1, args.num_iterations + 1):
            if args.anneal_lr:
                frac = 1.0 - (iteration - 1.0) / args.num_iterations
                optimizer.param_groups[0]["lr"] = frac * args.learning_rate
            if cluster is None or args.mode == "lockstep":
                r = lockstep_rollout(args, envs, agent, state, device)
            else:
                r = detach_rollout(args, cluster, agent, state, device)
            global_step += args.batch_size
            advantages, returns, proximal = corrected(args, agent, r)
            # decoupled weighs each sample by pi_prox / pi_behaviour; V-trace's advantages
            # already carry that weight, so it passes the proximal log-probs twice, as none.
            behaviour = r["logprobs"] if args.correction == "decoupled" else proximal
            stats = ppo_update(
                args,
                agent,
                optimizer,
                r["obs"].reshape((-1, *envs.single_observation_space.shape)),
                r["actions"].reshape(-1),
                proximal.reshape(-1),
                advantages.reshape(-1),
                returns.reshape(-1),
                r["values"].reshape(-1),
                behaviour.reshape(-1),
            )
            elapsed = time.perf_counter() - start_time
            mean_return = float(np.mean(state["returns"])) if state["returns"] else None
            metrics = None if cluster is None else cluster.metrics
            weight_bytes = 0 if metrics is None else metrics.weight_bytes
            state["curve"].append((global_step, elapsed, mean_return, weight_bytes))
            done = iteration == args.num_iterations
            out_of_time = args.max_seconds is not None and elapsed >= args.max_seconds
            parts = [f"iteration {iteration}/{args.num_iterations}"]
            if metrics is None:
                parts.append(f"{global_step / elapsed:,.0f} env-steps/s since the start")
            else:
                window = metrics.since(previous)  # aps: this iteration's figures
                rates, previous = window.rates(), metrics
                parts.append(f"{rates['env_steps']:,.0f} env-steps/s")
            parts.append(f"return {'n/a' if mean_return is None else f'{mean_return:.1f}'}")
            if metrics is not None:
                wire = (rates["bytes_received"] + rates["bytes_sent"]) / 1e6
                parts += [f"lag {window.lag_mean:.2f}", f"{wire:.2f} MB/s wire"]
            parts.append(f"approx_kl {stats['approx_kl']:.4f}")
            show(" | ".join(parts), last=done or out_of_time)
            if figures is not None:
                figures.tick()
            write_json(args.json, report(args, agent, metrics, state, device, complete=done))
            if out_of_time and not done:
                print(f"stopping: --max-seconds {args.max_seconds} passed", flush=True)
                break
        if figures is not None:
            figures.close()  # a last row, before the learner closes
        metrics = None if cluster is None else cluster.metrics
    finally:
        envs.close()
    return report(args, agent, metrics, state, device, complete=done)


def main(argv: list[str] | None = None) -> None:
    result = train(parse_args(argv))
    ret = result["final_return"]
    print(
        f"summary: {result['mode']} final mean return "
        f"{'n/a' if ret is None else f'{ret:.1f}'} over the last {result['final_episodes']} of "
        f"{result['episodes']} episodes | "
        f"{result['sps']:,.0f} env-steps/s | {result['weight_bytes'] / 1e6:.2f} MB of weights "
        f"in {result['syncs']} syncs ({result['versions']} versions)"
    )
    if result["verdict"] is not None:
        print(f"verdict: {result['verdict']}")


if __name__ == "__main__":
    main()
