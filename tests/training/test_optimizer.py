import math

import pytest
import torch
from torch import nn

from megatron_bmw.config import ParallelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.config import OptimizerConfig
from megatron_bmw.training.optimizer import build_optimizer
from tests.dist_harness import run_distributed

# 65 elements in all: odd, so the ZeRO flat buffer needs padding and shards split parameters.
SHAPES = [
    ("layer.weight", (5, 7)),
    ("layer.bias", (5,)),
    ("norm.weight", (7,)),
    ("out.weight", (3, 5)),
    ("out.bias", (3,)),
]


def _params(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(n, nn.Parameter(torch.randn(s, generator=gen).to(dtype))) for n, s in SHAPES]


def _set_grads(named, step, scale=1.0):
    gen = torch.Generator().manual_seed(1000 + step)
    for _, p in named:
        p.main_grad = torch.randn(p.shape, generator=gen) * scale


def _cfg(**kw):
    base = dict(lr=1e-2, weight_decay=0.1, clip_grad=0.0)
    base.update(kw)
    return OptimizerConfig(**base)


def test_config_checks():
    with pytest.raises(UsageError, match="--fp16 and --bf16 are mutually exclusive"):
        OptimizerConfig(lr=1e-4, fp16=True, bf16=True)
    with pytest.raises(UsageError, match="--clip-grad"):
        OptimizerConfig(lr=1e-4, clip_grad=-1.0)
    with pytest.raises(UsageError, match="--hysteresis"):
        OptimizerConfig(lr=1e-4, hysteresis=0)


def test_matches_torch_adamw_without_decay_on_1d_params():
    named = _params()
    ref = [p.detach().clone().requires_grad_() for _, p in named]
    decay = [r for (n, _), r in zip(named, ref) if r.ndim == 2]
    no_decay = [r for (n, _), r in zip(named, ref) if r.ndim == 1]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    ref_opt = torch.optim.AdamW(groups, lr=1e-2)
    opt = build_optimizer(named, _cfg(), ParallelState.serial())
    for step in range(3):
        _set_grads(named, step)
        for (_, p), r in zip(named, ref):
            r.grad = p.main_grad.clone()
        res = opt.step()
        ref_opt.step()
        assert res.successful and res.loss_scale == 1.0
        opt.zero_grad()
        assert all(p.main_grad.abs().sum() == 0 and p.grad is None for _, p in named)
    for (_, p), r in zip(named, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-6, atol=1e-7)
    opt.set_lr(0.5)
    assert opt.get_lr() == 0.5


def test_fp16_overflow_skips_and_backs_off_per_hysteresis():
    named = _params(torch.float16)
    opt = build_optimizer(named, _cfg(fp16=True, initial_loss_scale=2.0**10, hysteresis=2), ParallelState.serial())
    assert opt.scale_loss(torch.tensor(3.0)).item() == 3.0 * 2**10
    _set_grads(named, 0, scale=2.0**10)
    assert opt.step().successful
    before = [p.detach().clone() for _, p in named]
    for expected_scale in (2.0**10, 2.0**9, 2.0**8):  # hysteresis 2: the first overflow only spends budget
        _set_grads(named, 1, scale=opt.loss_scale)
        named[2][1].main_grad[3] = float("inf")
        res = opt.step()
        assert not res.successful and res.grad_norm is None and res.loss_scale == expected_scale
        assert all(torch.equal(p.detach(), b) for (_, p), b in zip(named, before))
    assert opt.num_skipped_steps == 3
    _set_grads(named, 2, scale=opt.loss_scale)
    named[0][1].main_grad[0, 0] = float("nan")
    assert not opt.step().successful and opt.loss_scale == 2.0**7
    _set_grads(named, 3, scale=opt.loss_scale)
    assert opt.step().successful


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_low_precision_params_track_fp32_run(dtype):
    low = _params(dtype)
    ref = [(n, nn.Parameter(p.detach().float())) for n, p in low]  # same (rounded) starting point
    fp16 = dtype == torch.float16
    cfg = _cfg(fp16=fp16, bf16=not fp16, initial_loss_scale=2.0**12, clip_grad=1.0)
    opt = build_optimizer(low, cfg, ParallelState.serial())
    ref_opt = build_optimizer(ref, _cfg(clip_grad=1.0), ParallelState.serial())
    for step in range(10):
        _set_grads(ref, step)
        for (_, p), (_, r) in zip(low, ref):
            p.main_grad = r.main_grad * opt.loss_scale
        a, b = opt.step(), ref_opt.step()
        assert a.successful and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
    masters = opt.state_dict()["params"]
    for m, (_, p), (_, r) in zip(masters, low, ref):
        torch.testing.assert_close(m["master"], r.detach(), rtol=1e-6, atol=1e-6)  # fp32 masters: same path
        torch.testing.assert_close(p.detach().float(), r.detach(), rtol=1e-2, atol=1e-2)


def _zero_vs_plain(rank, world_size, dtype, bucket):
    state = ParallelState.build(ParallelConfig())
    assert state.dp_size == 2
    zero_named, plain_named = _params(dtype), _params(dtype)
    kw = dict(clip_grad=1.0, bf16=dtype == torch.bfloat16)
    zero = build_optimizer(zero_named, _cfg(use_distributed_optimizer=True, param_bucket_size=bucket, **kw), state)
    plain = build_optimizer(plain_named, _cfg(**kw), state)
    owned = sum(m.numel() for m in zero._masters)
    if bucket < 65:  # buckets of 35, 5+7, 15 and 3 elements: each rank owns half of each (rounded up on rank 0)
        assert len(zero._layout.buckets) == 4 and owned == (34 if rank == 0 else 31)
    else:
        assert owned in (32, 33)  # one bucket: each DP rank owns half
    clipped = 0
    for step in range(5):
        _set_grads(zero_named, step, scale=0.05 + step * 0.06)  # same on both DP ranks, as after the DP all-reduce
        _set_grads(plain_named, step, scale=0.05 + step * 0.06)
        a, b = zero.step(), plain.step()
        clipped += b.grad_norm > 1.0
        assert a.successful and a.grad_norm == pytest.approx(b.grad_norm, rel=1e-6)
        for (_, p), (_, q) in zip(zero_named, plain_named):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert 0 < clipped < 5
    zsd, psd = zero.state_dict(), plain.state_dict()
    if rank == 0:
        for z, p in zip(zsd["params"], psd["params"]):
            for key in ("exp_avg", "exp_avg_sq"):
                # with buckets the grad norm sums other pieces: the clip coefficient differs in its last bits
                torch.testing.assert_close(z[key], p[key], rtol=1e-6, atol=1e-9 if bucket > 65 else 1e-8)
    else:
        assert zsd["params"] is None
    # A plain optimizer's state loads into a fresh ZeRO one (each DP rank takes its slice) and continues identically.
    resumed_named = [(n, nn.Parameter(p.detach().clone())) for n, p in plain_named]
    resumed = build_optimizer(resumed_named, _cfg(use_distributed_optimizer=True, param_bucket_size=bucket, **kw),
                              state)
    resumed.load_state_dict(psd)
    _set_grads(resumed_named, 9)
    _set_grads(plain_named, 9)
    resumed.step()
    plain.step()
    for (_, p), (_, q) in zip(resumed_named, plain_named):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    return True


@pytest.mark.slow
@pytest.mark.parametrize("dtype,bucket", [(torch.float32, 12), (torch.bfloat16, 40_000_000)])
def test_zero1_equals_plain_adam_on_dp2(dtype, bucket):
    assert run_distributed(2, _zero_vs_plain, dtype, bucket) == [True, True]


def _tp_norm(rank, world_size):
    state = ParallelState.build(ParallelConfig(tensor_model_parallel_size=2))
    gen = torch.Generator().manual_seed(5)
    full_w = torch.randn(8, 4, generator=gen)
    full_b, full_ln = torch.randn(4, generator=gen), torch.randn(4, generator=gen)
    expected = math.sqrt(sum(float(t.square().sum()) for t in (full_w, full_b, full_ln)))
    w = nn.Parameter(torch.zeros(4, 4))
    w.tensor_model_parallel = True
    named = [("w", w), ("b", nn.Parameter(torch.zeros(4))), ("ln.weight", nn.Parameter(torch.zeros(4)))]
    opt = build_optimizer(named, _cfg(lr=0.1, clip_grad=1.0, weight_decay=0.0), state)

    def grads(inf_on_rank=None):
        w.main_grad = full_w[4 * state.tp_rank : 4 * state.tp_rank + 4].clone()
        named[1][1].main_grad = full_b.clone()
        named[2][1].main_grad = full_ln.clone()
        if inf_on_rank == state.tp_rank:
            w.main_grad[0, 0] = float("inf")

    grads(inf_on_rank=1)
    assert not opt.step().successful  # only tp rank 1 saw the inf; both skip
    grads()
    res = opt.step()
    assert res.successful and res.grad_norm == pytest.approx(expected, rel=1e-6)
    coeff = 1.0 / (expected + 1e-6)
    sd = opt.state_dict()["params"]
    torch.testing.assert_close(sd[0]["exp_avg"], 0.1 * coeff * full_w[4 * state.tp_rank : 4 * state.tp_rank + 4])
    torch.testing.assert_close(sd[1]["exp_avg"], 0.1 * coeff * full_b)
    return res.grad_norm


@pytest.mark.slow
def test_grad_norm_on_tp2_equals_unsharded_norm_and_clips():
    a, b = run_distributed(2, _tp_norm)
    assert a == b


def _pp_shared_embedding(rank, world_size):
    state = ParallelState.build(ParallelConfig(pipeline_model_parallel_size=2))
    gen = torch.Generator().manual_seed(7)
    emb_grad, w0, w1 = (torch.randn(s, generator=gen) for s in ((6, 4), (4, 4), (4, 4)))
    emb, layer = nn.Parameter(torch.zeros(6, 4)), nn.Parameter(torch.zeros(4, 4))
    emb.main_grad, layer.main_grad = emb_grad.clone(), (w0 if state.pp_rank == 0 else w1).clone()
    if state.is_last_stage:
        emb.shared_embedding_copy = True
    opt = build_optimizer([("emb", emb), ("layer", layer)], _cfg(), state)
    expected = math.sqrt(sum(float(t.square().sum()) for t in (emb_grad, w0, w1)))
    res = opt.step()
    assert res.grad_norm == pytest.approx(expected, rel=1e-6)
    return True


@pytest.mark.slow
def test_shared_embedding_copy_not_double_counted():
    assert run_distributed(2, _pp_shared_embedding) == [True, True]


def _zero_fp16_overflow(rank, world_size):
    state = ParallelState.build(ParallelConfig())
    named = _params(torch.float16)
    opt = build_optimizer(named, _cfg(fp16=True, hysteresis=1, use_distributed_optimizer=True), state)
    _set_grads(named, 0, scale=opt.loss_scale)
    named[-1][1].main_grad[-1] = float("inf")  # lies in DP rank 1's shard only
    before = [p.detach().clone() for _, p in named]
    res = opt.step()
    assert all(torch.equal(p.detach(), b) for (_, p), b in zip(named, before))
    return res.successful, res.loss_scale


@pytest.mark.slow
def test_zero1_overflow_seen_by_one_shard_skips_everywhere():
    assert run_distributed(2, _zero_fp16_overflow) == [(False, 2.0**31)] * 2


def test_decoupled_lr_groups_hold_the_word_embedding_and_output_layer():
    """--decoupled-lr's parameters are the word embedding and the output layer (Megatron's
    is_embedding_or_output_parameter), with or without weight decay as before; the rest take --lr."""
    from megatron_bmw.models.chunk import ModelChunk, build_units
    from tests.reference import SEED, small_config

    model = ModelChunk(build_units(small_config(untie_embeddings_and_output_weights=True), ParallelState.serial(),
                                   SEED))
    opt = build_optimizer(list(model.named_parameters()), _cfg(), ParallelState.serial())
    opt.set_lr(1e-3, 5e-3)
    names = {id(p): n for n, p in model.named_parameters()}
    by_lr = {}
    for group in opt._inner.param_groups:
        for p in group["params"]:
            by_lr.setdefault(group["lr"], set()).add(names[id(p)])
            assert group["weight_decay"] == (0.1 if p.ndim == 2 else 0.0)
    assert by_lr[5e-3] == {"units.embedding.word_embeddings.weight", "units.head.output_weight"}
    assert len(by_lr[1e-3]) == len(names) - 2
    opt.set_lr(2e-3)
    assert {g["lr"] for g in opt._inner.param_groups} == {2e-3}


def _decoupled_run(rank, world_size, extra):
    from tests.training.test_pretrain import _layouts_case

    return [h[1] for h in _layouts_case(rank, world_size, ["--lr-warmup-iters", "0", "--decoupled-lr", "2e-2",
                                                           "--decoupled-min-lr", "1e-3"] + extra)]


@pytest.mark.slow
def test_decoupled_lr_trains_alike_on_pp2_and_zero1():
    """The tied word embedding's copy on the last pipeline stage takes the decoupled rate too (the copies stay
    equal), and ZeRO-1 shards put it in the right group: pp2 and dp2 ZeRO-1 give the serial losses, which differ
    from a run without --decoupled-lr."""
    from tests.training.test_pretrain import _layouts_case

    serial = run_distributed(1, _decoupled_run, [])[0]
    plain = [h[1] for h in run_distributed(1, _layouts_case, ["--lr-warmup-iters", "0"])[0]]
    assert serial[0] == plain[0] and serial[2] != pytest.approx(plain[2], rel=1e-4)
    for extra in (["--pipeline-model-parallel-size", "2"], ["--use-distributed-optimizer"]):
        assert run_distributed(2, _decoupled_run, extra)[-1] == pytest.approx(serial, rel=1e-5), extra
