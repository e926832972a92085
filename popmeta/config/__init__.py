"""The typed run configuration: schema and rules (:mod:`.schema`), reading (:mod:`.loading`).

Example::

    from popmeta.config import load_config

    cfg = load_config("configs/quickstart.yaml", ["estimator.std=0.02"])
    cfg.estimator.std  # 0.02
"""

from popmeta.config.loading import config_from_dict, config_to_dict, config_to_yaml, load_config
from popmeta.config.schema import (
    Config,
    ConfigError,
    EstimatorConfig,
    EvalConfig,
    LearnedOptimizerConfig,
    OuterOptimizerConfig,
    PopulationConfig,
    TaskConfig,
    TrainConfig,
    TruncationConfig,
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
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
]
