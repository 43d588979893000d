"""The aps release, in the lowest layer: the learner sends it to ``aps check``."""

__version__ = "0.1.0"
"""This release's version, and the distribution's: ``pyproject.toml`` reads it from here."""
