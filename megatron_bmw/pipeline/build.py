"""The schedule a PipelineConfig runs: generated, then sliced and BPipe-transformed, and checked. No torch.

`build_schedule` is the one entry point: the runtime (pipeline/stages.py, training/loop.py), the planner, the
trials and the tools (pipeline/show.py, benchmarks) all ask it; generators.generate (a named schedule,
untransformed) is its first step. ZB-1p and ZB-2p are searched for per-stage times: the plan's
(`PipelineConfig.schedule_times`, written by the planner with the times it simulated), else equal stages; the
search is a pure function of them, so every rank builds the same order."""

from __future__ import annotations

from ..config import PipelineConfig
from ..errors import UsageError
from .bpipe import ActivationLimitError, insert_bpipe
from .checker import check
from .generators import generate
from .schedule import Schedule
from .slicing import slice_microbatches


def _transform(schedule: Schedule, slicing: int = 0, bpipe: bool = False, fit_slicing: bool = False) -> Schedule:
    """Apply micro-batch slicing (first k micro-batches halved), then BPipe, and check the result.

    BPipe cannot always keep every rank within mu_opt when many micro-batches are sliced: then, with
    `fit_slicing` (for --microbatch-slicing auto), slice fewer micro-batches until it can; without, refuse."""
    for k in range(slicing, -1, -1) if fit_slicing else (slicing,):
        sliced = slice_microbatches(schedule, k) if k else schedule
        try:
            result = insert_bpipe(sliced) if bpipe else sliced
        except ActivationLimitError as err:
            if fit_slicing and k:
                continue
            raise UsageError(f"--bpipe with --microbatch-slicing {k}: rank {err.rank} would hold {err.held:g} "
                             f"micro-batches of activations, above mu_opt {err.limit:g}; slice fewer "
                             "micro-batches") from None
        if k or bpipe:
            check(result)
        return result
    raise AssertionError("unreachable")


def build_schedule(pipeline: PipelineConfig, pp: int, slicing: int | None = None) -> Schedule:
    """The schedule of `pipeline` on `pp` ranks. `slicing` replaces an "auto" count (chosen by the caller with
    slicing.choose_slices); with it, slicing may come out smaller if BPipe cannot hold that many halves."""
    auto = pipeline.slicing == "auto"
    k = slicing if slicing is not None else pipeline.slicing
    if k == "auto":
        raise ValueError("slicing 'auto' must be resolved to a count first (slicing.choose_slices)")
    sched = generate(pipeline.schedule, pp, pipeline.num_microbatches, pipeline.virtual_stages,
                     pipeline.schedule_times)
    return _transform(sched, k, pipeline.bpipe, fit_slicing=auto)
