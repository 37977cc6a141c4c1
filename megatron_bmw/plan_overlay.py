"""--plan laid over the flags: the plan decides the model, the degrees and the pipeline; a flag given beside it
that disagrees is an error, and the flags give only what a plan does not decide (training, optimizer, LR, data).
--plan auto: the flags say what to search for (plan_request); the layout is the search's, so a layout flag beside
it is refused."""

from __future__ import annotations

import argparse
from dataclasses import replace

from .config import ZERO_BUBBLE, BatchSchedule, ModelConfig, RunConfig, padded_vocab_size
from .config.planner import AutoPlanConfig, PlanRequest
from .config.schema import from_flags
from .errors import UsageError
from .pipeline.slicing import check_slicing
from .run_parts import check_layout, check_split_backward, check_strategies_fit, training_configs, training_length
from .strategy import parse_unit_strategies


def configs_from_plan(args, world_size: int, vocab_size: int | None, plan) -> RunConfig:
    """The run of a plan: its model, degrees and pipeline as they are; training flags around them."""
    s = plan.spec
    if args.rampup_batch_size is not None or args.step_batch_size_schedule is not None:
        flag = "--rampup-batch-size" if args.rampup_batch_size is not None else "--step-batch-size-schedule"
        raise UsageError(f"{flag}: --plan {args.plan} fixes the micro-batches per iteration; drop one of them")
    if world_size != s.world_size:
        raise UsageError(f"--plan {args.plan}: planned for {s.world_size} ranks (tp {s.tp} x pp {s.pp} x dp {s.dp}), "
                         f"launched with {world_size}")
    parallel = replace(s.parallel, gpus_per_node=args.gpus_per_node)
    orig_vocab = next((v for v in (vocab_size, args.vocab_size, plan.orig_vocab_size) if v is not None), None)
    if orig_vocab is None:
        raise UsageError("--vocab-size is required with --mock-data (or give a tokenizer with --tokenizer-type)")
    padded = padded_vocab_size(orig_vocab, plan.make_vocab_size_divisible_by, s.tp)
    if padded != s.model.vocab_size:
        raise UsageError(f"--plan {args.plan}: planned for a padded vocabulary of {s.model.vocab_size}, this run has "
                         f"{padded} (tokenizer or --vocab-size differs)")
    if s.model.model_type != getattr(args, "model_type", "gpt"):
        raise UsageError(f"--plan {args.plan}: planned for a {s.model.model_type.upper()} model, this run trains a "
                         f"{getattr(args, 'model_type', 'gpt').upper()}")
    check_layout(s.model, parallel, world_size)
    check_split_backward(s.pipeline, parallel, s.model)
    pl = s.pipeline
    check_slicing(pl.slicing, pl.micro_batch_size, pl.num_microbatches)
    if s.unit_strategies:
        check_strategies_fit(parse_unit_strategies(s.unit_strategies, s.model.num_units, s.dp), s.model,
                              pl.micro_batch_size * s.dp, pl.slicing != 0)
    batches = BatchSchedule(plan.global_batch_size)
    dtype = s.model.params_dtype
    rest = training_configs(args, batches, training_length(args, batches), dtype == "fp16", dtype == "bf16",
                             s.distributed_optimizer, s.overlap_grad_reduce, s.overlap_param_gather)
    rest["train"] = replace(rest["train"], gradient_accumulation_fusion=plan.engine.gradient_accumulation_fusion)
    if rest["data"].vocab_size is None and vocab_size is None:  # --mock-data sized by the plan's vocabulary
        rest["data"] = replace(rest["data"], vocab_size=orig_vocab)
    return RunConfig(model=s.model, parallel=parallel, pipeline=s.pipeline, orig_vocab_size=orig_vocab,
                     make_vocab_size_divisible_by=plan.make_vocab_size_divisible_by, **rest)


# ---- --plan: the plan gives the model, parallel and pipeline configs; flags given beside it must agree -----------
_RECOMPUTE_FLAGS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_activations",
                    "num_layers_per_virtual_pipeline_stage")


def plan_flags(plan) -> dict[str, object]:
    """The flag values (argparse dests) a plan decides: what flags given beside --plan are checked against."""
    s, pl, m = plan.spec, plan.spec.pipeline, plan.spec.model
    return {
        "num_layers": m.num_layers, "hidden_size": m.hidden_size, "ffn_hidden_size": m.ffn_hidden_size,
        "num_attention_heads": m.num_attention_heads, "seq_length": m.seq_length,
        "max_position_embeddings": m.max_position_embeddings, "hidden_dropout": m.hidden_dropout,
        "attention_dropout": m.attention_dropout, "init_method_std": m.init_method_std,
        "layernorm_epsilon": m.layernorm_epsilon,
        "untie_embeddings_and_output_weights": m.untie_embeddings_and_output_weights,
        "attention_backend": m.attention_backend, "bf16": m.params_dtype == "bf16", "fp16": m.params_dtype == "fp16",
        "bert_binary_head": m.bert_binary_head, "openai_gelu": m.openai_gelu,
        "apply_residual_connection_post_layernorm": m.apply_residual_connection_post_layernorm,
        "position_embedding_type": m.position_embedding_type,
        "use_rotary_position_embeddings": m.position_embedding_type == "rope", "rotary_percent": m.rotary_percent,
        "rotary_base": m.rotary_base, "rotary_seq_len_interpolation_factor": m.rotary_seq_len_interpolation_factor,
        "swiglu": m.swiglu, "squared_relu": m.squared_relu, "group_query_attention": m.num_query_groups is not None,
        "num_query_groups": m.num_query_groups, "normalization": m.normalization,
        "add_bias_linear": m.add_bias_linear, "add_qkv_bias": m.add_qkv_bias, "qk_layernorm": m.qk_layernorm,
        "apply_layernorm_1p": m.apply_layernorm_1p,
        "cross_entropy_loss_fusion": m.cross_entropy_loss_fusion,
        "bias_swiglu_fusion": m.bias_swiglu_fusion, "apply_rope_fusion": m.apply_rope_fusion,
        "make_vocab_size_divisible_by": plan.make_vocab_size_divisible_by,
        "tensor_model_parallel_size": s.tp, "pipeline_model_parallel_size": s.pp, "sequence_parallel": s.sp,
        "context_parallel_size": s.cp, "cp_comm_type": s.cp_comm_type,
        "expert_model_parallel_size": s.ep, "expert_tensor_parallel_size": s.etp,
        "micro_batch_size": pl.micro_batch_size, "global_batch_size": plan.global_batch_size,
        "pipeline_schedule": pl.schedule if pl.schedule in ("gpipe", *ZERO_BUBBLE) else "1f1b",
        "virtual_pipeline_model_parallel_size": pl.virtual_stages,
        "pipeline_partition": ",".join(map(str, pl.partition)),
        "recompute_units": ",".join(x or "none" for x in pl.unit_recompute(m.num_units)),
        "bpipe": pl.bpipe, "microbatch_slicing": str(pl.slicing),
        "use_distributed_optimizer": s.distributed_optimizer, "overlap_grad_reduce": s.overlap_grad_reduce,
        "overlap_param_gather": s.overlap_param_gather,
        "gradient_accumulation_fusion": plan.engine.gradient_accumulation_fusion,
        "unit_strategies": ",".join(s.unit_strategies) if s.unit_strategies else None,
    }


def given_flags(argv: list[str], parser: argparse.ArgumentParser) -> dict[str, str]:
    """argparse dest -> the option string, for every flag present in argv."""
    options = {opt: a.dest for a in parser._actions for opt in a.option_strings}
    out = {}
    for token in argv:
        opt = token.split("=", 1)[0]
        if opt in options:
            out[options[opt]] = opt
    return out


def check_flags_against_plan(args: argparse.Namespace, given: dict[str, str], plan) -> None:
    """A flag given beside --plan (`given`: dest -> option string) that disagrees with the plan is an error."""
    for dest in _RECOMPUTE_FLAGS:
        if dest in given:
            raise UsageError(f"{given[dest]}: --plan {args.plan} sets the pipeline and every unit's recomputation; "
                             "drop the flag")
    if args.use_flash_attn and plan.spec.model.attention_backend != "flash":
        raise UsageError(f"--use-flash-attn disagrees with --plan {args.plan} (attention backend "
                         f"{plan.spec.model.attention_backend})")
    for dest, value in plan_flags(plan).items():
        mine = getattr(args, dest, None)  # BERT's flags are not pretrain_gpt.py's
        if dest in given and mine != value and not (dest == "microbatch_slicing" and str(mine) == str(value)):
            shown = "" if isinstance(value, bool) else f" {mine}"
            raise UsageError(f"{given[dest]}{shown} disagrees with --plan {args.plan} "
                             f"({'on' if value is True else 'off' if value is False else value})")


# ---- --plan auto: the search decides the layout; the flags say the model, the batch and how to describe the ranks --
_LAYOUT_FLAGS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "sequence_parallel", "micro_batch_size",
                 "pipeline_schedule", "virtual_pipeline_model_parallel_size", "pipeline_partition", "recompute_units",
                 "bpipe", "microbatch_slicing", "use_distributed_optimizer", "overlap_grad_reduce",
                 "overlap_param_gather", "unit_strategies", "rampup_batch_size", "step_batch_size_schedule",
                 *_RECOMPUTE_FLAGS)
_SPACE_HINT = {"tensor_model_parallel_size": "tp=N", "pipeline_model_parallel_size": "pp=N",
               "sequence_parallel": "sp=on", "micro_batch_size": "mbs=N", "pipeline_schedule": "schedule=NAME",
               "virtual_pipeline_model_parallel_size": "virtual=N", "bpipe": "bpipe=on",
               "microbatch_slicing": "slicing=on", "use_distributed_optimizer": "zero1=on"}


def plan_request(args, given: dict[str, str], world_size: int, model: ModelConfig, orig_vocab: int) -> PlanRequest:
    """What --plan auto searches for: the flags' serial `model` (vocabulary `orig_vocab`), --global-batch-size, the
    `world_size` the run finds and --plan-profile/--plan-cluster/--plan-space. A layout flag in `given` (dest ->
    option string) is refused: the search chooses the layout, --plan-space restricts it."""
    for dest in _LAYOUT_FLAGS:
        if dest in given:
            hint = f" (restrict it with --plan-space {_SPACE_HINT[dest]})" if dest in _SPACE_HINT else ""
            raise UsageError(f"{given[dest]}: --plan auto chooses the layout for the ranks it finds; drop the flag"
                             + hint)
    auto = from_flags(AutoPlanConfig, args)
    if args.global_batch_size is None:
        raise UsageError("--plan auto needs --global-batch-size (kept whatever the world size: gradient accumulation "
                         "makes up the difference)")
    if auto.plan_profile is None and auto.plan_cluster in (None, "local"):
        raise UsageError("--plan auto needs --plan-profile FILE (tools/autoconfig.py profile on these devices) or "
                         "--plan-cluster NAME|YAML (analytic unit times on a described cluster, e.g. h100-80g-ib)")
    return PlanRequest(model=model, orig_vocab_size=orig_vocab,
                       make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                       global_batch_size=args.global_batch_size, world_size=world_size, auto=auto,
                       gradient_accumulation_fusion=args.gradient_accumulation_fusion, save=args.save, load=args.load,
                       ckpt_format=args.ckpt_format,
                       distributed_backend=args.distributed_backend,
                       distributed_timeout_minutes=args.distributed_timeout_minutes)
