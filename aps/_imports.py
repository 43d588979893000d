"""Import paths users give aps: ``"package.module:attr"`` or ``"path/to/file.py:attr"``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

from aps.errors import ConfigError

__all__ = ["import_object", "names_a_module"]


def import_object(spec: str, *, what: str) -> Any:
    """Return the object ``spec`` names.

    Args:
        spec: ``"pkg.module:attr"`` (imported with :func:`importlib.import_module`) or
            ``"path/to/file.py:attr"`` (the file runs once per process as a module under a
            private name, so its ``if __name__ == "__main__":`` block does not run; a relative
            path is relative to the current directory). ``attr`` may be dotted.
        what: what the spec is for, in error messages (``"policy"``, ``"env spec"``).

    Raises:
        ConfigError: the spec is malformed, the module or file cannot be imported (the
            original exception is chained), or the attribute is missing.
    """
    location, _, name = spec.rpartition(":")
    if not location or not name:
        raise ConfigError(
            f"{what} {spec!r} is not an import path; write 'pkg.module:attr' or "
            "'path/to/file.py:attr'"
        )
    if location.endswith(".py"):
        module = _import_file(location, spec, what)
    else:
        try:
            module = importlib.import_module(location)
        except Exception as exc:
            raise ConfigError(
                f"cannot import module {location!r} (from {what} {spec!r}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    target: Any = module
    for part in name.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise ConfigError(
                f"{location!r} has no attribute {name!r} (from {what} {spec!r})"
            ) from None
    return target


def names_a_module(spec: str) -> bool:
    """Whether the part of ``spec`` before its last ``:`` is a ``.py`` file or a module.

    Gymnasium ids such as ``"ale_py:ALE/Pong-v5"`` contain a colon too; those go to
    ``gym.make`` when the part before it is no importable module.
    """
    location = spec.rpartition(":")[0]
    if location.endswith(".py"):
        return True
    try:
        return bool(location) and importlib.util.find_spec(location) is not None
    except (ImportError, ValueError):
        return False


def _import_file(location: str, spec: str, what: str) -> Any:
    path = Path(location).resolve()
    if not path.is_file():
        raise ConfigError(f"{what} file {location!r} does not exist (from {what} {spec!r})")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    stem = re.sub(r"\W", "_", path.stem)
    module_name = f"_aps_import_{stem}_{digest}"
    module = sys.modules.get(module_name)
    if module is not None:
        return module
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    if loader_spec is None or loader_spec.loader is None:
        raise ConfigError(f"cannot import {location!r} (from {what} {spec!r})")
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module  # dataclasses in the file look themselves up here
    try:
        loader_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[module_name]
        raise ConfigError(
            f"importing {location!r} (from {what} {spec!r}) raised {type(exc).__name__}: {exc}"
        ) from exc
    return module
