"""Start workers for a learner: on this machine today; on Ray and Slurm later."""

from __future__ import annotations

from aps.launch.local import LocalWorkers

__all__ = ["LocalWorkers"]
