"""benchmarks/moe_vs_dense.py and moe_planner_vs_grid.py: a tiny MoE-against-dense run prints its table; every
layout of the planner-vs-grid benchmark's grid is one pretrain_gpt.py accepts on its 4 ranks (bad input:
test_cli_errors.py)."""

import pytest

from benchmarks import moe_planner_vs_grid as grid
from benchmarks import moe_vs_dense
from megatron_bmw.arguments import configs_from_args, parse_args


def test_the_grid_layouts_start_on_four_ranks():
    labels = set()
    for layout in grid.GRID:
        run = configs_from_args(parse_args(grid.MODEL + grid.grid_flags(*layout)), grid.WORLD)
        tp, pp, ep, dispatcher = layout
        par = run.parallel
        assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size, par.expert_model_parallel_size) \
            == (tp, pp, ep)
        assert run.model.moe.token_dispatcher_type == dispatcher and run.model.moe.num_experts == 8
        labels.add(grid.grid_label(*layout))
    assert len(labels) == len(grid.GRID)  # no layout twice
    assert {ep for _, _, ep, _ in grid.GRID} == {1, 2, 4} and {d for *_, d in grid.GRID} == set(grid.DISPATCHERS)


@pytest.mark.slow
def test_a_tiny_moe_against_dense_run_prints_its_table(capsys):
    assert moe_vs_dense.main(["--hidden", "32", "--heads", "2", "--experts", "4", "--expert-ffn", "32", "--seq", "16",
                              "--micro-batch-size", "1", "--rounds", "1", "--repeats", "1", "--ranks", "1", "2"]) == 0
    out = capsys.readouterr().out
    rows = [ln for ln in out.splitlines() if ln.startswith("| 1 ") or ln.startswith("| 2 ")]
    assert len(rows) == 4 and sum("allgather" in r for r in rows) == 2 and sum("alltoall" in r for r in rows) == 2
    assert "active parameters per token: dense 4192, MoE 4352" in out
