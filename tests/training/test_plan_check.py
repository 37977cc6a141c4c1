"""--plan's checks: the activation store (the CPU's memory measure) tracks only the warm-up iterations the time
check skips, since its saved-tensor hooks cost host time; the time is the median of the untracked ones."""

from types import SimpleNamespace

import pytest

from megatron_bmw.training.loop import Trainer, build_trainer
from megatron_bmw.training.plan_check import plan_check_lines, warmup_iterations
from tests.dist_harness import run_distributed

GPT = ["--mock-data", "--vocab-size", "64", "--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2",
       "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "1", "--global-batch-size", "4",
       "--lr", "1e-3", "--log-interval", "100", "--eval-iters", "0", "--make-vocab-size-divisible-by", "4"]


def _tracked_trainer(argv: list[str]) -> Trainer:
    probe = build_trainer(argv)
    return Trainer(probe.run, probe.state, track_memory=True)


def test_warmup_iterations():
    assert [warmup_iterations(n) for n in (0, 1, 2, 4, 8, 19, 20, 100)] == [0, 0, 1, 1, 2, 4, 5, 5]


def test_plan_run_tracks_activations_in_the_warmup_only():
    trainer = _tracked_trainer(GPT + ["--train-iters", "12"])
    assert trainer.tracked_iterations == 3 and trainer.engine.store is not None
    stores = []
    for _ in range(12):
        trainer.train_step()
        stores.append(trainer.engine.store is not None)
    assert stores == [True] * 3 + [False] * 9  # the first engine ran three iterations, new ones the rest
    assert trainer.activation_peak > 0
    params = sum(p.numel() * p.element_size() for _, p in trainer.named_params)
    states = params + trainer.grad_sync.buffer_bytes() + trainer.optimizer.state_bytes()
    assert trainer.memory_in_use() == states + trainer.activation_peak  # the tracked peak still counts
    trainer.step_times = [9.0] * 3 + [1.0] * 9  # tracked iterations are slow: none reaches the median
    plan = SimpleNamespace(prediction={"iteration_time_s": 1.0, "stages": []})
    assert plan_check_lines(trainer, plan) == [
        " plan check | iteration time predicted 1.0000 s, measured 1.0000 s (median of 9 iterations after 3 "
        "warm-up) | error +0.0%"]


def test_activation_memory_log_and_ramp_up_track_every_iteration():
    logged = _tracked_trainer(GPT + ["--train-iters", "12", "--log-activation-memory"])
    assert logged.tracked_iterations == 12
    logged.step_times = [2.0] * 3 + [1.0] * 9  # all tracked: the usual warm-up, not all but the last
    plan = SimpleNamespace(prediction={"iteration_time_s": 1.0, "stages": []})
    assert "(median of 9 iterations after 3 warm-up)" in plan_check_lines(logged, plan)[0]
    ramp = _tracked_trainer(GPT + ["--train-iters", "12", "--rampup-batch-size", "2", "2", "8"])
    assert ramp.tracked_iterations == 12  # a later, larger batch may hold more activations


def test_run_without_plan_tracks_nothing():
    trainer = build_trainer(GPT + ["--train-iters", "2"])
    assert trainer.tracked_iterations == 0 and trainer.engine.store is None


def _bpipe_case(rank, world_size, track):
    from megatron_bmw.training.loop import Trainer

    probe = build_trainer(GPT + ["--num-layers", "4", "--global-batch-size", "8", "--train-iters", "6",
                                 "--pipeline-model-parallel-size", "4", "--bpipe"])
    trainer = Trainer(probe.run, probe.state, track_memory=track) if track else probe
    engines = []
    for _ in range(6):
        trainer.train_step()
        engines.append(trainer.engine)
    return [h[1] for h in trainer.history], [id(e) for e in engines], engines[0].transfers is not None, \
        trainer.tracked_iterations


@pytest.mark.slow
def test_bpipe_ranks_keep_their_engine_when_tracking_stops():
    """BPipe's engines hold the store for their transfers: they run on; other ranks' engines drop it."""
    plain = run_distributed(4, _bpipe_case, False)
    tracked = run_distributed(4, _bpipe_case, True)
    for _, ids, transfers, warm in tracked:
        assert warm == 1
        assert len(set(ids)) == (1 if transfers else 2)
    assert any(t for _, _, t, _ in tracked) and not all(t for _, _, t, _ in tracked)
    assert tracked[-1][0] == pytest.approx(plain[-1][0], rel=1e-6)


def _load(start, end, seconds=60.0, own=1, cores=2):
    return {"cores": cores, "start": [start, start, start], "end": [end, end, end], "seconds": seconds, "own": own}


def test_the_check_names_a_load_unlike_the_profiles(monkeypatch):
    """A CPU plan on a busy machine ran 2-3x its prediction with no word: the check sets other work's runnable
    tasks per core during the run (its load averages less its own ranks' threads) beside its profile's, in one line
    where they differ by more than 0.5; none where they agree or the profile recorded no load."""
    import os

    from megatron_bmw.training import plan_check

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(plan_check, "own_threads", lambda: 2)
    quiet = SimpleNamespace(prediction={"iteration_time_s": 1.0, "stages": []},
                            profiles=[{"device_type": "cpu", "load": _load(0.1, 1.0)}])  # 0.1 + 0.37 over 2 cores
    trainer = SimpleNamespace(state=SimpleNamespace(device=__import__("torch").device("cpu"), pp_size=1, pp_rank=0),
                              step_times=[1.0] * 8, tracked_iterations=0, memory_in_use=lambda: 0.0)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 5.0, 4.0))  # the end of a run on a busy machine
    lines = plan_check_lines(trainer, quiet, [4.0, 4.0, 4.0], 30.0)
    assert len(lines) == 2 and lines[1].startswith(" plan check | load: other work kept 2.30 tasks per core"), lines
    assert "0.12 during its profile's: the machine was busier than when its profile was measured" in lines[1]
    assert "expect the run slower than predicted" in lines[1]
    monkeypatch.setattr(os, "getloadavg", lambda: (1.0, 0.5, 0.2))  # its own two ranks' rise, nothing else
    assert len(plan_check_lines(trainer, quiet, [0.2, 0.2, 0.2], 30.0)) == 1
    busy = SimpleNamespace(prediction=quiet.prediction, profiles=[{"load": _load(4.0, 4.0)}])
    assert "idler than when its profile was measured" in plan_check_lines(trainer, busy, [0.2, 0.2, 0.2], 30.0)[1]
    unrecorded = SimpleNamespace(prediction=quiet.prediction, profiles=[{"device_type": "cpu"}])
    assert len(plan_check_lines(trainer, unrecorded, [4.0, 4.0, 4.0], 30.0)) == 1
    assert len(plan_check_lines(trainer, quiet)) == 1  # no start reading: no load line
