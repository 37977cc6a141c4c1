"""Profiler: unit timings are positive, saved bytes agree with the memory model, link fits, profile files."""

import dataclasses
import json
import math

import pytest

from megatron_bmw.config import ModelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.planner.cluster import load_cluster
from megatron_bmw.planner.memory_model import unit_activation_bytes
from megatron_bmw.planner.profile_data import MODEL_KEYS, Profile
from megatron_bmw.planner.analytic import analytic_profile
from megatron_bmw.training.profiler import _fit_link, time_cp_core, time_engine_overhead, time_stream, time_units

MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                    attention_backend="unfused")


def test_time_units_and_saved_bytes():
    """Every kind as it is, and attention and MLP recomputed (full; selective for attention): what they save is
    what the memory model says of each; the units are left as built."""
    state = ParallelState.serial()
    timings = time_units(MODEL, state, (1, 2), warmup=0, repeats=2)
    assert [(t.micro_batch_size, t.kind, t.recompute) for t in timings] == [
        (b, k, rc) for b in (1, 2) for k, rc in [("embedding", None), ("attention", None), ("mlp", None),
                                                 ("head", None), ("attention", "full"), ("attention", "selective"),
                                                 ("mlp", "full")]]
    for t in timings:
        assert t.forward_s > 0 and t.backward_s > 0
        assert t.saved_bytes == unit_activation_bytes(t.kind, MODEL, t.micro_batch_size, recompute=t.recompute,
                                                      device="cpu")


def test_recompute_switch_restores_the_unit():
    from megatron_bmw.training.profiler import _one_layer_units, _recompute

    units, sync = _one_layer_units(MODEL, ParallelState.serial(), 1, True)
    attn, mlp = units["attn_0"], units["mlp_0"]
    _recompute(attn, "selective")
    assert attn.selective and attn.recompute is None
    _recompute(attn, "full")
    _recompute(mlp, "full")
    assert not attn.selective and attn.recompute == "full" and mlp.recompute == "full"
    for u in (attn, mlp):
        _recompute(u, None)
    assert not attn.selective and attn.recompute is None and mlp.recompute is None
    sync.remove_hooks()


def test_stream_of_the_stack_beside_the_units_sum():
    """What a GPU profile records for the GPU check: a micro-batch through a stack of the model's depth (at most
    8), unsynchronised inside, and the synchronised units' sum for the same stack; the file keeps it."""
    timings = time_units(MODEL, ParallelState.serial(), (1, 2), warmup=0, repeats=1)
    got = time_stream(MODEL, ParallelState.serial(), timings, warmup=0, repeats=2)
    assert set(got) == {"1", "2"} and all(e["depth"] == MODEL.num_layers for e in got.values())
    one = {t.kind: t.forward_s + t.backward_s for t in timings if t.micro_batch_size == 1 and t.recompute is None}
    assert got["1"]["units_s"] == pytest.approx(one["embedding"] + 2 * (one["attention"] + one["mlp"]) + one["head"])
    assert all(e["stream_s"] > 0 for e in got.values())
    prof = Profile(device={"name": "x"}, dtype="fp32", model={k: getattr(MODEL, k) for k in MODEL_KEYS},
                   stream=got)
    assert Profile.from_json(prof.to_json()).stream == got
    bad = {**prof.to_json(), "stream": {"1": {"depth": 2, "stream_s": -1.0, "units_s": 1.0}}}
    with pytest.raises(UsageError, match="stream.1.stream_s must be a number > 0"):
        Profile.from_json(bad)


@pytest.mark.parametrize("fusion", [True, False])
def test_units_accumulate_their_gradients_as_the_run_will(monkeypatch, fusion):
    """--no-gradient-accumulation-fusion reaches the profile's GradSync (the backward it times)."""
    from megatron_bmw.parallel import grad_sync

    seen = []

    class Spy(grad_sync.GradSync):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("fusion", True))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(grad_sync, "GradSync", Spy)
    time_units(MODEL, ParallelState.serial(), (1,), warmup=0, repeats=1, fusion=fusion)
    assert seen == [fusion]


def test_time_cp_core_times_one_cp_ranks_tiles():
    """The runtime's context-parallel core (a cp rank's share of the whole sequence's tiles), forward and backward,
    per cp size and micro-batch size: keys as Profile.cp_core reads them."""
    got = time_cp_core(dataclasses.replace(MODEL, num_query_groups=2), (2, 4), (1, 2), warmup=0, repeats=1)
    assert sorted(got) == ["2", "4"] and all(sorted(v) == ["1", "2"] for v in got.values())
    assert all(e["forward_s"] > 0 and e["backward_s"] > 0 for v in got.values() for e in v.values())


def test_engine_overhead_is_non_negative():
    out = time_engine_overhead(ParallelState.serial(), num_microbatches=2, repeats=1)
    assert out["forward_s"] >= 0 and out["backward_s"] == out["forward_s"]


def test_fit_link_recovers_latency_and_bandwidth():
    pts = [(n, 5e-5 + n / 2e9) for n in (1 << 10, 1 << 16, 1 << 20, 1 << 22)]
    fit = _fit_link(pts)
    assert fit["bandwidth_Bps"] == pytest.approx(2e9, rel=1e-6)
    assert fit["latency_s"] == pytest.approx(5e-5, rel=1e-6)
    noisy = _fit_link([(1 << 10, 3e-4), (1 << 20, 1e-4)])  # decreasing: fall back to the largest message
    assert noisy["bandwidth_Bps"] > 0


def test_analytic_profile_round_trip(tmp_path):
    shaped = load_cluster("aws-g4dn.12xlarge").device(0)
    flat = analytic_profile(MODEL, dataclasses.replace(shaped, sm_count=None), achievable_fraction=0.5)
    assert flat.achieved_flops() == pytest.approx(8.1e12 * 0.5)  # FLOPs at the achievable rate
    prof = analytic_profile(MODEL, shaped, achievable_fraction=0.5)  # by GEMM shape: a tiny model's tiles
    assert 0 < prof.achieved_flops() < 0.1 * flat.achieved_flops()
    path = tmp_path / "p.json"
    prof.save(str(path))
    again = Profile.load(str(path))
    assert again.units == prof.units and again.mode == "analytic"
    path.write_text(json.dumps({"format": 1, "units": []}))
    with pytest.raises(UsageError, match="missing field .device."):
        Profile.load(str(path))
    path.write_text("{")
    with pytest.raises(UsageError, match="not valid JSON"):
        Profile.load(str(path))


def test_a_profile_records_the_load_it_was_taken_under(monkeypatch, tmp_path):
    """os.getloadavg() at the start and the end, the seconds between, the cores and the profiling's own threads:
    a plan's check sets a run's load beside it (plan_check.load_line). Read back from the file and into a plan's
    record of its profiles."""
    import os

    from megatron_bmw.planner.analytic import ProfileSettings
    from megatron_bmw.planner.profile_data import Profiles, load_per_core
    from megatron_bmw.training.profiler import run_profile

    readings = iter([(0.5, 0.4, 0.3), (2.5, 1.0, 0.5)])
    monkeypatch.setattr(os, "getloadavg", lambda: next(readings))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    prof = run_profile(MODEL, ProfileSettings(micro_batch_sizes=(1,), warmup=0, repeats=1, links=False,
                                              overhead=False))
    load = prof.machine_load
    assert (load["cores"], load["start"], load["end"], load["own"]) == (2, [0.5, 0.4, 0.3], [2.5, 1.0, 0.5], 1)
    assert load["seconds"] >= 0
    path = str(tmp_path / "p.json")
    prof.save(path)
    again = Profile.load(path)
    assert again.machine_load == load and Profiles([again]).identity()[0]["load"] == load
    assert load_per_core(load) == pytest.approx((0.5 + 2.5 - (1 - math.exp(-load["seconds"] / 60))) / 2 / 2)


@pytest.mark.parametrize("layer_freq,kinds", [("1", ["embedding", "attention", "head", "moe"]),
                                              ("[0,1]", ["embedding", "attention", "mlp", "head", "moe"])])
def test_moe_models_time_their_moe_unit(layer_freq, kinds):
    """An MoE model's profile times its MoE unit (kind moe; saved bytes as the memory model's at ep 1) and a dense
    MLP only where some layer is dense; its model signature names the experts and the planner reads the entry."""
    from megatron_bmw.config import MoEConfig
    from megatron_bmw.models import moe_experts
    from megatron_bmw.planner.moe_model import Experts
    from megatron_bmw.planner.profile_data import model_signature

    model = dataclasses.replace(MODEL, moe=MoEConfig(num_experts=4, router_topk=2, ffn_hidden_size=32,
                                                     layer_freq=layer_freq))
    moe_experts._GROUPED_OK.clear()  # the grouped GEMM's probe runs inside the first measurement: unseen there
    timings = time_units(model, ParallelState.serial(), (1,), warmup=0, repeats=1, recomputed=())
    assert [t.kind for t in timings] == kinds and all(t.forward_s > 0 and t.backward_s > 0 for t in timings)
    moe = next(t for t in timings if t.kind == "moe")
    again = next(t for t in time_units(model, ParallelState.serial(), (1,), warmup=0, repeats=1, recomputed=())
                 if t.kind == "moe")
    assert moe.saved_bytes == again.saved_bytes
    # the memory model's MoE tensors, for the (even) routing of one expert pass: byte for byte
    assert moe.saved_bytes == unit_activation_bytes("moe", model, 1, 1, device="cpu", experts=Experts(1, 1))
    prof = Profile(device={"name": "x", "kind": "cpu"}, dtype="fp32", model=model_signature(model), units=timings)
    assert prof.model["moe"]["num_experts"] == 4 and prof.model["moe"]["layer_freq"] == "1"
    assert prof.unit_time("moe", 1, 1, model) == pytest.approx((moe.forward_s, moe.backward_s))
    assert prof.achieved_flops() > 0
