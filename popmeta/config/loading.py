"""Reading a config: a YAML file or a mapping, ``--set`` overrides, into a checked :class:`Config`; and back.

The overrides apply to the file's values before anything is checked
(:mod:`popmeta.config.overrides`), then every value is checked against the
schema and the kinds (:mod:`popmeta.config.reading`), then the ranges and
rules (:mod:`popmeta.config.schema`). Import paths ``module:attribute`` are
imported as they are, else from the config file's directory and the
directories of ``population.runtime_env`` (``working_dir``, ``py_modules``).

Example::

    cfg = load_config("configs/quickstart.yaml", ["estimator.std=0.02"])
    cfg.estimator.std  # 0.02
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from popmeta.config.kind_sections import KindSection
from popmeta.config.overrides import apply_override
from popmeta.config.reading import Reader, Sources, in_source
from popmeta.config.renamed import upgrade_recorded
from popmeta.config.schema import Config
from popmeta.config.values import ConfigError

__all__ = [
    "config_fields",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "module_dirs",
]


def _search_path(raw: Mapping[str, Any], given: Sequence[str | Path]) -> tuple[str, ...]:
    """Where user modules are imported from: ``given`` (the config's directory), and the
    directories of its runtime_env."""
    paths = [str(Path(p).resolve()) for p in given]
    population = raw.get("population") if isinstance(raw, Mapping) else None
    env = population.get("runtime_env") if isinstance(population, Mapping) else None
    if isinstance(env, Mapping):
        if isinstance(env.get("working_dir"), str):
            paths.append(str(Path(env["working_dir"]).resolve()))
        for module in env.get("py_modules") or ():
            if isinstance(module, str) and "://" not in module:
                paths.append(str(Path(module).resolve().parent))
    return tuple(dict.fromkeys(paths))


def config_from_dict(
    d: Mapping[str, Any] | None,
    source: str = "<dict>",
    overrides: Sequence[str] = (),
    *,
    search_path: Sequence[str | Path] = (),
    recorded: bool = False,
) -> Config:
    """Builds and validates a :class:`Config` from a nested mapping.

    Args:
      d: nested mapping of sections (missing keys take their defaults);
        None means all defaults.
      source: where ``d`` came from, used in error messages.
      overrides: ``"a.b=value"`` strings applied on top of ``d``.
      search_path: directories user modules (``kind: module:attribute``) may
        also be imported from: the config file's, the ones a checkpoint
        recorded (see :func:`module_dirs`).
      recorded: ``d`` is a config popmeta recorded (a run's ``config.yaml``,
        a checkpoint's metadata), perhaps by an older version: old field
        names are translated (:func:`upgrade_recorded`).

    Returns:
      The validated config.

    Raises:
      ConfigError: naming the offending field and the source.
    """
    sources = Sources(source)
    if d is not None and not isinstance(d, Mapping):
        raise ConfigError(f"config: expected a mapping of sections, got {d!r}{in_source(source)}")
    raw: dict[str, Any] = copy.deepcopy(dict(d)) if d is not None else {}
    if recorded:
        raw = upgrade_recorded(raw)
    for override in overrides:
        apply_override(raw, override, sources)
    reader = Reader(sources, _search_path(raw, search_path))
    try:
        return reader.section(raw, Config, "")
    except ConfigError as e:
        if "(in " in str(e):
            raise
        where = source if not overrides else f"{source} with --set {' '.join(overrides)}"
        raise ConfigError(f"{e}{in_source(where)}") from None


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
    here = Path(path).resolve().parent
    return config_from_dict(raw, source=source, overrides=overrides, search_path=(here,))


def module_dirs(cfg: Config) -> list[str]:
    """The directories the config's user modules were imported from beside it: what a
    checkpoint records so that a later reader imports them from there too."""
    return list(dict.fromkeys(str(Path(found).parent) for found in cfg.found_modules()))


def _section_to_dict(section: Any) -> Any:
    if isinstance(section, KindSection):
        out: dict[str, Any] = {"kind": section.kind, **section.options}
        for field in dataclasses.fields(section):
            if field.name in ("kind", "options", "resolved"):
                continue
            value = getattr(section, field.name)
            if field.name == "mixture":
                value = {
                    label: {"weight": m.weight, **_section_to_dict(m.task)}
                    for label, m in value.items()
                }
            out[field.name] = _section_to_dict(value)
        return out
    if dataclasses.is_dataclass(section):
        return {
            f.name: _section_to_dict(getattr(section, f.name)) for f in dataclasses.fields(section)
        }
    if isinstance(section, Mapping):
        return {key: _section_to_dict(value) for key, value in section.items()}
    if isinstance(section, tuple):
        return [_section_to_dict(value) for value in section]
    return copy.deepcopy(section)


def config_to_dict(cfg: Config) -> dict[str, Any]:
    """The config as nested plain dicts (YAML- and JSON-safe); inverse of
    :func:`config_from_dict`. A kind's fields sit beside ``kind`` in its section."""
    return _section_to_dict(cfg)


def config_fields(cfg: Config) -> dict[str, Any]:
    """Every field as ``section.field`` (``field`` at the top) -> its plain value; a kind's
    fields sit in its section (``learned_optimizer.weight_decay``)."""
    flat: dict[str, Any] = {}
    for section, values in config_to_dict(cfg).items():
        if isinstance(values, dict) and dataclasses.is_dataclass(getattr(cfg, section)):
            flat.update((f"{section}.{name}", value) for name, value in values.items())
        else:
            flat[section] = values
    return flat


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML text that :func:`load_config` reads back unchanged."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
