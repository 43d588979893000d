"""Reproduction suites that regenerate the figures in docs/results: ``experiments.aps``, ``experiments.nigt``."""
