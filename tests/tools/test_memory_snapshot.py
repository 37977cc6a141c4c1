"""tools/memory_snapshot.py: a snapshot's peaks and the allocator model's replay; bad input is one line, exit 2."""

import importlib.util
import json
import os
import pickle

import pytest

from tests.training.test_memory_history import END, MiB, TRACE, snapshot

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("memory_snapshot", os.path.join(ROOT, "tools", "memory_snapshot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_tool_prints_the_peaks_and_bad_input_is_one_line(tmp_path, capsys):
    tool = _tool()
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(snapshot(TRACE, END)))
    assert tool.main([str(path), "--json", str(tmp_path / "s.json")]) == 0
    out = capsys.readouterr().out
    assert "peak allocated 0.017 GiB, peak reserved 0.039 GiB: allocator overhead 135.3%" in out
    assert "most requested sizes (MiB x count): 9.00 x 1, 8.00 x 1, 6.00 x 1" in out
    assert tool.main([str(path), "--replay"]) == 0  # TRACE is what the allocator does: the model agrees
    out = capsys.readouterr().out
    assert "allocator model: peak reserved 0.039 GiB in 2 segments" in out
    assert "recorded 0.039 GiB in 2 segments: the same segments" in out
    trace_file = tmp_path / "allocator_trace.json"
    trace_file.write_text(json.dumps({"events": [[0, 4 * MiB, 0], [1, 4 * MiB, 8]]}))
    listed, negative = tmp_path / "list.json", tmp_path / "negative.json"
    listed.write_text("[]")
    negative.write_text(json.dumps({"events": [[0, -5, 2], [1, 3, 2]]}))
    for argv, message in (([str(tmp_path / "none.pickle")], "cannot read the memory snapshot"),
                          ([str(path), "--device", "1"], "no recorded events on device 1"),
                          ([str(trace_file)], "takes --replay"),
                          ([str(trace_file), "--replay"], "cannot replay: event 1: a free at 0x8"),
                          ([str(listed), "--replay"], "no (code, size, address) events to replay"),
                          ([str(negative), "--replay"], "event 0 [0, -5, 2] is not (code, size >= 0")):
        with pytest.raises(SystemExit) as info:
            tool.main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err


class _Poison:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("mode", ["main", pytest.param("process", marks=pytest.mark.slow)])
def test_a_crafted_snapshot_runs_nothing(tmp_path, capsys, mode):
    """A snapshot is plain data: a pickle naming a global (here os.system, run by a crafted __reduce__) is one line,
    exit 2, before anything in it runs; in this process and as a command."""
    import subprocess
    import sys

    marker = tmp_path / "ran"
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[_Poison(str(marker))]]}))
    if mode == "process":
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "memory_snapshot.py"), str(path)],
                              capture_output=True, text=True, timeout=120)
        code, err = proc.returncode, proc.stderr
    else:
        with pytest.raises(SystemExit) as info:
            _tool().main([str(path)])
        code, err = info.value.code, capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err
    assert "names the global posix.system" in lines[0] and str(path) in lines[0]
    assert not marker.exists()
