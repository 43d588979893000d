"""How far does a policy drift per update on pixels, and what would a stale worker's data cost?

Trains PPO in-process (always-sync: every batch is collected by the newest version) on
MinAtar Breakout (10x10x4 boolean frames, 3 actions) with a small CNN on one CPU thread. One
PPO update publishes one version, as ``examples/ppo_cluster.py`` does. The last 16 versions'
weights are kept, and before each update, on the states of the batch the newest version
``v`` just collected, for every lag ``k = 1..16`` with version ``v - k`` kept:

- the per-state ``KL(pi_{v-k}(.|s) || pi_v(.|s))`` (the direction APS measures): its mean,
  95th percentile and max over the batch's states;
- the clip fraction PPO's update would start with had version ``v - k`` collected the batch:
  the probability, under ``pi_{v-k}``, of an action whose ratio ``pi_v / pi_{v-k}`` lies
  outside ``[1 - 0.2, 1 + 0.2]``, summed exactly over the 3 actions and averaged over states
  (the clip anchored at the behaviour policy, the paper's objective);
- the clipped surrogate policy loss at the update's start on the batch's actions and
  normalized advantages with ``pi_{v-k}`` as the behaviour policy (0 at ``k = 0``, since the
  advantages are normalized to mean 0);
- what the off-policy corrections of ``aps.correction`` would keep of the batch, with the
  truncated weight ``w = min(1, pi_v / pi_{v-k})`` (decoupled PPO's weight with ``pi_v`` as
  the proximal policy and ``pi_{v-k}`` as the behaviour; V-trace's ``rho`` and ``c`` at
  ``rho_bar = c_bar = 1``, so they are not measured apart): its mean ``w_mean`` and the
  effective sample size fraction ``w_ess = (sum w)^2 / (N sum w^2)``, both exact over the 3
  actions drawn from ``pi_{v-k}`` (``E[w | s] = sum_a min(pi_{v-k}, pi_v)``, so
  ``1 - w_mean`` is the mean total variation between the two); on the batch's own actions,
  drawn by ``pi_v`` (which biases ``w`` up), ``w_mean_sampled`` and the share of the
  normalized advantages' mass kept, ``adv_kept = sum(w |A|) / sum(|A|)``; and ``c_prod_n``
  for ``n = 1, 4, 16``, the weight V-trace's value target gives the TD error ``n`` steps
  ahead, ``c_t ... c_{t+n-1}`` without lambda, each ``c`` exact over the actions as
  ``w_mean``, along the batch's states, over the starts whose ``n`` steps stay in the batch
  and in one episode.

It reports per lag the median over updates with the 25th and 75th percentiles, pooled over
seeds and per seed, the ratio of one update's own drift (``k = 1``) to the KL thresholds
people give APS (0.01 and 0.05 nats), and the drift at lag ``k`` in units of the same
update's ``k = 1`` drift. The runs' returns are recorded so a reader can see the policy
learned while it was measured; this is not a learning study.

    nice -n 10 python benchmarks/staleness.py --seeds 1,2,3 --updates 300 \\
        --out benchmarks/results/staleness-minatar-2026-12-06
    python benchmarks/staleness.py --replot \\
        --out benchmarks/results/staleness-minatar-2026-12-06

Needs ``pip install minatar`` (and matplotlib for the plot).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

LAGS = 16
CLIP = 0.2
TRACE_STEPS = (1, 4, 16)
THRESHOLDS = (0.01, 0.05)


def make_envs(num_envs: int, seed: int) -> list[Any]:
    """``num_envs`` MinAtar Breakout envs, reset with seeds ``seed * 1000 + i``."""
    import gymnasium as gym
    from minatar.gym import register_envs

    register_envs()
    envs = [gym.make("MinAtar/Breakout-v1") for _ in range(num_envs)]
    for index, env in enumerate(envs):
        env.reset(seed=seed * 1000 + index)
        env.action_space.seed(seed * 1000 + index)
    return envs


def build_agent(torch: Any, channels: int, actions: int) -> Any:
    """A MinAtar-sized CNN: one 3x3 conv of 16 filters, 128 hidden units, two heads."""
    nn = torch.nn

    class Agent(nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(channels, 16, 3),
                nn.ReLU(),
                nn.Flatten(),
                nn.Linear(16 * 8 * 8, 128),
                nn.ReLU(),
            )
            self.actor = nn.Linear(128, actions)
            self.critic = nn.Linear(128, 1)

        def forward(self, x: Any) -> tuple[Any, Any]:
            hidden = self.body(x)
            return self.actor(hidden), self.critic(hidden).squeeze(-1)

    return Agent()


def to_input(torch: Any, obs: np.ndarray) -> Any:
    """``[N, 10, 10, C]`` booleans to ``[N, C, 10, 10]`` floats."""
    return torch.as_tensor(obs, dtype=torch.float32).permute(0, 3, 1, 2)


def lag_figures(
    torch: Any,
    old_logits: Any,
    new_logits: Any,
    actions: Any,
    advantages: Any,
    done: np.ndarray | None = None,
) -> dict[str, float]:
    """The figures of one (older version, newest version) pair on one batch's states.

    ``done`` is the batch's ``[T, E]`` episode ends (the flat arrays are its rows); without
    it the trace figures (``c_prod_n``) are left out.
    """
    old_logp = torch.log_softmax(old_logits, dim=-1)
    new_logp = torch.log_softmax(new_logits, dim=-1)
    old_p = old_logp.exp()
    kl = (old_p * (old_logp - new_logp)).sum(-1).clamp_min(0.0).numpy()
    ratio_all = (new_logp - old_logp).exp()
    outside = ((ratio_all - 1.0).abs() > CLIP).float()
    clip_fraction = float((old_p * outside).sum(-1).mean())
    ratio = (new_logp.gather(1, actions[:, None]) - old_logp.gather(1, actions[:, None])).exp()
    ratio = ratio.squeeze(1)
    surrogate = torch.minimum(ratio * advantages, ratio.clamp(1 - CLIP, 1 + CLIP) * advantages)
    figures = {
        "kl_mean": float(kl.mean()),
        "kl_p95": float(np.percentile(kl, 95)),
        "kl_max": float(kl.max()),
        "clip_fraction": clip_fraction,
        "loss": float(-surrogate.mean()),
    }
    # The corrections' truncated weight w = min(1, pi_v / pi_{v-k}) (decoupled PPO's weight
    # with pi_v proximal and pi_{v-k} behaviour; V-trace's rho and c at rho_bar = c_bar = 1).
    # Exact over the 3 actions drawn from pi_{v-k}: E[w | s] = sum_a min(pi_{v-k}, pi_v).
    weight_all = ratio_all.clamp(max=1.0)
    w_state = (old_p * weight_all).sum(-1).double()
    w_sq = (old_p * weight_all**2).sum(-1).double()
    figures["w_mean"] = float(w_state.mean())
    figures["w_ess"] = float(w_state.mean() ** 2 / w_sq.mean())
    # On the batch's actions (drawn by pi_v, not pi_{v-k}: w is biased up there).
    w = ratio.clamp(max=1.0).double()
    figures["w_mean_sampled"] = float(w.mean())
    magnitude = advantages.abs().double()
    figures["adv_kept"] = float((w * magnitude).sum() / magnitude.sum())
    if done is not None:
        # The weight V-trace's target gives the TD error n steps ahead, prod of c_t..c_{t+n-1}
        # (without lambda), each c exact over the actions as w_mean, along the batch's states;
        # averaged over the starts t whose steps t..t+n lie in the batch and in one episode.
        steps, envs = done.shape
        log_c = np.log(w_state.numpy().reshape(steps, envs))
        log_cum = np.vstack([np.zeros((1, envs)), np.cumsum(log_c, axis=0)])
        ends = np.vstack([np.zeros((1, envs)), np.cumsum(done, axis=0)])
        for n in TRACE_STEPS:
            if n >= steps:
                continue
            starts = steps - n
            inside = ends[n : n + starts] - ends[:starts] == 0  # no end among t..t+n-1
            products = np.exp(log_cum[n : n + starts] - log_cum[:starts])
            figures[f"c_prod_{n}"] = float(products[inside].mean())
    return figures


def run_seed(seed: int, args: argparse.Namespace) -> dict[str, Any]:
    """Train one seed; return its per-update figures by lag and its episode returns."""
    import torch

    torch.manual_seed(seed)
    np.random.seed(seed)
    torch.set_num_threads(1)
    envs = make_envs(args.num_envs, seed)
    obs = np.stack([env.reset(seed=seed * 1000 + i)[0] for i, env in enumerate(envs)])
    channels, actions_n = obs.shape[-1], int(envs[0].action_space.n)
    agent = build_agent(torch, channels, actions_n)
    optimizer = torch.optim.Adam(agent.parameters(), lr=args.lr, eps=1e-5)
    # The newest version (the live agent's weights) and the LAGS before it.
    versions: collections.deque[dict[str, Any]] = collections.deque(maxlen=LAGS + 1)
    versions.append({k: v.detach().clone() for k, v in agent.state_dict().items()})
    steps, envs_n = args.num_steps, args.num_envs
    batch = steps * envs_n
    episode_return = np.zeros(envs_n)
    returns: list[tuple[int, float]] = []  # (env steps when it ended, return)
    updates: list[dict[str, Any]] = []
    env_steps = 0
    rng = np.random.default_rng(seed)
    started = time.monotonic()
    for update in range(1, args.updates + 1):
        # -- collect with the newest version ------------------------------------------------
        b_obs = np.zeros((steps, envs_n, *obs.shape[1:]), dtype=np.bool_)
        b_act = np.zeros((steps, envs_n), dtype=np.int64)
        b_logp = np.zeros((steps, envs_n), dtype=np.float32)
        b_val = np.zeros((steps, envs_n), dtype=np.float32)
        b_rew = np.zeros((steps, envs_n), dtype=np.float32)
        b_done = np.zeros((steps, envs_n), dtype=np.float32)
        for t in range(steps):
            b_obs[t] = obs
            with torch.no_grad():
                logits, value = agent(to_input(torch, obs))
            dist = torch.distributions.Categorical(logits=logits)
            action = dist.sample()
            b_act[t], b_logp[t] = action.numpy(), dist.log_prob(action).numpy()
            b_val[t] = value.numpy()
            for i, env in enumerate(envs):
                o, r, terminated, truncated, _ = env.step(int(b_act[t, i]))
                episode_return[i] += r
                b_rew[t, i] = r
                if terminated or truncated:
                    # Same-step reset; a truncation is treated as an end (MinAtar rarely has one).
                    returns.append((env_steps + (t + 1) * envs_n, float(episode_return[i])))
                    episode_return[i] = 0.0
                    b_done[t, i] = 1.0
                    o, _ = env.reset()
                obs[i] = o
        env_steps += batch
        with torch.no_grad():
            _, next_value = agent(to_input(torch, obs))
        # -- GAE --------------------------------------------------------------------------------
        adv = np.zeros((steps, envs_n), dtype=np.float32)
        last = np.zeros(envs_n, dtype=np.float32)
        following = next_value.numpy()
        for t in reversed(range(steps)):
            alive = 1.0 - b_done[t]
            delta = b_rew[t] + args.gamma * following * alive - b_val[t]
            last = delta + args.gamma * args.gae_lambda * alive * last
            adv[t] = last
            following = b_val[t]
        target = adv + b_val
        flat_obs = to_input(torch, b_obs.reshape(batch, *obs.shape[1:]))
        flat_act = torch.as_tensor(b_act.reshape(batch))
        flat_adv = torch.as_tensor(adv.reshape(batch))
        norm_adv = (flat_adv - flat_adv.mean()) / (flat_adv.std() + 1e-8)
        # -- measure: the batch's states through each kept version ---------------------------
        row: dict[str, Any] = {"update": update, "env_steps": env_steps}
        if len(versions) > 1:
            with torch.no_grad():
                new_logits, _ = agent(flat_obs)
                probe = build_agent(torch, channels, actions_n)
                lags: dict[str, dict[str, float]] = {}
                for k, weights in enumerate(list(reversed(versions))[1:], start=1):
                    probe.load_state_dict(weights)
                    old_logits, _ = probe(flat_obs)
                    lags[str(k)] = lag_figures(
                        torch, old_logits, new_logits, flat_act, norm_adv, b_done
                    )
            row["lags"] = lags
        # -- PPO update (clip anchored at the behaviour version, which is the newest here) -----
        flat_logp = torch.as_tensor(b_logp.reshape(batch))
        flat_target = torch.as_tensor(target.reshape(batch))
        minibatch = batch // args.minibatches
        for _ in range(args.epochs):
            order = rng.permutation(batch)
            for start in range(0, batch, minibatch):
                index = torch.as_tensor(order[start : start + minibatch])
                logits, value = agent(flat_obs[index])
                logp_all = torch.log_softmax(logits, dim=-1)
                logp = logp_all.gather(1, flat_act[index][:, None]).squeeze(1)
                ratio = (logp - flat_logp[index]).exp()
                mb_adv = flat_adv[index]
                mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                policy_loss = -torch.minimum(
                    ratio * mb_adv, ratio.clamp(1 - CLIP, 1 + CLIP) * mb_adv
                ).mean()
                value_loss = 0.5 * ((value - flat_target[index]) ** 2).mean()
                entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
                loss = policy_loss + 0.5 * value_loss - args.ent_coef * entropy
                optimizer.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(agent.parameters(), 0.5)
                optimizer.step()
        # The version this update published.
        versions.append({k: v.detach().clone() for k, v in agent.state_dict().items()})
        recent = [r for _, r in returns[-20:]]
        row["return_last20"] = float(np.mean(recent)) if recent else None
        updates.append(row)
        if update % 25 == 0:
            print(
                f"seed {seed} update {update}/{args.updates} env-steps {env_steps} "
                f"return(last 20) {row['return_last20']} "
                f"kl1 {row.get('lags', {}).get('1', {}).get('kl_mean', float('nan')):.4g} "
                f"{time.monotonic() - started:.0f}s",
                file=sys.stderr,
                flush=True,
            )
    return {
        "seed": seed,
        "seconds": time.monotonic() - started,
        "updates": updates,
        "returns": returns,
    }


def quantiles(values: list[float]) -> dict[str, float]:
    """Median with the 25th and 75th percentiles (the spread over updates)."""
    array = np.asarray(values, dtype=np.float64)
    p25, p50, p75 = np.percentile(array, [25, 50, 75])
    return {"median": float(p50), "p25": float(p25), "p75": float(p75), "n": int(array.size)}


FIGURES = (
    "kl_mean",
    "kl_p95",
    "kl_max",
    "clip_fraction",
    "loss",
    "w_mean",
    "w_ess",
    "w_mean_sampled",
    "adv_kept",
    *(f"c_prod_{n}" for n in TRACE_STEPS),
)


def summarize(runs: list[dict[str, Any]], skip: int) -> dict[str, Any]:
    """Per-lag medians over updates (after ``skip`` warm-up updates), pooled and per seed."""

    def table(selected: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k in range(1, LAGS + 1):
            rows = [
                u["lags"][str(k)]
                for run in selected
                for u in run["updates"][skip:]
                if str(k) in u.get("lags", {})
            ]
            if not rows:
                continue
            entry = {name: quantiles([r[name] for r in rows]) for name in FIGURES}
            # Drift at lag k in units of the same update's one-version drift.
            for name in ("kl_mean", "kl_p95"):
                ratios = [
                    u["lags"][str(k)][name] / u["lags"]["1"][name]
                    for run in selected
                    for u in run["updates"][skip:]
                    if str(k) in u.get("lags", {}) and u["lags"]["1"][name] > 0
                ]
                entry[f"{name}_over_k1"] = quantiles(ratios)
            out[str(k)] = entry
        return out

    pooled = table(runs)
    one = pooled["1"]
    return {
        "pooled": pooled,
        "per_seed": {str(run["seed"]): table([run]) for run in runs},
        "k1_drift_over_threshold": {
            f"{name}/{threshold}": one[name]["median"] / threshold
            for name in ("kl_mean", "kl_p95", "kl_max")
            for threshold in THRESHOLDS
        },
        "final_return_last20": {
            str(run["seed"]): run["updates"][-1]["return_last20"] for run in runs
        },
    }


WEIGHT_FIGURES = ("w_mean", "w_ess", "adv_kept", "c_prod_4", "c_prod_16")


def print_table(summary: dict[str, Any]) -> None:
    """The pooled medians per lag, one row each."""
    names = ("kl_mean", "kl_p95", "clip_fraction", "loss", *FIGURES[5:])
    print("lag " + " ".join(f"{name:>14}" for name in names))
    for k, entry in summary["pooled"].items():
        print(f"{k:>3} " + " ".join(f"{entry[name]['median']:>14.4g}" for name in names))


def rounded(value: Any) -> Any:
    """``value`` with every float rounded to 4 significant digits (the raw runs stay small)."""
    if isinstance(value, float):
        return float(f"{value:.4g}")
    if isinstance(value, dict):
        return {k: rounded(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [rounded(v) for v in value]
    return value


def columns(run: dict[str, Any]) -> dict[str, Any]:
    """One run's per-update figures as columns: ``lags[k][figure]`` lists over updates.

    ``lags[k]`` starts at update ``k + 1``, the first with version ``v - k`` kept.
    """
    updates = run["updates"]
    lags = {
        str(k): {
            name: [u["lags"][str(k)][name] for u in updates if str(k) in u.get("lags", {})]
            for name in FIGURES
        }
        for k in range(1, LAGS + 1)
    }
    return {
        "seed": run["seed"],
        "seconds": run["seconds"],
        "env_steps": [u["env_steps"] for u in updates],
        "return_last20": [u["return_last20"] for u in updates],
        "lags": lags,
        "episodes": len(run["returns"]),
    }


def write_result(result: dict[str, Any], path: Path) -> None:
    """The summary indented for reading; each run's figures as rounded columns, one line each."""
    head = json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1)
    runs = ",\n  ".join(
        json.dumps(rounded(columns(run)), separators=(",", ":")) for run in result["runs"]
    )
    path.write_text(f'{head[:-2]},\n "runs": [\n  {runs}\n ]\n}}\n')


def plot(result: dict[str, Any], path: Path) -> None:
    """KL mean / p95 / max, clip fraction and loss against lag, per seed and pooled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pooled = result["summary"]["pooled"]
    lags = sorted(int(k) for k in pooled)
    weights = "w_mean" in pooled[str(lags[0])]  # results written before they were measured lack it
    fig, axes = plt.subplots(1, 4 if weights else 3, figsize=(20 if weights else 15, 4.5))
    colors = {"kl_mean": "C0", "kl_p95": "C1", "kl_max": "C3"}
    for name, color in colors.items():
        med = [pooled[str(k)][name]["median"] for k in lags]
        low = [pooled[str(k)][name]["p25"] for k in lags]
        high = [pooled[str(k)][name]["p75"] for k in lags]
        axes[0].plot(lags, med, color=color, marker="o", label=f"{name} (pooled median)")
        axes[0].fill_between(lags, low, high, color=color, alpha=0.2)
        for table in result["summary"]["per_seed"].values():
            axes[0].plot(
                lags, [table[str(k)][name]["median"] for k in lags], color=color, lw=0.6, ls=":"
            )
    axes[0].axhspan(*THRESHOLDS, color="grey", alpha=0.15, label="APS thresholds 0.01-0.05")
    axes[0].set_yscale("log")
    axes[0].set_xlabel("lag k (versions behind the newest)")
    axes[0].set_ylabel("KL(pi_{v-k} || pi_v), nats")
    axes[0].set_title("per-state KL on the batch's states")
    axes[0].legend(fontsize=7)
    for ax, name, title in (
        (axes[1], "clip_fraction", "clip fraction at the update's start"),
        (axes[2], "loss", "clipped surrogate loss at the update's start"),
    ):
        med = [pooled[str(k)][name]["median"] for k in lags]
        ax.plot(lags, med, marker="o", color="C2", label="pooled median (25-75% band)")
        ax.fill_between(
            lags,
            [pooled[str(k)][name]["p25"] for k in lags],
            [pooled[str(k)][name]["p75"] for k in lags],
            color="C2",
            alpha=0.2,
        )
        for seed, table in result["summary"]["per_seed"].items():
            ax.plot(
                lags,
                [table[str(k)][name]["median"] for k in lags],
                lw=0.6,
                ls=":",
                label=f"seed {seed}",
            )
        ax.set_xlabel("lag k")
        ax.set_title(title)
        ax.legend(fontsize=7)
    if weights:
        for index, name in enumerate(WEIGHT_FIGURES):
            axes[3].plot(
                lags,
                [pooled[str(k)][name]["median"] for k in lags],
                marker="o",
                color=f"C{index}",
                label=name,
            )
            axes[3].fill_between(
                lags,
                [pooled[str(k)][name]["p25"] for k in lags],
                [pooled[str(k)][name]["p75"] for k in lags],
                color=f"C{index}",
                alpha=0.15,
            )
        axes[3].set_xlabel("lag k")
        axes[3].set_title("truncated weight min(1, pi_v / pi_{v-k}), pooled")
        axes[3].legend(fontsize=7)
    cfg = result["config"]
    fig.suptitle(
        f"MinAtar Breakout, PPO, {cfg['updates']} updates x {cfg['num_envs'] * cfg['num_steps']}"
        f" env-steps, seeds {cfg['seeds']}; medians over updates {cfg['skip'] + 1}+"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--updates", type=int, default=300)
    parser.add_argument("--num-envs", type=int, default=8)
    parser.add_argument("--num-steps", type=int, default=128)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--minibatches", type=int, default=4)
    parser.add_argument("--lr", type=float, default=5e-4)
    parser.add_argument("--gamma", type=float, default=0.99)
    parser.add_argument("--gae-lambda", type=float, default=0.95)
    parser.add_argument("--ent-coef", type=float, default=0.01)
    parser.add_argument(
        "--skip", type=int, default=LAGS, help="warm-up updates left out of the medians"
    )
    parser.add_argument("--out", required=True, help="path stem: writes STEM.json and STEM.png")
    parser.add_argument("--replot", action="store_true", help="only the plot, from STEM.json")
    args = parser.parse_args()
    stem = Path(args.out)
    if args.replot:
        result = json.loads(stem.with_suffix(".json").read_text())
        plot(result, stem.with_suffix(".png"))
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    config = {k: v for k, v in vars(args).items() if k not in ("out", "replot")}
    config["seeds"] = seeds
    runs = [run_seed(seed, args) for seed in seeds]
    result = {
        "benchmark": "staleness",
        "date": datetime.date.today().isoformat(),
        "env": "MinAtar/Breakout-v1",
        "machine": {"python": platform.python_version(), "cpu_threads": 1},
        "command": " ".join(["python", "benchmarks/staleness.py", *sys.argv[1:]]),
        "config": config,
        "summary": summarize(runs, args.skip),
        "runs": runs,
    }
    stem.parent.mkdir(parents=True, exist_ok=True)
    write_result(result, stem.with_suffix(".json"))
    plot(result, stem.with_suffix(".png"))
    print_table(result["summary"])
    print(json.dumps(result["summary"]["k1_drift_over_threshold"], indent=1))
    print("final return (last 20 episodes):", result["summary"]["final_return_last20"])


if __name__ == "__main__":
    main()
