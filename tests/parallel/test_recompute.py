"""parallel/recompute.checkpoint: gradients equal to running without recomputation, with dropout drawn from the
default generator and from the RNG tracker, on the reentrant path (an argument requires a gradient: what is saved
is the arguments alone) and on the fallback (only parameters do)."""

import torch

from megatron_bmw.parallel.random import RNGTracker
from megatron_bmw.parallel.recompute import _Recompute, checkpoint


def _block(weight, tracker):
    def fn(x, scale):
        y = torch.nn.functional.dropout(x @ weight, 0.5) * scale
        with tracker.fork():
            return torch.nn.functional.dropout(torch.tanh(y), 0.3)
    return fn


def _grads(recompute: bool, x_requires_grad: bool):
    torch.manual_seed(0)
    weight = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=x_requires_grad)
    tracker = RNGTracker()
    tracker.add("model-parallel-rng", 7)
    fn = _block(weight, tracker)
    torch.manual_seed(1)
    out = checkpoint(fn, tracker, x, 2.0) if recompute else fn(x, 2.0)
    torch.manual_seed(99)  # draws between forward and backward must not change the replayed masks
    torch.rand(10)
    with tracker.fork():
        torch.rand(10)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    return out.detach(), weight.grad, x.grad


def test_reentrant_recompute_replays_both_generators():
    ref = _grads(False, True)
    got = _grads(True, True)
    for a, b in zip(ref, got):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_only_the_arguments_are_saved_on_the_reentrant_path():
    weight = torch.randn(6, 6, requires_grad=True)
    x = torch.randn(4, 6, requires_grad=True)
    out = checkpoint(lambda a: torch.tanh(a @ weight) * 3, None, x)
    assert type(out.grad_fn).__name__ == _Recompute.__name__ + "Backward"
    assert [t.data_ptr() for t in out.grad_fn.saved_tensors] == [x.data_ptr()]


def test_parameters_alone_take_the_non_reentrant_path():
    ref = _grads(False, False)
    got = _grads(True, False)
    assert got[2] is None
    for a, b in zip(ref[:2], got[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
