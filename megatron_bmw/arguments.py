"""Megatron-LM-compatible command line -> config dataclasses. Parsed once, at the entry point."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from .config import (BatchSchedule, DataConfig, LRConfig, ModelConfig, MoEConfig, OptimizerConfig, ParallelConfig,
                     PipelineConfig, RunConfig, TrainConfig, padded_vocab_size)
from .config.inputs import FlagInputs
from .config.planner import AUTO, AUTO_GROUP, AutoPlanConfig, PlanRequest
from .config.schema import add_flags, check_flag_values, from_flags
from .errors import OneLineParser, UsageError
from .flag_rules import check_finite, join_negative_values
from .config.layout_rules import legacy_format_refusal
from .pipeline.partition import parse_partition, rank_chunks
from .pipeline.slicing import check_slicing, parse_slicing
from .plan_overlay import check_flags_against_plan, configs_from_plan, given_flags, plan_flags  # noqa: F401
from .plan_overlay import plan_request
from .planner.plan import Plan
from .run_parts import (check_layout, check_split_backward, check_strategies_fit, data_config_from_args,  # noqa: F401
                        training_configs, training_length)
from .strategy import parse_unit_strategies
from .units import num_units, parse_recompute, recompute_from_flags, unit_layer, unit_names

# Megatron flags accepted so existing launch scripts run unchanged, reported once at start-up, otherwise ignored
# (flag -> number of values it takes). Kernel selection and internal implementation choices:
IGNORED_KERNEL_FLAGS = {
    "--no-masked-softmax-fusion": 0, "--no-bias-gelu-fusion": 0, "--no-bias-dropout-fusion": 0,
    "--no-async-tensor-model-parallel-allreduce": 0,
    "--use-mcore-models": 0, "--use-legacy-models": 0, "--no-persist-layer-norm": 0,
    "--transformer-impl": 1, "--accumulate-allreduce-grads-in-fp32": 0, "--empty-unused-memory-level": 1,
    "--num-workers": 1, "--data-impl": 1,
    "--no-create-attention-mask-in-dataloader": 0, "--no-mmap-bin-files": 0,
    # how a torch_dist checkpoint is written (the checkpoint is the same), fp16 attention scaling (the softmax is fp32
    # here), p2p and embedding-gradient scheduling
    "--ckpt-fully-parallel-save": 0, "--no-ckpt-fully-parallel-save": 0, "--ckpt-fully-parallel-load": 0,
    "--async-save": 0, "--apply-query-key-layer-scaling": 0, "--overlap-p2p-communication": 0,
    "--defer-embedding-wgrad-compute": 0,
    # FP8 matmuls and a bf16 gradient reduction: speed-for-precision choices; the run keeps --bf16/--fp16 matmuls
    # and fp32 gradient reduction
    "--fp8-format": 1, "--fp8-recipe": 1, "--fp8-margin": 1, "--fp8-amax-history-len": 1,
    "--fp8-amax-compute-algo": 1, "--fp8-param-gather": 0, "--fp8-interval": 1, "--no-fp8-wgrad": 0,
    "--first-last-layers-bf16": 0, "--num-layers-at-start-in-bf16": 1, "--num-layers-at-end-in-bf16": 1,
    "--grad-reduce-in-bf16": 0,
    # MoE kernels and overlaps (the experts' permutation, the router's fused kernel, the grouped GEMM's older
    # implementation, the shared experts overlapped with the dispatch): the same routing and experts either way
    "--moe-permute-fusion": 0, "--moe-router-fusion": 0, "--moe-use-legacy-grouped-gemm": 0,
    "--moe-shared-expert-overlap": 0,
}
# Logging extras this implementation does not write:
IGNORED_LOGGING_FLAGS = {
    "--timing-log-level": 1, "--log-timers-to-tensorboard": 0, "--log-validation-ppl-to-tensorboard": 0,
    "--log-memory-to-tensorboard": 0, "--tensorboard-log-interval": 1, "--tensorboard-queue-size": 1,
    "--profile": 0, "--profile-step-start": 1, "--profile-step-end": 1, "--use-pytorch-profiler": 0,
    "--log-batch-size-to-tensorboard": 0, "--wandb-project": 1, "--wandb-exp-name": 1, "--wandb-save-dir": 1,
    "--wandb-entity": 1, "--log-world-size-to-tensorboard": 0,
}
IGNORED_FLAGS = {**IGNORED_KERNEL_FLAGS, **IGNORED_LOGGING_FLAGS}
# Megatron's attention backends -> ours: local runs as unfused (fused: torch's fused attention, cuDNN's kernel first)
_BACKEND_AS = {"local": "unfused"}
CKPT_FORMATS = ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor")  # Megatron's
CKPT_FORMATS_HERE = ("torch", "torch_dist")  # written and read here


# Every class whose fields declare Megatron flags (config/schema.py): the parser is generated from them
FLAG_CLASSES = (ModelConfig, MoEConfig, RunConfig, ParallelConfig, PipelineConfig, BatchSchedule, TrainConfig,
                OptimizerConfig, LRConfig, DataConfig, FlagInputs, AutoPlanConfig)
GROUPS = ("model", "mixture of experts", "parallelism", "training", "optimizer and learning rate", "data", "checkpointing",
          "logging and evaluation")


def build_parser(prog: str = "pretrain_gpt.py", model_type: str = "gpt") -> argparse.ArgumentParser:
    what = "BERT" if model_type == "bert" else "GPT"
    p = OneLineParser(prog=prog, description=f"Megatron-style {what} pretraining (megatron_bmw)", allow_abbrev=False)
    add_megatron_args(p)
    add_flags(p, {}, FLAG_CLASSES, lambda group: group == AUTO_GROUP)  # the entry points' own: not autoconfig's
    if model_type == "bert":
        add_bert_args(p)
    return p


def add_bert_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """pretrain_bert.py's flags (Megatron's names; --no-whole-word-masking and --masking-max-ngram are ours)."""
    add_flags(p, {}, FLAG_CLASSES, lambda group: group == "bert")
    p.set_defaults(model_type="bert", bert_binary_head=True)
    return p


def add_megatron_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every Megatron-compatible flag group to `p` (shared by pretrain_gpt.py and tools/autoconfig.py)."""
    groups = {name: p.add_argument_group(name) for name in GROUPS}
    add_flags(p, groups, FLAG_CLASSES, lambda group: group in GROUPS)
    return p


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser` and of its subcommands."""
    out = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                out |= _option_strings(sub)
    return out


def parse_args(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    parser = parser or build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    kept, ignored, i = [], [], 0
    own = _option_strings(parser)  # e.g. autoconfig's --profile FILE is its own, not Megatron's ignored --profile
    while i < len(argv):
        flag = argv[i].split("=")[0]
        if flag in IGNORED_FLAGS and flag not in own:
            ignored.append(flag)
            i += 1 + (IGNORED_FLAGS[flag] if "=" not in argv[i] else 0)
            continue
        kept.append(argv[i])
        i += 1
    args = parser.parse_args(join_negative_values(kept, parser))
    check_finite(args, parser)
    if getattr(args, "model_type", "gpt") == "bert" and args.tokenizer_type is None and args.vocab_file:
        args.tokenizer_type = "BertWordPieceLowerCase"  # Megatron's pretrain_bert default
    args.ignored_flags = ignored
    if hasattr(args, "attention_backend"):
        args.attention_backend = _BACKEND_AS.get(args.attention_backend, args.attention_backend)
    args.ckpt_format_given = any(a.split("=")[0] in ("--ckpt-format", "--use-dist-ckpt") for a in kept)
    args.notes = []  # start-up lines about choices the flags left to this run (the banner prints them)
    args.ignored_kernel_flags = [f for f in ignored if f in IGNORED_KERNEL_FLAGS]
    args.ignored_logging_flags = [f for f in ignored if f in IGNORED_LOGGING_FLAGS]
    return args


def _check_megatron_choices(args) -> None:
    """Megatron flags whose other values select something this implementation does not have."""
    if args.hierarchical_context_parallel_sizes:
        raise UsageError("--hierarchical-context-parallel-sizes: hierarchical context parallelism (a2a+p2p) is not "
                         "built; use --context-parallel-size with --cp-comm-type p2p or a2a")
    if args.calculate_per_token_loss and (args.eod_mask_loss or getattr(args, "model_type", "gpt") == "bert"):
        why = "--eod-mask-loss" if args.eod_mask_loss else "BERT's masked positions"
        raise UsageError(f"--calculate-per-token-loss: not supported with {why} (micro-batches then hold different "
                         "numbers of loss tokens; the loss here is the mean of the micro-batch means)")
    heads = args.num_attention_heads
    if args.kv_channels is not None and heads and args.kv_channels * heads != args.hidden_size:
        raise UsageError(f"--kv-channels {args.kv_channels}: only hidden size / heads "
                         f"({args.hidden_size // heads if heads else '?'}) is supported")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise UsageError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler are mutually "
                         "exclusive (this run's LR schedule, or the checkpoint's)")
    if args.ckpt_convert_format is not None and (args.ckpt_convert_save is None or args.load is None):
        missing = "--ckpt-convert-save" if args.ckpt_convert_save is None else "--load"
        raise UsageError(f"--ckpt-convert-format {args.ckpt_convert_format} needs {missing} (Megatron's conversion: "
                         "load --load, save to --ckpt-convert-save/<format>, exit)")
    if args.ckpt_convert_save is not None and args.ckpt_convert_format is None:
        raise UsageError("--ckpt-convert-save is only used with --ckpt-convert-format torch|torch_dist")
    if getattr(args, "use_dist_ckpt", False):  # as Megatron: the deprecated flag sets the format
        args.ckpt_format = "torch_dist"
    if args.ckpt_format not in CKPT_FORMATS_HERE:
        known = args.ckpt_format in CKPT_FORMATS
        raise UsageError(f"--ckpt-format {args.ckpt_format}: {'not supported' if known else 'unknown'}; use torch "
                         "(Megatron's legacy format) or torch_dist")
    if args.num_experts:
        _expert_ckpt_format(args)


def _expert_ckpt_format(args) -> None:
    """The legacy format cannot hold experts laid out apart from the dense tensors: refused when asked for; when
    --ckpt-format is not given, such a run takes Megatron's default, torch_dist, and says so."""
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    why = legacy_format_refusal(args.expert_model_parallel_size, etp, args.tensor_model_parallel_size)
    if why is None:
        return
    if args.ckpt_format == "torch" and not getattr(args, "ckpt_format_given", True):
        args.ckpt_format = "torch_dist"
        getattr(args, "notes", []).append("> --ckpt-format torch_dist (Megatron's default): experts split by "
                                          "--expert-model-parallel-size are not saved in the legacy torch format")
    if "torch" in (args.ckpt_format if args.save else None, args.ckpt_convert_format):
        raise UsageError(why)


def _virtual_stages(args) -> int:
    pp = args.pipeline_model_parallel_size
    if args.pipeline_schedule == "zbv":
        return _zbv_chunks(args)
    if args.virtual_pipeline_model_parallel_size is not None:
        v = args.virtual_pipeline_model_parallel_size
        if args.num_layers_per_virtual_pipeline_stage is not None:
            raise UsageError("give --virtual-pipeline-model-parallel-size or --num-layers-per-virtual-pipeline-stage, "
                             "not both")
        if v < 1 or (v > 1 and pp == 1):
            raise UsageError(f"--virtual-pipeline-model-parallel-size {v}: needs >= 1, and "
                             "--pipeline-model-parallel-size > 1 to interleave")
        if v > 1 and args.pipeline_schedule != "1f1b":
            raise UsageError(f"--pipeline-schedule {args.pipeline_schedule} cannot interleave")
        return v
    if args.num_layers_per_virtual_pipeline_stage is None:
        return 1
    per = args.num_layers_per_virtual_pipeline_stage
    if per < 1:
        raise UsageError(f"--num-layers-per-virtual-pipeline-stage must be >= 1, got {per}")
    if args.num_layers % (pp * per):
        raise UsageError(
            f"--num-layers-per-virtual-pipeline-stage {per}: --num-layers {args.num_layers} must be a multiple of "
            f"it times --pipeline-model-parallel-size {pp}"
        )
    virtual = args.num_layers // (pp * per)
    if virtual > 1 and pp == 1:
        raise UsageError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
    if virtual > 1 and args.pipeline_schedule != "1f1b":
        raise UsageError(f"--pipeline-schedule {args.pipeline_schedule} cannot interleave; drop "
                         "--num-layers-per-virtual-pipeline-stage or use 1f1b")
    return virtual


def _zbv_chunks(args) -> int:
    """zbv holds two model chunks per rank: the virtual-stage flags may only say the same."""
    v, per = args.virtual_pipeline_model_parallel_size, args.num_layers_per_virtual_pipeline_stage
    if v is not None and v != 2:
        raise UsageError(f"--virtual-pipeline-model-parallel-size {v}: --pipeline-schedule zbv holds 2 model chunks "
                         "per rank")
    if per is not None and per * 2 * args.pipeline_model_parallel_size != args.num_layers:
        raise UsageError(f"--num-layers-per-virtual-pipeline-stage {per}: --pipeline-schedule zbv has 2 x "
                         f"--pipeline-model-parallel-size virtual stages, so it must be --num-layers / "
                         f"{2 * args.pipeline_model_parallel_size} or left out")
    return 2


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _count(text: str) -> int:
    """'250B' -> 250e9 (K, M, B, T suffixes, as Megatron's step schedule)."""
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def parse_step_schedule(text: str, seq_length: int) -> tuple[tuple[int, int], ...]:
    """--step-batch-size-schedule 'TOKENS:BATCH ...' (spaces or commas) -> ((samples, batch), ...); thresholds
    count tokens, turned into samples with --seq-length, as Megatron does when the sequence length is known."""
    steps = []
    for entry in text.replace(",", " ").split():
        threshold, sep, batch = entry.partition(":")
        try:
            steps.append((_count(threshold) // seq_length, _count(batch)))
        except ValueError:
            sep = ""
        if not sep:
            raise UsageError(f"--step-batch-size-schedule: {entry!r} is not TOKENS:BATCH (e.g. '0:256 2M:512')")
    return tuple(sorted(steps))


def batch_schedule_from_args(args, default_batch: int) -> BatchSchedule:
    """Constant --global-batch-size, Megatron's --rampup-batch-size, or --step-batch-size-schedule."""
    if args.rampup_batch_size is not None and args.step_batch_size_schedule is not None:
        raise UsageError("--rampup-batch-size and --step-batch-size-schedule are mutually exclusive")
    if args.step_batch_size_schedule is not None:
        steps = parse_step_schedule(args.step_batch_size_schedule, args.seq_length)
        final = steps[-1][1] if steps else 0
        if args.global_batch_size is not None and args.global_batch_size != final:
            raise UsageError(f"--global-batch-size {args.global_batch_size} differs from the last batch {final} of "
                             "--step-batch-size-schedule (drop it: the schedule sets the batch)")
        return BatchSchedule(final, steps=steps)
    gbs = args.global_batch_size if args.global_batch_size is not None else default_batch
    if args.rampup_batch_size is not None:
        if args.global_batch_size is None:
            raise UsageError("--rampup-batch-size needs --global-batch-size (the batch it ramps up to)")
        return BatchSchedule(gbs, rampup=tuple(args.rampup_batch_size))
    return BatchSchedule(gbs)


def _check_varying_batch(args, sizes: list[int], mb: int, dp: int, pp: int, virtual: int, slicing) -> None:
    """What a batch that changes during training needs: every size a whole number of micro-batches per data-
    parallel rank, a multiple of the pipeline size for interleaving, and nothing fixed to one count."""
    flag = "--rampup-batch-size" if args.rampup_batch_size is not None else "--step-batch-size-schedule"
    for size in sizes:
        if size % (mb * dp):
            raise UsageError(f"{flag}: global batch {size} is not divisible by --micro-batch-size {mb} x "
                             f"data-parallel size {dp}")
        if virtual > 1 and args.pipeline_schedule != "zbv" and (size // (mb * dp)) % pp:
            raise UsageError(f"{flag}: global batch {size} gives {size // (mb * dp)} micro-batches, not a multiple "
                             f"of --pipeline-model-parallel-size {pp} as the interleaved schedule needs")
    if len(sizes) > 1 and args.plan:
        raise UsageError(f"{flag}: --plan {args.plan} fixes the micro-batches per iteration; drop one of them")
    if len(sizes) > 1 and slicing == "auto":
        raise UsageError(f"{flag}: --microbatch-slicing auto picks a count for one batch size; give a number")
    if len(sizes) > 1 and slicing and slicing > sizes[0] // (mb * dp):
        raise UsageError(f"{flag}: the first global batch {sizes[0]} has {sizes[0] // (mb * dp)} micro-batches, "
                         f"fewer than --microbatch-slicing {slicing}")


def _check_recompute_flags(args, stage_units: list[list[int]]) -> None:
    """Megatron's rules: --recompute-method and --recompute-num-layers say which layers full recomputation covers,
    so selective takes neither; block recomputes the first N layers of each pipeline stage, 1 <= N <= its layers.
    Uniform recomputes every unit on its own here, which is Megatron's uniform with N = 1 (its groups of N layers
    recomputed from one saved input are not implemented)."""
    n = args.recompute_num_layers
    if n is not None and n < 1:
        raise UsageError(f"--recompute-num-layers must be >= 1, got {n}")
    if args.recompute_activations or args.recompute_granularity == "selective":
        given = [f for f, v in (("--recompute-method", args.recompute_method), ("--recompute-num-layers", n))
                 if v is not None]
        if given:
            raise UsageError(f"{' and '.join(given)} {'choose' if len(given) > 1 else 'chooses'} the layers of "
                             "--recompute-granularity full; selective recomputation covers every attention core "
                             f"(drop {'them' if len(given) > 1 else 'it'})")
        return
    if args.recompute_method in (None, "uniform") and n is not None and n > 1 \
            and args.recompute_granularity == "full":
        raise UsageError(f"--recompute-num-layers {n} with --recompute-method uniform: Megatron's groups of {n} "
                         "layers recomputed from one saved input are not implemented; here every unit is recomputed "
                         "on its own (Megatron's 1), or --recompute-method block recomputes the first N layers of "
                         "each pipeline stage")
    if args.recompute_method != "block":
        return
    names = unit_names(args.num_layers)
    most = max(len({unit_layer(names[i]) for i in units} - {None}) for units in stage_units)
    if n is None or not 1 <= n <= most:
        given = "is missing" if n is None else f"is {n}"
        raise UsageError(f"--recompute-num-layers {given}: --recompute-method block recomputes the first N layers "
                         f"of each pipeline stage, N between 1 and {most} (layers per stage)")


def pipeline_config_from_args(args: argparse.Namespace, dp: int, global_batch_size: int,
                              batch_sizes: list[int] | None = None) -> PipelineConfig:
    """The pipeline part of the flags, with the partition and Megatron's recomputation flags resolved per unit.
    `batch_sizes`: every global batch a ramp-up or step schedule uses (the pipeline is built for the full one)."""
    pp, mb = args.pipeline_model_parallel_size, args.micro_batch_size
    virtual = _virtual_stages(args)
    if global_batch_size % (mb * dp):
        raise UsageError(
            f"--global-batch-size {global_batch_size} is not divisible by --micro-batch-size {mb} x data-parallel "
            f"size {dp}"
        )
    m = global_batch_size // (mb * dp)
    if virtual > 1 and args.pipeline_schedule != "zbv" and m % pp:
        raise UsageError(f"--global-batch-size {global_batch_size} gives {m} micro-batches per iteration; the "
                         f"interleaved schedule needs a multiple of --pipeline-model-parallel-size {pp}")
    slicing = parse_slicing(args.microbatch_slicing)
    check_slicing(slicing, mb, m)
    _check_varying_batch(args, batch_sizes or [global_batch_size], mb, dp, pp, virtual, slicing)
    partition = parse_partition(args.pipeline_partition, args.num_layers, pp, virtual)
    placement = "v" if args.pipeline_schedule == "zbv" else "interleaved"
    stage_units = [[i for c in rank_chunks(partition, pp, r, placement) for i in c] for r in range(pp)]
    _check_recompute_flags(args, stage_units)
    granularity = "selective" if args.recompute_activations else args.recompute_granularity
    if args.recompute_units is not None:
        if granularity is not None:
            raise UsageError("--recompute-units sets every unit's recomputation; drop --recompute-granularity "
                             "and --recompute-activations")
        recompute = parse_recompute(args.recompute_units, num_units(args.num_layers), "--recompute-units")
    else:
        recompute = recompute_from_flags(granularity, args.recompute_method, args.recompute_num_layers,
                                         args.num_layers, stage_units)
    return PipelineConfig(micro_batch_size=mb, num_microbatches=m, schedule=args.pipeline_schedule,
                          virtual_stages=virtual, partition=tuple(partition), recompute=recompute, bpipe=args.bpipe,
                          slicing=slicing)


def check_flags(args: argparse.Namespace) -> None:
    """The flags' own values and the Megatron choices this implementation refuses, before any config is built."""
    check_flag_values(args, FLAG_CLASSES)
    _check_megatron_choices(args)
    if args.fp16 and args.bf16:
        raise UsageError("--fp16 and --bf16 are mutually exclusive")
    if getattr(args, "model_type", "gpt") != "bert" and not getattr(args, "bert_binary_head", True):
        raise UsageError("--bert-no-binary-head: applies to --model-type bert (a GPT has no sentence-order head)")


def model_config_from_args(args: argparse.Namespace, tp: int, vocab_size: int | None = None
                           ) -> tuple[ModelConfig, int]:
    """The model the flags describe, its vocabulary padded for tensor-parallel size `tp`, and the vocabulary before
    padding (`vocab_size`: the tokenizer's; else --vocab-size)."""
    orig_vocab = vocab_size if vocab_size is not None else args.vocab_size
    if orig_vocab is None:
        raise UsageError("--vocab-size is required with --mock-data (or give a tokenizer with --tokenizer-type)"
                         if args.mock_data else "no vocabulary: give the tokenizer (--tokenizer-type and its "
                         "--vocab-file or --tokenizer-model) or --vocab-size")
    if orig_vocab < 2:
        raise UsageError(f"--vocab-size must be >= 2, got {orig_vocab}" if vocab_size is None else
                         f"the tokenizer's vocabulary has {orig_vocab} token(s); a language model needs >= 2")
    backend = _BACKEND_AS.get(args.attention_backend, args.attention_backend)
    if args.use_flash_attn and backend not in ("auto", "flash"):
        raise UsageError(f"--use-flash-attn (Megatron's older flag for --attention-backend flash) contradicts "
                         f"--attention-backend {args.attention_backend}")
    backend = "flash" if args.use_flash_attn else backend
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    moe = from_flags(MoEConfig, args) if getattr(args, "num_experts", None) else None
    model = from_flags(ModelConfig, args, vocab_size=padded_vocab_size(orig_vocab, args.make_vocab_size_divisible_by, tp),
                       attention_backend=backend, params_dtype=dtype, model_type=getattr(args, "model_type", "gpt"),
                       moe=moe, **llama_settings(args))
    return model, orig_vocab


def configs_from_args(args: argparse.Namespace, world_size: int, vocab_size: int | None = None,
                      plan=None) -> RunConfig:
    """Validate the flags against each other and the world size; build the config dataclasses. With `plan` (a
    Plan: --plan, checked against the flags by `apply_plan`), the model, parallel and pipeline configs are the
    plan's own objects and the flags give the rest.

    vocab_size: the vocabulary (from the tokenizer); defaults to --vocab-size, padded like Megatron."""
    check_flags(args)
    if plan is not None:
        return configs_from_plan(args, world_size, vocab_size, plan)
    tp = args.tensor_model_parallel_size
    parallel = from_flags(ParallelConfig, args, rank_order="bpipe" if args.bpipe else "tp-dp-pp",
                          unit_strategies=_unit_strategies(args, world_size))
    dp = parallel.data_parallel_size(world_size)
    batches = batch_schedule_from_args(args, args.micro_batch_size * dp)
    gbs = batches.global_batch_size
    pipeline = pipeline_config_from_args(args, dp, gbs, batches.sizes())
    train_iters = training_length(args, batches)
    model, orig_vocab = model_config_from_args(args, tp, vocab_size)
    check_layout(model, parallel, world_size)
    check_split_backward(pipeline, parallel, model)
    return RunConfig(model=model, parallel=parallel, pipeline=pipeline, orig_vocab_size=orig_vocab,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     **training_configs(args, batches, train_iters, args.fp16, args.bf16,
                                         args.use_distributed_optimizer, args.overlap_grad_reduce,
                                         args.overlap_param_gather))


def llama_settings(args) -> dict:
    """ModelConfig's Llama-family fields that Megatron's flags say in more than one way."""
    rope = args.use_rotary_position_embeddings or args.position_embedding_type == "rope"
    kind = "rope" if rope else "none" if getattr(args, "no_position_embedding", False) else args.position_embedding_type
    return dict(position_embedding_type=kind,
                num_query_groups=args.num_query_groups if args.group_query_attention else None)


def _unit_strategies(args: argparse.Namespace, world_size: int) -> tuple[str, ...] | None:
    """--unit-strategies checked against the other flags: canonical strategy strings, one per unit."""
    text = getattr(args, "unit_strategies", None)
    if text is None:
        return None
    if not text.strip():
        raise UsageError("--unit-strategies is empty (give a strategy per unit, or one for all)")
    flag = "--unit-strategies"
    for bad, why in ((args.tensor_model_parallel_size > 1, "--tensor-model-parallel-size > 1 (each unit sets its own tp)"),
                     (args.sequence_parallel, "--sequence-parallel"),
                     (args.use_distributed_optimizer, "--use-distributed-optimizer (sharded strategies, sdpN, shard "
                                                      "the optimizer state instead)"),
                     (args.overlap_param_gather, "--overlap-param-gather (it gathers the distributed optimizer's "
                                                 "parameters; sharded strategies, sdpN, gather their own)"),
                     (getattr(args, "model_type", "gpt") != "gpt", "a BERT model (hybrid strategies run GPT only)")):
        if bad:
            raise UsageError(f"{flag} cannot be combined with {why}")
    pp = args.pipeline_model_parallel_size
    if world_size % pp:
        raise UsageError(f"world size {world_size} is not divisible by --pipeline-model-parallel-size {pp}")
    strategies = parse_unit_strategies(text, num_units(args.num_layers), world_size // pp, flag)
    check_strategies_fit(strategies, args, args.micro_batch_size * (world_size // pp),
                          str(getattr(args, "microbatch_slicing", "0") or "0") != "0")
    return tuple(str(x) for x in strategies)


@dataclass
class ParsedRun:
    """What an entry point's command line says: the run, the plan it runs (with its path), the tokenizer its data
    names, and the Megatron flags accepted but ignored (for the start-up banner)."""

    run: RunConfig
    plan: Any = None
    plan_path: str | None = None
    tokenizer: Any = None
    ignored_kernel_flags: list[str] = field(default_factory=list)
    ignored_logging_flags: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def run_config_from_argv(argv: list[str], world_size: int, model_type: str = "gpt",
                         tokenizer_from: Callable[[DataConfig], Any] | None = None,
                         vocab_size: int | None = None,
                         plan_search: Callable[[PlanRequest], Plan] | None = None) -> ParsedRun:
    """The one way from a command line to a run: parse the flags (pretrain_gpt.py's, or pretrain_bert.py's), lay
    --plan over them, build the tokenizer with `tokenizer_from` where the data names one, and build the configs
    (`vocab_size`: a tokenizer's the caller holds). --plan auto: `plan_search` turns what the flags ask for into the
    plan the run takes (training/replan.py: searched for this world on rank 0, agreed by every rank)."""
    parser = build_parser(f"pretrain_{model_type}.py", model_type)
    args = parse_args(argv, parser)
    auto = args.plan == AUTO
    plan = apply_plan(args, argv, parser) if args.plan and not auto else None
    tokenizer = tokenizer_from(data_config_from_args(args)) if tokenizer_from and args.tokenizer_type else None
    if tokenizer is not None:
        vocab_size = tokenizer.vocab_size
    if auto:
        plan = auto_plan(args, argv, parser, world_size, vocab_size, plan_search)
    run = configs_from_args(args, world_size, vocab_size=vocab_size, plan=plan)
    return ParsedRun(run, plan, args.plan, tokenizer, args.ignored_kernel_flags, args.ignored_logging_flags,
                     args.notes)


def auto_plan(args: argparse.Namespace, argv: list[str], parser: argparse.ArgumentParser, world_size: int,
              vocab_size: int | None, plan_search: Callable[[PlanRequest], Plan] | None) -> Plan:
    """--plan auto: the flags checked, the search's request built from them, the plan `plan_search` returns checked
    against the flags as a plan file is."""
    if plan_search is None:
        raise UsageError("--plan auto searches at start-up: run it through pretrain_gpt.py or pretrain_bert.py")
    check_flags(args)
    given = given_flags(argv, parser)
    model, orig_vocab = model_config_from_args(args, 1, vocab_size)
    plan = plan_search(plan_request(args, given, world_size, model, orig_vocab))
    check_flags_against_plan(args, given, plan)
    return plan


def apply_plan(args: argparse.Namespace, argv: list[str], parser: argparse.ArgumentParser | None = None):
    """Load --plan and check the flags given beside it: one that disagrees with the plan is an error. The run's
    configs then come from the plan itself (`configs_from_args(..., plan=plan)`)."""
    plan = Plan.load(args.plan)
    if not plan.engine.runs_here:
        raise UsageError(f"--plan {args.plan}: planned for engine {plan.engine.describe()}, which this runtime is "
                         "not (megatron_bmw, fp32 main gradients); plan again with --engine megatron_bmw")
    check_flags_against_plan(args, given_flags(argv, parser or build_parser()), plan)
    return plan
