"""Typed configuration schemas. Imports neither torch nor megatron, so recipes load anywhere."""

from megatron_fr.config.algo import FlashReinforceConfig
from megatron_fr.config.buffer import BufferConfig
from megatron_fr.config.learner import LearnerConfig
from megatron_fr.config.parallel import ParallelConfig
from megatron_fr.config.weights import WeightSyncConfig

__all__ = [
    "BufferConfig",
    "FlashReinforceConfig",
    "LearnerConfig",
    "ParallelConfig",
    "WeightSyncConfig",
]
