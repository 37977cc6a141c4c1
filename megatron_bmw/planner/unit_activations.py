"""What one unit holds in activations, per micro-batch on one tensor-parallel rank: the tensors it saves for
backward, what a split backward's B keeps from them for W, and the buffers its backward allocates beside them.
memory_model.py adds up a rank's units under the schedule.

Activations are counted tensor by tensor from what OUR units save for backward (models/gpt.py), so the model
can be checked byte for byte against saved-tensor hooks (tests/planner/test_memory_model.py). Notation:
s sequence, b micro-batch, h hidden, a heads, f ffn, v padded vocabulary, t tensor-parallel size, e bytes per
element of the parameter dtype; with sequence parallelism the hidden state between units has s/t rows.

Per unit, no recomputation (flash = fused SDPA kernel, unfused = explicit softmax):
  attention  LN input s'bh e, LN statistics 2 s'b, QKV input (the LN output; with SP only its sequence part,
             re-gathered in backward) s'bh e, QKV output 3sbh/t e (kept through the q/k/v views), the core
             (below), the context copy sbh/t e fed to the output projection, and the dropout mask s'bh.
    unfused core: softmax output ab s^2/t e (computed in fp32, kept in e, as Megatron's fused kernel), and
             with attention dropout its mask and the dropped probabilities in e.
    flash core: the log-sum-exp abs/t x 4 (its output, laid out like q, is the context itself).
  mlp        LN input and statistics, FC1 input s'bh e, GeLU input and output 2 sbf/t e, dropout mask s'bh.
  embedding  token ids (int64; with t > 1 the masked local ids and the out-of-range mask), position ids and
             the dropout mask s'bh.
  head       LN input and statistics, the logits' input s'bh e, the fp32 softmax sbv/t x 4 of the vocab-parallel
             cross entropy, its local targets (int64) and out-of-range mask, the loss mask and the divisor.
             With --cross-entropy-loss-fusion (parallel/fused_cross_entropy.py) the loss keeps the logits
             themselves, sbv/t e, and per token the fp32 row maximum and sum of exponentials (2 sb x 4) where the
             softmax was; its forward and backward work over chunks of tokens, each upcast to one fp32 buffer of
             units.cross_entropy_chunk_tokens rows (at most units.CROSS_ENTROPY_CHUNK_BYTES, 64 MiB): the head's
             transient (`unit_backward_bytes`), where the unfused 16-bit head's backward casts sbv/t e.
BERT (model_type "bert", models/bert.py) adds to the embedding the token-type ids (int64), to a flash attention
unit the padding mask the kernel takes as an additive bias, b s e, and has its own head: the final LayerNorm
(input and statistics), the LM head's dense input s'bh e, GeLU input s'bh e, LayerNorm (input and statistics),
the logits' input s'bh e, the vocab-parallel cross entropy as GPT's, the loss mask and the two loss divisors;
with the binary head the pooler's input bh e (with SP only: the gathered first token; else it is a view of the
dense input), its tanh output bh e, and the sentence-order log-probabilities 2b x 4, labels (int64) and weight.
Llama-family units (models/gpt.py): RMSNorm keeps its input and the fp32 reciprocal RMS on "cuda" (the fused
kernel); on "cpu" the composite computes in fp32 and keeps the upcast input, the reciprocal RMS and the normalized
input, all fp32. Rope fused (models/fused_ops.py, the default) keeps one fp32 angles tensor for queries and keys
(s r x 4, r the rotated dims); unfused (--no-rope-fusion) cos and sin for each (4 s r x 4); either makes new
rotated q and k (v stays a view of the QKV output); with rope over part of the head, the fused attention
kernel's output is laid out by head and the projection's input is a copy of it. Grouped queries: k and v repeated over each group's
heads (sbh/t e each) and q copied out of the grouped rows (a view, keeping the whole QKV output, where a rank holds
one group and the core takes q as it is). SwiGLU keeps fc1's output (gate and up, 2 sbf/t e) and the product
(sbf/t e), and unfused (--no-bias-swiglu-fusion) silu(gate) too (sbf/t e), where GeLU keeps its input and output; squared ReLU (relu(x)^2, --squared-relu) keeps
relu's output (which the square keeps as its input) and the square's (sbf/t e each): GeLU's bytes. Biases change no saved tensor.
Context parallelism (cp = C > 1; the runtime's contract, models/gpt.py with parallel/context_parallel.py): every
unit holds what it holds for the rank's local sequence s/C (s is s/C everywhere above; with SP the hidden state
between units has s/(C t) rows). Attention differs: rope's cos and sin are taken at the rank's global positions
(the same shapes, s/C x r); k and v are NOT repeated over a group's heads (the core takes the grouped k, v); the
core is the context-parallel attention, nothing of size s^2 whatever the attention backend. The p2p ring saves
exactly the q, k, v it is given (the rotated q and k, v a view of the QKV output; without rope or q/k norms views
of the QKV output, except q, a copy sbh/(Ct) e, where a rank holds several groups of several query heads: the
grouped rows cannot be viewed as [b, a/t, s/C, d]), its output o [b, a/t, s/C, d] in e and the log-sum-exp
b a/t s/C x 4. The a2a core saves q, k, v as its all-to-all re-lays them (q [b, a/(tC), s, d]: sbh/(Ct) e; k and
v [b, m/C, s, d], m = lcm(g/t, C), each kv head repeated m t/g times first where C does not divide g/t: the
grouped k's bytes times m t/g each), not the given ones, its output [b, a/(tC), s, d] in e and the log-sum-exp
b a/(tC) s x 4 (the same bytes as the ring's). Under selective recomputation the checkpoint keeps the core's
inputs as given (the ring's q, k, v) for either exchange. The context copy fed to the projection stays. The
core's transient buffers (in flight, not saved) are `cp_attention_buffers`' (cp_buffers.py).
An MoE unit ("moe", units.unit_kind_of) saves what moe_model.py lists, for the busiest rank of an expert layout.
Selective recomputation keeps the attention unit minus its core (BERT: plus the core's input padding mask, b s
bool); full recomputation keeps the unit's input.
Zero-bubble schedules split a backward into B (input gradients) and W (the linear layers' weight gradients,
parallel/deferred_wgrad.py). B frees what the unit saved except what W needs, which it keeps until W: per linear
layer its input and its output gradient (attention: QKV input s'bh, QKV gradient 3sbh/t, context sbh/t,
projection gradient sbh; MLP: fc1 input s'bh, fc1 gradient sbf/t (2 sbf/t SwiGLU), fc2 input sbf/t, fc2
gradient sbh; head: logits input s'bh and gradient sbv/t; all in e; the row-parallel layers' output gradients
cover the whole sequence). Recomputation changes none of it: B rebuilds the inputs and W keeps them.

Megatron-core and NeMo (`te`: EngineConfig.megatron_core_runtime) run Transformer Engine's modules, whose flash
attention unit without recomputation, on "cuda" without context parallelism or q/k norms, saves less than ours:
TE's LayerNormLinear keeps its input and its output ln_out (with SP both the rank's s/t rows; ln_out is re-gathered
in backward), as ours; the fused rope (Megatron's apply_rope_fusion, on by default) keeps only the model chunk's
shared frequencies, nothing per layer; the fused core (cuDNN or flash-attn) keeps q, k and v as it takes them,
contiguous, k and v at their grouped size sbh g/(a t) e each (not repeated over a group's heads), its output (the
projection's input) and the fp32 softmax statistics b a/t s; the row-parallel projection keeps its input, that
output. The MLP (TE linears around Megatron's activation) saves what ours does.
Device kinds: on "cuda" a dropout mask is bool (1 byte) and LayerNorm statistics are fp32; on "cpu" dropout
keeps its scaled noise in the tensor's dtype and LayerNorm statistics are in that dtype, and SDPA with
dropout falls back to a math path (q, k, v copies and three s^2 tensors, in fp32 for 16-bit inputs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import UsageError
from ..units import ALL_UNIT_KINDS, RECOMPUTE, cross_entropy_chunk_tokens
from .cp_buffers import cp_attention_buffers
from .moe_model import (Experts, activation_backward_factor, default_experts, local_tokens, moe_backward_bytes,
                        moe_saved)

DEVICE_KINDS = ("cuda", "cpu")
_INT64, _BOOL, _FP32 = 8, 1, 4


@dataclass(frozen=True)
class SavedTensor:
    """One tensor a unit keeps for backward (per micro-batch, per rank)."""

    name: str
    numel: int
    itemsize: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def unit_saved_tensors(kind: str, model: ModelConfig, micro_batch_size: int, tp: int = 1, sp: bool = False,
                       recompute: str | None = None, device: str = "cuda", cp: int = 1,
                       cp_comm: str = "p2p", experts: Experts | None = None, te: bool = False) -> list[SavedTensor]:
    """The tensors one unit of `kind` saves for backward for one micro-batch on one tensor-parallel rank (of
    context-parallel size `cp`: its s/cp tokens; `cp_comm` the cp attention's exchange, p2p or a2a; an MoE unit's
    on the busiest rank of expert layout `experts`, moe_model.py: by default ep 1, etp = tp, even routing; `te`:
    Transformer Engine's attention as Megatron-core and NeMo run it, see the module doc)."""
    _check_cp(model, cp)
    if cp_comm not in ("p2p", "a2a"):
        raise UsageError(f"the context-parallel exchange must be p2p or a2a, not {cp_comm!r}")
    if kind not in ALL_UNIT_KINDS:
        raise ValueError(f"unknown unit kind {kind!r}")
    if recompute not in RECOMPUTE:
        raise UsageError(f"recomputation must be none, selective or full, not {recompute!r}")
    if device not in DEVICE_KINDS:
        raise UsageError(f"device kind must be cuda or cpu, not {device!r}")
    saved = _Saved(model, micro_batch_size, tp, sp and tp > 1, device, cp, cp_comm)
    if kind == "embedding":
        _embedding_saved(saved)
    elif kind == "head" and model.model_type == "bert":
        _bert_head_saved(saved)
    elif kind == "head":
        saved.lm_loss("loss divisor", 1)
    elif recompute == "full":
        saved.add("unit input (full recomputation)", saved.hidden_local, saved.e)
    elif kind == "mlp":
        _mlp_saved(saved)
    elif kind == "moe":
        moe_saved(saved, default_experts(tp, experts))
    elif te and recompute is None and device == "cuda" and cp == 1 and model.flash_attention \
            and not model.qk_layernorm and model.model_type == "gpt":
        _te_attention_saved(saved)
    else:
        _attention_saved(saved, recompute)
    return saved.out


class _Saved:
    """The tensors one unit saves, in the order it saves them, with the sizes they are counted in."""

    def __init__(self, model: ModelConfig, micro_batch_size: int, tp: int, sp: bool, device: str, cp: int = 1,
                 cp_comm: str = "p2p") -> None:
        self.model, self.tp, self.sp, self.device, self.cp, self.cp_comm = model, tp, sp, device, cp, cp_comm
        # s: the rank's local sequence (context parallelism splits it over cp ranks)
        self.s, self.b, self.h, self.e = model.seq_length // cp, micro_batch_size, model.hidden_size, model.dtype_bytes
        self.s_local = self.s // tp if sp else self.s
        self.hidden_local = self.s_local * self.b * self.h
        self.mask_size = _BOOL if device == "cuda" else self.e
        self.stat_size = _FP32 if device == "cuda" else self.e
        self.out: list[SavedTensor] = []

    def add(self, name: str, numel: int, itemsize: int) -> None:
        self.out.append(SavedTensor(name, numel, itemsize))

    def layernorm(self) -> None:
        """What a LayerNorm or RMSNorm over the hidden state keeps."""
        model, e, rows = self.model, self.e, self.s_local * self.b
        if model.apply_layernorm_1p:  # the norm keeps the weight + 1 it computed
            self.add("norm weight + 1", self.h, e)
        if model.normalization != "RMSNorm":
            self.add("layernorm input", self.hidden_local, e)
            self.add("layernorm statistics", 2 * rows, self.stat_size)
        elif self.device == "cuda":  # the fused kernel keeps its input and the fp32 reciprocal RMS
            self.add("rmsnorm input", self.hidden_local, e)
            self.add("rmsnorm statistics (fp32)", rows, _FP32)
        else:  # the composite path computes in fp32: input (upcast), reciprocal RMS, normalized input
            self.add("rmsnorm input (fp32)", self.hidden_local, _FP32)
            self.add("rmsnorm statistics (fp32)", rows, _FP32)
            self.add("rmsnorm normalized input (fp32)", self.hidden_local, _FP32)

    def lm_loss(self, divisor: str, divisors: int) -> None:
        """The final LayerNorm, the logits and the vocab-parallel cross entropy."""
        tokens = self.s * self.b
        logits = tokens * (self.model.vocab_size // self.tp)
        self.layernorm()
        self.add("logits input", self.hidden_local, self.e)
        if self.model.cross_entropy_loss_fusion:  # the logits themselves (the gradient's buffer), fp32 statistics
            self.add("logits", logits, self.e)
            self.add("row maximum (fp32)", tokens, _FP32)
            self.add("sum of exponentials (fp32)", tokens, _FP32)
        else:
            self.add("softmax (fp32)", logits, _FP32)
        self.add("local targets", tokens, _INT64)
        self.add("out-of-vocabulary-shard mask", tokens, _BOOL)
        self.add("loss mask", tokens, _FP32)
        self.add(divisor, divisors, _FP32)

    def hidden_dropout(self) -> None:
        """The mask of the dropout on the hidden state, if any."""
        if self.model.hidden_dropout > 0:
            self.add("dropout mask", self.hidden_local, self.mask_size)


def _embedding_saved(saved: _Saved) -> None:
    """The embedding: token (and position, token-type) ids, the vocabulary shard's mask, the dropout mask."""
    model, tokens = saved.model, saved.b * saved.s
    saved.add("token ids", tokens, _INT64)
    if saved.tp > 1:
        saved.add("out-of-vocabulary-shard mask", tokens, _BOOL)
    if model.position_embedding_type == "learned_absolute":
        saved.add("position ids", saved.s, _INT64)
    if model.num_tokentypes:
        saved.add("token-type ids", tokens, _INT64)
    saved.hidden_dropout()


def _bert_head_saved(saved: _Saved) -> None:
    """BERT's head: the final LayerNorm, the LM head and its loss, and the binary (sentence-order) head."""
    b, h, e = saved.b, saved.h, saved.e
    saved.layernorm()
    saved.add("lm dense input", saved.hidden_local, e)
    saved.add("lm gelu input", saved.hidden_local, e)
    saved.lm_loss("loss divisors", 2)
    if saved.model.bert_binary_head:
        if saved.sp:
            saved.add("pooler input (gathered first token)", b * h, e)
        saved.add("pooler output (tanh)", b * h, e)
        saved.add("sentence-order log-probabilities (fp32)", 2 * b, _FP32)
        saved.add("sentence-order labels", b, _INT64)
        saved.add("sentence-order loss weight", 1, _FP32)


def _mlp_saved(saved: _Saved) -> None:
    """An MLP unit without full recomputation: its norm, fc1's input, the activation's tensors, the dropout."""
    e, local_f = saved.e, saved.s * saved.b * (saved.model.ffn_hidden_size // saved.tp)
    saved.layernorm()
    saved.add("fc1 input", saved.hidden_local, e)
    if saved.model.swiglu:  # fc1's output holds [gate; up]; silu keeps the gate, the product keeps silu(gate) and up
        saved.add("fc1 output (gate and up)", 2 * local_f, e)
        if not saved.model.bias_swiglu_fusion:  # the fused op keeps z only
            saved.add("silu output", local_f, e)
        saved.add("swiglu output (fc2 input)", local_f, e)
    elif saved.model.squared_relu:  # relu keeps its output, the square its input (the same tensor)
        saved.add("relu output", local_f, e)
        saved.add("squared relu output (fc2 input)", local_f, e)
    else:
        saved.add("gelu input", local_f, e)
        saved.add("gelu output", local_f, e)
    saved.hidden_dropout()


def _attention_saved(saved: _Saved, recompute: str | None) -> None:
    """An attention unit without full recomputation: its norm, the QKV input, the q/k norms and rope, the core
    (`_attention_core_saved`), the context and the dropout."""
    model, s, b, tp = saved.model, saved.s, saved.b, saved.tp
    saved.layernorm()
    saved.add("qkv input", saved.hidden_local, saved.e)
    local_h = s * b * saved.h // tp
    # the unfused core's batched matmul copies a strided q; the fused kernel and a checkpoint keep q as it is
    core_inputs = _cp_core_inputs(model, local_h, tp) if saved.cp > 1 else \
        _core_inputs(model, local_h, tp, query_copied=recompute != "selective" and not model.flash_attention)
    if model.qk_layernorm:
        saved.out.extend(_qk_norm_saved(model, local_h, tp, b * (model.num_attention_heads // tp) * s, saved.device))
    if model.position_embedding_type == "rope" and model.apply_rope_fusion:  # one angles tensor for q and k
        saved.add("rotary angles (fp32)", s * model.rotary_dim, _FP32)
    elif model.position_embedding_type == "rope":  # cos and sin, computed for the queries and again for the keys
        saved.add("rotary cos and sin (fp32)", 4 * s * model.rotary_dim, _FP32)
    _attention_core_saved(saved, recompute, core_inputs, local_h)
    saved.add("context (output projection input)", local_h, saved.e)
    saved.hidden_dropout()
    if model.qk_layernorm:  # one storage: the QKV output the norms' inputs and the values are views of
        out = saved.out
        first = next((i for i, t in enumerate(out) if t.name == "qkv output"), len(out))
        saved.out = out[:first + 1] + [t for t in out[first + 1:] if t.name != "qkv output"]


def _te_attention_saved(saved: _Saved) -> None:
    """Transformer Engine's attention unit (module doc): LayerNormLinear's input and ln_out, the fused core's
    contiguous q, grouped k and v, its output (the projection's input) and softmax statistics, the dropout."""
    model, s, b, e = saved.model, saved.s, saved.b, saved.e
    local_h = s * b * saved.h // saved.tp
    kv = local_h * model.query_groups // model.num_attention_heads
    saved.layernorm()
    saved.add("ln_out (qkv input)", saved.hidden_local, e)
    saved.add("query", local_h, e)
    saved.add("keys (grouped)", kv, e)
    saved.add("values (grouped)", kv, e)
    saved.add("attention output (output projection input)", local_h, e)
    saved.add("softmax statistics (fp32)", b * (model.num_attention_heads // saved.tp) * s, _FP32)
    saved.hidden_dropout()


def _attention_core_saved(saved: _Saved, recompute: str | None, core_inputs: list[SavedTensor], local_h: int) -> None:
    """The attention core: its inputs, and what selective recomputation, the unfused core, SDPA's math fallback
    or the fused kernel keep beside them."""
    model, s, b, e, device = saved.model, saved.s, saved.b, saved.e, saved.device
    bert = model.model_type == "bert"
    heads = model.num_attention_heads // saved.tp
    score = b * heads * s * s
    p_attn = model.attention_dropout
    math_path = model.flash_attention and device == "cpu" and p_attn > 0
    if saved.cp > 1:  # the context-parallel core: q, k, v, its output and the log-sum-exp; no s^2 term
        if recompute == "selective":  # the checkpoint keeps the core's inputs as given
            saved.out.extend(core_inputs)
            return
        if saved.cp_comm == "a2a":  # q, k, v re-laid by the all-to-all (the given ones are not kept)
            saved.out.extend(_a2a_core_inputs(model, local_h, saved.tp, saved.cp))
        else:
            saved.out.extend(core_inputs)
        saved.add("context-parallel attention output", local_h, e)
        saved.add("log-sum-exp (fp32)", b * heads * s, _FP32)
    elif recompute == "selective":
        saved.out.extend(core_inputs)
        if bert:  # an input of the recomputed core
            saved.add("padding mask (bool)", b * s, _BOOL)
    elif not model.flash_attention:
        saved.out.extend(core_inputs)
        saved.add("softmax output", score, e)
        if p_attn > 0:
            saved.add("attention dropout mask", score, _BOOL if device == "cuda" else e)
            saved.add("attention probabilities", score, e)
    elif math_path:  # SDPA's math fallback: scaled q and k, v (a copy when 16-bit inputs are upcast), 3 s^2 terms
        c = _FP32
        if e == c:
            saved.out.append(core_inputs[-1])  # the values (or the QKV output they are a view of)
        else:
            saved.add("v (fp32 copy)", local_h, c)
        saved.add("scaled q", local_h, c)
        saved.add("scaled k", local_h, c)
        saved.add("softmax output", score, c)
        saved.add("attention dropout noise", score, c)
        saved.add("attention probabilities", score, c)
    else:  # the kernel's output is laid out like q, so the projection's input is a view of it
        saved.out.extend(core_inputs)
        saved.add("log-sum-exp (fp32)", b * heads * s, _FP32)
        if model.qk_layernorm or (model.position_embedding_type == "rope" and model.rotary_dim < model.head_dim):
            saved.add("attention output (q laid out by head: the context is a copy)", local_h, e)
        if bert:
            saved.add("padding mask (additive, for the kernel)", b * s, e)


def _qk_norm_saved(model: ModelConfig, local_h: int, tp: int, q_rows: int, device: str) -> list[SavedTensor]:
    """What the per-head query and key norms keep (before rope): their inputs (k, and q unless copied out of
    grouped rows, are views of the QKV output), statistics per head row, and as for the hidden norms the fp32
    upcast and normalized tensors of the composite RMSNorm on "cpu"; with 1p each norm's weight + 1."""
    e = model.dtype_bytes
    per = model.num_attention_heads // model.query_groups
    kv_local, k_rows = local_h // per, q_rows // per
    qkv = SavedTensor("qkv output", local_h * model.qkv_rows // model.hidden_size, e)
    q_copied = per > 1 and model.query_groups // tp > 1
    out = []
    if model.apply_layernorm_1p:
        out.append(SavedTensor("q/k norm weights + 1", 2 * model.head_dim, e))
    rms, cpu = model.normalization == "RMSNorm", device == "cpu"
    if rms and cpu:
        if e == _FP32:
            out += [qkv] + ([SavedTensor("query (norm input)", local_h, e)] if q_copied else [])
        else:
            out += [SavedTensor("q/k norm inputs (fp32)", local_h + kv_local, _FP32)]
        out += [SavedTensor("q/k rms statistics (fp32)", q_rows + k_rows, _FP32),
                SavedTensor("q/k normalized (fp32)", local_h + kv_local, _FP32)]
        return out
    out += [qkv] + ([SavedTensor("query (norm input)", local_h, e)] if q_copied else [])
    stats = 1 if rms else 2  # the fused RMSNorm's reciprocal RMS; LayerNorm's mean and reciprocal std
    out.append(SavedTensor("q/k norm statistics", stats * (q_rows + k_rows), _FP32 if device == "cuda" else e))
    return out


def _cp_core_inputs(model: ModelConfig, local_h: int, tp: int) -> list[SavedTensor]:
    """The storages behind the q, k, v the context-parallel core is given (what the p2p ring and a selective
    checkpoint keep): views of the QKV output, q copied out of the grouped rows where a rank holds several groups
    of several heads, or with rope (or q/k norms) the new q and k (k grouped: not repeated over the group's heads)
    beside the QKV output v is a view of."""
    e = model.dtype_bytes
    qkv = SavedTensor("qkv output", local_h * model.qkv_rows // model.hidden_size, e)
    per = model.num_attention_heads // model.query_groups
    if model.position_embedding_type != "rope" and not model.qk_layernorm:
        if per > 1 and model.query_groups // tp > 1:  # [s, b, groups, per, d] -> [b, n, s, d] cannot be a view
            return [SavedTensor("query (copied out of the grouped rows)", local_h, e), qkv]
        return [qkv]
    return [SavedTensor("query (normed or rotated)", local_h, e),
            SavedTensor("keys (normed or rotated, grouped)", local_h // per, e), qkv]


def _a2a_core_inputs(model: ModelConfig, local_h: int, tp: int, cp: int) -> list[SavedTensor]:
    """q, k, v as the a2a core keeps them, after the all-to-all: q [b, n/C, s, d] (q's elements), k and v
    [b, m/C, s, d] with m = lcm(g, C) kv heads (g = the rank's kv heads; each is repeated m/g times first when C
    does not divide g): the given k's elements times m/g."""
    e, g = model.dtype_bytes, model.query_groups // tp
    heads = model.num_attention_heads // tp
    kv = local_h * math.lcm(g, cp) // heads
    return [SavedTensor("query (after the all-to-all)", local_h, e), SavedTensor("keys (after the all-to-all)", kv, e),
            SavedTensor("values (after the all-to-all)", kv, e)]


def _check_cp(model: ModelConfig, cp: int) -> None:
    if cp < 1 or model.seq_length % cp:
        raise UsageError(f"context-parallel size {cp} does not split the sequence of {model.seq_length} tokens")


def _core_inputs(model: ModelConfig, local_h: int, tp: int, query_copied: bool) -> list[SavedTensor]:
    """The storages behind the attention core's q, k and v (what the core, or selective recomputation, keeps).

    Without groups or rope they are views of the QKV output. Rope makes new rotated q and k (v stays a view of
    the QKV output); groups repeat k and v over each group's query heads and copy q out of the grouped rows,
    unless the rank holds one group (then q is a view of the QKV output, kept whole, where the core takes q as it
    is: `query_copied` False)."""
    e = model.dtype_bytes
    per = model.num_attention_heads // model.query_groups
    qkv_local = local_h * model.qkv_rows // model.hidden_size
    new_qk = model.position_embedding_type == "rope" or model.qk_layernorm  # q and k are new tensors
    if per > 1:
        one_group_view = model.query_groups // tp == 1 and not new_qk and not query_copied
        query = SavedTensor("qkv output (the query is a view of it)", qkv_local, e) if one_group_view \
            else SavedTensor("query", local_h, e)
        return [query, SavedTensor("keys repeated over the group", local_h, e),
                SavedTensor("values repeated over the group", local_h, e)]
    if new_qk:
        return [SavedTensor("query (normed or rotated)", local_h, e), SavedTensor("keys (normed or rotated)", local_h, e),
                SavedTensor("qkv output", qkv_local, e)]
    return [SavedTensor("qkv output", qkv_local, e)]  # q, k and v are views of it


def unit_wgrad_tensors(kind: str, model: ModelConfig, micro_batch_size: int, tp: int = 1,
                       sp: bool = False, cp: int = 1) -> list[SavedTensor]:
    """What one unit keeps from a split backward's B until its W (parallel/deferred_wgrad.py): per linear layer
    its saved input and its output gradient; the rest of what it saved is freed at B's end. The same whatever
    the recomputation (B rebuilds the inputs and W keeps them) and device."""
    if kind not in ALL_UNIT_KINDS:
        raise ValueError(f"unknown unit kind {kind!r}")
    if kind == "moe":  # zero-bubble schedules are not planned for MoE models (spec.py refuses them)
        return []
    sp = sp and tp > 1
    s, b, h, e = model.seq_length // cp, micro_batch_size, model.hidden_size, model.dtype_bytes
    hidden_local = (s // tp if sp else s) * b * h  # a column-parallel input: this rank's sequence part with SP
    if kind == "embedding":
        return []
    if kind == "head":  # the output layer (BERT's LM dense, pooler and sentence-order head are not deferred)
        return [SavedTensor("logits input", hidden_local, e),
                SavedTensor("logits gradient", s * b * (model.vocab_size // tp), e)]
    if kind == "attention":
        return [SavedTensor("qkv input", hidden_local, e),
                SavedTensor("qkv output gradient", s * b * model.qkv_rows // tp, e),
                SavedTensor("context (projection input)", s * b * h // tp, e),
                SavedTensor("projection output gradient (before the reduction)", s * b * h, e)]
    return [SavedTensor("fc1 input", hidden_local, e),
            SavedTensor("fc1 output gradient", s * b * model.fc1_rows // tp, e),
            SavedTensor("fc2 input", s * b * model.ffn_hidden_size // tp, e),
            SavedTensor("fc2 output gradient (before the reduction)", s * b * h, e)]


def unit_wgrad_bytes(kind: str, model: ModelConfig, micro_batch_size: int, tp: int = 1, sp: bool = False,
                     cp: int = 1) -> int:
    return sum(t.nbytes for t in unit_wgrad_tensors(kind, model, micro_batch_size, tp, sp, cp))


_SAVED_KEYS = ("seq_length", "hidden_size", "ffn_hidden_size", "vocab_size", "num_attention_heads", "params_dtype",
               "attention_backend", "hidden_dropout", "attention_dropout", "model_type", "bert_binary_head",
               "position_embedding_type", "rotary_percent", "normalization", "swiglu", "squared_relu", "num_query_groups",
               "qk_layernorm", "apply_layernorm_1p", "cross_entropy_loss_fusion", "bias_swiglu_fusion",
               "apply_rope_fusion")
_saved_memo: dict[tuple, int] = {}


def unit_activation_bytes(kind: str, model: ModelConfig, micro_batch_size: int, tp: int = 1, sp: bool = False,
                          recompute: str | None = None, device: str = "cuda", cp: int = 1, cp_comm: str = "p2p",
                          experts: Experts | None = None, te: bool = False) -> int:
    key = (kind, micro_batch_size, tp, sp, recompute, device, cp, cp_comm, experts, te, repr(model.moe)) \
        + tuple(getattr(model, k) for k in _SAVED_KEYS)
    got = _saved_memo.get(key)
    if got is None:
        if len(_saved_memo) > 100_000:
            _saved_memo.clear()
        got = _saved_memo[key] = sum(t.nbytes for t in unit_saved_tensors(kind, model, micro_batch_size, tp, sp,
                                                                           recompute, device, cp, cp_comm, experts,
                                                                           te))
    return got


def bytes_by_dtype(tensors: list[SavedTensor]) -> dict[int, int]:
    """Saved bytes grouped by element size (8 int64, 4 fp32, 2 bf16/fp16, 1 bool)."""
    out: dict[int, int] = {}
    for t in tensors:
        out[t.itemsize] = out.get(t.itemsize, 0) + t.nbytes
    return out


def layer_activation_bytes(model: ModelConfig, micro_batch_size: int, tp: int = 1, sp: bool = False,
                           recompute: str | None = None, device: str = "cuda", cp: int = 1,
                           cp_comm: str = "p2p", experts: Experts | None = None) -> int:
    """One transformer layer (attention + MLP unit; the first layer's: an MoE unit where it holds experts), one
    micro-batch, one rank."""
    second = "moe" if model.moe_layer(0) else "mlp"
    return sum(unit_activation_bytes(k, model, micro_batch_size, tp, sp, recompute, device, cp, cp_comm, experts)
               for k in ("attention", second))


def korthikanti_layer_bytes(model: ModelConfig, micro_batch_size: int, tp: int = 1, sp: bool = False,
                            recompute: str | None = None) -> float:
    """Korthikanti et al. 2022, activations per layer in bytes for fp16 (reference only)."""
    s, b, h, a, t = model.seq_length, micro_batch_size, model.hidden_size, model.num_attention_heads, tp
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    if recompute == "selective":
        return 34 * s * b * h / t if sp else s * b * h * (10 + 24 / t)
    if sp:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def unit_backward_bytes(kind: str, model: ModelConfig, micro_batch_size: int, tp: int = 1, sp: bool = False,
                        cp: int = 1, cp_comm: str = "p2p", device: str = "cuda", experts: Experts | None = None) -> int:
    """The largest gradient buffers a unit's backward allocates beside what it saved (Galvatron's backward peak):
    the head's gradient of the logits cast for the output matmul (the fp32 gradient takes the saved softmax's
    place; fused, one fp32 chunk of tokens: its forward's upcast, and its backward's for 16-bit logits, whose
    gradient takes the saved logits' place), the attention's gradient
    of the scores and probabilities (unfused; the fused kernel's gradient of q, k, v), the MLP's gradients of
    its activation's output and input (moe_model.activation_backward_factor: the fused SwiGLU holds one fewer), the
    embedding's hidden-state gradient. Under context parallelism (cp > 1) the local
    s/cp tokens', and the context-parallel core's: the larger of its transient peaks (cp_attention_buffers, of
    `device` kind: its backward's includes the q, k, v gradients it returns) and those gradients."""
    s, b, h, f, v = model.seq_length // cp, micro_batch_size, model.hidden_size, model.ffn_hidden_size, model.vocab_size
    e = model.dtype_bytes
    if kind == "attention" and cp > 1:
        local_h = s * b * (h // tp)
        grads = (local_h + 2 * local_h * model.query_groups // model.num_attention_heads) * e
        return max(grads, *cp_attention_buffers(model, micro_batch_size, tp, cp, cp_comm, device))
    if kind == "head" and model.cross_entropy_loss_fusion:  # one fp32 chunk of tokens
        return cross_entropy_chunk_tokens(s * b, v // tp) * (v // tp) * _FP32
    if kind == "head":
        return s * b * (v // tp) * (0 if e == _FP32 else e)
    if kind == "attention":
        heads = model.num_attention_heads // tp
        return b * heads * s * s * (_FP32 + e) if not model.flash_attention else 3 * s * b * (h // tp) * e
    if kind == "mlp":  # SwiGLU: the gradients of [gate; up] and of the product besides silu's (fused: the product's
        # and [gate; up]'s only); squared ReLU: the square's backward (autograd's pow_backward, grad * 2 x^1) holds a
        # temporary beside its two gradients
        return activation_backward_factor(model) * s * b * (f // tp) * e
    if kind == "moe":  # moe_model.py: the experts' gradients at the tokens received, the dispatcher's buffers
        rows = (s // tp if sp and tp > 1 else s) * b
        return moe_backward_bytes(model, local_tokens(model, b, tp, sp, cp), s * b, rows, tp,
                                  default_experts(tp, experts), device)
    if kind == "embedding":
        return (s // tp if sp and tp > 1 else s) * b * h * e
    raise ValueError(f"unknown unit kind {kind!r}")


def unit_transient_bytes(kind: str, model: ModelConfig, micro_batch_size: int, tp: int, sp: bool,
                         recompute: str | None, device: str, cp: int = 1, cp_comm: str = "p2p",
                         experts: Experts | None = None) -> int:
    """What one unit's backward holds beside the saved activations: the activations recomputation rebuilds
    (one unit's, or one attention core's) and its gradient buffers."""
    rebuilt = 0
    if recompute is not None:
        rebuilt = unit_activation_bytes(kind, model, micro_batch_size, tp, sp, None, device, cp, cp_comm, experts) \
            - unit_activation_bytes(kind, model, micro_batch_size, tp, sp, recompute, device, cp, cp_comm, experts)
    return rebuilt + unit_backward_bytes(kind, model, micro_batch_size, tp, sp, cp, cp_comm, device, experts)
