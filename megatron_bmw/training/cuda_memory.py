"""What the CUDA allowance's terms measure to where a profile runs on a GPU (planner/cuda_allowance.py).

Readings of the caching allocator (memory_reserved, memory_allocated, their maxima) and of the device
(mem_get_info) are taken around the profiled steps; `cuda` is torch.cuda or a stand-in with those functions.
  context_bytes                what the device holds outside the allocator in the process that has no NCCL
                               communicator: (total - free) - reserved, after the steps (kernels load lazily)
  allocator_fraction           max reserved / max allocated - 1 over a few micro-batches run as training runs
                               them, from an emptied cache (`steady`; the profile's sweep over unit kinds and
                               micro-batch sizes fragments far more than training: 29-39% against 0.4% on an
                               H100, README "What has run on a GPU"), else over the steps
  nccl_bytes_per_communicator  in a tensor-parallel worker, what it holds outside the allocator beyond the
                               context, over its communicators (the default group and the tp group); the
                               least of the workers (worker 0 shares its GPU with the profiling process)
Other processes on the same GPU would count as context: profile on an idle device.
"""

from __future__ import annotations

TP_WORKER_COMMUNICATORS = 2  # the default group (barriers) and the tensor-parallel group


def reading(cuda, device) -> dict:
    free, total = cuda.mem_get_info(device)
    return {"reserved": int(cuda.memory_reserved(device)), "allocated": int(cuda.memory_allocated(device)),
            "max_reserved": int(cuda.max_memory_reserved(device)),
            "max_allocated": int(cuda.max_memory_allocated(device)), "free": int(free), "total": int(total)}


def outside_allocator(r: dict) -> int:
    return max(0, r["total"] - r["free"] - r["reserved"])


def measured_terms(before: dict, after: dict, tp_workers: list[dict] | None = None,
                   steady: dict | None = None) -> dict:
    """The profile's "cuda_memory": the measured terms and the readings they came from."""
    context = outside_allocator(after)
    fragmented = steady or after
    out = {"context_bytes": float(context),
           "allocator_fraction": max(0.0, fragmented["max_reserved"] / fragmented["max_allocated"] - 1)
           if fragmented["max_allocated"] else 0.0,
           "samples": {"before": before, "after": after, **({"steady": steady} if steady else {})}}
    if tp_workers:
        extra = min(outside_allocator(r) for r in tp_workers) - context  # rank 0 shares its GPU with this process
        out["nccl_bytes_per_communicator"] = max(0.0, extra / TP_WORKER_COMMUNICATORS)
        out["samples"]["tp_workers"] = tp_workers
    return out
