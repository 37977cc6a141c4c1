"""Deferred weight gradients (zero-bubble B/W split) of the linear layers, on one process."""

import pytest
import torch

from megatron_bmw.parallel import deferred_wgrad
from megatron_bmw.parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_bmw.parallel.state import ParallelState


def _layers():
    g = torch.Generator().manual_seed(3)
    st = ParallelState.serial()
    return (ColumnParallelLinear(torch.randn(6, 4, generator=g), torch.randn(6, generator=g), st),
            RowParallelLinear(torch.randn(4, 6, generator=g), torch.randn(4, generator=g), st))


def _run(x, defer: bool):
    col, row = _layers()
    x = x.clone().requires_grad_()
    loss = row(torch.tanh(col(x))).square().sum()
    if defer:
        with deferred_wgrad.deferring("mb0"):
            loss.backward()
        assert col.weight.grad is None and row.weight.grad is None  # B: input, bias gradients only
        assert col.bias.grad is not None and row.bias.grad is not None
        assert deferred_wgrad.pending() == ["mb0"]
        deferred_wgrad.run_deferred("mb0")
        assert deferred_wgrad.pending() == []
    else:
        loss.backward()
    return [x.grad, col.weight.grad, col.bias.grad, row.weight.grad, row.bias.grad]


def test_deferred_weight_gradients_equal_immediate_ones():
    x = torch.randn(5, 2, 4, generator=torch.Generator().manual_seed(4)).transpose(0, 1)  # not contiguous
    for a, b in zip(_run(x, False), _run(x, True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_run_deferred_of_an_unknown_key_and_double_deferral_fail():
    with pytest.raises(RuntimeError, match="no deferred weight gradients"):
        deferred_wgrad.run_deferred("nothing")
    with deferred_wgrad.deferring("k"):
        pass
    with pytest.raises(RuntimeError, match="already deferred"):
        with deferred_wgrad.deferring("k"):
            pass
    deferred_wgrad.discard()
    assert deferred_wgrad.pending() == []
