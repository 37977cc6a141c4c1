"""The vocab-parallel cross entropy's backward builds the logits' gradient in the saved softmax's place: the only
logits-sized tensor it allocates is the cast back to a 16-bit dtype, as memory_model.unit_backward_bytes("head")
counts (its values are checked against the serial loss in test_layers.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_bmw.config import ModelConfig
from megatron_bmw.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.planner.memory_model import unit_backward_bytes


class NewTensors(TorchDispatchMode):
    """The dtype and size of every tensor an op allocates (in-place ops and views allocate none)."""

    def __init__(self) -> None:
        super().__init__()
        self.allocated: list[tuple[torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {a.untyped_storage().data_ptr() for a in args if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.allocated.append((t.dtype, t.numel()))
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_allocates_only_the_cast_of_the_gradient(dtype):
    s, b, v = 16, 3, 256
    state = ParallelState.serial(torch.device("cpu"))
    logits = torch.randn(s, b, v, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()
    target = torch.randint(0, v, (s, b), generator=torch.Generator().manual_seed(1))
    loss = vocab_parallel_cross_entropy(logits, target, state)
    weights = torch.rand(s, b, generator=torch.Generator().manual_seed(2))
    with NewTensors() as mode:
        (grad,) = torch.autograd.grad(loss, logits, weights)
    big = [(dt, n) for dt, n in mode.allocated if n >= s * b * v]
    assert big == ([] if dtype == torch.float32 else [(dtype, s * b * v)])
    model = ModelConfig(seq_length=s, vocab_size=v, params_dtype="fp32" if dtype == torch.float32 else "bf16")
    assert unit_backward_bytes("head", model, b) == sum(n * dt.itemsize for dt, n in big)
    ref = logits.detach().float().requires_grad_()
    ref_loss = F.cross_entropy(ref.view(-1, v), target.view(-1), reduction="none").view(s, b)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref, weights)
    tol = {} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(grad.float(), ref_grad, **tol)
