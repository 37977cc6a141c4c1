"""`pretrain_gpt.py` and `pretrain_bert.py`: parse Megatron flags once, set up, train."""

from __future__ import annotations

import gc
import os
import sys
import time

import torch
import torch.distributed as dist

from ..arguments import run_config_from_argv
from ..data.tokenizers import build_tokenizer
from ..device import choose_backend
from ..errors import UsageError, exit_on_usage_error
from ..fused import HAVE_APEX, HAVE_TE
from ..parallel.state import ParallelState, init_distributed
from ..planner.profile_data import load_now
from ..paths import check_output_dir, check_output_file
from ..pipeline.slicing import num_sliced
from . import memory_history
from .logging import format_validation_log
from .plan_check import plan_check_lines
from .replan import agreed_plan
from .loop import Trainer, count_parameters, print_first, print_last


@exit_on_usage_error
def main(argv: list[str] | None = None, model_type: str = "gpt") -> None:
    trainer = pretrain(list(sys.argv[1:] if argv is None else argv), model_type)
    trainer.state.destroy()
    del trainer
    gc.collect()  # free the groups now: a gloo group destroyed during interpreter shutdown can abort the process
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def pretrain(argv: list[str], model_type: str = "gpt") -> Trainer:
    """Everything main does inside the process group (which it leaves to the caller); model_type "bert" takes
    pretrain_bert.py's flags."""
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1")))
    parsed = run_config_from_argv(argv, world, model_type, tokenizer_from=build_tokenizer, plan_search=agreed_plan)
    run, plan, tokenizer = parsed.run, parsed.plan, parsed.tokenizer
    check_output_dir("--save", run.train.save)
    check_output_dir("--ckpt-convert-save", run.train.ckpt_convert_save)
    check_output_dir("--tensorboard-dir", run.train.tensorboard_dir)
    check_output_file("--pipeline-trace", run.train.pipeline_trace)
    if run.train.record_memory_history:
        if choose_backend(run.train.distributed_backend) != "nccl":
            raise UsageError("--record-memory-history records the CUDA caching allocator: it needs a GPU (the nccl "
                             "backend), and this run is on the CPU")
        check_output_file("--memory-snapshot-path", run.train.memory_snapshot_path)
    init_distributed(run.train.distributed_backend, run.train.distributed_timeout_minutes)
    state = ParallelState.build(run.parallel, timeout_minutes=run.train.distributed_timeout_minutes,
                                num_units=run.model.num_units)
    if run.train.record_memory_history:  # from start-up, so the parameters' and optimizer's blocks are in it
        memory_history.start(torch.cuda)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    _banner(run, state, parsed)
    if plan is not None:
        print_first(state, f"> running plan {parsed.plan_path} (predicted {plan.prediction.get('iteration_time_s', 0):.4f} s "
                           "per iteration)")
    load_start, started = load_now(), time.monotonic()  # the plan check sets the machine's load beside the profile's
    trainer = Trainer(run, state, tokenizer, track_memory=plan is not None)
    if state.dp_rank == 0:
        print(f" > number of parameters on (tensor, pipeline) model parallel rank ({state.tp_rank}, {state.pp_rank}): "
              f"{count_parameters(trainer)}", flush=True)
    _describe_pipeline(trainer, state)
    trainer.load()
    if run.train.ckpt_convert_format is not None:  # Megatron's conversion: save in the other format and stop
        trainer.convert_checkpoint()
        trainer.finish()
        return trainer
    print_first(state, "training ...")
    trainer.train()
    if run.train.eval_iters > 0 and not trainer.exited_early:  # Megatron: the validation set, then the test set
        for data, split in ((trainer.valid_data, "validation"), (trainer.test_data, "test")):
            if data is not None:
                trainer.evaluate(data, run.train.eval_iters)
                print_last(state, format_validation_log(trainer.iteration, trainer.eval_losses,
                                                        label=f"iteration {trainer.iteration} on {split} set"))
    trainer.finish()
    if plan is not None:
        trainer.plan_check = plan_check_lines(trainer, plan, load_start, time.monotonic() - started)
        print_first(state, "\n".join(trainer.plan_check))
    return trainer


def _describe_pipeline(trainer, state: ParallelState) -> None:
    extras = []
    if trainer.run.pipeline.bpipe:
        extras.append("BPipe activation balancing on")
        node = trainer.run.parallel.gpus_per_node
        if node is None:  # default: the local world size (torchrun sets it), else one node for everything
            node = int(os.environ.get("LOCAL_WORLD_SIZE", state.layout.world_size))
        split = state.layout.split_pairs(node)
        if split:
            extras.append(f"WARNING: {len(split)} BPipe pairs span two nodes (e.g. ranks {split[0]}); "
                          "their transfers use the slower inter-node links")
    k = num_sliced(trainer.schedule)
    if k:
        extras.append(f"micro-batch slicing: the first {k} micro-batches run as halves")
    print_first(state, f"> pipeline partition (units per stage): {','.join(map(str, trainer.partition))}"
                + "".join(f"\n> {e}" for e in extras))


def _banner(run, state: ParallelState, parsed) -> None:
    t, pl = run.train, run.pipeline
    lines = [
        f"> initialized tensor model parallel with size {state.tp_size}",
        f"> initialized pipeline model parallel with size {state.pp_size}",
        f"> initialized data parallel with size {state.dp_size}",
        f"> backend {dist.get_backend() if dist.is_initialized() else 'none'}, device {state.device}, "
        f"dtype {run.model.torch_dtype}, apex {'yes' if HAVE_APEX else 'no'}, transformer-engine "
        f"{'yes' if HAVE_TE else 'no'}",
        f"> micro-batch size {pl.micro_batch_size}, global batch size {t.global_batch_size}, "
        f"micro-batches per iteration {pl.num_microbatches}, schedule "
        + (f"1f1b interleaved x{pl.virtual_stages}" if pl.schedule == "interleaved" else pl.schedule),
        f"> padded vocab (size: {run.orig_vocab_size}) with {run.model.vocab_size - run.orig_vocab_size} dummy "
        f"tokens (new size: {run.model.vocab_size})",
    ]
    for kind, flags in (("kernel or implementation choice", parsed.ignored_kernel_flags),
                        ("logging not written here", parsed.ignored_logging_flags)):
        if flags:
            lines.append(f"> ignored Megatron flags ({kind}): {' '.join(flags)}")
    if run.model.moe is not None:
        lines.insert(3, f"> initialized expert model parallel with size {state.ep_size}, expert tensor parallel "
                        f"with size {state.etp_size}")
    lines += parsed.notes
    print_first(state, "\n".join(lines))
