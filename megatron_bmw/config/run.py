"""One run: every config part, and the vocabulary padding rule."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import UsageError
from .schema import flag

from .data import DataConfig
from .model import ModelConfig
from .optim import LRConfig, OptimizerConfig
from .parallel import ParallelConfig, PipelineConfig
from .training import TrainConfig


@dataclass
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    pipeline: PipelineConfig
    train: TrainConfig
    optimizer: OptimizerConfig
    lr: LRConfig
    data: DataConfig
    orig_vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = flag(  # the padding multiple (x tp) behind model.vocab_size
        "--make-vocab-size-divisible-by", group="model", default=None, cli_default=128, minimum=1)


def padded_vocab_size(orig_vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: the vocabulary rounded up to a multiple of make_vocab_size_divisible_by x tp. The one
    padding rule (the model, the planner, the plan file, the converters and the tokenizers use it)."""
    if divisible_by < 1:
        raise UsageError(f"--make-vocab-size-divisible-by must be >= 1, got {divisible_by}")
    multiple = divisible_by * tp
    return -(-orig_vocab_size // multiple) * multiple
