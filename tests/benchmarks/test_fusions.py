"""benchmarks/fusions.py: a tiny run of each variant keeps what the memory model counts, byte for byte, the fused
ops keep less, and the gradients agree with the unfused model; bad input is one line, exit 2."""

import pytest

from benchmarks import fusions


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] in {name for name, _ in fusions.VARIANTS}:
            rows[cells[0]] = cells
    return rows


@pytest.mark.parametrize("dtype, tol", [("fp32", 1e-6), ("bf16", 2e-2)])
def test_each_variant_keeps_what_the_memory_model_counts(capsys, dtype, tol):
    assert fusions.main(["--hidden", "128", "--layers", "1", "--seq", "32", "--mbs", "2", "--vocab", "512",
                         "--rounds", "1", "--dtype", dtype]) == 0
    rows = _rows(capsys.readouterr().out)
    assert list(rows) == [name for name, _ in fusions.VARIANTS]
    saved = {name: float(cells[3]) for name, cells in rows.items()}
    assert all(cells[3] == cells[4] for cells in rows.values()), rows  # measured == modelled
    assert saved["swiglu+rope"] < saved["unfused"]
    assert (saved["all (+cross entropy)"] < saved["swiglu+rope"]) == (dtype == "bf16")  # fp32 logits: same bytes
    assert all(float(cells[5]) <= tol for cells in rows.values())


@pytest.mark.parametrize("args, message", [
    (["--rounds", "0"], "--rounds: must be >= 1"),
    (["--hidden", "200"], "--hidden 200: needs an even number of 64-wide heads"),
    (["--device", "cuda:x"], "--device cuda:x: not a device"),
])
def test_bad_input_is_one_line(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        fusions.main(args)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
