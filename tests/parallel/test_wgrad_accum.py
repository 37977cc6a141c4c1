"""Gradient-accumulation fusion (parallel/wgrad_accum.py): linear layers add their weight gradients into the fp32
main_grad themselves, equal to autograd's gradients; nothing else goes through that path; the overlapped
reduction still launches every bucket during backward; `--no-gradient-accumulation-fusion` turns it off."""

import pytest
import torch

from megatron_bmw.arguments import IGNORED_KERNEL_FLAGS, configs_from_args, parse_args
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel import deferred_wgrad, grad_sync, wgrad_accum
from megatron_bmw.parallel.grad_sync import GradSync
from megatron_bmw.parallel.state import ParallelState
from tests.reference import SEED, make_batch, serial_reference, small_config, split_batch


def _run(cfg, fusion: bool, micro: list, state=None, overlap: bool = False):
    """Gradients of `micro` through GradSync, and which parameters autograd handed a .grad."""
    state = state or ParallelState.serial()
    model = ModelChunk(build_units(cfg, state, SEED))
    params = dict(model.named_parameters())
    through_autograd: set[str] = set()
    def seen(p, name):  # autograd runs the hooks of a None gradient too, with no .grad
        if p.grad is not None:
            through_autograd.add(name)

    for name, p in params.items():
        p.register_post_accumulate_grad_hook(lambda p, name=name: seen(p, name))
    sync = GradSync(list(params.values()), state, bucket_size=500, overlap=overlap, fusion=fusion)
    sync.zero()
    sync.begin(len(micro))
    for mb in micro:
        (model(None, mb) / len(micro)).backward()
    launched = [b.handle is not None for b in sync.buckets]
    sync.finish()
    grads = {n: p.main_grad.clone() for n, p in params.items()}
    sync.remove_hooks()
    return grads, through_autograd, launched, params


@pytest.mark.parametrize("untied", [False, True])
def test_fused_gradients_equal_autograds_and_only_linear_weights_skip_it(untied):
    cfg = small_config(untie_embeddings_and_output_weights=untied)
    micro = split_batch(make_batch(cfg, 4, 0), 2)
    _, want, _ = serial_reference(cfg, micro)
    grads, through_autograd, _, params = _run(cfg, True, micro)
    for name, g in grads.items():
        torch.testing.assert_close(g, want[name], rtol=1e-6, atol=1e-7, msg=name)
    fused = {n for n, p in params.items() if getattr(p, "wgrad_fusable", False)}
    assert fused and through_autograd == set(params) - fused
    assert all(n.endswith("weight") for n in fused) and not any("norm" in n for n in fused)
    assert ("units.head.output_weight" in fused) == untied  # tied on one rank: the embedding's, not fused
    assert "units.embedding.word_embeddings.weight" not in fused
    assert not any(hasattr(p, "main_grad_sink") for p in params.values())  # remove_hooks takes the sinks


def test_fusion_off_takes_every_gradient_through_autograd():
    cfg = small_config()
    micro = split_batch(make_batch(cfg, 4, 1), 2)
    on, _, _, _ = _run(cfg, True, micro)
    off, through_autograd, _, params = _run(cfg, False, micro)
    assert through_autograd == set(params)
    for name in on:
        torch.testing.assert_close(on[name], off[name], rtol=1e-6, atol=1e-7, msg=name)


class _Handle:
    def wait(self):
        return None


def test_overlapped_reduction_launches_every_bucket_during_backward(monkeypatch):
    """The sinks count as the hooks do: each bucket's reduction starts once its last gradient, fused or not, is in."""
    launched_during = []
    monkeypatch.setattr(grad_sync.dist, "all_reduce", lambda t, group=None, async_op=False: launched_during.append(
        t.numel()) or _Handle())
    monkeypatch.setattr(grad_sync, "group_size", lambda group: 1)
    state = ParallelState.serial()
    state.dp_group = object()
    cfg = small_config()
    micro = split_batch(make_batch(cfg, 4, 2), 2)
    _, _, launched, _ = _run(cfg, True, micro, state=state, overlap=True)
    assert len(launched) > 2 and all(launched)


def test_deferred_weight_gradients_go_into_main_grad():
    """Zero-bubble's W pass: the stashed (input, output gradient) pairs are accumulated by the same fused GEMM."""
    cfg = small_config(untie_embeddings_and_output_weights=True)
    batch = make_batch(cfg, 2, 3)
    _, want, _ = serial_reference(cfg, [batch])
    model = ModelChunk(build_units(cfg, ParallelState.serial(), SEED))
    params = dict(model.named_parameters())
    sync = GradSync(list(params.values()), ParallelState.serial())
    sync.zero()
    with deferred_wgrad.deferring("w"):
        model(None, batch).backward()
    fused = [n for n, p in params.items() if getattr(p, "wgrad_fusable", False)]
    assert all(params[n].main_grad.abs().sum() == 0 for n in fused)  # nothing yet: deferred
    deferred_wgrad.run_deferred("w")
    sync.finish()
    for name, p in params.items():
        torch.testing.assert_close(p.main_grad, want[name], rtol=1e-6, atol=1e-7, msg=name)
    sync.remove_hooks()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_weights_accumulate_in_fp32(dtype):
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(3, 5, 16, generator=g).to(dtype), torch.randn(3, 5, 8, generator=g).to(dtype)
    main = torch.full((8, 16), 1e4)  # a 16-bit sum would lose the small gradient next to it
    wgrad_accum.accumulate(main, dy, x)
    want = 1e4 + dy.reshape(-1, 8).float().t() @ x.reshape(-1, 16).float()
    assert wgrad_accum.kernel(dtype, x.device) in ("addmm_out_dtype", "unfused")
    torch.testing.assert_close(main, want, rtol=0, atol=0.1)
    assert wgrad_accum.kernel(torch.float32, x.device) == "addmm"


def test_the_flag_follows_megatron():
    base = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "1"]
    assert "--no-gradient-accumulation-fusion" not in IGNORED_KERNEL_FLAGS
    assert configs_from_args(parse_args(base), 1).train.gradient_accumulation_fusion
    assert not configs_from_args(parse_args(base + ["--no-gradient-accumulation-fusion"]), 1).train \
        .gradient_accumulation_fusion
