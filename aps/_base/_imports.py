"""Import paths users give aps: ``"package.module:attr"`` or ``"path/to/file.py:attr"``."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aps.errors import ConfigError

__all__ = ["PolicyPin", "import_object", "names_a_module"]


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


# --------------------------------------------------------------------------------------------
# The policy pin. A learner's Welcome names the policy a worker should run; the worker runs it
# only when its own operator named it (``policy``) or allowed it (``allow_policy`` patterns).
# Names and patterns are compared as structured import paths, never as text: a module path
# (identifiers separated by ``.``) or one file path (segments separated by ``/``, ending in
# ``.py``), then ``:``, then an attribute (identifiers separated by ``.``). A ``*`` stands for
# part of one identifier or one path segment, so it never crosses ``.``, ``/`` or ``:``.

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
# What a ``*`` may stand for: ASCII letters, digits, ``_`` (and ``-`` in file names), never a
# leading ``_`` of a name (private modules, attributes and files are named literally or not
# at all), never ``.``, ``/``, ``:``, ``%``, a look-alike or anything else outside ASCII.
_STAR_IN_NAME = "[A-Za-z0-9_]+"
_STAR_IN_FILE = "[A-Za-z0-9_-]+"
_NO_UNDERSCORE = "(?!_)"
# Characters a learner's name may hold at all; anything else is refused before matching.
_NAME_CHARS = re.compile(r"[A-Za-z0-9_./:-]+\Z")


class PolicyPin:
    """The policies a worker's operator lets a learner choose, matched as import paths.

    Args:
        policy: the one import path the operator named (``Worker(policy=...)``,
            ``--policy``). The learner's name must equal it exactly; it is then imported as
            given, like any path the operator writes.
        patterns: more import paths the operator allows (``allow_policy``,
            ``--allow-policy``): ``"mypkg.agents:*"``, ``"mypkg.*:make_agent"``,
            ``"/srv/agents/*.py:Agent"``. Each is a module path or one file path, then
            ``:`` and an attribute; ``*`` stands for part of one identifier or path segment.

    Raises:
        ConfigError: a pattern that is not such an import path (more than one ``:``, a
            ``.`` or ``..`` segment, a ``%``, a character outside ASCII in a module or
            attribute name, ...), with the form to write instead.
    """

    def __init__(self, policy: str | None, patterns: Sequence[str]) -> None:
        self.policy = policy
        self.patterns = tuple(patterns)
        self._compiled = [_Pattern(pattern) for pattern in self.patterns]

    @property
    def allowed(self) -> list[str]:
        """What the operator named and allowed, for messages."""
        return [p for p in (self.policy, *self.patterns) if p is not None]

    def check(self, name: str) -> str:
        """The import path to load for the learner's ``name``, or a refusal.

        A name equal to the operator's ``policy`` is returned as it is. A name matching a
        pattern must be a plain import path (no ``..`` or ``.`` segment, no empty segment,
        no ``%``, no backslash, nothing outside ASCII) with as many identifiers or path
        segments as the pattern; for a file path, the file must lie where the pattern
        names it: the pattern's directory is resolved (symlinks followed: it is the
        operator's), the learner's segments are joined to it, and that path must be the
        file itself, not a symlink out of it. The returned path is then that absolute file,
        so what is imported is what was checked. Nothing is imported here.

        Raises:
            ConfigError: the name is not allowed, naming it, the patterns and the flag that
                would allow it.
        """
        if self.policy is not None and name == self.policy:
            return name
        problem = _malformed_name(name)
        if problem is None:
            for pattern in self._compiled:
                found = pattern.match(name)
                if found is not None:
                    return found
            problem = "it matches none of the allowed import paths"
        raise ConfigError(
            f"the learner asked this worker to run policy {name!r:.300}, which it is not "
            f"allowed to run: {problem} (allowed: {self.allowed or 'none'}); a worker runs "
            "only the code its own "
            f"operator names: start it with --policy IMPORT_PATH (Worker(policy=...)) "
            "naming that policy, or --allow-policy PATTERN"
        )


def _malformed_name(name: str) -> str | None:
    """Why ``name`` is no plain import path a pattern could match, or ``None``."""
    if len(name) > 4096:
        return f"it is longer than 4096 characters ({len(name)})"
    if not _NAME_CHARS.match(name):
        return (
            "it holds characters no allowed import path has (only ASCII letters, digits "
            "and _ . / : - are matched against patterns: no %-escapes, look-alikes, spaces "
            "or backslashes)"
        )
    if name.count(":") != 1:
        return "it is not one location, ':' and one attribute"
    location, attribute = name.split(":")
    if not all(_IDENTIFIER.match(part) for part in attribute.split(".")):
        return f"its attribute {attribute!r} is not a dotted name"
    if location.endswith(".py"):
        segments = location.split("/")
        if segments[0] == "":  # an absolute path
            segments = segments[1:]
        if any(segment in ("", ".", "..") for segment in segments):
            return f"its file path {location!r} has an empty, '.' or '..' segment"
    elif not all(_IDENTIFIER.match(part) for part in location.split(".")):
        return f"its module path {location!r} is not a dotted name (nor a .py file)"
    return None


class _Pattern:
    """One ``allow_policy`` pattern, parsed once."""

    def __init__(self, pattern: str) -> None:
        def refuse(why: str) -> ConfigError:
            return ConfigError(
                f"allow_policy pattern {pattern!r:.300} {why}; write 'pkg.module:attr' or "
                "'/path/to/file.py:attr' (a '*' stands for part of one name or path "
                "segment, e.g. 'mypkg.agents:*' or '/srv/agents/*.py:Agent')"
            )

        if not isinstance(pattern, str) or pattern.count(":") != 1:
            raise refuse("is not one location, ':' and one attribute")
        if not re.fullmatch(r"[\x21-\x7e]+", pattern) or "%" in pattern or "\\" in pattern:
            # Learners' names are matched as ASCII only (see _malformed_name): a pattern with
            # anything else could never match; an exact path goes to --policy instead.
            raise refuse(
                "holds a space, a control character, '%', a backslash or a character "
                "outside ASCII (name such a file exactly with --policy)"
            )
        location, attribute = pattern.split(":")
        if not all(re.fullmatch(r"[A-Za-z0-9_*]+", part) for part in attribute.split(".")):
            raise refuse("has an attribute that is not a dotted name")
        self._attribute = [_star_regex(part, _STAR_IN_NAME) for part in attribute.split(".")]
        self._is_file = location.endswith(".py")
        self._base: Path | None = None
        if self._is_file:
            absolute = location.startswith("/")
            segments = location.split("/")[1:] if absolute else location.split("/")
            if any(segment in ("", ".", "..") for segment in segments):
                raise refuse("has an empty, '.' or '..' segment in its file path")
            literal = 0  # segments before the first '*': the operator's own directory
            while literal < len(segments) and "*" not in segments[literal]:
                literal += 1
            self._absolute = absolute
            self._literal = segments[:literal]
            self._location = [_star_regex(s, _STAR_IN_FILE) for s in segments[literal:]]
            head = ("/" if absolute else "") + "/".join(self._literal)
            # Symlinks on the operator's side are the operator's: resolve them now, once.
            self._base = Path(head or ".").resolve()
        else:
            parts = location.split(".")
            if not all(re.fullmatch(r"[A-Za-z0-9_*]+", part) for part in parts):
                raise refuse("has a module path that is not a dotted name of ASCII identifiers")
            self._location = [_star_regex(part, _STAR_IN_NAME) for part in parts]

    def match(self, name: str) -> str | None:
        """The import path to load when ``name`` (well formed) matches, else ``None``."""
        location, attribute = name.split(":")
        if not _all_match(self._attribute, attribute.split(".")):
            return None
        if location.endswith(".py") != self._is_file:
            return None
        if self._base is None:
            return name if _all_match(self._location, location.split(".")) else None
        if location.startswith("/") != self._absolute:
            return None
        segments = location.split("/")[1:] if self._absolute else location.split("/")
        literal = len(self._literal)
        if segments[:literal] != self._literal:
            return None
        rest = segments[literal:]
        if not _all_match(self._location, rest):
            return None
        path = self._base.joinpath(*rest) if rest else self._base
        # The learner's segments must lead to the file they name, not through a symlink to
        # another place: only the operator's part of the path may be a link.
        if rest and path.resolve() != path:
            return None
        if not path.is_file():
            return None
        return f"{path}:{attribute}"


def _star_regex(part: str, star: str) -> re.Pattern[str]:
    pieces = part.split("*")
    regex = re.escape(pieces[0])
    for piece in pieces[1:]:
        # A leading '*' never stands for a leading '_': private names are named literally.
        regex += (_NO_UNDERSCORE if regex == "" else "") + star + re.escape(piece)
    return re.compile(regex + r"\Z")


def _all_match(regexes: list[re.Pattern[str]], parts: list[str]) -> bool:
    return len(regexes) == len(parts) and all(
        regex.match(part) for regex, part in zip(regexes, parts, strict=True)
    )
