"""The registries as Markdown: what ``popmeta kinds`` prints and ``docs/kinds.md`` holds."""

from __future__ import annotations

from collections.abc import Iterable

from popmeta.registry.kinds import Registry

__all__ = ["render_markdown"]


def _fields(kind) -> str:
    if not kind.fields:
        return "none"
    return "<br>".join(
        f"`{field.signature()}`" + (f": {field.doc}" if field.doc else "") for field in kind.fields
    )


def render_markdown(registries: Iterable[Registry] | None = None) -> str:
    """Every registry's kinds with their fields, as one Markdown page."""
    if registries is None:
        from popmeta.registry import REGISTRIES

        registries = REGISTRIES
    lines = [
        "# Kinds a config can name",
        "",
        "Generated from `popmeta/registry/` by `popmeta kinds`; a test keeps this page",
        "equal to its output. Every section names its kind with `kind`: one of these, or an",
        "import path `module:attribute` to a callable of yours, whose typed parameters are",
        "its fields ([extending.md](extending.md)). A kind's fields sit beside `kind` in the",
        "section, e.g. `task: {kind: curved_quadratic, dim: 10}`.",
    ]
    for registry in registries:
        lines += [
            "",
            f"## {registry.title}: `{registry.field}`",
            "",
            f"A kind returns {registry.builds}.",
            "",
            "| kind | what it is | fields |",
            "|---|---|---|",
        ]
        lines += [f"| `{kind.name}` | {kind.summary} | {_fields(kind)} |" for kind in registry]
    return "\n".join(lines) + "\n"
