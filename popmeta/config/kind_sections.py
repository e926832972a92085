"""The five sections that name a kind, and what they share (:class:`KindSection`).

``task``, ``learned_optimizer``, ``truncation``, ``estimator`` and
``outer_optimizer`` each name a kind with ``kind`` (a name of
:mod:`popmeta.registry`, or ``module:attribute``); the kind brings its own
fields, checked against its callable's typed parameters when the section is
made, and its own rules. A section may also have fields of its own, whatever
its kind (``estimator.num_tasks``). These classes name no kind but the
quickstart's defaults.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from popmeta.config.values import ConfigError, Problem, coerce, non_negative, positive
from popmeta.registry import (
    ESTIMATORS,
    LEARNED_OPTIMIZERS,
    OUTER_OPTIMIZERS,
    TASK_FAMILIES,
    TRUNCATION_SCHEDULES,
    Kind,
    KindError,
    Registry,
)

if TYPE_CHECKING:
    from popmeta.config.schema import Config

__all__ = [
    "KIND_SECTIONS",
    "EstimatorConfig",
    "KindSection",
    "LearnedOptimizerConfig",
    "MixtureMember",
    "OuterOptimizerConfig",
    "TaskConfig",
    "TruncationConfig",
]


class KindSection:
    """A section that names a kind: ``kind``, the kind's fields in ``options``, its own fields.

    Subclasses are frozen dataclasses with the fields ``kind``, ``options``
    and ``resolved`` (the :class:`~popmeta.registry.Kind`, found when the
    section is made unless given) and fields of their own. ``options`` ends up
    holding every field of the kind, its defaults filled in; they also read
    as attributes (``config.task.dim``). A kind that cannot be found, or
    options that do not fit it, are problems of the section, reported by the
    config that holds it.
    """

    REGISTRY: ClassVar[Registry]
    kind: str
    options: Mapping[str, Any]
    resolved: Kind | None

    def __post_init__(self) -> None:
        problems: list[Problem] = []
        kind = self.resolved
        if kind is None:
            try:
                kind = self.REGISTRY.resolve(self.kind)
            except KindError as err:
                problems.append(("kind", str(err).split(": ", 1)[-1]))
        options = dict(self.options)
        if kind is not None:
            options = self._checked_options(kind, options, problems)
        object.__setattr__(self, "resolved", kind)
        object.__setattr__(self, "options", options)
        object.__setattr__(self, "_kind_problems", tuple(problems))

    def _checked_options(
        self, kind: Kind, options: dict[str, Any], problems: list[Problem]
    ) -> dict[str, Any]:
        checked = {}
        for name in options:
            if kind.field(name) is None:
                problems.append((name, _not_a_field(self.REGISTRY.section, kind, name)))
        for field in kind.fields:
            if field.name not in options:
                if field.required:
                    problems.append((field.name, f"kind {kind.name!r} needs it; it has no default"))
                else:
                    checked[field.name] = field.default
                continue
            try:
                value = coerce(options[field.name], field.type, field.name)
            except ConfigError as err:
                problems.append((field.name, str(err).split(": ", 1)[-1]))
                continue
            if (problem := field.out_of_range(value)) is not None:
                problems.append((field.name, problem))
            checked[field.name] = value
        return checked

    def __getattr__(self, name: str) -> Any:
        # Only called for names that are not attributes: a kind's field reads as one.
        options = self.__dict__.get("options", {})
        if name.startswith("__") or name not in options:
            raise AttributeError(
                f"{type(self).__name__} of kind {self.__dict__.get('kind')!r} has no field {name!r}"
            )
        return options[name]

    def _problems(self) -> Iterator[Problem]:
        yield from self.__dict__.get("_kind_problems", ())
        yield from self._own_problems()

    def _own_problems(self) -> Iterator[Problem]:
        return iter(())

    def kind_rules(self, config: Config, where: str) -> Iterator[Problem]:
        """The kind's rules against the whole config (absolute field names)."""
        if self.resolved is not None and self.resolved.rules is not None:
            yield from self.resolved.rules(config, where, self)


def _not_a_field(section: str, kind: Kind, name: str) -> str:
    fields = ", ".join(f.name for f in kind.fields) or "none"
    return f"not a field of {section}.kind={kind.name!r} (its fields: {fields})"


@dataclasses.dataclass(frozen=True)
class MixtureMember:
    """One family of a task mixture: its share of the task slots and its task section.

    Attributes:
      weight: its share of each worker's ``estimator.num_tasks`` slots.
      task: its kind and fields.
    """

    weight: float
    task: TaskConfig


@dataclasses.dataclass(frozen=True)
class TaskConfig(KindSection):
    """The inner problems the learned optimizer is trained on.

    Attributes:
      kind: task family (``popmeta kinds`` lists them), or ``module:attribute``.
      options: the family's fields.
      mixture: a mixture to train on, ``{label: member}``: each actor splits
        its ``estimator.num_tasks`` slots among the members in proportion to
        their weights (at least one slot each), and TensorBoard shows
        ``meta_loss_by_family/<label>`` for each. Empty: train on ``kind``
        alone. When set, this section's own kind and fields (meta-testing
        runs on them) must be one of the members'.
      rescale_per_tensor: training augmentation (``[low, high]``): every
        training task multiplies each parameter tensor's scale by a factor
        drawn log-uniformly in this range
        (:class:`~popmeta.core.tasks.RescaledFamily`); ``[1, 1]``: none.
        Meta-testing runs the plain family.
      rescale_overall: the same with one factor per task for all its tensors.
        With a mixture, both apply to every member that sets neither.
    """

    REGISTRY: ClassVar[Registry] = TASK_FAMILIES
    #: The fields a mixture's members take from the section unless they set their own.
    SHARED_WITH_MEMBERS: ClassVar[tuple[str, ...]] = ("rescale_per_tensor", "rescale_overall")
    kind: str = "curved_quadratic"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    mixture: dict[str, MixtureMember] = dataclasses.field(default_factory=dict)
    rescale_per_tensor: tuple[float, float] = (1.0, 1.0)
    rescale_overall: tuple[float, float] = (1.0, 1.0)
    resolved: Kind | None = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def rescaled(self) -> bool:
        """Whether training rescales this family's tasks."""
        return (self.rescale_per_tensor, self.rescale_overall) != ((1.0, 1.0), (1.0, 1.0))

    def _own_problems(self) -> Iterator[Problem]:
        for name in self.SHARED_WITH_MEMBERS:
            low, high = getattr(self, name)
            if not 0 < low <= high:
                yield name, f"expected [low, high] with 0 < low <= high, got {[low, high]}"
        for label, member in self.mixture.items():
            if member.task.mixture:
                yield f"mixture.{label}.mixture", "a mixture's member is one family, not a mixture"
            if not member.weight > 0:
                yield f"mixture.{label}.weight", f"must be > 0, got {member.weight!r}"
            for field, message in member.task._problems():
                yield f"mixture.{label}.{field}", message
        if self.mixture and not any(self.same_family(m.task) for m in self.mixture.values()):
            yield (
                "kind",
                "with task.mixture set, task's own kind and fields are what meta-testing runs "
                f"on and must be one of the mixture's members; got {self.kind!r} with "
                f"{dict(self.options)}",
            )

    def same_family(self, other: TaskConfig) -> bool:
        return (self.kind, dict(self.options)) == (other.kind, dict(other.options))

    def training_sections(self, where: str = "task") -> list[tuple[str, TaskConfig]]:
        """``(dotted path, section)`` of each family training runs on (the mixture's, or this)."""
        if not self.mixture:
            return [(where, self)]
        return [(f"{where}.mixture.{label}", m.task) for label, m in self.mixture.items()]


@dataclasses.dataclass(frozen=True)
class LearnedOptimizerConfig(KindSection):
    """The learned optimizer whose theta is meta-trained.

    Attributes:
      kind: learned optimizer (``popmeta kinds`` lists them), or ``module:attribute``.
      options: its fields.
    """

    REGISTRY: ClassVar[Registry] = LEARNED_OPTIMIZERS
    kind: str = "mlp"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    resolved: Kind | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class TruncationConfig(KindSection):
    """How long each inner trajectory runs before it is reset.

    Attributes:
      kind: truncation schedule (``popmeta kinds`` lists them), or ``module:attribute``.
      options: its fields.
    """

    REGISTRY: ClassVar[Registry] = TRUNCATION_SCHEDULES
    kind: str = "constant"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    resolved: Kind | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class EstimatorConfig(KindSection):
    """The gradient estimator each actor runs, and the tasks it runs on.

    Attributes:
      kind: estimator (``popmeta kinds`` lists them).
      options: its fields (``trunc_length``, ``std``, ...).
      num_tasks: inner problems per actor, trained side by side.
      random_initial_iteration_offset: tasks start at random iterations in
        [0, offset) so they do not run in lockstep.
      truncations_per_call: consecutive truncations per worker call, run in one
        jitted call and averaged by their weights into one estimate; amortises
        the per-call cost (a Ray round trip) when a truncation takes about a
        millisecond. ``auto``: measured when the run starts, as the fewest
        that make the per-call cost at most a quarter of a call's compute
        (:mod:`popmeta.population.call_size`), and recorded with the run, so
        a resume continues with the same number. A larger number gives fewer,
        less noisy learner updates per inner step. Throughput counts scale
        with it.
      meta_loss_split: ``train``: the per-step meta-loss is the normalized
        training loss before the inner update (learned_optimization's
        default); ``outer_valid``: the updated parameters' normalized loss on a
        batch of the held-out outer-validation split (learned_optimization's
        ``outer_valid``), which rewards generalisation rather than fitting the
        training batch. Data-free task families have no such split and refuse it.
      meta_loss_transform: ``identity``: each step's meta-loss as it is, so
        the first steps of a trajectory, whose losses are the largest, weigh
        most; ``log``: its logarithm (plus 1e-3), so that halving the loss
        counts the same at any step, and the end of a trajectory, where the
        loss is small, weighs as much as its start.
    """

    REGISTRY: ClassVar[Registry] = ESTIMATORS
    kind: str = "pes"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    num_tasks: int = 16
    random_initial_iteration_offset: int = 100
    truncations_per_call: int | Literal["auto"] = "auto"
    meta_loss_split: Literal["train", "outer_valid"] = "train"
    meta_loss_transform: Literal["identity", "log"] = "identity"
    resolved: Kind | None = dataclasses.field(default=None, compare=False, repr=False)

    def _own_problems(self) -> Iterator[Problem]:
        yield from positive(self, "num_tasks")
        if self.truncations_per_call != "auto":
            yield from positive(self, "truncations_per_call")
        yield from non_negative(self, "random_initial_iteration_offset")


@dataclasses.dataclass(frozen=True)
class OuterOptimizerConfig(KindSection):
    """The optax optimizer the learner applies to theta.

    Attributes:
      kind: optimizer (``popmeta kinds`` lists them), or ``module:attribute``
        to an optax alias, e.g. ``optax:adamw`` with its keyword arguments.
      options: its fields (``learning_rate``, ...).
      clip_grad_norm: global-norm clip of each round's summed estimate, before
        the optimizer, or null.
      lr_decay: the meta learning rate over the run: ``constant``, or
        ``cosine`` / ``linear`` from the kind's ``learning_rate`` at the first
        update down to ``lr_decay_to`` times it at update ``train.num_steps``,
        so that the last updates average the estimates' noise rather than
        follow it. Raising ``train.num_steps`` to train a run further
        stretches the decay over the new count (the rate rises again).
      lr_decay_to: the fraction of the learning rate left at the end, in [0, 1].
      lr_decay_start: the fraction of ``train.num_steps`` the rate holds
        before it decays, in [0, 1): 0.5 decays it over the second half only.
    """

    REGISTRY: ClassVar[Registry] = OUTER_OPTIMIZERS
    kind: str = "adam"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    clip_grad_norm: float | None = 3.0
    lr_decay: Literal["constant", "cosine", "linear"] = "constant"
    lr_decay_to: float = 0.0
    lr_decay_start: float = 0.0
    resolved: Kind | None = dataclasses.field(default=None, compare=False, repr=False)

    def _own_problems(self) -> Iterator[Problem]:
        yield from positive(self, "clip_grad_norm")
        if not 0.0 <= self.lr_decay_to <= 1.0:
            yield "lr_decay_to", f"must be in [0, 1], got {self.lr_decay_to!r}"
        if not 0.0 <= self.lr_decay_start < 1.0:
            yield "lr_decay_start", f"must be in [0, 1), got {self.lr_decay_start!r}"


#: The sections that name a kind, by their key in the config.
KIND_SECTIONS: dict[str, type[KindSection]] = {
    "task": TaskConfig,
    "learned_optimizer": LearnedOptimizerConfig,
    "truncation": TruncationConfig,
    "estimator": EstimatorConfig,
    "outer_optimizer": OuterOptimizerConfig,
}
