"""Configuration: sections, loading, validation."""

from colonnade.config.load import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_toml,
    field_docs,
    load_config,
    parse_overrides,
)
from colonnade.config.sections import (
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    TrainingConfig,
)
from colonnade.config.validate import problems, resolve, validate

__all__ = [
    "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LoggingConfig",
    "ModelConfig", "OptimConfig", "ParallelConfig", "TrainingConfig", "config_from_dict",
    "config_to_dict", "config_to_toml", "field_docs", "load_config", "parse_overrides",
    "problems", "resolve", "validate",
]
