"""The whole GPT at tp=2 and tp=4 (with and without sequence parallelism and recomputation) equals tp=1."""

import pytest
import torch

from megatron_bmw.config import ModelConfig, ParallelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.units import unit_names
from megatron_bmw.parallel.grad_sync import GradSync
from megatron_bmw.parallel.state import ParallelState
from tests.dist_harness import run_distributed
from tests.reference import (LLAMA, QK_1P, SEED, expected_shard, make_batch, recompute_of, reference_name, serial_reference,
                             small_config, split_batch)

TOL = dict(rtol=1e-5, atol=1e-6)


def _batches(cfg):
    return split_batch(make_batch(cfg, 4, seed=7), 2)


def _tp_case(rank, world_size, overrides, sequence_parallel, ref_loss, ref_grads):
    cfg = small_config(**overrides)
    mbs = _batches(cfg)
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel))
    model = ModelChunk(build_units(cfg, st, SEED, recompute=recompute_of(overrides, cfg.num_layers)))
    sync = GradSync(list(model.parameters()), st)
    total = 0.0
    for mb in mbs:
        loss = model(None, mb) / len(mbs)
        loss.backward()
        total += loss.item()
    sync.finish()
    assert abs(total - ref_loss) <= 1e-5 * abs(ref_loss), (total, ref_loss)
    names = set()
    for name, p in model.named_parameters():
        full = ref_grads[reference_name(name, cfg)]
        torch.testing.assert_close(p.main_grad, expected_shard(full, p, st), **TOL, msg=lambda m: f"{name}: {m}")
        names.add(name)
    assert names == set(ref_grads)
    return total


CASES = [
    ({}, False),
    ({}, True),
    ({"recompute_granularity": "full"}, False),
    ({"recompute_granularity": "selective"}, True),
    ({"attention_backend": "flash", "untie_embeddings_and_output_weights": True}, False),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}, True),
]


# Llama-family layers over tensor parallelism: query groups split over tp (groups % tp == 0), SwiGLU's fc1 as
# [gate; up] split block by block, rope on a part of each head
LLAMA_CASES = [
    (2, {**LLAMA}, True),
    (2, {**LLAMA, "recompute_granularity": "selective", "attention_backend": "flash"}, False),
    (4, {**LLAMA, "num_query_groups": 4, "add_qkv_bias": True, "rotary_percent": 1.0}, True),
    # --qk-layernorm: each tp rank normalises its own heads, the q/k norm weights' gradients summed over tp
    (2, {**LLAMA, **QK_1P, "recompute_granularity": "selective"}, True),
    (2, {**LLAMA, "qk_layernorm": True, "normalization": "LayerNorm", "recompute_granularity": "full"}, False),
    # --squared-relu (Nemotron-4's MLP, no gating): fc1 split plainly over tp, biases off
    (2, {**LLAMA, "swiglu": False, "squared_relu": True}, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size,overrides,sequence_parallel",
                         [(ws, o, sp) for ws in (2, 4) for o, sp in CASES] + LLAMA_CASES)
def test_gpt_tensor_parallel_equals_serial(world_size, overrides, sequence_parallel):
    cfg = small_config(**overrides)
    ref_loss, ref_grads, _ = serial_reference(cfg, _batches(cfg))
    losses = run_distributed(world_size, _tp_case, overrides, sequence_parallel, ref_loss, ref_grads)
    assert len(set(losses)) == 1


def test_llama_layers_serial():
    """Rope depends on relative positions only; the fused and unfused attention agree under GQA and MQA; the
    layers hold what Megatron's do (no biases, no position table, RMSNorm weights only)."""
    from megatron_bmw.models.rotary import apply_rotary, rotary_angles

    q, k = torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8), torch.randn(1, 1, 1, 8).expand(1, 1, 6, 8)  # one q, k
    angles = rotary_angles(6, 8, 10000, None, torch.device("cpu"))
    scores = apply_rotary(q, angles) @ apply_rotary(k, angles).transpose(-1, -2)  # the same q and k at every position
    for offset in (1, 3):
        band = scores.diagonal(offset, -2, -1)
        assert torch.allclose(band, band[..., :1].expand_as(band), atol=1e-5)  # depends on the offset only
    assert not torch.allclose(scores.diagonal(1, -2, -1)[..., 0], scores.diagonal(3, -2, -1)[..., 0])
    for groups in (1, 2):
        cfgs = [small_config(**{**LLAMA, "num_query_groups": groups, "attention_backend": b}) for b in ("unfused", "flash")]
        batch = make_batch(cfgs[0], 2, seed=3)
        losses = [ModelChunk(build_units(c, ParallelState.serial(), SEED))(None, batch) for c in cfgs]
        torch.testing.assert_close(losses[0], losses[1], rtol=1e-5, atol=1e-6)
    names = {n for n, _ in ModelChunk(build_units(small_config(**LLAMA), ParallelState.serial(), SEED)).named_parameters()}
    assert "units.embedding.position_embeddings" not in names and not any(n.endswith(".bias") for n in names)
    assert "units.attn_0.qkv.weight" in names and "units.head.final_layernorm.weight" in names
    qkv = dict(ModelChunk(build_units(small_config(**LLAMA), ParallelState.serial(), SEED)).named_parameters())
    assert qkv["units.attn_0.qkv.weight"].shape == ((4 + 2 * 2) * 8, 32)  # 4 query heads, 2 groups, head dim 8
    assert qkv["units.mlp_0.fc1.weight"].shape == (2 * 48, 32)  # SwiGLU: gate and up


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_qk_layernorm_and_zero_centred_norms_serial(normalization):
    """--qk-layernorm normalises every query and key head over the head dimension (Megatron's q_layernorm and
    k_layernorm, one weight of the head size each); --apply-layernorm-1p stores every norm weight as gamma - 1 and
    equals the plain model holding gamma."""
    over = {**LLAMA, "normalization": normalization, "qk_layernorm": True}
    plain = ModelChunk(build_units(small_config(**over), ParallelState.serial(), SEED))
    params = dict(plain.named_parameters())
    assert params["units.attn_0.q_layernorm.weight"].shape == params["units.attn_0.k_layernorm.weight"].shape == (8,)
    seen = {}
    attn = plain.units["attn_0"]
    attn.q_layernorm.register_forward_hook(lambda m, i, o: seen.setdefault("q", (i[0], o)) and None)
    attn.k_layernorm.register_forward_hook(lambda m, i, o: seen.setdefault("k", (i[0], o)) and None)
    batch = make_batch(small_config(**over), 2, seed=3)
    plain(None, batch)
    assert seen["q"][1].shape == (2, 4, 8, 8) and seen["k"][1].shape == (2, 2, 8, 8)  # [b, heads or groups, s, d]
    for x, y in seen.values():  # unit weights: each head normalised over its 8 dimensions
        if normalization == "LayerNorm":
            x = x - x.mean(-1, keepdim=True)
        torch.testing.assert_close(y, x / (x.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt(), rtol=1e-5, atol=1e-6)
    one_p = ModelChunk(build_units(small_config(**over, apply_layernorm_1p=True), ParallelState.serial(), SEED))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in one_p.named_parameters():
            if "layernorm" in name:
                assert not p.any()  # zero-centred: gamma 1 at initialisation
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
                params[name].copy_(p + 1 if name.endswith(".weight") else p)
    torch.testing.assert_close(one_p(None, batch), plain(None, batch), rtol=1e-6, atol=1e-6)


def test_units_and_layout_independent_init():
    cfg = small_config(num_layers=3)
    assert unit_names(3) == ["embedding", "attn_0", "mlp_0", "attn_1", "mlp_1", "attn_2", "mlp_2", "head"]
    full = ModelChunk(build_units(cfg, ParallelState.serial(), SEED))
    part = ModelChunk(build_units(cfg, ParallelState.serial(), SEED, indices=[3, 4]))
    for name, p in part.named_parameters():
        assert torch.equal(p, dict(full.named_parameters())[name])


def test_dropout_recompute_replays_masks():
    cfg = small_config(hidden_dropout=0.2, attention_dropout=0.2)
    batch = make_batch(cfg, 2, seed=1)
    grads = []
    for granularity in (None, "full", "selective"):
        st = ParallelState.serial()
        st.rng.add("model-parallel-rng", 99)
        torch.manual_seed(5)
        model = ModelChunk(build_units(cfg, st, SEED,
                                     recompute=recompute_of({"recompute_granularity": granularity}, cfg.num_layers)))
        model(None, batch).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, **TOL)


def test_tp_must_divide_heads():
    cfg = small_config(num_attention_heads=4, hidden_size=32)
    with pytest.raises(UsageError, match="does not divide --num-attention-heads"):
        cfg.check_tensor_parallel(3)
    with pytest.raises(UsageError, match="not divisible by --num-attention-heads"):
        ModelConfig(hidden_size=30, num_attention_heads=4)


def test_squared_relu_activation():
    """--squared-relu: relu(x)^2 and its gradient 2 relu(x); the MLP uses it in place of GeLU (fc1 not doubled),
    and --swiglu with it is refused in one line."""
    from megatron_bmw.errors import UsageError
    from megatron_bmw.models.gpt import squared_relu

    x = torch.tensor([-2.0, -0.5, 0.0, 0.5, 3.0], requires_grad=True)
    y = squared_relu(x)
    torch.testing.assert_close(y, torch.tensor([0.0, 0.0, 0.0, 0.25, 9.0]))
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.tensor([0.0, 0.0, 0.0, 1.0, 6.0]))
    cfg = small_config(squared_relu=True)
    units = build_units(cfg, ParallelState.serial(), SEED)
    mlp = units["mlp_0"]
    assert mlp.fc1.weight.shape == (cfg.ffn_hidden_size, cfg.hidden_size)
    h = torch.randn(8, 2, cfg.hidden_size)
    x = mlp.post_attention_layernorm(h)
    expected = h + mlp.fc2(torch.relu(mlp.fc1(x)) ** 2)
    torch.testing.assert_close(mlp.compute(h, {}), expected)
    with pytest.raises(UsageError, match="--squared-relu and --swiglu"):
        small_config(squared_relu=True, swiglu=True)


@pytest.mark.parametrize("overrides", [{}, {**LLAMA}, {"model_type": "bert"}])
def test_cross_entropy_loss_fusion_serial(monkeypatch, overrides):
    """--cross-entropy-loss-fusion: the serial model's loss and every parameter gradient equal the unfused one's
    at fp32 (GPT tied, a Llama-style GPT untied, BERT's LM head), the loss worked over chunks of 5 tokens (16 per
    micro-batch: a ragged last one)."""
    from dataclasses import replace

    from megatron_bmw.parallel import fused_cross_entropy
    from tests.models.bert_reference import bert_batch, bert_config, split_micro

    monkeypatch.setattr(fused_cross_entropy, "CROSS_ENTROPY_CHUNK_BYTES", 5 * 64 * 4)
    bert = overrides.get("model_type") == "bert"
    cfg = bert_config() if bert else small_config(**overrides)
    batches = split_micro(bert_batch(cfg, 4, seed=7), 2) if bert else _batches(cfg)
    ref_loss, ref_grads, _ = serial_reference(cfg, batches)
    loss, grads, model = serial_reference(replace(cfg, cross_entropy_loss_fusion=True), batches)
    assert model.units["head"].cross_entropy_loss_fusion
    assert loss == pytest.approx(ref_loss, rel=1e-6, abs=1e-7)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")
