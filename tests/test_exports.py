"""The public API is exactly ``aps.__all__``."""

from __future__ import annotations

import inspect

import pytest

import aps
import aps.errors


def test_all_names_exist_and_are_unique() -> None:
    assert len(set(aps.__all__)) == len(aps.__all__)
    for name in aps.__all__:
        assert hasattr(aps, name), name


def test_every_public_error_is_exported() -> None:
    errors = {
        name
        for name, value in vars(aps.errors).items()
        if inspect.isclass(value) and issubclass(value, aps.ApsError)
    }
    assert errors == set(aps.errors.__all__)
    assert errors <= set(aps.__all__)


def test_no_public_name_is_left_out() -> None:
    public = {
        name
        for name, value in vars(aps).items()
        if not name.startswith("_") and not inspect.ismodule(value) and name != "annotations"
    }
    assert public == set(aps.__all__)


def test_every_error_derives_from_aps_error() -> None:
    for name in aps.errors.__all__:
        assert issubclass(getattr(aps.errors, name), aps.ApsError)


def test_aps_collect_is_a_deprecated_alias_of_the_learners_rollouts() -> None:
    import aps.collect
    from aps.learner import rollouts

    with pytest.warns(DeprecationWarning, match="import STALL_LAG from aps.learner.rollouts"):
        from aps.collect import STALL_LAG
    assert STALL_LAG == rollouts.STALL_LAG
    with pytest.warns(DeprecationWarning, match="aps.collect is deprecated"):
        assert aps.collect.Rollout is aps.Rollout is rollouts.Rollout
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        aps.collect.nothing_here  # noqa: B018
