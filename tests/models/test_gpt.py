"""The whole GPT at tp=2 and tp=4 (with and without sequence parallelism and recomputation) equals tp=1."""

import pytest
import torch

from megatron_bmw.config import ModelConfig, ParallelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.units import unit_names
from megatron_bmw.parallel.grad_sync import GradSync
from megatron_bmw.parallel.state import ParallelState
from tests.dist_harness import run_distributed
from tests.reference import (SEED, expected_shard, make_batch, recompute_of, reference_name, serial_reference,
                             small_config, split_batch)

TOL = dict(rtol=1e-5, atol=1e-6)


def _batches(cfg):
    return split_batch(make_batch(cfg, 4, seed=7), 2)


def _tp_case(rank, world_size, overrides, sequence_parallel, ref_loss, ref_grads):
    cfg = small_config(**overrides)
    mbs = _batches(cfg)
    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=world_size, sequence_parallel=sequence_parallel))
    model = ModelChunk(build_units(cfg, st, SEED, recompute=recompute_of(overrides, cfg.num_layers)))
    sync = GradSync(list(model.parameters()), st)
    total = 0.0
    for mb in mbs:
        loss = model(None, mb) / len(mbs)
        loss.backward()
        total += loss.item()
    sync.finish()
    assert abs(total - ref_loss) <= 1e-5 * abs(ref_loss), (total, ref_loss)
    names = set()
    for name, p in model.named_parameters():
        full = ref_grads[reference_name(name, cfg)]
        torch.testing.assert_close(p.main_grad, expected_shard(full, p, st), **TOL, msg=lambda m: f"{name}: {m}")
        names.add(name)
    assert names == set(ref_grads)
    return total


CASES = [
    ({}, False),
    ({}, True),
    ({"recompute_granularity": "full"}, False),
    ({"recompute_granularity": "selective"}, True),
    ({"attention_backend": "flash", "untie_embeddings_and_output_weights": True}, False),
    ({"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1}, True),
]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("overrides,sequence_parallel", CASES)
def test_gpt_tensor_parallel_equals_serial(world_size, overrides, sequence_parallel):
    cfg = small_config(**overrides)
    ref_loss, ref_grads, _ = serial_reference(cfg, _batches(cfg))
    losses = run_distributed(world_size, _tp_case, overrides, sequence_parallel, ref_loss, ref_grads)
    assert len(set(losses)) == 1


def test_units_and_layout_independent_init():
    cfg = small_config(num_layers=3)
    assert unit_names(3) == ["embedding", "attn_0", "mlp_0", "attn_1", "mlp_1", "attn_2", "mlp_2", "head"]
    full = ModelChunk(build_units(cfg, ParallelState.serial(), SEED))
    part = ModelChunk(build_units(cfg, ParallelState.serial(), SEED, indices=[3, 4]))
    for name, p in part.named_parameters():
        assert torch.equal(p, dict(full.named_parameters())[name])


def test_dropout_recompute_replays_masks():
    cfg = small_config(hidden_dropout=0.2, attention_dropout=0.2)
    batch = make_batch(cfg, 2, seed=1)
    grads = []
    for granularity in (None, "full", "selective"):
        st = ParallelState.serial()
        st.rng.add("model-parallel-rng", 99)
        torch.manual_seed(5)
        model = ModelChunk(build_units(cfg, st, SEED,
                                     recompute=recompute_of({"recompute_granularity": granularity}, cfg.num_layers)))
        model(None, batch).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, **TOL)


def test_tp_must_divide_heads():
    cfg = small_config(num_attention_heads=4, hidden_size=32)
    with pytest.raises(UsageError, match="does not divide --num-attention-heads"):
        cfg.check_tensor_parallel(3)
    with pytest.raises(UsageError, match="not divisible by --num-attention-heads"):
        ModelConfig(hidden_size=30, num_attention_heads=4)
