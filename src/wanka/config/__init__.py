from wanka.config.loader import ConfigError, dump_toml, load_config
from wanka.config.schema import (
    CheckpointConfig,
    DataConfig,
    JobConfig,
    ModelConfig,
    ParallelConfig,
    ResilienceConfig,
    RunConfig,
    TrainConfig,
)

__all__ = [
    "CheckpointConfig", "ConfigError", "DataConfig", "JobConfig", "ModelConfig",
    "ParallelConfig", "ResilienceConfig", "RunConfig", "TrainConfig", "dump_toml", "load_config",
]  # fmt: skip
