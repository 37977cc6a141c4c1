"""--plan auto: a run searched for 4 ranks, stopped, resumes on 2 with a new plan and the same losses; bad input is
one line (exit code 2), a world too small says how many GPUs the model needs."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

from megatron_bmw.arguments import run_config_from_argv
from megatron_bmw.errors import UsageError
from megatron_bmw.training import replan
from megatron_bmw.training.plan_summary import plan_block
from tests.dist_harness import run_distributed

CPU_CLUSTER = ("name: cpu-ranks\ninter_node: {bandwidth_GBps: 1, latency_us: 50}\n"
               "device_types: {cpu: {memory_gb: 4, peak_tflops: {fp32: 0.02}}}\n"
               "groups: [{nodes: 1, gpus_per_node: 2, device: cpu, intra_node: {bandwidth_GBps: 1, latency_us: 50}}]\n")
GPT = ["--mock-data", "--vocab-size", "128", "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
       "--seq-length", "32", "--global-batch-size", "16", "--lr", "1e-3", "--lr-warmup-iters", "2", "--log-interval",
       "1", "--eval-iters", "0", "--make-vocab-size-divisible-by", "4", "--attention-backend", "unfused",
       "--hidden-dropout", "0", "--attention-dropout", "0", "--seed", "7", "--train-iters", "8"]


def _cluster(tmp_path, memory_gb: float = 4) -> str:
    path = tmp_path / f"cpu{memory_gb}.yaml"
    path.write_text(CPU_CLUSTER.replace("memory_gb: 4", f"memory_gb: {memory_gb}"))
    return str(path)


def _auto(tmp_path, *extra) -> list[str]:
    return GPT + ["--plan", "auto", "--plan-cluster", _cluster(tmp_path), *extra]


def _train(rank, world_size, argv):
    from megatron_bmw.training.pretrain import pretrain

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = pretrain(argv)
    return trainer.history, out.getvalue()


@pytest.mark.slow
def test_stopped_on_4_ranks_resumes_on_2_with_a_new_plan_and_the_same_losses(tmp_path):
    """4 ranks train 8 iterations; 4 ranks stop at 4 (saving torch_dist); 2 ranks resume with --plan auto: their
    losses and grad norms are the uninterrupted run's. The plan changes (dp 2 -> 1, twice the samples per replica) and
    the restart prints it beside the checkpoint's."""
    ckpt = str(tmp_path / "ckpt")
    argv = _auto(tmp_path, "--plan-space", "pp=2")
    full = run_distributed(4, _train, argv)[-1][0]
    saved = ["--save", ckpt, "--load", ckpt, "--ckpt-format", "torch_dist"]
    first = run_distributed(4, _train, argv + saved + ["--exit-interval", "4"])
    old = json.load(open(os.path.join(ckpt, replan.PLAN_FILE)))
    resumed = run_distributed(2, _train, argv + saved)
    assert [h[0] for h in first[-1][0]] == [1, 2, 3, 4] and [h[0] for h in resumed[-1][0]] == [5, 6, 7, 8]
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(first[-1][0] + resumed[-1][0], full):
        assert loss == pytest.approx(ref_loss, rel=1e-3, abs=0), it
        assert norm == pytest.approx(ref_norm, rel=1e-3, abs=0), it
    new = json.load(open(os.path.join(ckpt, replan.PLAN_FILE)))
    assert old["parallel"]["data_parallel_size"] == 2 and new["parallel"]["data_parallel_size"] == 1
    per_replica = lambda plan: plan["pipeline"]["num_microbatches"] * plan["pipeline"]["micro_batch_size"]  # noqa: E731
    assert per_replica(new) == 2 * per_replica(old)  # the same global batch on half the replicas
    printed = resumed[0][1]
    assert "> --plan auto: searched 2 ranks of cluster cpu-ranks (analytic unit times)" in printed
    assert re.search(r"^> \* ranks\s+4\s+-> 2$", printed, re.M), printed
    assert "> * tp x pp x dp      1 x 2 x 2" in printed and "predicted s/iter" in printed
    assert "> --plan auto" not in resumed[1][1]  # rank 0 alone prints it


def _request(tmp_path, *extra, world: int = 1):
    """The PlanRequest the flags make (the search hook stops there)."""
    got = []

    def stop(request):
        got.append(request)
        raise UsageError("stop")

    with pytest.raises(UsageError, match="^stop$"):
        run_config_from_argv(list(extra), world, plan_search=stop)
    return got[0]


def test_the_request_carries_the_model_batch_and_world(tmp_path):
    request = _request(tmp_path, *_auto(tmp_path, "--plan-space", "pp=2", "--plan-space", "mbs=1"), world=4)
    assert request.world_size == 4 and request.global_batch_size == 16 and request.orig_vocab_size == 128
    assert request.auto.plan_space == ["pp=2", "mbs=1"] and request.model.num_layers == 4
    plan = replan.plan_or_refusal(replan.search_inputs(request))
    assert (plan.spec.pp, plan.spec.dp, plan.spec.pipeline.micro_batch_size) == (2, 2, 1)
    assert plan.global_batch_size == 16
    text = "\n".join(plan_block(plan))
    assert ">   tp x pp x dp      1 x 2 x 2" in text


@pytest.mark.parametrize("extra,needle", [
    (["--plan", "auto", "--plan-cluster", "h100-80g-ib", "--tensor-model-parallel-size", "2"],
     r"^--tensor-model-parallel-size: --plan auto chooses the layout for the ranks it finds; drop the flag \(restrict "
     r"it with --plan-space tp=N\)$"),
    (["--plan", "auto"], r"^--plan auto needs --plan-profile FILE .* or --plan-cluster NAME\|YAML"),
    (["--plan", "auto", "--plan-cluster", "local"], r"^--plan auto needs --plan-profile FILE"),
])
def test_plan_auto_without_what_it_needs_is_one_line(extra, needle):
    with pytest.raises(UsageError, match=needle):
        run_config_from_argv(GPT + extra, 1, plan_search=lambda request: None)


def test_plan_auto_needs_a_global_batch_and_the_entry_point():
    argv = [a for a in GPT if a not in ("--global-batch-size", "16")] + ["--plan", "auto", "--plan-cluster", "x"]
    with pytest.raises(UsageError, match=r"^--plan auto needs --global-batch-size"):
        run_config_from_argv(argv, 1, plan_search=lambda request: None)
    with pytest.raises(UsageError, match=r"^--plan auto searches at start-up: run it through pretrain_gpt.py"):
        run_config_from_argv(GPT + ["--plan", "auto", "--plan-cluster", "x"], 1)


@pytest.mark.parametrize("content,needle", [
    (None, r"^--plan-profile {path}: no such file$"),
    ("{not json", r"^--plan-profile {path}: not valid JSON \(line 1\)$"),
    ('{"format": 0}', r"^--plan-profile {path}: not a format-\d+ profile written by autoconfig.py profile$"),
])
def test_a_missing_or_corrupt_profile_is_one_line(tmp_path, content, needle):
    path = tmp_path / "prof.json"
    if content is not None:
        path.write_text(content)
    request = _request(tmp_path, *GPT, "--plan", "auto", "--plan-profile", str(path))
    with pytest.raises(UsageError, match=needle.format(path=path)):
        replan.search_inputs(request)


@pytest.mark.parametrize("extra,needle", [
    (["--plan-cluster", "nowhere.yaml"], r"^--plan-cluster nowhere.yaml: "),
    (["--plan-cluster", "h100-80g-ib", "--plan-space", "tp"], r"^--plan-space 'tp': expected DIM=VALUES"),
    (["--plan-cluster", "h100-80g-ib", "--save", "{ckpt}"], r"^--plan auto saves a checkpoint any layout loads: add "
                                                            r"--ckpt-format torch_dist \(got torch\)$"),
])
def test_a_bad_cluster_space_or_format_is_one_line(tmp_path, extra, needle):
    extra = [x.format(ckpt=tmp_path / "ckpt") for x in extra]
    request = _request(tmp_path, *GPT, "--plan", "auto", *extra)
    with pytest.raises(UsageError, match=needle):
        replan.search_inputs(request)


def test_a_world_too_small_says_how_many_gpus_the_model_needs(tmp_path):
    big = ["--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length", "64",
           "--vocab-size", "1000", "--global-batch-size", "16", "--mock-data", "--plan", "auto"]
    small = tmp_path / "small.yaml"
    small.write_text(CPU_CLUSTER.replace("memory_gb: 4", "memory_gb: 2").replace("fp32: 0.02", "fp32: 10"))
    request = _request(tmp_path, *big, "--plan-cluster", str(small))
    with pytest.raises(UsageError, match=r"^--plan auto: the model does not fit on 1 rank of cluster cpu-ranks; it "
                                         r"needs 2 GPUs \(tp 1 x pp 2 x dp 1 fits on 2; nothing fits on 1\)$"):
        replan.plan_or_refusal(replan.search_inputs(request))
    tiny = tmp_path / "tiny.yaml"
    tiny.write_text(CPU_CLUSTER.replace("memory_gb: 4", "memory_gb: 0.05"))
    request = _request(tmp_path, *big, "--plan-cluster", str(tiny), world=2)
    with pytest.raises(UsageError, match=r"^--plan auto: the model does not fit on 2 ranks of cluster cpu-ranks, nor "
                                         r"on up to \d+ \(a smaller --global-batch-size or model"):
        replan.plan_or_refusal(replan.search_inputs(request))


def test_an_unreadable_earlier_plan_is_a_warning_not_an_error(tmp_path):
    path = tmp_path / replan.PLAN_FILE
    assert replan.previous_plan(None) == (None, None)
    assert replan.previous_plan(str(path)) == (None, f"no earlier plan at {path}")
    path.write_text("{")
    plan, note = replan.previous_plan(str(path))
    assert plan is None and note.startswith("WARNING: the earlier plan is unreadable, not compared (")


@pytest.mark.slow
def test_pretrain_gpt_says_how_many_gpus_in_one_line_and_exits_2(tmp_path):
    small = tmp_path / "small.yaml"
    small.write_text(CPU_CLUSTER.replace("memory_gb: 4", "memory_gb: 2").replace("fp32: 0.02", "fp32: 10"))
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, os.path.join(root, "pretrain_gpt.py"), "--mock-data", "--vocab-size", "1000",
                          "--num-layers", "8", "--hidden-size", "1024", "--num-attention-heads", "8", "--seq-length",
                          "64", "--global-batch-size", "16", "--plan", "auto", "--plan-cluster", str(small)],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 2, out.stderr
    assert out.stderr.splitlines() == ["error: --plan auto: the model does not fit on 1 rank of cluster cpu-ranks; it "
                                       "needs 2 GPUs (tp 1 x pp 2 x dp 1 fits on 2; nothing fits on 1)"]
