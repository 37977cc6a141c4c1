"""The MoE unit: layer i's MLP slot (`mlp_i`) where `ModelConfig.moe_layer(i)` (docs/moe.md).

hidden -> post_attention_layernorm -> router (fp32 logits, scores, top-k, capacity) -> the dispatcher
(parallel/moe_dispatch.py) -> this rank's experts (models/moe_experts.py) -> weighted sum per token, plus the shared
experts (gated), plus the residual. Same hidden state in and out as the dense MLP unit.

The router's tokens: with tensor parallelism the tp ranks take different tokens (sequence parallelism's rows;
without it each tp rank routes its 1/tp of the rows, and the output is gathered again), so the router's gradient
is partial over tp (`sequence_parallel`). The *sequence group* is the tp x cp ranks holding one dp rank's
micro-batch. Over it, as Megatron over its tp x cp group: the load-balancing counts (aux_loss, seq_aux_loss) and
the z-loss's mean; and here also Sinkhorn's normalisation and the expert capacity, so that every layout drops the
tokens the serial model drops. Capacity is ceil(T * k / E * factor) for the T tokens of one micro-batch of one
dp rank (Megatron: of one rank's tokens), taken in their serial order (position-major, then sample).

Auxiliary losses reach the gradient as Megatron's MoEAuxLossAutoScaler does: attached to the router's
probabilities (z-loss: to its logits), their gradient is injected in backward times the coefficient and
`state.aux_loss_scale`, which the engine sets before each backward to that micro-batch's loss scale (loss scale /
micro-batches, times a half's share). Each rank's loss is its part of the sequence group's (the parts add up),
times cp as the head's loss is. They are computed in training with gradients enabled (so once under full
recomputation: in its backward's forward), and their values (without coefficient, whole over the sequence group)
are kept for the log: `drain_aux_losses`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..parallel.groups import group_size
from ..parallel.init import ParamInit
from ..parallel.mappings import gather_along, gather_from_sp, scatter_to_sp
from ..parallel.moe_dispatch import DISPATCH
from ..parallel.state import ParallelState
from ..units import unit_layer
from . import moe_routing as routing
from .gpt import Unit, _norm
from .moe_experts import Experts, SharedExpert

AUX_LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}


class _AuxLossScaler(torch.autograd.Function):
    """Identity on `output`; in backward, the gradient of `aux_loss` (a scalar: nothing of it is kept) is
    `state.aux_loss_scale`."""

    @staticmethod
    def forward(ctx, output, aux_loss, state):
        ctx.like = (aux_loss.dtype, aux_loss.device)
        ctx.state = state
        return output

    @staticmethod
    def backward(ctx, grad):
        dtype, device = ctx.like
        return grad, torch.full((), ctx.state.aux_loss_scale, dtype=dtype, device=device), None


class _Weight(nn.Module):
    def __init__(self, full: torch.Tensor, state: ParallelState, dtype: torch.dtype, partial_over_tp: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(full.to(device=state.device, dtype=dtype))
        self.weight.sequence_parallel = partial_over_tp


class MoE(Unit):
    """The MoE unit (docs/moe.md): `post_attention_layernorm`, `router`, `experts`, optional `shared_expert` and
    `shared_expert_gate`. `reported`: (name, value) of the auxiliary losses of every forward, for the log."""

    def __init__(self, cfg: ModelConfig, state: ParallelState, init: ParamInit, name: str) -> None:
        super().__init__(state)
        moe, h = cfg.moe, cfg.hidden_size
        self.moe, self.layer = moe, unit_layer(name)
        self.dropout = cfg.hidden_dropout
        self.residual_post_ln = cfg.apply_residual_connection_post_layernorm
        self.post_attention_layernorm = _norm(cfg, state)
        self.router = _Weight(init.normal(f"{name}.router.weight", (moe.num_experts, h)), state, cfg.torch_dtype,
                              state.tp_size > 1)
        self.experts = Experts(cfg, state, init, name)
        self.shared_expert = SharedExpert(cfg, state, init, name) if moe.shared_expert_intermediate_size else None
        self.shared_expert_gate = None
        if moe.shared_expert_gate:
            self.shared_expert_gate = _Weight(init.normal(f"{name}.shared_expert_gate.weight", (1, h)), state,
                                              cfg.torch_dtype, state.sequence_parallel)
        self.reported: list[tuple[str, torch.Tensor]] = []

    def compute(self, hidden, batch):
        st = self.state
        x = self.post_attention_layernorm(hidden)
        split = st.tp_size > 1 and not st.sequence_parallel  # each tp rank routes its 1/tp of the rows
        tokens = scatter_to_sp(x, st.tp_group) if split else x
        s, b, h = tokens.shape
        flat = tokens.reshape(s * b, h)
        probs, routing_map = self.route(flat, batch, s, b)
        y = DISPATCH[self.moe.token_dispatcher_type](flat, probs, routing_map, st, self.experts).view(s, b, h)
        if split:
            y = gather_from_sp(y, st.tp_group, tp_output_grad=False)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, self.shared_expert_gate.weight))
            y = y + shared
        return (x if self.residual_post_ln else hidden) + self._dropout(y, self.dropout)

    # -- routing ---------------------------------------------------------------------------------------------
    def route(self, flat: torch.Tensor, batch: dict, s: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's tokens [n, h] -> (probs [n, E] fp32, routing map [n, E] bool), losses attached."""
        moe = self.moe
        logits = F.linear(flat.float(), self.router.weight.float())
        losses = self.training and torch.is_grad_enabled()
        if losses and moe.z_loss_coeff:
            logits = self._z_loss(logits)
        if moe.load_balancing_type == "sinkhorn":
            balanced = None
            if self.training:
                rows, mine = self._group_rows(logits.detach())
                balanced = routing.sinkhorn(rows)[mine]
            probs, routing_map = routing.sinkhorn_route(logits, moe.router_topk, balanced)
        else:
            probs, routing_map = routing.route(logits, moe)
        if losses and moe.load_balancing_type in AUX_LOSS_NAMES and moe.aux_loss_coeff > 0:
            probs = self._balancing_loss(probs, logits, routing_map, s, b)
        if moe.expert_capacity_factor is not None:
            keep = self._capacity(probs, routing_map, batch, s, b)
            probs, routing_map = probs * keep, keep
        return probs, routing_map

    def _seq_group(self) -> list:
        return [g for g in (self.state.tp_group, self.state.cp_group) if group_size(g) > 1]

    def _group_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the sequence group (tp x cp); not autograd-aware."""
        t = t.detach().clone()
        for g in self._seq_group():
            dist.all_reduce(t, group=g)
        return t

    def _group_rows(self, t: torch.Tensor) -> tuple[torch.Tensor, slice]:
        """`t` [n, ...] gathered over the sequence group (tp ranks, then cp ranks), and this rank's rows in it."""
        n = t.size(0)
        for g in self._seq_group():
            t = gather_along(t, 0, g)
        at = (self.state.cp_rank * self.state.tp_size + self.state.tp_rank) * n
        return t, slice(at, at + n)

    def _attach(self, target: torch.Tensor, name: str, partial: torch.Tensor, coeff: float,
                whole: torch.Tensor) -> torch.Tensor:
        self.reported.append((name, whole.detach() * self.state.aux_loss_share))
        return _AuxLossScaler.apply(target, partial * (coeff * self.state.cp_size), self.state)

    def _z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        total = logits.size(0) * self.state.tp_size * self.state.cp_size
        mine = routing.z_loss_sum(logits)
        return self._attach(logits, "z_loss", mine / total, self.moe.z_loss_coeff, self._group_sum(mine) / total)

    def _balancing_loss(self, probs, logits, routing_map, s: int, b: int) -> torch.Tensor:
        moe, n_experts = self.moe, routing_map.size(1)
        scores = routing.aux_scores(logits, moe.score_function)
        seq = moe.load_balancing_type == "seq_aux_loss"
        shape = (s, b, n_experts) if seq else (s * b, 1, n_experts)  # per sequence, or over all tokens
        counts, prob_sums = routing_map.view(shape).sum(0).float(), scores.view(shape).sum(0)
        whole = self._group_sum(torch.stack([counts, prob_sums]))
        group = self.state.tp_size * self.state.cp_size
        tokens = (s if seq else s * b) * group
        div = b if seq else 1
        partial = routing.switch_loss(prob_sums, whole[0], tokens, moe.router_topk) / div
        value = routing.switch_loss(whole[1], whole[0], tokens, moe.router_topk) / div
        return self._attach(probs, AUX_LOSS_NAMES[moe.load_balancing_type], partial, moe.aux_loss_coeff, value)

    def _capacity(self, probs, routing_map, batch: dict, s: int, b: int) -> torch.Tensor:
        """This rank's part of the capacity decision over the sequence group's tokens in serial order."""
        all_probs, mine = self._group_rows(probs.detach())
        all_map, _ = self._group_rows(routing_map.to(torch.uint8))
        all_keys, _ = self._group_rows(self._token_keys(batch, s, b, probs.device))
        order = torch.argsort(all_keys)
        kept = routing.capacity_keep(all_probs[order], all_map[order].bool(), self.moe)
        keep = torch.empty_like(kept)
        keep[order] = kept
        return keep[mine].clone()  # (`probs * keep` keeps it: this rank's rows, not the group's)

    def _token_keys(self, batch: dict, s: int, b: int, device) -> torch.Tensor:
        """Serial order of this rank's tokens: position in the sequence x b + sample."""
        rows = torch.arange(s, device=device) + self.state.tp_rank * s  # this tp rank's rows of the cp rank's
        positions = batch["positions"][0].to(device)[rows] if "positions" in batch else rows
        return (positions.unsqueeze(1) * b + torch.arange(b, device=device)).reshape(-1)


def drain_aux_losses(chunks) -> dict[str, torch.Tensor]:
    """The auxiliary losses this rank's MoE units reported since the last call, by name: the sum over their
    layers and forwards (each value whole over its sequence group, without coefficient); forgets them. The log
    (training/moe_logging.py) divides by micro-batches, sums over pipeline ranks, averages over dp x cp and
    divides by the MoE layers, as Megatron."""
    out: dict[str, torch.Tensor] = {}
    for chunk in chunks:
        for unit in chunk.modules():
            if isinstance(unit, MoE):
                for name, value in unit.reported:
                    out[name] = out[name] + value.float() if name in out else value.float()
                unit.reported = []
    return out
