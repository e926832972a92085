"""The typed run configuration: values (:mod:`.values`), schema and rules (:mod:`.schema`),
reading (:mod:`.loading`).

Example::

    from popmeta.config import load_config

    cfg = load_config("configs/quickstart.yaml", ["estimator.std=0.02"])
    cfg.estimator.std  # 0.02
"""

from popmeta.config.loading import (
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    load_config,
    module_dirs,
    upgrade_recorded,
)
from popmeta.config.schema import (
    KIND_SECTIONS,
    Config,
    EstimatorConfig,
    EvalConfig,
    KindSection,
    LearnedOptimizerConfig,
    MixtureMember,
    OuterOptimizerConfig,
    PopulationConfig,
    TaskConfig,
    TrainConfig,
    TruncationConfig,
)
from popmeta.config.values import ConfigError

__all__ = [
    "KIND_SECTIONS",
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
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "module_dirs",
    "upgrade_recorded",
]
