"""Shared helpers for BERT tests: a small BERT config, random BERT batches, the serial reference."""

from __future__ import annotations

import torch

from megatron_bmw.config import ModelConfig
from megatron_bmw.models.bert import loss_divisors, synthetic_batch
from tests.reference import RECOMPUTE_FLAGS


def bert_config(**overrides) -> ModelConfig:
    kw = dict(model_type="bert", num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
              hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")
    kw.update({k: v for k, v in overrides.items() if k not in RECOMPUTE_FLAGS and not k.startswith("_")})
    return ModelConfig(**kw)


def split_micro(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batches of a batch, each with its own loss divisors."""
    chunks = {k: v.chunk(parts, 0) for k, v in batch.items()}
    out = []
    for i in range(parts):
        mb = {k: chunks[k][i].clone() for k in batch}
        mb["loss_divisors"] = loss_divisors(mb["loss_mask"])
        out.append(mb)
    return out


def bert_batch(cfg: ModelConfig, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    return synthetic_batch(cfg, batch_size, seed)


