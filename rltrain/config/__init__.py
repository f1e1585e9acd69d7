"""Typed, strict configuration: one dataclass per component, YAML recipes, dotted overrides."""

from rltrain.config.actor import ActorConfig, CriticConfig, RefConfig
from rltrain.config.algorithm import AlgorithmConfig, KLControlConfig
from rltrain.config.data import DataConfig, GeneratedTaskConfig
from rltrain.config.loader import dump_yaml
from rltrain.config.model import ModelConfig, TinyModelConfig
from rltrain.config.optim import OptimConfig
from rltrain.config.parallel import ParallelConfig
from rltrain.config.recipe import ConfigError
from rltrain.config.reward import RewardConfig
from rltrain.config.rl import RLConfig, load_config, write_resolved
from rltrain.config.rollout import RolloutConfig, ValKwargs, WeightSyncConfig
from rltrain.config.trainer import CheckpointConfig, ClusterConfig, TrainerConfig

__all__ = [
    "ActorConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ClusterConfig",
    "ConfigError",
    "CriticConfig",
    "DataConfig",
    "GeneratedTaskConfig",
    "KLControlConfig",
    "ModelConfig",
    "OptimConfig",
    "ParallelConfig",
    "RLConfig",
    "RefConfig",
    "RewardConfig",
    "RolloutConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "ValKwargs",
    "WeightSyncConfig",
    "dump_yaml",
    "load_config",
    "write_resolved",
]
