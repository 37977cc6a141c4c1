"""Log parsing on real trial logs (tests/trials/data, written by real 2-rank runs) and on the variants the
iteration line takes (with and without the timestamp prefix, added fields, torchrun's rank prefix)."""

import os

import pytest

from megatron_bmw.trials.logparse import parse_iteration, parse_log

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")


def _log(name: str):
    with open(os.path.join(DATA, name)) as f:
        return parse_log(f.read())


def test_real_pipeline_trial():
    s = _log("pp2_trial.log")
    assert [it["iteration"] for it in s.iterations] == [1, 2, 3, 4, 5, 6]
    assert s.iterations[0]["elapsed_ms"] == 692.6 and s.iterations[0]["global_batch_size"] == 4
    assert s.iteration_times(2) == pytest.approx([0.0486, 0.0632, 0.06, 0.0623])
    assert s.median_iteration_s(2) == pytest.approx(0.06115)
    assert s.stage_memory == {0: {"peak_allocated": 350720.0}, 1: {"peak_allocated": 335360.0}}
    assert s.peak_memory_bytes == 350720.0
    assert not s.oom and s.error is None


def test_real_plan_trial_with_plan_check():
    s = _log("plan_trial.log")
    assert len(s.iterations) == 6
    assert s.plan_check["predicted_s"] == 0.0377 and s.plan_check["measured_s"] == 0.1277
    stage = s.plan_check["stages"][0]
    assert stage["measured_bytes"] == pytest.approx(12.33 * 2**20) and stage["capacity_bytes"] > 2**30
    assert s.peak_memory_bytes == 12924164.0  # the entry's exact figure before the plan check's rounded one
    assert s.over_capacity == []


def test_real_crash_keeps_the_rank_own_error():
    s = _log("crash_trial.log")
    assert s.iterations == []
    assert s.error == ("error: rank 0: /nonexistent/corpus_text_document.idx: no such file "
                       "(data prefix '/nonexistent/corpus_text_document')")


@pytest.mark.parametrize("prefix", ["", " [2026-11-23 06:08:27]", "[rank3]: [2026-11-23 06:08:27]"])
def test_iteration_line_variants(prefix):
    line = (f"{prefix} iteration       40/     300 | consumed samples:         1280 | elapsed time per iteration (ms): "
            "701.4 | throughput per GPU (TFLOP/s/GPU): 123.4 | learning rate: 3.000000E-04 | global batch size:    32 "
            "| lm loss: 6.652419E+00 | loss scale: 1.0 | grad norm: 0.279 | number of skipped iterations:   0 | "
            "number of nan iterations:   0 |")
    it = parse_iteration(line)
    assert it["iteration"] == 40 and it["train_iters"] == 300 and it["elapsed_ms"] == 701.4
    assert it["throughput_per_gpu_tflop_s_gpu"] == 123.4 and it["lm_loss"] == pytest.approx(6.652419)
    assert it["global_batch_size"] == 32 and it["consumed_samples"] == 1280


def test_oom_over_capacity_and_megatron_memory_lines():
    text = "\n".join([
        " [2026-01-01 00:00:01] iteration        1/       4 | elapsed time per iteration (ms): 10.0 |",
        "[Rank 0] (after 1 iterations) memory (MB) | allocated: 100.0 | max allocated: 2048.0 | reserved: 3000.0",
        " plan check | stage 1 | memory predicted 70.00 GiB, measured 81.000 GiB (+15.7%) | capacity 80.000 GiB",
        "Traceback (most recent call last):",
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    ])
    s = parse_log(text)
    assert s.oom and s.over_capacity == [1]
    assert s.stage_memory[-1]["max_allocated"] == 2048 * 2**20
    assert s.error.startswith("torch.OutOfMemoryError: CUDA out of memory")
    assert s.median_iteration_s(3) == 0.01  # nothing after warm-up: every iteration counts


def test_a_memory_line_with_another_ranks_line_glued_on():
    """Ranks share the trial log: rank 1's iteration line once landed before rank 0's newline (seen in CI)."""
    text = (" trial memory | rank 0 | stage 0 | peak allocated 350720 [2026-11-25 04:50:36] iteration        4/"
            "       4 | consumed samples:           16 | elapsed time per iteration (ms): 21.4 | learning rate: "
            "0.000000E+00 | global batch size:     4 | lm loss: 5.551847E+00 | loss scale: 1.0 | grad norm: 1.050 | "
            "number of skipped iterations:   0 | number of nan iterations:   0 |\n"
            " trial memory | rank 1 | stage 1 | peak allocated 335360\n")
    summary = parse_log(text)
    assert summary.stage_memory[0]["peak_allocated"] == 350720 and summary.stage_memory[1]["peak_allocated"] == 335360
