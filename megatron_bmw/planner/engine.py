"""Whose runtime holds the model states, and in which precision: the model-state bytes per parameter.

The engine and its flags follow Megatron-LM's names. Per parameter, with d the data-parallel size and the
distributed optimizer (ZeRO-1) sharding everything the optimizer owns over d:

  megatron_bmw (ours)  gradients accumulate and are reduced in an fp32 main_grad buffer (parallel/grad_sync.py);
                       fp32 master copy for 16-bit parameters, and for fp32 ones under ZeRO-1 too (the shards
                       are copies, training/optimizer.py); two fp32 Adam moments.
                       bf16: 2 + 4 + 12 (6 + 12/d), fp32: 4 + 4 + 8 (8 + 12/d).
  megatron-core        the DDP grad buffer is fp32 with --accumulate-allreduce-grads-in-fp32 (DDPConfig
                       grad_reduce_in_fp32), else in the parameter dtype; Megatron-LM turns the flag on for bf16
                       unless --grad-reduce-in-bf16, and leaves it off for fp16. With 16-bit gradients the
                       optimizer steps on an fp32 copy of them (main grads). fp32 parameters are their own main
                       parameters (not copied, only the Adam moments are sharded). These are the bytes Megatron
                       Core's distributed-optimizer guide tabulates: fp16/fp16 20 (4 + 16/d), bf16/fp32 18
                       (6 + 12/d), fp32/fp32 16 (8 + 8/d).
  deepspeed            ZeRO stage 0 (FP16_Optimizer) or 1 (--use-distributed-optimizer) with fp16 parameters, as in
                       AMP's trials: fp16 gradients, and fp32 master weights, fp32 gradients and Adam moments for
                       the step (the ZeRO paper's 2 + 2 + 12, plus the fp32 gradient copy the optimizer steps on,
                       of its partition under ZeRO-1): 20 (4 + 16/d). With bf16 parameters (BF16_Optimizer, as
                       BLOOM's runs): the bf16 gradients autograd writes, a whole fp32 gradient accumulator each
                       micro-batch's gradients are added into and that is all-reduced as it is, even under ZeRO-1,
                       and fp32 master weights and moments: 20 (8 + 12/d). fp32 parameters are not modelled.
  nemo                 NeMo 24.x's Megatron GPT recipes (Nemotron, GPT-3): Megatron-core's model and schedules
                       (`megatron-core` in every other respect) stepped by `distributed_fused_adam`, NeMo's
                       MegatronDistributedFusedAdam over Apex's DistributedFusedAdam, with the recipes' bf16
                       parameters, grad_sync_dtype bf16, contiguous_grad_buffer and store_param_remainders. From
                       Apex's source: the parameters are views of a bf16 buffer (2); the contiguous gradient buffer
                       holds every bucket's gradients in grad_sync_dtype (2); each rank keeps, for its 1/d shard of
                       every bucket, an int16 remainder (the fp32 master is the bf16 parameter plus these 16 low
                       bits: 2) and fp32 exp_avg and exp_avg_sq (4 + 4): 14 (4 + 10/d) with the distributed
                       optimizer, 14 unsharded without it. The reduce-scatter's bf16 output shard (2/d) is
                       allocated when the gradients are synchronised and freed when they are zeroed: it lives across
                       the step, when no activation is held, so it is not counted with them. bf16 only (the recipes';
                       store_param_remainders needs bf16 parameters).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config.planner import ENGINES, OURS  # noqa: F401 - the engines' names live with the planner's flags
from ..errors import UsageError
from ..units import DTYPE_BYTES

_FP32 = 4


@dataclass(frozen=True)
class PrecisionConfig:
    """How parameters are stored and updated, in bytes per parameter (see the module doc)."""

    param_bytes: int = 4  # 2 for bf16/fp16
    distributed_optimizer: bool = False  # ZeRO-1 over data parallel
    grad_bytes: int = 4  # the buffer gradients accumulate and are reduced in: 4 fp32 main grads, 2 16-bit
    fp32_master_copy: bool = True  # fp32 parameters get separate master shards under ZeRO-1 (ours)
    master_remainder: bool = False  # the fp32 master kept as 16-bit remainders of bf16 parameters (nemo)

    def optimizer_bytes(self, dp: int) -> float:
        """Per parameter: the fp32 master copy (none for fp32 parameters that are their own master; its 16-bit
        remainder for nemo's), the fp32 gradient the step reads where the gradient buffer is 16-bit (not nemo's,
        whose step reads the bf16 shard), two fp32 Adam moments; ZeRO-1 shards all of it over the data-parallel
        group."""
        if self.master_remainder:
            master = 2
        elif self.param_bytes < _FP32:
            master = _FP32
        else:
            master = _FP32 if self.distributed_optimizer and self.fp32_master_copy else 0
        grad_copy = _FP32 if self.grad_bytes < _FP32 and not self.master_remainder else 0
        per = master + grad_copy + 2 * _FP32
        return per / dp if self.distributed_optimizer else per

    def state_bytes(self, dp: int) -> float:
        """Parameters, gradients and optimizer states per parameter."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes(dp)


@dataclass(frozen=True)
class EngineConfig:
    """The runtime a plan is for, with Megatron-LM's gradient-precision flag (None: the engine's default)."""

    name: str = OURS
    accumulate_allreduce_grads_in_fp32: bool | None = None
    tp_comm_overlap: bool = False  # Megatron-core with Transformer Engine: SP collectives overlap their GEMMs
    gradient_accumulation_fusion: bool = True  # Megatron's default; --no-gradient-accumulation-fusion turns it off

    def __post_init__(self) -> None:
        if self.name not in ENGINES:
            raise UsageError(f"--engine must be one of {', '.join(ENGINES)}, not {self.name!r}")
        if self.name == "nemo" and self.accumulate_allreduce_grads_in_fp32 is not None:
            raise UsageError("--accumulate-allreduce-grads-in-fp32/--grad-reduce-in-bf16 are Megatron-LM's; engine "
                             "nemo reduces in its recipes' grad_sync_dtype, bf16")
        if self.tp_comm_overlap and not self.megatron_core_runtime:
            raise UsageError(f"--tp-comm-overlap is Megatron-core's (Transformer Engine's userbuffers); engine "
                             f"{self.name} does not overlap tensor-parallel communication (plan with --engine "
                             "megatron-core)")
        if self.name == OURS and self.accumulate_allreduce_grads_in_fp32 is False:
            raise UsageError("--grad-reduce-in-bf16: megatron_bmw accumulates and reduces gradients in fp32 "
                             "(parallel/grad_sync.py); plan another engine with --engine megatron-core")
        if self.name == "deepspeed" and self.accumulate_allreduce_grads_in_fp32 is not None:
            raise UsageError("--accumulate-allreduce-grads-in-fp32/--grad-reduce-in-bf16 are Megatron-LM's; the "
                             "deepspeed engine's gradient precision follows the parameters (ZeRO stage 0/1)")

    @property
    def megatron_core_runtime(self) -> bool:
        """Whether the model runs as Megatron-core's with Transformer Engine's modules (megatron-core, nemo)."""
        return self.name in ("megatron-core", "nemo")

    def _bf16_optimizer(self, params_dtype: str) -> bool:
        """DeepSpeed with bf16 parameters: its BF16_Optimizer, an fp32 accumulator all-reduced as ours is."""
        return self.name == "deepspeed" and params_dtype == "bf16"

    def grads_in_fp32(self, params_dtype: str) -> bool:
        """Whether gradients accumulate and are reduced in fp32."""
        if params_dtype == "fp32" or self.name == OURS or self._bf16_optimizer(params_dtype):
            return True
        if self.name == "nemo":
            return False
        if self.accumulate_allreduce_grads_in_fp32 is not None:
            return self.accumulate_allreduce_grads_in_fp32
        return params_dtype == "bf16" and self.name == "megatron-core"

    def precision(self, params_dtype: str, distributed_optimizer: bool) -> PrecisionConfig:
        if self.name == "deepspeed" and params_dtype == "fp32":
            raise UsageError("--engine deepspeed: memory is modelled for --fp16 and --bf16 (ZeRO stage 0/1), not fp32")
        if self.name == "nemo" and params_dtype != "bf16":
            raise UsageError("--engine nemo: memory is modelled for --bf16 (distributed_fused_adam with "
                             "store_param_remainders, NeMo's recipes), not " + params_dtype)
        param_bytes = DTYPE_BYTES[params_dtype]
        if self.name == "nemo":
            return PrecisionConfig(param_bytes=2, distributed_optimizer=distributed_optimizer, grad_bytes=2,
                                   fp32_master_copy=False, master_remainder=True)
        if self._bf16_optimizer(params_dtype):  # bf16 gradients beside the fp32 accumulator
            return PrecisionConfig(param_bytes=2, distributed_optimizer=distributed_optimizer, grad_bytes=2 + _FP32,
                                   fp32_master_copy=False)
        return PrecisionConfig(param_bytes=param_bytes, distributed_optimizer=distributed_optimizer,
                               grad_bytes=_FP32 if self.grads_in_fp32(params_dtype) else param_bytes,
                               fp32_master_copy=self.name == OURS)

    def accumulation_bytes(self, params_dtype: str) -> int:
        """Bytes moved per parameter and micro-batch to accumulate a weight gradient outside the GEMM that made it.
        Ours and Megatron-core accumulate inside the weight-gradient GEMM (--gradient-accumulation-fusion, the
        default; parallel/wgrad_accum.py): none. Unfused, they add the e-byte gradient into their gradient buffer
        (read e, read and write the buffer's bytes: fp32 main_grad for ours). DeepSpeed's autograd adds each
        micro-batch's gradient into the 16-bit .grad (read 2e, write e); with bf16 its optimizer adds them into an
        fp32 accumulator as ours does unfused."""
        e = DTYPE_BYTES[params_dtype]
        if self._bf16_optimizer(params_dtype):
            return e + 2 * _FP32
        if self.name == "deepspeed":
            return 3 * e
        if self.gradient_accumulation_fusion:
            return 0
        return e + 2 * (_FP32 if self.grads_in_fp32(params_dtype) else e)

    def grad_reduction(self, params_dtype: str, distributed_optimizer: bool) -> tuple[float, bool]:
        """(bytes per gradient element reduced over data parallel, whether it is a reduce-scatter): ours all-reduces
        fp32 even under ZeRO-1 (parallel/grad_sync.py), as DeepSpeed's BF16_Optimizer does its fp32 accumulator;
        Megatron-core's and DeepSpeed's fp16 distributed optimizers reduce-scatter their gradient buffer's bytes,
        each rank keeping the gradients of its shard."""
        if self.name == OURS or self._bf16_optimizer(params_dtype):
            return float(_FP32), False
        return float(self.precision(params_dtype, distributed_optimizer).grad_bytes), distributed_optimizer

    @property
    def blocking_p2p(self) -> bool:
        """Whether pipeline sends and receives hold the compute stream: DeepSpeed's pipeline engine moves each
        activation and gradient with a synchronous broadcast between the two stages, so a stage computes nothing
        while its transfers run (Megatron's batched isend/irecv, and ours, run beside the compute)."""
        return self.name == "deepspeed"

    def synchronous_p2p(self, schedule: str) -> bool:
        """Whether the sender of a pipeline transfer waits for it to arrive: Megatron-LM's own schedules (1F1B,
        interleaved) post each send with the receive of the next input after a compute and wait on both
        (p2p_communication._communicate), so a rank runs on only once its neighbour has posted the matching receive;
        the zero-bubble schedules' Megatron-LM fork (sail-sg/zero-bubble-pipeline-parallelism) and our engine post
        receives ahead and wait only for inputs. DeepSpeed's transfers hold the compute (blocking_p2p)."""
        return self.name not in (OURS, "deepspeed") and schedule in ("1f1b", "interleaved")

    @property
    def runs_here(self) -> bool:
        """Whether our runtime (pretrain_gpt.py) runs a plan for this engine."""
        return self.name == OURS

    def to_json(self) -> dict:
        out: dict = {"engine": self.name}
        if self.accumulate_allreduce_grads_in_fp32 is not None:
            out["accumulate_allreduce_grads_in_fp32"] = self.accumulate_allreduce_grads_in_fp32
        if self.tp_comm_overlap:
            out["tp_comm_overlap"] = True
        if not self.gradient_accumulation_fusion:
            out["gradient_accumulation_fusion"] = False
        return out

    def describe(self) -> str:
        flag = self.accumulate_allreduce_grads_in_fp32
        return self.name + ("" if flag is None else " with --accumulate-allreduce-grads-in-fp32" if flag
                            else " with --grad-reduce-in-bf16") + (" --tp-comm-overlap" if self.tp_comm_overlap else "") + \
            ("" if self.gradient_accumulation_fusion or self.name == "deepspeed"
             else " --no-gradient-accumulation-fusion")


def engine_from_flags(engine: str | None, accumulate_fp32: bool, reduce_bf16: bool,
                      tp_comm_overlap: bool = False, accumulation_fusion: bool = True) -> EngineConfig:
    """The engine of `--engine`, `--accumulate-allreduce-grads-in-fp32`, `--grad-reduce-in-bf16`,
    `--tp-comm-overlap` and `--no-gradient-accumulation-fusion`."""
    if accumulate_fp32 and reduce_bf16:
        raise UsageError("--accumulate-allreduce-grads-in-fp32 and --grad-reduce-in-bf16 contradict each other")
    flag = True if accumulate_fp32 else False if reduce_bf16 else None
    return EngineConfig(engine or OURS, flag, tp_comm_overlap, accumulation_fusion)
