"""Model-state bytes per parameter for every engine setting (hand-computed), and plans for other engines."""

import json
from dataclasses import replace

import pytest

from megatron_bmw.arguments import apply_plan, configs_from_args, parse_args
from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.pipeline.build import build_schedule
from megatron_bmw.planner.engine import EngineConfig, engine_from_flags
from megatron_bmw.planner.memory_model import StageLayout, rank_memory, total_parameters
from megatron_bmw.planner.plan import Plan
from megatron_bmw.planner.spec import RunSpec

# (engine, --accumulate-allreduce-grads-in-fp32 (None: the engine's default), dtype, ZeRO-1) ->
# (param, grad, optimizer) bytes per parameter at dp 4
CASES = [
    # ours: fp32 main grads always; fp32 master (for fp32 under ZeRO-1 too) + two fp32 moments
    ("megatron_bmw", None, "bf16", False, (2, 4, 12)),
    ("megatron_bmw", None, "bf16", True, (2, 4, 12 / 4)),
    ("megatron_bmw", None, "fp32", False, (4, 4, 8)),
    ("megatron_bmw", None, "fp32", True, (4, 4, 12 / 4)),
    ("megatron_bmw", True, "fp16", False, (2, 4, 12)),
    # Megatron Core's distributed-optimizer table: fp16/fp16 20 (4 + 16/d), bf16/fp32 18 (6 + 12/d), fp32 16 (8 + 8/d)
    ("megatron-core", None, "fp16", False, (2, 2, 16)),
    ("megatron-core", None, "fp16", True, (2, 2, 16 / 4)),
    ("megatron-core", True, "fp16", False, (2, 4, 12)),
    ("megatron-core", None, "bf16", False, (2, 4, 12)),
    ("megatron-core", None, "bf16", True, (2, 4, 12 / 4)),
    ("megatron-core", False, "bf16", False, (2, 2, 16)),
    ("megatron-core", None, "fp32", False, (4, 4, 8)),
    ("megatron-core", None, "fp32", True, (4, 4, 8 / 4)),
    # NeMo's distributed_fused_adam (Apex): bf16 params and grad buffer; int16 remainder + fp32 moments sharded
    ("nemo", None, "bf16", False, (2, 2, 10)),
    ("nemo", None, "bf16", True, (2, 2, 10 / 4)),
    # DeepSpeed ZeRO-0/1, fp16: fp16 grads; fp32 master, fp32 grad copy and moments (a partition of them at stage 1)
    ("deepspeed", None, "fp16", False, (2, 2, 16)),
    ("deepspeed", None, "fp16", True, (2, 2, 16 / 4)),
    # BF16_Optimizer: bf16 grads and a whole fp32 accumulator; fp32 master and moments (a partition at stage 1)
    ("deepspeed", None, "bf16", False, (2, 6, 12)),
    ("deepspeed", None, "bf16", True, (2, 6, 12 / 4)),
]


@pytest.mark.parametrize("engine,fp32,dtype,zero1,expected", CASES)
def test_state_bytes_per_parameter(engine, fp32, dtype, zero1, expected):
    p = EngineConfig(engine, fp32).precision(dtype, zero1)
    assert (p.param_bytes, p.grad_bytes, p.optimizer_bytes(4)) == pytest.approx(expected)
    assert p.state_bytes(4) == pytest.approx(sum(expected))


def test_rank_memory_follows_the_engine():
    model = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=8,
                        params_dtype="fp16")
    layout = StageLayout(tp=1, dp=2, pp=1, sequence_parallel=False, micro_batch_size=1, partition=(6,))
    sched = build_schedule(PipelineConfig(micro_batch_size=1, num_microbatches=2), 1)
    n = total_parameters(model)
    ours = rank_memory(layout, model, sched, 0, EngineConfig().precision("fp16", False))
    core = rank_memory(layout, model, sched, 0, EngineConfig("megatron-core").precision("fp16", True))
    assert (ours.params_bytes, ours.grads_bytes, ours.optimizer_bytes) == (2 * n, 4 * n, 12 * n)
    assert (core.params_bytes, core.grads_bytes, core.optimizer_bytes) == (2 * n, 2 * n, 16 * n / 2)
    assert core.activation_bytes == ours.activation_bytes


@pytest.mark.parametrize("flags,needle", [
    (("megatron_bmw", False, True), "megatron_bmw accumulates and reduces gradients in fp32"),
    (("megatron-core", True, True), "contradict"),
    (("deepspeed", True, False), "Megatron-LM's"),
    (("nemo", True, False), "grad_sync_dtype, bf16"),
])
def test_engine_flags_that_cannot_hold(flags, needle):
    with pytest.raises(UsageError, match=needle):
        engine_from_flags(*flags)
    with pytest.raises(UsageError, match="modelled for --fp16 and --bf16"):
        EngineConfig("deepspeed").precision("fp32", False)


MODEL = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16,
                    params_dtype="bf16")


def test_nemo_is_bf16_only_and_overlaps_like_megatron_core():
    for dtype in ("fp16", "fp32"):
        with pytest.raises(UsageError, match="engine nemo: memory is modelled for --bf16"):
            EngineConfig("nemo").precision(dtype, True)
    assert EngineConfig("nemo", tp_comm_overlap=True).megatron_core_runtime
    assert EngineConfig("nemo").grad_reduction("bf16", True) == (2.0, True)


def _plan(engine: EngineConfig) -> Plan:
    spec = RunSpec.of(MODEL, tp=1, pp=1, dp=1, pipeline=PipelineConfig(micro_batch_size=1, num_microbatches=2))
    return Plan(spec, global_batch_size=2, orig_vocab_size=100, make_vocab_size_divisible_by=128, engine=engine)


def test_plans_carry_the_engine_and_our_runtime_refuses_others(tmp_path):
    path = tmp_path / "plan.json"
    core = EngineConfig("megatron-core", False)
    _plan(core).save(str(path))
    data = json.loads(path.read_text())
    assert data["training"]["engine"] == "megatron-core"
    assert data["training"]["accumulate_allreduce_grads_in_fp32"] is False
    assert Plan.load(str(path)).engine == core
    argv = ["--plan", str(path), "--mock-data"]
    with pytest.raises(UsageError, match="planned for engine megatron-core with --grad-reduce-in-bf16"):
        apply_plan(parse_args(argv), argv)
    overlapped = EngineConfig("megatron-core", tp_comm_overlap=True)
    _plan(overlapped).save(str(path))
    assert json.loads(path.read_text())["training"]["tp_comm_overlap"] is True
    assert Plan.load(str(path)).engine == overlapped
    _plan(EngineConfig()).save(str(path))  # ours: the default, written as before
    training = json.loads(path.read_text())["training"]
    assert "accumulate_allreduce_grads_in_fp32" not in training and "gradient_accumulation_fusion" not in training
    assert apply_plan(parse_args(argv), argv).engine == EngineConfig()
    unfused = EngineConfig(gradient_accumulation_fusion=False)
    _plan(unfused).save(str(path))
    assert json.loads(path.read_text())["training"]["gradient_accumulation_fusion"] is False
    assert apply_plan(parse_args(argv), argv).engine == unfused
    assert not configs_from_args(parse_args(argv), 1, plan=Plan.load(str(path))).train.gradient_accumulation_fusion
    _plan(EngineConfig()).save(str(path))
    with pytest.raises(UsageError, match="--no-gradient-accumulation-fusion disagrees with --plan"):
        apply_plan(parse_args(argv + ["--no-gradient-accumulation-fusion"]), argv + ["--no-gradient-accumulation-fusion"])


@pytest.mark.parametrize("training,needle", [
    ({"accumulate_allreduce_grads_in_fp32": False}, "engine megatron_bmw accumulates and reduces gradients in fp32"),
    ({"engine": "megatron"}, "training.engine must be one of"),
    ({"engine": "deepspeed", "accumulate_allreduce_grads_in_fp32": True}, "Megatron-LM's flag"),
    ({"engine": "megatron-core", "accumulate_allreduce_grads_in_fp32": "yes"}, "must be true or false"),
    ({"tp_comm_overlap": True}, "engine megatron_bmw does not overlap tensor-parallel communication"),
    ({"engine": "megatron-core", "tp_comm_overlap": 1}, "must be true or false"),
    ({"gradient_accumulation_fusion": "off"}, "training.gradient_accumulation_fusion must be true or false"),
])
def test_a_plan_file_with_an_engine_setting_that_cannot_hold(tmp_path, training, needle):
    data = _plan(EngineConfig()).to_json()
    data["training"].update(training)
    with pytest.raises(UsageError) as err:
        Plan.from_json(data, "--plan p.json")
    assert needle in str(err.value) and "\n" not in str(err.value) and str(err.value).startswith("--plan p.json")


def test_estimate_flags(capsys):
    from megatron_bmw.cli.autoconfig import main

    base = ["estimate", "--cluster", "a100-80g-ib", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "200", "--micro-batch-size", "2",
            "--global-batch-size", "16", "--fp16", "--use-distributed-optimizer", "--json"]
    got = {}
    for extra in ((), ("--engine", "megatron-core"), ("--engine", "megatron-core",
                                                      "--accumulate-allreduce-grads-in-fp32")):
        assert main(base + list(extra)) == 0
        got[extra] = json.loads(capsys.readouterr().out)["engine"]["state_bytes_per_parameter"]
    assert list(got.values()) == pytest.approx([2 + 4 + 12 / 8, 2 + 2 + 16 / 8, 2 + 4 + 12 / 8])
    with pytest.raises(SystemExit) as exc:
        main(base + ["--grad-reduce-in-bf16"])
    assert exc.value.code == 2 and "megatron_bmw accumulates" in capsys.readouterr().err


def test_the_search_counts_the_engines_states_and_the_layouts_allowance():
    from megatron_bmw.planner.cluster import parse_cluster
    from megatron_bmw.planner.cuda_allowance import DerivedAllowance, allowance_terms
    from megatron_bmw.planner.memory_model import MemorySettings
    from megatron_bmw.planner.search import search
    from megatron_bmw.planner.space import SearchSpace

    model = replace(MODEL, num_layers=4, params_dtype="fp16", vocab_size=256, hidden_dropout=0.0,
                    attention_dropout=0.0)
    cluster = parse_cluster({
        "name": "tiny", "inter_node": {"bandwidth_GBps": 0.5, "latency_us": 50},
        "device_types": {"d": {"memory_gb": 4, "peak_tflops": {"fp16": 0.05}, "memory_bandwidth_GBps": 20}},
        "groups": [{"nodes": 1, "gpus_per_node": 2, "device": "d", "intra_node": {"bandwidth_GBps": 2}}]})
    space = SearchSpace(tp=(1,), pp=(2,), mbs=(1,), schedule=("1f1b",), slicing=(False,), zero1=(False,))
    got = {}
    for engine in (EngineConfig(), EngineConfig("megatron-core")):
        settings = MemorySettings(device="cuda", engine=engine, derived=DerivedAllowance((cluster.groups[0].device,)))
        best = search(model, 256, 8, 4, cluster, space=space, memory=settings).best
        got[engine.name] = m = best.evaluation.memory[0]
        spec = best.spec
        terms = allowance_terms(cluster.groups[0].device, spec.model, spec.tp, spec.dp, spec.pp, 1, False,
                                engine.precision("fp16", False))
        assert m.allowance_bytes == pytest.approx(terms.workspace + terms.fragmentation * (
            m.static_bytes + m.activation_bytes + m.transient_bytes))
    ours, core = got["megatron_bmw"], got["megatron-core"]
    assert core.grads_bytes == ours.grads_bytes / 2 and core.optimizer_bytes == ours.optimizer_bytes * 16 / 12


def test_a_search_for_another_engine_plans_only_what_it_runs(tmp_path, capsys):
    from megatron_bmw.cli.autoconfig import main

    out = tmp_path / "plan.json"
    base = ["search", "--cluster", "a100-80g-ib", "--num-layers", "4", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "32", "--vocab-size", "200", "--global-batch-size", "16",
            "--fp16", "--world-size", "8", "--no-progress", "--space", "tp=1,2", "--space", "pp=2,4"]
    assert main(base + ["--engine", "megatron-core", "--output", str(out)]) == 0
    assert "pretrain_gpt.py refuses it" in capsys.readouterr().out
    plan = json.loads(out.read_text())
    pipe = plan["pipeline"]
    assert pipe["schedule"] in ("1f1b", "interleaved") and not pipe.get("bpipe") and not pipe.get("slicing")
    bounds = [sum(pipe["partition"][:k + 1]) for k in range(len(pipe["partition"]) - 1)]
    assert all(b % 2 == 1 for b in bounds)  # stages end at layer boundaries (after an MLP unit)
    rc = pipe.get("recompute") or [None] * 10
    assert len(set(rc[1:-1:2])) == 1 and len(set(rc[2:-1:2])) == 1  # one recomputation for all layers
    with pytest.raises(SystemExit) as exc:
        main(base + ["--engine", "megatron-core", "--space", "schedule=zb-h1"])
    assert exc.value.code == 2 and "runs only 1f1b, interleaved" in capsys.readouterr().err


def _simulated(flags):
    from megatron_bmw.cli.autoconfig import simulate_flags

    base = ["--cluster", "a100-80g-ib", "--num-nodes", "1", "--num-layers", "6", "--hidden-size", "256",
            "--num-attention-heads", "4", "--seq-length", "256", "--vocab-size", "1000", "--bf16",
            "--micro-batch-size", "1", "--pipeline-model-parallel-size", "4", "--global-batch-size", "8"]
    return simulate_flags(base + flags)[0]


def test_megatron_core_stages_may_hold_the_embedding_or_the_head_alone():
    """--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split: 6 layers + 2 ends over
    4 stages of two; a stage ending inside a layer is still refused."""
    assert _simulated(["--engine", "megatron-core", "--pipeline-partition", "3,4,4,3"]).simulation.iteration_time > 0
    interleaved = ["--engine", "megatron-core", "--virtual-pipeline-model-parallel-size", "2",
                   "--pipeline-partition", "1,2,2,2,2,2,2,1"]
    assert _simulated(interleaved).simulation.iteration_time > 0
    with pytest.raises(UsageError, match="starts a stage at mlp_0"):
        _simulated(["--engine", "megatron-core", "--pipeline-partition", "2,5,4,3"])


def test_megatron_cores_own_schedules_wait_for_their_sends():
    """Megatron-LM's 1F1B waits for each batch of sends (planner/evaluate.compiled_for): slower than the same
    schedule with our engine's transfers beside the compute, on the same durations; the zero-bubble schedules (the
    ZB authors' fork) are simulated with theirs."""
    from megatron_bmw.planner.evaluate import compiled_for, simulate_run

    ev = _simulated(["--engine", "megatron-core", "--pipeline-partition", "3,4,4,3"])
    core = ev.cost.settings.engine
    assert core.synchronous_p2p("1f1b") and core.synchronous_p2p("interleaved")
    assert not core.synchronous_p2p("zb-h1") and not EngineConfig().synchronous_p2p("1f1b")
    free = simulate_run(ev.spec, ev.cost.cluster, None, ev.cost.settings, schedule=compiled_for(
        build_schedule(ev.spec.pipeline, ev.spec.pp), EngineConfig()))
    assert ev.simulation.iteration_time > free.simulation.iteration_time
    zb = _simulated(["--engine", "megatron-core", "--pipeline-partition", "3,4,4,3", "--pipeline-schedule", "zb-h1"])
    assert zb.simulation.iteration_time < ev.simulation.iteration_time


def test_megatron_core_reduce_scatters_the_embedding_under_sequence_parallelism():
    """VocabParallelEmbedding with reduce_scatter_embeddings: half an all-reduce's bytes; ours all-reduces, then
    splits the sequence."""
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "1"]
    base = ["--cluster", "a100-80g-ib", "--num-nodes", "1", "--num-layers", "2", "--hidden-size", "256",
            "--num-attention-heads", "4", "--seq-length", "256", "--vocab-size", "1000", "--bf16",
            "--micro-batch-size", "1", "--global-batch-size", "8"]
    from megatron_bmw.cli.autoconfig import simulate_flags

    core = simulate_flags(base + flags + ["--engine", "megatron-core"])[0].cost.tp_comm("embedding", 0)[0]
    ours = simulate_flags(base + flags)[0].cost.tp_comm("embedding", 0)[0]
    assert 0 < core < 0.75 * ours
