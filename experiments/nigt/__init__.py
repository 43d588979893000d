"""NIGT in virtual time (aps.learner.simulate): ``python -m experiments.nigt``."""
