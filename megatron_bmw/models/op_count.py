"""How many operators the runtime dispatches in each unit's forward and backward: times the host's time per
operator, a unit's host time, which the planner takes as the least an analytic unit of our runtime on a GPU costs,
and adds to any unit's device time where every kernel launch waits for the kernel (CUDA_LAUNCH_BLOCKING=1)
(planner/cost_model.py, CostSettings.host_ops and launch_blocking).

The units of one layer of `model` are built small on the CPU (hidden 64, sequence 32, vocabulary 256, at most 4
heads: the same modules and code paths, so the same operators) and run once forward and once backward under a
dispatch counter; views (no kernel) are not counted. The CPU paths stand for the GPU's: where the GPU has a
fused kernel the CPU runs several operators (RMSNorm; unfused rope and SwiGLU), the count is high; the fused
rope and SwiGLU (models/fused_ops.py, one compiled kernel each on the GPU) count one each way; tensor-parallel
collectives are not in it (the planner adds them).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..config import ModelConfig
from dataclasses import replace

from ..units import model_unit_kinds, unit_kind_of
from .fused_ops import fused_bodies

VIEWS = frozenset({"view", "_unsafe_view", "t", "transpose", "permute", "expand", "unsqueeze", "squeeze", "select",
                   "slice", "as_strided", "alias", "detach", "split", "split_with_sizes", "chunk", "unbind",
                   "reshape", "narrow", "_reshape_alias", "view_as", "expand_as", "lift_fresh", "unflatten",
                   "flatten", "movedim"})


class _Counter(TorchDispatchMode):
    """Operators dispatched inside it; a compiled fused body (models/fused_ops.py) is one, whatever it runs on the
    CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __enter__(self):
        self._bodies = fused_bodies()[1]
        return super().__enter__()

    def __exit__(self, *exc):
        self.ops += fused_bodies()[1] - self._bodies
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ not in VIEWS and not fused_bodies()[0]:
            self.ops += 1
        return func(*args, **(kwargs or {}))


def small_model(model: ModelConfig) -> ModelConfig:
    """`model` with the sizes shrunk and its structure kept (norms, MLP, attention backend and grouping, dropout,
    positions, model type)."""
    heads = min(model.num_attention_heads, 4)
    groups = model.num_query_groups
    if groups is not None:
        groups = max(1, heads * groups // model.num_attention_heads)
    hidden = 16 * heads
    ffn = hidden * model.ffn_hidden_size // model.hidden_size
    moe = model.moe
    if moe is not None:  # one layer, with experts; each expert's FFN shrunk as the dense one
        shrink = lambda f: None if f is None else max(1, hidden * f // model.hidden_size)  # noqa: E731
        moe = replace(moe, layer_freq="1", ffn_hidden_size=shrink(moe.ffn_hidden_size),
                      shared_expert_intermediate_size=shrink(moe.shared_expert_intermediate_size))
    return ModelConfig(**{**model.__dict__, "num_layers": 1, "hidden_size": hidden, "num_attention_heads": heads,
                          "num_query_groups": groups, "ffn_hidden_size": ffn, "seq_length": 32,
                          "max_position_embeddings": 32, "vocab_size": 256, "params_dtype": "fp32", "moe": moe})


def unit_op_counts(model: ModelConfig, micro_batch_size: int = 1) -> dict[str, tuple[int, int]]:
    """{unit kind: (forward operators, backward operators)} of `model`'s units on one rank (tp 1); counted once
    per small model (models differing in size only share it)."""
    small = small_model(model)
    key = (repr(small), micro_batch_size)
    if key not in _COUNTS:
        _COUNTS[key] = _count(small, micro_batch_size)
    return dict(_COUNTS[key])


_COUNTS: dict[tuple, dict[str, tuple[int, int]]] = {}


def _count(small: ModelConfig, micro_batch_size: int) -> dict[str, tuple[int, int]]:
    from ..parallel.state import ParallelState
    from .chunk import build_units, synthetic_batch

    state = ParallelState.serial()
    with torch.random.fork_rng():
        units = build_units(small, state, 1234)
        batch = synthetic_batch(small, micro_batch_size, state.device)
        out = {}
        for kind in model_unit_kinds(small):
            unit = next(u for name, u in units.items() if unit_kind_of(small, name) == kind)
            hidden = None
            if kind != "embedding":
                hidden = torch.randn(small.seq_length, micro_batch_size, small.hidden_size, requires_grad=True)
            with _Counter() as fwd:
                y = unit(hidden, batch)
            with _Counter() as bwd:
                torch.autograd.backward(y, None if kind == "head" else torch.ones_like(y))
            out[kind] = (fwd.ops, bwd.ops)
    return out

