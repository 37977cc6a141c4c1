"""The sweep's table names its memory columns for what they hold: the peak tensor bytes, and on the CPU the
process's peak resident memory, which the trial entry writes and the log parser reads."""

from __future__ import annotations

from megatron_bmw.trials.logparse import parse_log
from megatron_bmw.trials.report import table


def _record(i: int, log: str) -> dict:
    summary = parse_log(log)
    peak = max(s.get("peak_allocated", 0.0) for s in summary.stage_memory.values())
    return {"id": f"t{i}", "status": "ok", "median_iteration_s": 0.5, "tokens_per_s": 100.0,
            "label": f"mbs{i}", "peak_memory_bytes": peak, "stage_memory": summary.stage_memory}


def test_cpu_trials_show_their_peak_resident_memory():
    logs = [" trial memory | rank 0 | stage 0 | peak allocated 2621440 | peak rss 419430400",
            " trial memory | rank 0 | stage 0 | peak allocated 2621440 | peak rss 524288000"]
    text = table([_record(i, log) for i, log in enumerate(logs, 1)], {})
    header, first, second = text.splitlines()[:3]
    assert "peak alloc" in header and "peak RSS" in header
    assert first.split()[-2:] == ["2.5M", "400.0M"] and second.split()[-1] == "500.0M"
    assert "peak RSS: its process's peak resident memory" in text


def test_gpu_trials_have_no_rss_column():
    log = " trial memory | rank 0 | stage 0 | peak allocated 2147483648 | peak reserved 3221225472 | device used 1"
    text = table([_record(1, log)], {})
    assert "peak RSS" not in text and text.splitlines()[1].split()[-1] == "2.00G"
