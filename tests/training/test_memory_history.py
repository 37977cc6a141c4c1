"""--record-memory-history / --memory-snapshot-path (Megatron's flags) and the snapshot summary: the CUDA paths run on
a stand-in for torch.cuda; on the CPU the flag is one line, exit 2."""

import pickle
from types import SimpleNamespace

import pytest

from megatron_bmw.arguments import build_parser, configs_from_args, parse_args
from megatron_bmw.errors import UsageError
from megatron_bmw.training import memory_history
from megatron_bmw.training.pretrain import main as pretrain_main

MiB = 2**20


def snapshot(trace: list[dict], segments: list[dict]) -> dict:
    return {"segments": segments, "device_traces": [trace]}


def _segment(total: int, allocated: list[int]) -> dict:
    blocks = [{"size": n, "state": "active_allocated"} for n in allocated]
    free = total - sum(allocated)
    blocks += [{"size": free, "state": "inactive"}] if free else []
    return {"device": 0, "total_size": total, "blocks": blocks}


# what the caching allocator does: a 20 MiB segment takes 6 and 8 MiB blocks; the 6 MiB one freed, a 9 MiB request
# fits neither free piece (6 MiB, and the 6 MiB tail), so a second 20 MiB segment: peak allocated 17 MiB (8 + 9),
# peak reserved 40 MiB
TRACE = [{"action": "segment_alloc", "size": 20 * MiB, "addr": 0}, {"action": "alloc", "size": 6 * MiB, "addr": 0},
         {"action": "alloc", "size": 8 * MiB, "addr": 6 * MiB},
         {"action": "free_requested", "size": 6 * MiB, "addr": 0},
         {"action": "free_completed", "size": 6 * MiB, "addr": 0},
         {"action": "segment_alloc", "size": 20 * MiB, "addr": 20 * MiB},
         {"action": "alloc", "size": 9 * MiB, "addr": 20 * MiB}]
# the end state: each segment with its live block
END = [_segment(20 * MiB, [8 * MiB]), _segment(20 * MiB, [9 * MiB])]


def test_the_summary_replays_the_trace_back_from_the_segments():
    s = memory_history.summarize(snapshot(TRACE, END))
    assert s["peak_allocated_bytes"] == 17 * MiB and s["peak_reserved_bytes"] == 40 * MiB
    assert s["allocator_fraction"] == pytest.approx(40 / 17 - 1)
    assert s["allocated_end_bytes"] == 17 * MiB and s["counts"] == {"alloc": 3, "free": 1, "segment_alloc": 2,
                                                                  "segment_free": 0, "oom": 0}
    # the trace's first events lost (a trace kept to its last entries): the peaks still come from the end state
    cut = memory_history.summarize(snapshot(TRACE[3:], END))
    assert cut["peak_allocated_bytes"] == 17 * MiB and cut["peak_reserved_bytes"] == 40 * MiB
    assert memory_history.summarize({"segments": []})["allocator_fraction"] is None


def _fake_cuda(snap):
    calls = []
    memory = SimpleNamespace(_snapshot=lambda: snap,
                             _record_memory_history=lambda **kw: calls.append(kw))
    return SimpleNamespace(memory=memory), calls


def test_recording_starts_with_megatrons_entry_limit_and_snapshots_replace_the_file(tmp_path):
    cuda, calls = _fake_cuda(snapshot(TRACE, END))
    memory_history.start(cuda)
    assert calls == [{"max_entries": 100_000}]
    path = tmp_path / "snap.pickle"
    assert memory_history.write_snapshot(str(path), cuda)
    assert pickle.loads(path.read_bytes())["device_traces"][0] == TRACE and not (tmp_path / "snap.pickle.tmp").exists()
    assert memory_history.read_snapshot(str(path))["segments"] == END


def test_an_unwritable_snapshot_is_one_warning_and_training_goes_on(tmp_path, capsys):
    cuda, _ = _fake_cuda(snapshot(TRACE, END))
    assert not memory_history.write_snapshot(str(tmp_path / "missing" / "snap.pickle"), cuda)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: --memory-snapshot-path") and "training goes on" in err[0]


def test_not_a_snapshot_is_one_line(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(b"not a pickle")
    with pytest.raises(UsageError, match="not a memory snapshot"):
        memory_history.read_snapshot(str(bad))
    other = tmp_path / "other.pickle"
    other.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(UsageError, match="no segments"):
        memory_history.read_snapshot(str(other))


def test_the_flags_reach_the_run_config():
    flags = ["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
             "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2", "--global-batch-size", "2",
             "--train-iters", "1"]
    run = configs_from_args(parse_args(flags + ["--record-memory-history", "--memory-snapshot-path", "m.pickle"],
                                       build_parser()), 1)
    assert run.train.record_memory_history and run.train.memory_snapshot_path == "m.pickle"
    default = configs_from_args(parse_args(flags, build_parser()), 1).train
    assert not default.record_memory_history and default.memory_snapshot_path == "snapshot.pickle"


def test_on_the_cpu_the_flag_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setattr("megatron_bmw.training.pretrain.choose_backend", lambda backend: "gloo")
    with pytest.raises(SystemExit) as info:
        pretrain_main(["--mock-data", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
                       "--seq-length", "16", "--vocab-size", "128", "--micro-batch-size", "2",
                       "--global-batch-size", "2", "--train-iters", "1", "--record-memory-history"])
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--record-memory-history records the CUDA caching allocator" in err[0], err
