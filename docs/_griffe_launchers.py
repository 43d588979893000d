"""A griffe extension: ``aps.launch.local``, ``ray`` and ``slurm`` in the API reference.

The three functions share their names with the submodules that define their launchers. At
run time ``aps.launch.local`` is the function (``aps/launch/__init__.py`` defines it after
importing the submodule), but griffe keeps the submodule under that name, so the reference
rendered no entry for them. This extension keeps each function as griffe visits the package,
resolves the package's aliases while the submodules are still reachable by path, then puts
the function in the submodule's place, as Python does.
"""

from __future__ import annotations

from typing import Any

import griffe

PACKAGE = "aps.launch"
FUNCTIONS = ("local", "ray", "slurm")


def _resolve_all(obj: griffe.Object | griffe.Alias, seen: set[str]) -> None:
    """Resolve every alias below ``obj``, so none needs a submodule's path later."""
    if obj.path in seen:
        return
    seen.add(obj.path)
    if obj.is_alias:
        try:
            obj.final_target  # noqa: B018 - the access resolves and caches the target
        except (griffe.AliasResolutionError, griffe.CyclicAliasError):
            pass  # an external target: mkdocstrings leaves it as it would have
        return
    for member in list(obj.members.values()):
        _resolve_all(member, seen)


class LauncherFunctions(griffe.Extension):
    """Puts ``aps.launch.local``, ``ray`` and ``slurm`` (the functions) in the reference."""

    def __init__(self) -> None:
        self.functions: dict[str, griffe.Function] = {}

    def on_function_instance(self, *, func: griffe.Function, **kwargs: Any) -> None:
        """Keep the three functions as the visitor creates them."""
        if func.parent is not None and func.parent.path == PACKAGE and func.name in FUNCTIONS:
            self.functions[func.name] = func

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        """Once ``aps`` is loaded: resolve its aliases, then let the functions take their names."""
        if pkg.name != PACKAGE.split(".")[0] or not self.functions:
            return
        _resolve_all(pkg, set())
        launch = pkg.get_member(PACKAGE.split(".", 1)[1])
        for name, func in self.functions.items():
            launch.set_member(name, func)
