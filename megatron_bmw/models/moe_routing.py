"""An MoE router's arithmetic on one set of tokens, as Megatron-core's (moe_utils.py) computes it: scores, top-k,
capacity and the drop policies, Sinkhorn, the load-balancing and z losses. No process groups: where a quantity
spans the tokens of several ranks (counts, the capacity decision) the caller passes it in already gathered.

Ties are broken by the lowest expert index (top-k) and by the earliest token (capacity), so the routing is the
same on every rank and layout that holds the same tokens.
"""

from __future__ import annotations

import math

import torch

from ..config.moe import MoEConfig


def topk(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest scores of every row [n, k] and where they are in `scores` flattened ([n, k] int64: row x E +
    expert), ties to the lowest index. The sort runs on the detached scores and the values are picked by that one
    flat index, so backward keeps n k int64 (a sort with gradients would keep its n E indices)."""
    n, experts = scores.shape
    idx = torch.sort(scores.detach(), dim=-1, descending=True, stable=True).indices[:, :k]
    flat = idx + torch.arange(n, device=scores.device).unsqueeze(1) * experts
    return scores.reshape(-1)[flat], flat


def route(logits: torch.Tensor, moe: MoEConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of fp32 logits [n, E]: (probs [n, E], zero where not routed; routing map [n, E] bool)."""
    k = moe.router_topk
    if moe.score_function == "softmax":
        if moe.pre_softmax:
            probs, flat = topk(torch.softmax(logits, dim=-1), k)
        else:
            values, flat = topk(logits, k)
            probs = torch.softmax(values, dim=-1)
    else:
        probs, flat = topk(torch.sigmoid(logits), k)
        if k > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if moe.topk_scaling_factor:
        probs = probs * moe.topk_scaling_factor
    return _dense(logits, flat, probs)


def _dense(logits: torch.Tensor, flat: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities [n, k] at their flat places (`topk`) -> dense [n, E] (backward keeps `flat`) and the map."""
    dense = torch.zeros(logits.numel(), dtype=probs.dtype, device=logits.device).index_put((flat,), probs)
    chosen = torch.zeros(logits.numel(), dtype=torch.bool, device=logits.device).index_fill_(0, flat.reshape(-1), True)
    return dense.view_as(logits), chosen.view_as(logits)


def sinkhorn(cost: torch.Tensor, tol: float = 0.0001) -> torch.Tensor:
    """Megatron's Sinkhorn normalisation of exp(cost) over tokens (rows) and experts (columns)."""
    cost = torch.exp(cost)
    d0 = torch.ones(cost.size(0), device=cost.device, dtype=cost.dtype)
    d1 = torch.ones(cost.size(1), device=cost.device, dtype=cost.dtype)
    eps, error, d1_old = 1e-8, 1e9, d1
    while error > tol:
        d0 = (1 / d0.size(0)) * 1 / (torch.sum(d1 * cost, 1) + eps)
        d1 = (1 / d1.size(0)) * 1 / (torch.sum(d0.unsqueeze(1) * cost, 0) + eps)
        error = torch.mean(torch.abs(d1_old - d1))
        d1_old = d1
    return d1 * cost * d0.unsqueeze(1)


def sinkhorn_route(logits: torch.Tensor, k: int, balanced: torch.Tensor | None):
    """Sinkhorn routing: each token's experts are the top-k of `balanced` (this rank's rows of Sinkhorn over the
    tokens of the whole sequence group, in training), else (evaluation: None) of the scores; its probabilities
    are the scores (sigmoid for k = 1, else softmax), as Megatron's."""
    scores = torch.sigmoid(logits) if k == 1 else torch.softmax(logits, dim=-1)
    _, flat = topk(scores.detach() if balanced is None else balanced, k)
    return _dense(logits, flat, scores.reshape(-1)[flat])


def capacity(num_tokens: int, moe: MoEConfig) -> int:
    """Tokens an expert takes from `num_tokens` tokens (Megatron's get_capacity of tokens x k)."""
    return math.ceil(num_tokens * moe.router_topk / moe.num_experts * moe.expert_capacity_factor)


def capacity_keep(probs: torch.Tensor, routing_map: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """Which (token, expert) pairs an expert takes, over tokens in their order [N, E] (bool). Probs policy: each
    expert keeps its `capacity` highest probabilities (earliest token first on ties); position policy: its
    first `capacity` tokens. With padding an expert takes exactly `capacity` tokens, unrouted ones (probability
    0) filling the places after the routed ones, as Megatron's pad_to_capacity."""
    n = probs.size(0)
    cap = capacity(n, moe)
    if cap >= n:
        return torch.ones_like(routing_map) if moe.pad_expert_input_to_capacity else routing_map
    key = probs if moe.token_drop_policy == "probs" else routing_map.float()
    chosen = torch.sort(key, dim=0, descending=True, stable=True).indices[:cap]
    mask = torch.zeros_like(routing_map).scatter(0, chosen, True)
    return mask if moe.pad_expert_input_to_capacity else mask & routing_map


def aux_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The normalised scores over all experts the load-balancing losses read."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def switch_loss(prob_sums: torch.Tensor, counts: torch.Tensor, total_tokens: int, k: int) -> torch.Tensor:
    """Switch/GShard load balancing E * sum_e f_e P_e without its coefficient: `prob_sums` [.., E] this rank's
    sums of scores per expert, `counts` the tokens routed to each expert over all `total_tokens` tokens (a
    partial loss when `prob_sums` covers part of the tokens: the parts add up)."""
    n_experts = prob_sums.size(-1)
    return torch.sum(prob_sums * counts) * (n_experts / (k * total_tokens * total_tokens))


def z_loss_sum(logits: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of logsumexp(logits)^2 (ST-MoE's z-loss is its mean)."""
    return torch.square(torch.logsumexp(logits, dim=-1)).sum()
