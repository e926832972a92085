"""Reading configs: YAML files, ``--set`` overrides, type checks against the schema.

A config is built from a YAML file plus ``--set a.b=value`` overrides, and
checked before any actor starts. The overrides apply to the file's values
before anything is checked, so ``--set`` can repair a bad value in a file;
an error names the override that set the field, else the file:

* unknown keys fail naming the full dotted key and listing the known ones;
* wrong types fail naming the field, the expected type and the value;
* ``Literal`` fields list the allowed values; ``X | None`` fields accept null;
* then the schema's own range and cross-field rules run
  (:mod:`popmeta.config.schema`).

Override values are parsed with ``yaml.safe_load`` (``0.02`` is a float, ``5``
an int, ``null`` is None, ``true`` a bool, ``{TPU: 1}`` a mapping) and then
type-checked exactly like file values. Two conveniences on top of that:

* a float field accepts an int, and a string in exponent notation such as
  ``1e-3`` (YAML 1.1, which PyYAML implements, reads ``1e-3`` as a string);
* for a field that expects a string, ``--set name=2024`` keeps the text
  ``"2024"`` instead of failing because YAML read an int.

Example::

    cfg = load_config("configs/quickstart.yaml", ["estimator.std=0.02"])
    cfg.estimator.std  # 0.02
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml

from popmeta.config.schema import Config, ConfigError

__all__ = ["config_from_dict", "config_to_dict", "config_to_yaml", "load_config"]


# Exponent-notation numbers that YAML 1.1 leaves as strings ("1e-3", "2E+5").
_FLOAT_TEXT = re.compile(r"^[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?$")

#: Where the value at a dotted path came from, for error messages.
Source = Callable[[str], str]


class _Sources:
    """The file (or mapping) a config came from, and the ``--set`` that last set each key."""

    def __init__(self, base: str):
        self.base = base
        self._overrides: dict[str, str] = {}

    def record(self, key: str, override: str) -> None:
        for earlier in [k for k in self._overrides if k.startswith(key + ".")]:
            del self._overrides[earlier]  # the new value of the section replaces them
        self._overrides[key] = f"--set {override}"

    def __call__(self, path: str) -> str:
        parts = path.rstrip(".").split(".")
        for end in range(len(parts), 0, -1):
            override = self._overrides.get(".".join(parts[:end]))
            if override is not None:
                return override
        return self.base


def _field_types(cls: type) -> dict[str, Any]:
    # Resolves the string annotations left by `from __future__ import annotations`.
    return typing.get_type_hints(cls)


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _union_args(tp: Any) -> tuple[Any, ...] | None:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return None


def _type_name(tp: Any) -> str:
    args = _union_args(tp)
    if args is not None:
        return " or ".join("null" if a is type(None) else _type_name(a) for a in args)
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is dict:
        key_tp, value_tp = typing.get_args(tp)
        return f"mapping of {_type_name(key_tp)} to {_type_name(value_tp)}"
    return getattr(tp, "__name__", str(tp))


def _accepts_str(tp: Any) -> bool:
    args = _union_args(tp)
    if args is not None:
        return any(_accepts_str(a) for a in args)
    if typing.get_origin(tp) is Literal:
        return any(isinstance(a, str) for a in typing.get_args(tp))
    return tp is str


def _in(source: str) -> str:
    return f" (in {source})"


def _coerce(value: Any, tp: Any, path: str, source: Source) -> Any:
    """Checks ``value`` against ``tp``; returns it converted (int -> float, ...)."""

    def fail() -> ConfigError:
        return ConfigError(f"{path}: expected {_type_name(tp)}, got {value!r}{_in(source(path))}")

    args = _union_args(tp)
    if args is not None:
        if value is None:
            if type(None) in args:
                return None
            raise fail()
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path, source)
            except ConfigError:
                continue
        raise fail()

    if typing.get_origin(tp) is Literal:
        choices = typing.get_args(tp)
        # `type(...) is` keeps True from matching a Literal[1] and 1 from matching 1.0.
        if any(type(value) is type(c) and value == c for c in choices):
            return value
        allowed = ", ".join(repr(c) for c in choices)
        raise ConfigError(f"{path}: expected one of {allowed}, got {value!r}{_in(source(path))}")

    if typing.get_origin(tp) is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, Mapping):
            raise fail()
        result = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(
                    f"{path}: keys must be {_type_name(key_tp)}, got {key!r}{_in(source(path))}"
                )
            if _is_section(value_tp):
                checked = _coerce_section(item, value_tp, f"{path}.{key}.", source)
                result[key] = _build(value_tp, checked)
            else:
                result[key] = _coerce(item, value_tp, f"{path}.{key}", source)
        return result

    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail()
    if tp is int:
        # bool is an int subclass; `true` for a count is a mistake, not 1.
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail()
    if tp is float:
        if isinstance(value, str) and _FLOAT_TEXT.match(value.strip()):
            value = float(value)
        if isinstance(value, int | float) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(
                    f"{path}: expected a finite float, got {value!r}{_in(source(path))}"
                )
            return float(value)
        raise fail()
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail()
    raise TypeError(f"unsupported config field type {tp!r} for {path}")


def _known_keys(cls: type, prefix: str) -> list[str]:
    return [f"{prefix}{f.name}" for f in dataclasses.fields(cls)]


def _unknown_key(key: Any, cls: type, prefix: str, source: str) -> ConfigError:
    dotted = f"{prefix}{key}"
    known = _known_keys(cls, prefix)
    close = difflib.get_close_matches(dotted, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"unknown config key {dotted!r} in {source}{hint}; known keys: {', '.join(known)}"
    )


def _coerce_section(raw: Any, cls: type, prefix: str, source: Source) -> dict[str, Any]:
    """Type-checks a mapping against a section class; returns checked values."""
    if raw is None:
        # An empty YAML section (`estimator:` with nothing under it) means defaults.
        return {}
    if not isinstance(raw, Mapping):
        where = prefix.rstrip(".") or "config"
        raise ConfigError(
            f"{where}: expected a mapping with keys {', '.join(_known_keys(cls, prefix))}, "
            f"got {raw!r}{_in(source(prefix))}"
        )
    field_types = _field_types(cls)
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in field_types:
            raise _unknown_key(key, cls, prefix, source(f"{prefix}{key}"))
        tp = field_types[key]
        path = f"{prefix}{key}"
        if _is_section(tp):
            values[key] = _coerce_section(value, tp, f"{path}.", source)
        else:
            values[key] = _coerce(value, tp, path, source)
    return values


def _build(cls: type, values: Mapping[str, Any]) -> Any:
    field_types = _field_types(cls)
    kwargs = {
        name: _build(tp, values.get(name, {})) if _is_section(tp) else values[name]
        for name, tp in field_types.items()
        if _is_section(tp) or name in values
    }
    return cls(**kwargs)


def _merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def _apply_override(raw: dict[str, Any], override: str, sources: _Sources) -> None:
    """Puts the override's value into the raw (not yet checked) values."""
    source = f"--set {override}"
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad override {override!r}: expected KEY=VALUE, e.g. estimator.std=0.02")
    parts = key.split(".")
    cls: type = Config
    target = raw
    for i, part in enumerate(parts):
        prefix = "".join(f"{p}." for p in parts[:i])
        field_types = _field_types(cls)
        if part not in field_types:
            raise _unknown_key(part, cls, prefix, source)
        tp = field_types[part]
        if i < len(parts) - 1:
            if not _is_section(tp):
                raise ConfigError(
                    f"unknown config key {key!r} in {source}: {prefix}{part} holds a "
                    f"value of type {_type_name(tp)}, not a section"
                )
            cls = tp
            if not isinstance(target.get(part), dict):
                target[part] = {}  # a missing (or empty) section of the file
            target = target[part]
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{key}: cannot parse value {text!r}{_in(source)}: {e}") from e
        if _is_section(tp) and isinstance(value, Mapping) and isinstance(target.get(part), dict):
            _merge(target[part], copy.deepcopy(dict(value)))
        elif _accepts_str(tp) and value is not None and not isinstance(value, str | Mapping | list):
            # `--set name=2024` means the string, even though YAML reads an int.
            target[part] = text.strip()
        else:
            target[part] = value
        sources.record(key, override)


def config_from_dict(
    d: Mapping[str, Any] | None, source: str = "<dict>", overrides: Sequence[str] = ()
) -> Config:
    """Builds and validates a :class:`Config` from a nested mapping.

    Args:
      d: nested mapping of sections (missing keys take their defaults);
        None means all defaults.
      source: where ``d`` came from, used in error messages.
      overrides: ``"a.b=value"`` strings applied on top of ``d``.

    Returns:
      The validated config.

    Raises:
      ConfigError: naming the offending field and the source.
    """
    sources = _Sources(source)
    if d is not None and overrides and not isinstance(d, Mapping):
        _coerce_section(d, Config, "", sources)  # fails, naming the source
    raw: Any = copy.deepcopy(dict(d)) if isinstance(d, Mapping) else d
    for override in overrides:
        raw = raw if isinstance(raw, dict) else {}
        _apply_override(raw, override, sources)
    values = _coerce_section(raw, Config, "", sources)
    try:
        return _build(Config, values)
    except ConfigError as e:
        where = source if not overrides else f"{source} with --set {' '.join(overrides)}"
        raise ConfigError(f"{e}{_in(where)}") from None


def load_config(path: str | Path | None, overrides: Sequence[str] = ()) -> Config:
    """Loads a YAML config file, applies ``--set`` overrides and validates.

    Args:
      path: YAML file, or None for the defaults.
      overrides: ``"a.b=value"`` strings; values are parsed as YAML.

    Returns:
      The validated config.

    Raises:
      ConfigError: if the file cannot be read or parsed, is not a mapping, or
        any key or value is invalid. The message names the file (or override)
        and the dotted field.
    """
    if path is None:
        return config_from_dict({}, source="<defaults>", overrides=overrides)
    source = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file {source}: {e}") from e
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {source} is not valid YAML: {e}") from e
    if raw is not None and not isinstance(raw, Mapping):
        raise ConfigError(
            f"config file {source} must contain a YAML mapping of config keys, "
            f"got {type(raw).__name__}"
        )
    return config_from_dict(raw, source=source, overrides=overrides)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested plain dicts (YAML- and JSON-safe); inverse of
    :func:`config_from_dict`."""
    return dataclasses.asdict(cfg)


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML text that :func:`load_config` reads back unchanged."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
