"""planner/allocation_trace.py: the synthetic trace holds what the memory model counts, in the schedule's order."""

from dataclasses import replace

import pytest

from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.planner.allocation_trace import rank_trace, synthetic_allocator, unit_param_numels
from megatron_bmw.planner.caching_allocator import ALLOC, FREE, round_size
from megatron_bmw.planner.engine import EngineConfig
from megatron_bmw.planner.evaluate import estimate_memory
from megatron_bmw.planner.memory_model import MemorySettings, unit_param_count
from megatron_bmw.planner.spec import RunSpec

GPT = ModelConfig(num_layers=4, hidden_size=256, num_attention_heads=8, vocab_size=1024, seq_length=128,
                  params_dtype="bf16", attention_backend="flash")
LLAMA = replace(GPT, normalization="RMSNorm", swiglu=True, num_query_groups=2, add_bias_linear=False,
                position_embedding_type="rope", qk_layernorm=True, untie_embeddings_and_output_weights=True)
BERT = replace(GPT, model_type="bert", bert_binary_head=True)


@pytest.mark.parametrize("model", [GPT, LLAMA, BERT], ids=["gpt", "llama", "bert"])
@pytest.mark.parametrize("tp", [1, 2])
def test_parameter_tensors_sum_to_the_memory_models_count(model, tp):
    for kind in ("embedding", "attention", "mlp", "head"):
        for output_weight in (True, False):
            numels = unit_param_numels(kind, model, tp, output_weight)
            assert all(n > 0 for n in numels)
            assert sum(numels) == unit_param_count(kind, model, tp, output_weight)


def _spec(pp=1, virtual=1, mbs=2, recompute=None, dp=1, dist=False):
    units = 2 * GPT.num_layers + 2
    pipe = PipelineConfig(micro_batch_size=mbs, num_microbatches=4, virtual_stages=virtual,
                          schedule="interleaved" if virtual > 1 else "1f1b",
                          recompute=None if recompute is None else (None,) + (recompute,) * (units - 2) + (None,))
    return RunSpec.of(GPT, 1, pp, dp, pipe, distributed_optimizer=dist)


@pytest.mark.parametrize("kw", [{}, {"pp": 2}, {"pp": 2, "virtual": 2}, {"recompute": "full"},
                                {"pp": 2, "recompute": "selective", "dp": 4, "dist": True}])
def test_the_traces_peak_is_the_memory_models(kw):
    spec = _spec(**kw)
    for rank, mem in enumerate(estimate_memory(spec, settings=MemorySettings())):
        events = rank_trace(spec, rank)
        live, now, top, static = {}, 0, 0, 0
        for code, size, addr in events:
            if code == ALLOC:
                live[addr] = round_size(size)
                now += live[addr]
            else:
                assert code == FREE
                now -= live.pop(addr)
            top = max(top, now)
        static = now  # what is left after the iterations: the start-up allocations
        rounding = 512 * sum(1 for c, _, _ in events if c == ALLOC)
        assert static == pytest.approx(mem.static_bytes, abs=rounding)
        # the saved activations at the schedule's peak, plus at most the worst unit's backward transient
        assert mem.static_bytes + mem.activation_bytes - rounding <= top
        assert top <= mem.static_bytes + mem.activation_bytes + mem.transient_bytes + rounding
        got = synthetic_allocator(spec, rank)
        # (a block whose rest is too small to split is allocated whole, as the allocator counts it)
        assert top <= got["peak_allocated"] <= top + 2**20 * sum(1 for c, _, _ in events if c == ALLOC)
        assert got["peak_allocated"] <= got["pinned_peak"] <= got["peak_reserved"]
        assert got["allocator_fraction"] == pytest.approx(got["pinned_peak"] / got["peak_allocated"] - 1)


def test_iterations_repeat_the_schedule():
    spec = _spec(pp=2)
    one, two = rank_trace(spec, 0, iterations=1), rank_trace(spec, 0, iterations=2)
    start = sum(1 for c, _, _ in one if c == ALLOC) - sum(1 for c, _, _ in one if c == FREE)
    assert len(two) - len(one) == len(one) - start  # the second iteration adds the same events again


def test_what_it_does_not_model_is_refused():
    with pytest.raises(UsageError, match="our runtime"):
        rank_trace(_spec(), settings=MemorySettings(engine=EngineConfig("megatron-core")))
    bpipe = RunSpec.of(GPT, 1, 4, 1, PipelineConfig(micro_batch_size=1, num_microbatches=8, bpipe=True))
    with pytest.raises(UsageError, match="BPipe"):
        rank_trace(bpipe)
