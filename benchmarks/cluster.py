"""An emulated bandwidth-limited cluster: wall-clock cost of weight syncs per strategy.

The learner and each worker run in network namespaces of their own, joined through a switch
namespace (a Linux bridge) by veth pairs. Every host's link is shaped in both directions
with the kernel's token-bucket filter (``tc qdisc ... tbf rate R``), so a host has a NIC of
rate R and the learner's link is shared by the weights it sends to all workers, as on a
switched cluster. Addresses are 10.231.0.0/24 and exist only inside the namespaces this
creates; nothing leaves them. The namespaces (all named ``apsbench-*``) are removed on exit
whatever happens (normal end, error, Ctrl-C, SIGTERM), and stale ones from an earlier run
that was killed with SIGKILL are removed at start.

For each rate and strategy it runs ``examples/ppo_cluster.py`` (DETACH PPO on CartPole-v1)
with a policy large enough for weights to matter (``--hidden-size 1024``: 2.1M parameters,
8.45 MB a version), the learner listening inside its namespace and ``aps worker`` processes
dialing it from theirs, and reports:

- wall time (training loop only) and wall time to reach a return target: by default
  always-sync's final return at the same rate, so the ratio reads "how long this strategy
  took to get where always-sync ended";
- env-steps/s, syncs and weight bytes;
- time spent syncing: over the iterations in which weights travelled, the time of
  publish + rollout beyond the median of the iterations in which none did (same rate, any
  strategy); and its share of the wall time. Beside it, ``link_s``: the weight bytes divided
  by the rate, the least time the link needs to carry them.

One lockstep row per rate: the learner chooses actions and ``ClusterEnv.step`` makes one
round trip to both workers per step; its median and 95th-percentile step time under the
shaped link.

Needs Linux, root, ``ip`` and ``tc``; otherwise it says why and exits 0 (skipped).

    sudo .venv/bin/python benchmarks/cluster.py                # 1gbit, 100mbit, 20mbit
    sudo .venv/bin/python benchmarks/cluster.py --rates 20mbit --total-timesteps 20480
    sudo .venv/bin/python benchmarks/cluster.py --overlap-weights  # transfers hidden
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
PREFIX = "apsbench-"
SUBNET = "10.231.0"  # private; the addresses live only inside the namespaces made here
LEARNER_IP = f"{SUBNET}.1"
PORT = 7000
STRATEGIES = {
    "always": ["--sync", "always"],
    "aps-0.05": ["--sync", "aps", "--kl-threshold", "0.05"],  # APS with its default max_lag
    "fixed-4": ["--sync", "fixed", "--fixed-versions", "4"],
}


def sh(*command: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run an ip/tc command; raise with its stderr when it fails and ``check``."""
    proc = subprocess.run(command, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({proc.returncode}): {proc.stderr}")
    return proc


def rate_bits(rate: str) -> float:
    """``"20mbit"`` -> 20e6 bits/s (tc's units: bit, kbit, mbit, gbit)."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, factor in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * factor
    raise ValueError(f"rate {rate!r} must end in bit, kbit, mbit or gbit (tc's units)")


def skip_reason() -> str | None:
    """Why this host cannot run the benchmark, or None."""
    if platform.system() != "Linux":
        return f"needs Linux network namespaces; this is {platform.system()}"
    if os.geteuid() != 0:
        return "needs root (ip netns, tc); run it with sudo"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the {tool!r} command (iproute2)"
    return None


def namespaces() -> list[str]:
    """The benchmark's namespaces that exist now."""
    listed = sh("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(PREFIX)]


def remove_all() -> None:
    """Delete every ``apsbench-*`` namespace; their veths and qdiscs go with them."""
    for name in namespaces():
        # Processes still inside would keep a namespace alive unnamed: end them first.
        pids = sh("ip", "netns", "pids", name, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        sh("ip", "netns", "del", name, check=False)


class Cluster:
    """The namespaces, bridge and shaped veths of one rate; a context manager."""

    def __init__(self, rate: str, workers: int) -> None:
        self.rate, self.workers = rate, workers
        self.switch = f"{PREFIX}sw"
        self.hosts = [f"{PREFIX}l", *(f"{PREFIX}w{i}" for i in range(workers))]

    def __enter__(self) -> Cluster:
        try:
            self._create()
        except BaseException:
            remove_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        remove_all()

    def _create(self) -> None:
        sw = self.switch
        sh("ip", "netns", "add", sw)
        sh("ip", "-n", sw, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", sw, "link", "set", "br0", "up")
        # A token bucket of 10 ms at the rate, and at least 256 KB: veths hand tbf segments
        # of up to 64 KB (segmentation offload), and tbf drops any larger than its bucket.
        burst = max(int(rate_bits(self.rate) / 8 / 100), 256 * 1024)
        for index, host in enumerate(self.hosts):
            sh("ip", "netns", "add", host)
            sh("ip", "-n", host, "link", "set", "lo", "up")
            inside, port = f"eth{index}", f"port{index}"
            sh(
                "ip", "link", "add", inside, "netns", host, "type", "veth",
                "peer", "name", port, "netns", sw,
            )  # fmt: skip
            sh("ip", "-n", host, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", inside)
            sh("ip", "-n", host, "link", "set", inside, "up")
            sh("ip", "-n", sw, "link", "set", port, "master", "br0")
            sh("ip", "-n", sw, "link", "set", port, "up")
            for namespace, device in ((host, inside), (sw, port)):  # both directions
                sh(
                    "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
                    "rate", self.rate, "burst", str(burst), "latency", "100ms",
                )  # fmt: skip

    def spawn(self, host: str, command: list[str], env: dict[str, str], log: Path) -> Any:
        """Start ``command`` inside ``host``'s namespace, in a process group of its own."""
        return subprocess.Popen(
            ["ip", "netns", "exec", host, *command],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )


def stop(proc: Any, grace: float = 10.0) -> None:
    """End a process group started by :meth:`Cluster.spawn` (TERM, then KILL)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


def run_hosts(
    cluster: Cluster,
    learner_command: list[str],
    args: argparse.Namespace,
    logs: Path,
    name: str,
    policy: str | None = None,
) -> None:
    """Run the learner command in the learner's namespace and ``aps worker`` in the others."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "APS_TOKEN": secrets.token_hex(16)}
    url = f"tcp://{LEARNER_IP}:{PORT}"
    learner = cluster.spawn(cluster.hosts[0], learner_command, env, logs / f"{name}.learner.log")
    workers = []
    try:
        for index, host in enumerate(cluster.hosts[1:]):
            worker = [sys.executable, "-m", "aps", "worker", url, "--env", args.env_id]
            worker += ["--num-envs", str(args.envs_per_worker), "--no-reconnect"]
            if policy is not None:  # workers run only the policy their side names
                worker += ["--policy", policy]
            log = logs / f"{name}.worker{index}.log"
            workers.append(cluster.spawn(host, worker, env, log))
        status = learner.wait(timeout=args.timeout)
        if status != 0:
            tail = (logs / f"{name}.learner.log").read_text()[-3000:]
            raise RuntimeError(f"{name}: the learner exited with {status}:\n{tail}")
    finally:
        stop(learner)
        for worker in workers:
            stop(worker)


def detach_run(
    cluster: Cluster, strategy: str, args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    """One DETACH PPO run of ``strategy`` on the shaped cluster; the example's figures."""
    out = logs / f"{cluster.rate}-{strategy}.json"
    command = [
        sys.executable, str(ROOT / "examples" / "ppo_cluster.py"),
        "--listen", f"tcp://{LEARNER_IP}:{PORT}", "--workers", str(args.workers),
        "--env-id", args.env_id, "--hidden-size", str(args.hidden_size),
        "--num-steps", str(args.num_steps), "--total-timesteps", str(args.total_timesteps),
        "--seed", str(args.seed), "--torch-threads", "1", "--no-progress", "--json", str(out),
        *STRATEGIES[strategy],
    ]  # fmt: skip
    if args.overlap_weights:
        command.append("--overlap-weights")
    # The learner names its agent by this path (examples/ppo_cluster.py's policy_path).
    policy = f"{ROOT / 'examples' / 'ppo_cluster.py'}:sized.h{args.hidden_size}x2"
    run_hosts(cluster, command, args, logs, f"{cluster.rate}-{strategy}", policy)
    return dict(json.loads(out.read_text()))


LOCKSTEP = """
import json, os, sys, time
import numpy as np
import aps
url, workers, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
envs = aps.ClusterEnv(url, num_workers=workers, token=os.environ["APS_TOKEN"])
envs.reset(seed=0)
rng = np.random.default_rng(0)
times = []
for _ in range(steps):
    actions = rng.integers(0, 2, size=envs.num_envs)
    start = time.perf_counter()
    envs.step(actions)
    times.append(time.perf_counter() - start)
envs.close()
print("LOCKSTEP", json.dumps(times))
"""


def lockstep_run(cluster: Cluster, args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    """Remote steps (the learner chooses actions): the step round trip under the link."""
    name = f"{cluster.rate}-lockstep"
    url = f"tcp://{LEARNER_IP}:{PORT}"
    command = [sys.executable, "-c", LOCKSTEP, url, str(args.workers), str(args.lockstep_steps)]
    run_hosts(cluster, command, args, logs, name)
    line = next(
        line
        for line in (logs / f"{name}.learner.log").read_text().splitlines()
        if line.startswith("LOCKSTEP ")
    )
    times = sorted(json.loads(line.removeprefix("LOCKSTEP ")))[10:]  # the first steps warm up
    return {
        "rate": cluster.rate,
        "steps": len(times),
        "step_ms_p50": 1e3 * statistics.median(times),
        "step_ms_p95": 1e3 * times[int(0.95 * (len(times) - 1))],
    }


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Seconds until the mean return of the last 50 episodes first reached ``target``."""
    for row in curve:
        if row["mean_return"] == row["mean_return"] and row["mean_return"] >= target:
            return float(row["seconds"])
    return None


def summarize(
    results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One row per rate and strategy, with times to target and the time spent syncing."""
    rows = []
    for rate, by_strategy in results.items():
        idle = [
            row["rollout_seconds"]
            for figures in by_strategy.values()
            for previous, row in zip([None, *figures["curve"]], figures["curve"], strict=False)
            if row["syncs"] == (previous["syncs"] if previous else 0)
        ]
        baseline = statistics.median(idle) if idle else None
        always = by_strategy.get("always")
        target = args.target
        if target is None and always is not None:
            target = always["final_return"]
        for strategy, figures in by_strategy.items():
            curve = figures["curve"]
            sync_s = None
            if baseline is not None:
                sync_s = sum(
                    max(row["rollout_seconds"] - baseline, 0.0)
                    for previous, row in zip([None, *curve], curve, strict=False)
                    if row["syncs"] != (previous["syncs"] if previous else 0)
                )
            reach = None if target is None else time_to(curve, target)
            always_reach = (
                None if target is None or always is None else time_to(always["curve"], target)
            )
            rows.append(
                {
                    "rate": rate,
                    "strategy": strategy,
                    "final_return": figures["final_return"],
                    "target": target,
                    "seconds_to_target": reach,
                    "time_ratio_vs_always": (
                        reach / always_reach if reach is not None and always_reach else None
                    ),
                    "seconds": figures["seconds"],
                    "sps": figures["sps"],
                    "syncs": figures["syncs"],
                    "weight_bytes": figures["weight_bytes"],
                    "bytes_per_version": figures["bytes_per_version"],
                    "sync_seconds": sync_s,
                    "sync_share": None if sync_s is None else sync_s / figures["seconds"],
                    "link_seconds": figures["weight_bytes"] * 8 / rate_bits(rate),
                    "lag_mean": figures["lag_mean"],
                    "lag_max": figures["lag_max"],
                }
            )
    return rows


def on_signal(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}; removing the namespaces")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1gbit,100mbit,20mbit", help="tc rates, fastest first")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument("--env-id", default="CartPole-v1")
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--num-steps", type=int, default=128)
    parser.add_argument("--total-timesteps", type=int, default=40_960)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--target", type=float, default=None, help="default: always's final")
    parser.add_argument(
        "--overlap-weights",
        action="store_true",
        help="a chosen version travels while the workers act with theirs (Learner's option)",
    )
    parser.add_argument("--lockstep-steps", type=int, default=300)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=RESULTS / "cluster.json")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    rates = args.rates.split(",")
    for rate in rates:
        try:
            rate_bits(rate)
        except ValueError as exc:
            parser.error(str(exc))
    reason = skip_reason()
    if reason is not None:
        print(f"skipped: benchmarks/cluster.py {reason}")
        return

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    stale = namespaces()
    if stale:
        print(f"removing stale namespaces of an earlier run: {', '.join(stale)}")
    remove_all()
    results: dict[str, dict[str, dict[str, Any]]] = {}
    lockstep = []
    logs = Path(tempfile.mkdtemp(prefix="aps-cluster-"))
    print(f"logs in {logs}")
    try:
        for rate in rates:
            with Cluster(rate, args.workers) as cluster:
                lockstep.append(lockstep_run(cluster, args, logs))
                print(f"{rate} lockstep: {lockstep[-1]}", flush=True)
                for strategy in strategies:
                    figures = detach_run(cluster, strategy, args, logs)
                    results.setdefault(rate, {})[strategy] = figures
                    print(
                        f"{rate} {strategy}: return {figures['final_return']:.1f}, "
                        f"{figures['seconds']:.1f} s, {figures['syncs']} syncs, "
                        f"{figures['weight_bytes'] / 1e6:.0f} MB",
                        flush=True,
                    )
    finally:
        remove_all()
    rows = summarize(results, args)
    report = {
        "benchmark": "cluster",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "command": " ".join(["python", "benchmarks/cluster.py", *sys.argv[1:]]),
        "rows": rows,
        "lockstep": lockstep,
        "curves": {
            rate: {s: figures["curve"] for s, figures in by_strategy.items()}
            for rate, by_strategy in results.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    with args.out.with_suffix(".csv").open("w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print_table(rows, lockstep)
    print(f"wrote {args.out} and {args.out.with_suffix('.csv')}")


def print_table(rows: list[dict[str, Any]], lockstep: list[dict[str, Any]]) -> None:
    def num(value: float | None, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    print(
        "| rate | strategy | final return | s to target | ratio vs always | wall s | "
        "env-steps/s | syncs | weight MB | sync s (share) | link s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        share = num(r["sync_share"], ".0%")
        print(
            f"| {r['rate']} | {r['strategy']} | {r['final_return']:.1f} | "
            f"{num(r['seconds_to_target'], '.1f')} | {num(r['time_ratio_vs_always'], '.2f')} | "
            f"{r['seconds']:.1f} | {r['sps']:,.0f} | {r['syncs']} | "
            f"{r['weight_bytes'] / 1e6:,.0f} | {num(r['sync_seconds'], '.1f')} ({share}) | "
            f"{r['link_seconds']:.1f} |"
        )
    print("\n| rate | lockstep step p50 ms | p95 ms |\n|---|---|---|")
    for row in lockstep:
        print(f"| {row['rate']} | {row['step_ms_p50']:.2f} | {row['step_ms_p95']:.2f} |")


if __name__ == "__main__":
    main()
