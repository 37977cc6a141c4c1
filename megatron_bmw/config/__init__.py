"""Configuration dataclasses: the one description of a run. Every field that a flag sets declares that flag
(`schema.flag`): the parser is generated from them (arguments.py), a plan file is read into them (planner/plan.py);
the library only sees these objects. No torch here: dtypes are names."""

from .data import DataConfig, parse_split
from .moe import MoEConfig
from .model import MODEL_TYPES, NORMALIZATIONS, POSITION_TYPES, ModelConfig, dtype_name, llama_features
from .optim import LR_DECAY_STYLES, LRConfig, OptimizerConfig
from .parallel import SCHEDULES, ZERO_BUBBLE, ParallelConfig, PipelineConfig
from .run import RunConfig, padded_vocab_size
from .training import BatchSchedule, TrainConfig

__all__ = ["BatchSchedule", "DataConfig", "LRConfig", "LR_DECAY_STYLES", "MODEL_TYPES", "ModelConfig", "MoEConfig", "NORMALIZATIONS",
           "OptimizerConfig", "POSITION_TYPES", "ParallelConfig", "PipelineConfig", "RunConfig", "SCHEDULES",
           "TrainConfig", "ZERO_BUBBLE", "dtype_name", "llama_features", "padded_vocab_size", "parse_split"]
