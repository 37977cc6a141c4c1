"""Megatron's MoE auxiliary losses on the log line, beside lm loss (`| lm loss: ... | load_balancing_loss: ... |
z_loss: ... |`), and as TensorBoard scalars of the same names.

As Megatron-core's MoE metrics tracker reports them (training.py's training_log, moe_logging.py): the names
tracked follow the flags (`load_balancing_loss` with --moe-router-load-balancing-type aux_loss,
`seq_load_balancing_loss` with seq_aux_loss, `z_loss` with --moe-z-loss-coeff); each MoE layer's value is summed
over the iteration's micro-batches and scaled by 1/micro-batches, summed over the pipeline stages (each holds
its own layers), averaged over the dp x cp ranks and divided by the model's MoE layers. The log line shows the
mean over the interval's iterations that stepped, as it does lm loss. The values come from the MoE units
(`models.moe.drain_aux_losses`: name -> the sum since the last call over this rank's layers and micro-batches).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import ModelConfig
from ..parallel.state import ParallelState


def aux_loss_names(model: ModelConfig) -> list[str]:
    """The auxiliary losses Megatron tracks for this model's flags (none for a dense model)."""
    moe = model.moe
    if moe is None:
        return []
    names = {"aux_loss": ["load_balancing_loss"], "seq_aux_loss": ["seq_load_balancing_loss"]}
    return names.get(moe.load_balancing_type, []) + (["z_loss"] if moe.z_loss_coeff is not None else [])


class MoEAuxLosses:
    """An iteration's auxiliary losses, reduced as Megatron reduces them (see the module doc)."""

    def __init__(self, model: ModelConfig, state: ParallelState) -> None:
        self.names = aux_loss_names(model)
        self.moe_layers = sum(model.moe.layers(model.num_layers))
        self.state = state

    def forget(self, chunks: list) -> None:
        """Drop what forwards outside a training iteration recorded (measuring stage times, evaluation)."""
        _drain(chunks)

    def reduce(self, chunks: list, num_microbatches: int) -> dict[str, float]:
        """The iteration's value of each name, known on every rank (collective over pp and dp x cp)."""
        st = self.state
        t = torch.zeros(len(self.names), dtype=torch.float32, device=st.device)
        reported = _drain(chunks) or {}
        for i, name in enumerate(self.names):
            value = reported.get(name)
            if value is not None:
                t[i] = value.detach().float().sum().to(st.device)
        t /= num_microbatches
        if st.pp_group is not None:
            dist.all_reduce(t, group=st.pp_group)
        if st.grad_group is not None:
            dist.all_reduce(t, group=st.grad_group)
            t /= st.units.loss_divisor(st)
        t /= max(self.moe_layers, 1)
        return dict(zip(self.names, t.tolist()))


def _drain(chunks: list) -> dict | None:
    from ..models.moe import drain_aux_losses

    return drain_aux_losses(chunks)
