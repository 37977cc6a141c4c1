"""Forward FLOPs of each unit kind (matrix multiplications; 2 FLOPs per multiply-add), per tensor-parallel rank."""

from __future__ import annotations

from ..config import ModelConfig


def unit_forward_flops(kind: str, model: ModelConfig, micro_batch_size: int, tp: int = 1) -> float:
    s, b, h, f, v = model.seq_length, micro_batch_size, model.hidden_size, model.ffn_hidden_size, model.vocab_size
    tokens = s * b
    bert = model.model_type == "bert"
    if kind == "embedding":  # lookups, the position (and token-type) add and dropout: elementwise
        return (4.0 if model.num_tokentypes else 3.0) * tokens * h
    if kind == "attention":  # QKV (grouped queries: fewer key and value rows), the core, the output projection
        return (2.0 * tokens * h * model.qkv_rows + 2.0 * tokens * h * h + 4.0 * s * tokens * h) / tp
    if kind == "mlp":  # SwiGLU's fc1 makes gate and up
        return 2.0 * tokens * h * (model.fc1_rows + f) / tp
    if kind == "moe":
        return moe_forward_flops(model, micro_batch_size, tp)
    if kind == "head" and bert:  # logits; the LM dense, pooler and sentence-order layers on every tp rank
        extra = 2.0 * b * h * (h + 2) if model.bert_binary_head else 0.0
        return 2.0 * tokens * h * v / tp + 2.0 * tokens * h * h + extra
    if kind == "head":
        return 2.0 * tokens * h * v / tp
    raise ValueError(f"unknown unit kind {kind!r}")


def unit_weight_grad_flops(kind: str, model: ModelConfig, micro_batch_size: int, tp: int = 1) -> float:
    """FLOPs of the unit's deferred weight gradients (parallel/deferred_wgrad.py: a split backward's W), one GEMM
    per linear layer as large as its forward: QKV and projection, fc1 and fc2, the logits (not BERT's LM dense)."""
    s, b, h = model.seq_length, micro_batch_size, model.hidden_size
    tokens = s * b
    if kind == "attention":
        return 2.0 * tokens * h * (model.qkv_rows + h) / tp
    if kind == "mlp":
        return 2.0 * tokens * h * (model.fc1_rows + model.ffn_hidden_size) / tp
    if kind == "moe":  # the experts' and shared experts' (the router's stays in B)
        moe = model.moe
        return moe_forward_flops(model, micro_batch_size, tp) - 2.0 * tokens * h * moe.num_experts / tp
    if kind == "head":
        return 2.0 * tokens * h * model.vocab_size / tp
    if kind == "embedding":
        return 0.0
    raise ValueError(f"unknown unit kind {kind!r}")


def moe_forward_flops(model: ModelConfig, micro_batch_size: int, tp: int = 1) -> float:
    """An MoE unit's forward FLOPs per rank at even routing (moe_model.py: a rank's experts receive etp T k tokens,
    T = s b / tp under sequence parallelism, over F/etp columns: the same as k dense MLPs of the expert FFN over tp):
    the router (s b E h / tp multiply-adds), k experts per token, the shared experts."""
    moe, h = model.moe, model.hidden_size
    tokens = model.seq_length * micro_batch_size
    f = model.moe_ffn_hidden_size
    rows = 2 * f if model.swiglu else f
    shared = moe.shared_expert_intermediate_size or 0
    shared_rows = 2 * shared if model.swiglu else shared
    return 2.0 * tokens * h * (moe.num_experts + moe.router_topk * (rows + f) + shared_rows + shared) / tp


def core_attention_share(model: ModelConfig) -> float:
    """Fraction of an attention unit's forward FLOPs spent in the softmax(QK^T)V core (what selective
    recomputation repeats)."""
    s, h = model.seq_length, model.hidden_size
    core = 4.0 * s * h
    return core / (2.0 * h * (model.qkv_rows + h) + core)


def core_attention_flops(model: ModelConfig, micro_batch_size: int, tp: int = 1) -> float:
    """Forward FLOPs of the softmax(QK^T)V core of one attention unit per tensor-parallel rank (the scores and the
    context: 4 s^2 b h / t, as unit_forward_flops counts them)."""
    return 4.0 * model.seq_length * model.seq_length * micro_batch_size * model.hidden_size / tp


def cp_tile_flops(model: ModelConfig, micro_batch_size: float, tp: int, cp: int) -> float:
    """Forward FLOPs of the context-parallel core on one cp rank as the runtime computes it
    (parallel/context_parallel.py with parallel/cp_blocks.py, p2p and a2a alike): the rank's n/t heads x s/C query
    rows against the whole sequence, pair by pair, an aligned-causal pair computing only its visible half (the fused
    kernels skip the masked half; the tiled math path reads only the keys a row tile can see) and an unmasked pair
    whole: 1/C of the causal scores, (s/C)^2 C/2 per head, 4 d FLOPs each (QK^T and PV)."""
    rows = model.seq_length / cp
    return 4.0 * micro_batch_size * (model.num_attention_heads // tp) * model.head_dim * rows * rows * cp / 2