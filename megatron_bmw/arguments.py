"""Megatron-LM-compatible command line -> config dataclasses. Parsed once, at the entry point."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from .config import (NORMALIZATIONS, BatchSchedule, DataConfig, LRConfig, ModelConfig, OptimizerConfig,
                     ParallelConfig, PipelineConfig, RunConfig, TrainConfig, ZERO_BUBBLE)
from .errors import OneLineParser, UsageError
from .flag_rules import check_finite, join_negative_values
from .pipeline.partition import parse_partition, rank_chunks
from .pipeline.slicing import check_slicing, parse_slicing
from .strategy import parse_strategy, parse_unit_strategies
from .units import num_units, parse_recompute, recompute_from_flags, unit_layer, unit_names

# Megatron flags accepted so existing launch scripts run unchanged, reported once at start-up, otherwise ignored
# (flag -> number of values it takes). Kernel selection and internal implementation choices:
IGNORED_KERNEL_FLAGS = {
    "--no-masked-softmax-fusion": 0, "--no-bias-gelu-fusion": 0, "--no-bias-dropout-fusion": 0,
    "--no-async-tensor-model-parallel-allreduce": 0,
    "--use-mcore-models": 0, "--use-legacy-models": 0, "--no-persist-layer-norm": 0,
    "--transformer-impl": 1, "--accumulate-allreduce-grads-in-fp32": 0, "--empty-unused-memory-level": 1,
    "--num-workers": 1, "--data-impl": 1, "--cross-entropy-loss-fusion": 0,
    "--no-create-attention-mask-in-dataloader": 0, "--no-mmap-bin-files": 0,
    "--tiktoken-pattern": 1, "--no-rope-fusion": 0,
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
# Megatron's attention backends -> ours: cuDNN's fused kernel runs as torch's fused attention, local as unfused
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")
_BACKEND_AS = {"fused": "flash", "local": "unfused"}
CKPT_FORMATS = ("torch", "torch_dist", "zarr", "torch_dcp", "fsdp_dtensor")  # Megatron's
CKPT_FORMATS_HERE = ("torch", "torch_dist")  # written and read here


def build_parser(prog: str = "pretrain_gpt.py", model_type: str = "gpt") -> argparse.ArgumentParser:
    what = "BERT" if model_type == "bert" else "GPT"
    p = OneLineParser(prog=prog, description=f"Megatron-style {what} pretraining (megatron_bmw)", allow_abbrev=False)
    add_megatron_args(p)
    if model_type == "bert":
        add_bert_args(p)
    return p


def add_bert_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """pretrain_bert.py's flags (Megatron's names; --no-whole-word-masking and --masking-max-ngram are ours)."""
    g = p.add_argument_group("bert")
    g.add_argument("--bert-no-binary-head", dest="bert_binary_head", action="store_false",
                   help="no sentence-order head (and no token-type embeddings)")
    g.add_argument("--bert-binary-head", dest="bert_binary_head", action="store_true",
                   help="the sentence-order head with the pooler (default)")
    g.add_argument("--mask-prob", type=float, default=0.15, help="fraction of tokens to predict (default 0.15)")
    g.add_argument("--short-seq-prob", type=float, default=0.1,
                   help="probability of a sample shorter than --seq-length (default 0.1)")
    g.add_argument("--no-whole-word-masking", dest="whole_word_masking", action="store_false",
                   help="mask WordPiece pieces independently instead of whole words")
    g.add_argument("--masking-max-ngram", type=int, default=3, help="longest masked n-gram of words (default 3)")
    g.add_argument("--apply-residual-connection-post-layernorm", action="store_true",
                   help="residuals from the LayerNorm outputs (the layout Hugging Face's post-LN BERT converts to)")
    g.add_argument("--openai-gelu", action="store_true", help="tanh-approximated GeLU in the LM head")
    p.set_defaults(model_type="bert", bert_binary_head=True)
    return p


def add_megatron_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add every Megatron-compatible flag group to `p` (shared by pretrain_gpt.py and tools/autoconfig.py)."""
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=2)
    g.add_argument("--hidden-size", type=int, default=64)
    g.add_argument("--ffn-hidden-size", type=int, default=None)
    g.add_argument("--num-attention-heads", type=int, default=4)
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None)
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon", type=float, default=1e-5)
    g.add_argument("--position-embedding-type", default="learned_absolute",
                   help="learned_absolute (GPT-2), rope (Llama) or none")
    g.add_argument("--use-rotary-position-embeddings", action="store_true", help="Megatron's older flag for rope")
    g.add_argument("--no-position-embedding", action="store_true",
                   help="Megatron's older flag: no learned position embedding (--position-embedding-type none, "
                        "unless rope)")
    g.add_argument("--rotary-percent", type=float, default=1.0, help="of each head's dimensions rotated")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-seq-len-interpolation-factor", type=int, default=None,
                   help="positions divided by it (longer contexts)")
    g.add_argument("--swiglu", action="store_true", help="SwiGLU MLP (fc1 holds the gate and up projections)")
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, default=1, help="with --group-query-attention (1: multi-query)")
    g.add_argument("--normalization", choices=NORMALIZATIONS, default="LayerNorm")
    g.add_argument("--disable-bias-linear", action="store_true", help="no biases in attention and MLP projections")
    g.add_argument("--add-qkv-bias", action="store_true", help="a QKV bias even with --disable-bias-linear")
    g.add_argument("--kv-channels", type=int, default=None, help="head dimension: hidden size / heads only")
    g.add_argument("--qk-layernorm", action="store_true",
                   help="normalise every query and key head over the head dimension (--normalization's kind)")
    g.add_argument("--apply-layernorm-1p", action="store_true",
                   help="norm weights stored zero-centred (gamma - 1) and applied as weight + 1")
    g.add_argument("--attention-softmax-in-fp32", action="store_true",
                   help="accepted: the attention softmax always runs in fp32")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto",
                   help="auto, flash or fused (torch's fused attention), unfused or local (explicit softmax)")
    g.add_argument("--use-flash-attn", action="store_true", help="Megatron's older flag; same as --attention-backend flash")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None)
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None)
    g.add_argument("--recompute-num-layers", type=int, default=None)
    g.add_argument("--recompute-activations", action="store_true", help="Megatron's alias of --recompute-granularity selective")
    g.add_argument("--recompute-units", type=str, default=None,
                   help="recomputation of every unit, e.g. none,selective,full,... over [embedding, attn_0, mlp_0, ..., head]")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None)
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved 1F1B); with --pipeline-partition any unit split")
    g.add_argument("--unit-strategies", type=str, default=None,
                   help="Galvatron-BMW hybrid: a strategy per unit over the world/pp ranks of a stage (tp2-dp2, "
                        "dp2-tp2, sdp4, tp4, ...), comma separated over [embedding, attn_0, mlp_0, ..., head], or "
                        "one for all; needs --tensor-model-parallel-size 1")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--context-parallel-size", type=int, default=1, help="1 only (no context parallelism)")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--no-gradient-accumulation-fusion", dest="gradient_accumulation_fusion", action="store_false",
                   help="add each weight gradient into the fp32 main_grad after its GEMM, not inside it (the "
                        "planner then counts e + 8 bytes per parameter and micro-batch, for ours and megatron-core)")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="with --use-distributed-optimizer: all-gather the updated parameters during the next forward")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"], default=None)
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    g.add_argument("--pipeline-partition", type=str, default=None,
                   help="units per (virtual) pipeline stage, e.g. 3,4,4,3; units are [embedding, attn_0, mlp_0, ..., head]")
    g.add_argument("--pipeline-schedule", choices=["1f1b", "gpipe", "zb-h1", "zb-h2", "zbv"], default="1f1b",
                   help="zero-bubble: zb-h1, zb-h2 (more warm-up forwards), zbv (two chunks per rank in a V)")
    g.add_argument("--pipeline-trace", type=str, default=None, help="write a Chrome trace of the pipeline actions")
    g.add_argument("--gpus-per-node", type=int, default=None,
                   help="node size for rank placement (default: the local world size)")
    g.add_argument("--bpipe", action="store_true",
                   help="BPipe: balance saved activations between pipeline stages s and p-1-s (pair-adjacent ranks)")
    g.add_argument("--microbatch-slicing", default="0",
                   help="halve the first K micro-batches to shorten the pipeline start-up (K >= 0, or auto)")
    g.add_argument("--log-activation-memory", action="store_true",
                   help="every pipeline rank prints its peak saved activations at the end")
    g.add_argument("--plan", type=str, default=None,
                   help="run the plan file written by tools/autoconfig.py search (other flags must agree with it)")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None)
    g.add_argument("--train-iters", type=int, default=None, help="iterations (default 10 without --train-samples)")
    g.add_argument("--train-samples", type=int, default=None, help="sample-based training length")
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None,
                   metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over SAMPLES consumed samples")
    g.add_argument("--step-batch-size-schedule", type=str, default=None,
                   help="global batch by consumed tokens, e.g. '0:256 2M:512' (K/M/B/T suffixes)")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--loss-scale", type=float, default=None)
    g.add_argument("--initial-loss-scale", type=float, default=2.0**32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--exit-interval", type=int, default=None)
    g.add_argument("--exit-duration-in-mins", type=float, default=None)
    g.add_argument("--exit-signal-handler", action="store_true", help="accepted; SIGTERM always saves and exits")
    g.add_argument("--manual-gc", action="store_true",
                   help="Python's garbage collector off during training, run by hand (as Megatron: at the start, "
                        "every --manual-gc-interval iterations, around each validation)")
    g.add_argument("--manual-gc-interval", type=int, default=0, help="iterations between collections (0: none)")
    g.add_argument("--no-manual-gc-eval", dest="manual_gc_eval", action="store_false",
                   help="with --manual-gc, no collection around validation")

    g = p.add_argument_group("optimizer and learning rate")
    g.add_argument("--optimizer", choices=["adam"], default="adam")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="linear")
    g.add_argument("--decoupled-lr", type=float, default=None,
                   help="peak learning rate of the word embedding and output layer (same warm-up and decay)")
    g.add_argument("--decoupled-min-lr", type=float, default=None,
                   help="their final learning rate (default --min-lr)")
    g.add_argument("--calculate-per-token-loss", action="store_true",
                   help="accepted where every micro-batch has micro-batch x seq-length loss tokens (GPT without "
                        "--eod-mask-loss): the mean over the batch's tokens is then the mean of micro-batch means")
    g.add_argument("--lr-decay-iters", type=int, default=None)
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-fraction", type=float, default=None)
    g.add_argument("--lr-warmup-init", type=float, default=0.0, help="the learning rate the warm-up starts from")
    g.add_argument("--lr-decay-samples", type=int, default=None)
    g.add_argument("--lr-warmup-samples", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)

    g = p.add_argument_group("data")
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--data-cache-path", type=str, default=None)
    g.add_argument("--tokenizer-type", type=str, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None)
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--vocab-size", type=int, default=None)
    g.add_argument("--eod-mask-loss", action="store_true")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--load-fallback", action="store_true", help="a damaged tracked checkpoint loads the previous one")
    g.add_argument("--finetune", action="store_true")
    g.add_argument("--override-opt_param-scheduler", action="store_true",
                   help="on --load, use this run's LR schedule flags instead of the checkpoint's")
    g.add_argument("--use-checkpoint-opt_param-scheduler", action="store_true",
                   help="on --load, keep the checkpoint's LR schedule whatever this run's flags say")
    g.add_argument("--ckpt-convert-format", default=None, choices=CKPT_FORMATS_HERE,
                   help="load --load, save it in this format to --ckpt-convert-save/<format>, and exit")
    g.add_argument("--ckpt-convert-save", default=None, help="where --ckpt-convert-format saves")
    g.add_argument("--ckpt-format", default="torch",
                   help="torch (Megatron's legacy format, the default) or torch_dist (layout-free, "
                        "torch.distributed.checkpoint); --load reads either")
    g.add_argument("--use-dist-ckpt", action="store_true", help="Megatron's older flag for --ckpt-format torch_dist")

    g = p.add_argument_group("logging and evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100)
    g.add_argument("--log-throughput", action="store_true")
    g.add_argument("--log-params-norm", action="store_true")
    g.add_argument("--log-num-zeros-in-grad", action="store_true")
    g.add_argument("--check-for-nan-in-loss-and-grad", action="store_true",
                   help="always on here: a nan or inf loss, or gradients that are not finite, end the run with one "
                        "line (fp16 with a dynamic loss scale skips the step first)")
    g.add_argument("--record-memory-history", action="store_true",
                   help="record the CUDA caching allocator's allocations and frees from start-up; the last rank "
                        "writes a snapshot to --memory-snapshot-path at every log interval (open it at "
                        "pytorch.org/memory_viz, or summarise it with tools/memory_snapshot.py)")
    g.add_argument("--memory-snapshot-path", type=str, default="snapshot.pickle")
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
    args.ignored_kernel_flags = [f for f in ignored if f in IGNORED_KERNEL_FLAGS]
    args.ignored_logging_flags = [f for f in ignored if f in IGNORED_LOGGING_FLAGS]
    return args


def _positive(args, names: list[str]) -> None:
    for name in names:
        value = getattr(args, name.replace("-", "_"))
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be >= 1, got {value}")


def _check_megatron_choices(args) -> None:
    """Megatron flags whose other values select something this implementation does not have."""
    if args.context_parallel_size != 1:
        raise UsageError(f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
                         "implemented; only 1 is accepted")
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
    for flag in ("hidden-dropout", "attention-dropout"):
        value = getattr(args, flag.replace("-", "_"))
        if not 0.0 <= value < 1.0:
            raise UsageError(f"--{flag} must be in [0, 1), got {value}")


def data_config_from_args(args: argparse.Namespace) -> DataConfig:
    return DataConfig(data_path=args.data_path or [], split=args.split, data_cache_path=args.data_cache_path,
                      tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
                      vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
                      mock_data=args.mock_data, mask_prob=getattr(args, "mask_prob", 0.15),
                      short_seq_prob=getattr(args, "short_seq_prob", 0.1),
                      whole_word_masking=getattr(args, "whole_word_masking", True),
                      masking_max_ngram=getattr(args, "masking_max_ngram", 3))


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


def _training_length(args, schedule: BatchSchedule) -> int:
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


def configs_from_args(args: argparse.Namespace, world_size: int, vocab_size: int | None = None,
                      plan=None) -> RunConfig:
    """Validate the flags against each other and the world size; build the config dataclasses. With `plan` (a
    Plan: --plan, checked against the flags by `apply_plan`), the model, parallel and pipeline configs are the
    plan's own objects and the flags give the rest.

    vocab_size: the vocabulary (from the tokenizer); defaults to --vocab-size, padded like Megatron."""
    _positive(args, ["num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "seq-length",
                     "micro-batch-size", "global-batch-size", "train-iters", "log-interval", "eval-interval",
                     "tensor-model-parallel-size", "pipeline-model-parallel-size", "make-vocab-size-divisible-by"])
    _check_megatron_choices(args)
    if args.fp16 and args.bf16:
        raise UsageError("--fp16 and --bf16 are mutually exclusive")
    if getattr(args, "model_type", "gpt") != "bert" and not getattr(args, "bert_binary_head", True):
        raise UsageError("--bert-no-binary-head: applies to --model-type bert (a GPT has no sentence-order head)")
    if plan is not None:
        return _configs_from_plan(args, world_size, vocab_size, plan)
    tp = args.tensor_model_parallel_size
    parallel = ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=args.pipeline_model_parallel_size,
                              sequence_parallel=args.sequence_parallel,
                              rank_order="bpipe" if args.bpipe else "tp-dp-pp", gpus_per_node=args.gpus_per_node,
                              unit_strategies=_unit_strategies(args, world_size))
    dp = parallel.data_parallel_size(world_size)
    batches = batch_schedule_from_args(args, args.micro_batch_size * dp)
    gbs = batches.global_batch_size
    pipeline = pipeline_config_from_args(args, dp, gbs, batches.sizes())
    train_iters = _training_length(args, batches)
    orig_vocab = vocab_size if vocab_size is not None else args.vocab_size
    if orig_vocab is None:
        raise UsageError("--vocab-size is required with --mock-data (or give a tokenizer with --tokenizer-type)"
                         if args.mock_data else "no vocabulary: give the tokenizer (--tokenizer-type and its "
                         "--vocab-file or --tokenizer-model) or --vocab-size")
    if orig_vocab < 2:
        raise UsageError(f"--vocab-size must be >= 2, got {orig_vocab}" if vocab_size is None else
                         f"the tokenizer's vocabulary has {orig_vocab} token(s); a language model needs >= 2")
    multiple = args.make_vocab_size_divisible_by * tp
    padded = -(-orig_vocab // multiple) * multiple
    backend = _BACKEND_AS.get(args.attention_backend, args.attention_backend)
    if args.use_flash_attn and backend not in ("auto", "flash"):
        raise UsageError(f"--use-flash-attn (Megatron's older flag for --attention-backend flash) contradicts "
                         f"--attention-backend {args.attention_backend}")
    backend = "flash" if args.use_flash_attn else backend
    model = ModelConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
        vocab_size=padded, seq_length=args.seq_length, max_position_embeddings=args.max_position_embeddings,
        ffn_hidden_size=args.ffn_hidden_size, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, init_method_std=args.init_method_std,
        layernorm_epsilon=args.layernorm_epsilon,
        untie_embeddings_and_output_weights=args.untie_embeddings_and_output_weights, attention_backend=backend,
        params_dtype="bf16" if args.bf16 else "fp16" if args.fp16 else "fp32",
        model_type=getattr(args, "model_type", "gpt"), bert_binary_head=getattr(args, "bert_binary_head", True),
        apply_residual_connection_post_layernorm=getattr(args, "apply_residual_connection_post_layernorm", False),
        openai_gelu=getattr(args, "openai_gelu", False), **llama_settings(args),
    )
    _check_layout(model, parallel)
    _check_split_backward(pipeline, parallel, model)
    return RunConfig(model=model, parallel=parallel, pipeline=pipeline, orig_vocab_size=orig_vocab,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     **_training_configs(args, batches, train_iters, args.fp16, args.bf16,
                                         args.use_distributed_optimizer, args.overlap_grad_reduce,
                                         args.overlap_param_gather))


def llama_settings(args) -> dict:
    """ModelConfig's Llama-family fields from Megatron's flags."""
    rope = args.use_rotary_position_embeddings or args.position_embedding_type == "rope"
    kind = "rope" if rope else "none" if getattr(args, "no_position_embedding", False) else args.position_embedding_type
    return dict(position_embedding_type=kind,
                rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
                rotary_seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor, swiglu=args.swiglu,
                num_query_groups=args.num_query_groups if args.group_query_attention else None,
                normalization=args.normalization, add_bias_linear=not args.disable_bias_linear,
                add_qkv_bias=args.add_qkv_bias, qk_layernorm=args.qk_layernorm,
                apply_layernorm_1p=args.apply_layernorm_1p)


def _check_layout(model: ModelConfig, parallel: ParallelConfig) -> None:
    """The model splits over the tensor-parallel degrees: the run's, and every unit strategy's."""
    tp = parallel.tensor_model_parallel_size
    model.check_tensor_parallel(tp)
    for strategy in sorted(set(parallel.unit_strategies or ())):
        t = parse_strategy(strategy).tp
        if model.vocab_size % t:
            raise UsageError(f"--unit-strategies {strategy}: the padded vocabulary {model.vocab_size} does not split "
                             f"over tp {t} (raise --make-vocab-size-divisible-by)")
    if parallel.sequence_parallel and tp > 1 and model.seq_length % tp:
        raise UsageError(f"--sequence-parallel: --seq-length {model.seq_length} is not divisible by tensor-parallel "
                         f"size {tp}")


def _training_configs(args, batches: BatchSchedule, train_iters: int, fp16: bool, bf16: bool,
                      distributed_optimizer: bool, overlap_grad_reduce: bool, overlap_param_gather: bool) -> dict:
    """The parts of a run no plan decides: training, optimizer, LR schedule and data."""
    gbs = batches.global_batch_size
    if overlap_param_gather and distributed_optimizer and not overlap_grad_reduce:
        raise UsageError("--overlap-param-gather needs --overlap-grad-reduce (as in Megatron-LM)")
    train = TrainConfig(
        global_batch_size=gbs, train_iters=train_iters, seed=args.seed, pipeline_trace=args.pipeline_trace,
        overlap_grad_reduce=overlap_grad_reduce, eod_mask_loss=args.eod_mask_loss,
        gradient_accumulation_fusion=getattr(args, "gradient_accumulation_fusion", True),
        log_interval=args.log_interval, eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        exit_interval=args.exit_interval, exit_duration_in_mins=args.exit_duration_in_mins,
        manual_gc=args.manual_gc, manual_gc_interval=args.manual_gc_interval, manual_gc_eval=args.manual_gc_eval,
        tensorboard_dir=args.tensorboard_dir, log_throughput=args.log_throughput,
        record_memory_history=getattr(args, "record_memory_history", False),
        memory_snapshot_path=getattr(args, "memory_snapshot_path", "snapshot.pickle"),
        log_params_norm=args.log_params_norm, log_num_zeros_in_grad=args.log_num_zeros_in_grad, save=args.save,
        load=args.load, save_interval=args.save_interval, save_optim=not args.no_save_optim,
        save_rng=not args.no_save_rng, load_optim=not args.no_load_optim, load_rng=not args.no_load_rng,
        finetune=args.finetune, ckpt_format=args.ckpt_format,
        load_fallback=args.load_fallback,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        ckpt_convert_format=args.ckpt_convert_format, ckpt_convert_save=args.ckpt_convert_save,
        distributed_backend=args.distributed_backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes, log_activation_memory=args.log_activation_memory,
        train_samples=args.train_samples, batch_schedule=batches,
    )
    optimizer = OptimizerConfig(
        lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, adam_beta1=args.adam_beta1,
        adam_beta2=args.adam_beta2, adam_eps=args.adam_eps, clip_grad=args.clip_grad, fp16=fp16,
        bf16=bf16, loss_scale=args.loss_scale, initial_loss_scale=args.initial_loss_scale,
        min_loss_scale=args.min_loss_scale, loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        use_distributed_optimizer=distributed_optimizer, overlap_param_gather=overlap_param_gather,
    )
    lr = LRConfig(lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
                  lr_decay_iters=args.lr_decay_iters, lr_warmup_iters=args.lr_warmup_iters,
                  lr_warmup_fraction=args.lr_warmup_fraction, train_iters=train_iters, global_batch_size=gbs,
                  train_samples=args.train_samples, lr_decay_samples=args.lr_decay_samples,
                  lr_warmup_samples=args.lr_warmup_samples, decoupled_lr=args.decoupled_lr,
                  decoupled_min_lr=args.decoupled_min_lr, warmup_init=getattr(args, "lr_warmup_init", 0.0))
    if not args.mock_data and not args.data_path:
        raise UsageError("give --data-path (preprocessed .bin/.idx prefixes) or --mock-data")
    return dict(train=train, optimizer=optimizer, lr=lr, data=data_config_from_args(args))


def _check_split_backward(pipeline: PipelineConfig, parallel: ParallelConfig, model: ModelConfig) -> None:
    """What a zero-bubble schedule (backwards split into B and W) does not combine with yet (BPipe and slicing:
    PipelineConfig)."""
    name = pipeline.schedule
    if name in ZERO_BUBBLE and parallel.unit_strategies:
        raise UsageError(f"--pipeline-schedule {name} does not combine with --unit-strategies (not supported yet)")


def _configs_from_plan(args, world_size: int, vocab_size: int | None, plan) -> RunConfig:
    """The run of a plan: its model, degrees and pipeline as they are; training flags around them."""
    s = plan.spec
    if args.rampup_batch_size is not None or args.step_batch_size_schedule is not None:
        flag = "--rampup-batch-size" if args.rampup_batch_size is not None else "--step-batch-size-schedule"
        raise UsageError(f"{flag}: --plan {args.plan} fixes the micro-batches per iteration; drop one of them")
    if world_size != s.world_size:
        raise UsageError(f"--plan {args.plan}: planned for {s.world_size} ranks (tp {s.tp} x pp {s.pp} x dp {s.dp}), "
                         f"launched with {world_size}")
    parallel = ParallelConfig(tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp,
                              sequence_parallel=s.sp, rank_order=s.rank_order, gpus_per_node=args.gpus_per_node,
                              unit_strategies=tuple(s.unit_strategies) if s.unit_strategies else None)
    orig_vocab = next((v for v in (vocab_size, args.vocab_size, plan.orig_vocab_size) if v is not None), None)
    if orig_vocab is None:
        raise UsageError("--vocab-size is required with --mock-data (or give a tokenizer with --tokenizer-type)")
    multiple = plan.make_vocab_size_divisible_by * s.tp
    if -(-orig_vocab // multiple) * multiple != s.model.vocab_size:
        raise UsageError(f"--plan {args.plan}: planned for a padded vocabulary of {s.model.vocab_size}, this run has "
                         f"{-(-orig_vocab // multiple) * multiple} (tokenizer or --vocab-size differs)")
    if s.model.model_type != getattr(args, "model_type", "gpt"):
        raise UsageError(f"--plan {args.plan}: planned for a {s.model.model_type.upper()} model, this run trains a "
                         f"{getattr(args, 'model_type', 'gpt').upper()}")
    _check_layout(s.model, parallel)
    _check_split_backward(s.pipeline, parallel, s.model)
    pl = s.pipeline
    check_slicing(pl.slicing, pl.micro_batch_size, pl.num_microbatches)
    if s.unit_strategies:
        _check_strategies_fit(parse_unit_strategies(s.unit_strategies, s.model.num_units, s.dp), s.model,
                              pl.micro_batch_size * s.dp, pl.slicing != 0)
    batches = BatchSchedule(plan.global_batch_size)
    dtype = s.model.params_dtype
    rest = _training_configs(args, batches, _training_length(args, batches), dtype == "fp16", dtype == "bf16",
                             s.distributed_optimizer, s.overlap_grad_reduce, s.overlap_param_gather)
    rest["train"] = replace(rest["train"], gradient_accumulation_fusion=plan.engine.gradient_accumulation_fusion)
    if rest["data"].vocab_size is None and vocab_size is None:  # --mock-data sized by the plan's vocabulary
        rest["data"] = replace(rest["data"], vocab_size=orig_vocab)
    return RunConfig(model=s.model, parallel=parallel, pipeline=s.pipeline, orig_vocab_size=orig_vocab,
                     make_vocab_size_divisible_by=plan.make_vocab_size_divisible_by, **rest)


# ---- --plan: the plan gives the model, parallel and pipeline configs; flags given beside it must agree -----------
_RECOMPUTE_FLAGS = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_activations",
                    "num_layers_per_virtual_pipeline_stage")


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
    _check_strategies_fit(strategies, args, args.micro_batch_size * (world_size // pp),
                          str(getattr(args, "microbatch_slicing", "0") or "0") != "0")
    return tuple(str(x) for x in strategies)


def _check_strategies_fit(strategies, model, stage_batch: int, sliced: bool) -> None:
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
        "swiglu": m.swiglu, "group_query_attention": m.num_query_groups is not None,
        "num_query_groups": m.num_query_groups, "normalization": m.normalization,
        "disable_bias_linear": not m.add_bias_linear, "add_qkv_bias": m.add_qkv_bias, "qk_layernorm": m.qk_layernorm,
        "apply_layernorm_1p": m.apply_layernorm_1p,
        "make_vocab_size_divisible_by": plan.make_vocab_size_divisible_by,
        "tensor_model_parallel_size": s.tp, "pipeline_model_parallel_size": s.pp, "sequence_parallel": s.sp,
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


def apply_plan(args: argparse.Namespace, argv: list[str], parser: argparse.ArgumentParser | None = None):
    """Load --plan and check the flags given beside it: one that disagrees with the plan is an error. The run's
    configs then come from the plan itself (`configs_from_args(..., plan=plan)`)."""
    from .planner.plan import Plan

    plan = Plan.load(args.plan)
    if not plan.engine.runs_here:
        raise UsageError(f"--plan {args.plan}: planned for engine {plan.engine.describe()}, which this runtime is "
                         "not (megatron_bmw, fp32 main gradients); plan again with --engine megatron_bmw")
    check_flags_against_plan(args, given_flags(argv, parser or build_parser()), plan)
    return plan


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
