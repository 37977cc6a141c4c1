"""Megatron's flags that are not a field of a run's config: other ways of saying what a field holds (resolved into
the fields by arguments.py: the recomputation flags into `PipelineConfig.recompute`, the virtual-stage flags into
`virtual_stages`, ...), and flags accepted for compatibility that change nothing here."""

from __future__ import annotations

from dataclasses import dataclass

from .model import M
from .parallel import P
from .schema import flag

T, O, C, L, B = "training", "optimizer and learning rate", "checkpointing", "logging and evaluation", "bert"


@dataclass
class FlagInputs:
    use_rotary_position_embeddings: bool = flag("--use-rotary-position-embeddings", group=M, default=False,
                                                action="store_true", help="Megatron's older flag for rope")
    no_position_embedding: bool = flag(
        "--no-position-embedding", group=M, default=False, action="store_true",
        help="Megatron's older flag: no learned position embedding (--position-embedding-type none, unless rope)")
    group_query_attention: bool = flag("--group-query-attention", group=M, default=False, action="store_true")
    kv_channels: int | None = flag("--kv-channels", group=M, default=None,
                                   help="head dimension: hidden size / heads only")
    attention_softmax_in_fp32: bool = flag("--attention-softmax-in-fp32", group=M, default=False,
                                           action="store_true",
                                           help="accepted: the attention softmax always runs in fp32")
    use_flash_attn: bool = flag("--use-flash-attn", group=M, default=False, action="store_true",
                                help="Megatron's older flag; same as --attention-backend flash")
    recompute_granularity: str | None = flag("--recompute-granularity", group=M, default=None,
                                             choices=("full", "selective"))
    recompute_method: str | None = flag("--recompute-method", group=M, default=None, choices=("uniform", "block"))
    recompute_num_layers: int | None = flag("--recompute-num-layers", group=M, default=None)
    recompute_activations: bool = flag("--recompute-activations", group=M, default=False, action="store_true",
                                       help="Megatron's alias of --recompute-granularity selective")
    recompute_units: str | None = flag(
        "--recompute-units", group=M, default=None,
        help="recomputation of every unit, e.g. none,selective,full,... over [embedding, attn_0, mlp_0, ..., head]")
    num_layers_per_virtual_pipeline_stage: int | None = flag("--num-layers-per-virtual-pipeline-stage", group=P,
                                                             default=None)
    virtual_pipeline_model_parallel_size: int | None = flag(
        "--virtual-pipeline-model-parallel-size", group=P, default=None,
        help="model chunks per pipeline rank (interleaved 1F1B); with --pipeline-partition any unit split")
    unit_strategies: str | None = flag(
        "--unit-strategies", group=P, default=None,
        help="Galvatron-BMW hybrid: a strategy per unit over the world/pp ranks of a stage (tp2-dp2, dp2-tp2, sdp4, "
             "tp4, ...), comma separated over [embedding, attn_0, mlp_0, ..., head], or one for all; needs "
             "--tensor-model-parallel-size 1")
    hierarchical_context_parallel_sizes: list[int] | None = flag(
        "--hierarchical-context-parallel-sizes", group=P, default=None, nargs="+", type=int,
        help="not built: refused (context parallelism is one level, --cp-comm-type p2p or a2a)")
    plan: str | None = flag("--plan", group=P, default=None,
                            help="run the plan file written by tools/autoconfig.py search (other flags must agree "
                                 "with it); auto: search at start-up for the ranks the run finds (--plan-profile, "
                                 "--plan-cluster, --plan-space), written beside the checkpoint as latest_plan.json")
    exit_signal_handler: bool = flag("--exit-signal-handler", group=T, default=False, action="store_true",
                                     help="accepted; SIGTERM always saves and exits")
    optimizer: str = flag("--optimizer", group=O, default="adam", choices=("adam",))
    calculate_per_token_loss: bool = flag(
        "--calculate-per-token-loss", group=O, default=False, action="store_true",
        help="accepted where every micro-batch has micro-batch x seq-length loss tokens (GPT without "
             "--eod-mask-loss): the mean over the batch's tokens is then the mean of micro-batch means")
    use_dist_ckpt: bool = flag("--use-dist-ckpt", group=C, default=False, action="store_true",
                               help="Megatron's older flag for --ckpt-format torch_dist")
    check_for_nan_in_loss_and_grad: bool = flag(
        "--check-for-nan-in-loss-and-grad", group=L, default=False, action="store_true",
        help="always on here: a nan or inf loss, or gradients that are not finite, end the run with one line (fp16 "
             "with a dynamic loss scale skips the step first)")
    bert_binary_head: bool = flag("--bert-binary-head", group=B, default=True, action="store_true",
                                  help="the sentence-order head with the pooler (default)")
