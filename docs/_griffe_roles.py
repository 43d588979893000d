"""A griffe extension: the docstrings' Sphinx roles as code in the API reference.

aps's docstrings name other objects as ``:class:`~aps.sync.APS```, which reads well in
source and in ``help()``; Markdown has no roles, so the reference shows them as code:
``APS`` for a ``~`` target (its last part), the whole dotted name otherwise.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:class|meth|func|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _as_code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites ``:role:`target``` in every docstring as a code span."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        """Rewrite the docstring of each object as it is loaded."""
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_as_code, obj.docstring.value)
