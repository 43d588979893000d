"""The aps release, in the lowest layer: the learner sends it to ``aps check``."""

__version__ = "0.1.0"
"""This release's version; ``pyproject.toml`` states the same (a test compares them)."""
