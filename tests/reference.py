"""Shared helpers for equivalence tests: a small GPT config, deterministic batches, serial reference grads."""

from __future__ import annotations

import torch

from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.pipeline.partition import parse_partition, rank_chunks
from megatron_bmw.units import recompute_from_flags

SEED = 1234
LLAMA = dict(position_embedding_type="rope", swiglu=True, num_query_groups=2, normalization="RMSNorm",
             add_bias_linear=False, untie_embeddings_and_output_weights=True, ffn_hidden_size=48, rotary_percent=0.5)
QK_1P = dict(qk_layernorm=True, apply_layernorm_1p=True)  # --qk-layernorm --apply-layernorm-1p
RECOMPUTE_FLAGS = ("recompute_granularity", "recompute_method", "recompute_num_layers")


def small_config(**overrides) -> ModelConfig:
    """A small GPT; Megatron's recomputation flags among `overrides` are left for `recompute_of`. LLAMA: the
    Llama-family layers (rope, SwiGLU, grouped-query attention, RMSNorm, no biases, untied output)."""
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
              hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")
    kw.update({k: v for k, v in overrides.items() if k not in RECOMPUTE_FLAGS})
    return ModelConfig(**kw)


def recompute_of(overrides: dict, num_layers: int, partition=None, pp: int = 1, virtual: int = 1):
    """The per-unit recomputation Megatron's flags among `overrides` mean (block: per pipeline rank)."""
    parts = parse_partition(partition, num_layers, pp, virtual)
    ranks = [[i for c in rank_chunks(parts, pp, r) for i in c] for r in range(pp)]
    return recompute_from_flags(overrides.get("recompute_granularity"), overrides.get("recompute_method"),
                                overrides.get("recompute_num_layers"), num_layers, ranks)


def pipeline_of(cfg: ModelConfig, overrides: dict, mbs: int, m: int, pp: int, v: int = 1, schedule: str = "1f1b",
                partition=None, **kw) -> PipelineConfig:
    """PipelineConfig for a test case: the recomputation flags of `overrides` resolved, or its explicit per-unit
    list `_recompute`."""
    recompute = overrides.get("_recompute") or recompute_of(overrides, cfg.num_layers, partition, pp, v)
    return PipelineConfig(micro_batch_size=mbs, num_microbatches=m, schedule=schedule, virtual_stages=v,
                          partition=partition if partition is None else tuple(parse_partition(partition, cfg.num_layers,
                                                                                               pp, v)),
                          recompute=recompute, **kw)


def make_batch(cfg: ModelConfig, batch_size: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_length + 1), generator=g)
    mask = (torch.rand(batch_size, cfg.seq_length, generator=g) > 0.1).float()
    return {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(), "loss_mask": mask}


def split_batch(batch: dict[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    chunks = {k: v.chunk(parts, 0) for k, v in batch.items()}
    return [{k: chunks[k][i] for k in batch} for i in range(parts)]


def serial_reference(cfg: ModelConfig, microbatches: list[dict[str, torch.Tensor]]):
    """Mean loss over micro-batches and the gradients of every parameter, by name, on one process."""
    state = ParallelState.serial()
    state.aux_loss_scale = 1.0 / len(microbatches)  # MoE auxiliary losses scale as the loss (models/moe.py)
    model = ModelChunk(build_units(cfg, state, SEED))
    total = 0.0
    for mb in microbatches:
        loss = model(None, mb) / len(microbatches)
        loss.backward()
        total += loss.item()
    return total, {n: p.grad.clone() for n, p in model.named_parameters()}, model


def head_logits(model: ModelChunk, tokens: torch.Tensor) -> torch.Tensor:
    """The (vocab-parallel) logits [s, b, v/tp] of a whole model in eval mode, unit by unit."""
    model.eval()
    hidden, batch = None, {"tokens": tokens}
    with torch.no_grad():
        for name, unit in model.units.items():
            if name == "head":
                return unit.logits(hidden)
            hidden = unit(hidden, batch)
    raise AssertionError("no head unit")


def reference_name(name: str, cfg: ModelConfig) -> str:
    """The serial model's name of a (possibly pipeline-copied) parameter."""
    if name.endswith("head.output_weight") and not cfg.untie_embeddings_and_output_weights:
        return "units.embedding.word_embeddings.weight"
    return name


def expected_shard(full: torch.Tensor, param, state: ParallelState) -> torch.Tensor:
    """This rank's part of a serial tensor, as its parameter is split (partition_stride: SwiGLU's [gate; up]);
    an expert parameter's: its ep rank's experts (expert_dim), split over etp."""
    if getattr(param, "expert_parallel", False):
        full = full.chunk(state.ep_size, dim=param.expert_dim)[state.ep_rank]
        return tp_shard(full, param, state.etp_size, state.etp_rank)
    return tp_shard(full, param, state.tp_size, state.tp_rank)


def tp_shard(full: torch.Tensor, param, tp: int, tp_rank: int) -> torch.Tensor:
    """Tensor-parallel rank `tp_rank`'s part of a serial tensor over `tp` ranks, as `param` is split."""
    dim = getattr(param, "partition_dim", None)
    if dim is None or not getattr(param, "tensor_model_parallel", False):
        return full
    blocks = full.chunk(getattr(param, "partition_stride", 1), dim=dim)
    return torch.cat([b.chunk(tp, dim=dim)[tp_rank] for b in blocks], dim=dim)
