"""BERT as the same list of units as GPT: [embedding, attn_0, mlp_0, ..., attn_{L-1}, mlp_{L-1}, head].

Megatron's BERT is its pre-LayerNorm transformer with bidirectional attention over the padding mask, so the
attention and MLP units are GPT's (models/gpt.py, `causal` off). What differs:
  embedding  word + position + token-type (segment) embeddings (Megatron's `tokentype_embeddings`; none
             without the binary head, as in Megatron);
  head       the encoder's final LayerNorm, the masked-LM head (dense h->h, GeLU, LayerNorm, logits with the
             word embedding and an output bias) and, with the binary head, the pooler (dense + tanh on the first
             token) and the sentence-order classifier (h->2). It returns lm loss + sop loss, as Megatron's
             pretrain_bert loss_func.

The batch (data/bert_dataset.py `bert_batch`): tokens, types, padding_mask (bool, True on real tokens), labels,
loss_mask (masked-LM positions), sop_labels (1 where the segments were swapped) and loss_divisors: per sample the
masked tokens and the samples of the whole micro-batch. The head divides by those, so the loss of half a
micro-batch (AutoPipe slicing) is its exact share of the micro-batch's loss and the engine adds halves unweighted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.init import ParamInit, shard
from ..parallel.layers import parallel_lm_logits
from ..parallel.mappings import gather_from_sp, scatter_to_sp
from ..parallel.state import ParallelState
from .gpt import Embedding, Head, _norm

LOSS_NAMES = ("lm loss", "sop loss")


def _replicated(full: torch.Tensor, state: ParallelState, dtype: torch.dtype, sequence_parallel: bool = False):
    p = nn.Parameter(full.to(device=state.device, dtype=dtype))
    p.sequence_parallel = sequence_parallel  # gradient partial per sequence shard: summed over tp
    return p


class _Linear(nn.Module):
    """A dense layer every tensor-parallel rank holds whole."""

    def __init__(self, init: ParamInit, name: str, shape: tuple[int, int], state: ParallelState,
                 dtype: torch.dtype, sequence_parallel: bool = False) -> None:
        super().__init__()
        self.weight = _replicated(init.normal(f"{name}.weight", shape), state, dtype, sequence_parallel)
        self.bias = _replicated(init.zeros((shape[0],)), state, dtype, sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class BertEmbedding(Embedding):
    def __init__(self, cfg: ModelConfig, state: ParallelState, init: ParamInit) -> None:
        super().__init__(cfg, state, init)
        self.tokentype_embeddings = None
        if cfg.num_tokentypes:
            full = init.normal("embedding.tokentype_embeddings.weight", (cfg.num_tokentypes, cfg.hidden_size))
            self.tokentype_embeddings = nn.Parameter(full.to(state.device, cfg.torch_dtype))

    def compute(self, hidden, batch):
        tokens = batch["tokens"]
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.word_embeddings(tokens) + F.embedding(positions, self.position_embeddings).unsqueeze(0)
        if self.tokentype_embeddings is not None:
            x = x + F.embedding(batch["types"], self.tokentype_embeddings)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.state.sequence_parallel:
            x = scatter_to_sp(x, self.state.tp_group)
        return self._dropout(x, self.dropout)


class BertHead(Head):
    """Final LayerNorm, masked-LM head and (optionally) pooler + sentence-order head; returns the loss."""

    def __init__(self, cfg: ModelConfig, state: ParallelState, init: ParamInit,
                 word_embeddings: nn.Parameter | None) -> None:
        super().__init__(cfg, state, init, word_embeddings)
        h, dtype, sp = cfg.hidden_size, cfg.torch_dtype, state.sequence_parallel
        self.gelu_approximate = "tanh" if cfg.openai_gelu else "none"
        self.lm_dense = _Linear(init, "head.lm_dense", (h, h), state, dtype, sequence_parallel=sp)
        self.lm_layernorm = _norm(cfg, state)
        bias = shard(init.zeros((cfg.vocab_size,)), 0, state.tp_rank, state.tp_size)
        self.lm_bias = nn.Parameter(bias.to(device=state.device, dtype=dtype))
        self.lm_bias.tensor_model_parallel = state.tp_size > 1
        self.lm_bias.partition_dim = 0
        self.pooler = self.binary_head = None
        if cfg.bert_binary_head:
            self.pooler = _Linear(init, "head.pooler", (h, h), state, dtype)
            self.binary_head = _Linear(init, "head.binary_head", (2, h), state, dtype)
        self.reported: list[torch.Tensor] = []  # (lm loss, sop loss) of every forward, for the log

    def lm_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel masked-LM logits [s, b, v/tp] from the final LayerNorm's output."""
        y = F.gelu(self.lm_dense(x), approximate=self.gelu_approximate)
        return parallel_lm_logits(self.lm_layernorm(y), self.weight, self.state) + self.lm_bias

    def sop_logits(self, x: torch.Tensor) -> torch.Tensor:
        """Sentence-order logits [b, 2] from the first token of the final LayerNorm's output."""
        if self.state.sequence_parallel and self.state.tp_size > 1:  # the first token lives on tp rank 0
            first = gather_from_sp(x[:1], self.state.tp_group, tp_output_grad=False)[0].clone()
        else:
            first = x[0]
        return self.binary_head(torch.tanh(self.pooler(first)))

    def outputs(self, hidden, batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(masked-LM logits [s, b, v/tp], sentence-order logits [b, 2] or None)."""
        x = self.final_layernorm(hidden)
        return self.lm_logits(x), (self.sop_logits(x) if self.binary_head is not None else None)

    def compute(self, hidden, batch):
        lm_logits, sop_logits = self.outputs(hidden, batch)
        losses = self.token_losses(lm_logits, batch)
        mask = batch["loss_mask"].transpose(0, 1).float()
        divisors = batch["loss_divisors"][0].clone()  # (masked tokens, samples) of the whole micro-batch
        lm = (losses * mask).sum() / divisors[0]
        loss, sop = lm, torch.zeros((), device=lm.device)
        if sop_logits is not None:
            sop = F.cross_entropy(sop_logits.float(), batch["sop_labels"], reduction="sum") / divisors[1]
            loss = lm + sop
        self.reported.append(torch.stack([lm.detach(), sop.detach()]))
        return loss


def synthetic_batch(cfg: ModelConfig, batch_size: int, seed: int, pad: bool = True) -> dict[str, torch.Tensor]:
    """A random BERT micro-batch (for tests and the profiler): samples padded at the end (at least 3 real tokens;
    none padded with pad=False), two segments, ~15% of the real tokens predicted (always position 1)."""
    g = torch.Generator().manual_seed(seed)
    b, s = batch_size, cfg.seq_length
    tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    lengths = torch.randint(min(3, s), s + 1, (b,), generator=g) if pad else torch.full((b,), s)
    real = torch.arange(s)[None, :] < lengths[:, None]
    types = (torch.arange(s)[None, :] >= (lengths[:, None] // 2)).long() * real
    predict = (torch.rand(b, s, generator=g) < 0.15) & real
    predict[:, min(1, s - 1)] = True
    labels = torch.where(predict, torch.randint(0, cfg.vocab_size, (b, s), generator=g), torch.full((b, s), -1))
    mask = predict.float()
    return {"tokens": tokens * real, "types": types, "padding_mask": real, "labels": labels, "loss_mask": mask,
            "sop_labels": torch.randint(0, 2, (b,), generator=g), "loss_divisors": loss_divisors(mask)}


def loss_divisors(loss_mask: torch.Tensor) -> torch.Tensor:
    """[b, 2] float32: every row (masked tokens, samples) of the micro-batch `loss_mask` [b, s] belongs to."""
    b = loss_mask.size(0)
    row = torch.tensor([float(loss_mask.sum().clamp(min=1)), float(b)], device=loss_mask.device)
    return row.expand(b, 2).contiguous()


def drain_reported(chunks) -> torch.Tensor | None:
    """Sum of the (lm loss, sop loss) the BERT head of `chunks` recorded since the last call, then forgotten;
    None where this rank holds no BERT head."""
    for chunk in chunks:
        for unit in chunk.modules():
            if isinstance(unit, BertHead):
                reported, unit.reported = unit.reported, []
                return torch.stack(reported).sum(0) if reported else None
    return None
