"""NIGT in virtual time (aps.pg.simulate): ``python -m experiments.nigt``."""
