"""models/fused_ops.py: the fused SwiGLU and rope against the unfused ops (forward and gradients), what they save,
and a serial Llama-style GPT with the fusions on against off."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.models.fused_ops import rope, swiglu
from megatron_bmw.models.rotary import apply_rotary, rotary_angles
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.training.saved_bytes import measure_saved
from tests.reference import LLAMA, SEED, make_batch, small_config

CPU = torch.device("cpu")
# fp32: the same arithmetic but for the order of a few products (SwiGLU's backward); bf16: a bf16 ulp or two
TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}


def _unfused_swiglu(z):
    gate, up = z.chunk(2, dim=-1)
    return F.silu(gate) * up


def _both(fused, unfused, inputs, grad, dtype):
    """Forward and input gradients of `fused` and `unfused` at the same inputs: asserted close."""
    outs = []
    for fn in (fused, unfused):
        xs = [x.detach().requires_grad_(x.is_floating_point() and i == 0) for i, x in enumerate(inputs)]
        y = fn(*xs)
        (dx,) = torch.autograd.grad(y, xs[0], grad)
        outs.append((y, dx))
    (y1, d1), (y0, d0) = outs
    torch.testing.assert_close(y1, y0, rtol=0, atol=0)  # the forward runs the same ops
    torch.testing.assert_close(d1, d0, **TOL[dtype])
    return y1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_matches_the_unfused_ops_and_saves_z_only(dtype):
    g = torch.Generator().manual_seed(0)
    f = 24  # a tp rank's local halves: [gate; up] of its own columns, as fc1 gives them
    z = torch.randn(16, 3, 2 * f, generator=g).to(dtype)
    dy = torch.randn(16, 3, f, generator=g).to(dtype)
    _both(swiglu, _unfused_swiglu, [z], dy, dtype)
    z.requires_grad_()
    fused, _ = measure_saved(lambda: swiglu(z))
    unfused, _ = measure_saved(lambda: _unfused_swiglu(z))
    assert fused.total == z.numel() * z.element_size()  # z only
    assert unfused.total == fused.total + z.numel() // 2 * z.element_size()  # and silu(gate)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("percent,factor,positions,heads", [
    (1.0, None, False, 4), (0.5, None, False, 4),  # all of the head; half of it, the rest passed through
    (1.0, 4, False, 4),  # positions interpolated
    (0.5, None, True, 4),  # a context-parallel rank's global positions (chunks 1 and 2 of 4)
    (1.0, None, False, 2),  # grouped-query k: fewer heads, the same angles
])
def test_rope_matches_apply_rotary_and_saves_the_angles_only(dtype, percent, factor, positions, heads):
    g = torch.Generator().manual_seed(1)
    s, b, d = 8, 2, 16
    where = torch.cat((torch.arange(8, 12), torch.arange(16, 20))) if positions else None
    angles = rotary_angles(s, int(d * percent), 10000, factor, CPU, where)
    # q as Attention takes it: [s, b, heads, d] rows permuted to [b, heads, s, d] (not contiguous)
    x = torch.randn(s, b, heads, d, generator=g).to(dtype).permute(1, 2, 0, 3)
    dy = torch.randn(b, heads, s, d, generator=g).to(dtype)
    y = _both(rope, apply_rotary, [x, angles], dy, dtype)
    assert y.stride() == apply_rotary(x, angles).stride()  # laid out as the unfused output (the core's input)
    x = x.detach().requires_grad_()
    fused, _ = measure_saved(lambda: (rope(x, angles), rope(x, angles)))  # q and k share the angles
    unfused, _ = measure_saved(lambda: (apply_rotary(x, angles), apply_rotary(x, angles)))
    assert fused.total == angles.numel() * 4
    assert unfused.total == 4 * angles.numel() * 4  # cos and sin per call


def test_llama_gpt_fused_equals_unfused():
    """A serial Llama-style GPT (rope over half the head, SwiGLU, RMSNorm, grouped queries) with the fusions on and
    off: the same loss and the same gradient of every parameter at fp32."""
    on = small_config(**LLAMA)
    assert on.bias_swiglu_fusion and on.apply_rope_fusion  # Megatron's defaults
    results = []
    for cfg in (on, replace(on, bias_swiglu_fusion=False, apply_rope_fusion=False)):
        model = ModelChunk(build_units(cfg, ParallelState.serial(), SEED))
        loss = model(None, make_batch(cfg, 2, seed=5))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss1, grads1), (loss0, grads0) = results
    torch.testing.assert_close(loss1, loss0, rtol=1e-6, atol=0)
    assert grads1.keys() == grads0.keys()
    for name in grads0:
        torch.testing.assert_close(grads1[name], grads0[name], rtol=1e-6, atol=1e-7, msg=name)
