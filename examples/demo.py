"""Demo: PPO with Adaptive Policy Synchronization on CartPole-v1 over 2 local worker processes.

The workers act with their own copy of the policy; after every PPO update the learner
publishes a new version, and APS sends it to a worker only when that worker's copy has
drifted too far from it (KL over the states the worker just visited above a threshold).
The return rises as usual while most versions never cross the wire. At the end the demo
compares the weight traffic with always-sync, measured by a second, identical run that
sends every version to every worker (``--no-compare`` skips it and shows the computed figure
only). Its last line says what bounded the APS run: the envs, inference, the wire, the learner
or one slow worker (:func:`aps.metrics.verdict`).

    python examples/demo.py [--total-timesteps 50000] [--kl-threshold 0.05] [--no-compare]

The training code is examples/ppo_cluster.py, imported here.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load_ppo_cluster() -> Any:
    """Import examples/ppo_cluster.py by path (examples/ is not a package)."""
    spec = importlib.util.spec_from_file_location("ppo_cluster", HERE / "ppo_cluster.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["ppo_cluster"] = module  # its dataclasses look themselves up here
    spec.loader.exec_module(module)
    return module


def megabytes(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--total-timesteps", type=int, default=50_000, help="env steps a run")
    parser.add_argument("--kl-threshold", type=float, default=0.05, help="APS threshold, nats")
    parser.add_argument("--workers", type=int, default=2, help="number of worker processes")
    parser.add_argument("--envs-per-worker", type=int, default=8, help="envs per worker")
    parser.add_argument("--num-steps", type=int, default=32, help="steps per env per rollout")
    parser.add_argument(
        "--transport", default="tcp", choices=["tcp", "unix", "ws", "memory"], help="the transport"
    )
    parser.add_argument("--seed", type=int, default=1, help="seed of the experiment")
    parser.add_argument(
        "--compare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure always-sync with a second run of the same budget",
    )
    options = parser.parse_args()
    ppo = load_ppo_cluster()

    def args_for(sync: str) -> Any:
        return ppo.parse_args(
            [
                f"--sync={sync}",
                f"--kl-threshold={options.kl_threshold}",
                f"--total-timesteps={options.total_timesteps}",
                f"--workers={options.workers}",
                f"--envs-per-worker={options.envs_per_worker}",
                f"--num-steps={options.num_steps}",
                f"--transport={options.transport}",
                f"--seed={options.seed}",
                "--no-progress",
            ]
        )

    args = args_for("aps")
    batch = args.workers * args.envs_per_worker * args.num_steps
    every = max(args.total_timesteps // batch // 25, 1)  # about 25 lines

    def report(it: dict[str, Any]) -> None:
        if it["iteration"] % every and it["iteration"] != it["num_iterations"]:
            return
        ret = it["mean_return"]
        print(
            f"iteration {it['iteration']:>4}/{it['num_iterations']}  "
            f"step {it['global_step']:>7,}  "
            f"return {'   n/a' if math.isnan(ret) else f'{ret:6.1f}'}  "
            f"syncs {it['syncs']:>4}  "
            f"{it['sps']:>6,.0f} env-steps/s",
            flush=True,
        )

    print(
        f"PPO on {args.env_id}: {args.workers} worker processes x {args.envs_per_worker} envs "
        f"over {args.transport}, APS with kl_threshold={args.kl_threshold}"
    )
    aps_run = ppo.train(args, on_iteration=report)
    print(ppo.summary_line(aps_run))

    always = None
    if options.compare:
        print(
            "\nmeasuring always-sync: the same run, every version to every worker ...", flush=True
        )
        always = ppo.train(args_for("always"))
        print(ppo.summary_line(always))

    # In this loop every rollout waits for every worker, so always-sync sends each published
    # version to each worker: versions x workers x bytes per version, exactly.
    versions, workers = aps_run["versions"], aps_run["workers"]
    computed = aps_run["always_sync_weight_bytes"]
    reference = always["weight_bytes"] if always else computed
    rows = [(f"APS (kl_threshold={args.kl_threshold})", aps_run["syncs"], aps_run["weight_bytes"])]
    if always:
        rows.append(("always-sync, measured", always["syncs"], always["weight_bytes"]))
    rows.append(("always-sync, computed", versions * workers, computed))
    print(f"\nweights sent over {versions} published versions:")
    for label, syncs, nbytes in rows:
        print(f"  {label:<26} {syncs:>5} syncs {megabytes(nbytes):>10}")
    print(
        f"  (computed: {versions} versions x {workers} workers x "
        f"{aps_run['bytes_per_version']:,} bytes per version)"
    )
    share = aps_run["weight_bytes"] / reference if reference else math.nan
    final = aps_run["final_return"]
    versus = ""
    if always and always["final_return"] is not None:
        versus = f" (always-sync: {always['final_return']:.1f})"
    print(
        f"\nsummary: APS final return {'n/a' if final is None else f'{final:.1f}'}{versus}; "
        f"APS sent {share:.0%} of always-sync's weight bytes "
        f"({'measured' if always else 'computed'}); {aps_run['sps']:,.0f} env-steps/s"
    )
    print(f"\nwhere the APS run's time went: {aps_run['verdict']}")


if __name__ == "__main__":
    main()
