"""Field names of older popmeta versions: refused in what a user writes, translated in what popmeta recorded.

A config file or ``--set`` that uses an old name fails naming the new one
(:data:`RENAMED_KIND_FIELDS`, :data:`RENAMED_FIELDS`); a config popmeta
recorded itself (a run's ``config.yaml``, a checkpoint's) holds every field of
its time and is translated by :func:`upgrade_recorded`, so old runs resume
and old checkpoints evaluate.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from popmeta.config.kind_sections import KIND_SECTIONS, TaskConfig

__all__ = ["RENAMED_FIELDS", "RENAMED_KIND_FIELDS", "upgrade_recorded"]

#: Fields renamed or moved, per kind section: old key -> where it went.
RENAMED_KIND_FIELDS = {
    "task": {
        "family": "kind",
        "families": "mixture",
        "parametric_groups": "groups (a field of kind parametric_image_mlp_digits)",
    },
    "truncation": {"schedule": "kind"},
    "outer_optimizer": {"name": "kind"},
}


#: Fields of plain sections renamed: old dotted key -> what to write instead.
RENAMED_FIELDS = {
    "eval.long_horizon_factor": "eval.long_horizon_factors, a list (e.g. [5, 10]; [] for none)",
}


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
        own = tuple(
            f.name for f in dataclasses.fields(cls) if f.name not in ("kind", "options", "resolved")
        )
        raw[name] = {"kind": kind_name, **_keep(section, kind, own)}
    ood = (raw.get("eval") or {}).get("out_of_distribution") or {}
    if ood:
        raw["eval"] = {
            **raw["eval"],
            "out_of_distribution": {k: _upgrade_task(v) for k, v in ood.items()},
        }
    return raw
