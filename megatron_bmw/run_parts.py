"""The checks and config parts shared by a run built from flags (arguments.py) and one laid over a plan
(plan_overlay.py): training length, the training/optimizer/LR/data configs, and how the model fits the layout."""

from __future__ import annotations

from .config import (BatchSchedule, DataConfig, LRConfig, ModelConfig, OptimizerConfig, ParallelConfig,
                     PipelineConfig, TrainConfig, ZERO_BUBBLE)
from .config.layout_rules import check_context_parallel
from .config.schema import from_flags
from .errors import UsageError
from .strategy import parse_strategy


def data_config_from_args(args) -> DataConfig:
    return from_flags(DataConfig, args, data_path=args.data_path or [])


def training_length(args, schedule: BatchSchedule) -> int:
    """--train-iters, or the iterations --train-samples holds (Megatron's update_train_iters)."""
    if args.train_samples is not None:
        if args.train_iters is not None:
            raise UsageError("give --train-iters or --train-samples, not both")
        if args.train_samples < 1:
            raise UsageError(f"--train-samples must be >= 1, got {args.train_samples}")
        iterations = schedule.iterations(args.train_samples)
        if iterations == 0:
            raise UsageError(f"--train-samples {args.train_samples} is less than the first global batch "
                             f"({schedule.at(0)})")
        return iterations
    return 10 if args.train_iters is None else args.train_iters


def check_layout(model: ModelConfig, parallel: ParallelConfig, world_size: int | None = None) -> None:
    """The model splits over the tensor-parallel degrees: the run's, and every unit strategy's; its experts over
    the expert degrees (`world_size`, when known, for the expert layout's divisibility)."""
    tp = parallel.tensor_model_parallel_size
    model.check_tensor_parallel(tp)
    check_moe(model, parallel, world_size)
    for strategy in sorted(set(parallel.unit_strategies or ())):
        t = parse_strategy(strategy).tp
        if model.vocab_size % t:
            raise UsageError(f"--unit-strategies {strategy}: the padded vocabulary {model.vocab_size} does not split "
                             f"over tp {t} (raise --make-vocab-size-divisible-by)")
    if parallel.sequence_parallel and tp > 1 and model.seq_length % tp:
        raise UsageError(f"--sequence-parallel: --seq-length {model.seq_length} is not divisible by tensor-parallel "
                         f"size {tp}")
    check_context_parallel(model, parallel)


def check_moe(model: ModelConfig, parallel: ParallelConfig, world_size: int | None = None) -> None:
    """What a mixture of experts (docs/moe.md) needs of the model and the layout."""
    ep, etp, tp = parallel.expert_model_parallel_size, parallel.expert_tensor_parallel_size, \
        parallel.tensor_model_parallel_size
    moe = model.moe
    if moe is None:
        if ep > 1:
            raise UsageError(f"--expert-model-parallel-size {ep}: needs --num-experts (a mixture of experts)")
        return
    etp = etp or tp
    if model.model_type != "gpt":
        raise UsageError(f"--num-experts: mixtures of experts are built for GPT models, not {model.model_type}'s")
    if parallel.unit_strategies:
        raise UsageError("--num-experts does not combine with --unit-strategies (Galvatron-BMW strategies are tp x dp "
                         "per unit)")
    if moe.num_experts % ep:
        raise UsageError(f"--expert-model-parallel-size {ep} does not divide --num-experts {moe.num_experts}")
    if model.moe_ffn_hidden_size % etp:
        raise UsageError(f"--expert-tensor-parallel-size {etp} does not divide the experts' FFN size "
                         f"{model.moe_ffn_hidden_size} (--moe-ffn-hidden-size)")
    shared = moe.shared_expert_intermediate_size
    if shared is not None and shared % tp:
        raise UsageError(f"--tensor-model-parallel-size {tp} does not divide "
                         f"--moe-shared-expert-intermediate-size {shared}")
    if etp > 1 and model.add_bias_linear:
        raise UsageError(f"--expert-tensor-parallel-size {etp}: experts split over etp have no biases yet; give "
                         "--disable-bias-linear or --expert-tensor-parallel-size 1")
    rows = model.seq_length // parallel.context_parallel_size
    if tp > 1 and rows % tp:
        raise UsageError(f"--num-experts with --tensor-model-parallel-size {tp}: a rank's {rows} rows of each "
                         "sequence do not split over the tensor-parallel ranks (each routes its share)")
    if world_size is not None:
        stage = world_size // parallel.pipeline_model_parallel_size
        if stage % (ep * etp):
            raise UsageError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} must divide "
                             f"a pipeline stage's tensor x context x data parallel ranks ({stage})")



def training_configs(args, batches: BatchSchedule, train_iters: int, fp16: bool, bf16: bool,
                      distributed_optimizer: bool, overlap_grad_reduce: bool, overlap_param_gather: bool) -> dict:
    """The parts of a run no plan decides: training, optimizer, LR schedule and data."""
    gbs = batches.global_batch_size
    if overlap_param_gather and distributed_optimizer and not overlap_grad_reduce:
        raise UsageError("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    train = from_flags(TrainConfig, args, global_batch_size=gbs, train_iters=train_iters,
                       overlap_grad_reduce=overlap_grad_reduce, batch_schedule=batches)
    optimizer = from_flags(OptimizerConfig, args, fp16=fp16, bf16=bf16, use_distributed_optimizer=distributed_optimizer,
                           overlap_param_gather=overlap_param_gather)
    lr = from_flags(LRConfig, args, lr=optimizer.lr, min_lr=optimizer.min_lr, train_iters=train_iters,
                    global_batch_size=gbs, train_samples=train.train_samples)
    if not args.mock_data and not args.data_path:
        raise UsageError("give --data-path (preprocessed .bin/.idx prefixes) or --mock-data")
    return dict(train=train, optimizer=optimizer, lr=lr, data=data_config_from_args(args))


def check_split_backward(pipeline: PipelineConfig, parallel: ParallelConfig, model: ModelConfig) -> None:
    """What a zero-bubble schedule (backwards split into B and W) does not combine with yet (BPipe and slicing:
    PipelineConfig)."""
    name = pipeline.schedule
    if name in ZERO_BUBBLE and parallel.unit_strategies:
        raise UsageError(f"--pipeline-schedule {name} does not combine with --unit-strategies (not supported yet)")
    check_moe_slicing(pipeline, model)


def check_moe_slicing(pipeline: PipelineConfig, model: ModelConfig) -> None:
    """A sliced micro-batch runs as two forwards of half its samples. Routing that is decided over a micro-batch's
    tokens as a whole (the load-balancing loss over all of them, Sinkhorn's normalisation, the expert capacity)
    would then be decided over each half, which is another model; per-sequence routing (seq_aux_loss, z-loss,
    dropless) is the same over the halves."""
    moe = model.moe
    if moe is None or not pipeline.slicing:
        return
    why = "the expert capacity (--moe-expert-capacity-factor)" if moe.expert_capacity_factor is not None else None
    if moe.load_balancing_type == "sinkhorn":
        why = "Sinkhorn's routing (--moe-router-load-balancing-type sinkhorn)"
    if moe.load_balancing_type == "aux_loss" and moe.aux_loss_coeff > 0:
        why = "the load-balancing loss (--moe-router-load-balancing-type aux_loss)"
    if why is not None:
        raise UsageError(f"--microbatch-slicing with --num-experts: {why} is decided over a micro-batch's tokens as "
                         "a whole, and each half would decide it over its own; use seq_aux_loss or none, dropless, "
                         "or drop --microbatch-slicing")


def check_strategies_fit(strategies, model, stage_batch: int, sliced: bool) -> None:
    """Unit strategies against the model (a ModelConfig, or the flags' namespace) and the stage micro-batch: a
    tied embedding and head share one unsharded strategy, every tp splits the heads, hidden and FFN sizes, and
    with slicing every dp splits half a stage micro-batch."""
    flag = "--unit-strategies"
    first, last = strategies[0], strategies[-1]
    if not model.untie_embeddings_and_output_weights and (first != last or first.sharded):
        raise UsageError(f"{flag}: a tied word embedding needs the same, unsharded strategy for the embedding and "
                         f"the head (got {first} and {last}); give --untie-embeddings-and-output-weights to use "
                         "different ones")
    groups = model.num_query_groups if getattr(model, "group_query_attention", True) else None
    for name, value in (("--num-attention-heads", model.num_attention_heads), ("--num-query-groups", groups),
                        ("--hidden-size", model.hidden_size), ("--ffn-hidden-size", model.ffn_hidden_size)):
        bad = sorted({str(x) for x in strategies if value is not None and value % x.tp})
        if bad:
            raise UsageError(f"{flag}: {name} {value} does not split over the tp of {', '.join(bad)}")
    half = stage_batch // 2
    if sliced:
        bad = sorted({str(x) for x in strategies if stage_batch % 2 or half % x.dp})
        if bad:
            raise UsageError(f"{flag} with --microbatch-slicing: half a stage micro-batch ({half} samples) does not "
                             f"split over the dp of {', '.join(bad)}")
