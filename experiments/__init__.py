"""Reproduction suites for the claims aps makes."""
