"""benchmarks/megatron_core_scaling.py: the published table read right, the planner run on it, bad input refused."""

import pytest

from benchmarks import megatron_core_scaling as bench

# the MFU column of the published table (per cent of 989 bf16 TFLOP/s), which the teraFLOP/s column must give
PUBLISHED_MFU = {"1.7B": 41, "7.1B": 47, "16B": 49, "32B": 46, "70B": 42, "119B": 43, "177B": 44, "314B": 48,
                 "462B": 47}


def test_table_is_consistent():
    for row in bench.TABLE:
        name, heads, hidden, layers, tp, pp, dp, gpus, batch, tflops = row
        assert tp * pp * dp == gpus and hidden % heads == 0
        assert round(100 * tflops * 1e12 / bench.PEAK) == PUBLISHED_MFU[name]
        # seconds per iteration give back the published rate
        assert bench.megatron_flops(batch, layers, hidden) / bench.measured_seconds(row) / gpus == \
            pytest.approx(tflops * 1e12)


def test_rows_run_and_the_search_is_no_slower_than_the_stated_plan(capsys):
    rows = [r for r in bench.TABLE if r[0] in ("1.7B", "70B")]
    for row in rows:
        out = bench.run_row(row, tuned=True)
        assert out["stated_fits"]
        assert 0.5 < out["stated_s"] / out["measured_s"] < 2
        # the stated plan (micro-batch 1, 1F1B) is in the searched space, so the pick is at least as fast
        assert out["tuned_s"] <= out["stated_s"] * (1 + 1e-9)
    assert bench.main(["--rows", "1.7B", "--no-tuned"]) == 0
    text = capsys.readouterr().out
    assert " 1.7B " in text and "median |error|" in text


def test_bad_rows_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--rows", "3B"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--rows" in err[0] and "3B" in err[0]


def test_strong_scaling_ends_are_the_177b_row_at_other_data_parallel_sizes():
    base = next(r for r in bench.TABLE if r[0] == "177B")
    ends = bench.strong_rows()
    assert [r[0] for r in ends] == ["177B@96", "177B@4608"]
    for row, mfu in zip(ends, (47, 42)):
        assert row[1:6] == base[1:6] and row[8] == base[8]  # model, tp, pp and global batch of the 177B row
        assert row[4] * row[5] * row[6] == row[7]
        assert round(100 * row[9] * 1e12 / bench.PEAK) == mfu
    # the row in the table lies between the two ends in scale and in MFU
    assert ends[0][7] < base[7] < ends[1][7] and ends[1][9] < base[9] < ends[0][9]
