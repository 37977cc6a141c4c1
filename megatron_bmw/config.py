"""Configuration dataclasses. Flags are parsed once (arguments.py); the library only sees these."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import UsageError


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128  # padded vocabulary size
    seq_length: int = 32
    max_position_embeddings: int | None = None
    ffn_hidden_size: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = False
    attention_backend: str = "auto"  # auto | flash | unfused
    recompute_granularity: str | None = None  # None | full | selective
    recompute_method: str | None = None  # uniform | block (with full)
    recompute_num_layers: int | None = None
    params_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.hidden_size % self.num_attention_heads:
            raise UsageError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}"
            )
        if self.attention_backend not in ("auto", "flash", "unfused"):
            raise UsageError(f"--attention-backend must be auto, flash or unfused, not {self.attention_backend!r}")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise UsageError(f"--recompute-granularity must be full or selective, not {self.recompute_granularity!r}")
        if self.seq_length > self.max_position_embeddings:
            raise UsageError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}"
            )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_units(self) -> int:
        """embedding + (attention, mlp) per layer + head."""
        return 2 * self.num_layers + 2

    def check_tensor_parallel(self, tp: int) -> None:
        for name, value in (
            ("--num-attention-heads", self.num_attention_heads),
            ("--hidden-size", self.hidden_size),
            ("--ffn-hidden-size", self.ffn_hidden_size),
            ("padded vocabulary size", self.vocab_size),
        ):
            if value % tp:
                raise UsageError(f"--tensor-model-parallel-size {tp} does not divide {name} {value}")


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    rank_order: str = "tp-dp-pp"  # Megatron's; "bpipe" places pipeline pairs (s, p-1-s) side by side
    gpus_per_node: int | None = None

    def __post_init__(self) -> None:
        for name, value in (
            ("--tensor-model-parallel-size", self.tensor_model_parallel_size),
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
            ("--virtual-pipeline-model-parallel-size", self.virtual_pipeline_model_parallel_size),
        ):
            if value < 1:
                raise UsageError(f"{name} must be >= 1, got {value}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            self.sequence_parallel = False  # Megatron disables it for tp=1 as well

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % mp:
            raise UsageError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tensor_model_parallel_size} x --pipeline-model-parallel-size {self.pipeline_model_parallel_size}"
            )
        return world_size // mp
