"""The worker role: host a Gymnasium vector env and answer the learner's requests.

The package, one room each:

- :mod:`~aps.worker.worker`: :class:`Worker`, the session loop (dial, handshake, resume, and
  the dispatch of each request).
- :mod:`~aps.worker.steps`: the step server, which answers numbered resets, steps and
  rollouts exactly once, and keeps answers for a resume.
- :mod:`~aps.worker.collector`: worker-side inference (DETACH): act with the local policy
  copy and record chunks.
- :mod:`~aps.worker.rounds`: gradient mode (Rennala / Malenia NIGT).
- :mod:`~aps.worker.envs`: env specs and factories.
"""

from aps.worker.envs import EnvSpec, resolve_env
from aps.worker.worker import Worker

__all__ = ["EnvSpec", "Worker", "resolve_env"]
