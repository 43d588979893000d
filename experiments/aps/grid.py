"""What the suite runs: tasks, sync strategies, PPO objectives, seeds, and their budgets.

A run is one example process (``examples/ppo_cluster.py`` or ``examples/dqn_async.py``) with
one task, one strategy, one objective and one seed. Its key (``Run.key``) names its result
file, so a suite that is stopped and started again skips every run whose result exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


@dataclass(frozen=True)
class Task:
    """An environment, the example that trains on it, its budget and its hyperparameters.

    Attributes:
        name: the task's name in keys, tables and plots.
        example: the example script in ``examples/``.
        env_id: the Gymnasium id.
        timesteps: env steps per run in the full suite.
        quick_timesteps: env steps per run in ``--quick`` mode.
        args: the example's other arguments (the task's hyperparameters).
        objectives: the PPO objectives it runs with (``("",)`` for DQN, which has none).
        needs: a module the env needs (the run is skipped, saying so, without it).
    """

    name: str
    example: str
    env_id: str
    timesteps: int
    quick_timesteps: int
    args: tuple[str, ...] = ()
    objectives: tuple[str, ...] = ("decoupled", "paper")
    needs: str | None = None


# Budgets: the full suite (every task x objective x strategy x 5 seeds, 630 runs) is sized
# to finish in one night on a 2-core machine; the PPO hyperparameters are CleanRL's, with
# Pendulum's from the RL Zoo (gamma 0.9, long rollouts, 10 epochs, no entropy bonus).
TASKS: dict[str, Task] = {
    task.name: task
    for task in (
        Task("ppo-cartpole", "ppo_cluster.py", "CartPole-v1", 100_000, 1_024),
        Task(
            "ppo-lunarlander",
            "ppo_cluster.py",
            "LunarLander-v3",
            300_000,
            1_024,
            ("--envs-per-worker", "8", "--num-steps", "128", "--learning-rate", "5e-4"),
            needs="Box2D",
        ),
        Task(
            "ppo-pendulum",
            "ppo_cluster.py",
            "Pendulum-v1",
            150_000,
            1_024,
            (
                "--num-steps",
                "128",
                "--gamma",
                "0.9",
                "--update-epochs",
                "10",
                "--ent-coef",
                "0",
                "--norm-reward",
            ),
        ),
        Task(
            "dqn-cartpole",
            "dqn_async.py",
            "CartPole-v1",
            50_000,
            1_024,
            objectives=("",),
        ),
    )
}

THRESHOLDS = (0.001, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0)
"""The APS thresholds of the paper's sweep (per-state mean KL in nats)."""

STRATEGIES: tuple[str, ...] = (
    "always",
    "fixed-2",
    "fixed-4",
    "fixed-8",
    *(f"aps-{t:g}" for t in THRESHOLDS),
    *(f"aps-{t:g}-nolag" for t in THRESHOLDS),
)
"""Strategy names: ``aps-T`` has the default staleness bound, ``aps-T-nolag`` none."""

QUICK_STRATEGIES = ("always", "fixed-4", "aps-0.05", "aps-1-nolag")


def strategy_args(strategy: str) -> list[str]:
    """The example's command-line arguments for a strategy name.

    Raises:
        ValueError: an unknown name, naming the known ones.
    """
    if strategy == "always":
        return ["--sync", "always"]
    kind, _, rest = strategy.partition("-")
    if kind == "fixed" and rest.isdigit():
        return ["--sync", "fixed", "--fixed-versions", rest]
    if kind == "aps" and rest:
        threshold, _, suffix = rest.partition("-")
        if suffix in ("", "nolag"):
            try:
                float(threshold)
            except ValueError:
                pass
            else:
                bound = ["--max-lag", "0"] if suffix == "nolag" else []
                return ["--sync", "aps", "--kl-threshold", threshold, *bound]
    raise ValueError(
        f"unknown strategy {strategy!r}; use always, fixed-K, aps-T or aps-T-nolag "
        f"(the suite's: {', '.join(STRATEGIES)})"
    )


@dataclass(frozen=True)
class Run:
    """One run of the suite."""

    task: Task
    objective: str
    strategy: str
    seed: int
    timesteps: int

    @property
    def key(self) -> str:
        """A file-name-safe name, unique in the suite: task, objective, strategy, seed."""
        parts = [self.task.name, self.objective or "-", self.strategy, f"s{self.seed}"]
        return "__".join(parts)

    def command(self, python: str, result: Path) -> list[str]:
        """The example's command line, writing its figures to ``result``."""
        objective = ["--no-decoupled"] if self.objective == "paper" else []
        return [
            python,
            str(EXAMPLES / self.task.example),
            "--env-id",
            self.task.env_id,
            "--total-timesteps",
            str(self.timesteps),
            "--seed",
            str(self.seed),
            *self.task.args,
            *objective,
            *strategy_args(self.strategy),
            "--no-progress",
            "--json",
            str(result),
        ]


def plan(
    tasks: list[str],
    strategies: list[str],
    objectives: list[str] | None,
    seeds: int,
    quick: bool,
) -> list[Run]:
    """Every run of the selection, task by task, seed-major so early results cover all.

    Raises:
        ValueError: an unknown task, strategy or objective, naming the known ones.
    """
    unknown = [name for name in tasks if name not in TASKS]
    if unknown:
        raise ValueError(f"unknown task(s) {unknown}; the suite's: {', '.join(TASKS)}")
    for strategy in strategies:
        strategy_args(strategy)
    for objective in objectives or []:
        if objective not in ("decoupled", "paper"):
            raise ValueError(f"unknown objective {objective!r}; use decoupled or paper")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    runs = []
    for name in tasks:
        task = TASKS[name]
        chosen = [o for o in task.objectives if not objectives or o in objectives or o == ""]
        timesteps = task.quick_timesteps if quick else task.timesteps
        for seed in range(1, seeds + 1):
            for objective in chosen:
                for strategy in strategies:
                    runs.append(Run(task, objective, strategy, seed, timesteps))
    return runs
