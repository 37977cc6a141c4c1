"""Save and load time of a training checkpoint: --ckpt-format torch (Megatron's legacy per-rank files) against
torch_dist (torch.distributed.checkpoint), on gloo ranks of this machine, after one training step (so the Adam
moments exist). torch_dist is also loaded into another layout (pp instead of tp), which torch cannot do.

    python benchmarks/ckpt_formats.py [--num-layers 24 --hidden-size 1024 --nproc 2 --dir /tmp/ckpt_bench]
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

from benchmarks.args import UsageError, count, exit_on_usage_error, output_dirs, parser  # noqa: E402
from benchmarks.common import format_table, run_gloo  # noqa: E402


def _model(args) -> list[str]:
    return ["--mock-data", "--vocab-size", "50304", "--num-layers", str(args.num_layers), "--hidden-size",
            str(args.hidden_size), "--num-attention-heads", str(args.hidden_size // 64), "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--lr", "1e-4", "--train-iters", "1", "--log-interval", "1", "--eval-iters", "0",
            "--attention-backend", "unfused"]


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _case(rank: int, world_size: int, args) -> dict:
    from megatron_bmw.training.loop import build_trainer

    model = _model(args)
    n = str(world_size)
    trainer = build_trainer(model + ["--tensor-model-parallel-size", n])
    trainer.train()
    out = {"params": sum(p.numel() for _, p in trainer.named_params) * world_size}
    for fmt in ("torch", "torch_dist"):
        where = os.path.join(args.dir, fmt)
        trainer.run = replace(trainer.run, train=replace(trainer.run.train, save=where, ckpt_format=fmt))
        out[f"save {fmt}"] = _timed(trainer.save)
        out[f"bytes {fmt}"] = _size(where) if rank == 0 else 0
    for fmt in ("torch", "torch_dist"):
        trainer.run = replace(trainer.run, train=replace(trainer.run.train, load=os.path.join(args.dir, fmt)))
        out[f"load {fmt}"] = _timed(trainer.load)
    trainer.state.destroy()
    del trainer
    gc.collect()
    other = build_trainer(model + ["--pipeline-model-parallel-size", n])
    other.run = replace(other.run, train=replace(other.run.train, load=os.path.join(args.dir, "torch_dist")))
    out["load torch_dist into pp"] = _timed(other.load)
    other.state.destroy()
    return out


@exit_on_usage_error
def main() -> None:
    p = parser(__doc__)
    p.add_argument("--num-layers", type=count(1), default=24)
    p.add_argument("--hidden-size", type=count(64), default=1024, help="a head per 64")
    p.add_argument("--nproc", type=count(1), default=2)
    p.add_argument("--dir", default="/tmp/megatron_bmw_ckpt_bench")
    args = p.parse_args()
    heads = args.hidden_size // 64  # as _model gives them
    if args.hidden_size % heads:
        raise UsageError(f"--hidden-size {args.hidden_size}: not divisible by its {heads} attention heads (one per 64)")
    if heads % args.nproc:
        raise UsageError(f"--nproc {args.nproc}: must divide the {heads} attention heads of --hidden-size "
                         f"{args.hidden_size} (tensor parallel)")
    output_dirs(dir=args.dir)
    shutil.rmtree(args.dir, ignore_errors=True)
    results = run_gloo(_case, args.nproc, args)
    r0 = results[0]
    print(f"GPT {args.num_layers} layers x {args.hidden_size} hidden, {r0['params'] / 1e6:.0f}M parameters, fp32 "
          f"with Adam state, {args.nproc} gloo ranks (tp {args.nproc}); seconds (slowest rank)")
    rows = []
    for fmt in ("torch", "torch_dist"):
        save, load = (max(r[f"{what} {fmt}"] for r in results) for what in ("save", "load"))
        rows.append([fmt, f"{save:.2f}", f"{load:.2f}", f"{r0[f'bytes {fmt}'] / 2**30:.2f}"])
    rows.append(["torch_dist into pp", "", f"{max(r['load torch_dist into pp'] for r in results):.2f}", ""])
    print(format_table(["format", "save s", "load s", "GiB on disk"], rows))
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
