"""The field specs of the codec: what each message type's fields must be, made once per type.

:func:`spec_for` reads a message class's annotations and returns its :class:`Spec`: a check
per field (each written once as the source of an expression of ``v``, compiled alone for a
field's check and inlined with every other field of the type for a decoded body's one-call
test), the packed map head and names the encoders write, the fields left out while ``None``,
and a builder that stores a decoded body's fields in the message's slots. :mod:`aps.wire.codec`
keeps the specs of the registered types and does the encoding and decoding.
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from collections.abc import Callable
from typing import Any

import gymnasium as gym
import msgpack
import numpy as np

from aps._base._typing import ArrayTree
from aps.wire._trees import is_array_tree
from aps.wire.messages import OMIT_NONE, Message

__all__ = ["ANY", "PLAIN", "SPACE", "Field", "Spec", "field_for", "is_array", "spec_for"]


def _pack(name: str) -> bytes:
    packed: bytes = msgpack.packb(name, use_bin_type=True)
    return packed


ANY, SPACE, PLAIN = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class Field:
    name: str
    kind: int  # ANY, SPACE or PLAIN
    check: Callable[[Any], bool]  # for PLAIN (and None-ness of an optional SPACE)
    expected: str  # for error messages
    test: str = "True"  # check's own source, a Python expression of v (see _rule)


@dataclasses.dataclass(frozen=True, slots=True)
class Spec:
    cls: type[Message]
    tag: str
    fields: tuple[Field, ...]
    names: frozenset[str]
    head: bytes  # the packed map header, "t" and the tag: how every frame of the type starts
    # Per field, in order: its name, its packed name, its kind and its check (_pack_small's).
    plan: tuple[tuple[str, bytes, int, Callable[[Any], bool]], ...]
    # Fields declared with OMIT_NONE: left out of the frame while None, None when absent.
    omitted: frozenset[str] = frozenset()
    # The fields a frame must hold (all but the omitted), and the packed "t" and tag that
    # follow the map header: made once, for the frames whose header counts their fields.
    required: frozenset[str] = frozenset()
    tail: bytes = b""
    # Whether every field of a decoded body passes its check (see _all_pass).
    passes: Callable[[dict[str, Any]], bool] = lambda body: False
    # The message of a body holding every field, checked (see _builder); None: cls(**body).
    build: Callable[[dict[str, Any]], Message] | None = None


def is_array(value: Any) -> bool:
    return type(value) is np.ndarray and not value.dtype.hasobject


# Each check is written once, as the source of an expression of ``v``, and compiled twice:
# alone (a field's check, for encoding and for the error of a decoded field) and inlined with
# every other field of its message type (_all_pass: a decoded body, one call). The names the
# sources use are those of _RULE_NAMES.
_RULE_NAMES: dict[str, Any] = {"ndarray": np.ndarray, "is_array_tree": is_array_tree}
_ARRAY_TEST = "(type(v) is ndarray and not v.dtype.hasobject)"

_ATOMS: dict[object, tuple[str, str]] = {
    # type() is, not isinstance: bool is an int subclass, and msgpack yields exact types.
    int: ("type(v) is int", "int"),
    float: ("type(v) is float or type(v) is int", "float"),
    bool: ("type(v) is bool", "bool"),
    str: ("type(v) is str", "str"),
    bytes: ("type(v) is bytes", "bytes"),
    type(None): ("v is None", "None"),
}


def _rule(name: str, kind: int, test: str, expected: str) -> Field:
    """The field whose check is the expression ``test`` of ``v``."""
    # The source is the codec's own (the table above), never data from the network.
    check = eval(f"lambda v: {test}", _RULE_NAMES)
    return Field(name, kind, check, expected, test)


_EXACT_TYPES: dict[object, tuple[type, ...]] = {
    int: (int,),
    float: (float, int),
    bool: (bool,),
    str: (str,),
    bytes: (bytes,),
    type(None): (type(None),),
}
"""The exact types each of :data:`_ATOMS`'s checks accepts."""


def _origin(hint: object) -> object:
    """``typing.get_origin``, seeing through type aliases.

    NumPy 2.3 and later define ``NDArray`` with a ``type`` statement, so the origin of
    ``NDArray[Any]`` is the alias, whose ``__value__`` names ``np.ndarray``.
    """
    origin = typing.get_origin(hint)
    while origin is not None and hasattr(origin, "__value__"):
        origin = typing.get_origin(origin.__value__) or origin.__value__
    return origin


def field_for(name: str, hint: object) -> Field:
    if hint is Any:
        return _rule(name, ANY, "True", "any plain data")
    if hint is ArrayTree or hint == ArrayTree:
        # An array first: the one test a plain array's field costs.
        return _rule(
            name,
            PLAIN,
            f"{_ARRAY_TEST} or is_array_tree(v)",
            "a numpy array, or a dict or tuple of them (nested)",
        )
    options = (
        typing.get_args(hint)
        if typing.get_origin(hint) in (typing.Union, types.UnionType)
        else (hint,)
    )
    optional = type(None) in options
    rest = [o for o in options if o is not type(None)]
    if len(rest) == 1 and (rest[0] is gym.Space or typing.get_origin(rest[0]) is gym.Space):
        if optional:
            return _rule(name, SPACE, "v is None", "a gymnasium space or None")
        return _rule(name, SPACE, "False", "a gymnasium space")
    tests: list[str] = []
    words: list[str] = []
    for option in options:
        if option is np.ndarray or _origin(option) is np.ndarray:
            tests.append(_ARRAY_TEST)
            words.append("a numpy array")
        elif option in _ATOMS:
            test, word = _ATOMS[option]
            tests.append(f"({test})")
            words.append(word)
        else:
            raise TypeError(f"aps.wire.codec cannot carry a field annotated {hint!r} ({name})")
    if len(tests) == 1:
        return _rule(name, PLAIN, tests[0], words[0])
    if all(option in _ATOMS for option in options):
        # A union of atoms (``float | None``, say) is one lookup of the value's exact type;
        # _ATOMS's checks are exact-type tests (float's accepts int too).
        exact = f"exact_{len(_RULE_NAMES)}"  # a name of its own: the sets differ by field
        _RULE_NAMES[exact] = frozenset(k for option in options for k in _EXACT_TYPES[option])
        return _rule(name, PLAIN, f"type(v) in {exact}", " or ".join(words))
    return _rule(name, PLAIN, " or ".join(tests), " or ".join(words))


def _all_pass(fields: tuple[Field, ...]) -> Callable[[dict[str, Any]], bool]:
    """One function testing every field of a decoded body: whether all pass their checks.

    What _message's loop over the fields finds, in one call with the checks inlined (a
    frame's fields cost a lambda call each otherwise). A field of a space that is not
    ``None`` does not pass: the loop builds it.
    """
    lines = ["def passes(body):"]
    for field in fields:
        if field.kind == ANY:
            continue
        lines += [
            f"    v = body[{field.name!r}]",
            f"    if not ({field.test}):",
            "        return False",
        ]
    lines.append("    return True")
    scope = dict(_RULE_NAMES)
    exec("\n".join(lines), scope)  # the fields' own sources, as in _rule
    passes: Callable[[dict[str, Any]], bool] = scope["passes"]
    return passes


def _builder(cls: type[Message]) -> Callable[[dict[str, Any]], Message] | None:
    """A function making the ``cls`` whose fields a decoded body holds, or ``None``.

    What the dataclass's own ``__init__`` does for a frozen class with slots and no
    ``__post_init__``: each field stored in its slot, as ``object.__setattr__`` would, in
    the fields' order. Without the call by keywords, which costs as much again (a chunk's 17
    fields: about 1.5 us of 3). ``None`` for any other class (an ``__init__`` or
    ``__post_init__`` of its own, fields outside slots, an init-only parameter): ``_message``
    then calls ``cls(**body)``.
    """
    init = cls.__dict__.get("__init__")
    fields = dataclasses.fields(cls)
    params = getattr(cls, "__dataclass_params__", None)
    if (
        params is None
        or not params.frozen
        or hasattr(cls, "__post_init__")
        # The dataclass's own __init__ (compiled from its source, "<string>"), taking the
        # fields and nothing else.
        or getattr(getattr(init, "__code__", None), "co_filename", None) != "<string>"
        or list(inspect.signature(cls).parameters) != [f.name for f in fields]
        or not all(type(cls.__dict__.get(f.name)) is types.MemberDescriptorType for f in fields)
    ):
        return None
    lines = ["def build(body):", "    message = new(cls)"]
    scope: dict[str, Any] = {"new": object.__new__, "cls": cls}
    for index, field in enumerate(fields):
        scope[f"set_{index}"] = cls.__dict__[field.name].__set__
        lines.append(f"    set_{index}(message, body[{field.name!r}])")
    lines.append("    return message")
    exec("\n".join(lines), scope)  # field names are identifiers, from the class itself
    build: Callable[[dict[str, Any]], Message] = scope["build"]
    return build


def spec_for(cls: type[Message]) -> Spec:
    hints = typing.get_type_hints(cls)
    fields = tuple(field_for(f.name, hints[f.name]) for f in dataclasses.fields(cls))
    names = frozenset(f.name for f in fields)
    if "t" in names:
        raise TypeError(f"{cls.__name__} has a field named 't', which the codec uses for the tag")
    count = len(fields) + 1
    head = bytes([0x80 | count]) if count < 16 else b"\xde" + count.to_bytes(2, "big")
    head += _pack("t") + _pack(cls.TAG)
    plan = tuple((f.name, _pack(f.name), f.kind, f.check) for f in fields)
    omitted = frozenset(f.name for f in dataclasses.fields(cls) if f.metadata.get(OMIT_NONE))
    tail = _pack("t") + _pack(cls.TAG)
    return Spec(
        cls,
        cls.TAG,
        fields,
        names,
        head,
        plan,
        omitted,
        names - omitted,
        tail,
        _all_pass(fields),
        _builder(cls),
    )
