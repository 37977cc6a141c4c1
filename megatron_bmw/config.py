"""Configuration dataclasses: the one home of every setting. Flags are parsed once (arguments.py) or a plan file
is read (planner/plan.py); the library only sees these objects. No torch here: dtypes are names."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field

from .errors import UsageError
from .units import DTYPE_BYTES, num_units, parse_recompute

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv")
ZERO_BUBBLE = ("zb-h1", "zb-h2", "zbv")  # backward split into B and W
MODEL_TYPES = ("gpt", "bert")
POSITION_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
LR_DECAY_STYLES = ("constant", "linear", "cosine")
_TORCH_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_name(dtype) -> str:
    """'fp32' | 'bf16' | 'fp16' from such a name or a torch dtype."""
    text = str(dtype).replace("torch.", "")
    name = _TORCH_NAMES.get(text, text)
    if name not in DTYPE_BYTES:
        raise UsageError(f"unknown parameter dtype {dtype!r} (use fp32, bf16 or fp16)")
    return name


def llama_features(values) -> list[str]:
    """The Llama-family flags a model's settings (ModelConfig fields, or a checkpoint's args) use."""
    heads = values.get("num_attention_heads")
    groups = values.get("num_query_groups") or heads
    position = values.get("position_embedding_type") or "learned_absolute"
    return [flag for flag, on in (
        (f"--position-embedding-type {position}", position != "learned_absolute"),
        ("--swiglu", bool(values.get("swiglu"))), (f"--num-query-groups {groups}", groups != heads),
        (f"--normalization {values.get('normalization')}", (values.get("normalization") or "LayerNorm") != "LayerNorm"),
        ("--disable-bias-linear", values.get("add_bias_linear") is False),
        ("--add-qkv-bias", bool(values.get("add_qkv_bias"))), ("--qk-layernorm", bool(values.get("qk_layernorm"))),
        ("--apply-layernorm-1p", bool(values.get("apply_layernorm_1p")))) if on]


@dataclass
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    vocab_size: int = 128  # padded vocabulary size
    seq_length: int = 32
    max_position_embeddings: int | None = None
    ffn_hidden_size: int | None = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    untie_embeddings_and_output_weights: bool = False
    attention_backend: str = "auto"  # auto | flash | unfused
    params_dtype: str = "fp32"  # fp32 | bf16 | fp16 (a torch dtype is accepted and named)
    model_type: str = "gpt"  # gpt (causal LM) | bert (bidirectional, masked LM + sentence order)
    bert_binary_head: bool = True  # BERT: pooler, sentence-order head and token-type embeddings
    apply_residual_connection_post_layernorm: bool = False  # residual taken after the LayerNorm (HF BERT layout)
    openai_gelu: bool = False  # the BERT LM head's GeLU as the tanh approximation (the MLP always uses it)
    # Llama-family GPTs (Megatron's flags of the same names)
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | none
    rotary_percent: float = 1.0  # of each head's dimensions rotated
    rotary_base: int = 10000
    rotary_seq_len_interpolation_factor: float | None = None  # positions divided by it
    swiglu: bool = False  # MLP: silu(gate) * up, fc1 holding [gate; up]
    num_query_groups: int | None = None  # grouped-query attention (1: multi-query); None: one per head
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    add_bias_linear: bool = True  # biases of the attention and MLP projections (--disable-bias-linear: False)
    add_qkv_bias: bool = False  # a QKV bias even without the other biases
    qk_layernorm: bool = False  # queries and keys normalised per head over the head dimension
    apply_layernorm_1p: bool = False  # every norm's weight stored as gamma - 1 (zero-centred), applied as w + 1

    def __post_init__(self) -> None:
        self.params_dtype = dtype_name(self.params_dtype)
        if self.model_type not in MODEL_TYPES:
            raise UsageError(f"unknown model type {self.model_type!r} (use {' or '.join(MODEL_TYPES)})")
        if self.ffn_hidden_size is None and self.swiglu:  # Megatron's: 8h/3 (two input matrices), a multiple of 64
            self.ffn_hidden_size = int(4 * self.hidden_size * 2 / 3 / 64) * 64
            if not self.ffn_hidden_size:
                raise UsageError(f"--swiglu with --hidden-size {self.hidden_size}: Megatron's default FFN size "
                                 "(8h/3 rounded down to a multiple of 64) is 0; give --ffn-hidden-size")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.hidden_size % self.num_attention_heads:
            raise UsageError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads {self.num_attention_heads}"
            )
        for flag, value in (("--init-method-std", self.init_method_std), ("--layernorm-epsilon", self.layernorm_epsilon)):
            if not value > 0:
                raise UsageError(f"{flag} must be > 0, got {value}")
        if self.attention_backend not in ("auto", "flash", "unfused"):
            raise UsageError(f"--attention-backend must be auto, flash or unfused, not {self.attention_backend!r}")
        self._check_llama()
        if self.seq_length > self.max_position_embeddings:
            raise UsageError(
                f"--seq-length {self.seq_length} exceeds --max-position-embeddings {self.max_position_embeddings}"
            )

    def _check_llama(self) -> None:
        for flag, value, choices in (("--position-embedding-type", self.position_embedding_type, POSITION_TYPES),
                                     ("--normalization", self.normalization, NORMALIZATIONS)):
            if value not in choices:
                raise UsageError(f"{flag} {value}: not supported (choose {', '.join(choices)})")
        groups = self.query_groups
        if not 1 <= groups <= self.num_attention_heads or self.num_attention_heads % groups:
            raise UsageError(f"--num-query-groups {groups} must divide --num-attention-heads "
                             f"{self.num_attention_heads}")
        if not 0.0 < self.rotary_percent <= 1.0:
            raise UsageError(f"--rotary-percent must be in (0, 1], got {self.rotary_percent}")
        if self.rotary_dim % 2:
            raise UsageError(f"--rotary-percent {self.rotary_percent} rotates {self.rotary_dim} of the head's "
                             f"{self.head_dim} dimensions; the rotated part must be even")
        if not self.rotary_base > 0:
            raise UsageError(f"--rotary-base must be > 0, got {self.rotary_base}")
        factor = self.rotary_seq_len_interpolation_factor
        if factor is not None and not factor >= 1:
            raise UsageError(f"--rotary-seq-len-interpolation-factor must be >= 1, got {factor}")
        if self.model_type == "bert" and self.llama_features():
            raise UsageError(f"{self.llama_features()[0]}: BERT runs its classic layers only (GPT models take it)")

    def llama_features(self) -> list[str]:
        """The flags of Llama-family layers this model uses (none for a GPT-2 or BERT)."""
        return llama_features(asdict(self))

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.rotary_percent)

    @property
    def qkv_rows(self) -> int:
        """Rows of the fused QKV projection: the query heads plus a key and a value head per group."""
        return (self.num_attention_heads + 2 * self.query_groups) * self.head_dim

    @property
    def fc1_rows(self) -> int:
        return 2 * self.ffn_hidden_size if self.swiglu else self.ffn_hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_units(self) -> int:
        """embedding + (attention, mlp) per layer + head."""
        return num_units(self.num_layers)

    @property
    def num_tokentypes(self) -> int:
        """Token-type (segment) embeddings: BERT with the binary head has two, as in Megatron."""
        return 2 if self.model_type == "bert" and self.bert_binary_head else 0

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]

    @property
    def torch_dtype(self):
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.params_dtype]

    @property
    def flash_attention(self) -> bool:
        """The fused attention kernel (every supported torch has scaled_dot_product_attention)."""
        return self.attention_backend != "unfused"

    def splits_over(self, tp: int) -> bool:
        """Whether tp ranks split the heads, query groups, hidden and FFN sizes (the vocabulary is padded)."""
        return not any(x % tp for x in (self.num_attention_heads, self.query_groups, self.hidden_size,
                                        self.ffn_hidden_size))

    def check_tensor_parallel(self, tp: int) -> None:
        for name, value in (
            ("--num-attention-heads", self.num_attention_heads),
            ("--num-query-groups", self.query_groups),
            ("--hidden-size", self.hidden_size),
            ("--ffn-hidden-size", self.ffn_hidden_size),
            ("padded vocabulary size", self.vocab_size),
        ):
            if value % tp:
                raise UsageError(f"--tensor-model-parallel-size {tp} does not divide {name} {value}")

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    sequence_parallel: bool = False
    rank_order: str = "tp-dp-pp"  # Megatron's; "bpipe" places pipeline pairs (s, p-1-s) side by side
    gpus_per_node: int | None = None
    # Galvatron-BMW hybrid: one strategy per unit (strategy.py text form) over the stage's world/pp ranks; tp is 1
    unit_strategies: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.unit_strategies is not None:
            self.unit_strategies = tuple(str(s) for s in self.unit_strategies)
        for name, value in (
            ("--tensor-model-parallel-size", self.tensor_model_parallel_size),
            ("--pipeline-model-parallel-size", self.pipeline_model_parallel_size),
        ):
            if value < 1:
                raise UsageError(f"{name} must be >= 1, got {value}")
        if self.gpus_per_node is not None and self.gpus_per_node < 1:
            raise UsageError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            self.sequence_parallel = False  # Megatron disables it for tp=1 as well

    def data_parallel_size(self, world_size: int) -> int:
        mp = self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        if world_size % mp:
            raise UsageError(
                f"world size {world_size} is not divisible by --tensor-model-parallel-size "
                f"{self.tensor_model_parallel_size} x --pipeline-model-parallel-size {self.pipeline_model_parallel_size}"
            )
        return world_size // mp


@dataclass
class PipelineConfig:
    """How one iteration runs: micro-batching, the schedule and its transforms, the unit partition and the
    recomputation of every unit. The part of a plan that the schedule, the engine, the memory and cost models
    and the simulator all read."""

    micro_batch_size: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved | zero-bubble zb-h1 | zb-h2 | zbv (B/W split)
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved 1F1B; zbv: 2)
    partition: tuple[int, ...] | None = None  # units per virtual stage; None: the default split
    recompute: tuple[str | None, ...] | None = None  # per unit: None | selective | full; None: nothing
    bpipe: bool = False
    slicing: int | str = 0  # AutoPipe: the first K micro-batches run as halves ("auto": chosen at start-up)

    def __post_init__(self) -> None:
        for name, value in (("--micro-batch-size", self.micro_batch_size),
                            ("micro-batches per iteration", self.num_microbatches),
                            ("virtual pipeline stages", self.virtual_stages)):
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be an integer >= 1, got {value!r}")
        if self.virtual_stages > 1 and self.schedule == "1f1b":
            self.schedule = "interleaved"
        if self.schedule not in SCHEDULES:
            raise UsageError(f"unknown pipeline schedule {self.schedule!r} (choose {', '.join(SCHEDULES)})")
        if self.schedule == "zbv":
            if self.virtual_stages not in (1, 2):
                raise UsageError(f"--pipeline-schedule zbv holds 2 model chunks per rank, not {self.virtual_stages}")
            self.virtual_stages = 2
        elif self.virtual_stages > 1 and self.schedule != "interleaved":
            raise UsageError(f"--pipeline-schedule {self.schedule} cannot interleave model chunks")
        if self.partition is not None:
            self.partition = tuple(self.partition)
        if self.recompute is not None:
            self.recompute = tuple(self.recompute)
        if self.bpipe and self.schedule == "gpipe":
            raise UsageError("--bpipe works with the 1F1B schedules, not --pipeline-schedule gpipe")
        if self.schedule in ZERO_BUBBLE and (self.bpipe or self.slicing):
            raise UsageError(f"--pipeline-schedule {self.schedule} does not combine with "
                             f"{'--bpipe' if self.bpipe else '--microbatch-slicing'} (not supported yet)")

    @property
    def placement(self) -> str:
        """Where the virtual stages sit on the ranks (pipeline/schedule.py): "v" for zbv, else "interleaved"."""
        return "v" if self.schedule == "zbv" else "interleaved"

    def unit_recompute(self, n_units: int) -> tuple[str | None, ...]:
        """Recomputation of every unit (a full-length tuple)."""
        return self.recompute if self.recompute is not None else (None,) * n_units

    def to_json(self) -> dict:
        out = asdict(self)
        out["partition"] = list(self.partition) if self.partition is not None else None
        out["recompute"] = [x or "none" for x in self.recompute] if self.recompute is not None else None
        return out

    @classmethod
    def from_json(cls, data: dict, n_units: int, where: str = "plan") -> PipelineConfig:
        known = set(cls.__dataclass_fields__)
        extra = sorted(set(data) - known)
        if extra:
            raise UsageError(f"{where}: unknown pipeline key {extra[0]!r} (allowed: {', '.join(sorted(known))})")
        values = dict(data)
        values["recompute"] = parse_recompute(values.get("recompute"), n_units, f"{where}: pipeline.recompute")
        try:
            return cls(**values)
        except TypeError as exc:
            raise UsageError(f"{where}: bad pipeline section ({exc})") from None


@dataclass(frozen=True)
class BatchSchedule:
    """The global batch size as training consumes samples (Megatron's micro-batch calculator): constant,
    a linear ramp-up (`--rampup-batch-size start increment samples`) or steps (`--step-batch-size-schedule`)."""

    global_batch_size: int  # the final (full) batch
    rampup: tuple[int, int, int] | None = None
    steps: tuple[tuple[int, int], ...] | None = None  # (from this many consumed samples, batch); first from 0

    def __post_init__(self) -> None:
        if self.rampup is not None:
            start, inc, ramp = self.rampup
            if start < 1 or inc < 1 or ramp < 0:
                raise UsageError(f"--rampup-batch-size {start} {inc} {ramp}: needs start >= 1, increment >= 1 "
                                 "and ramp-up samples >= 0")
            if start > self.global_batch_size or (self.global_batch_size - start) % inc:
                raise UsageError(f"--rampup-batch-size {start} {inc} {ramp}: --global-batch-size "
                                 f"{self.global_batch_size} must be the start plus a whole number of increments")
        if self.steps is not None:
            if not self.steps or self.steps[0][0] != 0:
                raise UsageError("--step-batch-size-schedule: the first threshold must be 0")
            if any(b < 1 for _, b in self.steps) or any(a[0] >= b[0] for a, b in zip(self.steps, self.steps[1:])):
                raise UsageError("--step-batch-size-schedule: thresholds must increase and batch sizes be >= 1")

    @property
    def varies(self) -> bool:
        return len(self.sizes()) > 1

    def sizes(self) -> list[int]:
        """Every batch size the schedule can use, ascending."""
        if self.rampup is not None:
            return list(range(self.rampup[0], self.global_batch_size + 1, self.rampup[1]))
        if self.steps is not None:
            return sorted({b for _, b in self.steps})
        return [self.global_batch_size]

    def at(self, consumed: int) -> int:
        """The batch of the iteration that starts after `consumed` samples (Megatron's arithmetic)."""
        if self.rampup is not None:
            start, inc, ramp = self.rampup
            increments = (self.global_batch_size - start) // inc
            if consumed > ramp or increments == 0 or ramp == 0:
                return self.global_batch_size
            return start + int(consumed / (ramp / increments)) * inc
        if self.steps is not None:
            return [b for t, b in self.steps if consumed >= t][-1]
        return self.global_batch_size

    def iterations(self, train_samples: int) -> int:
        """Iterations that fit in `train_samples` (a last partial batch is dropped, as in Megatron)."""
        last_change = self.rampup[2] if self.rampup else self.steps[-1][0] if self.steps else 0
        consumed = iters = 0
        while consumed <= last_change:  # the varying part, one iteration at a time
            batch = self.at(consumed)
            if consumed + batch > train_samples:
                return iters
            consumed, iters = consumed + batch, iters + 1
        return iters + (train_samples - consumed) // self.global_batch_size


@dataclass
class TrainConfig:
    global_batch_size: int  # the full batch (after any ramp-up)
    train_iters: int
    seed: int = 1234
    pipeline_trace: str | None = None
    overlap_grad_reduce: bool = False
    gradient_accumulation_fusion: bool = True  # weight gradients added into main_grad by their GEMM (wgrad_accum)
    eod_mask_loss: bool = False
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 100
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None
    manual_gc: bool = False  # Python's collector off during training, collected by hand (Megatron's --manual-gc)
    manual_gc_interval: int = 0  # iterations between collections; 0: only at the start and around validation
    manual_gc_eval: bool = True
    tensorboard_dir: str | None = None
    log_throughput: bool = False
    record_memory_history: bool = False  # the CUDA allocator's history, a snapshot per log interval (last rank)
    memory_snapshot_path: str = "snapshot.pickle"
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    save_optim: bool = True
    save_rng: bool = True
    load_optim: bool = True
    load_rng: bool = True
    load_fallback: bool = False  # --load-fallback: a damaged tracked checkpoint loads the previous one instead
    finetune: bool = False
    ckpt_format: str = "torch"  # what --save writes: torch (Megatron's legacy) or torch_dist (layout-free)
    override_opt_param_scheduler: bool = False  # on --load: this run's LR schedule, not the checkpoint's
    use_checkpoint_opt_param_scheduler: bool = False  # on --load: the checkpoint's LR schedule, whatever the flags
    ckpt_convert_format: str | None = None  # --ckpt-convert-format: load, save in this format, exit (Megatron's)
    ckpt_convert_save: str | None = None  # --ckpt-convert-save: the converted checkpoint goes to <this>/<format>
    distributed_backend: str | None = None
    distributed_timeout_minutes: float = 10.0
    log_activation_memory: bool = False
    train_samples: int | None = None  # --train-samples (train_iters is then derived from it)
    batch_schedule: BatchSchedule | None = None  # None: constant global_batch_size

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise UsageError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.train_iters < 1:
            raise UsageError(f"--train-iters must be >= 1, got {self.train_iters}")
        for flag, value in (("--log-interval", self.log_interval), ("--eval-interval", self.eval_interval)):
            if value < 1:
                raise UsageError(f"{flag} must be >= 1, got {value}")
        if self.eval_iters < 0:
            raise UsageError(f"--eval-iters must be >= 0, got {self.eval_iters}")
        if self.save_interval is not None and self.save_interval < 1:
            raise UsageError(f"--save-interval must be >= 1, got {self.save_interval}")
        if self.exit_interval is not None and self.exit_interval < 1:
            raise UsageError(f"--exit-interval must be >= 1, got {self.exit_interval}")
        if self.manual_gc_interval < 0:
            raise UsageError(f"--manual-gc-interval must be >= 0, got {self.manual_gc_interval}")
        if self.exit_duration_in_mins is not None and not self.exit_duration_in_mins > 0:
            raise UsageError(f"--exit-duration-in-mins must be > 0, got {self.exit_duration_in_mins:g}")
        if not 0 <= self.seed < 2**32:
            raise UsageError(f"--seed must be in [0, 2**32), got {self.seed}")
        if not self.distributed_timeout_minutes > 0:
            raise UsageError(f"--distributed-timeout-minutes must be > 0, got {self.distributed_timeout_minutes:g}")
        if self.batch_schedule is None:
            self.batch_schedule = BatchSchedule(self.global_batch_size)
        elif self.batch_schedule.global_batch_size != self.global_batch_size:
            raise UsageError(f"--global-batch-size {self.global_batch_size} differs from the batch schedule's "
                             f"final batch {self.batch_schedule.global_batch_size}")


def _check_lr(lr: float, min_lr: float, lr_flag: str = "--lr", min_flag: str = "--min-lr") -> None:
    if lr < 0:
        raise UsageError(f"{lr_flag} must be >= 0, got {lr}")
    if min_lr < 0:
        raise UsageError(f"{min_flag} must be >= 0, got {min_lr}")
    if min_lr > lr:
        raise UsageError(f"{min_flag} {min_lr} exceeds {lr_flag} {lr}")


@dataclass
class OptimizerConfig:
    lr: float
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    fp16: bool = False
    bf16: bool = False
    loss_scale: float | None = None  # a constant scale for fp16; None = dynamic
    initial_loss_scale: float = 2.0**32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    use_distributed_optimizer: bool = False
    overlap_param_gather: bool = False  # the ZeRO-1 parameter all-gather runs during the next forward
    param_bucket_size: int = 40_000_000  # elements per ZeRO-1 gather bucket (no flag; as GradSync's buckets)

    def __post_init__(self) -> None:
        if self.fp16 and self.bf16:
            raise UsageError("--fp16 and --bf16 are mutually exclusive")
        if self.overlap_param_gather and not self.use_distributed_optimizer:
            raise UsageError("--overlap-param-gather is only supported with the distributed optimizer "
                             "(give --use-distributed-optimizer)")
        _check_lr(self.lr, self.min_lr)
        if self.weight_decay < 0:
            raise UsageError(f"--weight-decay must be >= 0, got {self.weight_decay}")
        for flag, beta in (("--adam-beta1", self.adam_beta1), ("--adam-beta2", self.adam_beta2)):
            if not 0.0 <= beta < 1.0:
                raise UsageError(f"{flag} must be in [0, 1), got {beta}")
        if self.adam_eps <= 0:
            raise UsageError(f"--adam-eps must be > 0, got {self.adam_eps}")
        if self.clip_grad < 0:
            raise UsageError(f"--clip-grad must be >= 0 (0 disables clipping), got {self.clip_grad}")
        if self.loss_scale is not None and self.loss_scale <= 0:
            raise UsageError(f"--loss-scale must be > 0, got {self.loss_scale}")
        if self.min_loss_scale <= 0:
            raise UsageError(f"--min-loss-scale must be > 0, got {self.min_loss_scale}")
        if self.initial_loss_scale < self.min_loss_scale:
            raise UsageError(
                f"--initial-loss-scale {self.initial_loss_scale} is below --min-loss-scale {self.min_loss_scale}"
            )
        if self.loss_scale_window < 1:
            raise UsageError(f"--loss-scale-window must be >= 1, got {self.loss_scale_window}")
        if self.hysteresis < 1:
            raise UsageError(f"--hysteresis must be >= 1, got {self.hysteresis}")


@dataclass
class LRConfig:
    """The learning-rate schedule. As in Megatron it counts samples: iteration-based lengths (--lr-decay-iters,
    --lr-warmup-iters) are multiplied by `global_batch_size`; with --train-samples the lengths are samples."""

    lr: float
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_decay_iters: int | None = None  # None = train_iters
    lr_warmup_iters: int = 0
    lr_warmup_fraction: float | None = None  # fraction of the decay length; excludes the other warm-up flags
    train_iters: int | None = None
    global_batch_size: int = 1  # samples per iteration, for the iteration-based lengths
    train_samples: int | None = None  # sample-based training (--train-samples)
    lr_decay_samples: int | None = None  # None = train_samples
    lr_warmup_samples: int = 0
    # Megatron's --decoupled-lr/--decoupled-min-lr: the word embedding's and output layer's own peak and floor
    # (the floor defaults to min_lr), on the same warm-up and decay
    decoupled_lr: float | None = None
    decoupled_min_lr: float | None = None
    warmup_init: float = 0.0  # --lr-warmup-init: where the linear warm-up starts

    def __post_init__(self) -> None:
        if self.warmup_init < 0:
            raise UsageError(f"--lr-warmup-init must be >= 0, got {self.warmup_init}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise UsageError(
                f"--lr-decay-style must be one of {', '.join(LR_DECAY_STYLES)}, not {self.lr_decay_style!r}"
            )
        _check_lr(self.lr, self.min_lr)
        if self.decoupled_min_lr is not None and self.decoupled_lr is None:
            raise UsageError("--decoupled-min-lr needs --decoupled-lr")
        if self.decoupled_lr is not None:
            _check_lr(self.decoupled_lr, self.decoupled_floor, "--decoupled-lr",
                      "--decoupled-min-lr" if self.decoupled_min_lr is not None else "--min-lr")
        if self.global_batch_size < 1:
            raise UsageError(f"--global-batch-size must be >= 1, got {self.global_batch_size}")
        if self.lr_warmup_fraction is not None:
            if self.lr_warmup_iters or self.lr_warmup_samples:
                flag = "--lr-warmup-iters" if self.lr_warmup_iters else "--lr-warmup-samples"
                raise UsageError(f"--lr-warmup-fraction and {flag} are mutually exclusive")
            if not 0.0 <= self.lr_warmup_fraction < 1.0:
                raise UsageError(f"--lr-warmup-fraction must be in [0, 1), got {self.lr_warmup_fraction}")
        if self.train_samples is not None:
            self._check_samples()
        else:
            self._check_iterations()
        if self.warmup_steps >= self.decay_steps:
            unit = "samples" if self.train_samples is not None else "iters"
            raise UsageError(f"--lr-warmup-{unit} must end before --lr-decay-{unit} ends (warm-up "
                             f"{self.warmup_steps:g} samples, decay {self.decay_steps:g} samples)")

    @property
    def decoupled_floor(self) -> float:
        """The decoupled parameters' final learning rate."""
        return self.decoupled_min_lr if self.decoupled_min_lr is not None else self.min_lr

    def _check_iterations(self) -> None:
        if self.lr_decay_samples is not None or self.lr_warmup_samples:
            flag = "--lr-decay-samples" if self.lr_decay_samples is not None else "--lr-warmup-samples"
            raise UsageError(f"{flag} needs sample-based training (--train-samples); with --train-iters use "
                             f"{flag.replace('samples', 'iters')}")
        if self.lr_decay_iters is None:
            self.lr_decay_iters = self.train_iters
        if self.lr_decay_iters is None:
            raise UsageError("--lr-decay-iters is required when --train-iters is not given")
        if self.lr_decay_iters <= 0:
            raise UsageError(f"--lr-decay-iters must be > 0, got {self.lr_decay_iters}")
        if self.lr_warmup_iters < 0:
            raise UsageError(f"--lr-warmup-iters must be >= 0, got {self.lr_warmup_iters}")

    def _check_samples(self) -> None:
        if self.lr_decay_iters is not None or self.lr_warmup_iters:
            flag = "--lr-decay-iters" if self.lr_decay_iters is not None else "--lr-warmup-iters"
            raise UsageError(f"{flag} counts iterations; with --train-samples use "
                             f"{flag.replace('iters', 'samples')}")
        if self.lr_decay_samples is None:
            self.lr_decay_samples = self.train_samples
        if self.lr_decay_samples <= 0:
            raise UsageError(f"--lr-decay-samples must be > 0, got {self.lr_decay_samples}")
        if self.lr_warmup_samples < 0:
            raise UsageError(f"--lr-warmup-samples must be >= 0, got {self.lr_warmup_samples}")

    @property
    def decay_steps(self) -> int:
        """Decay length in samples."""
        if self.train_samples is not None:
            return self.lr_decay_samples
        return self.lr_decay_iters * self.global_batch_size

    @property
    def warmup_steps(self) -> float:
        """Warm-up length in samples (fractional when given by --lr-warmup-fraction, like Megatron)."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * self.decay_steps
        if self.train_samples is not None:
            return float(self.lr_warmup_samples)
        return float(self.lr_warmup_iters * self.global_batch_size)


def parse_split(split: str) -> list[float]:
    """`"969,30,1"` (or `"969/30/1"`) -> three normalised weights for train/valid/test."""
    parts = re.split(r"[,/]", split.strip())
    if not 1 <= len(parts) <= 3:
        raise UsageError(f"--split: expected up to 3 weights like '969,30,1', got {split!r}")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise UsageError(f"--split: {split!r} is not a list of numbers") from None
    if any(not math.isfinite(w) for w in weights) or not math.isfinite(sum(weights)):
        raise UsageError(f"--split: weights in {split!r} must be finite numbers (only their ratios count)")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise UsageError(f"--split: weights in {split!r} must be non-negative with a positive sum")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return [w / total for w in weights]


@dataclass
class DataConfig:
    """Everything the data layer needs; field names follow Megatron-LM's flags (`--data-path` -> data_path)."""

    data_path: list[str] = field(default_factory=list)
    split: str = "969,30,1"
    data_cache_path: str | None = None
    tokenizer_type: str | None = None
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    mock_data: bool = False
    # BERT samples (data/bert_dataset.py)
    mask_prob: float = 0.15
    short_seq_prob: float = 0.1
    whole_word_masking: bool = True
    masking_max_ngram: int = 3

    def __post_init__(self) -> None:
        # Megatron reads the numbers out of --split: quotes a launch script kept, or spaces, do not matter
        self.split = re.sub(r"[\s'\"]", "", str(self.split))
        parse_split(self.split)
        if not 0.0 < self.mask_prob < 1.0:
            raise UsageError(f"--mask-prob must be in (0, 1), got {self.mask_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise UsageError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if self.masking_max_ngram < 1:
            raise UsageError(f"--masking-max-ngram must be >= 1, got {self.masking_max_ngram}")


@dataclass
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    pipeline: PipelineConfig
    train: TrainConfig
    optimizer: OptimizerConfig
    lr: LRConfig
    data: DataConfig
    orig_vocab_size: int | None = None
    make_vocab_size_divisible_by: int | None = None  # the padding multiple (x tp) behind model.vocab_size
