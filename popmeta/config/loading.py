"""Reading configs: YAML files, ``--set`` overrides, type checks against the schema and the kinds.

A config is built from a YAML file plus ``--set a.b=value`` overrides, and
checked before any actor starts. The overrides apply to the file's values
before anything is checked, so ``--set`` can repair a bad value in a file;
an error names the override that set the field, else the file:

* unknown keys fail naming the full dotted key and listing the known ones;
  in a section that names a kind, the kind's fields are the known ones too;
* wrong types fail naming the field, the expected type and the value;
* a kind that cannot be found or imported fails naming ``<section>.kind``;
* then the schema's ranges, the kinds' rules and the cross-field rules run
  (:mod:`popmeta.config.schema`).

Override values are parsed with ``yaml.safe_load`` (``0.02`` is a float, ``5``
an int, ``null`` is None, ``true`` a bool, ``{TPU: 1}`` a mapping) and then
checked exactly like file values; for a field that expects a string,
``--set name=2024`` keeps the text ``"2024"``. Null for a field the section's
kind does not have removes it, so ``--set task.kind=quadratic --set
task.npz_path=null`` switches away from a kind with other fields. Field names of older popmeta
versions (``task.family``, ``truncation.schedule``, ...) fail naming the new
one, except in configs popmeta recorded itself (a run's ``config.yaml``, a
checkpoint's), which :func:`upgrade_recorded` translates.

Import paths ``module:attribute`` are imported as they are, else from the
config file's directory and the directories of ``population.runtime_env``
(``working_dir``, ``py_modules``).

Example::

    cfg = load_config("configs/quickstart.yaml", ["estimator.std=0.02"])
    cfg.estimator.std  # 0.02
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from popmeta.config.schema import KIND_SECTIONS, Config, KindSection, MixtureMember, TaskConfig
from popmeta.config.values import ConfigError, accepts_str, coerce, type_name
from popmeta.registry import KindError

__all__ = [
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "module_dirs",
    "upgrade_recorded",
]

#: Where the value at a dotted path came from, for error messages.
Source = Callable[[str], str]

#: Fields renamed or moved, per kind section: old key -> where it went.
_RENAMED = {
    "task": {
        "family": "kind",
        "families": "mixture",
        "parametric_groups": "groups (a field of kind parametric_image_mlp_digits)",
    },
    "truncation": {"schedule": "kind"},
    "outer_optimizer": {"name": "kind"},
}


#: Fields of plain sections renamed: old dotted key -> what to write instead.
_RENAMED_FIELDS = {
    "eval.long_horizon_factor": "eval.long_horizon_factors, a list (e.g. [5, 10]; [] for none)",
}


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
    return {
        name: tp
        for name, tp in typing.get_type_hints(cls).items()
        if name in {f.name for f in dataclasses.fields(cls)} and name != "resolved"
    }


def _is_section(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _is_kind_section(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, KindSection)


def _in(source: str) -> str:
    return f" (in {source})"


def _known_keys(cls: type, prefix: str) -> list[str]:
    return [f"{prefix}{name}" for name in _field_types(cls)]


def _unknown_key(key: Any, cls: type, prefix: str, source: str) -> ConfigError:
    dotted = f"{prefix}{key}"
    known = _known_keys(cls, prefix)
    close = difflib.get_close_matches(dotted, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"unknown config key {dotted!r} in {source}{hint}; known keys: {', '.join(known)}"
    )


class _Reader:
    """Checks raw (YAML) values against the schema, naming each value's source."""

    def __init__(self, source: Source, search_path: tuple[str, ...]):
        self.source = source
        self.search_path = search_path

    def value(self, value: Any, tp: Any, path: str) -> Any:
        if typing.get_origin(tp) is dict and _is_section(typing.get_args(tp)[1]):
            return self.sections(value, typing.get_args(tp)[1], path)
        return coerce(value, tp, path, _in(self.source(path)))

    def sections(self, value: Any, cls: type, path: str) -> dict[str, Any]:
        """A mapping of name -> section (``eval.out_of_distribution``)."""
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{path}: expected a mapping of names to sections, got {value!r}"
                f"{_in(self.source(path))}"
            )
        return {key: self.section(item, cls, f"{path}.{key}.") for key, item in value.items()}

    def section(self, raw: Any, cls: type, prefix: str) -> Any:
        """A section built from ``raw`` (None or an empty YAML section means defaults)."""
        if _is_kind_section(cls):
            return self.kind_section(raw, cls, prefix)
        raw = self._mapping(raw, cls, prefix)
        field_types = _field_types(cls)
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if f"{prefix}{key}" in _RENAMED_FIELDS:
                raise ConfigError(
                    f"{prefix}{key} was renamed: it is {_RENAMED_FIELDS[prefix + key]} now"
                    f"{_in(self.source(f'{prefix}{key}'))}"
                )
            if key not in field_types:
                raise _unknown_key(key, cls, prefix, self.source(f"{prefix}{key}"))
            tp = field_types[key]
            path = f"{prefix}{key}"
            values[key] = (
                self.section(value, tp, f"{path}.")
                if _is_section(tp)
                else self.value(value, tp, path)
            )
        for name, tp in field_types.items():
            if _is_section(tp) and name not in values:
                values[name] = self.section(None, tp, f"{prefix}{name}.")
        return cls(**values)

    def _mapping(self, raw: Any, cls: type, prefix: str) -> Mapping[str, Any]:
        if raw is None:
            return {}
        if not isinstance(raw, Mapping):
            where = prefix.rstrip(".") or "config"
            raise ConfigError(
                f"{where}: expected a mapping with keys {', '.join(_known_keys(cls, prefix))}, "
                f"got {raw!r}{_in(self.source(prefix))}"
            )
        return raw

    def kind_section(self, raw: Any, cls: type[KindSection], prefix: str) -> KindSection:
        """A section that names a kind: ``kind``, the section's own fields, the kind's fields."""
        raw = dict(self._mapping(raw, cls, prefix))
        section_name = cls.REGISTRY.section
        for old, new in _RENAMED.get(section_name, {}).items():
            if old in raw:
                raise ConfigError(
                    f"{prefix}{old} was renamed: it is {prefix}{new} now (every section names "
                    f"its kind with `kind`; `popmeta kinds` lists each kind's fields)"
                    f"{_in(self.source(f'{prefix}{old}'))}"
                )
        default_kind = next(f.default for f in dataclasses.fields(cls) if f.name == "kind")
        name = raw.pop("kind", default_kind)
        if not isinstance(name, str):
            raise ConfigError(
                f"{prefix}kind: expected a kind's name or module:attribute, got {name!r}"
                f"{_in(self.source(f'{prefix}kind'))}"
            )
        try:
            kind = cls.REGISTRY.resolve(name, self.search_path)
        except KindError as err:
            field, _, message = str(err).partition(": ")
            del field
            raise ConfigError(
                f"{prefix}kind: {message}{_in(self.source(f'{prefix}kind'))}"
            ) from None
        own = {n: tp for n, tp in _field_types(cls).items() if n not in ("kind", "options")}
        values: dict[str, Any] = {"kind": name, "resolved": kind}
        options: dict[str, Any] = {}
        for key, value in raw.items():
            path = f"{prefix}{key}"
            if key == "mixture" and cls is TaskConfig:
                own_fields = {k: v for k, v in raw.items() if k != "mixture"}
                values["mixture"] = self.mixture(value, path, name, own_fields)
            elif key in own:
                values[key] = self.value(value, own[key], path)
            elif (field := kind.field(key)) is not None:
                options[key] = coerce(value, field.type, path, _in(self.source(path)))
            elif value is None:
                continue  # null for a field the kind lacks removes it (--set a.b=null)
            else:
                fields = [f.name for f in kind.fields]
                close = difflib.get_close_matches(key, [*fields, *own], n=1)
                hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
                raise ConfigError(
                    f"unknown config key {path!r} in {self.source(path)}: not a field of "
                    f"{prefix}kind={name!r} (its fields: {', '.join(fields) or 'none'}; the "
                    f"section's: {', '.join(own) or 'none'}){hint}"
                )
        values["options"] = options
        return cls(**values)

    def mixture(
        self, raw: Any, path: str, kind: str, kind_fields: Mapping[str, Any]
    ) -> dict[str, MixtureMember]:
        """``{label: weight}`` or ``{label: {kind, weight, fields}}``.

        A member given by its weight alone is the kind named by its label at
        its defaults, or, when that is the task section's own kind, with the
        section's fields (meta-testing's family, trained in the mixture). The
        section's rescaling ranges apply to every member that sets none.
        """
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"{path}: expected a mapping of labels to weights or task sections, got {raw!r}"
                f"{_in(self.source(path))}"
            )
        members = {}
        for label, member in raw.items():
            where = f"{path}.{label}"
            if isinstance(member, Mapping):
                section = dict(member)
            else:
                section = {"weight": member, **(kind_fields if label == kind else {})}
            section.setdefault("kind", label)
            for name in TaskConfig.SHARED_WITH_MEMBERS:
                if name in kind_fields:
                    section.setdefault(name, kind_fields[name])
            weight = self.value(section.pop("weight", 1.0), float, f"{where}.weight")
            members[label] = MixtureMember(
                weight, self.kind_section(section, TaskConfig, f"{where}.")
            )
        return members


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
    cls: type | None = Config
    target = raw
    for i, part in enumerate(parts):
        prefix = "".join(f"{p}." for p in parts[:i])
        last = i == len(parts) - 1
        tp: Any = None
        if cls is not None:
            field_types = _field_types(cls)
            if part not in field_types and not _is_kind_section(cls):
                raise _unknown_key(part, cls, prefix, source)
            tp = field_types.get(part)  # None: a kind's field, checked with the kind
        if not last:
            if cls is not None and tp is not None and not _is_section(tp) and part != "mixture":
                raise ConfigError(
                    f"unknown config key {key!r} in {source}: {prefix}{part} holds a "
                    f"value of type {type_name(tp)}, not a section"
                )
            cls = tp if _is_section(tp) else None
            if not isinstance(target.get(part), dict):
                target[part] = {}  # a missing (or empty) section of the file
            target = target[part]
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ConfigError(f"{key}: cannot parse value {text!r}{_in(source)}: {e}") from e
        if (
            isinstance(value, Mapping)
            and isinstance(target.get(part), dict)
            and (tp is None or _is_section(tp) or part == "mixture")
        ):
            _merge(target[part], copy.deepcopy(dict(value)))
        elif (
            tp is not None
            and accepts_str(tp)
            and value is not None
            and not isinstance(value, str | Mapping | list)
        ):
            # `--set name=2024` means the string, even though YAML reads an int.
            target[part] = text.strip()
        else:
            target[part] = value
        sources.record(key, override)


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
    sources = _Sources(source)
    if d is not None and not isinstance(d, Mapping):
        raise ConfigError(f"config: expected a mapping of sections, got {d!r}{_in(source)}")
    raw: dict[str, Any] = copy.deepcopy(dict(d)) if d is not None else {}
    if recorded:
        raw = upgrade_recorded(raw)
    for override in overrides:
        _apply_override(raw, override, sources)
    reader = _Reader(sources, _search_path(raw, search_path))
    try:
        return reader.section(raw, Config, "")
    except ConfigError as e:
        if "(in " in str(e):
            raise
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


def config_to_yaml(cfg: Config) -> str:
    """The config as YAML text that :func:`load_config` reads back unchanged."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)


# -- configs popmeta recorded before every section named its kind with `kind` -----------


def _keep(fields: dict[str, Any], kind: Any, own: tuple[str, ...]) -> dict[str, Any]:
    """The recorded fields the kind (or the section itself) has."""
    names = {f.name for f in kind.fields} if kind is not None else set(fields)
    return {k: v for k, v in fields.items() if k in names or k in own}


def _upgrade_task(task: Mapping[str, Any]) -> dict[str, Any]:
    from popmeta.registry import TASK_FAMILIES

    task = dict(task)
    families = task.pop("families", None) or {}
    name = task.pop("family", task.pop("kind", TaskConfig.kind))
    shared = {k: task.pop(k) for k in ("dim", "npz_path") if k in task}
    if "parametric_groups" in task:
        shared["groups"] = task.pop("parametric_groups")

    def member(kind_name: str) -> dict[str, Any]:
        kind = TASK_FAMILIES.resolve(kind_name) if kind_name in TASK_FAMILIES else None
        return {"kind": kind_name, **_keep(shared, kind, ())}

    out = {**task, **member(name)}
    if families:
        out["mixture"] = {label: {"weight": w, **member(label)} for label, w in families.items()}
    return out


def upgrade_recorded(raw: dict[str, Any]) -> dict[str, Any]:
    """A recorded config of any popmeta version, in this version's field names.

    Recorded configs hold every field of their time's sections; a field the
    section's kind does not have is dropped (it was never read), a renamed
    one takes its new name.
    """
    from popmeta.registry import REGISTRIES

    raw = dict(raw)
    evaluation = dict(raw.get("eval") or {})
    if "long_horizon_factor" in evaluation:
        factor = evaluation.pop("long_horizon_factor")
        evaluation["long_horizon_factors"] = [factor] if factor else []
        raw["eval"] = evaluation
    if "kind" in (raw.get("task") or {}) and "family" not in (raw.get("task") or {}):
        return raw  # already in this version's names
    registries = {registry.section: registry for registry in REGISTRIES}
    for name, cls in KIND_SECTIONS.items():
        section = dict(raw.get(name) or {})
        if name == "task":
            raw[name] = _upgrade_task(section)
            continue
        old_kind = {"truncation": "schedule", "outer_optimizer": "name"}.get(name)
        if old_kind and old_kind in section:
            section["kind"] = section.pop(old_kind)
        kind_name = section.get(
            "kind", next(f.default for f in dataclasses.fields(cls) if f.name == "kind")
        )
        registry = registries[name]
        kind = registry.resolve(kind_name) if kind_name in registry else None
        if kind_name == "learnable_adam" and "initial_momentum" in section:
            section["initial_beta1"] = section.pop("initial_momentum")
        own = tuple(n for n in _field_types(cls) if n not in ("kind", "options"))
        raw[name] = {"kind": kind_name, **_keep(section, kind, own)}
    ood = (raw.get("eval") or {}).get("out_of_distribution") or {}
    if ood:
        raw["eval"] = {
            **raw["eval"],
            "out_of_distribution": {k: _upgrade_task(v) for k, v in ood.items()},
        }
    return raw
