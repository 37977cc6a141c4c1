"""A model as units: building them for a model type, and a chunk (a contiguous run of units: the whole model,
or what one pipeline rank holds of it). GPT and BERT share the transformer units (models/gpt.py) and differ in
their ends (BERT's embedding and heads, models/bert.py)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..parallel.context_parallel import chunk_positions, split_sequence
from ..parallel.init import ParamInit
from ..parallel.state import ParallelState
from ..units import unit_layer, unit_names
from .bert import BertEmbedding, BertHead
from .bert import synthetic_batch as bert_batch
from .gpt import MLP, Attention, Embedding, Head, Unit
from .moe import MoE

ENDS = {"gpt": (Embedding, Head), "bert": (BertEmbedding, BertHead)}  # model type -> (embedding, head) units


def synthetic_batch(model: ModelConfig, b: int, device, seed: int = 0, cp: tuple[int, int] = (1, 0)
                    ) -> dict[str, torch.Tensor]:
    """A micro-batch of `b` random samples for `model`'s units (profiling and counting them); `cp`: (cp size,
    cp rank) whose share of every sequence to keep."""
    if model.model_type == "bert":
        return {k: v.to(device) for k, v in bert_batch(model, b, seed, pad=False).items()}
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.vocab_size, (b, model.seq_length + 1), generator=g)
    batch = {"tokens": tokens[:, :-1].clone(), "labels": tokens[:, 1:].clone(),
             "loss_mask": torch.ones(b, model.seq_length)}
    return {k: v.to(device) for k, v in cp_shard(batch, *cp).items()}


def cp_shard(batch: dict[str, torch.Tensor], cp: int, cp_rank: int) -> dict[str, torch.Tensor]:
    """A GPT micro-batch ([b, s] tensors) as context-parallel rank `cp_rank` of `cp` holds it: its chunks of every
    sequence, their global `positions` ([b, s/cp]) and each sample's loss-token count over the whole sequence
    (`loss_tokens`, so the head divides by the count of the whole sequence). Unchanged when cp is 1."""
    if cp == 1:
        return batch
    b, s = batch["tokens"].shape
    out = {k: split_sequence(v, 1, cp, cp_rank) for k, v in batch.items()}
    out["positions"] = chunk_positions(s, cp, cp_rank).expand(b, -1).contiguous()
    out["loss_tokens"] = batch["loss_mask"].sum(dim=1)
    return out


def build_units(cfg: ModelConfig, state: ParallelState, seed: int, indices: list[int] | None = None,
                recompute: tuple[str | None, ...] | None = None, state_of=None) -> dict[str, Unit]:
    """Build the units with the given indices (all by default), in order, keyed by unit name.
    `recompute`: None, selective or full for every unit of the model (PipelineConfig.recompute).
    `state_of(i)`: the ParallelState unit i is built with (hybrid strategies), else `state` for all."""
    base = state
    cfg.check_tensor_parallel(state.tp_size)
    embedding_unit, head_unit = ENDS[cfg.model_type]
    names = unit_names(cfg.num_layers)
    indices = list(range(len(names))) if indices is None else sorted(indices)
    init = ParamInit(seed, cfg.init_method_std, cfg.num_layers)
    units: dict[str, Unit] = {}
    for i in indices:
        name = names[i]
        state = state_of(i) if state_of is not None else base
        if name == "embedding":
            unit = embedding_unit(cfg, state, init)
            if not cfg.untie_embeddings_and_output_weights and len(names) - 1 not in indices:
                unit.word_embeddings.weight.shared_embedding = True  # the head's copy is on another rank
        elif name == "head":
            emb = units.get("embedding")
            unit = head_unit(cfg, state, init, emb.word_embeddings.weight if emb is not None else None)
        elif name.startswith("attn_"):
            unit = Attention(cfg, state, init, name)
        elif cfg.moe_layer(unit_layer(name)):
            unit = MoE(cfg, state, init, name)
        else:
            unit = MLP(cfg, state, init, name)
        choice = recompute[i] if recompute is not None else None
        if choice == "selective" and isinstance(unit, Attention):
            unit.selective = True
        elif choice == "full":
            unit.recompute = "full"
        units[name] = unit
    return units


class ModelChunk(nn.Module):
    """A contiguous run of units (the whole model, or one pipeline chunk)."""

    def __init__(self, units: dict[str, Unit]) -> None:
        super().__init__()
        self.units = nn.ModuleDict(units)

    def forward(self, hidden, batch):
        for unit in self.units.values():
            hidden = unit(hidden, batch)
        return hidden
