"""The typed run configuration: values (:mod:`.values`), sections (:mod:`.kind_sections`,
:mod:`.sections`), the whole config and its rules (:mod:`.schema`), reading
(:mod:`.loading`, :mod:`.reading`, :mod:`.overrides`, :mod:`.renamed`).

Example::

    from popmeta.config import load_config

    cfg = load_config("configs/quickstart.yaml", ["estimator.std=0.02"])
    cfg.estimator.std  # 0.02
"""

from popmeta.config.kind_sections import (
    KIND_SECTIONS,
    EstimatorConfig,
    KindSection,
    LearnedOptimizerConfig,
    MixtureMember,
    OuterOptimizerConfig,
    TaskConfig,
    TruncationConfig,
)
from popmeta.config.loading import (
    config_fields,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    load_config,
    module_dirs,
)
from popmeta.config.renamed import upgrade_recorded
from popmeta.config.schema import Config
from popmeta.config.sections import EvalConfig, PopulationConfig, TrainConfig
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
    "config_fields",
    "config_from_dict",
    "config_to_dict",
    "config_to_yaml",
    "load_config",
    "module_dirs",
    "upgrade_recorded",
]
