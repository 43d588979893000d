"""Experiments that regenerate the figures in docs/results."""
