"""GPT as a list of units: [embedding, attn_0, mlp_0, ..., attn_{L-1}, mlp_{L-1}, head].

Between any two units flows the hidden state [seq, batch, hidden] (seq/tp with sequence parallelism), so a
pipeline stage may end after any unit. Every unit has the signature `unit(hidden, batch) -> hidden`; the
embedding ignores `hidden` and reads batch["tokens"], the head returns the micro-batch's mean loss. With context
parallelism (--context-parallel-size C) a rank holds s/C rows of every sequence (models/chunk.py cp_shard: its
global batch["positions"]); attention crosses the cp group (parallel/context_parallel.py), the rest is per row.
A BERT (cfg.model_type "bert", models/bert.py) reuses Attention and MLP, attending over the batch's padding
mask instead of causally, with its own embedding and head.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..fused import layer_norm, sdpa_backends
from ..parallel.context_parallel import context_attention
from ..parallel.cross_entropy import vocab_parallel_cross_entropy
from ..parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from ..parallel.init import ParamInit
from ..parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, parallel_lm_logits
from ..parallel.mappings import scatter_to_sp
from ..parallel.recompute import checkpoint
from ..parallel.state import ParallelState
from .fused_ops import rope, swiglu
from .rotary import apply_rotary, rotary_angles
from .softmax import causal_softmax, padding_softmax

WORD_EMBEDDING = "embedding.word_embeddings.weight"


class ZeroCenteredNorm(nn.Module):
    """LayerNorm or RMSNorm whose weight holds gamma - 1 (Megatron's --apply-layernorm-1p): zeros at
    initialisation, applied as weight + 1."""

    def __init__(self, size: int, eps: float, rms: bool, device, dtype) -> None:
        super().__init__()
        self.eps, self.rms = eps, rms
        self.weight = nn.Parameter(torch.zeros(size, device=device, dtype=dtype))
        self.bias = None if rms else nn.Parameter(torch.zeros(size, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = (self.weight.numel(),)
        if self.rms:
            return F.rms_norm(x, shape, self.weight + 1, self.eps)
        return F.layer_norm(x, shape, self.weight + 1, self.bias, self.eps)


def _norm(cfg: ModelConfig, state: ParallelState, size: int | None = None, tp_partial: bool = False) -> nn.Module:
    """The model's normalisation over `size` (default the hidden size). Its gradient is partial per tp rank with
    sequence parallelism, or always when `tp_partial` (queries and keys: each rank normalises its own heads)."""
    size = size or cfg.hidden_size
    if cfg.apply_layernorm_1p:
        ln = ZeroCenteredNorm(size, cfg.layernorm_epsilon, cfg.normalization == "RMSNorm", state.device,
                              cfg.torch_dtype)
    elif cfg.normalization == "RMSNorm":
        ln = nn.RMSNorm(size, eps=cfg.layernorm_epsilon, device=state.device, dtype=cfg.torch_dtype)
    else:
        ln = layer_norm(size, cfg.layernorm_epsilon, state.device, cfg.torch_dtype)
    for p in ln.parameters():
        p.sequence_parallel = state.sequence_parallel or (tp_partial and state.tp_size > 1)
    return ln


class Unit(nn.Module):
    """Base: applies full recomputation around `compute` when `self.recompute == "full"`."""

    recompute: str | None = None

    def __init__(self, state: ParallelState) -> None:
        super().__init__()
        self.state = state

    def forward(self, hidden, batch):
        if self.recompute == "full" and self.training and torch.is_grad_enabled():
            return checkpoint(self.compute, self.state.rng, hidden, batch)
        return self.compute(hidden, batch)

    def compute(self, hidden, batch):
        raise NotImplementedError

    def _dropout(self, x: torch.Tensor, p: float) -> torch.Tensor:
        if not self.training or p == 0.0:
            return x
        if self.state.sequence_parallel:  # each tp rank holds a different part of the sequence
            with self.state.rng.fork():
                return F.dropout(x, p, True)
        return F.dropout(x, p, True)


class Embedding(Unit):
    def __init__(self, cfg: ModelConfig, state: ParallelState, init: ParamInit) -> None:
        super().__init__(state)
        h = cfg.hidden_size
        self.dropout = cfg.hidden_dropout
        self.word_embeddings = VocabParallelEmbedding(init.normal(WORD_EMBEDDING, (cfg.vocab_size, h)), state,
                                                      cfg.torch_dtype)
        self.word_embeddings.weight.embedding_or_output = True  # --decoupled-lr's parameters (and the output's)
        self.position_embeddings = None  # rope rotates queries and keys in attention instead; none has nothing
        if cfg.position_embedding_type == "learned_absolute":
            full = init.normal("embedding.position_embeddings.weight", (cfg.max_position_embeddings, h))
            self.position_embeddings = nn.Parameter(full.to(state.device, cfg.torch_dtype))

    def compute(self, hidden, batch):
        tokens = batch["tokens"]
        x = self.word_embeddings(tokens)
        if self.position_embeddings is not None:
            # a context-parallel rank's global positions: one row's own copy (the lookup keeps its indices)
            positions = batch["positions"][0].clone() if "positions" in batch else torch.arange(tokens.size(1),
                                                                                                 device=tokens.device)
            x = x + F.embedding(positions, self.position_embeddings).unsqueeze(0)
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.state.sequence_parallel:
            x = scatter_to_sp(x, self.state.tp_group)
        return self._dropout(x, self.dropout)


class Attention(Unit):
    """Pre-norm self-attention with a fused QKV projection and the residual add: causal (GPT), or over the
    keys batch["padding_mask"] marks as real tokens (BERT). Grouped-query attention shares a key and a value head
    among the query heads of a group; rope rotates queries and keys by position (models/rotary.py; fused_ops.rope
    unless --no-rope-fusion); with qk_layernorm every query and key head is normalised over the head dimension
    first (q_layernorm, k_layernorm)."""

    def __init__(self, cfg: ModelConfig, state: ParallelState, init: ParamInit, name: str) -> None:
        super().__init__(state)
        h, d = cfg.hidden_size, cfg.head_dim
        self.heads = cfg.num_attention_heads // state.tp_size
        self.groups = cfg.query_groups // state.tp_size
        self.head_dim = d
        self.rotary = (cfg.rotary_dim, cfg.rotary_base, cfg.rotary_seq_len_interpolation_factor) \
            if cfg.position_embedding_type == "rope" else None
        self.rope = rope if cfg.apply_rope_fusion else apply_rotary  # the fused op saves only the angles
        self.dropout, self.attention_dropout = cfg.hidden_dropout, cfg.attention_dropout
        self.flash = cfg.flash_attention
        self.cudnn_first = cfg.attention_backend == "fused"
        self.selective = False
        self.causal = cfg.model_type != "bert"
        self.residual_post_ln = cfg.apply_residual_connection_post_layernorm
        self.input_layernorm = _norm(cfg, state)
        self.q_layernorm = _norm(cfg, state, d, tp_partial=True) if cfg.qk_layernorm else None
        self.k_layernorm = _norm(cfg, state, d, tp_partial=True) if cfg.qk_layernorm else None
        # QKV rows are laid out per query group as [group, (its q heads | k | v), head_dim] (Megatron's order; per
        # head [head, (q|k|v), head_dim] without groups), so a contiguous tp shard holds whole groups.
        rows = cfg.qkv_rows
        qkv_bias = init.zeros((rows,)) if cfg.add_bias_linear or cfg.add_qkv_bias else None
        self.qkv = ColumnParallelLinear(init.normal(f"{name}.qkv.weight", (rows, h)), qkv_bias, state,
                                        dtype=cfg.torch_dtype)
        self.proj = RowParallelLinear(init.normal(f"{name}.proj.weight", (h, h), init.output_std),
                                      init.zeros((h,)) if cfg.add_bias_linear else None, state, dtype=cfg.torch_dtype)

    def compute(self, hidden, batch):
        x = self.input_layernorm(hidden)
        qkv = self.qkv(x)
        s, b = qkv.shape[:2]
        per = self.heads // self.groups  # query heads per group
        qkv = qkv.view(s, b, self.groups, per + 2, self.head_dim)
        q = qkv[:, :, :, :per].reshape(s, b, self.heads, self.head_dim).permute(1, 2, 0, 3)  # [b, n, s, d]
        k, v = (qkv[:, :, :, per + i].permute(1, 2, 0, 3) for i in (0, 1))  # [b, groups, s, d]
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        positions = batch["positions"][0] if "positions" in batch else None  # a context-parallel rank's rows
        if self.rotary is not None:
            angles = rotary_angles(s, *self.rotary, q.device, positions)
            q, k = self.rope(q, angles), self.rope(k, angles)
        if positions is not None:  # the cp core takes grouped k and v (positions: the batch's, never saved)
            core, args = partial(self.cp_attention, positions=positions), (q, k, v)
        else:
            if per > 1:
                k, v = k.repeat_interleave(per, dim=1), v.repeat_interleave(per, dim=1)
            keep = None if self.causal else batch["padding_mask"].bool()[:, None, None, :]  # keys to attend to
            core, args = self.core_attention, (q, k, v, keep)
        if self.selective and self.training and torch.is_grad_enabled():
            ctx = checkpoint(core, self.state.rng, *args)
        else:
            ctx = core(*args)
        ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)
        return (x if self.residual_post_ln else hidden) + self._dropout(self.proj(ctx), self.dropout)

    def cp_attention(self, q, k, v, positions):
        """Causal attention of this rank's rows over the whole sequence, across the context-parallel group."""
        st = self.state
        return context_attention(q, k, v, positions, st.cp_group, st.cp_ranks, 1.0 / math.sqrt(self.head_dim),
                                 st.cp_comm_type)

    def core_attention(self, q, k, v, keep=None):
        p = self.attention_dropout if self.training else 0.0
        with self.state.rng.fork():
            if self.flash:
                with sdpa_backends(self.cudnn_first):
                    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p, is_causal=keep is None)
            scores, scale = torch.matmul(q, k.transpose(-1, -2)), 1.0 / math.sqrt(self.head_dim)
            probs = causal_softmax(scores, scale) if keep is None else padding_softmax(scores, scale, keep)
            if p > 0.0:
                probs = F.dropout(probs, p, True)
            return torch.matmul(probs, v)


def squared_relu(z: torch.Tensor) -> torch.Tensor:
    """relu(z)^2 (Megatron-LM's --squared-relu): relu keeps its output, the square its input (the same tensor)."""
    return torch.square(F.relu(z))


def mlp_activation(z: torch.Tensor, gated: bool, squared: bool = False, fused: bool = True,
                   compiled: bool = True) -> torch.Tensor:
    """An MLP's activation of fc1's output (the dense MLP's and the experts'): SwiGLU (`gated`; fused_ops.swiglu
    where `fused`, its bodies compiled on CUDA where `compiled`: shapes fixed from step to step), squared ReLU or
    tanh-GeLU."""
    if gated and fused:
        return swiglu(z, compiled)
    if gated:
        gate, up = z.chunk(2, dim=-1)
        return F.silu(gate) * up
    if squared:
        return squared_relu(z)
    return F.gelu(z, approximate="tanh")


class MLP(Unit):
    """Pre-norm MLP (fc1, tanh-GeLU, squared ReLU or SwiGLU, fc2) with the residual add. SwiGLU's fc1 holds
    [gate; up], each split over tp (so a rank holds its part of both: stride 2); fused (fused_ops.swiglu) unless
    --no-bias-swiglu-fusion."""

    def __init__(self, cfg: ModelConfig, state: ParallelState, init: ParamInit, name: str) -> None:
        super().__init__(state)
        h, f, rows = cfg.hidden_size, cfg.ffn_hidden_size, cfg.fc1_rows
        self.dropout = cfg.hidden_dropout
        self.swiglu, self.squared_relu = cfg.swiglu, cfg.squared_relu
        self.fused_swiglu = cfg.bias_swiglu_fusion  # saves fc1's output only (fused_ops.py)
        self.residual_post_ln = cfg.apply_residual_connection_post_layernorm
        self.post_attention_layernorm = _norm(cfg, state)
        bias = cfg.add_bias_linear
        self.fc1 = ColumnParallelLinear(init.normal(f"{name}.fc1.weight", (rows, h)),
                                        init.zeros((rows,)) if bias else None, state, dtype=cfg.torch_dtype,
                                        stride=2 if cfg.swiglu else 1)
        self.fc2 = RowParallelLinear(init.normal(f"{name}.fc2.weight", (h, f), init.output_std),
                                     init.zeros((h,)) if bias else None, state, dtype=cfg.torch_dtype)

    def compute(self, hidden, batch):
        x = self.post_attention_layernorm(hidden)
        y = self.fc2(mlp_activation(self.fc1(x), self.swiglu, self.squared_relu, self.fused_swiglu))
        return (x if self.residual_post_ln else hidden) + self._dropout(y, self.dropout)


class Head(Unit):
    """Final LayerNorm, output layer (tied to the word embedding unless untied) and the vocab-parallel loss."""

    def __init__(self, cfg: ModelConfig, state: ParallelState, init: ParamInit,
                 word_embeddings: nn.Parameter | None) -> None:
        super().__init__(state)
        self.final_layernorm = _norm(cfg, state)
        self.cross_entropy_loss_fusion = cfg.cross_entropy_loss_fusion
        self.tied = not cfg.untie_embeddings_and_output_weights
        if self.tied and word_embeddings is not None:
            self._shared = [word_embeddings]  # same rank as the embedding: share the Parameter itself
            self.output_weight = None
        else:
            name = WORD_EMBEDDING if self.tied else "head.output_layer.weight"
            full = init.normal(name, (cfg.vocab_size, cfg.hidden_size))
            self.output_weight = VocabParallelEmbedding(full, state, cfg.torch_dtype).weight
            self.output_weight.embedding_or_output = True
            self.output_weight.wgrad_fusable = True  # the logits are its only use on this rank
            if self.tied:  # a copy on the last pipeline stage, kept equal by the embedding-group all-reduce
                self.output_weight.shared_embedding = True
                self.output_weight.shared_embedding_copy = True

    @property
    def weight(self) -> torch.Tensor:
        return self.output_weight if self.output_weight is not None else self._shared[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel logits [s, b, v/tp]."""
        return parallel_lm_logits(self.final_layernorm(hidden), self.weight, self.state)

    def token_losses(self, logits: torch.Tensor, batch) -> torch.Tensor:
        """Per-token loss [s, b] of the vocab-parallel logits (--cross-entropy-loss-fusion: the fused loss, which
        overwrites `logits` with their gradient in the backward)."""
        loss = fused_vocab_parallel_cross_entropy if self.cross_entropy_loss_fusion else vocab_parallel_cross_entropy
        return loss(logits, batch["labels"].transpose(0, 1), self.state)

    def compute(self, hidden, batch):
        losses = self.token_losses(self.logits(hidden), batch)
        mask = batch["loss_mask"].transpose(0, 1).float()
        if "loss_tokens" in batch:  # context parallel: this rank's share of the whole sequences' mean, times cp
            # (gradients are averaged over dp x cp; Megatron's scaling)
            return (losses * mask).sum() * self.state.cp_size / batch["loss_tokens"].sum().clamp(min=1.0)
        if "sample_weights" in batch:  # hybrid strategies: this shard's share of the loss (parallel/hybrid.py)
            return (losses * mask * batch["sample_weights"].unsqueeze(0)).sum()
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)
