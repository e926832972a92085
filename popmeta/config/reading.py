"""Raw (YAML) values checked against the schema and the kinds, each error naming its source.

:class:`Reader` builds each section from a mapping: unknown keys fail naming
the full dotted key and the known ones (in a section that names a kind, the
kind's fields are known ones too), wrong types name the field, the expected
type and the value, and a kind that cannot be found or imported names
``<section>.kind``; the section's own checks then run as it is made.
:class:`Sources` says where each value came from: the file, or the ``--set``
that last set it.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Callable, Mapping
from typing import Any

from popmeta.config.kind_sections import KindSection, MixtureMember, TaskConfig
from popmeta.config.renamed import RENAMED_FIELDS, RENAMED_KIND_FIELDS
from popmeta.config.values import ConfigError, coerce
from popmeta.registry import KindError

__all__ = [
    "Reader",
    "Source",
    "Sources",
    "in_source",
    "is_kind_section",
    "is_section",
    "section_field_types",
    "unknown_key",
]

#: Where the value at a dotted path came from, for error messages.
Source = Callable[[str], str]


class Sources:
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


def section_field_types(cls: type) -> dict[str, Any]:
    """A section class's fields and their types, ``resolved`` left out."""
    # Resolves the string annotations left by `from __future__ import annotations`.
    return {
        name: tp
        for name, tp in typing.get_type_hints(cls).items()
        if name in {f.name for f in dataclasses.fields(cls)} and name != "resolved"
    }


def is_section(tp: Any) -> bool:
    """Whether ``tp`` is a section (a dataclass), not a value."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def is_kind_section(tp: Any) -> bool:
    """Whether ``tp`` is a section that names a kind."""
    return isinstance(tp, type) and issubclass(tp, KindSection)


def in_source(source: str) -> str:
    """The end of an error message that names where the value came from."""
    return f" (in {source})"


def known_keys(cls: type, prefix: str) -> list[str]:
    return [f"{prefix}{name}" for name in section_field_types(cls)]


def unknown_key(key: Any, cls: type, prefix: str, source: str) -> ConfigError:
    """The error for ``prefix + key``, not a field of ``cls``: the closest and all known keys."""
    dotted = f"{prefix}{key}"
    known = known_keys(cls, prefix)
    close = difflib.get_close_matches(dotted, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ConfigError(
        f"unknown config key {dotted!r} in {source}{hint}; known keys: {', '.join(known)}"
    )


class Reader:
    """Checks raw (YAML) values against the schema, naming each value's source."""

    def __init__(self, source: Source, search_path: tuple[str, ...]):
        self.source = source
        self.search_path = search_path

    def value(self, value: Any, tp: Any, path: str) -> Any:
        if typing.get_origin(tp) is dict and is_section(typing.get_args(tp)[1]):
            return self.sections(value, typing.get_args(tp)[1], path)
        return coerce(value, tp, path, in_source(self.source(path)))

    def sections(self, value: Any, cls: type, path: str) -> dict[str, Any]:
        """A mapping of name -> section (``eval.out_of_distribution``)."""
        if not isinstance(value, Mapping):
            raise ConfigError(
                f"{path}: expected a mapping of names to sections, got {value!r}"
                f"{in_source(self.source(path))}"
            )
        return {key: self.section(item, cls, f"{path}.{key}.") for key, item in value.items()}

    def section(self, raw: Any, cls: type, prefix: str) -> Any:
        """A section built from ``raw`` (None or an empty YAML section means defaults)."""
        if is_kind_section(cls):
            return self.kind_section(raw, cls, prefix)
        raw = self._mapping(raw, cls, prefix)
        field_types = section_field_types(cls)
        values: dict[str, Any] = {}
        for key, value in raw.items():
            if f"{prefix}{key}" in RENAMED_FIELDS:
                raise ConfigError(
                    f"{prefix}{key} was renamed: it is {RENAMED_FIELDS[prefix + key]} now"
                    f"{in_source(self.source(f'{prefix}{key}'))}"
                )
            if key not in field_types:
                raise unknown_key(key, cls, prefix, self.source(f"{prefix}{key}"))
            tp = field_types[key]
            path = f"{prefix}{key}"
            values[key] = (
                self.section(value, tp, f"{path}.")
                if is_section(tp)
                else self.value(value, tp, path)
            )
        for name, tp in field_types.items():
            if is_section(tp) and name not in values:
                values[name] = self.section(None, tp, f"{prefix}{name}.")
        return cls(**values)

    def _mapping(self, raw: Any, cls: type, prefix: str) -> Mapping[str, Any]:
        if raw is None:
            return {}
        if not isinstance(raw, Mapping):
            where = prefix.rstrip(".") or "config"
            raise ConfigError(
                f"{where}: expected a mapping with keys {', '.join(known_keys(cls, prefix))}, "
                f"got {raw!r}{in_source(self.source(prefix))}"
            )
        return raw

    def kind_section(self, raw: Any, cls: type[KindSection], prefix: str) -> KindSection:
        """A section that names a kind: ``kind``, the section's own fields, the kind's fields."""
        raw = dict(self._mapping(raw, cls, prefix))
        section_name = cls.REGISTRY.section
        for old, new in RENAMED_KIND_FIELDS.get(section_name, {}).items():
            if old in raw:
                raise ConfigError(
                    f"{prefix}{old} was renamed: it is {prefix}{new} now (every section names "
                    f"its kind with `kind`; `popmeta kinds` lists each kind's fields)"
                    f"{in_source(self.source(f'{prefix}{old}'))}"
                )
        default_kind = next(f.default for f in dataclasses.fields(cls) if f.name == "kind")
        name = raw.pop("kind", default_kind)
        if not isinstance(name, str):
            raise ConfigError(
                f"{prefix}kind: expected a kind's name or module:attribute, got {name!r}"
                f"{in_source(self.source(f'{prefix}kind'))}"
            )
        try:
            kind = cls.REGISTRY.resolve(name, self.search_path)
        except KindError as err:
            field, _, message = str(err).partition(": ")
            del field
            raise ConfigError(
                f"{prefix}kind: {message}{in_source(self.source(f'{prefix}kind'))}"
            ) from None
        own = {n: tp for n, tp in section_field_types(cls).items() if n not in ("kind", "options")}
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
                options[key] = coerce(value, field.type, path, in_source(self.source(path)))
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
                f"{in_source(self.source(path))}"
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
