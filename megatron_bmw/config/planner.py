"""The planner's settings beside a run's model flags (tools/autoconfig.py estimate, simulate, search): the cluster,
the profiles, the memory allowance, the engine whose memory is counted, and the cost model's knobs. Each field
declares its flag (schema.flag); the planner's functions take this object, never the parsed flags. AutoPlanConfig
and PlanRequest: pretrain_gpt.py --plan auto, the same search at start-up for the ranks the run finds."""

from __future__ import annotations

from dataclasses import dataclass

from .model import ModelConfig
from .schema import check_ranges, flag, positive_int

ENGINES = ("megatron_bmw", "megatron-core", "nemo", "deepspeed")
BUILTIN_CLUSTERS = ("a100-80g-ib", "a100-40g-ib", "h100-80g-ib", "rtx-titan-pcie", "aws-p3.8xlarge",
                    "aws-g4dn.12xlarge", "amp-heterogeneous", "local")  # planner/clusters/<name>.yaml
OURS = "megatron_bmw"
PLANNER, ENGINE, TIMING = "planner", "engine (whose model states the memory counts; Megatron-LM's flag names)", "timing"


@dataclass
class PlannerConfig:
    cluster: str = flag("--cluster", group=PLANNER, default="local",
                        help=f"built-in ({', '.join(BUILTIN_CLUSTERS)}) or a YAML file")
    num_nodes: int | None = flag("--num-nodes", group=PLANNER, default=None, type=positive_int("--num-nodes"),
                                 help="resize a single-group cluster")
    world_size: int | None = flag("--world-size", group=PLANNER, default=None, type=positive_int("--world-size"),
                                  help="GPUs used (default: all of the cluster)")
    profile: list[str] = flag("--profile", group=PLANNER, default_factory=list, action="append",
                              help="profile JSON (autoconfig.py profile), one or more (one per device type); else "
                                   "analytic")
    inter_node_bus_bandwidth: float | None = flag(
        "--inter-node-bus-bandwidth", group=PLANNER, default=None, above=0.0,
        help="GB/s: the NCCL bus bandwidth measured across nodes (nccl-tests all_reduce_perf busbw); every ring "
             "crossing nodes gets it (replaces the cluster's inter-node link and its NIC sharing)")
    intra_node_bus_bandwidth: float | None = flag(
        "--intra-node-bus-bandwidth", group=PLANNER, default=None, above=0.0,
        help="GB/s: the NCCL bus bandwidth measured inside a node (replaces the cluster's intra-node links)")
    rank_order: str = flag("--rank-order", group=PLANNER, default="tp-dp-pp", choices=("tp-dp-pp", "bpipe"))
    memory_device: str | None = flag(
        "--memory-device", group=PLANNER, default=None, choices=("cuda", "cpu"),
        help="kernel behaviour the activation count follows (default: cpu only for a local CPU profile)")
    memory_workspace_gb: float | None = flag(
        "--memory-workspace-gb", group=PLANNER, default=None,
        help="fixed allowance per GPU (default: the profile's memory_allowance, else on cuda derived per device type "
             "and layout: CUDA context, cuBLAS workspaces, NCCL buffers; 0 on cpu)")
    memory_fragmentation: float | None = flag(
        "--memory-fragmentation", group=PLANNER, default=None,
        help="fractional allowance on top (default: the profile's memory_allowance, else on cuda the caching "
             "allocator's rounding of the layout's tensors; 0 on cpu)")
    cuda_context_gb: float | None = flag(
        "--cuda-context-gb", group=PLANNER, default=None, minimum=0.0,
        help="the CUDA context and loaded kernels per GPU as measured on the cluster (an idle process's "
             "nvidia-smi use; default: the device type's cuda_context_gb), in the derived allowance")
    moe_load_imbalance: float = flag(
        "--moe-load-imbalance", group=PLANNER, default=1.0, minimum=1.0,
        help="MoE models: max/mean tokens per expert the memory and time are planned for (default 1.0: the even "
             "routing the load-balancing loss aims at; the busiest rank holds one expert at this multiple of the "
             "mean, capped by a capacity factor)")
    engine: str = flag("--engine", group=ENGINE, default=OURS, choices=ENGINES,
                       help="megatron_bmw (this runtime: fp32 main gradients), megatron-core (Megatron-LM), nemo "
                            "(NeMo 24.x: Megatron-core stepped by distributed_fused_adam, bf16 gradients, 16-bit "
                            "master remainders) or deepspeed (ZeRO stage 0/1, fp16; --use-distributed-optimizer for "
                            "stage 1)")
    accumulate_allreduce_grads_in_fp32: bool = flag(
        "--accumulate-allreduce-grads-in-fp32", group=ENGINE, default=False, action="store_true",
        help="megatron-core: the gradient buffer in fp32 (default: on for bf16, off for fp16)")
    grad_reduce_in_bf16: bool = flag("--grad-reduce-in-bf16", group=ENGINE, default=False, action="store_true",
                                     help="megatron-core: 16-bit gradient buffer with bf16 (off by default)")
    tp_comm_overlap: bool = flag(
        "--tp-comm-overlap", group=ENGINE, default=False, action="store_true",
        help="megatron-core or nemo with Transformer Engine: the sequence-parallel all-gathers and reduce-scatters overlap the "
             "GEMMs next to them (timed only where the cluster gives the SM count)")
    json: bool = flag("--json", group=ENGINE, default=False, action="store_true", help="print one JSON object")
    # what simulate and search time (not estimate)
    achievable_fraction: float | None = flag(
        "--achievable-fraction", group=TIMING, default=None,
        help="of peak FLOP/s for analytic times (default: the device type's in the cluster file, else 0.5)")
    bandwidth_fraction: float = flag("--bandwidth-fraction", group=TIMING, default=0.8,
                                     help="of the memory bandwidth, for memory-bound work")
    overlap_factor: float | None = flag(
        "--overlap-factor", group=TIMING, default=None,
        help="slowdown of overlapped DP sync (default: the profile's overlap_factor, else 1.3)")
    cuda_launch_blocking: bool = flag(
        "--cuda-launch-blocking", group=TIMING, default=False, action="store_true",
        help="the run sets CUDA_LAUNCH_BLOCKING=1: each unit's host time (its operators, counted on this CPU, x "
             "--host-op-us) adds to its device time (analytic times only)")
    host_op_us: float | None = flag(
        "--host-op-us", group=TIMING, default=None,
        help="host time per dispatched operator (default: 80, measured for this runtime on an H100's host): our "
             "runtime's analytic units take at least their host time, and with --cuda-launch-blocking any engine's "
             "add it")
    timeline: str | None = flag("--timeline", group=TIMING, default=None,
                                help="write the simulated timeline as a PNG")

    def __post_init__(self) -> None:
        self.profile = list(self.profile)
        check_ranges(self)


AUTO = "auto"  # --plan auto: search at start-up for the world the run finds
AUTO_GROUP = "--plan auto (pretrain_gpt.py and pretrain_bert.py only)"


@dataclass
class AutoPlanConfig:
    """--plan auto: what the search at start-up describes the ranks with (pretrain_gpt.py's flags; the run's own
    model and --global-batch-size are the rest of what it searches for)."""

    plan_profile: str | None = flag(
        "--plan-profile", group=AUTO_GROUP, default=None,
        help="with --plan auto: a profile of these devices (tools/autoconfig.py profile); without it the unit "
             "times are analytic (FLOPs / peak) on --plan-cluster")
    plan_cluster: str | None = flag(
        "--plan-cluster", group=AUTO_GROUP, default=None,
        help="with --plan auto: the cluster the ranks belong to, built-in name or YAML (default: local, this "
             "machine as --plan-profile measured it); resized to the ranks the run finds")
    plan_space: list[str] = flag(
        "--plan-space", group=AUTO_GROUP, default_factory=list, action="append",
        help="with --plan auto: restrict the search as autoconfig.py search --space does (tp=1,2 pp=2 mbs=1,2 "
             "schedule=1f1b ...), repeatable")

    def __post_init__(self) -> None:
        self.plan_space = list(self.plan_space)


@dataclass(frozen=True)
class PlanRequest:
    """What --plan auto searches for, built from the flags at start-up (plan_overlay.plan_request): the serial model
    (vocabulary padded for tp 1), its vocabulary, the global batch, the world the run finds, how to describe its
    ranks, and where the run's plans live (--load: the plan the checkpoint ran; --save: this run's)."""

    model: ModelConfig
    orig_vocab_size: int
    make_vocab_size_divisible_by: int
    global_batch_size: int
    world_size: int
    auto: AutoPlanConfig
    gradient_accumulation_fusion: bool = True
    save: str | None = None
    load: str | None = None
    ckpt_format: str = "torch"
    distributed_backend: str | None = None
    distributed_timeout_minutes: float = 10.0
