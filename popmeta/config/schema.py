"""The typed run configuration: one frozen dataclass per section, and every rule.

A config is a tree of frozen dataclasses (:class:`Config` and one section class
per top-level key). Constructing one (directly, with ``dataclasses.replace``,
or through :mod:`popmeta.config.loading`) runs every check, and a failure
names the dotted field:

* ranges (positive sizes, ``std > 0``, ...);
* cross-field rules (an estimator that needs a schedule, a field the chosen
  engine would ignore, ...), naming every field involved.

The names a kind field accepts (``task.family``, ``estimator.kind``, ...) come
from the registries of :mod:`popmeta.registry`: a kind registered there is
accepted here and built by :mod:`popmeta.experiment`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal

from popmeta.registry import (
    DATA_FREE_TASK_FAMILIES,
    ESTIMATORS,
    LEARNED_OPTIMIZERS,
    OUTER_OPTIMIZERS,
    TASK_FAMILIES,
    TRUNCATION_SCHEDULES,
)

__all__ = [
    "Config",
    "ConfigError",
    "EstimatorConfig",
    "EvalConfig",
    "LearnedOptimizerConfig",
    "OuterOptimizerConfig",
    "PopulationConfig",
    "TaskConfig",
    "TrainConfig",
    "TruncationConfig",
]


class ConfigError(ValueError):
    """A config file or override is unreadable, unknown, mistyped or out of range."""


# Each kind field accepts exactly the names of its registry.
TaskFamilyName = Literal[TASK_FAMILIES.names]
LearnedOptimizerName = Literal[LEARNED_OPTIMIZERS.names]
TruncationScheduleName = Literal[TRUNCATION_SCHEDULES.names]
EstimatorName = Literal[ESTIMATORS.names]
OuterOptimizerName = Literal[OUTER_OPTIMIZERS.names]

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


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The inner problems the learned optimizer is trained on.

    Attributes:
      family: task family (``popmeta kinds`` lists them).
      dim: problem dimension of the quadratic families.
      npz_path: ``.npz`` file with ``images`` / ``labels``; required for
        ``image_mlp_npz`` and refused for every other family.
      families: a mixture to train on, ``{family: weight}``: each actor splits
        its ``estimator.num_tasks`` slots among the families in proportion to
        the weights (at least one slot each), so one actor trains on every
        family at once, and TensorBoard shows ``meta_loss_by_family/<family>``
        for each. Empty: train on ``family`` alone. When set, ``family`` must
        be one of them: it is the family meta-testing (``eval``) runs on.
      parametric_groups: architectures a parametric family
        (``parametric_image_mlp_digits``) trains at once, drawn from the run's
        ``seed``; each is a group of task slots with its own compile.
    """

    family: TaskFamilyName = "curved_quadratic"
    dim: int = 10
    npz_path: str | None = None
    families: dict[str, float] = dataclasses.field(default_factory=dict)
    parametric_groups: int = 3

    def _problems(self) -> Iterator[_Problem]:
        yield from _positive(self, "dim", "parametric_groups")
        for name, weight in self.families.items():
            if name not in TASK_FAMILIES:
                choices = ", ".join(repr(n) for n in TASK_FAMILIES.names)
                yield f"families.{name}", f"unknown task family; expected one of {choices}"
            elif not weight > 0:
                yield f"families.{name}", f"weight must be > 0, got {weight!r}"
        if self.families and self.family not in self.families:
            yield (
                "family",
                "with task.families set, task.family names the family that meta-testing "
                f"(eval) runs on and must be one of {sorted(self.families)}; got {self.family!r}",
            )
        trained = [family for _, family in self.named_families()]
        if "image_mlp_npz" in trained and not self.npz_path:
            yield "npz_path", "is required when task.family or task.families has 'image_mlp_npz'"
        if "image_mlp_npz" not in trained and self.npz_path is not None:
            yield (
                "npz_path",
                f"only the task family 'image_mlp_npz' reads it, and the task trains on "
                f"{', '.join(repr(f) for f in trained)}; remove task.npz_path",
            )

    def named_families(self) -> list[tuple[str, str]]:
        """``(field, family)`` for every family this section trains on."""
        if self.families:
            return [(f"task.families.{name}", name) for name in self.families]
        return [("task.family", self.family)]


@dataclasses.dataclass(frozen=True)
class LearnedOptimizerConfig:
    """The meta-learned optimizer (theta).

    Attributes:
      kind: learned optimizer architecture (``popmeta kinds`` lists them).
      initial_lr: initial learning rate of the learnable SGD/SGDM/Adam.
      initial_momentum: initial momentum of learnable SGDM/Adam, in [0, 1).
      step_multiplier: output step scale of the MLP optimizer.
      magnitude_multiplier: output magnitude scale of the MLP optimizer.
      hidden_size: hidden width of the MLP optimizer.
    """

    kind: LearnedOptimizerName = "mlp"
    initial_lr: float = 1e-3
    initial_momentum: float = 0.9
    step_multiplier: float = 0.001
    magnitude_multiplier: float = 0.001
    hidden_size: int = 32

    def _problems(self) -> Iterator[_Problem]:
        yield from _positive(
            self, "initial_lr", "step_multiplier", "magnitude_multiplier", "hidden_size"
        )
        if not 0.0 <= self.initial_momentum < 1.0:
            yield "initial_momentum", f"must be in [0, 1), got {self.initial_momentum!r}"


@dataclasses.dataclass(frozen=True)
class TruncationConfig:
    """How long each inner trajectory runs before it is reset.

    Attributes:
      schedule: ``constant`` (``length`` steps), ``log_uniform`` (length drawn
        log-uniformly in [min_length, max_length] per trajectory) or
        ``never_ending``.
      length: trajectory length of the constant schedule.
      min_length: lower bound of the log-uniform schedule.
      max_length: upper bound of the log-uniform schedule.
    """

    schedule: TruncationScheduleName = "constant"
    length: int = 100
    min_length: int = 10
    max_length: int = 100

    def _problems(self) -> Iterator[_Problem]:
        yield from _positive(self, "length", "min_length", "max_length")
        if self.max_length < self.min_length:
            yield (
                "max_length",
                f"must be >= truncation.min_length ({self.min_length}), got {self.max_length!r}",
            )


@dataclasses.dataclass(frozen=True)
class EstimatorConfig:
    """The gradient estimator each actor runs.

    Attributes:
      kind: estimator (``popmeta kinds`` lists them).
      trunc_length: inner steps per truncation (per estimate).
      std: perturbation standard deviation sigma.
      sign_delta_loss_scalar: if set, replace the antithetic loss difference
        by ``sign(delta) * scalar``.
      clip_loss_diff: if set, clip the antithetic loss difference to +-value.
      num_tasks: inner problems per actor, trained side by side.
      random_initial_iteration_offset: tasks start at random iterations in
        [0, offset) so they do not run in lockstep.
      truncations_per_call: consecutive truncations per worker call, run in one
        jitted call and averaged by their weights into one estimate; amortises
        the per-call cost (a Ray round trip) when a truncation takes about a
        millisecond. Throughput counts scale with it.
      meta_loss_split: ``train``: the per-step meta-loss is the normalized
        training loss before the inner update (the reference's default);
        ``outer_valid``: the updated parameters' normalized loss on a batch of
        the held-out outer-validation split (the reference's ``outer_valid``),
        which rewards generalisation rather than fitting the training batch.
        Data-free task families have no such split and refuse it.
    """

    kind: EstimatorName = "pes"
    trunc_length: int = 10
    std: float = 0.01
    sign_delta_loss_scalar: float | None = None
    clip_loss_diff: float | None = None
    num_tasks: int = 16
    random_initial_iteration_offset: int = 100
    truncations_per_call: int = 1
    meta_loss_split: Literal["train", "outer_valid"] = "train"

    def _problems(self) -> Iterator[_Problem]:
        yield from _positive(
            self,
            "trunc_length",
            "std",
            "sign_delta_loss_scalar",
            "clip_loss_diff",
            "num_tasks",
            "truncations_per_call",
        )
        yield from _non_negative(self, "random_initial_iteration_offset")


@dataclasses.dataclass(frozen=True)
class OuterOptimizerConfig:
    """The optax optimizer the learner applies to theta.

    Attributes:
      name: optimizer (``popmeta kinds`` lists them).
      learning_rate: meta learning rate.
      clip_grad_norm: global-norm clip of each aggregated estimate, or null.
      weight_decay: decoupled for adamw, L2 for the others.
    """

    name: OuterOptimizerName = "adam"
    learning_rate: float = 1e-2
    clip_grad_norm: float | None = 3.0
    weight_decay: float = 0.0

    def _problems(self) -> Iterator[_Problem]:
        yield from _positive(self, "learning_rate", "clip_grad_norm")
        yield from _non_negative(self, "weight_decay")


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
      env: environment variables for the actors (e.g. ``XLA_FLAGS``).
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
        trajectory length training used (``truncation.length``, or
        ``truncation.max_length`` for ``log_uniform``).
      long_horizon_factor: a second setting runs ``factor * num_steps`` steps on
        the training task family (0 leaves it out).
      out_of_distribution: further settings, each a name and a ``task`` section
        (other architectures, other data), run at the trained horizon.
      seed: evaluation seed (separate from the training seed); baselines are
        tuned on tasks drawn from ``seed + 1``, disjoint from the test tasks.
      every: also evaluate the learned optimizer every this many learner steps
        while training, in the background, logged under ``eval/`` (0: never).
      after_training: compare the trained learned optimizer with the tuned
        baselines at the trained horizon when a run finishes.
    """

    num_tasks: int = 32
    num_steps: int | None = None
    long_horizon_factor: int = 5
    out_of_distribution: dict[str, TaskConfig] = dataclasses.field(default_factory=dict)
    seed: int = 1234
    every: int = 0
    after_training: bool = True

    def _problems(self) -> Iterator[_Problem]:
        yield from _positive(self, "num_tasks", "num_steps")
        yield from _non_negative(self, "seed", "long_horizon_factor", "every")
        if self.num_tasks is not None and self.num_tasks < 2:
            yield "num_tasks", f"must be >= 2 for an interval over tasks, got {self.num_tasks!r}"
        for name, task in self.out_of_distribution.items():
            for field, message in task._problems():
                yield f"out_of_distribution.{name}.{field}", message
            if task.families:
                yield (
                    f"out_of_distribution.{name}.families",
                    "meta-testing runs on one family (its task.family); remove families",
                )


@dataclasses.dataclass(frozen=True)
class Config:
    """A complete, validated run configuration.

    Constructing it (directly, with ``dataclasses.replace`` or through
    :func:`load_config`) runs the range checks; type checks happen when it is
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
        for field in dataclasses.fields(self):
            section = getattr(self, field.name)
            if dataclasses.is_dataclass(section):
                for name, message in section._problems():
                    yield f"{field.name}.{name}", message
        yield from self._cross_field_problems()

    def _cross_field_problems(self) -> Iterator[_Problem]:
        """Rules that tie fields of different sections (names are absolute)."""
        est, pop = self.estimator, self.population
        if est.kind == "full_es" and self.truncation.schedule != "constant":
            yield (
                "estimator.kind",
                "'full_es' unrolls whole episodes of truncation.length steps and needs "
                f"truncation.schedule: constant, got truncation.schedule: "
                f"{self.truncation.schedule!r}",
            )
        if est.kind == "truncated_grad":
            for name in ("sign_delta_loss_scalar", "clip_loss_diff"):
                if getattr(est, name) is not None:
                    yield (
                        f"estimator.{name}",
                        "only the antithetic estimators use it, and estimator.kind is "
                        "'truncated_grad'; remove it",
                    )
        if len(self.task.families) > est.num_tasks:
            yield (
                "task.families",
                f"{len(self.task.families)} families need at least one task slot each, and "
                f"estimator.num_tasks is {est.num_tasks}; raise estimator.num_tasks or name "
                "fewer families",
            )
        if est.meta_loss_split == "outer_valid":
            for field, family in self.task.named_families():
                if family in DATA_FREE_TASK_FAMILIES:
                    yield (
                        "estimator.meta_loss_split",
                        f"'outer_valid' evaluates on held-out data, and {field} {family!r} is "
                        "data-free (no outer_valid split); use meta_loss_split: train or a "
                        "family with data",
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
    "call_timeout_s",
    "call_timeout_factor",
    "min_call_timeout_s",
    "max_actor_restarts",
    "compiled_graph",
)
