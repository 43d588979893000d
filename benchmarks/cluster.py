"""An emulated bandwidth-limited cluster: wall-clock cost of weight syncs per strategy.

The learner and each worker run in network namespaces of their own, joined through a switch
namespace (a Linux bridge) by veth pairs. Every host's link is shaped in both directions
with the kernel's token-bucket filter (``tc qdisc ... tbf rate R``), so a host has a NIC of
rate R and the learner's link is shared by the weights it sends to all workers, as on a
switched cluster. Addresses are 10.231.0.0/24 and exist only inside the namespaces this
creates; nothing leaves them. The namespaces (named ``apsbench-<pid>-*`` after the run's
process) are removed on exit
whatever happens (normal end, error, Ctrl-C, SIGTERM), and stale ones from an earlier run
that was killed with SIGKILL are removed at start.

For each rate and strategy it runs ``examples/ppo_cluster.py`` (DETACH PPO on CartPole-v1)
with a policy large enough for weights to matter (``--hidden-size 1024``: 2.1M parameters,
8.45 MB a version), the learner listening inside its namespace and ``aps worker`` processes
dialing it from theirs, and reports:

- wall time (training loop only) and wall time to reach a fixed return target (``--target``,
  195 by default: the same number for every seed and strategy), and its ratio to
  always-sync's time on the same seed;
- the return at equal wall time: every run's mean return at the end of the shortest run of
  its rate;
- env-steps/s, syncs and weight bytes;
- time spent syncing: over the iterations in which weights travelled, the time of
  publish + rollout beyond the median of the iterations in which none did (same rate, any
  strategy); and its share of the wall time. Beside it, ``link_s``: the weight bytes divided
  by the rate, the least time the link needs to carry them.

One lockstep row per rate: the learner chooses actions and ``ClusterEnv.step`` makes one
round trip to both workers per step; its median and 95th-percentile step time under the
shaped link.

Over several seeds (``--seeds 1,2,3,4,5``) every (rate, strategy) runs once per seed, in
interleaved order, and the table gives each figure with an interval: the mean with its 95%
percentile-bootstrap interval for the return at equal wall time and for the bytes; the
median with its (20%, 80%) quantiles for the time to target, where a run that never reached
the target counts as an infinite time (shown as "not reached") rather than being dropped,
and the count of runs that reached it.

``--workload pong``: pixels, ``--pixel-env`` (Pong-v5 through EnvPool) on 2 workers x 8 envs
per compression setting in ``--compressions``: a lockstep run (random actions, the learner
stepping the workers) and, when ``examples/ppo_atari.py`` exists, its DETACH PPO run. Each
gives env-steps/s, the bytes per env-step each way (the learner's interface counters inside
its namespace, headers included) and the CPU seconds of the learner and of the workers;
against the ``none`` run at the same rate, the extra CPU per MB of frames is compression's
cost on each side. Settings other than ``none`` need an aps with ``compression=``; without
it they are skipped, saying so. ``--pixel-modes`` picks the modes; ``--rounds N`` runs every
mode and setting N times, rounds outermost so the settings interleave, and reports each
setting's median env-steps/s with the (min, max) of its ratio to ``none`` in the same round.

Needs Linux, root, ``ip`` and ``tc``; otherwise it says why and exits 0 (skipped).

    sudo .venv/bin/python benchmarks/cluster.py                # 1gbit, 100mbit, 20mbit
    sudo .venv/bin/python benchmarks/cluster.py --rates 20mbit --total-timesteps 20480
    sudo .venv/bin/python benchmarks/cluster.py --overlap-weights  # transfers hidden
    sudo .venv/bin/python benchmarks/cluster.py --seeds 1,2,3,4,5 --rates 20mbit
    sudo .venv/bin/python benchmarks/cluster.py --workload pong --compressions none,zstd
    sudo .venv/bin/python benchmarks/cluster.py --workload pong --rates 1gbit \
        --pixel-modes lockstep --compressions none,auto,lz4 --rounds 5
    sudo .venv/bin/python benchmarks/cluster.py --quick  # tiny budgets, 1 seed, 1 rate

``benchmarks/results_page.py`` turns the JSON into the tables of the results page.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import inspect
import json
import math
import os
import platform
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
PREFIX = "apsbench-"
RUN = f"{PREFIX}{os.getpid()}-"
"""This run's namespaces start so: two runs on one machine (two test suites, say) each
create and remove their own, and only a dead run's namespaces are stale."""
SUBNET = "10.231.0"  # private; the addresses live only inside the namespaces made here
LEARNER_IP = f"{SUBNET}.1"
PORT = 7000
WORKLOADS = ("cartpole", "pong")
COMPRESSIONS = ("none", "auto", "zstd", "lz4")  # aps's compression= values
PIXEL_EXAMPLE = ROOT / "examples" / "ppo_atari.py"  # the Atari example, once it exists
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


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The benchmark's namespaces that exist now (of every run, or those named ``prefix``)."""
    listed = sh("ip", "netns", "list", check=False).stdout.split("\n")
    return [line.split()[0] for line in listed if line.startswith(prefix)]


def is_stale(name: str) -> bool:
    """Whether namespace ``name`` belongs to a run whose process is gone (or to this one's
    earlier format, which named no process)."""
    owner = name.removeprefix(PREFIX).partition("-")[0]
    if not owner.isdigit():
        return True
    try:
        os.kill(int(owner), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def remove_all(names: Sequence[str] | None = None) -> None:
    """Delete this run's namespaces (or ``names``); their veths and qdiscs go with them."""
    for name in namespaces(RUN) if names is None else names:
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
        self.switch = f"{RUN}sw"
        self.hosts = [f"{RUN}l", *(f"{RUN}w{i}" for i in range(workers))]

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
    worker_args: Sequence[str] = (),
    env_id: str | None = None,
) -> None:
    """Run the learner command in the learner's namespace and ``aps worker`` in the others.

    Each worker runs under :data:`CPU_WRAPPER`, which logs its CPU seconds when it ends.
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), "APS_TOKEN": secrets.token_hex(16)}
    url = f"tcp://{LEARNER_IP}:{PORT}"
    learner = cluster.spawn(cluster.hosts[0], learner_command, env, logs / f"{name}.learner.log")
    workers = []
    try:
        for index, host in enumerate(cluster.hosts[1:]):
            worker = [sys.executable, "-c", CPU_WRAPPER, sys.executable, "-m", "aps", "worker"]
            worker += [url, "--env", env_id or args.env_id]
            worker += ["--num-envs", str(args.envs_per_worker), "--no-reconnect", *worker_args]
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


# Runs a command and logs the CPU seconds it used. stop() ends the process group with
# SIGTERM: the wrapper's handler (a Python function, reset to the default across exec, so
# the worker still ends) keeps the wrapper alive long enough to read its child's usage.
CPU_WRAPPER = """
import resource, signal, subprocess, sys
signal.signal(signal.SIGTERM, lambda signum, frame: None)
proc = subprocess.Popen(sys.argv[1:])
while True:
    try:
        status = proc.wait()
        break
    except InterruptedError:
        continue
usage = resource.getrusage(resource.RUSAGE_CHILDREN)
print("CPU_SECONDS", usage.ru_utime + usage.ru_stime, flush=True)
sys.exit(status if status >= 0 else 0)
"""


def logged_cpu(log: Path) -> float | None:
    """The CPU seconds a :data:`CPU_WRAPPER` run logged, or None."""
    for line in reversed(log.read_text().splitlines()):
        if line.startswith("CPU_SECONDS "):
            return float(line.split()[1])
    return None


def detach_run(
    cluster: Cluster, strategy: str, args: argparse.Namespace, logs: Path, seed: int | None = None
) -> dict[str, Any]:
    """One DETACH PPO run of ``strategy`` on the shaped cluster; the example's figures."""
    seed = args.seeds[0] if seed is None else seed
    out = logs / f"{cluster.rate}-{strategy}-seed{seed}.json"
    command = [
        sys.executable, str(ROOT / "examples" / "ppo_cluster.py"),
        "--listen", f"tcp://{LEARNER_IP}:{PORT}", "--workers", str(args.workers),
        "--env-id", args.env_id, "--hidden-size", str(args.hidden_size),
        "--num-steps", str(args.num_steps), "--total-timesteps", str(args.total_timesteps),
        "--seed", str(seed), "--torch-threads", "1", "--no-progress", "--json", str(out),
        *STRATEGIES[strategy],
    ]  # fmt: skip
    if args.overlap_weights:
        command.append("--overlap-weights")
    # The learner names its agent by this path (examples/ppo_cluster.py's policy_path).
    policy = f"{ROOT / 'examples' / 'ppo_cluster.py'}:sized.h{args.hidden_size}x2"
    run_hosts(cluster, command, args, logs, f"{cluster.rate}-{strategy}-seed{seed}", policy)
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


PIXEL_LOCKSTEP = """
import json, os, resource, sys, time
import numpy as np
import aps
url, workers, steps, compression = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
extra = {} if compression == "-" else {"compression": compression}
envs = aps.ClusterEnv(url, num_workers=workers, token=os.environ["APS_TOKEN"], **extra)
envs.reset(seed=0)
rng = np.random.default_rng(0)
figures = getattr(envs, "metrics", None) is not None and hasattr(envs.metrics, "since")
earlier = envs.metrics if figures else None
start = time.perf_counter()
for _ in range(steps):
    envs.step(rng.integers(0, envs.single_action_space.n, size=envs.num_envs))
seconds = time.perf_counter() - start
row = {"env_steps": steps * envs.num_envs, "seconds": seconds}
if figures:  # an aps with aps.metrics: what bound the timed steps
    from aps.metrics import verdict
    found = verdict(envs.metrics.since(earlier))
    row.update(verdict=found.bound, verdict_worker=found.worker, verdict_line=found.line)
envs.close()
print("PIXELS", json.dumps(row))
"""


def supports_compression() -> bool:
    """Whether this aps takes ``compression=`` (the handshake's negotiated compression)."""
    import aps

    return "compression" in inspect.signature(aps.ClusterEnv.__init__).parameters


def interface_bytes(host: str) -> tuple[int, int]:
    """Bytes received and sent so far on ``host``'s link (its veth, headers included)."""
    figures = []
    for counter in ("rx_bytes", "tx_bytes"):
        path = f"/sys/class/net/eth0/statistics/{counter}"  # the learner is host 0: eth0
        figures.append(int(sh("ip", "netns", "exec", host, "cat", path).stdout))
    return figures[0], figures[1]


def pixel_detach_command(
    url: str, compression: str | None, args: argparse.Namespace, out: Path
) -> list[str]:
    """``examples/ppo_atari.py``'s DETACH PPO run, listening on ``url`` for the workers."""
    command = [
        sys.executable, str(PIXEL_EXAMPLE), "--mode", "detach", "--listen", url,
        "--workers", str(args.workers), "--envs-per-worker", str(args.envs_per_worker),
        "--env-id", args.pixel_env, "--total-timesteps", str(args.pixel_timesteps),
        "--seed", str(args.seeds[0]), "--json", str(out),
    ]  # fmt: skip
    return command if compression is None else [*command, "--compression", compression]


def pixel_run(
    cluster: Cluster, mode: str, compression: str, args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    """One pixel run (``lockstep`` or ``detach``) under ``compression``; its figures."""
    name = f"{cluster.rate}-pixels-{mode}-{compression}"
    url = f"tcp://{LEARNER_IP}:{PORT}"
    passed = supports_compression()  # an aps without compression= runs only "none", plainly
    worker_args = ["--vector", args.pixel_vector]
    if passed:
        worker_args += ["--compression", compression]
    out = logs / f"{name}.json"
    policy = None
    if mode == "lockstep":
        script = [PIXEL_LOCKSTEP, url, str(args.workers), str(args.pixel_steps)]
        learner = [sys.executable, "-c", *script, compression if passed else "-"]
    else:
        learner = pixel_detach_command(url, compression if passed else None, args, out)
        policy = "aps.policy:NatureCNN"  # the example's agent, which the workers act with
    before = interface_bytes(cluster.hosts[0])
    command = [sys.executable, "-c", CPU_WRAPPER, *learner]
    run_hosts(cluster, command, args, logs, name, policy, worker_args, env_id=args.pixel_env)
    after = interface_bytes(cluster.hosts[0])
    log = (logs / f"{name}.learner.log").read_text()
    if mode == "lockstep":
        line = next(x for x in log.splitlines() if x.startswith("PIXELS "))
        figures = json.loads(line.removeprefix("PIXELS "))
    else:
        example = json.loads(out.read_text())
        figures = {"env_steps": example["global_step"], "seconds": example["seconds"]}
    steps = figures["env_steps"]
    workers_cpu = [logged_cpu(logs / f"{name}.worker{i}.log") for i in range(args.workers)]
    return {
        "rate": cluster.rate,
        "mode": mode,
        "compression": compression,
        "env_steps": steps,
        "seconds": figures["seconds"],
        "sps": steps / figures["seconds"],
        "bytes_in_per_step": (after[0] - before[0]) / steps,  # into the learner: frames
        "bytes_out_per_step": (after[1] - before[1]) / steps,  # out of it: actions, weights
        "learner_cpu_s": logged_cpu(logs / f"{name}.learner.log"),
        "workers_cpu_s": None if None in workers_cpu else sum(x for x in workers_cpu if x),
        # What bound the run, by aps.metrics.verdict (lockstep rows; None where not given).
        "verdict": figures.get("verdict"),
        "verdict_line": figures.get("verdict_line"),
    }


def compression_costs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each pixel row with its wire ratio and CPU per MB against the ``none`` run beside it.

    The MB are the frames' bytes as ``none`` carried them (bytes in per env-step there, times
    this run's env-steps); the CPU is this run's CPU seconds minus ``none``'s, scaled to this
    run's env-steps. Without a ``none`` run of the same rate, mode and round the figures are
    None.
    """

    def key(r: dict[str, Any]) -> tuple[str, str, int]:
        return r["rate"], r["mode"], r.get("round", 0)

    plain = {key(r): r for r in rows if r["compression"] == "none"}
    costed = []
    for row in rows:
        base = plain.get(key(row))
        extra: dict[str, Any] = {"wire_ratio_in": None, "learner_cpu_per_mb": None}
        extra["workers_cpu_per_mb"] = None
        if base is not None and base["bytes_in_per_step"] > 0:
            extra["wire_ratio_in"] = row["bytes_in_per_step"] / base["bytes_in_per_step"]
            megabytes = base["bytes_in_per_step"] * row["env_steps"] / 1e6
            scale = row["env_steps"] / base["env_steps"]
            for side in ("learner", "workers"):
                own, ref = row[f"{side}_cpu_s"], base[f"{side}_cpu_s"]
                if own is not None and ref is not None and megabytes > 0:
                    extra[f"{side}_cpu_per_mb"] = (own - ref * scale) / megabytes
        costed.append({**row, **extra})
    return costed


def pixel_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rate, mode and setting: median env-steps/s over the rounds, and its ratio to
    ``none``'s in the same round (the median, min and max of those per-round ratios)."""
    plain = {
        (r["rate"], r["mode"], r.get("round", 0)): r["sps"]
        for r in rows
        if r["compression"] == "none"
    }
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["rate"], row["mode"], row["compression"]), []).append(row)
    summary = []
    for (rate, mode, compression), group in groups.items():
        ratios = [
            r["sps"] / plain[(rate, mode, r.get("round", 0))]
            for r in group
            if plain.get((rate, mode, r.get("round", 0)))
        ]
        summary.append(
            {
                "rate": rate,
                "mode": mode,
                "compression": compression,
                "rounds": len(group),
                "sps_median": statistics.median(r["sps"] for r in group),
                "vs_none_median": statistics.median(ratios) if ratios else None,
                "vs_none_min": min(ratios, default=None),
                "vs_none_max": max(ratios, default=None),
            }
        )
    return summary


def time_to(curve: list[dict[str, Any]], target: float) -> float | None:
    """Seconds until the mean return of the last 50 episodes first reached ``target``."""
    for row in curve:
        if row["mean_return"] == row["mean_return"] and row["mean_return"] >= target:
            return float(row["seconds"])
    return None


def return_at(curve: list[dict[str, Any]], seconds: float) -> float | None:
    """The mean return of the last iteration that ended by ``seconds``, or None."""
    value = None
    for row in curve:
        if row["seconds"] <= seconds and row["mean_return"] == row["mean_return"]:
            value = float(row["mean_return"])
    return value


def mean_interval(
    values: Sequence[float | None], resamples: int = 10_000, seed: int = 0
) -> dict[str, Any]:
    """The mean of the values that exist and its 95% percentile-bootstrap interval.

    ``n`` counts the values given, ``present`` those not None; with one value the interval
    is that value, with none every figure is None.
    """
    data = np.asarray([v for v in values if v is not None], dtype=np.float64)
    result: dict[str, Any] = {"n": len(values), "present": int(data.size)}
    if data.size == 0:
        return {**result, "mean": None, "low": None, "high": None}
    means = np.random.default_rng(seed).choice(data, size=(resamples, data.size)).mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    return {**result, "mean": float(data.mean()), "low": float(low), "high": float(high)}


def format_interval(x: dict[str, Any], fmt: str = ".1f", scale: float = 1.0) -> str:
    """``mean (low, high)`` of a :func:`mean_interval`, each divided by ``scale``; ``n/a``
    without values, and the mean alone with one."""
    if x["mean"] is None:
        return "n/a"
    body = format(x["mean"] / scale, fmt)
    if x["present"] > 1:
        body += f" ({x['low'] / scale:{fmt}}, {x['high'] / scale:{fmt}})"
    return body


def median_interval(values: Sequence[float | None]) -> dict[str, Any]:
    """Median and (20%, 80%) quantiles of times where None means "never reached".

    A run that never reached the target counts as an infinitely long time, so it moves the
    quantiles up instead of dropping out; a quantile that lands on such a run is None.
    Quantiles are order statistics (``inverted_cdf``), never a blend with infinity.
    """
    data = np.asarray([math.inf if v is None else v for v in values], dtype=np.float64)
    result: dict[str, Any] = {"n": int(data.size), "reached": int(np.isfinite(data).sum())}
    if data.size == 0:
        return {**result, "median": None, "q20": None, "q80": None}
    q20, median, q80 = np.percentile(data, [20, 50, 80], method="inverted_cdf")

    def finite(x: float) -> float | None:
        return float(x) if math.isfinite(x) else None

    return {**result, "median": finite(median), "q20": finite(q20), "q80": finite(q80)}


Results = dict[str, dict[str, dict[int, dict[str, Any]]]]  # rate -> strategy -> seed -> figures


def summarize(results: Results, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per rate, strategy and seed: times to target, return at equal wall time, syncs."""
    rows = []
    for rate, by_strategy in results.items():
        runs = [figures for by_seed in by_strategy.values() for figures in by_seed.values()]
        idle = [
            row["rollout_seconds"]
            for figures in runs
            for previous, row in zip([None, *figures["curve"]], figures["curve"], strict=False)
            if row["syncs"] == (previous["syncs"] if previous else 0)
        ]
        baseline = statistics.median(idle) if idle else None
        equal_time = min(figures["seconds"] for figures in runs)  # the shortest run's wall
        target = args.target
        for strategy, by_seed in by_strategy.items():
            for seed, figures in by_seed.items():
                curve = figures["curve"]
                sync_s = None
                if baseline is not None:
                    sync_s = sum(
                        max(row["rollout_seconds"] - baseline, 0.0)
                        for previous, row in zip([None, *curve], curve, strict=False)
                        if row["syncs"] != (previous["syncs"] if previous else 0)
                    )
                reach = time_to(curve, target)
                always = by_strategy.get("always", {}).get(seed)
                always_reach = None if always is None else time_to(always["curve"], target)
                rows.append(
                    {
                        "rate": rate,
                        "strategy": strategy,
                        "seed": seed,
                        "final_return": figures["final_return"],
                        "target": target,
                        "seconds_to_target": reach,
                        "time_ratio_vs_always": (
                            reach / always_reach if reach is not None and always_reach else None
                        ),
                        "always_seconds_to_target": always_reach,
                        "equal_wall_s": equal_time,
                        "return_at_equal_wall": return_at(curve, equal_time),
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


def aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per rate and strategy over its seeds, each figure with its interval."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault((row["rate"], row["strategy"]), []).append(row)
    return [
        {
            "rate": rate,
            "strategy": strategy,
            "seeds": [r["seed"] for r in group],
            "target": group[0]["target"],
            "seconds_to_target": median_interval([r["seconds_to_target"] for r in group]),
            # Over the seeds on which always-sync reached the target: there a run of this
            # strategy that did not has an infinite ratio; elsewhere there is no ratio at all.
            "time_ratio_vs_always": median_interval(
                [r["time_ratio_vs_always"] for r in group if r["always_seconds_to_target"]]
            ),
            "return_at_equal_wall": mean_interval([r["return_at_equal_wall"] for r in group]),
            "equal_wall_s": group[0]["equal_wall_s"],
            "final_return": mean_interval([r["final_return"] for r in group]),
            "weight_bytes": mean_interval([r["weight_bytes"] for r in group]),
            "seconds": mean_interval([r["seconds"] for r in group]),
        }
        for (rate, strategy), group in groups.items()
    ]


def on_signal(signum: int, frame: object) -> None:
    raise SystemExit(f"stopped by signal {signum}; removing the namespaces")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line, checked: rates in tc's units, known strategies and compressions,
    seeds as a list of ints (``args.seeds``); ``--quick`` shrinks every budget."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--rates", default=None, help="tc rates, fastest first (1gbit,100mbit,20mbit)"
    )
    parser.add_argument("--workload", default="cartpole", choices=WORKLOADS)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--envs-per-worker", type=int, default=8)
    parser.add_argument("--env-id", default="CartPole-v1")
    parser.add_argument("--hidden-size", type=int, default=None, help="1024 (quick 64)")
    parser.add_argument("--num-steps", type=int, default=None, help="128 (quick 16)")
    parser.add_argument("--total-timesteps", type=int, default=None, help="40960 (quick 1024)")
    parser.add_argument("--seed", type=int, default=1, help="the seed when --seeds is not given")
    parser.add_argument("--seeds", default=None, help="comma-separated seeds: 1,2,3,4,5")
    parser.add_argument(
        "--target", type=float, default=195.0, help="the fixed return target of every run"
    )
    parser.add_argument(
        "--overlap-weights",
        action="store_true",
        help="a chosen version travels while the workers act with theirs (Learner's option)",
    )
    parser.add_argument("--lockstep-steps", type=int, default=None, help="300 (quick 20)")
    parser.add_argument("--compressions", default="none,zstd,lz4", help="pixel workload")
    parser.add_argument("--pixel-env", default="Pong-v5")
    parser.add_argument("--pixel-vector", default="envpool", help="the workers' --vector")
    parser.add_argument("--pixel-steps", type=int, default=None, help="lockstep, 300 (quick 20)")
    parser.add_argument("--pixel-modes", default="lockstep,detach", help="pixel workload")
    parser.add_argument("--rounds", type=int, default=1, help="pixel workload: interleaved")
    parser.add_argument(
        "--pixel-timesteps", type=int, default=None, help="DETACH, 65536 (quick 2048)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny budgets, 1 seed, 1 rate")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per run")
    parser.add_argument("--out", type=Path, default=None, help="results/cluster[-pong].json")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = {
        "rates": "100mbit" if quick else "1gbit,100mbit,20mbit",
        "hidden_size": 64 if quick else 1024,
        "num_steps": 16 if quick else 128,
        "total_timesteps": 1024 if quick else 40_960,
        "lockstep_steps": 20 if quick else 300,
        "pixel_steps": 20 if quick else 300,
        "pixel_timesteps": 2048 if quick else 65_536,
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.out is None:
        suffix = "" if args.workload == "cartpole" else f"-{args.workload}"
        args.out = RESULTS / f"cluster{suffix}.json"
    try:
        seeds = [args.seed] if args.seeds is None else [int(x) for x in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds must be comma-separated ints such as 1,2,3,4,5, got {args.seeds!r}")
    if len(set(seeds)) != len(seeds):
        parser.error(f"--seeds has a seed twice: {args.seeds!r}; give each seed once")
    args.seeds = seeds[:1] if quick else seeds
    strategies = args.strategies.split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategies {unknown}; choose from {', '.join(STRATEGIES)}")
    args.strategy_list = strategies
    compressions = args.compressions.split(",")
    unknown = [c for c in compressions if c not in COMPRESSIONS]
    if unknown:
        parser.error(f"unknown compressions {unknown}; choose from {', '.join(COMPRESSIONS)}")
    args.compression_list = compressions
    args.pixel_mode_list = args.pixel_modes.split(",")
    unknown = [m for m in args.pixel_mode_list if m not in ("lockstep", "detach")]
    if unknown:
        parser.error(f"unknown --pixel-modes {unknown}; choose from lockstep, detach")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    args.rate_list = args.rates.split(",")
    for rate in args.rate_list:
        try:
            rate_bits(rate)
        except ValueError as exc:
            parser.error(str(exc))
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    reason = skip_reason()
    if reason is not None:
        print(f"skipped: benchmarks/cluster.py {reason}")
        return
    if args.workload == "pong" and "none" not in args.compression_list:
        print("note: without a 'none' run, compression's CPU per MB cannot be measured")
    if args.workload == "pong" and args.compression_list != ["none"] and not supports_compression():
        print("this aps has no compression= yet: only the 'none' pixel runs go ahead")
        args.compression_list = [c for c in args.compression_list if c == "none"]

    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    stale = [name for name in namespaces() if is_stale(name)]
    if stale:
        print(f"removing stale namespaces of an earlier run: {', '.join(stale)}")
        remove_all(stale)
    results: Results = {}
    lockstep = []
    pixels = []
    logs = Path(tempfile.mkdtemp(prefix="aps-cluster-"))
    print(f"logs in {logs}")
    try:
        for rate in args.rate_list:
            with Cluster(rate, args.workers) as cluster:
                if args.workload == "pong":
                    modes = args.pixel_mode_list
                    if "detach" in modes and not PIXEL_EXAMPLE.exists():
                        print(f"{rate}: no {PIXEL_EXAMPLE.name} here; lockstep pixel runs only")
                        modes = [m for m in modes if m != "detach"]
                    for round_ in range(args.rounds):  # rounds outermost: settings interleave
                        for mode in modes:
                            for compression in args.compression_list:
                                row = pixel_run(cluster, mode, compression, args, logs)
                                pixels.append({**row, "round": round_})
                                print(f"{rate} pixels: {pixels[-1]}", flush=True)
                    continue
                lockstep.append(lockstep_run(cluster, args, logs))
                print(f"{rate} lockstep: {lockstep[-1]}", flush=True)
                for seed in args.seeds:  # seeds outermost: strategies interleave
                    for strategy in args.strategy_list:
                        figures = detach_run(cluster, strategy, args, logs, seed)
                        results.setdefault(rate, {}).setdefault(strategy, {})[seed] = figures
                        print(
                            f"{rate} seed {seed} {strategy}: return "
                            f"{figures['final_return']:.1f}, {figures['seconds']:.1f} s, "
                            f"{figures['syncs']} syncs, {figures['weight_bytes'] / 1e6:.0f} MB",
                            flush=True,
                        )
    finally:
        remove_all()
    rows = summarize(results, args)
    config = {k: v for k, v in vars(args).items() if k != "out"}
    report = {
        "benchmark": "cluster",
        "workload": args.workload,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": config,
        "command": " ".join(["python", "benchmarks/cluster.py", *(argv or sys.argv[1:])]),
        "rows": rows,
        "aggregate": aggregate(rows),
        "lockstep": lockstep,
        "pixels": compression_costs(pixels),
        "pixel_rounds": pixel_rounds(pixels),
        "curves": {
            rate: {
                strategy: {str(seed): f["curve"] for seed, f in by_seed.items()}
                for strategy, by_seed in by_strategy.items()
            }
            for rate, by_strategy in results.items()
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    table_rows = rows or report["pixels"]
    if table_rows:
        with args.out.with_suffix(".csv").open("w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=list(table_rows[0]))
            writer.writeheader()
            writer.writerows(table_rows)
    import results_page  # benchmarks/ is this script's directory, so first on sys.path

    print(results_page.cluster_tables(report))
    print(f"wrote {args.out}" + (f" and {args.out.with_suffix('.csv')}" if table_rows else ""))


if __name__ == "__main__":
    main()
