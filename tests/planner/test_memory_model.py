"""The memory model against what our units really save (saved-tensor hooks), and the model-state formulas."""

import itertools
import os

import pytest
import torch

from megatron_bmw.config import ModelConfig, ParallelConfig
from megatron_bmw.models.chunk import build_units
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.pipeline.generators import generate
from megatron_bmw.planner.memory_model import (
    MemorySettings,
    PrecisionConfig,
    StageLayout,
    rank_memory,
    shared_output_grad_bytes,
    total_parameters,
    unit_kind,
    unit_param_count,
)
from megatron_bmw.planner.unit_activations import korthikanti_layer_bytes, layer_activation_bytes, unit_saved_tensors
from megatron_bmw.units import recompute_from_flags, unit_kind_of
from megatron_bmw.training.saved_bytes import measure_saved
from megatron_bmw.models.bert import synthetic_batch
from tests.dist_harness import run_distributed
from tests.models.bert_reference import bert_config

SEQ, MBS, VOCAB = 8, 3, 40


def _cfg(**kw) -> ModelConfig:
    base = dict(num_layers=2, hidden_size=24, num_attention_heads=4, vocab_size=VOCAB, seq_length=SEQ)
    base.update(kw)
    return ModelConfig(**base)


def _batch(b: int) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"tokens": torch.randint(0, VOCAB, (b, SEQ), generator=g),
            "labels": torch.randint(0, VOCAB, (b, SEQ), generator=g),
            "loss_mask": torch.ones(b, SEQ)}


# Llama-family layers (SwiGLU and rope fused unless the variant says otherwise): rope with GQA, SwiGLU, RMSNorm and
# no biases together; rope alone (MHA, part of the head rotated); groups without rope; MQA (one group: tp 1 only);
# q/k norms.
LLAMA_VARIANTS = (
    dict(position_embedding_type="rope", num_query_groups=2, swiglu=True, ffn_hidden_size=40,
         normalization="RMSNorm", add_bias_linear=False),
    dict(position_embedding_type="rope", rotary_percent=0.5, add_qkv_bias=True, num_attention_heads=2),
    dict(num_query_groups=2, normalization="RMSNorm"),
    dict(num_query_groups=1),
    dict(position_embedding_type="rope", num_query_groups=1, swiglu=True),
    # per-head query and key norms (before rope), zero-centred norm weights
    dict(qk_layernorm=True, apply_layernorm_1p=True),
    dict(qk_layernorm=True, normalization="RMSNorm", position_embedding_type="rope", num_query_groups=2),
    dict(qk_layernorm=True, normalization="RMSNorm", apply_layernorm_1p=True, num_query_groups=1),
    # --squared-relu (Nemotron-4's MLP: relu(x)^2, no gating) with rope and groups, with and without biases
    dict(squared_relu=True, position_embedding_type="rope", num_query_groups=2, add_bias_linear=False),
    dict(squared_relu=True),
    # the Llama layer with --no-bias-swiglu-fusion --no-rope-fusion (the fused ops are the default)
    dict(position_embedding_type="rope", num_query_groups=2, swiglu=True, ffn_hidden_size=40,
         normalization="RMSNorm", add_bias_linear=False, bias_swiglu_fusion=False, apply_rope_fusion=False),
)


def _variants(tp: int):
    classic = itertools.product((torch.float32, torch.bfloat16), ("unfused", "flash"), (None, "selective", "full"),
                                (0.0, 0.1), (0.0, 0.1), ({},))
    llama = itertools.product((torch.float32, torch.bfloat16), ("unfused", "flash"), (None, "selective", "full"),
                              (0.0,), (0.0, 0.1), [v for v in LLAMA_VARIANTS if v.get("num_query_groups", 2) % tp == 0])
    return itertools.chain(classic, llama)


def _mismatches(state: ParallelState, tp: int, sp: bool) -> list[str]:
    """Every unit of every variant: predicted saved bytes vs measured; returns the differences."""
    bad = []
    for dtype, backend, rc, hd, ad, extra in _variants(tp):
        cfg = _cfg(attention_backend=backend, params_dtype=dtype, hidden_dropout=hd, attention_dropout=ad, **extra)
        recompute = recompute_from_flags(rc, None, None, cfg.num_layers, [list(range(cfg.num_units))])
        units = build_units(cfg, state, 1, recompute=recompute)
        params = [p for u in units.values() for p in u.parameters()] + [units["embedding"].word_embeddings.weight]
        choice = dict(zip(units, recompute or (None,) * cfg.num_units))
        batch = _batch(MBS)
        seq = SEQ // tp if sp else SEQ
        for name, unit in units.items():
            hidden = None if name == "embedding" else torch.randn(seq, MBS, 24, dtype=dtype, requires_grad=True)
            saved, _ = measure_saved(lambda: unit(hidden, batch), params)
            predicted = sum(t.nbytes for t in unit_saved_tensors(unit_kind(name), cfg, MBS, tp, sp, choice[name], "cpu"))
            if predicted != saved.total:
                bad.append(f"tp={tp} sp={sp} {dtype} {backend} {rc} hd={hd} ad={ad} {extra} {name}: "
                           f"predicted {predicted}, measured {saved.total}")
    return bad


def _fused_head_mismatches(state: ParallelState, tp: int, sp: bool) -> list[str]:
    """--cross-entropy-loss-fusion: GPT's head (tied, untied with RMSNorm) and BERT's (with and without the binary
    head), fp32 and bf16: predicted saved bytes vs measured (the logits in their dtype and fp32 statistics per
    token where the fp32 softmax was)."""
    bad = []
    heads = [({}, _cfg), (dict(untie_embeddings_and_output_weights=True, normalization="RMSNorm"), _cfg),
             ({}, lambda **kw: bert_config(hidden_size=24, vocab_size=VOCAB, seq_length=SEQ, **kw)),
             (dict(bert_binary_head=False), lambda **kw: bert_config(hidden_size=24, vocab_size=VOCAB, seq_length=SEQ,
                                                                     **kw))]
    for dtype, (extra, make) in itertools.product((torch.float32, torch.bfloat16), heads):
        cfg = make(params_dtype=dtype, cross_entropy_loss_fusion=True, **extra)
        units = build_units(cfg, state, 1)
        params = [p for u in units.values() for p in u.parameters()] + [units["embedding"].word_embeddings.weight]
        batch = synthetic_batch(cfg, MBS, seed=3) if cfg.model_type == "bert" else _batch(MBS)
        hidden = torch.randn(SEQ // tp if sp else SEQ, MBS, 24, dtype=dtype, requires_grad=True)
        saved, _ = measure_saved(lambda: units["head"](hidden, batch), params)
        predicted = sum(t.nbytes for t in unit_saved_tensors("head", cfg, MBS, tp, sp, None, "cpu"))
        if predicted != saved.total:
            bad.append(f"fused head tp={tp} sp={sp} {dtype} {cfg.model_type} {extra}: predicted {predicted}, "
                       f"measured {saved.total}")
    return bad


def _tp_body(rank, world_size, sp):
    state = ParallelState.build(ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=sp))
    return _mismatches(state, 2, sp) + _wgrad_mismatches(state, 2, sp) + _fused_head_mismatches(state, 2, sp)


def test_saved_bytes_tp1_exact():
    assert _mismatches(ParallelState.serial(), 1, False) == []


def test_saved_bytes_fused_cross_entropy_head_exact():
    assert _fused_head_mismatches(ParallelState.serial(), 1, False) == []
    fused = _cfg(params_dtype=torch.bfloat16, cross_entropy_loss_fusion=True, vocab_size=128 * 1024)
    assert [(t.name, t.nbytes) for t in unit_saved_tensors("head", fused, 2, 2)[3:6]] == [
        ("logits", SEQ * 2 * 64 * 1024 * 2), ("row maximum (fp32)", SEQ * 2 * 4),
        ("sum of exponentials (fp32)", SEQ * 2 * 4)]


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_saved_bytes_tp2_exact(sp):
    results = run_distributed(2, _tp_body, sp)
    assert results == [[], []]


def test_recompute_flags_per_unit():
    """Megatron's flags as per-unit choices; the block method counts layers per pipeline rank."""
    ranks = [[0, 1, 2, 3], [4, 5, 6, 7]]  # 3 layers over 2 ranks, the second rank holds layers 1 (mlp) and 2
    assert recompute_from_flags(None, None, None, 3, ranks) is None
    assert recompute_from_flags("selective", None, None, 3, ranks) == \
        (None, "selective", None, "selective", None, "selective", None, None)
    assert recompute_from_flags("full", "uniform", None, 3, ranks) == (None,) + ("full",) * 6 + (None,)
    assert recompute_from_flags("full", "block", 1, 3, ranks) == \
        (None, "full", "full", None, "full", None, None, None)
    cfg = _cfg(num_layers=3)
    choice = (None, "selective", "full", None, None, "full", "full", None)
    units = build_units(cfg, ParallelState.serial(), 1, recompute=choice)
    built = tuple("selective" if getattr(u, "selective", False) else u.recompute for u in units.values())
    assert built == choice


@pytest.mark.parametrize("extra", ({},) + LLAMA_VARIANTS)
def test_param_counts_match_model(extra):
    for tied in (False, True):
        cfg = _cfg(untie_embeddings_and_output_weights=not tied, **extra)
        units = build_units(cfg, ParallelState.serial(), 1)
        for name, unit in units.items():
            own = sum(p.numel() for p in unit.parameters())
            expected = unit_param_count(unit_kind(name), cfg, output_weight=not tied)
            assert own == expected, name
        model_total = sum(p.numel() for u in units.values() for p in u.parameters())
        assert total_parameters(cfg) == model_total


def test_korthikanti_reference_relation():
    """Megatron's accounting exactly (fp16, cuda, unfused attention), plus the LayerNorm statistics it ignores:
    at tp 1, with tp, with tp + SP, and with selective recomputation."""
    cfg = _cfg(num_layers=1, hidden_size=64, num_attention_heads=8, seq_length=32, params_dtype=torch.float16,
               attention_backend="unfused")
    s, b = 32, MBS
    stats = 2 * 2 * s * b * 4  # two LayerNorms' fp32 mean and rstd
    for tp, sp in ((1, False), (2, False), (4, True)):
        for rc in (None, "selective"):
            ours = layer_activation_bytes(cfg, b, tp=tp, sp=sp, recompute=rc, device="cuda")
            assert ours == korthikanti_layer_bytes(cfg, b, tp=tp, sp=sp, recompute=rc) + stats / (tp if sp else 1)


def test_rank_memory_uses_schedule_inflight():
    cfg = _cfg(num_layers=4)
    layout = StageLayout(tp=1, dp=1, pp=4, sequence_parallel=False, micro_batch_size=2,
                         partition=(3, 2, 2, 3))
    sched = generate("1f1b", 4, 8)
    gp = generate("gpipe", 4, 8)
    prec = PrecisionConfig(param_bytes=4)
    for r in range(4):
        mem = rank_memory(layout, cfg, sched, r, prec, MemorySettings(device="cpu"))
        assert mem.peak_inflight_microbatches == min(4 - r, 8)
        assert mem.activation_bytes == pytest.approx(mem.chunk_activation_bytes[0] * (4 - r))
        assert rank_memory(layout, cfg, gp, r, prec).peak_inflight_microbatches == 8


def test_shared_output_weight_gradient_is_held_in_backward():
    """Tied, with embedding and head on one rank, the output layer's weight gradient (v/t x h, parameter dtype)
    waits in autograd from the head's backward to the embedding's: the backward transient carries it. An own
    output matrix (untied, or the last stage's copy) goes straight into main_grad, as does Megatron-LM's."""
    from megatron_bmw.planner.engine import EngineConfig
    from megatron_bmw.units import unit_names

    cfg = _cfg(num_layers=2, params_dtype="bf16")
    names = unit_names(2)
    ours = EngineConfig()
    assert shared_output_grad_bytes(cfg, 2, 1, names, ours) == (cfg.vocab_size // 2) * cfg.hidden_size * 2
    assert shared_output_grad_bytes(_cfg(num_layers=2, untie_embeddings_and_output_weights=True), 1, 1, names,
                                    ours) == 0
    assert shared_output_grad_bytes(cfg, 1, 2, names[-2:], ours) == 0  # the last stage's own copy
    assert shared_output_grad_bytes(cfg, 1, 1, names[:2], ours) == 0  # no head here
    assert shared_output_grad_bytes(cfg, 1, 1, names, EngineConfig(name="megatron-core")) == 0
    layout = StageLayout(tp=1, dp=1, pp=1, sequence_parallel=False, micro_batch_size=1, partition=(len(names),))
    prec = PrecisionConfig(param_bytes=2)
    tied = rank_memory(layout, cfg, generate("1f1b", 1, 2), 0, prec)
    untied = rank_memory(layout, _cfg(num_layers=2, params_dtype="bf16", untie_embeddings_and_output_weights=True),
                         generate("1f1b", 1, 2), 0, prec)
    assert tied.transient_bytes - untied.transient_bytes == cfg.vocab_size * cfg.hidden_size * 2


def test_model_states_precision_and_zero():
    cfg = _cfg(num_layers=2)
    layout = StageLayout(tp=1, dp=4, pp=1, sequence_parallel=False, micro_batch_size=1, partition=(6,))
    sched = generate("1f1b", 1, 1)
    n = total_parameters(cfg)
    fp32 = rank_memory(layout, cfg, sched, 0, PrecisionConfig(4))
    assert (fp32.params_bytes, fp32.grads_bytes, fp32.optimizer_bytes) == (4 * n, 4 * n, 8 * n)
    bf16 = rank_memory(layout, cfg, sched, 0, PrecisionConfig(2))
    assert (bf16.params_bytes, bf16.grads_bytes, bf16.optimizer_bytes) == (2 * n, 4 * n, 12 * n)
    zero = rank_memory(layout, cfg, sched, 0, PrecisionConfig(2, distributed_optimizer=True))
    assert zero.optimizer_bytes == pytest.approx(12 * n / 4)


@pytest.mark.parametrize("rank,partition,rc", [(0, (4, 6), None), (1, (4, 6), "selective"), (1, (7, 3), "full"),
                                                (0, (3, 7), "full")])
def test_stage_forwards_match_chunk_bytes(rank, partition, rc):
    """Several micro-batches through one pipeline stage's chunk, all kept alive as during the warm-up of 1F1B."""
    from megatron_bmw.models.chunk import ModelChunk
    from megatron_bmw.training.saved_bytes import record_saved
    from megatron_bmw.planner.memory_model import chunk_saved_bytes

    cfg = _cfg(num_layers=4)
    start = sum(partition[:rank])
    mine = list(range(start, start + partition[rank]))
    recompute = recompute_from_flags(rc, "block" if rc == "full" else None, 1 if rc == "full" else None, 4,
                                     [list(range(partition[0])), list(range(partition[0], 10))])
    layout = StageLayout(tp=1, dp=1, pp=2, sequence_parallel=False, micro_batch_size=MBS, partition=partition,
                         recompute=recompute)
    units = build_units(cfg, ParallelState.serial(), 1, mine, recompute)
    chunk = ModelChunk(units)
    params = list(chunk.parameters())
    outs = []
    with record_saved(params) as saved:
        for i in range(3):
            hidden = None if rank == 0 else torch.randn(SEQ, MBS, 24, requires_grad=True)
            outs.append(chunk(hidden, _batch(MBS)))
    predicted = chunk_saved_bytes(layout, cfg, rank, MemorySettings(device="cpu"))
    assert saved.total == 3 * predicted[0]


def test_bpipe_walk_matches_activation_store_accounting():
    from megatron_bmw.pipeline.bpipe import insert_bpipe
    from megatron_bmw.pipeline.holding import resident_peaks
    from megatron_bmw.planner.memory_model import activation_walk

    for p, m in ((4, 8), (6, 6), (8, 16)):
        sched = insert_bpipe(generate("1f1b", p, m))
        expected = resident_peaks(sched)
        for r in range(p):
            peak, count = activation_walk(sched, r, lambda rank: [5.0])
            assert count == expected[r] and peak == 5.0 * expected[r]


# (dtype, backend, recomputation, hidden dropout, Llama-family settings): item sizes, the context copy, inputs that
# recomputation rebuilds in B, gradients taken before dropout, SwiGLU's and grouped queries' shapes
WGRAD_VARIANTS = [(torch.float32, "unfused", None, 0.1, {}), (torch.bfloat16, "flash", None, 0.0, {}),
                  (torch.bfloat16, "unfused", "full", 0.1, {}), (torch.float32, "flash", "selective", 0.1, {}),
                  (torch.float32, "flash", "full", 0.0, LLAMA_VARIANTS[0]),
                  (torch.float32, "flash", None, 0.0, LLAMA_VARIANTS[1]),
                  (torch.bfloat16, "flash", None, 0.0, LLAMA_VARIANTS[6])]


def _wgrad_mismatches(state: ParallelState, tp: int, sp: bool) -> list[str]:
    """What a split backward's B leaves for its W (the deferred layers' stash: inputs and output gradients, each
    storage once) against the memory model, unit by unit; returns the differences."""
    from megatron_bmw.parallel import deferred_wgrad
    from megatron_bmw.planner.unit_activations import unit_wgrad_bytes

    bad = []
    g = torch.Generator().manual_seed(1)
    seq = SEQ // tp if sp else SEQ
    for dtype, backend, rc, hd, extra in WGRAD_VARIANTS:
        if extra.get("num_query_groups", tp) % tp:
            continue
        cfg = _cfg(attention_backend=backend, params_dtype=dtype, hidden_dropout=hd, **extra)
        recompute = recompute_from_flags(rc, None, None, cfg.num_layers, [list(range(cfg.num_units))])
        units = build_units(cfg, state, 1, recompute=recompute)
        for name, unit in units.items():
            hidden = None if name == "embedding" else torch.randn(seq, MBS, 24, dtype=dtype, requires_grad=True)
            out = unit(hidden, _batch(MBS))
            with deferred_wgrad.deferring(name):
                out.backward(None if out.numel() == 1 else torch.randn(out.shape, generator=g).to(dtype))
            kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in deferred_wgrad.stashed(name)}
            if name in deferred_wgrad.pending():
                deferred_wgrad.run_deferred(name)
            predicted = unit_wgrad_bytes(unit_kind(name), cfg, MBS, tp, sp)
            if predicted != sum(kept.values()):
                bad.append(f"tp={tp} sp={sp} {dtype} {backend} {rc} hd={hd} {extra} {name}: predicted {predicted}, "
                           f"kept {sum(kept.values())}")
    return bad


def test_wgrad_bytes_tp1_exact():
    assert _wgrad_mismatches(ParallelState.serial(), 1, False) == []


@pytest.mark.parametrize("rc", [None, "full"])
def test_split_backward_store_matches_holding_walk(rc):
    """One process runs F0 B0 F1 B1 F2 B2 W0 W1 W2 (split backwards) with the activation store: after every action
    its live bytes are the memory model's walk (saved bytes until B, what W needs from B to W), byte for byte."""
    from megatron_bmw.parallel.grad_sync import GradSync
    from megatron_bmw.pipeline.engine import PipelineEngine
    from megatron_bmw.pipeline.holding import bytes_size, holding_events
    from megatron_bmw.pipeline.schedule import Action, Kind, Schedule
    from megatron_bmw.pipeline.stages import hidden_shape, pipeline_setup
    from megatron_bmw.planner.memory_model import chunk_saved_bytes, chunk_wgrad_bytes
    from tests.reference import SEED, make_batch, pipeline_of, small_config, split_batch

    cfg = small_config()
    overrides = {"_recompute": (None, "full", "full", None, None, None)} if rc else {}
    micro = split_batch(make_batch(cfg, 6, seed=3), 3)
    st = ParallelState.serial()
    pipe = pipeline_of(cfg, overrides, 2, 3, 1, 1, "zb-h1")
    chunks, _, _ = pipeline_setup(cfg, st, SEED, pipe)
    order = [Action(k, i) for i in range(3) for k in (Kind.FORWARD, Kind.BACKWARD_INPUT)]
    sched = Schedule("zb-h1", 1, 3, 1, [order + [Action(Kind.BACKWARD_WEIGHT, i) for i in range(3)]])
    live = []

    class Probe:
        def record(self, a, start, end):
            live.append(engine.store.live_bytes)

        def record_wait(self, *args):
            pass

    engine = PipelineEngine(chunks, st, sched, hidden_shape(cfg, st, 2), cfg.torch_dtype, tracer=Probe(),
                            track_activations=True)
    sync = GradSync([p for c in chunks for p in c.parameters()], st)
    engine.run(lambda i: micro[i], grad_sync=sync)
    sync.remove_hooks()
    layout = StageLayout(tp=1, dp=1, pp=1, sequence_parallel=False, micro_batch_size=2,
                         partition=(cfg.num_units,), recompute=pipe.recompute)
    saved = chunk_saved_bytes(layout, cfg, 0, MemorySettings(device="cpu"))
    wgrad = chunk_wgrad_bytes(layout, cfg, 0)
    size = bytes_size(lambda r: saved, lambda r: wgrad)
    level, walk = 0.0, []
    holds = holding_events(sched.actions[0], 0)
    for i in range(len(sched.actions[0])):
        level += sum(size(h) for h in holds if h.index == i)
        walk.append(level)
    assert live == walk
    assert engine.store.peak_bytes == max(walk) and wgrad[0] != saved[0]


def _cp_mismatches(state: ParallelState, tp: int, cp: int, sp: bool, share: tuple[int, int] = (0, 1)) -> list[str]:
    """As _mismatches, on a context-parallel rank (its chunks of the sequence; no attention dropout under cp; a2a
    only where a tensor-parallel rank's heads split over cp, as run_parts requires). `share` (k, n): the k-th of n
    interleaved shares of the variants."""
    from megatron_bmw.models.chunk import cp_shard

    bad = []
    a2a = state.cp_comm_type == "a2a"
    variants = [v for v in _variants(tp) if v[3] == 0.0 and v[5].get("num_query_groups", 4) % tp == 0
                and not (a2a and v[5].get("num_attention_heads", 4) // tp % cp)][share[0]::share[1]]
    for dtype, backend, rc, hd, _, extra in variants:
        cfg = _cfg(attention_backend=backend, params_dtype=dtype, hidden_dropout=hd, attention_dropout=0.0, **extra)
        recompute = recompute_from_flags(rc, None, None, cfg.num_layers, [list(range(cfg.num_units))])
        units = build_units(cfg, state, 1, recompute=recompute)
        params = [p for u in units.values() for p in u.parameters()] + [units["embedding"].word_embeddings.weight]
        choice = dict(zip(units, recompute or (None,) * cfg.num_units))
        batch = cp_shard(_batch(MBS), cp, state.cp_rank)
        seq = SEQ // cp // (tp if sp else 1)
        for name, unit in units.items():
            hidden = None if name == "embedding" else torch.randn(seq, MBS, 24, dtype=dtype, requires_grad=True)
            saved, _ = measure_saved(lambda: unit(hidden, batch), params)
            predicted = sum(t.nbytes for t in unit_saved_tensors(unit_kind(name), cfg, MBS, tp, sp, choice[name], "cpu",
                                                                 cp, state.cp_comm_type))
            if predicted != saved.total:
                bad.append(f"cp={cp} tp={tp} sp={sp} {state.cp_comm_type} {dtype} {backend} {rc} hd={hd} {extra} "
                           f"{name}: predicted {predicted}, measured {saved.total}")
    return bad


def _cp_body(rank, world_size, layouts, shared):
    out = []
    for i, (tp, cp, sp, comm) in enumerate(layouts):
        state = ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp, context_parallel_size=cp,
                                                   sequence_parallel=sp, cp_comm_type=comm))
        out += _cp_mismatches(state, tp, cp, sp, (i, len(layouts)) if shared else (0, 1))
        state.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts,shared", [
    (2, [(1, 2, False, "p2p"), (1, 2, False, "a2a")], False),
    # 4 ranks on 2 cores: each layout takes an interleaved third of the variants (MBMW_EXHAUSTIVE=1: all of them)
    (4, [(2, 2, True, "p2p"), (1, 4, False, "p2p"), (2, 2, False, "a2a")], os.environ.get("MBMW_EXHAUSTIVE") != "1"),
])
def test_saved_bytes_context_parallel_exact(world, layouts, shared):
    """The memory model byte for byte against what a context-parallel rank's units save (p2p ring and a2a): every
    variant at cp 2, both transports; at cp 4 and with tp 2 each layout a share of them."""
    assert run_distributed(world, _cp_body, layouts, shared) == [[]] * world


# MoE units (docs/moe.md): (MoEConfig settings, model settings). Every variant runs in fp32 and bf16, with both
# dispatchers and no, selective and full recomputation; the planner is given the routing each unit really took.
MOE_VARIANTS = (
    (dict(), dict()),  # softmax over the k, top-2, GeLU, biases, hidden dropout
    (dict(router_topk=1, pre_softmax=True, aux_loss_coeff=0.01), dict(hidden_dropout=0.0)),
    (dict(score_function="sigmoid", aux_loss_coeff=0.01, z_loss_coeff=0.001), dict()),
    (dict(score_function="sigmoid", router_topk=1, load_balancing_type="seq_aux_loss", aux_loss_coeff=0.1), dict()),
    (dict(shared_expert_intermediate_size=32), LLAMA_VARIANTS[0]),  # SwiGLU, RMSNorm, no biases
    (dict(shared_expert_intermediate_size=32), LLAMA_VARIANTS[-1]),  # the same, SwiGLU unfused
    (dict(shared_expert_intermediate_size=16, shared_expert_gate=True, ffn_hidden_size=12), dict()),  # bf16: a loop
    (dict(expert_capacity_factor=0.5), LLAMA_VARIANTS[0]),  # probs drop
    (dict(expert_capacity_factor=0.75, token_drop_policy="position"), dict()),
    (dict(expert_capacity_factor=0.5, pad_expert_input_to_capacity=True, pre_softmax=True), dict()),
    (dict(router_topk=1, load_balancing_type="sinkhorn"), dict(add_bias_linear=False)),
)


def _moe_mismatches(state: ParallelState, tp: int, sp: bool, cp: int = 1, dtypes=(torch.float32, torch.bfloat16),
                    rcs=(None, "selective", "full")) -> list[str]:
    """Every MoE unit of every MoE variant on this rank: predicted saved bytes (for the routing it took: its local
    experts' rows and the pairs it routed) vs measured; returns the differences."""
    from megatron_bmw.config import MoEConfig
    from megatron_bmw.models.chunk import cp_shard
    from megatron_bmw.planner.moe_model import Experts

    bad = []
    ep, etp = state.ep_size, state.etp_size
    for (kw, extra), dtype, dispatcher, rc in itertools.product(MOE_VARIANTS, dtypes, ("allgather", "alltoall"), rcs):
        if etp > 1 and extra.get("add_bias_linear", True):
            continue  # expert biases are refused with etp > 1 (run_parts.check_moe)
        moe = MoEConfig(**{"num_experts": 4, "ffn_hidden_size": 16, "token_dispatcher_type": dispatcher, **kw})
        cfg = _cfg(params_dtype=dtype, attention_dropout=0.0, **{"hidden_dropout": 0.1, **extra, "moe": moe})
        recompute = recompute_from_flags(rc, None, None, cfg.num_layers, [list(range(cfg.num_units))])
        units = build_units(cfg, state, 1, recompute=recompute)
        params = [p for u in units.values() for p in u.parameters()]
        choice = dict(zip(units, recompute or (None,) * cfg.num_units))
        batch = cp_shard(_batch(MBS), cp, state.cp_rank) if cp > 1 else _batch(MBS)
        for name, unit in units.items():
            if unit_kind_of(cfg, name) != "moe":
                continue
            loads, sent = _record_routing(unit)
            hidden = torch.randn(SEQ // cp // (tp if sp else 1), MBS, 24, dtype=dtype, requires_grad=True)
            saved, _ = measure_saved(lambda: unit(hidden, batch), params)
            experts = Experts(ep, etp, loads=tuple(loads[0]), sent=sent[0])
            predicted = sum(t.nbytes for t in unit_saved_tensors("moe", cfg, MBS, tp, sp, choice[name], "cpu", cp,
                                                                 experts=experts))
            if predicted != saved.total:
                bad.append(f"tp={tp} sp={sp} cp={cp} ep={ep} etp={etp} {dtype} {dispatcher} {rc} {kw} {extra} {name}: "
                           f"predicted {predicted}, measured {saved.total} (loads {loads[0]}, sent {sent[0]})")
    return bad


def _record_routing(unit) -> tuple[list, list]:
    """Lists filled as `unit` runs: its local experts' rows (per expert) and the (token, expert) pairs it routes."""
    loads, sent = [], []
    experts, route = unit.experts.forward, unit.route

    def run_experts(rows, counts):
        loads.append(counts.tolist())
        return experts(rows, counts)

    def routed(*args):
        probs, routing_map = route(*args)
        sent.append(int(routing_map.sum()))
        return probs, routing_map

    unit.experts.forward, unit.route = run_experts, routed
    return loads, sent


def test_saved_bytes_moe_exact():
    """The memory model byte for byte against what an MoE unit saves on one rank (ep 1, etp 1)."""
    assert _moe_mismatches(ParallelState.serial(), 1, False) == []


def _moe_body(rank, world_size, layouts):
    out = []
    for tp, sp, cp, ep, etp in layouts:
        state = ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp, sequence_parallel=sp,
                                                   context_parallel_size=cp, expert_model_parallel_size=ep,
                                                   expert_tensor_parallel_size=etp))
        out += _moe_mismatches(state, tp, sp, cp, rcs=(None, "full"))
        state.destroy()
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world,layouts", [
    # (tp, sp, cp, ep, etp): ep2 with dp2; etp2 (tp2 + SP); tp2 without SP (each tp rank routes half), ep2; cp2, ep2
    (2, [(1, False, 1, 2, 1), (2, True, 1, 1, 2), (2, False, 1, 2, 1), (1, False, 2, 2, 1)]),
    # ep2 x tp2 + SP (etp2); ep4 beside tp2 + SP; ep2 x cp2 x tp2 + SP
    (4, [(2, True, 1, 2, 2), (2, True, 1, 4, 1), (2, True, 2, 2, 1)]),
])
def test_saved_bytes_moe_expert_parallel_exact(world, layouts):
    """The memory model byte for byte against what the MoE units of expert-parallel ranks save (gloo)."""
    assert run_distributed(world, _moe_body, layouts) == [[]] * world


NEMOTRON_340B = dict(num_layers=96, hidden_size=18432, num_attention_heads=96, num_query_groups=8,
                     ffn_hidden_size=73728, seq_length=4096, vocab_size=256000, position_embedding_type="rope",
                     untie_embeddings_and_output_weights=True, add_bias_linear=False, params_dtype="bf16",
                     attention_backend="flash", hidden_dropout=0.0, attention_dropout=0.0)


def test_transformer_engine_attention_term_by_term():
    """Megatron-core/NeMo's TE attention at tp 8 with SP, no dropout (unit_activations.py's module doc), in units
    of the rank's sbh/t bf16 bytes: LN input and ln_out on s/t rows (1 + 1), q (1), grouped k and v (1/12 each:
    8 groups of 96 heads), the core's output (1), fp32 softmax statistics; no rope cos/sin per layer."""
    model = ModelConfig(**NEMOTRON_340B)
    unit = 4096 * 18432 // 8 * 2
    got = {t.name: t.nbytes for t in unit_saved_tensors("attention", model, 1, 8, True, te=True)}
    assert got == {"layernorm input": unit, "layernorm statistics": 2 * 512 * 4, "ln_out (qkv input)": unit,
                   "query": unit, "keys (grouped)": unit // 12, "values (grouped)": unit // 12,
                   "attention output (output projection input)": unit, "softmax statistics (fp32)": 12 * 4096 * 4}
    ours = {t.name for t in unit_saved_tensors("attention", model, 1, 8, True)}
    assert {"rotary angles (fp32)", "keys repeated over the group"} <= ours  # what TE does not save (fused rope: the
    # angles per layer, TE's the chunk's shared frequencies)
    mlp = unit_saved_tensors("mlp", model, 1, 8, True, te=True)
    assert sum(t.nbytes for t in mlp) == 2 * unit + 2 * 512 * 4 + 2 * 4 * unit  # LN in, ln_out, fc1 out, act out
    # recomputation, context parallelism and the unfused core keep our runtime's count
    for kw in (dict(recompute="selective"), dict(cp=2)):
        assert unit_saved_tensors("attention", model, 1, 8, True, te=True, **kw) == \
            unit_saved_tensors("attention", model, 1, 8, True, **kw)


@pytest.mark.parametrize("pp,v,nodes,engine,fits", [
    (8, 12, 16, "nemo", True), (16, 2, 32, "nemo", True), (16, 6, 32, "nemo", True),
    (4, None, 16, "nemo", False), (4, 12, 16, "nemo", False), (8, 12, 16, "megatron-core", False)])
def test_nemotron_340b_runs_fit_and_too_big_ones_do_not(capsys, pp, v, nodes, engine, fits):
    """The published tp 8 x pp 8 (v 12) and pp 16 NeMo runs fit 80 GiB; pp 4, and Megatron-core's fp32 gradient
    buffer at pp 8, do not. The first rank's peak is Megatron's interleaved warm-up."""
    import json

    from megatron_bmw.cli.autoconfig import main

    argv = ["estimate", "--cluster", "h100-80g-ib", "--num-nodes", str(nodes), "--num-layers", "96",
            "--hidden-size", "18432", "--num-attention-heads", "96", "--group-query-attention", "--num-query-groups",
            "8", "--ffn-hidden-size", "73728", "--seq-length", "4096", "--vocab-size", "256000",
            "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
            "--bf16", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", str(pp),
            "--sequence-parallel", "--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size",
            "64", "--engine", engine, "--tp-comm-overlap", "--attention-backend", "flash", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--json"] + (["--virtual-pipeline-model-parallel-size", str(v)] if v else [])
    assert main(argv) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert all(s["fits"] for s in stages) == fits
    # the first rank holds Megatron's interleaved warm-up, (p - 1) 2 + (v - 1) p chunk forwards, and one more
    assert stages[0]["peak_inflight_microbatches"] == (2 * (pp - 1) + ((v or 1) - 1) * pp + 1 if v else pp)


def test_squared_relu_saved_bytes_backward_and_elementwise():
    """--squared-relu saves GeLU's bytes (relu's output, the square's output); its backward holds one temporary
    more (pow_backward); its two kernels move 4F forward and 10F backward where bias-GeLU moves 2F and 3F."""
    from megatron_bmw.planner.elementwise import unit_elementwise_bytes
    from megatron_bmw.planner.unit_activations import unit_backward_bytes

    gelu, squared = _cfg(add_bias_linear=False), _cfg(add_bias_linear=False, squared_relu=True)
    names = [t.name for t in unit_saved_tensors("mlp", squared, MBS, 2, True)]
    assert "relu output" in names and "squared relu output (fc2 input)" in names
    assert sum(t.nbytes for t in unit_saved_tensors("mlp", squared, MBS, 2, True)) == \
        sum(t.nbytes for t in unit_saved_tensors("mlp", gelu, MBS, 2, True))
    f = SEQ * MBS * 96 // 2 * 4  # s b f/t elements in fp32
    assert unit_backward_bytes("mlp", squared, MBS, 2, True) - unit_backward_bytes("mlp", gelu, MBS, 2, True) == f
    (gf, gb), (qf, qb) = (unit_elementwise_bytes("mlp", m, MBS, 2, True) for m in (gelu, squared))
    assert (qf - gf, qb - gb) == (2 * f, 7 * f)


LLAMA3_8B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
                 seq_length=4096, vocab_size=128256, position_embedding_type="rope", swiglu=True,
                 normalization="RMSNorm", add_bias_linear=False, params_dtype="bf16", attention_backend="flash", hidden_dropout=0.0,
                 attention_dropout=0.0, untie_embeddings_and_output_weights=True)


def test_fused_swiglu_and_rope_save_less_llama3_8b():
    """Llama-3-8B at tp 1, micro-batch 1, sequence 4096, bf16: the fused SwiGLU keeps fc1's output and not silu's
    (s f e less), the fused rope one fp32 angles tensor for q and k where the unfused ops keep cos and sin for each
    (3 s r x 4 less); the fused SwiGLU's backward holds the product's gradient and dz only (one s f e less). Per
    layer 594.5 MiB fused, 712.5 MiB unfused."""
    from megatron_bmw.planner.unit_activations import unit_backward_bytes

    fused = ModelConfig(**LLAMA3_8B)
    unfused = ModelConfig(**LLAMA3_8B, bias_swiglu_fusion=False, apply_rope_fusion=False)
    s, f, r, e = 4096, 14336, 128, 2
    on, off = layer_activation_bytes(fused, 1), layer_activation_bytes(unfused, 1)
    assert off - on == s * f * e + 3 * s * r * 4
    assert (on, off) == (594.53125 * 2**20, 712.53125 * 2**20)
    assert unit_backward_bytes("mlp", unfused, 1) - unit_backward_bytes("mlp", fused, 1) == s * f * e
    names = {t.name for k in ("attention", "mlp") for t in unit_saved_tensors(k, fused, 1)}
    assert "rotary angles (fp32)" in names and "silu output" not in names
