"""--ckpt-format torch_dist: a checkpoint saved on one layout resumes on any other exactly (losses and grad norms of
the continued run equal the source layout's own continuation), atomic saves, clear errors."""

import os
import shutil

import pytest

from megatron_bmw.training.loop import build_trainer
from tests.dist_harness import run_distributed

GPT = ["--mock-data", "--vocab-size", "128", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3",
       "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
       "--make-vocab-size-divisible-by", "4", "--attention-backend", "unfused", "--hidden-dropout", "0",
       "--attention-dropout", "0", "--seed", "7", "--lr-decay-iters", "8"]
TP, PP = "--tensor-model-parallel-size", "--pipeline-model-parallel-size"
ZERO1 = "--use-distributed-optimizer"
# name: (world size, flags); 4 layers = 10 units
LAYOUTS = {
    "serial": (1, []),
    "tp2-pp2-sp": (4, [TP, "2", PP, "2", "--sequence-parallel"]),
    "pp2-v2-cut": (2, [PP, "2", "--num-layers-per-virtual-pipeline-stage", "1", "--pipeline-partition", "2,3,3,2"]),
    "dp2-zero1": (2, [ZERO1]),
    "pp4-bpipe-sliced": (4, [PP, "4", "--bpipe", "--microbatch-slicing", "2"]),
    "tp2": (2, [TP, "2"]),
    "dp4": (4, []),
    "pp2-dp2-zero1": (4, [PP, "2", ZERO1]),
    # per-unit strategies over a stage's 2 ranks, FSDP2-sharded units (sdp2) among them
    "hybrid-pp2": (4, [PP, "2", "--unit-strategies", "tp2,dp2,sdp2,tp2,dp2,sdp2,tp2,dp2,sdp2,tp2"]),
}
NAMES = list(LAYOUTS)
LAYOUTS["tp2-dp2-zero1"] = (4, [TP, "2", ZERO1])  # only the Llama resume: ZeRO-1 pieces of SwiGLU's stride-2 fc1
# 9 of the 72 ordered pairs: each layout resumes from one other and is resumed by another (the cyclic shift 4 over
# NAMES: tp and pp, ZeRO-1, BPipe and hybrid strategies meet); MBMW_ALL_LAYOUT_PAIRS=1 runs all 72
_SHIFTS = range(1, len(NAMES)) if os.environ.get("MBMW_ALL_LAYOUT_PAIRS") == "1" else (4,)
PAIRS = [(a, NAMES[(i + k) % len(NAMES)]) for i, a in enumerate(NAMES) for k in _SHIFTS]


LLAMA = ["--position-embedding-type", "rope", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
         "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
         "--ffn-hidden-size", "48"]
BERT = ["--mock-data", "--vocab-size", "96", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--make-vocab-size-divisible-by", "4", "--attention-backend", "unfused", "--hidden-dropout", "0",
        "--attention-dropout", "0"]


def _train(rank, world_size, argv, model_type="gpt"):
    trainer = build_trainer(argv, model_type=model_type)
    trainer.train()
    trainer.finish()
    return trainer.history


def _train_logged(rank, world_size, argv, model_type):
    """(history, the lines this rank printed about re-seeding)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = _train(rank, world_size, argv, model_type)
    return history, [ln for ln in out.getvalue().splitlines() if "re-seeded" in ln]


def _run(layout: str, extra: list[str], base=GPT, model_type="gpt", reseeded: int | None = None):
    """The last rank's history; `reseeded`: how many re-seed lines all ranks together must print."""
    world, flags = LAYOUTS[layout]
    results = run_distributed(world, _train_logged, base + flags + extra, model_type)
    if reseeded is not None:
        lines = [ln for _, rank_lines in results for ln in rank_lines]
        assert len(lines) == reseeded, lines
        assert all("torch and model-parallel-rng" in ln for ln in lines), lines
    return results[-1][0]


def _checkpoint_at(src_dir: str, iteration: int, dst_dir: str) -> str:
    """A checkpoint directory whose tracker names `iteration` of `src_dir`."""
    name = f"iter_{iteration:07d}"
    shutil.copytree(os.path.join(src_dir, name), os.path.join(dst_dir, name))
    with open(os.path.join(dst_dir, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))
    return dst_dir


def _same(hist, ref, what):
    assert [h[0] for h in hist] == [h[0] for h in ref], what
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5, abs=0), (what, it)
        assert norm == pytest.approx(ref_norm, rel=1e-4, abs=0), (what, it)


@pytest.mark.slow
def test_resume_on_any_layout(tmp_path):
    """Every layout trains 6 iterations saving torch_dist at 4; for each pair (PAIRS), B resumes from A's iteration 4
    and its next two iterations (the second one after an optimizer step on the loaded state) are A's."""
    refs, ckpts = {}, {}
    for name in NAMES:
        ckpts[name] = str(tmp_path / name)
        refs[name] = _run(name, ["--train-iters", "6", "--save", ckpts[name], "--save-interval", "4",
                                 "--ckpt-format", "torch_dist"])
        assert [h[0] for h in refs[name]] == list(range(1, 7))
        assert os.path.isfile(os.path.join(ckpts[name], "iter_0000004", ".metadata"))
    for src, dst in PAIRS:
        start = _checkpoint_at(ckpts[src], 4, str(tmp_path / f"{src}-to-{dst}"))
        resumed = _run(dst, ["--train-iters", "6", "--load", start], reseeded=1)  # the layouts differ
        _same(resumed, refs[src][4:6], f"{src} -> {dst}")


@pytest.mark.slow
@pytest.mark.parametrize("model,src,dsts", [
    ("llama", "tp2", ["serial", "pp2-v2-cut", "tp2-dp2-zero1"]),  # SwiGLU's stride-2 fc1, grouped QKV, untied
    ("llama", "serial", ["tp2-pp2-sp"]),
    ("llama", "tp2-dp2-zero1", ["serial"]),
    ("bert", "tp2-pp2-sp", ["serial", "dp2-zero1"]),
])
def test_resume_llama_and_bert_on_other_layouts(tmp_path, model, src, dsts):
    base, model_type = (GPT + LLAMA, "gpt") if model == "llama" else (BERT, "bert")
    ckpt = str(tmp_path / "src")
    ref = _run(src, ["--train-iters", "8", "--save", ckpt, "--save-interval", "4", "--ckpt-format", "torch_dist"],
               base, model_type)
    for dst in dsts:
        start = _checkpoint_at(ckpt, 4, str(tmp_path / dst))
        _same(_run(dst, ["--train-iters", "8", "--load", start], base, model_type), ref[4:], f"{model} {src} -> {dst}")


def test_tensor_parallel_chunks_tile_the_full_tensor():
    """A shard's chunks sit at its global offsets: SwiGLU's stride-2 fc1 as a part of each block, a row-parallel
    weight along dim 1; over the ranks they tile the full tensor exactly."""
    import torch

    from megatron_bmw.parallel.init import shard
    from megatron_bmw.training.dist_chunks import slices_of

    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    for dim, stride in ((0, 2), (0, 1), (1, 1)):
        rebuilt = torch.full_like(full, -1.0)
        for rank in range(2):
            local = shard(full, dim, rank, 2, stride)
            p = torch.nn.Parameter(local.clone())
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
            s = slices_of(p, local, rank, 2)
            assert tuple(s.size()) == (8, 6) and len(s.chunks) == stride
            for off, t in s.chunks:
                rebuilt[tuple(slice(o, o + n) for o, n in zip(off, t.shape))] = t
        assert torch.equal(rebuilt, full), (dim, stride)


def _error_of(argv):
    from megatron_bmw.errors import UsageError

    with pytest.raises(UsageError) as info:
        build_trainer(argv)
    return str(info.value)


def test_other_model_refused_in_one_line(tmp_path):
    """A tensor of another shape is named with both shapes; another architecture names the setting."""
    ckpt = str(tmp_path / "ckpt")
    small = GPT[:GPT.index("--num-layers")] + GPT[GPT.index("--hidden-size"):] + ["--num-layers", "1"]
    _train(0, 1, small + ["--train-iters", "3", "--save", ckpt, "--ckpt-format", "torch_dist"])
    wider = [a if a != "32" else "48" for a in small] + ["--train-iters", "4", "--load", ckpt]
    msg = _error_of(wider)
    assert msg.startswith(f"--load {ckpt}: model tensor ") and "(48" in msg and "(32" in msg, msg
    assert "\n" not in msg
    msg = _error_of(small + ["--train-iters", "4", "--load", ckpt, "--swiglu"])
    assert msg == (f"--load {ckpt}: checkpoint has swiglu = False, this run True (another model; a torch_dist "
                   "checkpoint reshards the layout only)")
    # a truncated .metadata is named, as a truncated common file is (probe, session 12: an UnpicklingError); as an
    # older checkpoint, without checksums.json (which would name it first: test_checkpoint_integrity.py)
    cut = str(tmp_path / "cut")
    shutil.copytree(ckpt, cut)
    os.remove(os.path.join(cut, "iter_0000003", "checksums.json"))
    metadata = os.path.join(cut, "iter_0000003", ".metadata")
    with open(metadata, "rb") as f:
        head = f.read(100)
    with open(metadata, "wb") as f:
        f.write(head)
    msg = _error_of(small + ["--train-iters", "4", "--load", cut])
    assert msg.startswith(f"--load {cut}: cannot read {metadata} (") and "\n" not in msg, msg
    os.remove(metadata)
    msg = _error_of(small + ["--train-iters", "4", "--load", cut])
    assert msg == (f"--load {cut}: {os.path.dirname(metadata)} holds torch_dist shards (__0_0.distcp, ...) but no "
                   ".metadata (an incomplete copy?)"), msg
    shutil.copy(os.path.join(ckpt, "iter_0000003", ".metadata"), metadata)
    shard = os.path.join(cut, "iter_0000003", "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    msg = _error_of(small + ["--train-iters", "4", "--load", cut])
    assert msg.startswith(f"--load {cut}: cannot read the tensors in {os.path.dirname(metadata)} ("), msg


_KILL_CHILD = """
import os, sys, time
import megatron_bmw.training.checkpoint_dir as cd
from megatron_bmw.training.loop import build_trainer
where, marker = sys.argv[1], sys.argv[2]
calls = []
def hang(*a, **k):
    calls.append(1)
    if len(calls) == 2:  # the second save: stop dead here
        open(marker, "w").close()
        time.sleep(600)
if where == "publish":
    orig_move = cd.move_into_place
    def move(*a, **k):
        hang()
        return orig_move(*a, **k)
    cd.move_into_place = move
else:
    from torch.distributed.checkpoint import filesystem
    orig_write = filesystem.FileSystemWriter.write_data
    def write_data(self, plan, planner):
        fut = orig_write(self, plan, planner)
        fut.wait()
        hang()
        return fut
    filesystem.FileSystemWriter.write_data = write_data
trainer = build_trainer(sys.argv[3:])
trainer.train()
"""


@pytest.mark.slow
@pytest.mark.parametrize("where", ["write", "publish"])
def test_kill_during_save_keeps_previous_checkpoint(tmp_path, where):
    """kill -9 while DCP writes the shards, or between the write and the rename: the tracker and the previous
    checkpoint stay, and it loads; the next save clears the debris."""
    import signal
    import subprocess
    import sys
    import time

    ckpt, marker = str(tmp_path / "ckpt"), str(tmp_path / "marker")
    argv = GPT + ["--train-iters", "4", "--save", ckpt, "--save-interval", "2", "--ckpt-format", "torch_dist"]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=root)
    child = subprocess.Popen([sys.executable, "-c", _KILL_CHILD, where, marker, *argv], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not os.path.exists(marker) and child.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert os.path.exists(marker), f"the child never reached the second save (exit {child.poll()})"
    child.send_signal(signal.SIGKILL)
    child.wait()
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read() == "2"
    assert any(".tmp-" in e for e in os.listdir(ckpt))  # the killed save's debris
    trainer = build_trainer(GPT + ["--train-iters", "3", "--load", ckpt, "--save", ckpt, "--ckpt-format",
                                   "torch_dist"])
    assert trainer.iteration == 2 and trainer.consumed_train == 32
    trainer.train()
    assert sorted(os.listdir(ckpt)) == ["iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]


def test_schedule_scaler_and_data_position_carry_over(tmp_path):
    """fp16 with a growing loss scale: the loaded run has the saved scale, LR schedule, step, iteration, consumed
    samples and (same layout) RNG streams."""
    import torch

    ckpt = str(tmp_path / "ckpt")
    argv = GPT + ["--fp16", "--initial-loss-scale", "256", "--loss-scale-window", "1", "--hidden-dropout", "0.1"]
    saved = build_trainer(argv + ["--train-iters", "3", "--save", ckpt, "--ckpt-format", "torch_dist"])
    saved.train()
    streams = torch.get_rng_state(), saved.state.rng.get_states()
    loaded = build_trainer(argv + ["--train-iters", "4", "--load", ckpt])
    assert saved.optimizer.loss_scale == loaded.optimizer.loss_scale > 256
    assert loaded.scheduler.state_dict() == saved.scheduler.state_dict()
    assert loaded.optimizer.get_lr() == saved.optimizer.get_lr()
    assert (loaded.iteration, loaded.consumed_train, loaded.optimizer._step_count) == (3, 48, 3)
    assert torch.equal(torch.get_rng_state(), streams[0])
    assert all(torch.equal(loaded.state.rng.states[k], v) for k, v in streams[1].items())


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_changed_train_iters_stop_the_load_unless_a_scheduler_flag_says(tmp_path, fmt):
    """Megatron's continued-training flags, with either format."""
    ckpt = str(tmp_path / "ckpt")
    argv = [a for a in GPT if a not in ("--lr-decay-iters", "8")] + ["--num-layers", "1"]
    _train(0, 1, argv + ["--train-iters", "3", "--save", ckpt, "--ckpt-format", fmt])
    msg = _error_of(argv + ["--train-iters", "5", "--load", ckpt])
    assert msg.startswith(f"--load {ckpt}: the checkpoint's learning-rate schedule has lr_decay_steps = 48, this "
                          "run 80 (samples:"), msg
    kept = build_trainer(argv + ["--train-iters", "5", "--load", ckpt, "--use-checkpoint-opt_param-scheduler"])
    assert kept.scheduler.lr_decay_steps == 48 and kept.iteration == 3
    mine = build_trainer(argv + ["--train-iters", "5", "--load", ckpt, "--override-opt_param-scheduler"])
    assert mine.scheduler.lr_decay_steps == 80 and mine.scheduler.num_steps == 48
    msg = _error_of(argv + ["--train-iters", "5", "--override-opt_param-scheduler",
                            "--use-checkpoint-opt_param-scheduler"])
    assert "mutually exclusive" in msg


def _plans_case(rank, world_size, tmp):
    """Plan A (tp2 pp2 + SP) trains 8 iterations saving torch_dist at 4; plan B (pp2 dp2, ZeRO-1, a sub-layer
    cut) resumes A's iteration 4 with --plan B --load."""
    import torch.distributed as dist

    from megatron_bmw.config import ModelConfig, PipelineConfig
    from megatron_bmw.planner.plan import Plan
    from megatron_bmw.planner.spec import RunSpec
    from megatron_bmw.training.pretrain import pretrain

    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
                        max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                        attention_backend="unfused")
    specs = {"a": RunSpec.of(model=model, tp=2, pp=2, dp=1, sequence_parallel=True,
                          pipeline=PipelineConfig(micro_batch_size=2, num_microbatches=8)),
             "b": RunSpec.of(model=model, tp=1, pp=2, dp=2, distributed_optimizer=True,
                          pipeline=PipelineConfig(micro_batch_size=2, num_microbatches=4, partition=(4, 6)))}
    paths = {k: os.path.join(tmp, f"plan_{k}.json") for k in specs}
    if rank == 0:
        for k, spec in specs.items():
            Plan(spec=spec, global_batch_size=16, orig_vocab_size=128, make_vocab_size_divisible_by=4).save(paths[k])
    dist.barrier()
    flags = ["--mock-data", "--train-iters", "8", "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-iters", "8",
             "--log-interval", "1", "--eval-iters", "0", "--seed", "7"]
    ckpt = os.path.join(tmp, "a")
    a = pretrain(flags + ["--plan", paths["a"], "--save", ckpt, "--save-interval", "4", "--ckpt-format", "torch_dist"])
    dist.barrier()
    if rank == 0:
        _checkpoint_at(ckpt, 4, os.path.join(tmp, "a4"))
    dist.barrier()
    b = pretrain(flags + ["--plan", paths["b"], "--load", os.path.join(tmp, "a4")])
    return a.history, b.history, (b.state.tp_size, b.state.pp_size, b.state.dp_size)


@pytest.mark.slow
def test_a_changed_plan_resumes_the_checkpoint(tmp_path):
    results = run_distributed(4, _plans_case, str(tmp_path))
    a, b, sizes = results[-1]
    assert sizes == (1, 2, 2)
    _same(b, a[4:], "plan a -> plan b")


def _convert_case(rank, world_size, argv):
    import contextlib
    import io

    from megatron_bmw.training.pretrain import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = pretrain(argv)
    return trainer.history, [ln for ln in out.getvalue().splitlines() if "converted checkpoint" in ln]


@pytest.mark.slow
def test_convert_between_formats(tmp_path):
    """Megatron's --ckpt-convert-format/--ckpt-convert-save: a serial legacy checkpoint becomes torch_dist (and
    trains on exactly on tp2), which becomes a legacy tp2 checkpoint (and trains on exactly)."""
    legacy = str(tmp_path / "legacy")
    ref = run_distributed(1, _train, GPT + ["--train-iters", "6", "--save", legacy, "--save-interval", "3"])[0]
    start = _checkpoint_at(legacy, 3, str(tmp_path / "legacy3"))
    conv = str(tmp_path / "conv")
    history, lines = run_distributed(1, _convert_case, GPT + ["--train-iters", "6", "--load", start,
                                                              "--ckpt-convert-format", "torch_dist",
                                                              "--ckpt-convert-save", conv])[0]
    assert history == [] and lines == ["> converted checkpoint: torch -> torch_dist."]
    dist_dir = os.path.join(conv, "torch_dist")
    assert os.path.isfile(os.path.join(dist_dir, "iter_0000003", ".metadata"))
    tp2 = LAYOUTS["tp2"][1]
    _same(run_distributed(2, _train, GPT + tp2 + ["--train-iters", "6", "--load", dist_dir])[-1], ref[3:],
          "torch -> torch_dist -> tp2")
    back = str(tmp_path / "back")
    lines = run_distributed(2, _convert_case, GPT + tp2 + ["--train-iters", "6", "--load", dist_dir,
                                                           "--ckpt-convert-format", "torch", "--ckpt-convert-save",
                                                           back])[0][1]
    assert lines == ["> converted checkpoint: torch_dist -> torch."]
    assert os.path.isfile(os.path.join(back, "torch", "iter_0000003", "mp_rank_01", "model_optim_rng.pt"))
    _same(run_distributed(2, _train, GPT + tp2 + ["--train-iters", "6", "--load", os.path.join(back, "torch")])[-1],
          ref[3:], "torch_dist -> torch tp2")


def test_legacy_reader_names_a_torch_dist_checkpoint(tmp_path):
    """Tools that read the legacy format (converters) get one line saying how to convert."""
    from megatron_bmw.errors import UsageError
    from megatron_bmw.parallel.state import ParallelState
    from megatron_bmw.training.checkpointing import load_checkpoint

    ckpt = str(tmp_path / "ckpt")
    small = GPT[:GPT.index("--num-layers")] + GPT[GPT.index("--hidden-size"):] + ["--num-layers", "1"]
    _train(0, 1, small + ["--train-iters", "3", "--save", ckpt, "--ckpt-format", "torch_dist"])
    with pytest.raises(UsageError, match="is a torch_dist checkpoint; this reads the legacy torch format"):
        load_checkpoint(ckpt, ParallelState.serial())


def _embedding_case(rank, world_size, argv):
    """(this rank's word-embedding shard and its Adam exp_avg, after loading; the lines about padding)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = build_trainer(argv)
    names = trainer.optimizer.names
    i = names.index("units.embedding.word_embeddings.weight")
    exp_avg = trainer.optimizer._inner.state[trainer.optimizer._masters[i]]["exp_avg"].clone()
    weight = trainer.chunks[0].units["embedding"].word_embeddings.weight.detach().clone()
    return weight, exp_avg, [ln for ln in out.getvalue().splitlines() if "vocabulary padding" in ln]


@pytest.mark.slow
def test_vocabulary_padding_follows_the_tensor_parallel_size(tmp_path):
    """Vocabulary 100 pads to 104 rows at tp2 and stays 100 at tp1 (--make-vocab-size-divisible-by 4): a tp2
    checkpoint loads into tp1 with its first 100 rows (weights and Adam state), a tp1 one into tp2 with the 4
    padded rows at zero."""
    import torch
    import torch.distributed.checkpoint as dcp

    vocab = [a if a != "128" else "100" for a in GPT] + ["--train-iters", "3", "--ckpt-format", "torch_dist"]
    tp2 = LAYOUTS["tp2"][1]
    keys = ("model.embedding.word_embeddings.weight", "optimizer.state.exp_avg.embedding.word_embeddings.weight")

    def saved(where, rows):
        out = {k: torch.empty(rows, 32) for k in keys}
        dcp.load(out, checkpoint_id=os.path.join(where, "iter_0000003"), no_dist=True)
        return [out[k] for k in keys]

    wide, narrow = str(tmp_path / "tp2"), str(tmp_path / "tp1")
    run_distributed(2, _train, vocab + tp2 + ["--save", wide])
    run_distributed(1, _train, vocab + ["--save", narrow])
    weight, exp_avg, lines = run_distributed(1, _embedding_case, vocab + ["--load", wide])[0]
    assert lines == [" vocabulary padding: the checkpoint has 104 rows, this run 100 (Megatron pads to a multiple of "
                     "--make-vocab-size-divisible-by x tp): its padded rows beyond 100 are dropped"]
    w, m = saved(wide, 104)
    assert torch.equal(weight, w[:100]) and torch.equal(exp_avg, m[:100])
    back = run_distributed(2, _embedding_case, vocab + tp2 + ["--load", narrow])
    assert back[0][2] == [" vocabulary padding: the checkpoint has 100 rows, this run 104 (Megatron pads to a "
                          "multiple of --make-vocab-size-divisible-by x tp): padded rows beyond 100 start at zero"]
    w, m = saved(narrow, 100)
    for got, want in ((torch.cat([b[0] for b in back]), w), (torch.cat([b[1] for b in back]), m)):
        assert torch.equal(got[:100], want) and not got[100:].any()


@pytest.mark.parametrize("dim,stride", [(0, 2), (0, 1), (1, 1), (None, 1)])
def test_zero1_pieces_tile_the_full_tensor(dim, stride):
    """ZeRO-1 flat ranges of every tp shard (partial rows, whole rows, a range crossing SwiGLU's gate | up
    boundary) placed as boxes: over the tp ranks and ranges they tile the full tensor exactly."""
    import torch

    from megatron_bmw.parallel.init import shard
    from megatron_bmw.training.dist_chunks import piece_slices

    full = torch.arange(8 * 6, dtype=torch.float32).view(8, 6)
    tp = 1 if dim is None else 2
    rebuilt = torch.full_like(full, -1.0)
    for rank in range(tp):
        local = shard(full, dim, rank, tp, stride)
        p = torch.nn.Parameter(local.clone())
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = dim is not None, dim, stride
        for start, end in ((0, 5), (5, 13), (13, 14), (14, local.numel())):  # odd cuts, as ZeRO's shards fall
            s = piece_slices(p, start, end, local.reshape(-1)[start:end].clone(), rank, tp)
            assert tuple(s.size()) == (8, 6)
            for off, t in s.chunks:
                region = rebuilt[tuple(slice(o, o + n) for o, n in zip(off, t.shape))]
                assert (region == -1).all()  # no overlap
                region.copy_(t)
    assert torch.equal(rebuilt, full)


def test_a_bf16_checkpoint_resumes_in_fp32_from_its_masters(tmp_path):
    """fp32 weights are their own masters: resuming a bf16 run in fp32 reads the saved fp32 masters, not the
    rounded bf16 weights."""
    import torch

    ckpt = str(tmp_path / "ckpt")
    small = GPT[:GPT.index("--num-layers")] + GPT[GPT.index("--hidden-size"):] + ["--num-layers", "1"]
    bf16 = build_trainer(small + ["--bf16", "--train-iters", "3", "--save", ckpt, "--ckpt-format", "torch_dist"])
    bf16.train()
    masters = [m.detach().clone() for m in bf16.optimizer._masters]
    fp32 = build_trainer(small + ["--train-iters", "4", "--load", ckpt])
    assert [n for n, _ in fp32.named_params] == bf16.optimizer.names
    for (name, p), m, half in zip(fp32.named_params, masters, bf16.optimizer.params):
        assert p.dtype == torch.float32 and torch.equal(p.detach(), m), name
        assert not torch.equal(p.detach(), half.detach().float()) or p.numel() < 64, name  # not the rounded copy
