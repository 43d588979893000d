"""The APS reproduction suite: ``python -m experiments.aps`` (see ``__main__``)."""
