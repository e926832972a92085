"""The kinds a config may name: one registry per section, each kind one callable.

``task``, ``learned_optimizer``, ``truncation``, ``estimator`` and
``outer_optimizer`` each name their kind with ``kind``: a name registered
here, or an import path ``module:attribute`` to a callable of the user's
(:mod:`popmeta.registry.kinds`). A kind's typed parameters are its config
fields; its rules sit beside it. ``popmeta kinds`` prints every registry with
its kinds' fields, and ``docs/kinds.md`` is its output. This package never
imports the config, which sits above it.
"""

from popmeta.registry.docs import render_markdown
from popmeta.registry.estimators import ESTIMATORS
from popmeta.registry.kinds import REQUIRED, Field, Kind, KindError, Range, Registry
from popmeta.registry.learned_optimizers import LEARNED_OPTIMIZERS
from popmeta.registry.outer_optimizers import OUTER_OPTIMIZERS
from popmeta.registry.schedules import TRUNCATION_SCHEDULES
from popmeta.registry.tasks import TASK_FAMILIES

#: Every registry, in the order of the config's sections.
REGISTRIES: tuple[Registry, ...] = (
    TASK_FAMILIES,
    LEARNED_OPTIMIZERS,
    TRUNCATION_SCHEDULES,
    ESTIMATORS,
    OUTER_OPTIMIZERS,
)

__all__ = [
    "ESTIMATORS",
    "LEARNED_OPTIMIZERS",
    "OUTER_OPTIMIZERS",
    "REGISTRIES",
    "REQUIRED",
    "TASK_FAMILIES",
    "TRUNCATION_SCHEDULES",
    "Field",
    "Kind",
    "KindError",
    "Range",
    "Registry",
    "register_estimator",
    "register_learned_optimizer",
    "register_outer_optimizer",
    "register_task_family",
    "register_truncation_schedule",
    "render_markdown",
]


def _user_kinds(registry: Registry):
    def register(build=None, *, name: str | None = None):
        def add(function):
            registry.register_user_kind(function, name)
            return function

        return add(build) if build is not None else add

    register.__doc__ = (
        f"Decorator: the callable becomes a kind of ``{registry.field}``, named by ``name`` "
        f"(default: its own name); it must return {registry.builds}. Its typed "
        "parameters are the kind's config fields. A callable defined in a notebook or "
        "script travels to the actors by value."
    )
    return register


register_task_family = _user_kinds(TASK_FAMILIES)
register_learned_optimizer = _user_kinds(LEARNED_OPTIMIZERS)
register_truncation_schedule = _user_kinds(TRUNCATION_SCHEDULES)
register_estimator = _user_kinds(ESTIMATORS)
register_outer_optimizer = _user_kinds(OUTER_OPTIMIZERS)
