"""``--set a.b=value`` overrides, put into the raw values before anything is checked.

So ``--set`` can repair a bad value in a file. A value is parsed with
``yaml.safe_load`` (``0.02`` a float, ``null`` None, ``{TPU: 1}`` a mapping)
and then checked exactly like a file's; for a field that expects a string,
``--set name=2024`` keeps the text ``"2024"``. Null for a field the section's
kind does not have removes it, so ``--set task.kind=quadratic --set
task.npz_path=null`` switches away from a kind with other fields.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import yaml

from popmeta.config.reading import (
    Sources,
    in_source,
    is_kind_section,
    is_section,
    section_field_types,
    unknown_key,
)
from popmeta.config.schema import Config
from popmeta.config.values import ConfigError, takes_text, type_name

__all__ = ["apply_override"]


def merge(base: dict[str, Any], update: Mapping[str, Any]) -> None:
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            merge(base[key], value)
        else:
            base[key] = value


def apply_override(raw: dict[str, Any], override: str, sources: Sources) -> None:
    """Puts the override's value into the raw (not yet checked) values."""
    source = f"--set {override}"
    key, sep, text = override.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"bad override {override!r}: expected KEY=VALUE, e.g. estimator.std=0.02")
    parts = key.split(".")
    cls: type | None = Config
    target = raw
    for i, part in enumerate(parts):
        prefix = "".join(f"{p}." for p in parts[:i])
        last = i == len(parts) - 1
        tp: Any = None
        if cls is not None:
            field_types = section_field_types(cls)
            if part not in field_types and not is_kind_section(cls):
                raise unknown_key(part, cls, prefix, source)
            tp = field_types.get(part)  # None: a kind's field, checked with the kind
        if not last:
            if cls is not None and tp is not None and not is_section(tp) and part != "mixture":
                raise ConfigError(
                    f"unknown config key {key!r} in {source}: {prefix}{part} holds a "
                    f"value of type {type_name(tp)}, not a section"
                )
            cls = tp if is_section(tp) else None
            if not isinstance(target.get(part), dict):
                target[part] = {}  # a missing (or empty) section of the file
            target = target[part]
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{key}: cannot parse value {text!r}{in_source(source)}: {e}") from e
        if (
            isinstance(value, Mapping)
            and isinstance(target.get(part), dict)
            and (tp is None or is_section(tp) or part == "mixture")
        ):
            merge(target[part], copy.deepcopy(dict(value)))
        elif (
            tp is not None
            and value is not None
            and not isinstance(value, str | Mapping | list)
            and takes_text(tp, text.strip())
        ):
            # `--set name=2024` means the string, even though YAML reads an int.
            target[part] = text.strip()
        else:
            target[part] = value
        sources.record(key, override)
