"""Memory-bound work per unit: the bytes each elementwise kernel of a unit reads and writes, forward and backward,
on one tensor-parallel rank. Torch-free. The cost model divides them by the device's memory bandwidth; the
matrix products (their operands included) are kernel_time.py's.

Kernels are counted as Megatron fuses them: LayerNorm/RMSNorm one pass, the bias folded into the GEMM, the
scale-mask-softmax one kernel, bias-GeLU (or SwiGLU, unless --no-bias-swiglu-fusion) one kernel, rope one kernel
(unless --no-rope-fusion), bias-dropout-add one kernel. Notation as in
memory_model.py: s sequence, b micro-batch, h hidden, a heads, g query groups, d head dimension, f FFN size,
v padded vocabulary, t tensor-parallel size, e bytes per element; H = s'bh elements of the hidden state on a rank
(s' = s/t with sequence parallelism, else s: LayerNorm and dropout-add run on every tp rank).

  norm           forward reads x, writes y (2He); backward reads x and dy, writes dx (3He).
  residual join  backward: the branch's gradient and the skip gradient summed (read 2He, write He).
  dropout-add    forward reads the branch and the residual, writes the sum (3He) and, with dropout, a one-byte
                 mask (H); backward reads dy and the mask and writes the branch's gradient (2He + H); a bias's
                 gradient reads dy once more (He).
  unfused core   S = b a s^2 / t scores: softmax reads and writes them (2Se), attention dropout reads and writes
                 them and writes a mask (2Se + S); backward: dropout 2Se + S, softmax reads probabilities and
                 gradient and writes one (3Se); the context [b a s d] is copied into [s b h] (2sbh/t e each way).
                 The fused flash kernel does all of this on chip: nothing here.
  rope, qk norm  over q and k (X = s b (a + g) d / t elements): fused rope (models/fused_ops.py, the default) reads
                 and writes them each way; unfused (--no-rope-fusion: models/rotary.py's ops, `_rope`) over the
                 n = X r/d rotated elements in fp32 (c = 4 bytes) 10 n c each way, with 16-bit inputs the casts
                 (forward 3 n e + 3 n c, backward 6 n e), and autograd's slicing of the rotated part (forward with
                 r < d the concatenation 2 X e; backward 3 X e, 7 X e with r < d); the norm as above.
  grouped query  k and v repeated over each group's heads (read 2sbgd/t, write 2sbad/t) and summed back.
  MLP            bias-GeLU reads and writes fc1's output F = sb f/t (2Fe; backward reads input and gradient,
                 writes one: 3Fe, plus Fe for fc1's bias gradient); SwiGLU fused reads 2F, writes F (backward reads
                 2F and F, writes 2F), unfused (--no-bias-swiglu-fusion) silu and the product 5F forward, 13F
                 backward (two products' gradients 6F, silu's 3F, [gate; up]'s concatenation 4F); squared ReLU,
                 relu and the square as two kernels: 4Fe forward, 10Fe backward (`_activation`).
  MoE            the norm, the experts' activation as the MLP's over the k copies of each token at the expert FFN
                 size, the shared experts' as an MLP's, dropout-add; the router's softmax/top-k over T E fp32 scores
                 (read the logits, write the probabilities: 8 T E each way; T = s'b); the permutation copying the
                 T k routed copies (2 T k h e each way) and the combine weighting and summing them back (3 T k h e
                 forward, read dy and write 2 gradients backward); at even routing (moe_model.py).
  head           the final norm (BERT's LM head adds its GeLU and LayerNorm on [s'b, h]) and the vocab-parallel
                 cross entropy over L = sb v/t logits as parallel/cross_entropy.py computes it: forward casts
                 to fp32 (Le + 4L), max (4L), subtract (8L), exp (8L), sum (4L), normalise (8L); backward scales
                 the saved softmax in place (8L) and casts back (4L + Le). Fused (--cross-entropy-loss-fusion,
                 parallel/fused_cross_entropy.py), as inductor compiles each chunk's body on CUDA: forward the
                 row maximum (Le) and the sum of exponentials (Le); backward reads the logits and writes their
                 gradient in place (2Le). (Run eagerly, without triton, each fp32 operation is a pass of its own.)
  embedding      the dropout (as above) and, in backward, the word table's dense gradient [v/t, h]: written
                 zero-filled, read into the gradient buffer (grad_bytes per element, read and written); the
                 learned positions likewise over their rows. The lookups themselves are kernel_time.py's.
"""

from __future__ import annotations

from ..config import ModelConfig

MASK = 1  # bytes per element of a dropout mask (bool)
FP32 = 4


def _dropout_add(hidden: float, e: int, dropout: bool, bias: bool) -> tuple[float, float]:
    fwd = 3 * hidden * e + (hidden * MASK if dropout else 0)
    bwd = (2 * hidden * e + hidden * MASK if dropout else 0) + (hidden * e if bias else 0)
    return fwd, bwd


def _norm(hidden: float, e: int) -> tuple[float, float]:
    return 2 * hidden * e, 3 * hidden * e + 3 * hidden * e  # backward: the norm, then the residual join


def _attention(model: ModelConfig, b: int, tp: int, rows: float, e: int) -> tuple[float, float]:
    s, h, d = model.seq_length, model.hidden_size, model.head_dim
    heads, groups = model.num_attention_heads / tp, model.query_groups / tp
    hidden = rows * b * h
    fwd, bwd = _norm(hidden, e)
    qk = s * b * (heads + groups) * d
    if model.qk_layernorm:
        fwd, bwd = fwd + 2 * qk * e, bwd + 3 * qk * e
    if model.position_embedding_type == "rope":
        f1, b1 = _rope(model, qk, e)
        fwd, bwd = fwd + f1, bwd + b1
    if groups < heads:
        kv = 2 * s * b * d * (heads + groups) * e
        fwd, bwd = fwd + kv, bwd + kv
    if not model.flash_attention:
        scores = b * heads * s * s
        fwd += 2 * scores * e
        bwd += 3 * scores * e
        if model.attention_dropout > 0:
            fwd += 2 * scores * e + scores * MASK
            bwd += 2 * scores * e + scores * MASK
        context = 2 * s * b * h / tp * e
        fwd, bwd = fwd + context, bwd + context
    if model.add_bias_linear or model.add_qkv_bias:
        bwd += s * b * model.qkv_rows / tp * e
    f2, b2 = _dropout_add(hidden, e, model.hidden_dropout > 0, model.add_bias_linear)
    return fwd + f2, bwd + b2


def _mlp(model: ModelConfig, b: int, tp: int, rows: float, e: int) -> tuple[float, float]:
    hidden = rows * b * model.hidden_size
    fwd, bwd = _norm(hidden, e)
    f = model.seq_length * b * model.ffn_hidden_size / tp
    f1, b1 = _activation(f, e, model.swiglu, model.add_bias_linear, model.squared_relu, model.bias_swiglu_fusion)
    fwd, bwd = fwd + f1, bwd + b1
    f2, b2 = _dropout_add(hidden, e, model.hidden_dropout > 0, model.add_bias_linear)
    return fwd + f2, bwd + b2


def _rope(model: ModelConfig, qk: float, e: int) -> tuple[float, float]:
    """Bytes rope moves over the qk elements of q and k (module doc): fused one pass each way; unfused the fp32 ops
    over the rotated part, the casts of 16-bit inputs and autograd's slicing."""
    if model.apply_rope_fusion:
        return 2 * qk * e, 2 * qk * e
    n, partial, cast = qk * model.rotary_dim / model.head_dim, model.rotary_dim < model.head_dim, e != FP32
    fwd = 10 * n * FP32 + (3 * n * e + 3 * n * FP32 if cast else 0) + (2 * qk * e if partial else 0)
    bwd = 10 * n * FP32 + (6 * n * e if cast else 0) + (7 if partial else 3) * qk * e
    return fwd, bwd


def _activation(f: float, e: int, swiglu: bool, bias: bool, squared: bool = False,
                fused: bool = True) -> tuple[float, float]:
    """Bytes the MLP's activation moves over f elements: GeLU reads and writes f (backward: reads the gradient and
    the input, writes one); SwiGLU fused 3 and 5, unfused 5 and 13; squared ReLU, relu then the square
    (torch.pow(relu(x), 2), two kernels): 4 forward, and backward the square's pow_backward (x^1 copied: 2,
    doubled: 2, times the gradient: 3) and relu's threshold_backward (3): 10; a bias's gradient reads fc1's
    output gradient."""
    if swiglu:
        fwd, bwd = (3 * f * e, 5 * f * e) if fused else (5 * f * e, 13 * f * e)
    else:
        fwd, bwd = (4 * f * e, 10 * f * e) if squared else (2 * f * e, 3 * f * e)
    return fwd, bwd + ((2 * f if swiglu else f) * e if bias else 0)


def _moe(model: ModelConfig, b: int, tp: int, rows: float, e: int) -> tuple[float, float]:
    moe, h = model.moe, model.hidden_size
    hidden = rows * b * h
    tokens = rows * b
    copies = tokens * moe.router_topk
    fwd, bwd = _norm(hidden, e)
    f1, b1 = _activation(copies * model.moe_ffn_hidden_size, e, model.swiglu, model.add_bias_linear,
                         model.squared_relu, model.bias_swiglu_fusion)
    scores = 2 * tokens * moe.num_experts * FP32  # the router's fp32 scores, read and written
    fwd, bwd = fwd + f1 + scores, bwd + b1 + scores
    fwd, bwd = fwd + 5 * copies * h * e, bwd + 5 * copies * h * e
    shared = moe.shared_expert_intermediate_size
    if shared:
        f2, b2 = _activation(model.seq_length * b * shared / tp, e, model.swiglu, model.add_bias_linear,
                             model.squared_relu, model.bias_swiglu_fusion)
        fwd, bwd = fwd + f2, bwd + b2
    f3, b3 = _dropout_add(hidden, e, model.hidden_dropout > 0, model.add_bias_linear)
    return fwd + f3, bwd + b3


def _head(model: ModelConfig, b: int, tp: int, rows: float, e: int) -> tuple[float, float]:
    hidden = rows * b * model.hidden_size
    fwd, bwd = 2 * hidden * e, 3 * hidden * e
    if model.model_type == "bert":  # the LM head's GeLU and LayerNorm
        fwd, bwd = fwd + 4 * hidden * e, bwd + 6 * hidden * e
    logits = model.seq_length * b * model.vocab_size / tp
    if model.cross_entropy_loss_fusion:  # the row maximum, then one kernel per chunk each way
        return fwd + 2 * logits * e, bwd + 2 * logits * e
    fwd += logits * (e + 9 * FP32)
    bwd += logits * (3 * FP32 + e)
    return fwd, bwd


def _embedding(model: ModelConfig, b: int, tp: int, rows: float, e: int, grad_bytes: int) -> tuple[float, float]:
    hidden = rows * b * model.hidden_size
    fwd = bwd = 0.0
    if model.hidden_dropout > 0:
        fwd, bwd = 2 * hidden * e + hidden * MASK, 2 * hidden * e + hidden * MASK
    table_rows = model.vocab_size / tp
    if model.position_embedding_type == "learned_absolute":
        table_rows += model.max_position_embeddings
    bwd += table_rows * model.hidden_size * (2 * e + 2 * grad_bytes)
    return fwd, bwd


def unit_elementwise_bytes(kind: str, model: ModelConfig, micro_batch_size: int, tp: int = 1, sp: bool = False,
                           grad_bytes: int = FP32) -> tuple[float, float]:
    """(forward, backward) bytes the unit's memory-bound kernels move on one tensor-parallel rank (module doc);
    `grad_bytes` per element of the gradient buffer the embedding's table gradient is added into."""
    e = model.dtype_bytes
    rows = model.seq_length / tp if sp else model.seq_length
    b = micro_batch_size
    if kind == "attention":
        return _attention(model, b, tp, rows, e)
    if kind == "mlp":
        return _mlp(model, b, tp, rows, e)
    if kind == "moe":
        return _moe(model, b, tp, rows, e)
    if kind == "head":
        return _head(model, b, tp, rows, e)
    if kind == "embedding":
        return _embedding(model, b, tp, rows, e, grad_bytes)
    raise ValueError(f"unknown unit kind {kind!r}")
