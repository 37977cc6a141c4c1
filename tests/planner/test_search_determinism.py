"""The search decides by work, never by the clock (same plan and counts when time jumps), and its counts add up:
layouts = solved + pruned + infeasible, candidates likewise, the progress bar counting the candidates."""

import re
import time

import pytest

from megatron_bmw.planner.cluster import parse_cluster
from megatron_bmw.planner.cost_model import CostSettings
from megatron_bmw.planner.memory_model import MemorySettings
from megatron_bmw.planner.profile_data import Profile, Profiles, UnitTiming, model_signature
from megatron_bmw.planner.report import TABLE_FOOTER, search_table, summary_line
from megatron_bmw.planner.search import SearchSettings, search
from megatron_bmw.planner.space import SearchSpace
from megatron_bmw.config import ModelConfig

MEM = MemorySettings(device="cuda")
COSTS = CostSettings()


def _cluster(memory_gb: float, nodes: int = 2):
    return parse_cluster({
        "name": "tiny", "inter_node": {"bandwidth_GBps": 0.5, "latency_us": 50},
        "device_types": {"d": {"memory_gb": memory_gb, "peak_tflops": {"fp32": 0.05}, "memory_bandwidth_GBps": 20}},
        "groups": [{"nodes": nodes, "gpus_per_node": 2, "device": "d",
                    "intra_node": {"bandwidth_GBps": 2, "latency_us": 20}}]})


def _model(layers: int = 4) -> ModelConfig:
    return ModelConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, vocab_size=256, seq_length=64,
                       hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")


def _outcome(result):
    stats = {k: v for k, v in result.stats.items() if not k.endswith("_s")}  # elapsed seconds are reported only
    return [(r.spec, r.time, r.estimate, tuple(r.notes)) for r in result.ranked], stats


def _run(memory_gb=0.004, strategy=("uniform",), progress=False):
    space = SearchSpace(strategy=strategy)
    return search(_model(), 256, 8, 16, _cluster(memory_gb), space=space, costs=COSTS, memory=MEM,
                  settings=SearchSettings(progress=progress))


def test_same_plan_and_counts_when_the_clock_jumps(monkeypatch):
    quiet = _outcome(_run())
    clock = [0.0]

    def jumping():  # every reading an hour later: any wall-clock budget would be spent at once
        clock[0] += 3600.0
        return clock[0]

    for name in ("time", "monotonic", "perf_counter", "process_time"):
        monkeypatch.setattr(time, name, jumping)
    loaded = _outcome(_run())
    assert loaded == quiet
    assert quiet[0], "the case must have plans"


@pytest.mark.parametrize("memory_gb,strategy", [(0.004, ("uniform",)), (0.0015, ("uniform",)),
                                                (0.004, ("uniform", "hybrid"))])
def test_counts_add_up(memory_gb, strategy, capsys):
    result = _run(memory_gb, strategy, progress=True)
    st = result.stats
    assert st["layouts"] == st["solved"] + st["pruned"] + st["infeasible"]
    assert st["candidates"] == st["candidates_solved"] + st["candidates_pruned"] + st["candidates_infeasible"]
    assert st["solved"] >= 1 and st["layouts"] <= st["candidates"]
    assert st["solved"] <= st["candidates_solved"] and st["pruned"] <= st["candidates_pruned"]
    bar = re.findall(r"(\d+)/(\d+) candidates", capsys.readouterr().err)
    assert bar and bar[-1] == (str(st["candidates"]), str(st["candidates"]))
    line = summary_line(st)
    assert line.startswith(f"{st['layouts']} layouts: {st['solved']} solved, {st['pruned']} pruned")
    assert f"{st['candidates']} candidates: {st['candidates_solved']} solved" in line


def test_short_memory_shows_infeasible_and_pruned_layouts():
    st = _run(0.0015).stats
    roomy = _run(0.004).stats
    assert st["infeasible"] > roomy["infeasible"] and roomy["pruned"] > 0


def test_table_footer_names_the_columns():
    table = search_table(_run())
    assert TABLE_FOOTER in table
    head = table.splitlines()[0].split()
    for col in ("#", "SP", "Z1", "BP", "K", "rc", "mem/cap", "mbs", "m", "notes"):
        assert col in head and f"{col} " in TABLE_FOOTER


def _timed_up_to(largest: int) -> Profiles:
    units = [UnitTiming(kind, 1, b, t * (b + 4), 2 * t * (b + 4)) for b in (1, 2, 4, 8, 16) if b <= largest
             for kind, t in (("embedding", 1e-5), ("attention", 1e-4), ("mlp", 2e-4), ("head", 5e-5))]
    return Profiles([Profile(device={"name": "d", "type": "d", "kind": "cpu"}, dtype="fp32",
                             model=model_signature(_model()), units=units)])


def test_a_micro_batch_beyond_the_profile_is_noted():
    short = search(_model(), 256, 8, 16, _cluster(0.004), _timed_up_to(1), costs=COSTS, memory=MEM,
                   settings=SearchSettings(top_k=5))
    assert short.stats["profiled_micro_batch"] == 1
    beyond = [r for r in short.ranked if r.spec.pipeline.micro_batch_size > 1]
    assert beyond, "a fixed cost per micro-batch: some plan takes a micro-batch beyond 1"
    for r in short.ranked:
        b = r.spec.pipeline.micro_batch_size
        assert (f"mbs {b} extrapolated (profiled up to 1)" in r.notes) == (b > 1)
    table = search_table(short)
    sizes = sorted({r.spec.pipeline.micro_batch_size for r in beyond})
    assert f"{', '.join(map(str, sizes))} {'is' if len(sizes) == 1 else 'are'} beyond the sizes --profile" in table
    assert "--profile-micro-batch-sizes 1,2" in table
    covered = search(_model(), 256, 8, 16, _cluster(0.004), _timed_up_to(16), costs=COSTS, memory=MEM,
                     settings=SearchSettings(top_k=5))
    assert covered.stats["profiled_micro_batch"] == 16
    assert not any("extrapolated" in n for r in covered.ranked for n in r.notes)
    assert "note: micro-batch" not in search_table(covered)
    assert "profiled_micro_batch" not in _run().stats and "note: micro-batch" not in search_table(_run())
