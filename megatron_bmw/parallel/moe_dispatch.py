"""How an MoE layer's tokens reach their experts and come back (docs/moe.md, Dispatchers).

Both dispatchers take this rank's tokens [n, h], its routing map [n, E] (bool: the experts each token goes to)
and probabilities [n, E] (zero where not routed), and an `experts(rows, counts)` function running this rank's
E/ep local experts (its etp shard of each) on rows sorted by local expert (`counts[l]` rows for expert l), whose
result is partial over etp. They return [n, h]: each token's expert outputs weighted by their probabilities and
summed. Rows reach an expert in a fixed order (by source rank, then token), so every layout computes the same.

`allgather`: tokens, maps and probabilities all-gathered over the etp x ep group; each rank runs its local experts
on the gathered tokens routed to them; the weighted outputs are reduce-scattered back (which also sums the etp
partials). `alltoall`: tokens permuted by expert, counts exchanged, an all-to-all over the ep group, then an
all-gather over the etp group (each etp rank holds its shard of the same experts), the experts run, and the
reverse path back (a reduce-scatter over etp sums the partials).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .groups import group_rank, group_size
from .mappings import gather_along, gather_from_sp, owned, reduce_scatter_along, reduce_scatter_to_sp, with_adjoint
from .view import ParallelView


def permute(tokens: torch.Tensor, routing_map: torch.Tensor):
    """Rows of `tokens` for every (token, expert) pair of the map, sorted by expert then token: (rows,
    token index and expert index of each row, rows per expert)."""
    expert_idx, token_idx = routing_map.t().nonzero(as_tuple=True)
    return tokens.index_select(0, token_idx), token_idx, expert_idx, routing_map.sum(0)


def unpermute(rows: torch.Tensor, token_idx: torch.Tensor, expert_idx: torch.Tensor, probs: torch.Tensor,
              n: int) -> torch.Tensor:
    """Each token's rows weighted by its probability for their expert and summed: [n, h]. Backward keeps the
    indices, the rows and their weights (in the rows' dtype); the sum by index_put keeps only its index (index_add
    would keep the weighted rows as well)."""
    weights = probs[token_idx, expert_idx].to(rows.dtype).unsqueeze(-1)
    out = torch.zeros((n, rows.size(-1)), dtype=rows.dtype, device=rows.device)
    return out.index_put((token_idx,), rows * weights, accumulate=True)


def allgather_dispatch(tokens, probs, routing_map, state: ParallelView, experts) -> torch.Tensor:
    group = state.etp_ep_group
    n = tokens.size(0)
    all_tokens = gather_from_sp(tokens, group)  # backward: the grads of this rank's tokens, summed over the group
    all_probs = gather_from_sp(probs, group)
    all_map = gather_along(routing_map.to(torch.uint8), 0, group).bool()
    local = _local_experts(state, routing_map.size(1))
    rows, token_idx, expert_idx, counts = permute(all_tokens, all_map[:, local])
    out = unpermute(experts(rows, counts), token_idx, expert_idx, all_probs[:, local], all_tokens.size(0))
    out = reduce_scatter_to_sp(out, group)
    assert out.size(0) == n
    return out


def alltoall_dispatch(tokens, probs, routing_map, state: ParallelView, experts) -> torch.Tensor:
    ep_group, etp_group = state.ep_group, state.etp_group
    ep, n_experts = state.ep_size, routing_map.size(1)
    rows, token_idx, expert_idx, counts = permute(tokens, routing_map)
    per_rank = counts.view(ep, n_experts // ep)  # rows for each ep rank's local experts
    recv_counts = _exchange_counts(per_rank, ep_group)  # [ep source, local expert]
    send_splits, recv_splits = per_rank.sum(1).tolist(), recv_counts.sum(1).tolist()
    received = all_to_all(rows, recv_splits, send_splits, ep_group)
    chunk_counts = recv_counts
    if group_size(etp_group) > 1:  # every etp rank of the experts takes the tokens its etp peers received
        chunk_counts = gather_along(recv_counts, 0, etp_group)  # [etp x ep chunks, local expert]
        sizes = chunk_counts.view(group_size(etp_group), -1).sum(1).tolist()
        received = gather_uneven(received, sizes, etp_group)
    if chunk_counts.size(0) > 1:  # rows from several ranks: expert by expert, and back (keeping `order` once)
        order = _expert_major(chunk_counts)
        out = experts(received.index_select(0, order), chunk_counts.sum(0))
        out = out.new_empty(out.shape).index_put((order,), out)  # back to (chunk, expert) order
    else:
        out = experts(received, chunk_counts.sum(0))
    if group_size(etp_group) > 1:
        out = reduce_scatter_uneven(out, sizes, etp_group)
    back = all_to_all(out, send_splits, recv_splits, ep_group)
    return unpermute(back, token_idx, expert_idx, probs, tokens.size(0))


DISPATCH = {"allgather": allgather_dispatch, "alltoall": alltoall_dispatch}


def _local_experts(state: ParallelView, n_experts: int) -> slice:
    per = n_experts // state.ep_size
    return slice(state.ep_rank * per, (state.ep_rank + 1) * per)


def _exchange_counts(per_rank: torch.Tensor, group) -> torch.Tensor:
    """[ep, local experts] rows this rank sends to each ep rank -> the rows each ep rank sends to this one."""
    if group_size(group) == 1:
        return per_rank
    out = torch.empty_like(per_rank)
    dist.all_to_all_single(out, per_rank.contiguous(), group=group)
    return out


def _expert_major(chunk_counts: torch.Tensor) -> torch.Tensor:
    """Row order that takes rows laid out chunk by chunk (each chunk's rows by local expert) expert by expert
    (each expert's rows chunk by chunk)."""
    flat = chunk_counts.reshape(-1)
    starts = torch.cumsum(flat, 0) - flat
    sizes_t, starts_t = chunk_counts.t().reshape(-1), starts.view_as(chunk_counts).t().reshape(-1)
    total = int(flat.sum())
    offsets = torch.cumsum(sizes_t, 0) - sizes_t
    within = torch.arange(total, device=flat.device) - torch.repeat_interleave(offsets, sizes_t)
    return torch.repeat_interleave(starts_t, sizes_t) + within


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        return _AllToAll.apply(g, in_splits, out_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    """Rows in_splits[j] of `x` to rank j of `group`; out_splits[j] rows from it (autograd-aware)."""
    if group_size(group) == 1:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _padded(x: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([x, x.new_zeros((rows - x.size(0), *x.shape[1:]))]) if x.size(0) < rows else x


def _gather_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    most = max(sizes)
    parts = gather_along(_padded(x, most), 0, group).split(most)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


def _reduce_scatter_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    most = max(sizes)
    padded = torch.cat([_padded(p, most) for p in x.split(sizes)])
    return owned(reduce_scatter_along(padded, 0, group)[: sizes[group_rank(group)]])


def gather_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Rank j's sizes[j] rows of `x`, concatenated over `group` (backward: the sum over the group, split)."""
    return with_adjoint(x, _gather_uneven, _reduce_scatter_uneven, sizes, group)


def reduce_scatter_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """`x` (sizes[j] rows for rank j) summed over `group`; this rank's rows (backward: gather_uneven)."""
    return with_adjoint(x, _reduce_scatter_uneven, _gather_uneven, sizes, group)
