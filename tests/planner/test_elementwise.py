"""Elementwise traffic per unit: hand counts of the fused kernels, and how the bytes follow the model's shapes."""

from dataclasses import replace

import pytest

from megatron_bmw.config import ModelConfig
from megatron_bmw.planner.elementwise import unit_elementwise_bytes

GPT = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=32,
                  params_dtype="bf16")


def test_mlp_by_hand():
    s, b, h, f, e = 32, 2, 64, 256, 2
    hidden = s * b * h
    fwd = 2 * hidden * e + 2 * s * b * f * e + 3 * hidden * e + hidden  # norm, bias-GeLU, bias-dropout-add + mask
    bwd = 6 * hidden * e + (3 + 1) * s * b * f * e + 2 * hidden * e + hidden + hidden * e
    assert unit_elementwise_bytes("mlp", GPT, b) == (fwd, bwd)


def test_unfused_attention_by_hand_and_flash_has_no_scores():
    s, b, h, a, e = 32, 1, 64, 4, 2
    hidden = s * b * h
    unfused = replace(GPT, attention_backend="unfused")
    scores = b * a * s * s
    fwd = 2 * hidden * e + 2 * scores * e + 2 * scores * e + scores + 2 * hidden * e + 3 * hidden * e + hidden
    bwd = (6 * hidden * e + 3 * scores * e + 2 * scores * e + scores + 2 * hidden * e + 3 * hidden * e
           + 2 * hidden * e + hidden + hidden * e)
    assert unit_elementwise_bytes("attention", unfused, b) == (fwd, bwd)
    flash = unit_elementwise_bytes("attention", GPT, b)
    assert flash[0] == 2 * hidden * e + 3 * hidden * e + hidden
    # the scores grow with the square of the sequence, the rest linearly
    long = replace(unfused, seq_length=64, max_position_embeddings=64)
    grown = unit_elementwise_bytes("attention", long, b)[0] - 2 * unit_elementwise_bytes("attention", unfused, b)[0]
    assert grown == 2 * scores * (4 * e + 1)  # 4x the scores where the rest doubles
    no_dropout = replace(unfused, attention_dropout=0.0)
    assert unit_elementwise_bytes("attention", no_dropout, b)[0] == fwd - 2 * scores * e - scores


def test_tensor_and_sequence_parallel_split_the_right_parts():
    unfused = replace(GPT, attention_backend="unfused")
    for kind in ("attention", "mlp", "head"):
        one = unit_elementwise_bytes(kind, unfused, 2, 1)
        split = unit_elementwise_bytes(kind, unfused, 2, 2)
        sp = unit_elementwise_bytes(kind, unfused, 2, 2, sp=True)
        # without SP every rank normalises and adds the whole hidden state; the sharded parts halve
        assert one[0] / 2 < split[0] < one[0] and one[1] / 2 < split[1] < one[1]
        assert sp[0] == pytest.approx(one[0] / 2) and sp[1] == pytest.approx(one[1] / 2)


def test_llama_features_add_their_kernels():
    base = replace(GPT, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False)
    rope = replace(base, position_embedding_type="rope")
    gqa = replace(rope, num_query_groups=2)
    s, b, d = 32, 1, 16
    plain = unit_elementwise_bytes("attention", base, b)
    assert unit_elementwise_bytes("attention", rope, b)[0] - plain[0] == 2 * s * b * (4 + 4) * d * 2
    assert unit_elementwise_bytes("attention", gqa, b)[0] - plain[0] == (2 * s * b * (4 + 2) * d * 2  # rope
                                                                         + 2 * s * b * d * (4 + 2) * 2)  # repeat
    swiglu = replace(base, swiglu=True, ffn_hidden_size=128)
    gelu = replace(base, ffn_hidden_size=128)
    f = s * b * 128
    assert unit_elementwise_bytes("mlp", swiglu, b)[0] - unit_elementwise_bytes("mlp", gelu, b)[0] == f * 2
    assert unit_elementwise_bytes("mlp", swiglu, b)[1] - unit_elementwise_bytes("mlp", gelu, b)[1] == 2 * f * 2


def test_head_cross_entropy_and_embedding_table_gradient():
    s, b, h, v, e = 32, 2, 64, 256, 2
    logits = s * b * v
    fwd, bwd = unit_elementwise_bytes("head", GPT, b)
    assert fwd == 2 * s * b * h * e + logits * (e + 36)
    assert bwd == 3 * s * b * h * e + logits * (12 + e)
    # --cross-entropy-loss-fusion: the row maximum and one compiled kernel per chunk each way
    fused = unit_elementwise_bytes("head", replace(GPT, cross_entropy_loss_fusion=True), b)
    assert fused == (2 * s * b * h * e + 2 * logits * e, 3 * s * b * h * e + 2 * logits * e)
    # the word and position tables' dense gradient, added into an fp32 or a 16-bit gradient buffer
    fp32 = unit_elementwise_bytes("embedding", GPT, b, grad_bytes=4)[1]
    bf16 = unit_elementwise_bytes("embedding", GPT, b, grad_bytes=2)[1]
    assert fp32 - bf16 == (v + 32) * h * 2 * 2
    with pytest.raises(ValueError):
        unit_elementwise_bytes("router", GPT, b)


def test_unfused_swiglu_and_rope_move_more():
    """--no-bias-swiglu-fusion: silu and the product (5F forward, 13F backward) where the fused kernel moves 3F and
    5F; --no-rope-fusion: rotary.py's fp32 ops over the rotated part, the casts and autograd's slicing, where the
    fused kernel reads and writes q and k once each way."""
    base = replace(GPT, hidden_dropout=0.0, attention_dropout=0.0, add_bias_linear=False, swiglu=True,
                   ffn_hidden_size=128, position_embedding_type="rope", rotary_percent=0.5, num_query_groups=2)
    s, b, e = 32, 1, 2
    f, qk = s * b * 128, s * b * (4 + 2) * 16
    mlp = [unit_elementwise_bytes("mlp", m, b) for m in (base, replace(base, bias_swiglu_fusion=False))]
    assert (mlp[1][0] - mlp[0][0], mlp[1][1] - mlp[0][1]) == (2 * f * e, 8 * f * e)
    att = [unit_elementwise_bytes("attention", m, b) for m in (base, replace(base, apply_rope_fusion=False))]
    n = qk / 2  # half of each head rotated
    assert att[1][0] - att[0][0] == 10 * n * 4 + 3 * n * e + 3 * n * 4 + 2 * qk * e - 2 * qk * e
    assert att[1][1] - att[0][1] == 10 * n * 4 + 6 * n * e + 7 * qk * e - 2 * qk * e
