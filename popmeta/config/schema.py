"""The typed run configuration: one frozen dataclass per section, and every rule.

A config is a tree of frozen dataclasses (:class:`Config` and one section class
per top-level key). Constructing one (directly, with ``dataclasses.replace``,
or through :mod:`popmeta.config.loading`) runs every check, and a failure
names the dotted field.

Five sections name a kind with ``kind`` (:class:`KindSection`): ``task``,
``learned_optimizer``, ``truncation``, ``estimator`` and ``outer_optimizer``.
The kind (a name of :mod:`popmeta.registry`, or ``module:attribute``) brings
its own fields, checked against its callable's typed parameters, and its own
rules; this module names no kind. A section may also have fields of its own,
whatever its kind (``estimator.num_tasks``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Literal

from popmeta.config.values import ConfigError, coerce
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

__all__ = [
    "Config",
    "ConfigError",
    "EstimatorConfig",
    "EvalConfig",
    "KindSection",
    "LearnedOptimizerConfig",
    "MixtureMember",
    "OuterOptimizerConfig",
    "PopulationConfig",
    "TaskConfig",
    "TrainConfig",
    "TruncationConfig",
]

#: The longest file name most file systems take (NAME_MAX): a run's directory name.
MAX_NAME_BYTES = 255

# A problem found by a range check: (dotted field name relative to the section, message).
_Problem = tuple[str, str]


def _positive(section: Any, *names: str) -> Iterator[_Problem]:
    for name in names:
        value = getattr(section, name)
        if value is not None and not value > 0:
            yield name, f"must be > 0, got {value!r}"


def _non_negative(section: Any, *names: str) -> Iterator[_Problem]:
    for name in names:
        value = getattr(section, name)
        if value is not None and not value >= 0:
            yield name, f"must be >= 0, got {value!r}"


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
        problems: list[_Problem] = []
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
        self, kind: Kind, options: dict[str, Any], problems: list[_Problem]
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

    def _problems(self) -> Iterator[_Problem]:
        yield from self.__dict__.get("_kind_problems", ())
        yield from self._own_problems()

    def _own_problems(self) -> Iterator[_Problem]:
        return iter(())

    def kind_rules(self, config: Config, where: str) -> Iterator[_Problem]:
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

    def _own_problems(self) -> Iterator[_Problem]:
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
        millisecond. Throughput counts scale with it.
      meta_loss_split: ``train``: the per-step meta-loss is the normalized
        training loss before the inner update (learned_optimization's
        default); ``outer_valid``: the updated parameters' normalized loss on a
        batch of the held-out outer-validation split (learned_optimization's
        ``outer_valid``), which rewards generalisation rather than fitting the
        training batch. Data-free task families have no such split and refuse it.
    """

    REGISTRY: ClassVar[Registry] = ESTIMATORS
    kind: str = "pes"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    num_tasks: int = 16
    random_initial_iteration_offset: int = 100
    truncations_per_call: int = 1
    meta_loss_split: Literal["train", "outer_valid"] = "train"
    resolved: Kind | None = dataclasses.field(default=None, compare=False, repr=False)

    def _own_problems(self) -> Iterator[_Problem]:
        yield from _positive(self, "num_tasks", "truncations_per_call")
        yield from _non_negative(self, "random_initial_iteration_offset")


@dataclasses.dataclass(frozen=True)
class OuterOptimizerConfig(KindSection):
    """The optax optimizer the learner applies to theta.

    Attributes:
      kind: optimizer (``popmeta kinds`` lists them), or ``module:attribute``
        to an optax alias, e.g. ``optax:adamw`` with its keyword arguments.
      options: its fields (``learning_rate``, ...).
      clip_grad_norm: global-norm clip of each round's summed estimate, before
        the optimizer, or null.
    """

    REGISTRY: ClassVar[Registry] = OUTER_OPTIMIZERS
    kind: str = "adam"
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    clip_grad_norm: float | None = 3.0
    resolved: Kind | None = dataclasses.field(default=None, compare=False, repr=False)

    def _own_problems(self) -> Iterator[_Problem]:
        yield from _positive(self, "clip_grad_norm")


#: The sections that name a kind, by their key in the config.
KIND_SECTIONS: dict[str, type[KindSection]] = {
    "task": TaskConfig,
    "learned_optimizer": LearnedOptimizerConfig,
    "truncation": TruncationConfig,
    "estimator": EstimatorConfig,
    "outer_optimizer": OuterOptimizerConfig,
}


@dataclasses.dataclass(frozen=True)
class PopulationConfig:
    """The actors that compute estimates, and where they run.

    Attributes:
      num_actors: number of estimator actors (in single-process ``local``
        mode, the number of independent estimator seeds).
      mode: ``sync`` (one estimate per actor per version) or ``async``.
      batch_size: estimates aggregated per learner update in async mode.
      max_staleness: an estimate on theta version v is used at version u only
        if u - v <= max_staleness.
      num_cpus: CPUs declared per actor.
      num_gpus: GPUs declared per actor.
      resources: custom Ray resources per actor (e.g. ``{TPU: 4}``).
      pin_cpus: pin each actor's threads to a distinct CPU core of its node
        (CPU-only nodes), since XLA otherwise spreads every actor over all cores.
      address: Ray address to join (``auto``), or null for an embedded instance
        (``RAY_ADDRESS`` in the environment also joins a cluster).
      engine: ``ray`` (actors) or ``local`` (every worker in the driver, one
        after another, sync, no Ray). The local engine reads only
        ``num_actors`` and ``shard_tasks`` and refuses every other field set
        away from its default.
      one_actor_per_node_with: if set, start one actor on every node that
        carries this resource (e.g. ``TPU`` or ``GPU``) instead of
        ``num_actors`` actors (which must then stay unset).
      calls_in_flight: estimate calls queued per actor in async mode, so an
        actor never idles waiting for the learner.
      env: environment variables for the actors (e.g. ``XLA_FLAGS``); they join
        ``runtime_env``'s ``env_vars``.
      runtime_env: Ray's runtime environment for the actors, passed to Ray as it
        is (``working_dir``, ``py_modules``, ``pip``, ``env_vars``, ...): how the
        code of your own kinds reaches every node. The driver imports your
        modules from its local ``working_dir`` and ``py_modules`` too, and a
        module found only beside the config file is added to ``py_modules``.
      shard_tasks: an actor that sees several local devices shards its tasks over
        them (``estimator.num_tasks`` must then be a multiple of their number).
      call_timeout_s: longest wait for an actor to start (build its worker and
        compile), and for one call before the population's calls are timed.
      call_timeout_factor: a busy actor silent for this many times the slowest
        of the population's recent calls (before its first calls, of its
        actors' starts) is lost and replaced (a warning comes at half that
        time); the wait is at least ``min_call_timeout_s`` and at most
        ``call_timeout_s``.
      min_call_timeout_s: the shortest wait before a silent actor is lost.
      max_actor_restarts: times one rank may be replaced in a row, without a
        reply in between, before the run gives up (a crash loop); losses of
        actors that delivered in between never add up.
      compiled_graph: sync rounds reach each actor through a Ray compiled graph
        (shared-memory channels) instead of an actor call: 0.7-1.0 ms less per
        round on 2 CPU cores, but the driver busy-waits on a core while the
        actors compute. Sync mode only.
    """

    num_actors: int = 2
    mode: Literal["sync", "async"] = "sync"
    batch_size: int = 1
    max_staleness: int = 2
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = dataclasses.field(default_factory=dict)
    pin_cpus: bool = True
    address: str | None = None
    engine: Literal["local", "ray"] = "ray"
    one_actor_per_node_with: str | None = None
    calls_in_flight: int = 2
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    runtime_env: dict[str, Any] = dataclasses.field(default_factory=dict)
    shard_tasks: bool = True
    call_timeout_s: float = 600.0
    call_timeout_factor: float = 10.0
    min_call_timeout_s: float = 10.0
    max_actor_restarts: int = 10
    compiled_graph: bool = False

    def _problems(self) -> Iterator[_Problem]:
        yield from _positive(
            self,
            "num_actors",
            "batch_size",
            "calls_in_flight",
            "call_timeout_s",
            "call_timeout_factor",
            "min_call_timeout_s",
        )
        if self.compiled_graph and self.mode != "sync":
            yield "compiled_graph", "works in mode: sync only (async calls queue up on the actors)"
        yield from _non_negative(
            self, "max_staleness", "num_cpus", "num_gpus", "max_actor_restarts"
        )
        if self.one_actor_per_node_with is not None and not self.one_actor_per_node_with:
            yield "one_actor_per_node_with", "must be a resource name or null"
        for name, amount in self.resources.items():
            if not name:
                yield "resources", "resource names must be non-empty"
            elif name in ("CPU", "GPU"):
                yield f"resources.{name}", f"use population.num_{name.lower()}s for {name}s"
            elif not amount >= 0:
                yield f"resources.{name}", f"must be >= 0, got {amount!r}"
        if self.address is not None and not self.address.strip():
            yield "address", "must be non-empty or null"


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """The meta-training loop.

    Attributes:
      num_steps: learner (outer) updates.
      log_every: progress/console logging period, in learner steps.
      checkpoint_every: checkpoint period, in learner steps.
      keep_checkpoints: how many recent checkpoints to keep.
      summary_every: TensorBoard summary period, in learner steps.
    """

    num_steps: int = 20000
    log_every: int = 1000
    checkpoint_every: int = 2000
    keep_checkpoints: int = 3
    summary_every: int = 10

    def _problems(self) -> Iterator[_Problem]:
        yield from _positive(
            self, "num_steps", "log_every", "checkpoint_every", "keep_checkpoints", "summary_every"
        )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Meta-testing of a learned optimizer (``popmeta eval``, the end of a run, ``every``).

    Attributes:
      num_tasks: held-out inner problems per setting; the 95% intervals are over them.
      num_steps: inner steps of the trained-horizon setting; None means the
        longest trajectory of the truncation schedule (its ``max_length``).
      long_horizon_factors: a further setting for each factor, running
        ``factor * num_steps`` steps on the training task family (``[]``: none).
      each_training_family: with a mixture, the trained horizon and the long
        horizons run on every member (settings named ``<label>: ...``), not
        only on the task section's own kind.
      optax_cosine: a further setting at the trained horizon where the learned
        optimizer runs as exported (``popmeta.load_optimizer``), chained with
        an external cosine decay of its updates to 0 over the run.
      out_of_distribution: further settings, each a name and a ``task`` section
        (other architectures, other data), run at the trained horizon.
      seed: evaluation seed (separate from the training seed); baselines are
        tuned on tasks drawn from ``seed + 1``, disjoint from the test tasks.
      every: also evaluate the learned optimizer every this many learner steps
        while training, in the background, logged under ``eval/`` (0: never).
      after_training: compare the trained learned optimizer with the tuned
        baselines at the trained horizon when a run finishes.
      tuning: how each baseline's learning rate is chosen from the grid:
        ``full`` runs all 21 rates; ``coarse_to_fine`` runs every fourth
        (one per decade), then the six grid rates around the best of those:
        12 runs, the same choice wherever the tuning loss is unimodal over
        the grid.
    """

    num_tasks: int = 32
    num_steps: int | None = None
    long_horizon_factors: tuple[int, ...] = (5,)
    each_training_family: bool = False
    optax_cosine: bool = False
    out_of_distribution: dict[str, TaskConfig] = dataclasses.field(default_factory=dict)
    seed: int = 1234
    every: int = 0
    after_training: bool = True
    tuning: Literal["full", "coarse_to_fine"] = "coarse_to_fine"

    def _problems(self) -> Iterator[_Problem]:
        yield from _positive(self, "num_tasks", "num_steps")
        yield from _non_negative(self, "seed", "every")
        for i, factor in enumerate(self.long_horizon_factors):
            if not factor > 1:
                yield f"long_horizon_factors[{i}]", f"must be > 1, got {factor!r}"
        if self.num_tasks is not None and self.num_tasks < 2:
            yield "num_tasks", f"must be >= 2 for an interval over tasks, got {self.num_tasks!r}"
        for name, task in self.out_of_distribution.items():
            for field, message in task._problems():
                yield f"out_of_distribution.{name}.{field}", message
            if task.mixture:
                yield (
                    f"out_of_distribution.{name}.mixture",
                    "meta-testing runs on one family (its kind); remove mixture",
                )
            if task.rescaled:
                yield (
                    f"out_of_distribution.{name}.rescale_per_tensor",
                    "rescaling is a training augmentation; meta-testing runs the plain family",
                )


@dataclasses.dataclass(frozen=True)
class Config:
    """A complete, validated run configuration.

    Constructing it (directly, with ``dataclasses.replace`` or through
    :func:`load_config`) runs the range checks, the kinds' field checks and
    every rule; type checks of the sections' own fields happen when it is
    built from YAML or a dict.

    The defaults are the quickstart, the one source of them: ``popmeta train``
    with no config file runs it, and ``configs/quickstart.yaml`` spells the
    same values out for reading and copying (a test keeps the two equal).

    Attributes:
      name: run name; outputs go to ``<run_dir>/<name>/``.
      seed: root seed of the run.
      run_dir: parent directory of run outputs.
      task: see :class:`TaskConfig`.
      learned_optimizer: see :class:`LearnedOptimizerConfig`.
      truncation: see :class:`TruncationConfig`.
      estimator: see :class:`EstimatorConfig`.
      outer_optimizer: see :class:`OuterOptimizerConfig`.
      population: see :class:`PopulationConfig`.
      train: see :class:`TrainConfig`.
      eval: see :class:`EvalConfig`.
    """

    name: str = "quickstart"
    seed: int = 0
    run_dir: str = "runs"
    task: TaskConfig = dataclasses.field(default_factory=TaskConfig)
    learned_optimizer: LearnedOptimizerConfig = dataclasses.field(
        default_factory=LearnedOptimizerConfig
    )
    truncation: TruncationConfig = dataclasses.field(default_factory=TruncationConfig)
    estimator: EstimatorConfig = dataclasses.field(default_factory=EstimatorConfig)
    outer_optimizer: OuterOptimizerConfig = dataclasses.field(default_factory=OuterOptimizerConfig)
    population: PopulationConfig = dataclasses.field(default_factory=PopulationConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        problems = list(self._problems())
        if problems:
            raise ConfigError("; ".join(f"{name}: {message}" for name, message in problems))

    def kind_sections(self) -> list[tuple[str, KindSection]]:
        """``(dotted path, section)`` of every section that names a kind, nested ones too."""
        sections: list[tuple[str, KindSection]] = [("task", self.task)]
        sections += [(f"task.mixture.{k}", m.task) for k, m in self.task.mixture.items()]
        sections += [
            (f"eval.out_of_distribution.{k}", t) for k, t in self.eval.out_of_distribution.items()
        ]
        sections += [
            (name, getattr(self, name))
            for name in ("learned_optimizer", "truncation", "estimator", "outer_optimizer")
        ]
        return sections

    def found_modules(self) -> list[str]:
        """Files (or package directories) of the modules of user kinds that were found only
        in a directory of the search path (beside the config file), in order."""
        found = [s.resolved.found_in for _, s in self.kind_sections() if s.resolved is not None]
        return list(dict.fromkeys(f for f in found if f))

    def _problems(self) -> Iterator[_Problem]:
        if not self.name or "/" in self.name or "\\" in self.name or self.name in (".", ".."):
            yield (
                "name",
                f"must be a non-empty directory name without separators, got {self.name!r}",
            )
        elif not self.name.isprintable():
            yield "name", f"must not hold control characters (a NUL, a newline), got {self.name!r}"
        elif len(self.name.encode("utf-8", "surrogateescape")) > MAX_NAME_BYTES:
            yield (
                "name",
                f"is a directory name, at most {MAX_NAME_BYTES} bytes; got "
                f"{len(self.name.encode('utf-8', 'surrogateescape'))}",
            )
        if not self.run_dir:
            yield "run_dir", "must be non-empty"
        yield from _non_negative(self, "seed")
        problems = []
        for field in dataclasses.fields(self):
            section = getattr(self, field.name)
            if dataclasses.is_dataclass(section):
                for name, message in section._problems():
                    problems.append((f"{field.name}.{name}", message))
        yield from problems
        if not problems:  # rules read the sections, which must be whole for them
            yield from self._cross_field_problems()

    def _cross_field_problems(self) -> Iterator[_Problem]:
        """Rules that tie fields of different sections (names are absolute)."""
        for where, task in self.task.training_sections():
            yield from task.kind_rules(self, where)
        for name in ("learned_optimizer", "truncation", "estimator", "outer_optimizer"):
            yield from getattr(self, name).kind_rules(self, name)
        est, pop = self.estimator, self.population
        if len(self.task.mixture) > est.num_tasks:
            yield (
                "task.mixture",
                f"{len(self.task.mixture)} families need at least one task slot each, and "
                f"estimator.num_tasks is {est.num_tasks}; raise estimator.num_tasks or name "
                "fewer families",
            )
        defaults = PopulationConfig()
        if pop.engine == "local":
            for name in _RAY_ENGINE_FIELDS:
                value = getattr(pop, name)
                if value != getattr(defaults, name):
                    yield (
                        f"population.{name}",
                        f"the local engine runs every worker in the driver, one after another "
                        f"(sync), and would ignore it (got {value!r}); remove it or set "
                        "population.engine: ray",
                    )
        if pop.one_actor_per_node_with is not None and pop.num_actors != defaults.num_actors:
            yield (
                "population.num_actors",
                f"one_actor_per_node_with={pop.one_actor_per_node_with!r} starts one actor on "
                f"every node carrying that resource and would ignore num_actors="
                f"{pop.num_actors}; remove one of them",
            )


#: Population fields that only the Ray engine reads; the local engine refuses them.
_RAY_ENGINE_FIELDS = (
    "mode",
    "batch_size",
    "max_staleness",
    "calls_in_flight",
    "num_cpus",
    "num_gpus",
    "resources",
    "pin_cpus",
    "address",
    "one_actor_per_node_with",
    "env",
    "runtime_env",
    "call_timeout_s",
    "call_timeout_factor",
    "min_call_timeout_s",
    "max_actor_restarts",
    "compiled_graph",
)
