"""Adapters that hand aps envs to other RL libraries.

- :mod:`aps.integrations.sb3`: a Stable-Baselines3 ``VecEnv`` over a :class:`aps.ClusterEnv`
  (the optional extra ``aps-rl[sb3]``).

Each adapter imports its library only when it is imported itself.
"""
