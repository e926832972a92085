"""One config value checked: against its type (ints, floats, bools, strings, literals, unions,
maps, lists) and against the range rules every section uses (:func:`positive`, ...).

Shared by the sections (a kind's fields are checked where the section is made)
and the reader (which adds where the value came from). A float accepts an
int, and a string in exponent notation such as ``1e-3`` (YAML 1.1, which
PyYAML implements, reads ``1e-3`` as a string). A type this module does not
know (``Any``, a class, a callable), as a user kind's annotation may be, takes
the value as it is: the kind itself then judges it.
"""

from __future__ import annotations

import math
import re
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, Literal

__all__ = [
    "ConfigError",
    "Problem",
    "coerce",
    "non_negative",
    "positive",
    "takes_text",
    "type_name",
]


class ConfigError(ValueError):
    """A config file or override is unreadable, unknown, mistyped or out of range."""


# A problem found by a check: (dotted field name relative to its section, message).
Problem = tuple[str, str]


def positive(section: Any, *names: str) -> Iterator[Problem]:
    """A problem for each of the section's fields ``names`` that is set and not > 0."""
    for name in names:
        value = getattr(section, name)
        if value is not None and not value > 0:
            yield name, f"must be > 0, got {value!r}"


def non_negative(section: Any, *names: str) -> Iterator[Problem]:
    """A problem for each of the section's fields ``names`` that is set and negative."""
    for name in names:
        value = getattr(section, name)
        if value is not None and not value >= 0:
            yield name, f"must be >= 0, got {value!r}"


# Exponent-notation numbers that YAML 1.1 leaves as strings ("1e-3", "2E+5").
_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")

_KNOWN = (bool, int, float, str)


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return None


def _is_known(tp: Any) -> bool:
    args = _union_args(tp)
    if args is not None:
        return all(a is type(None) or _is_known(a) for a in args)
    return tp in _KNOWN or typing.get_origin(tp) in (Literal, dict, tuple)


def type_name(tp: Any) -> str:
    """How an error message names ``tp``."""
    args = _union_args(tp)
    if args is not None:
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        key_tp, value_tp = typing.get_args(tp)
        return f"mapping of {type_name(key_tp)} to {type_name(value_tp)}"
    if typing.get_origin(tp) is tuple:
        items = typing.get_args(tp)
        if len(items) == 2 and items[1] is Ellipsis:
            return f"a list of {type_name(items[0])}"
        return f"a list of {len(items)} ({', '.join(type_name(a) for a in items)})"
    if tp is Any:
        return "any value"
    return getattr(tp, "__name__", str(tp))


def takes_text(tp: Any, text: str) -> bool:
    """Whether ``tp`` takes ``text`` as a string (so ``--set name=2024`` means the text).

    Any text where ``tp`` is ``str``; for a ``Literal``, only its own strings
    (``truncations_per_call: int | Literal["auto"]`` reads ``4`` as the number).
    """
    args = _union_args(tp)
    if args is not None:
        return any(takes_text(a, text) for a in args)
    if typing.get_origin(tp) is Literal:
        return text in typing.get_args(tp)
    return tp is str


def coerce(value: Any, tp: Any, path: str, where: str = "") -> Any:
    """``value`` checked against ``tp`` and converted (int -> float, ...).

    Args:
      value: the value read from YAML or given in Python.
      tp: the field's type.
      path: the dotted field, for the message.
      where: appended to the message, e.g. ``" (in my.yaml)"``.

    Raises:
      ConfigError: naming the field, the expected type and the value.
    """
    args = _union_args(tp)
    if args is not None:
        return _coerce_union(value, tp, args, path, where)
    if not _is_known(tp):
        return value
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        # `type(...) is` keeps True from matching a Literal[1] and 1 from matching 1.0.
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{path}: expected one of {allowed}, got {value!r}{where}")
    if origin is dict:
        return _coerce_mapping(value, tp, path, where)
    if origin is tuple:
        return _coerce_tuple(value, tp, path, where)
    return _coerce_scalar(value, tp, path, where)


def _mismatch(value: Any, tp: Any, path: str, where: str) -> ConfigError:
    return ConfigError(f"{path}: expected {type_name(tp)}, got {value!r}{where}")


def _coerce_union(value: Any, tp: Any, args: tuple[Any, ...], path: str, where: str) -> Any:
    """The first member of the union that takes ``value``; null only if the union has None."""
    if value is None:
        if type(None) in args:
            return None
        raise _mismatch(value, tp, path, where)
    for arg in args:
        if arg is type(None):
            continue
        try:
            return coerce(value, arg, path, where)
        except ConfigError:
            continue
    if not _is_known(tp):
        return value  # an annotation with types this module does not know
    raise _mismatch(value, tp, path, where)


def _coerce_mapping(value: Any, tp: Any, path: str, where: str) -> dict[str, Any]:
    key_tp, value_tp = typing.get_args(tp)
    if not isinstance(value, Mapping):
        raise _mismatch(value, tp, path, where)
    result = {}
    for key, item in value.items():
        if not isinstance(key, str):
            raise ConfigError(f"{path}: keys must be {type_name(key_tp)}, got {key!r}{where}")
        result[key] = coerce(item, value_tp, f"{path}.{key}", where)
    return result


def _coerce_tuple(value: Any, tp: Any, path: str, where: str) -> tuple[Any, ...]:
    """A list (or tuple) of the tuple's item types; ``tuple[T, ...]`` takes any length."""
    items = typing.get_args(tp)
    if len(items) == 2 and items[1] is Ellipsis and isinstance(value, list | tuple):
        items = (items[0],) * len(value)
    if not isinstance(value, list | tuple) or len(value) != len(items):
        raise _mismatch(value, tp, path, where)
    return tuple(
        coerce(item, item_tp, f"{path}[{i}]", where)
        for i, (item, item_tp) in enumerate(zip(value, items, strict=True))
    )


def _coerce_scalar(value: Any, tp: Any, path: str, where: str) -> Any:
    """A bool, int, float or str; a bool is never an int (``true`` for a count is a mistake)."""
    if tp is bool and isinstance(value, bool):
        return value
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float:
        number = value
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            number = float(value)
        if isinstance(number, int | float) and not isinstance(number, bool):
            if not math.isfinite(number):
                raise ConfigError(f"{path}: expected a finite float, got {number!r}{where}")
            return float(number)
    if tp is str and isinstance(value, str):
        return value
    raise _mismatch(value, tp, path, where)
