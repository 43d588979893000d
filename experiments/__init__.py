"""Reproduction suites that regenerate the figures in docs/results.

``python -m experiments.aps`` (Adaptive Policy Synchronization) and ``python -m
experiments.nigt`` (Rennala and Malenia NIGT in virtual time).
"""
