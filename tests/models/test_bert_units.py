"""BERT units: what the planner's memory model, parameter counts and FLOPs say, against the real units
(saved-tensor hooks byte for byte, parameters one by one, matmul FLOPs counted by torch)."""

import itertools

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megatron_bmw.config import ParallelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.models.bert import synthetic_batch
from megatron_bmw.models.chunk import build_units
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.planner.flops import unit_forward_flops
from megatron_bmw.planner.memory_model import total_parameters, unit_kind, unit_param_count, unit_saved_tensors
from megatron_bmw.training.saved_bytes import measure_saved
from megatron_bmw.units import recompute_from_flags
from tests.dist_harness import run_distributed
from tests.models.bert_reference import bert_config

SEQ, MBS, H = 8, 3, 24


def _cfg(**kw):
    return bert_config(hidden_size=H, vocab_size=40, seq_length=SEQ, **kw)


def _mismatches(state: ParallelState, tp: int, sp: bool) -> list[str]:
    bad = []
    variants = itertools.product((torch.float32, torch.bfloat16), ("unfused", "flash"), (None, "selective", "full"),
                                 (0.0, 0.1), (True, False))
    for dtype, backend, rc, dropout, binary in variants:
        cfg = _cfg(attention_backend=backend, params_dtype=dtype, hidden_dropout=dropout, attention_dropout=dropout,
                   bert_binary_head=binary)
        recompute = recompute_from_flags(rc, None, None, cfg.num_layers, [list(range(cfg.num_units))])
        units = build_units(cfg, state, 1, recompute=recompute)
        params = [p for u in units.values() for p in u.parameters()] + [units["embedding"].word_embeddings.weight]
        choice = dict(zip(units, recompute or (None,) * cfg.num_units))
        batch = synthetic_batch(cfg, MBS, seed=3)
        seq = SEQ // tp if sp else SEQ
        for name, unit in units.items():
            hidden = None if name == "embedding" else torch.randn(seq, MBS, H, dtype=dtype, requires_grad=True)
            saved, _ = measure_saved(lambda: unit(hidden, batch), params)
            predicted = sum(t.nbytes for t in unit_saved_tensors(unit_kind(name), cfg, MBS, tp, sp, choice[name], "cpu"))
            if predicted != saved.total:
                bad.append(f"tp={tp} sp={sp} {dtype} {backend} {rc} dropout={dropout} binary={binary} {name}: "
                           f"predicted {predicted}, measured {saved.total}")
    return bad


def test_bert_saved_bytes_tp1_exact():
    assert _mismatches(ParallelState.serial(), 1, False) == []


def _tp_body(rank, world_size, sp):
    state = ParallelState.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp))
    return _mismatches(state, 2, sp)


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_bert_saved_bytes_tp2_exact(sp):
    assert run_distributed(2, _tp_body, sp) == [[], []]


@pytest.mark.parametrize("binary,tied", [(True, True), (False, True), (True, False)])
def test_bert_param_counts_match_model(binary, tied):
    cfg = _cfg(bert_binary_head=binary, untie_embeddings_and_output_weights=not tied)
    units = build_units(cfg, ParallelState.serial(), 1)
    for name, unit in units.items():
        assert sum(p.numel() for p in unit.parameters()) == \
            unit_param_count(unit_kind(name), cfg, output_weight=not tied), name
    assert total_parameters(cfg) == sum(p.numel() for u in units.values() for p in u.parameters())
    gpt = _cfg(model_type="gpt")
    assert unit_param_count("embedding", cfg) - unit_param_count("embedding", gpt) == (2 * H if binary else 0)


@pytest.mark.parametrize("binary", [True, False])
def test_bert_head_and_layer_flops_are_the_matmuls(binary):
    cfg = _cfg(bert_binary_head=binary)
    units = build_units(cfg, ParallelState.serial(), 1)
    batch = synthetic_batch(cfg, MBS, seed=3)
    for name in ("attn_0", "mlp_0", "head"):
        counter = FlopCounterMode(display=False)
        with counter:
            units[name](torch.randn(SEQ, MBS, H), batch)
        assert counter.get_total_flops() == unit_forward_flops(unit_kind(name), cfg, MBS), name


def test_bert_config_checks():
    with pytest.raises(UsageError, match="unknown model type 't5'"):
        _cfg(model_type="t5")
    assert _cfg().num_tokentypes == 2 and _cfg(bert_binary_head=False).num_tokentypes == 0
    assert _cfg(model_type="gpt").num_tokentypes == 0
