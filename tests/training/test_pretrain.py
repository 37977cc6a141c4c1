"""pretrain_gpt end to end: exact resume, ZeRO-1 and layouts agree, bf16 close to fp32, Megatron log lines."""

import os
import re
import subprocess
import sys

import pytest

from megatron_bmw.training.loop import build_trainer
from tests.dist_harness import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--lr", "1e-3",
        "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "1",
        "--make-vocab-size-divisible-by", "4", "--attention-backend", "unfused"]
LOG_RE = re.compile(
    r" \[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\] iteration\s+(\d+)/\s*(\d+) \| consumed samples:\s+(\d+) \| elapsed time per iteration \(ms\): ([\d.]+) \| "
    r"learning rate: ([\d.E+-]+) \| global batch size:\s+(\d+) \| lm loss: ([\d.E+-]+) \| loss scale: ([\d.]+) \| "
    r"grad norm: ([\d.]+) \| number of skipped iterations:\s+(\d+) \| number of nan iterations:\s+(\d+) \|")


def iteration_lines(stdout):
    """The training log lines (Megatron's: a ` [date time]` prefix, then ` iteration ...`)."""
    return [ln.split("]", 1)[1] for ln in stdout.splitlines() if ln.startswith(" [") and "] iteration" in ln]


def _layout(tp, pp):
    return ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def _train(rank, world_size, argv):
    trainer = build_trainer(argv)
    trainer.train()
    trainer.finish()
    return trainer.history


def _resume_case(rank, world_size, tp, pp, ckpt):
    argv = BASE + _layout(tp, pp) + ["--train-iters", "6", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    full = _train(rank, world_size, argv)
    first = _train(rank, world_size, argv + ["--save", ckpt, "--exit-interval", "3"])
    second = _train(rank, world_size, argv + ["--save", ckpt, "--load", ckpt])
    return full, first, second


@pytest.mark.slow
@pytest.mark.parametrize("world_size,tp,pp", [(1, 1, 1), (2, 2, 1), (2, 1, 2), (2, 1, 1)])
def test_resume_is_exact(tmp_path, world_size, tp, pp):
    ckpt = str(tmp_path / "ckpt")
    full, first, second = run_distributed(world_size, _resume_case, tp, pp, ckpt)[-1]
    assert [h[0] for h in first] == [1, 2, 3] and [h[0] for h in second] == [4, 5, 6]
    assert [h[1] for h in first + second] == [h[1] for h in full]
    assert full[-1][1] < full[0][1]
    assert os.path.isfile(os.path.join(ckpt, "latest_checkpointed_iteration.txt"))
    sub = "mp_rank_00" if pp == 1 else "mp_rank_00_000"
    assert os.path.isfile(os.path.join(ckpt, "iter_0000006", sub, "model_optim_rng.pt"))


# Megatron's Llama flags (sizes shrunk): rope, SwiGLU, grouped-query attention, RMSNorm, no biases, untied output
LLAMA_FLAGS = ["--position-embedding-type", "rope", "--rotary-base", "500000", "--swiglu", "--group-query-attention",
               "--num-query-groups", "2", "--normalization", "RMSNorm", "--disable-bias-linear",
               "--untie-embeddings-and-output-weights", "--ffn-hidden-size", "48", "--kv-channels", "8",
               "--attention-softmax-in-fp32", "--norm-epsilon", "1e-5"]


@pytest.mark.slow
def test_llama_flags_train_alike_on_every_layout_and_resume(tmp_path):
    """Llama-family layers through pretrain_gpt.py's flags: serial, tp2 + SP, pp2 with a sub-layer cut, dp2 ZeRO-1
    and pp2 x dp2 ZeRO-1 give the same losses and grad norms; a run stopped and resumed continues exactly."""
    llama = LLAMA_FLAGS + ["--num-layers", "4"]
    serial = run_distributed(1, _layouts_case, llama)[0]
    runs = {
        "tp2-sp": run_distributed(2, _layouts_case, llama + _layout(2, 1) + ["--sequence-parallel"])[-1],
        "pp2-cut": run_distributed(2, _layouts_case, llama + _layout(1, 2) + ["--pipeline-partition", "4,6"])[-1],
        "dp2-zero1": run_distributed(2, _layouts_case, llama + ["--use-distributed-optimizer"])[-1],
        "pp2-dp2-zero1": run_distributed(4, _layouts_case, llama + _layout(1, 2) + ["--use-distributed-optimizer"])[-1],
    }
    for name, hist in runs.items():
        for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, serial):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, it)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (name, it)
    ckpt = str(tmp_path / "ckpt")
    argv = BASE + llama + _layout(2, 1) + ["--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
    full = run_distributed(2, _train, argv)[-1]
    run_distributed(2, _train, argv + ["--save", ckpt, "--exit-interval", "2"])
    second = run_distributed(2, _train, argv + ["--load", ckpt])[-1]
    assert [h[1] for h in second] == [h[1] for h in full[2:]]


def _layouts_case(rank, world_size, extra):
    # vocabulary 128 needs no padding at tp=1 or 2 (padding changes the softmax, as in Megatron)
    return _train(rank, world_size, BASE + ["--train-iters", "3", "--hidden-dropout", "0", "--attention-dropout", "0",
                                            "--vocab-size", "128"] + extra)


@pytest.mark.slow
def test_layouts_zero1_and_grad_norm_agree():
    serial = run_distributed(1, _layouts_case, [])[0]
    runs = {
        "tp2": run_distributed(2, _layouts_case, _layout(2, 1))[-1],
        "pp2": run_distributed(2, _layouts_case, _layout(1, 2))[-1],
        "dp2": run_distributed(2, _layouts_case, [])[-1],
        "dp2-zero1": run_distributed(2, _layouts_case, ["--use-distributed-optimizer"])[-1],
        "tp2-pp2-zero1": run_distributed(8, _layouts_case, _layout(2, 2) + ["--use-distributed-optimizer"])[-1],
    }
    for name, hist in runs.items():
        for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, serial):
            assert loss == pytest.approx(ref_loss, rel=1e-5), (name, it)
            assert norm == pytest.approx(ref_norm, rel=1e-4), (name, it)


@pytest.mark.slow
def test_bf16_close_to_fp32():
    fp32 = run_distributed(1, _layouts_case, [])[0]
    bf16 = run_distributed(1, _layouts_case, ["--bf16"])[0]
    for (_, a, _), (_, b, _) in zip(fp32, bf16):
        assert b == pytest.approx(a, rel=2e-2)


def _cli(args, env_extra=None, timeout=120):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.slow
def test_cli_log_lines_parse_and_tensorboard(tmp_path):
    tb = tmp_path / "tb"
    out = _cli(BASE + ["--train-iters", "4", "--tensorboard-dir", str(tb), "--eval-interval", "2",
                       "--no-masked-softmax-fusion"])
    assert out.returncode == 0, out.stderr
    lines = [ln for ln in out.stdout.splitlines() if "] iteration" in ln]
    assert len(lines) == 4
    parsed = [LOG_RE.match(ln) for ln in lines]
    assert all(parsed), lines[0]
    assert [int(m.group(1)) for m in parsed] == [1, 2, 3, 4]
    assert int(parsed[-1].group(3)) == 32
    assert "validation loss at iteration 2 | lm loss value:" in out.stdout
    assert "ignored Megatron flags" in out.stdout
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tb))


@pytest.mark.slow
@pytest.mark.parametrize("args,env,needle", [
    (["--global-batch-size", "6", "--micro-batch-size", "4"], {}, "--global-batch-size 6"),
    (["--fp16", "--bf16"], {}, "--fp16 and --bf16"),
    (["--tensor-model-parallel-size", "3"], {"WORLD_SIZE": "3"}, "does not divide --num-attention-heads"),
    (["--tensor-model-parallel-size", "2"], {"WORLD_SIZE": "3"}, "world size 3 is not divisible"),
    (["--no-such-flag"], {}, "unrecognized arguments: --no-such-flag"),
    (["--microbatch-slicing", "1", "--micro-batch-size", "3", "--global-batch-size", "6"], {},
     "--microbatch-slicing needs an even --micro-batch-size"),
    (["--microbatch-slicing", "some"], {}, "--microbatch-slicing 'some'"),
    (["--pipeline-partition", "3,4"], {}, "--pipeline-partition: 2 entries given"),
    (["--plan", "/nonexistent/plan.json"], {}, "--plan /nonexistent/plan.json: no such file"),
    (["--recompute-units", "none,full"], {}, "--recompute-units: 2 entries given, but the model has 6 units"),
])
def test_bad_input_one_line_exit_2(args, env, needle):
    out = _cli(BASE + ["--train-iters", "3"] + args, env)
    assert out.returncode == 2, out.stderr
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.slow
def test_load_without_checkpoint_warns_and_starts_from_scratch(tmp_path):
    """Megatron: --load of a directory without a tracker file warns and trains from random weights."""
    ckpt = str(tmp_path / "ckpt")
    ok = _cli(BASE + ["--train-iters", "3", "--save", ckpt])
    assert ok.returncode == 0, ok.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    for where in (str(empty), str(tmp_path / "missing")):
        out = _cli(BASE + ["--train-iters", "3", "--load", where])
        assert out.returncode == 0, out.stderr
        assert "WARNING: could not find the metadata file" in out.stdout and "start from random" in out.stdout
        assert iteration_lines(out.stdout)[0].startswith(" iteration        1/")
    not_dir = tmp_path / "file.pt"
    not_dir.write_text("x")
    out = _cli(BASE + ["--train-iters", "3", "--load", str(not_dir)])
    assert out.returncode == 2 and "not a directory" in out.stderr and len(out.stderr.strip().splitlines()) == 1
    resumed = _cli(BASE + ["--train-iters", "4", "--load", ckpt, "--save", ckpt,
                           "--use-checkpoint-opt_param-scheduler"])
    assert resumed.returncode == 0 and "successfully loaded checkpoint" in resumed.stdout
    assert iteration_lines(resumed.stdout)[0].startswith(" iteration        4/")


@pytest.mark.slow
def test_load_refuses_what_megatron_refuses_and_starts_a_release_at_zero(tmp_path):
    """Probe, session 12: a folder inside a checkpoint started from random weights (exit 0), and a checkpoint saved
    without RNG state resumed silently; Megatron stops at the latter. A release checkpoint is Megatron's weights
    only, from iteration 0."""
    from megatron_bmw.errors import UsageError

    ckpt = str(tmp_path / "ckpt")
    _train(0, 1, BASE + ["--train-iters", "4", "--exit-interval", "2", "--save", ckpt, "--no-save-rng"])
    import torch  # the padding multiple is in the args, so the converters re-pad for another tp as the run would

    saved = torch.load(os.path.join(ckpt, "iter_0000002", "mp_rank_00", "model_optim_rng.pt"), weights_only=False)
    assert saved["args"]["make_vocab_size_divisible_by"] == 4
    argv = BASE + ["--train-iters", "4"]
    for inside, holds in (("iter_0000002", "mp_rank_00"), ("iter_0000002/mp_rank_00", "model_optim_rng.pt")):
        with pytest.raises(UsageError, match=rf"inside a checkpoint \(it holds {holds}\); give the checkpoint's top"):
            build_trainer(argv + ["--load", os.path.join(ckpt, inside)])
    with pytest.raises(UsageError, match="has no RNG state .saved with --no-save-rng..; load with --no-load-rng"):
        build_trainer(argv + ["--load", ckpt])
    assert build_trainer(argv + ["--load", ckpt, "--no-load-rng"]).iteration == 2
    os.rename(os.path.join(ckpt, "iter_0000002"), os.path.join(ckpt, "release"))
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("release\n")
    assert build_trainer(argv + ["--load", ckpt]).iteration == 0


def _mismatch_case(rank, world_size, ckpt):
    """Every rank meets the mismatch; they agree on it, rank 0 prints it and all stop with code 2."""
    import contextlib
    import io

    from megatron_bmw.errors import Reported

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(Reported) as info:
        build_trainer(BASE + _layout(2, 1) + ["--train-iters", "3", "--load", ckpt])
    return info.value.exit_code, err.getvalue()


@pytest.mark.slow
def test_load_from_other_layout_refused(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    assert _cli(BASE + ["--train-iters", "3", "--save", ckpt]).returncode == 0
    (code0, err0), (code1, err1) = run_distributed(2, _mismatch_case, ckpt)
    assert code0 == code1 == 2 and err1 == ""
    assert err0.startswith("error: rank 0: --load") and "saved with tensor/pipeline parallel sizes (1, 1)" in err0


def _write_corpus(path, docs):
    import json

    with open(path, "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": " ".join(map(str, doc))}) + "\n")


@pytest.mark.slow
def test_train_on_preprocessed_blend(tmp_path):
    """NullTokenizer corpus -> tools/preprocess_data.py -> pretrain_gpt.py with a two-prefix blend and validation."""
    import random

    rng = random.Random(0)
    prefixes = []
    for name in ("a", "b"):
        _write_corpus(tmp_path / f"{name}.jsonl",
                      [[rng.randrange(100) for _ in range(rng.randrange(5, 60))] for _ in range(80)])
        prep = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "preprocess_data.py"), "--input",
                               str(tmp_path / f"{name}.jsonl"), "--output-prefix", str(tmp_path / name),
                               "--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--append-eod"],
                              capture_output=True, text=True, timeout=120)
        assert prep.returncode == 0, prep.stderr
        prefixes.append(str(tmp_path / f"{name}_text_document"))
    data = ["--data-path", "0.3", prefixes[0], "0.7", prefixes[1], "--split", "90,10,0", "--tokenizer-type",
            "NullTokenizer", "--data-cache-path", str(tmp_path / "cache")]
    base = [a for a in BASE if a != "--mock-data"]
    out = _cli(base + data + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "2"])
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("validation loss at iteration") == 3  # at 2 and 4, and after training as Megatron:
    assert out.stdout.count("validation loss at iteration 4 on validation set") == 1
    assert len([ln for ln in out.stdout.splitlines() if LOG_RE.match(ln)]) == 4
    assert os.listdir(tmp_path / "cache")
    # ids beyond the vocabulary are caught when the dataset opens
    bad = _cli(base + ["--data-path", prefixes[0], "--tokenizer-type", "NullTokenizer", "--vocab-size", "50",
                       "--train-iters", "3", "--data-cache-path", str(tmp_path / "cache")])
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr
    missing = _cli(base + ["--data-path", str(tmp_path / "nope"), "--tokenizer-type", "NullTokenizer",
                           "--train-iters", "3"])
    assert missing.returncode == 2 and "nope" in missing.stderr


@pytest.mark.slow
@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_saves_and_exits(tmp_path, signame):
    import signal
    import time

    ckpt = str(tmp_path / "ckpt")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *BASE, "--train-iters", "100000",
                             "--save", ckpt], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=ROOT)
    for line in proc.stdout:
        if "] iteration        2/" in line:
            break
    time.sleep(0.2)
    proc.send_signal(getattr(signal, signame))
    rest, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "successfully saved checkpoint" in rest and "exiting program" in rest
    assert "on test set" not in rest and "Traceback" not in err  # exits right after the save
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert int(f.read()) >= 2


@pytest.mark.slow
def test_pipeline_trace_and_fp16(tmp_path):
    import json

    trace = tmp_path / "trace.json"
    out = _cli(BASE + ["--train-iters", "3", "--fp16", "--initial-loss-scale", "1024", "--pipeline-trace", str(trace)])
    assert out.returncode == 0, out.stderr
    events = [e for e in json.load(open(trace))["traceEvents"] if e.get("ph") == "X"]
    assert {e["args"]["kind"] for e in events} >= {"F", "B"}
    assert all(e["dur"] >= 0 for e in events)
    assert " loss scale: 1024.0 |" in out.stdout


def _features_case(rank, world_size, extra):
    trainer = build_trainer(BASE + _layout(1, 4) + ["--num-layers", "4", "--global-batch-size", "16",
                                                    "--train-iters", "3", "--hidden-dropout", "0",
                                                    "--attention-dropout", "0"] + extra)
    trainer.train()
    stats = trainer.engine.activation_stats() if "--log-activation-memory" in extra else None
    return trainer.history, stats, trainer.schedule.num_microbatches


@pytest.mark.slow
def test_bpipe_and_slicing_through_pretrain_keep_the_losses():
    plain = run_distributed(4, _features_case, [])[-1][0]
    both = run_distributed(4, _features_case, ["--bpipe", "--microbatch-slicing", "2", "--log-activation-memory"])
    for (_, a, na), (_, b, nb) in zip(plain, both[-1][0]):
        assert b == pytest.approx(a, rel=1e-5) and nb == pytest.approx(na, rel=1e-4)
    assert all(stats is not None for _, stats, _ in both)


# ---- plans from the search, run with --plan ------------------------------------------------------------------
PLAN_MODEL = ["--mock-data", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
              "--seq-length", "16", "--vocab-size", "100", "--make-vocab-size-divisible-by", "4",
              "--attention-backend", "unfused", "--hidden-dropout", "0", "--attention-dropout", "0"]


PLAN_LLAMA_FLAGS = ["--position-embedding-type", "rope", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
               "--normalization", "RMSNorm", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
PLAN_LLAMA_MODEL = dict(position_embedding_type="rope", swiglu=True, num_query_groups=2, normalization="RMSNorm",
                   add_bias_linear=False, untie_embeddings_and_output_weights=True)


def _local_plans(world: int, memory_mb: float, top_k: int, tmp_path, **model_kw) -> list[str]:
    from megatron_bmw.config import ModelConfig
    from megatron_bmw.planner.cluster import parse_cluster
    from megatron_bmw.planner.memory_model import MemorySettings
    from megatron_bmw.planner.profile_data import Profiles
    from megatron_bmw.planner.report import plan_from
    from megatron_bmw.planner.search import SearchSettings, search

    cluster = parse_cluster({"name": "cpu-ranks", "inter_node": {"bandwidth_GBps": 1, "latency_us": 50},
                             "device_types": {"cpu": {"memory_gb": memory_mb / 1024, "peak_tflops": {"fp32": 0.02}}},
                             "groups": [{"nodes": 1, "gpus_per_node": world, "device": "cpu",
                                         "intra_node": {"bandwidth_GBps": 1, "latency_us": 50}}]})
    model = ModelConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=100, seq_length=16,
                        hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused", **model_kw)
    result = search(model, 100, 4, 8, cluster, memory=MemorySettings(device="cpu"),
                    settings=SearchSettings(top_k=top_k))
    paths = []
    for i, ranked in enumerate(result.ranked):
        path = str(tmp_path / f"plan{world}_{i}.json")
        plan_from(ranked, result, Profiles(), 100).save(path)
        paths.append(path)
    return paths


def _run_plan(rank, world_size, path, extra=()):
    from megatron_bmw.training.pretrain import pretrain

    trainer = pretrain(PLAN_MODEL + list(extra) + ["--plan", path, "--train-iters", "4", "--lr", "1e-3", "--log-interval", "1",
                                     "--eval-iters", "0"])
    return trainer.plan_check, trainer.memory_in_use(), [h[1] for h in trainer.history]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_search_plans_run_with_plan_and_fit(tmp_path, world_size):
    """Every plan the search emits for a small CPU cluster runs with --plan; per stage the memory measured
    (model states + the activation store's peak) is within the device and close to the prediction."""
    from megatron_bmw.planner.plan import Plan

    paths = _local_plans(world_size, 0.9, 3, tmp_path)  # tight: ZeRO-1, interleaving, recomputation, slicing
    assert paths
    for path in paths:
        plan = Plan.load(path)
        _ran_and_fit(plan, path, run_distributed(world_size, _run_plan, path))


def _ran_and_fit(plan, path, results) -> None:
    """A --plan run's 4 finite losses, its plan check lines, and per stage the tracked memory (model states + the
    activation store's peak) within the device and within 10% of the prediction."""
    lines = results[0][0]
    assert lines[0].startswith(" plan check | iteration time predicted"), lines
    # on the CPU the process's own peak (resident growth) is measured, beside the tensors the run tracks
    assert all("(peak resident growth)" in ln and "| tracked tensors" in ln for ln in lines[1:]), lines
    losses = results[-1][2]
    assert len(losses) == 4 and all(x == x for x in losses)
    for stage in plan.prediction["stages"]:
        measured = max(mem for r, (_, mem, _) in enumerate(results)
                       if plan.spec.rank_layout().coords(r)[2] == stage["stage"])
        assert measured <= stage["capacity_bytes"], (path, stage, measured)
        assert measured == pytest.approx(stage["peak_bytes"] - stage["allowance_bytes"], rel=0.1), (path, stage)


@pytest.mark.slow
def test_searched_llama_plans_run_with_plan_and_fit(tmp_path):
    """A Llama-style model (rope, GQA, SwiGLU, RMSNorm, no biases, untied): the search's plans for 4 CPU ranks run
    with --plan and the Llama flags beside it, within the device and close to the predicted memory."""
    from megatron_bmw.planner.plan import Plan

    paths = _local_plans(4, 0.9, 2, tmp_path, **PLAN_LLAMA_MODEL)
    assert paths
    for path in paths:
        plan = Plan.load(path)
        assert plan.spec.model.swiglu and plan.spec.model.num_query_groups == 2
        _ran_and_fit(plan, path, run_distributed(4, _run_plan, path, PLAN_LLAMA_FLAGS))


PLAN_MOE_FLAGS = ["--num-experts", "8", "--moe-router-topk", "2"]


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher,memory_mb,top_k", [("allgather", 2.5, 3), ("alltoall", 1.5, 2)])
def test_searched_moe_plans_run_with_plan_and_fit(tmp_path, capsys, dispatcher, memory_mb, top_k):
    """A tiny MoE GPT (8 experts, top-2) on 4 CPU ranks: `autoconfig.py search` over tp x dp x ep (one stage) under a
    budget no ep 1 layout fits; its top plans (ep 2 and 4; with tp 2 and 4 and SP at the tighter budget) run with
    --plan and the MoE flags beside it, within the device and close to the predicted memory."""
    import json

    from megatron_bmw.cli.autoconfig import main as autoconfig
    from megatron_bmw.planner.plan import Plan

    cluster = tmp_path / "cpu.yaml"
    cluster.write_text("name: cpu-ranks\ninter_node: {bandwidth_GBps: 1, latency_us: 50}\n"
                       f"device_types: {{cpu: {{memory_gb: {memory_mb / 1024}, peak_tflops: {{fp32: 0.02}}}}}}\n"
                       "groups: [{nodes: 1, gpus_per_node: 4, device: cpu, "
                       "intra_node: {bandwidth_GBps: 1, latency_us: 50}}]\n")
    flags = PLAN_MODEL + PLAN_MOE_FLAGS + ["--moe-token-dispatcher-type", dispatcher]
    search = ["search", *flags, "--global-batch-size", "8", "--cluster", str(cluster), "--memory-device", "cpu",
              "--space", "pp=1", "--no-progress"]
    with pytest.raises(SystemExit) as refused:  # the experts' states need ep > 1 to fit
        autoconfig(search + ["--space", "ep=1"])
    assert refused.value.code == 2 and "no plan fits" in capsys.readouterr().err
    assert autoconfig(search + ["--top-k", str(top_k), "--output-dir", str(tmp_path / "plans"), "--json"]) == 0
    ranked = json.loads(capsys.readouterr().out)["plans"]
    assert all(p["layout"]["ep"] > 1 for p in ranked)
    assert len({p["layout"]["ep"] for p in ranked}) > 1 or {p["layout"]["tp"] for p in ranked} == {2, 4}
    paths = sorted(str(p) for p in (tmp_path / "plans").glob("plan_*.json"))
    assert len(paths) == top_k
    for path in paths:
        plan = Plan.load(path)
        assert plan.spec.ep > 1 and plan.spec.model.moe.token_dispatcher_type == dispatcher
        _ran_and_fit(plan, path, run_distributed(4, _run_plan, path, PLAN_MOE_FLAGS +
                                                 ["--moe-token-dispatcher-type", dispatcher]))


def _run_bert_plan(rank, world_size, path):
    from megatron_bmw.training.pretrain import pretrain

    trainer = pretrain(PLAN_MODEL + ["--plan", path, "--train-iters", "3", "--lr", "1e-3", "--log-interval", "1",
                                     "--eval-iters", "0"], "bert")
    return trainer.plan_check, trainer.memory_in_use(), [h[1] for h in trainer.history]


@pytest.mark.slow
def test_bert_plans_from_autoconfig_run_with_pretrain_bert(tmp_path):
    """autoconfig.py search --model-type bert writes a BERT plan; pretrain_bert.py --plan runs it on 2 ranks
    within the predicted memory, and pretrain_gpt.py refuses it."""
    from megatron_bmw.planner.plan import Plan

    cluster = tmp_path / "cpu.yaml"
    cluster.write_text("name: cpu-ranks\ninter_node: {bandwidth_GBps: 1, latency_us: 50}\n"
                       "device_types: {cpu: {memory_gb: 0.0009, peak_tflops: {fp32: 0.02}}}\n"
                       "groups: [{nodes: 1, gpus_per_node: 2, device: cpu, "
                       "intra_node: {bandwidth_GBps: 1, latency_us: 50}}]\n")
    path = str(tmp_path / "bert_plan.json")
    out = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "autoconfig.py"), "search", "--model-type",
                          "bert", *PLAN_MODEL, "--global-batch-size", "8", "--cluster", str(cluster), "--memory-device",
                          "cpu", "--no-progress", "--output", path], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr
    assert f"pretrain_bert.py --plan {path}" in out.stdout
    plan = Plan.load(path)
    assert plan.spec.model.model_type == "bert"
    results = run_distributed(2, _run_bert_plan, path)
    assert results[0][0][0].startswith(" plan check | iteration time predicted")
    assert len(results[-1][2]) == 3 and all(x == x for x in results[-1][2])
    for stage in plan.prediction["stages"]:
        measured = max(mem for r, (_, mem, _) in enumerate(results)
                       if plan.spec.rank_layout().coords(r)[2] == stage["stage"])
        assert measured <= stage["capacity_bytes"], (stage, measured)
        assert measured == pytest.approx(stage["peak_bytes"] - stage["allowance_bytes"], rel=0.1), stage
    refused = _cli(PLAN_MODEL + ["--plan", path, "--train-iters", "3"], {"WORLD_SIZE": "2"})
    assert refused.returncode == 2 and "planned for a BERT model, this run trains a GPT" in refused.stderr
