"""fused.py: the compiled pointwise wrapper's eager and fallback paths, and the cuDNN-first attention order."""

import torch
import torch.nn.functional as F

from megatron_bmw import fused
from megatron_bmw.fused import CudaCompiled, sdpa_backends


def _scale_add(x, y):
    return x * 2.0 + y


def test_cuda_compiled_runs_eagerly_on_the_cpu(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("torch.compile must not run for CPU tensors")

    monkeypatch.setattr(torch, "compile", refuse)
    f = CudaCompiled(_scale_add)
    x, y = torch.randn(5), torch.randn(5)
    assert not f.compiles(x)
    assert torch.equal(f(x, y), x * 2.0 + y)


def test_a_failed_compile_falls_back_once_and_says_so(monkeypatch, capsys):
    calls = []

    def broken_compile(fn, **kwargs):
        calls.append(kwargs)

        def run(*a):
            raise RuntimeError("no compiler here\nsecond line")
        return run

    monkeypatch.setattr(torch, "compile", broken_compile)
    monkeypatch.setattr(CudaCompiled, "compiles", lambda self, first: not self._broken)
    f = CudaCompiled(_scale_add)
    x, y = torch.randn(3), torch.randn(3)
    assert torch.equal(f(x, y), x * 2.0 + y)
    assert torch.equal(f(x, y), x * 2.0 + y)  # the eager function from then on: compile tried once
    assert calls == [{"dynamic": False, "fullgraph": True}]
    out = capsys.readouterr().out
    assert out.count("torch.compile of _scale_add failed (RuntimeError: no compiler here)") == 1


def test_triton_detection_is_a_bool():
    assert fused._triton_available() in (True, False)


def test_cudnn_first_attention_equals_the_default_where_cudnn_does_not_run():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, dtype=torch.float64) for _ in range(3))
    keep = torch.rand(2, 1, 1, 16) > 0.3
    keep[..., 0] = True
    for kwargs in ({"is_causal": True}, {"attn_mask": keep}):
        want = F.scaled_dot_product_attention(q, k, v, **kwargs)
        with sdpa_backends(True):
            got = F.scaled_dot_product_attention(q, k, v, **kwargs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with sdpa_backends(False):
        assert torch.equal(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                           F.scaled_dot_product_attention(q, k, v, is_causal=True))
