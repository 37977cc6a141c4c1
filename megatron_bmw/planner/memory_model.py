"""Memory per pipeline rank: model states, activations held by the schedule, and an allowance.

A unit's activations per micro-batch, tensor by tensor as OUR units save them, are unit_activations.py's; here
they are added up over a rank's units and the micro-batches the schedule has it hold (pipeline/holding.py).
Engines that checkpoint whole layers (Megatron-LM, DeepSpeed: `layer_checkpoints`) keep one input per fully
recomputed layer, the attention unit's, and the MLP's backward then holds the rebuilt layer
(`layer_transient_extra`).
The engine frees a stage's output once it is sent (Megatron's deallocate_output_tensor), so between units
nothing is held beyond what the next unit saves. Where the tied output weight is the embedding's own Parameter
(embedding and head on one rank) its gradient cannot go straight into main_grad: autograd holds the logits' part,
v/t x h in the parameter dtype, from the head's backward to the embedding's (`shared_output_grad_bytes`).
Zero-bubble schedules split a backward into B (input gradients) and W (the linear layers' weight gradients,
parallel/deferred_wgrad.py). B frees what the unit saved except what W needs (unit_activations.py), which it
keeps until W. Recomputation changes none of it: B rebuilds the inputs and W keeps them.

The count is Korthikanti et al. 2022's (sbh(34 + 5as/h) bytes per layer in fp16, 34 sbh/t with SP;
unit_activations.korthikanti_layer_bytes): their 34 sbh is our 13 sbh (attention with its LayerNorm) + 21 sbh
(MLP with its LayerNorm), their 5as^2b our unfused core with dropout (flash keeps no s^2 term). We also count
the LayerNorm statistics and integer ids (they ignore them), and full recomputation at sub-layer granularity
keeps two inputs per layer (one per unit), i.e. 4 sbh in fp16 instead of their 2 sbh.

Mixtures of experts (docs/moe.md; moe_model.py): an MoE unit's activations are those of the busiest rank of the
stage's expert layout (StageLayout.ep, etp) under the routing model (MemorySettings.moe_imbalance); its parameters
split into dense ones (norm, router, shared experts) and the rank's expert shards, whose optimizer state ZeRO-1
shards over the expert data-parallel ranks edp = tp cp dp / (etp ep) where the dense ones' is over dp x cp.

Context parallelism (StageLayout.cp = C): every unit holds its activations for the rank's s/C tokens
(unit_activations.py, the context-parallel core's contract there); the model states are those of C = 1 (the
parameters are replicated over cp), except that ZeRO-1 shards the optimizer state over dp x cp ranks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import ModelConfig
from ..errors import UsageError
from ..pipeline.holding import bytes_size, holding_events, peak
from ..pipeline.partition import rank_chunks
from ..pipeline.schedule import Schedule
from ..units import UNIT_KINDS, owns_output_weight, unit_kind, unit_kind_of, unit_names  # noqa: F401 - re-exported
from .engine import OURS, EngineConfig, PrecisionConfig  # noqa: F401 - PrecisionConfig is re-exported
from .moe_model import Experts, default_experts, moe_param_split
from .unit_activations import DEVICE_KINDS, unit_activation_bytes, unit_transient_bytes, unit_wgrad_bytes
# re-exported: callers outside the planner import them from here (tests/models, tests/parallel)
from .unit_activations import unit_backward_bytes, unit_saved_tensors  # noqa: F401


# ---- parameters and model states ------------------------------------------------------------------------------
def unit_param_split(kind: str, model: ModelConfig, tp: int = 1, output_weight: bool = True,
                     experts: Experts | None = None) -> tuple[int, int]:
    """(dense, expert) parameters one rank holds for a unit: an MoE unit's expert shards apart (moe_model.py;
    `experts` by default ep 1, etp = tp), every other unit's all dense."""
    if kind == "moe":
        return moe_param_split(model, tp, default_experts(tp, experts))
    return unit_param_count(kind, model, tp, output_weight), 0


def unit_param_count(kind: str, model: ModelConfig, tp: int = 1, output_weight: bool = True,
                     experts: Experts | None = None) -> int:
    """Parameters one tensor-parallel rank holds for a unit. For the head, `output_weight` says whether the
    rank owns an output matrix (untied, or the tied copy on a last pipeline stage) rather than sharing the
    embedding's."""
    if kind == "moe":
        return sum(unit_param_split(kind, model, tp, output_weight, experts))
    h, f, v = model.hidden_size, model.ffn_hidden_size, model.vocab_size
    per_norm = 1 if model.normalization == "RMSNorm" else 2  # RMSNorm has no bias
    norm = per_norm * h
    bias = model.add_bias_linear
    if kind == "embedding":
        positions = model.max_position_embeddings if model.position_embedding_type == "learned_absolute" else 0
        return (v // tp) * h + positions * h + model.num_tokentypes * h
    if kind == "attention":
        qkv = model.qkv_rows // tp
        qk_norms = 2 * per_norm * model.head_dim if model.qk_layernorm else 0  # replicated over tp
        return norm + qk_norms + qkv * h + (qkv if bias or model.add_qkv_bias else 0) + h * (h // tp) \
            + (h if bias else 0)
    if kind == "mlp":
        return norm + (model.fc1_rows // tp) * h + (model.fc1_rows // tp if bias else 0) + h * (f // tp) \
            + (h if bias else 0)
    if kind == "head":
        n = norm + ((v // tp) * h if output_weight else 0)
        if model.model_type == "bert":  # LM dense, LayerNorm and output bias; pooler and sentence-order head
            n += h * h + h + 2 * h + v // tp + ((h * h + h) + (2 * h + 2) if model.bert_binary_head else 0)
        return n
    raise ValueError(f"unknown unit kind {kind!r}")


def total_parameters(model: ModelConfig) -> int:
    """Unique parameters of the whole model (a tied output matrix counted once)."""
    n = unit_param_count("embedding", model) + unit_param_count(
        "head", model, output_weight=model.untie_embeddings_and_output_weights)
    return n + sum(unit_param_count(unit_kind_of(model, name), model) for name in unit_names(model.num_layers)[1:-1])


@dataclass(frozen=True)
class MemorySettings:
    """Knobs of the memory model that are not properties of the run."""

    device: str = "cuda"
    workspace_bytes: float = 0.0  # fixed per rank: framework context, kernels' workspace
    fragmentation: float = 0.0  # fraction added on top of everything else
    engine: EngineConfig = EngineConfig()  # whose model states (gradient precision, main-gradient buffers)
    moe_imbalance: float = 1.0  # max/mean tokens per expert (moe_model.py's routing model; --moe-load-imbalance)
    # when set (cuda_allowance.DerivedAllowance), workspace and fragmentation come per layout from it
    derived: object | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.device not in DEVICE_KINDS:
            raise UsageError(f"--memory-device must be cuda or cpu, not {self.device!r}")
        if self.workspace_bytes < 0:
            raise UsageError(f"--memory-workspace-gb must be >= 0, got {self.workspace_bytes / 2**30:g}")
        if not 0 <= self.fragmentation < 1:
            raise UsageError(f"--memory-fragmentation must be in [0, 1) (a fraction added to the memory in use), "
                             f"got {self.fragmentation}")

    def precision(self, model: ModelConfig, distributed_optimizer: bool) -> PrecisionConfig:
        return self.engine.precision(model.params_dtype, distributed_optimizer)

    def for_layout(self, model: ModelConfig, tp: int, dp: int, pp: int, micro_batch_size: int,
                   sp: bool, cp: int = 1) -> MemorySettings:
        """These settings with the allowance of one layout: the derived one (cuda_allowance.py) where there is
        one, else unchanged."""
        if self.derived is None:
            return self
        return self.derived.settings(self, model, tp, dp, pp, micro_batch_size, sp, cp)


@dataclass
class RankMemory:
    """Memory of one pipeline rank (bytes)."""

    params_bytes: float
    grads_bytes: float
    optimizer_bytes: float
    activation_bytes: float  # at the peak of the schedule
    transient_bytes: float  # one unit's backward: recomputed activations and gradient buffers
    allowance_bytes: float
    peak_inflight_microbatches: float
    chunk_activation_bytes: list[float]  # per model chunk, one micro-batch

    @property
    def static_bytes(self) -> float:
        return self.params_bytes + self.grads_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> float:
        return self.static_bytes + self.activation_bytes + self.transient_bytes + self.allowance_bytes


@dataclass(frozen=True)
class StageLayout:
    """What the memory model needs to know about the parallel layout of one run."""

    tp: int
    dp: int
    pp: int
    sequence_parallel: bool
    micro_batch_size: int
    partition: tuple[int, ...]  # units per virtual stage
    recompute: tuple[str | None, ...] | None = None  # per unit of the model (PipelineConfig.recompute)
    placement: str = "interleaved"  # where the virtual stages sit (PipelineConfig.placement)
    cp: int = 1  # context-parallel size: each rank holds s/cp tokens of every sequence
    cp_comm: str = "p2p"  # the context-parallel attention's exchange (ParallelConfig.cp_comm_type)
    ep: int = 1  # expert-parallel size (MoE units)
    etp: int | None = None  # expert-tensor-parallel size; None: tp

    @property
    def optimizer_shards(self) -> int:
        """Ranks ZeRO-1 shards the optimizer state over: the gradient-reduction group, dp x cp."""
        return self.dp * self.cp

    @property
    def expert_shards(self) -> int:
        """Ranks ZeRO-1 shards the expert parameters' optimizer state over: edp = tp cp dp / (etp ep)."""
        return self.tp * self.cp * self.dp // (self.expert_tp * self.ep)

    @property
    def expert_tp(self) -> int:
        return self.etp if self.etp is not None else self.tp

    def experts(self, imbalance: float = 1.0) -> Experts:
        return Experts(self.ep, self.expert_tp, imbalance)

    def unit_recompute(self, index: int) -> str | None:
        return self.recompute[index] if self.recompute is not None else None


def chunk_unit_indices(layout: StageLayout, rank: int) -> list[list[int]]:
    return rank_chunks(list(layout.partition), layout.pp, rank, layout.placement)


def chunk_units(layout: StageLayout, model: ModelConfig, rank: int) -> list[list[str]]:
    names = unit_names(model.num_layers)
    return [[names[i] for i in chunk] for chunk in chunk_unit_indices(layout, rank)]


def layer_checkpoints(engine: EngineConfig) -> bool:
    """Whether full recomputation checkpoints whole layers, keeping one input per layer: Megatron-LM's and
    DeepSpeed's (`--recompute-granularity full`, each layer one checkpoint). Ours checkpoints each unit."""
    return engine.name != OURS


def _layer_paired(layout: StageLayout, names: list[str], chunk: list[int], i: int) -> bool:
    """Whether unit i is an MLP unit inside its layer's whole-layer checkpoint: its attention unit in the same chunk
    and both fully recomputed."""
    return (unit_kind(names[i]) == "mlp" and i - 1 in chunk and layout.unit_recompute(i) == "full"
            and layout.unit_recompute(i - 1) == "full")


def layer_transient_extra(model: ModelConfig, micro_batch_size: int, tp: int, sp: bool, device: str,
                          cp: int = 1, cp_comm: str = "p2p", te: bool = False) -> int:
    """What a whole-layer checkpoint's backward holds beyond its MLP unit's own transient: the MLP's input
    (rebuilt, not kept) and the attention unit's rebuilt activations, alive while the MLP's backward runs."""
    def saved(kind: str, recompute: str | None) -> int:
        return unit_activation_bytes(kind, model, micro_batch_size, tp, sp, recompute, device, cp, cp_comm, te=te)
    return saved("mlp", "full") + saved("attention", None) - saved("attention", "full")


def chunk_saved_bytes(layout: StageLayout, model: ModelConfig, rank: int,
                      settings: MemorySettings = MemorySettings()) -> list[float]:
    """Per model chunk of `rank`, what its units save for backward for one micro-batch (what the activation
    store records and BPipe moves). Under an engine that checkpoints whole layers, a fully recomputed layer keeps
    only its attention unit's input; under Megatron-core's and NeMo's Transformer Engine modules the attention
    saves what they save (unit_activations.py)."""
    names = unit_names(model.num_layers)
    sp = layout.sequence_parallel and layout.tp > 1
    layered = layer_checkpoints(settings.engine)
    experts = layout.experts(settings.moe_imbalance)
    te = settings.engine.megatron_core_runtime
    return [float(sum(unit_activation_bytes(unit_kind_of(model, names[i]), model, layout.micro_batch_size, layout.tp,
                                            sp, layout.unit_recompute(i), settings.device, layout.cp, layout.cp_comm,
                                            experts, te)
                      for i in chunk if not (layered and _layer_paired(layout, names, chunk, i))))
            for chunk in chunk_unit_indices(layout, rank)]


def chunk_wgrad_bytes(layout: StageLayout, model: ModelConfig, rank: int) -> list[float]:
    """Per model chunk of `rank`, what one micro-batch keeps from a split backward's B until its W."""
    names = unit_names(model.num_layers)
    sp = layout.sequence_parallel and layout.tp > 1
    return [float(sum(unit_wgrad_bytes(unit_kind_of(model, names[i]), model, layout.micro_batch_size, layout.tp, sp, layout.cp)
                      for i in chunk)) for chunk in chunk_unit_indices(layout, rank)]


def activation_walk(schedule: Schedule, rank: int, saved: Callable[[int], list[float]],
                    wgrad: Callable[[int], list[float]] | None = None,
                    holds: list | None = None) -> tuple[float, float]:
    """(peak activation bytes, peak chunk-micro-batches) of the rank's action list, by pipeline/holding.py's
    rule. `saved(r)` gives rank r's saved bytes per chunk (an acceptor holds its evictor's), `wgrad(r)` what a
    chunk keeps between a split backward's B and W (zero-bubble schedules); `holds`: the rank's holding events
    when the caller already has them."""
    if holds is None:
        holds = holding_events(schedule.actions[rank], rank)
    return peak(holds, bytes_size(saved, wgrad)), peak(holds)


def rank_memory(layout: StageLayout, model: ModelConfig, schedule: Schedule, rank: int,
                precision: PrecisionConfig, settings: MemorySettings = MemorySettings(),
                activation_peak: float | None = None, holds: list | None = None) -> RankMemory:
    """Memory of pipeline rank `rank` (any tensor-/data-parallel rank of it: they are alike).

    The activation peak comes from walking the rank's actions (activations accepted from a BPipe evictor
    included); `activation_peak` overrides it (e.g. with the simulator's timed peak)."""
    chunks = chunk_units(layout, model, rank)
    names = [n for c in chunks for n in c]
    own_output = owns_output_weight(model.untie_embeddings_and_output_weights, layout.pp, names)
    experts = layout.experts(settings.moe_imbalance)
    splits = [unit_param_split(unit_kind_of(model, n), model, layout.tp, own_output, experts) for n in names]
    dense, expert = sum(d for d, _ in splits), sum(x for _, x in splits)
    params = dense + expert
    chunk_bytes = chunk_saved_bytes(layout, model, rank, settings)
    act, inflight = activation_walk(schedule, rank, lambda r: chunk_saved_bytes(layout, model, r, settings),
                                    lambda r: chunk_wgrad_bytes(layout, model, r), holds)
    if activation_peak is not None:
        act = activation_peak
    transient = _backward_transient(layout, model, rank, settings)
    optimizer = dense * precision.optimizer_bytes(layout.optimizer_shards) \
        + expert * precision.optimizer_bytes(layout.expert_shards)
    static = params * (precision.param_bytes + precision.grad_bytes) + optimizer
    allowance = settings.workspace_bytes + settings.fragmentation * (static + act + transient)
    return RankMemory(
        params_bytes=params * precision.param_bytes,
        grads_bytes=params * precision.grad_bytes,
        optimizer_bytes=optimizer,
        activation_bytes=act,
        transient_bytes=transient,
        allowance_bytes=allowance,
        peak_inflight_microbatches=inflight,
        chunk_activation_bytes=chunk_bytes,
    )


def shared_output_grad_bytes(model: ModelConfig, tp: int, pp: int, names: list[str], engine: EngineConfig) -> int:
    """Our runtime's gradient of the output layer's weight when it is the word embedding's own Parameter on this
    rank (tied, embedding and head together): two uses in one backward, so it cannot go straight into main_grad
    (parallel/wgrad_accum.py) and autograd holds the logits' part, v/t x h in the parameter dtype, from the
    head's backward until the embedding's adds to it. 0 elsewhere, and for engines that accumulate it fused."""
    if engine.name != OURS or "head" not in names \
            or owns_output_weight(model.untie_embeddings_and_output_weights, pp, names):
        return 0
    return (model.vocab_size // tp) * model.hidden_size * model.dtype_bytes


def _backward_transient(layout: StageLayout, model: ModelConfig, rank: int, settings: MemorySettings) -> float:
    """The rank's worst unit backward: rebuilt activations plus gradient buffers (one unit at a time; a whole-layer
    checkpoint's MLP backward also holds the layer's rebuilt attention and its own input), plus the shared
    output weight's gradient (`shared_output_grad_bytes`), held from the head's backward, the first, to the end."""
    names = unit_names(model.num_layers)
    sp = layout.sequence_parallel and layout.tp > 1
    b, tp = layout.micro_batch_size, layout.tp
    layered = layer_checkpoints(settings.engine)
    extra = layer_transient_extra(model, b, tp, sp, settings.device, layout.cp, layout.cp_comm,
                                  settings.engine.megatron_core_runtime) if layered else 0
    chunks = chunk_unit_indices(layout, rank)
    held = shared_output_grad_bytes(model, tp, layout.pp, [names[i] for c in chunks for i in c], settings.engine)
    experts = layout.experts(settings.moe_imbalance)
    return float(held + max(unit_transient_bytes(unit_kind_of(model, names[i]), model, b, tp, sp,
                                                 layout.unit_recompute(i), settings.device, layout.cp,
                                                 layout.cp_comm, experts)
                            + (extra if layered and _layer_paired(layout, names, chunk, i) else 0)
                            for chunk in chunks for i in chunk))


def precision_from(model: ModelConfig, distributed_optimizer: bool, engine: EngineConfig = EngineConfig()
                   ) -> PrecisionConfig:
    return engine.precision(model.params_dtype, distributed_optimizer)
