"""Expert parameters (docs/moe.md): which parameters they are, where a rank's shard sits, and which rank counts
each distinct element in a world-wide sum (grad norm, overflow check, params norm).

An expert parameter carries `expert_parallel = True` and `expert_dim` (the dim split over ep: ep rank j holds
experts j*E/ep ... (j+1)*E/ep-1), and the usual tensor-parallel attributes for its split over etp. Its copies
are the `edp_group` (the ranks holding the same experts); a dense parameter's are the dp x cp `grad_group`.
The expert groups are read from the state only where a model has expert parameters.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: arguments.py reads legacy_format_refusal without torch
    import torch

from .counting import counted_once


def is_expert(param: torch.Tensor) -> bool:
    return bool(getattr(param, "expert_parallel", False))


def has_experts(params) -> bool:
    return any(is_expert(p) for p in params)


def split_of(param: torch.Tensor, state) -> tuple[int, int, int, int]:
    """(tensor-parallel rank, size, expert-parallel rank, size) of `param`'s shard: etp and ep for an expert
    parameter, tp and (0, 1) for a dense one."""
    if is_expert(param):
        return state.etp_rank, state.etp_size, state.ep_rank, state.ep_size
    return state.tp_rank, state.tp_size, 0, 1


def counted_in_world(param: torch.Tensor, state, sharded: bool) -> bool:
    """Does this rank count its copy of `param` (or, `sharded`, its ZeRO-1 piece of it) in a sum over the whole
    world? Each distinct element once: a tp (etp) shard on every tp (etp) rank, a replicated tensor on tp (etp)
    rank 0; over its copies (dense: dp x cp, experts: edp) the first rank, or each rank its own ZeRO-1 piece;
    different pipeline stages and ep ranks hold different tensors."""
    if is_expert(param):
        return counted_once(param, state.etp_rank) and (sharded or state.edp_rank == 0)
    return counted_once(param, state.tp_rank) and (sharded or (state.dp_rank == 0 and state.cp_rank == 0))


def legacy_format_refusal(ep: int, etp: int, tp: int) -> str | None:
    """Why `--ckpt-format torch` cannot hold these experts, or None. Megatron's legacy files with expert parallelism
    (mp_rank_TT_PPP_EEE) are not written here: experts laid out other than the dense tensors (ep > 1, or etp != tp)
    are saved and loaded as torch_dist only."""
    if ep == 1 and etp == tp:
        return None
    what = f"--expert-model-parallel-size {ep}" if ep > 1 else f"--expert-tensor-parallel-size {etp} (tp {tp})"
    return (f"--ckpt-format torch: experts split by {what} are saved and loaded only as torch_dist; use "
            "--ckpt-format torch_dist (it loads into any ep/etp/tp/pp)")
