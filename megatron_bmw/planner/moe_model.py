"""An MoE unit (docs/moe.md) in numbers: how many tokens its experts receive on a rank, the parameters a rank holds
and what the unit saves for backward. Torch-free; kernel_time.py and moe_cost.py time it, unit_activations.py and
memory_model.py count it.

Layout (`Experts`): ep ranks split the E experts (E/ep each), etp ranks split each expert's FFN (fc1 rows, fc2
columns), carved from the stage's tp x cp x dp ranks; the expert data-parallel size edp = tp cp dp / (etp ep)
(ranks holding the same expert shards: the distributed optimizer shards expert states over them, the dense ones
over dp x cp).

Routing (`expert_tokens`): a rank routes its T = s'b/tp tokens (s' = s/cp; with sequence parallelism its rows, without
it its 1/tp of the rows, as the runtime splits them; Megatron-core runs MoE under tp only with SP, and so does the
planner), k experts each. The dispatcher brings every expert the tokens routed to it from the etp x ep ranks that
share it (allgather: gathered over etp x ep; alltoall: all-to-all over ep, then gathered over etp), so an expert's
mean load is m = etp ep T k / E and a rank's E/ep experts receive etp T k in all: the same per rank for any ep. The
routing model: even (m per expert) but for a load-imbalance factor lambda = max/mean tokens per expert
(`Experts.imbalance`, --moe-load-imbalance; 1.0, the even routing the load balancing loss aims at, by default): the
busiest rank holds one expert at lambda m (at most etp ep T: every token once) and its others at m. With a capacity
factor c (--moe-expert-capacity-factor) each source rank keeps at most ceil(T k / E c) tokens per expert (the
runtime decides it over the sequence group's tokens, about tp cp times as many, for that many ranks), so an expert
gets at most etp ep of those; padded to capacity (--moe-pad-expert-input-to-capacity) every expert gets exactly
that. S, the (token, expert) pairs a rank routes (`routed_pairs`): T k, capped as above. A given routing
(`Experts.loads`, `.sent`: one micro-batch's as the runtime took it) replaces the model's R and S.

Saved for backward on the busiest rank, per micro-batch (`moe_saved`; R rows its experts receive, S pairs it
routes, L = E/ep local experts, f = F/etp, rows = 2f with SwiGLU else f; e the parameter dtype's bytes):
  norm       as the dense MLP's (LayerNorm input and statistics, or RMSNorm's).
  router     its input: a 16-bit model's fp32 copy T h x 4 and the weight's fp32 copy E h x 4; an fp32 model the norm
             output itself (without SP and tp > 1: the rank's own rows, a copy, T h e). With the z-loss the fp32
             logits and log-sum-exp T (E + 1) x 4. The scores: softmax over all E before the top-k or sigmoid
             (always with Sinkhorn, k = 1) keep their output T E x 4; the top-k's one flat index T k int64 (it picks
             the k scores and places the probabilities in the dense [T, E]); softmax over the k keeps its output
             T k x 4; sigmoid's normalisation over k > 1 the k scores and their sum T (k + 1) x 4. Load balancing
             (aux_loss, seq_aux_loss with a coefficient): scores of its own over all E, T E x 4 (sigmoid: and their
             sum per token, T x 4), and the sequence group's counts stacked on the probability sums, 2 E x 4 (per
             sequence 2 b E x 4). A capacity: the kept mask T E bool.
  dispatch   the permutation's (token, expert) index pairs, int64: 2 R (allgather: picked from the etp x ep
             gather) or 2 S (alltoall: of the rank's tokens), and with alltoall over more than one rank (etp ep > 1)
             the received rows' expert-major order R int64; the expert input R h e.
  experts    the grouped GEMM's offsets L int32 (where it runs as torch._grouped_mm, `grouped_gemm`), with biases
             the expert of each row R int64, fc1's output and the activation's tensors as the dense MLP's at R rows
             and f columns (GeLU: its input and output; SwiGLU: fc1's output 2 R f, silu's output (unfused only) and the
             product).
  combine    the rows weighted (allgather: the experts' R output rows; alltoall: the S rows come back) and their
             weights, in e (C h e and C e); the sum by index_put keeps only the index it already counted.
  shared     fc1's input (the norm output: already counted where it is the fp32 router's input), the activation's
             tensors as a dense MLP of F_shared over tp; with the gate its sigmoid output s'b e and the shared
             output s'bh e (the gate's input is the norm output again).
  dropout    the hidden dropout's mask.
Full recomputation keeps the unit's input; selective recomputation does not touch an MoE unit. Checked byte for byte
against saved-tensor hooks on 1, 2 and 4 ranks for the routing the runtime took (tests/planner/test_memory_model.py).
The backward's transient: `moe_backward_bytes` (checked against the CPU allocator: tests/planner/test_moe_buffers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import UsageError

_INT64, _FP32, _INT32, _BOOL = 8, 4, 4, 1


@dataclass(frozen=True)
class Experts:
    """How one stage's ranks hold the experts: ep ranks split them, etp ranks split each one; `imbalance`: max/mean
    tokens per expert (the routing model). A given routing instead (one micro-batch's, as measured): `loads`, the
    rows each of the rank's E/ep experts receives, and `sent`, the (token, expert) pairs the rank routes (kept by
    the capacity, padding included)."""

    ep: int = 1
    etp: int = 1
    imbalance: float = 1.0
    loads: tuple[int, ...] | None = None
    sent: int | None = None

    def __post_init__(self) -> None:
        if self.ep < 1 or self.etp < 1:
            raise UsageError(f"expert parallel sizes must be >= 1, got ep {self.ep}, etp {self.etp}")
        if not self.imbalance >= 1.0:
            raise UsageError(f"--moe-load-imbalance is max/mean tokens per expert, >= 1; got {self.imbalance}")


def default_experts(tp: int, experts: Experts | None) -> Experts:
    """`experts`, or Megatron's default layout: ep 1, etp = tp."""
    return experts if experts is not None else Experts(1, tp)


def check_experts(model: ModelConfig, tp: int, cp: int, dp: int, ep: int, etp: int, sp: bool) -> None:
    """What the planner plans of a layout's experts: MoE models only for ep or etp > 1 (etp beside tp 1), E % ep,
    the expert FFN over etp, etp x ep dividing the stage's tp x cp x dp ranks, and sequence parallelism under tp."""
    moe = model.moe
    if moe is None:
        if ep > 1 or etp != tp:
            raise UsageError(f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp}: the model "
                             "has no experts (--num-experts)")
        return
    if moe.num_experts % ep:
        raise UsageError(f"--expert-model-parallel-size {ep} does not divide --num-experts {moe.num_experts}")
    if model.moe_ffn_hidden_size % etp:
        raise UsageError(f"--expert-tensor-parallel-size {etp} does not split the experts' FFN size "
                         f"{model.moe_ffn_hidden_size}")
    if (tp * cp * dp) % (etp * ep):
        raise UsageError(f"expert layout etp {etp} x ep {ep} does not divide a stage's tp {tp} x cp {cp} x dp {dp} "
                         "ranks")
    if tp > 1 and not sp:
        raise UsageError(f"--tensor-model-parallel-size {tp} with experts needs --sequence-parallel (as Megatron-core)")


def local_tokens(model: ModelConfig, micro_batch_size: int, tp: int, sp: bool, cp: int = 1) -> int:
    """T: the tokens one rank routes, s/(cp tp) x the micro-batch: sequence parallelism's rows, or without it the
    rank's 1/tp of the rows (the runtime scatters them after the norm)."""
    return model.seq_length // cp // tp * micro_batch_size


def capacity(model: ModelConfig, tokens: int) -> int | None:
    """Megatron-core's capacity per expert of a source rank's `tokens`: ceil(T k / E x factor); None: dropless."""
    moe = model.moe
    if moe.expert_capacity_factor is None:
        return None
    return math.ceil(tokens * moe.router_topk / moe.num_experts * moe.expert_capacity_factor)


def expert_loads(model: ModelConfig, tokens: int, experts: Experts) -> list[float]:
    """Tokens each local expert of the busiest rank receives: one at lambda x the mean, the others at the mean (the
    routing model, module doc), each at most every token once and, with a capacity, at most the capacity."""
    moe = model.moe
    local = moe.num_experts // experts.ep
    if experts.loads is not None:
        if len(experts.loads) != local:
            raise UsageError(f"a given routing names {len(experts.loads)} expert loads; a rank holds {local} experts")
        return [float(x) for x in experts.loads]
    sources = experts.etp * experts.ep
    mean = sources * tokens * moe.router_topk / moe.num_experts
    most = float(sources * tokens)
    cap = capacity(model, tokens)
    loads = [min(mean * experts.imbalance, most)] + [mean] * (local - 1)
    if cap is not None:
        limit = float(sources * cap)
        loads = [limit] * local if moe.pad_expert_input_to_capacity else [min(x, limit) for x in loads]
    return loads


def expert_tokens(model: ModelConfig, tokens: int, experts: Experts) -> int:
    """R: the tokens the busiest rank's experts receive in all (rounded up)."""
    return math.ceil(sum(expert_loads(model, tokens, experts)))


def routed_pairs(model: ModelConfig, tokens: int, experts: Experts) -> int:
    """S: the (token, expert) pairs a rank routes: T k, or under a capacity T k/E per expert up to the capacity (each
    expert's capacity with padding); the given routing's `sent` where it has one."""
    if experts.sent is not None:
        return experts.sent
    moe = model.moe
    pairs = tokens * moe.router_topk
    cap = capacity(model, tokens)
    if cap is None:
        return pairs
    if moe.pad_expert_input_to_capacity:
        return moe.num_experts * cap
    return math.ceil(moe.num_experts * min(pairs / moe.num_experts, cap))


def group_local_indices(tp: int, cp: int, dp: int, experts: Experts, group: str) -> list[int]:
    """The local indices (L, moe_cost.py) of the first `group` ("ep", "etp_ep", "edp") of a stage."""
    etp, ep = experts.etp, experts.ep
    if group == "ep":
        return [etp * j for j in range(ep)]
    if group == "etp_ep":
        return list(range(etp * ep))
    if group == "edp":
        return [etp * ep * i for i in range(tp * cp * dp // (etp * ep))]
    raise ValueError(group)


def local_to_coords(index: int, tp: int, cp: int) -> tuple[int, int, int]:
    """(tp_rank, cp_rank, dp_rank) of local index L."""
    return index % tp, (index // tp) % cp, index // (tp * cp)


def moe_param_split(model: ModelConfig, tp: int, experts: Experts) -> tuple[int, int]:
    """(dense, expert) parameters one rank holds of an MoE unit: the norm, the router (E h, replicated), the shared
    experts over tp and their gate; the E/ep experts' fc1 (rows/etp x h, bias rows/etp) and fc2 (h x F/etp, bias h)."""
    moe, h = model.moe, model.hidden_size
    bias = model.add_bias_linear
    norm = (1 if model.normalization == "RMSNorm" else 2) * h
    dense = norm + moe.num_experts * h
    shared = moe.shared_expert_intermediate_size
    if shared:
        rows = (2 * shared if model.swiglu else shared) // tp
        dense += rows * h + (rows if bias else 0) + h * (shared // tp) + (h if bias else 0)
        dense += h if moe.shared_expert_gate else 0
    f = model.moe_ffn_hidden_size
    rows = (2 * f if model.swiglu else f) // experts.etp
    local = moe.num_experts // experts.ep
    expert = local * (rows * h + (rows if bias else 0) + h * (f // experts.etp) + (h if bias else 0))
    return dense, expert


def moe_saved(saved, experts: Experts) -> None:
    """Add what an MoE unit saves for backward (module doc) to unit_activations._Saved `saved`, in order."""
    model, e, h = saved.model, saved.e, saved.h
    moe = model.moe
    tokens = local_tokens(model, saved.b, saved.tp, saved.sp, saved.cp)
    split = saved.tp > 1 and not saved.sp  # the rank routes a copy of its 1/tp of the norm output's rows
    saved.layernorm()
    if e != _FP32:
        saved.add("router input (fp32 copy)", tokens * h, _FP32)
        saved.add("router weight (fp32 copy)", moe.num_experts * h, _FP32)
    else:
        saved.add("router input (the rank's rows of the norm output)" if split else "router input (norm output)",
                  tokens * h, e)
    _router(saved, tokens)
    received, sent = expert_tokens(model, tokens, experts), routed_pairs(model, tokens, experts)
    _dispatch(saved, experts, received, sent)
    shared = moe.shared_expert_intermediate_size
    if shared:
        if e != _FP32 or split:  # else the router's input is this very tensor
            saved.add("shared expert fc1 input (norm output)", saved.hidden_local, e)
        _activation(saved, saved.s * saved.b * (shared // saved.tp), "shared expert")
        if moe.shared_expert_gate:
            saved.add("shared expert gate (sigmoid output)", saved.s_local * saved.b, e)
            saved.add("shared expert output", saved.hidden_local, e)
    saved.hidden_dropout()


def _router(saved, tokens: int) -> None:
    """The router's scores, top-k, auxiliary losses and capacity (models/moe_routing.py), all fp32 but indices."""
    moe = saved.model.moe
    big_e, k = moe.num_experts, moe.router_topk
    if moe.z_loss_coeff:  # logsumexp keeps its input and output
        saved.add("z-loss logits and log-sum-exp (fp32)", tokens * (big_e + 1), _FP32)
    sinkhorn = moe.load_balancing_type == "sinkhorn"  # (k = 1: sigmoid scores, picked as they are)
    if sinkhorn or moe.score_function == "sigmoid":
        saved.add("router scores (sigmoid, fp32)", tokens * big_e, _FP32)
    elif moe.pre_softmax:
        saved.add("router probabilities (softmax over the experts, fp32)", tokens * big_e, _FP32)
    saved.add("top-k flat indices (picking the k scores and placing the probabilities)", tokens * k, _INT64)
    if sinkhorn:
        pass
    elif moe.score_function == "sigmoid" and k > 1:
        saved.add("top-k scores and their sum (fp32)", tokens * (k + 1), _FP32)
    elif moe.score_function == "softmax" and not moe.pre_softmax:
        saved.add("top-k probabilities (softmax over the k, fp32)", tokens * k, _FP32)
    if moe.load_balancing_type in ("aux_loss", "seq_aux_loss") and moe.aux_loss_coeff > 0:
        # scores of their own (softmax, or sigmoid and its sum per token), the group's counts stacked on prob sums
        saved.add("load-balancing scores (over the experts, fp32)", tokens * big_e, _FP32)
        if moe.score_function == "sigmoid":
            saved.add("load-balancing scores' sum per token (fp32)", tokens, _FP32)
        per = saved.b if moe.load_balancing_type == "seq_aux_loss" else 1
        saved.add("load-balancing counts and probability sums (fp32)", 2 * per * big_e, _FP32)
    if moe.expert_capacity_factor is not None:
        saved.add("capacity mask (bool)", tokens * big_e, _BOOL)


def _dispatch(saved, experts: Experts, received: int, sent: int) -> None:
    """The dispatcher's indices, the experts at the R rows received, and the combine."""
    model, e, h = saved.model, saved.e, saved.h
    moe = model.moe
    if moe.token_dispatcher_type == "allgather":  # permuted from the gathered tokens: R (token, expert) rows
        saved.add("permutation indices (token and expert of each row, int64)", 2 * received, _INT64)
    else:  # permuted from the rank's tokens; rows from several ranks re-ordered expert by expert
        saved.add("permutation indices (token and expert of each routed pair, int64)", 2 * sent, _INT64)
        if experts.etp * experts.ep > 1:
            saved.add("expert-major order of the received rows (int64)", received, _INT64)
    saved.add("expert input (permuted tokens)", received * h, e)
    f = model.moe_ffn_hidden_size // experts.etp
    if grouped_gemm(model, experts, saved.device, received):
        saved.add("grouped GEMM offsets (int32)", moe.num_experts // experts.ep, _INT32)
    if model.add_bias_linear:
        saved.add("expert of each received row (biases' index, int64)", received, _INT64)
    _activation(saved, received * f, "expert")
    rows = received if moe.token_dispatcher_type == "allgather" else sent
    saved.add("expert output (fc2 output; alltoall: the rows back)", rows * h, e)
    saved.add("routing probabilities of those rows", rows, e)


def _activation(saved, local_f: int, what: str) -> None:
    e = saved.e
    if saved.model.swiglu:
        saved.add(f"{what} fc1 output (gate and up)", 2 * local_f, e)
        if not saved.model.bias_swiglu_fusion:  # the fused op keeps z only
            saved.add(f"{what} silu output", local_f, e)
        saved.add(f"{what} swiglu output (fc2 input)", local_f, e)
    else:
        saved.add(f"{what} gelu input", local_f, e)
        saved.add(f"{what} gelu output", local_f, e)


def grouped_gemm(model: ModelConfig, experts: Experts, device: str, received: int) -> bool:
    """Whether the experts run as torch._grouped_mm (models/moe_experts.py), which keeps the groups' offsets: rows to
    multiply, 16-byte aligned sizes (h, fc1's rows/etp, F/etp), and a torch that has it for the device and dtype
    (torch 2.13 on cpu: fp32, bf16 and fp16; on cuda taken for bf16)."""
    e, f = model.dtype_bytes, model.moe_ffn_hidden_size // experts.etp
    rows = (2 * f if model.swiglu else f)
    aligned = all(d * e % 16 == 0 for d in (model.hidden_size, rows, f))
    has = device == "cpu" or model.params_dtype == "bf16"
    return received > 0 and aligned and has


def activation_backward_factor(model: ModelConfig) -> int:
    """The MLP activation's backward buffers in units of its output (f columns): GeLU 2 (gradients of its output and
    input); SwiGLU 4 unfused (the product's, silu's, [gate; up]'s), 3 fused (the product's and [gate; up]'s: the
    fused backward writes dz in place, eagerly too); squared ReLU 3."""
    if model.swiglu:
        return 3 if model.bias_swiglu_fusion else 4
    return 3 if model.squared_relu else 2


def moe_backward_bytes(model: ModelConfig, tokens: int, hidden_rows_full: int, hidden_rows: int, tp: int,
                       experts: Experts, device: str = "cuda") -> int:
    """The most an MoE unit's backward allocates beside what it saved (its saved tensors counted as held), the
    largest of its phases in the order autograd runs them (e in the parameter dtype but where fp32 is said):
      shared    the shared experts' activation gradients as the dense MLP's, at `hidden_rows_full` s'b rows of the
                whole sequence part (their weight gradients go into main_grad); afterwards their input's gradient,
                `hidden_rows` x h, stays through every phase below.
      combine   the output rows' gradient, that of the rows times their weights and that of the weights: 3 C h + C
                (C = R rows with allgather, S routed pairs with alltoall), beside the dispatcher's buffer
                (allgather: the gathered tokens' gradient, etp ep T h where etp ep > 1; alltoall: its reverse path,
                two of max(S, R) h at a time). From here on the routing probabilities' gradient T E fp32 stays.
      fc2       its output's gradient R h, its input's R F/etp and its weight gradient: the expert weights are not
                fused into main_grad, their gradient goes through `.grad` to GradSync's hook, which on "cpu" first
                copies a 16-bit gradient to fp32 (4 bytes an element, in place of the output's gradient).
      activation  GeLU 2, SwiGLU 4 (fused 3), squared ReLU 3 x R F/etp.
      fc1       its output's gradient R rows/etp (at its hook: the fp32 copy instead), its input's R h, its weight
                gradient.
      back      to the tokens: R h beside the gathered tokens' gradient (and their reduce-scatter's T h) with
                allgather; two of max(S, R) h, then S h beside T h with alltoall.
      router    the tokens' gradient T h held, the fp32 gradients of its input T h and weight E h, and with a
                16-bit model the input gradient's cast back, T h.
    Checked against the CPU allocator on one rank (tests/planner/test_moe_buffers.py)."""
    moe, e, h = model.moe, model.dtype_bytes, model.hidden_size
    received, sent = expert_tokens(model, tokens, experts), routed_pairs(model, tokens, experts)
    f = model.moe_ffn_hidden_size // experts.etp
    rows = 2 * f if model.swiglu else f
    local = moe.num_experts // experts.ep
    bias = model.add_bias_linear
    w1 = local * (rows * h + (rows if bias else 0))
    w2 = local * (f * h + (h if bias else 0))
    upcast = _FP32 if device == "cpu" and e != _FP32 else 0  # the hook's fp32 copy of a 16-bit gradient
    if moe.token_dispatcher_type == "allgather":
        group = experts.etp * experts.ep  # (one rank: the output's gradient is the caller's, none gathered)
        gathered = group * tokens * h * e if group > 1 else 0
        combine = gathered + received * (3 * h + 1) * e
        back = received * h * e + group * tokens * h * e + (tokens * h * e if group > 1 else 0)
    else:
        most = max(sent, received) * h * e
        combine = max(sent * (3 * h + 1) * e, 2 * most)
        back = max(2 * most, (sent + tokens) * h * e)
    acts = activation_backward_factor(model) * received * f * e
    fc2 = received * f * e + w2 * e + max(received * h * e, w2 * upcast)
    fc1 = received * h * e + w1 * e + max(received * rows * e, w1 * upcast)
    gemms = max(fc2, acts, fc1)
    # the router's: the tokens' gradient from the experts held, the fp32 gradients of its input and weight (and with
    # a 16-bit model the input's cast back)
    router = tokens * h * e + (tokens * h + moe.num_experts * h) * _FP32 + (tokens * h * e if e != _FP32 else 0)
    routed = max(combine, tokens * moe.num_experts * _FP32 + max(gemms, back), router)
    shared = moe.shared_expert_intermediate_size
    if not shared:
        return routed
    shared_acts = activation_backward_factor(model) * hidden_rows_full * (shared // tp) * e
    return max(shared_acts, hidden_rows * h * e + routed)
