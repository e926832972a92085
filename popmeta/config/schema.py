"""The whole run configuration (:class:`Config`) and the rules that tie its sections together.

A config is a tree of frozen dataclasses, one per top-level key
(:mod:`popmeta.config.kind_sections`, :mod:`popmeta.config.sections`).
Constructing one (directly, with ``dataclasses.replace``, or through
:mod:`popmeta.config.loading`) runs every check, and a failure names the
dotted field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from popmeta.config.kind_sections import (
    EstimatorConfig,
    KindSection,
    LearnedOptimizerConfig,
    OuterOptimizerConfig,
    TaskConfig,
    TruncationConfig,
)
from popmeta.config.sections import EvalConfig, PopulationConfig, TrainConfig
from popmeta.config.values import ConfigError, Problem, non_negative

__all__ = ["MAX_NAME_BYTES", "Config"]

#: The longest file name most file systems take (NAME_MAX): a run's directory name.
MAX_NAME_BYTES = 255


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

    def with_truncations_per_call(self, num_truncations: int) -> Config:
        """This config with ``estimator.truncations_per_call`` set (``auto`` resolved)."""
        estimator = dataclasses.replace(self.estimator, truncations_per_call=num_truncations)
        return dataclasses.replace(self, estimator=estimator)

    def found_modules(self) -> list[str]:
        """Files (or package directories) of the modules of user kinds that were found only
        in a directory of the search path (beside the config file), in order."""
        found = [s.resolved.found_in for _, s in self.kind_sections() if s.resolved is not None]
        return list(dict.fromkeys(f for f in found if f))

    def _problems(self) -> Iterator[Problem]:
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
        yield from non_negative(self, "seed")
        problems = []
        for field in dataclasses.fields(self):
            section = getattr(self, field.name)
            if dataclasses.is_dataclass(section):
                for name, message in section._problems():
                    problems.append((f"{field.name}.{name}", message))
        yield from problems
        if not problems:  # rules read the sections, which must be whole for them
            yield from self._cross_field_problems()

    def _cross_field_problems(self) -> Iterator[Problem]:
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
        if pop.cpu_devices is not None and est.num_tasks % pop.cpu_devices:
            yield (
                "population.cpu_devices",
                f"the tasks are split evenly over the devices: estimator.num_tasks "
                f"({est.num_tasks}) must be a multiple of cpu_devices ({pop.cpu_devices})",
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
