"""Rules a layout must keep against the model it splits, in one place for the run (run_parts.check_layout) and the
planner (planner/spec.py): what the runtime cannot run is neither started nor planned; and which checkpoint
format can hold a layout's experts."""

from __future__ import annotations

from ..errors import UsageError
from .model import ModelConfig
from .parallel import ParallelConfig


def check_context_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """What --context-parallel-size needs of the model and the other degrees (nothing where cp is 1)."""
    if parallel.context_parallel_size == 1:
        return
    cp, tp, flag = parallel.context_parallel_size, parallel.tensor_model_parallel_size, "--context-parallel-size"
    if model.model_type != "gpt":
        raise UsageError(f"{flag} {cp}: context parallelism splits causal (GPT) sequences, not {model.model_type}'s")
    if model.seq_length % (2 * cp):
        raise UsageError(f"{flag} {cp}: --seq-length {model.seq_length} is not divisible by 2 x {cp} (each rank "
                         "holds two chunks of every sequence)")
    if parallel.sequence_parallel and (model.seq_length // cp) % tp:
        raise UsageError(f"{flag} {cp} with --sequence-parallel: a rank's {model.seq_length // cp} rows of each "
                         f"sequence do not split over tensor-parallel size {tp}")
    if model.attention_dropout:
        raise UsageError(f"{flag} {cp}: attention dropout is not supported across context-parallel ranks; "
                         "give --attention-dropout 0")
    if parallel.unit_strategies:
        raise UsageError(f"{flag} {cp} does not combine with --unit-strategies (Galvatron-BMW strategies are "
                         "tp x dp per unit)")
    heads = model.num_attention_heads // tp
    if parallel.cp_comm_type == "a2a" and heads % cp:
        raise UsageError(f"--cp-comm-type a2a: {heads} attention heads per tensor-parallel rank are not divisible "
                         f"by {flag} {cp} (use --cp-comm-type p2p)")


def legacy_format_refusal(ep: int, etp: int, tp: int) -> str | None:
    """Why `--ckpt-format torch` cannot hold these experts, or None. Megatron's legacy files with expert parallelism
    (mp_rank_TT_PPP_EEE) are not written here: experts laid out other than the dense tensors (ep > 1, or etp != tp)
    are saved and loaded as torch_dist only."""
    if ep == 1 and etp == tp:
        return None
    what = f"--expert-model-parallel-size {ep}" if ep > 1 else f"--expert-tensor-parallel-size {etp} (tp {tp})"
    return (f"--ckpt-format torch: experts split by {what} are saved and loaded only as torch_dist; use "
            "--ckpt-format torch_dist (it loads into any ep/etp/tp/pp)")
