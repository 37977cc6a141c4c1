"""The plan file: JSON round trip, clear errors for bad files, and the flags given beside --plan."""

import argparse
import json
import os
from dataclasses import replace

import pytest

from megatron_bmw.arguments import apply_plan, configs_from_args, parse_args
from megatron_bmw.config import ModelConfig, PipelineConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.planner.plan import Plan
from megatron_bmw.planner.spec import RunSpec, spec_from_run_config

MODEL = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                    params_dtype="bf16")
RECOMPUTE = (None, "selective", "full", None, None, "full", "full", None, None, None)


def _plan() -> Plan:
    pipe = PipelineConfig(micro_batch_size=2, num_microbatches=4, schedule="1f1b", partition=(4, 6),
                          recompute=RECOMPUTE, slicing=1)
    spec = RunSpec.of(MODEL, tp=2, pp=2, dp=2, pipeline=pipe, sequence_parallel=True, distributed_optimizer=True,
                   overlap_grad_reduce=True)
    return Plan(spec, global_batch_size=16, orig_vocab_size=100, make_vocab_size_divisible_by=32, devices=["a100-80g"] * 8,
                cluster={"name": "a100-80g-ib"}, prediction={"iteration_time_s": 1.5, "stages": []})


def test_round_trip(tmp_path):
    path = tmp_path / "plan.json"
    plan = _plan()
    plan.save(str(path))
    again = Plan.load(str(path))
    assert again.spec == plan.spec and again.global_batch_size == 16 and again.orig_vocab_size == 100
    assert again.devices == plan.devices and again.prediction == plan.prediction
    data = json.loads(path.read_text())
    assert data["pipeline"]["recompute"][:3] == ["none", "selective", "full"]
    # --cross-entropy-loss-fusion travels with the model; a plan written before the field runs unfused
    assert data["model"]["cross_entropy_loss_fusion"] is False
    for value in (True, None):
        data["model"]["cross_entropy_loss_fusion"] = value
        if value is None:
            del data["model"]["cross_entropy_loss_fusion"]
        path.write_text(json.dumps(data))
        assert Plan.load(str(path)).spec.model.cross_entropy_loss_fusion is bool(value)
    # the kernel fusions are the model's (the memory model counts what they save): an unfused plan stays unfused
    unfused = Plan(RunSpec.of(replace(MODEL, bias_swiglu_fusion=False, apply_rope_fusion=False), tp=2, pp=2, dp=2,
                              pipeline=plan.spec.pipeline), global_batch_size=16, orig_vocab_size=100,
                   make_vocab_size_divisible_by=32)
    unfused.save(str(path))
    model = Plan.load(str(path)).spec.model
    assert (model.bias_swiglu_fusion, model.apply_rope_fusion) == (False, False) and model == unfused.spec.model


@pytest.mark.parametrize("mutate,needle", [
    (lambda d: d.update(format="other"), "not a plan file"),
    (lambda d: d.update(version=7), "plan version 7"),
    (lambda d: d["model"].update(colour=1), "unknown model key 'colour'"),
    (lambda d: d["pipeline"].update(stages=3), "unknown pipeline key 'stages'"),
    (lambda d: d["pipeline"].update(recompute=["full"] * 10), "embedding and the head are never recomputed"),
    (lambda d: d["pipeline"].update(partition=[5, 6]), "sums to 11"),
    (lambda d: d["training"].update(global_batch_size=12), "training.global_batch_size 12 is not"),
    (lambda d: d.pop("parallel"), "missing field 'parallel'"),
])
def test_bad_plan_files(tmp_path, mutate, needle):
    data = _plan().to_json()
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=needle):
        Plan.load(str(path))
        RunSpec  # noqa: B018 - the partition is checked when the spec is built


def _set(section, key, value):
    def mutate(d):
        (d if section is None else d[section])[key] = value
    return mutate


# The adversarial probe's plan edits (#28): each named the field? Wrong types crashed, some values were taken as
# they came, others were blamed on flags the user never gave.
@pytest.mark.parametrize("mutate,field", [
    (_set(None, "training", [16]), "training"),
    (_set("training", "global_batch_size", "16"), "training.global_batch_size"),
    (_set("training", "distributed_optimizer", "yes"), "training.distributed_optimizer"),
    (_set(None, "make_vocab_size_divisible_by", "32"), "make_vocab_size_divisible_by"),
    (_set(None, "make_vocab_size_divisible_by", 0), "make_vocab_size_divisible_by"),
    (_set(None, "cluster", "a100"), "cluster"),
    (_set(None, "devices", "a100-80g"), "devices"),
    (_set(None, "devices", ["a100-80g"] * 3), "devices"),
    (_set(None, "orig_vocab_size", "100"), "orig_vocab_size"),
    (_set(None, "orig_vocab_size", 1000), "model.vocab_size"),
    (_set(None, "prediction", 1.5), "prediction"),
    (_set(None, "search", [1]), "search"),
    (_set(None, "profiles", {"a": 1}), "profiles"),
    (_set(None, "profiles", [1, 2]), "profiles"),
    (_set("parallel", "rank_order", "bogus"), "parallel.rank_order"),
    (_set("parallel", "sequence_parallel", 1), "parallel.sequence_parallel"),
    (_set("parallel", "tensor_model_parallel_size", 3), "model.num_attention_heads"),
    (_set("parallel", "tensor_model_parallel_size", 0), "parallel.tensor_model_parallel_size"),
    (_set("parallel", "tensor_model_parallel_size", 2.0), "parallel.tensor_model_parallel_size"),
    (_set("parallel", "data_parallel_size", 0), "parallel.data_parallel_size"),
    (_set("parallel", "data_parallel_size", 4), "training.global_batch_size"),
    (_set("parallel", "pipeline_model_parallel_size", 4), "pipeline.partition"),
    (_set("parallel", "unit_strategies", "tp2"), "parallel.unit_strategies"),
    (_set("parallel", "colour", 1), "unknown parallel key 'colour'"),
    (_set("pipeline", "bpipe", "yes"), "pipeline.bpipe"),
    (_set("pipeline", "partition", [4, -6]), "pipeline.partition"),
    (_set("pipeline", "partition", "4,6"), "pipeline.partition"),
    (_set("pipeline", "partition", [10]), "pipeline.partition"),
    (_set("pipeline", "micro_batch_size", 0), "pipeline.micro_batch_size"),
    (_set("pipeline", "micro_batch_size", "2"), "pipeline.micro_batch_size"),
    (_set("pipeline", "num_microbatches", None), "pipeline.num_microbatches"),
    (_set("pipeline", "slicing", 9), "pipeline.slicing"),
    (_set("pipeline", "slicing", "some"), "pipeline.slicing"),
    (_set("pipeline", "schedule", "zb"), "pipeline.schedule"),
    (_set("pipeline", "schedule", "zbv"), "pipeline.virtual_stages"),
    (_set("pipeline", "recompute", "full"), "pipeline.recompute"),
    (_set("model", "num_layers", 0), "model.num_layers"),
    (_set("model", "num_layers", 5), "pipeline.partition"),
    (_set("model", "num_layers", "4"), "model.num_layers"),
    (_set("model", "hidden_size", 66), "model.hidden_size"),
    (_set("model", "hidden_dropout", 1.0), "model.hidden_dropout"),
    (_set("model", "layernorm_epsilon", -1), "model.layernorm_epsilon"),
    (_set("model", "params_dtype", "fp8"), "model.params_dtype"),
    (_set("model", "seq_length", 64), "model.seq_length"),
    (_set("model", "max_position_embeddings", 16), "model.seq_length"),
    (_set("model", "untie_embeddings_and_output_weights", "no"), "model.untie_embeddings_and_output_weights"),
    (_set(None, "extra", 1), "unknown top-level key 'extra'"),
    (_set("model", "swiglu", "yes"), "model.swiglu"),
    (_set("model", "num_query_groups", 3), "model.num_query_groups"),
    (_set("model", "qk_layernorm", 1), "model.qk_layernorm"),
    (_set("model", "normalization", "BatchNorm"), "model.normalization"),
    (_set("model", "num_query_groups", 0), "model.num_query_groups"),
])
def test_every_plan_field_is_checked_by_name(tmp_path, mutate, field):
    data = _plan().to_json()
    mutate(data)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError) as err:
        Plan.load(str(path))
    message = str(err.value)
    assert message.startswith(f"--plan {path}: ") and field in message and "\n" not in message, message
    assert "--" not in message.replace("--plan", ""), message  # no flag the user never gave


def test_unreadable_plan_files(tmp_path):
    with pytest.raises(UsageError, match="no such file"):
        Plan.load(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(UsageError, match="not valid JSON"):
        Plan.load(str(tmp_path / "bad.json"))
    with pytest.raises(UsageError, match="is a directory"):
        Plan.load(str(tmp_path))


def _args(tmp_path, *extra):
    path = tmp_path / "plan.json"
    _plan().save(str(path))
    argv = ["--plan", str(path), "--mock-data", *extra]
    args = parse_args(argv)
    return args, apply_plan(args, argv)


def test_the_run_takes_the_plans_own_configs(tmp_path):
    args, plan = _args(tmp_path, "--train-iters", "3", "--tensor-model-parallel-size", "2", "--bf16")
    run = configs_from_args(args, 8, plan=plan)
    assert run.pipeline is plan.spec.pipeline and run.model is plan.spec.model  # no round trip through flags
    assert args.pipeline_partition is None and args.num_layers != plan.spec.model.num_layers  # flags not rewritten
    assert run.parallel.tensor_model_parallel_size == 2 and run.parallel.sequence_parallel
    assert run.optimizer.use_distributed_optimizer and run.train.overlap_grad_reduce
    assert run.model.params_dtype == "bf16" and run.model.vocab_size == 128 and run.orig_vocab_size == 100


@pytest.mark.parametrize("extra,needle", [
    (["--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size 4 disagrees with --plan"),
    (["--micro-batch-size", "1"], "--micro-batch-size 1 disagrees"),
    (["--bpipe"], "--bpipe disagrees with --plan .* \\(off\\)"),
    (["--fp16"], "--fp16 disagrees"),
    (["--recompute-granularity", "full"], "sets the pipeline and every unit's recomputation"),
    (["--num-layers-per-virtual-pipeline-stage", "1"], "drop the flag"),
    (["--swiglu"], "--swiglu disagrees with --plan .* \\(off\\)"),
    (["--qk-layernorm"], "--qk-layernorm disagrees with --plan"),
    (["--use-rotary-position-embeddings"], "--use-rotary-position-embeddings disagrees"),
    (["--group-query-attention", "--num-query-groups", "2"], "disagrees with --plan"),
    (["--normalization", "RMSNorm"], "--normalization RMSNorm disagrees with --plan .* \\(LayerNorm\\)"),
    (["--cross-entropy-loss-fusion"], "--cross-entropy-loss-fusion disagrees with --plan .* \\(off\\)"),
    (["--no-rope-fusion"], "--no-rope-fusion disagrees with --plan .* \\(on\\)"),
    (["--no-bias-swiglu-fusion"], "--no-bias-swiglu-fusion disagrees with --plan"),
])
def test_disagreeing_flags(tmp_path, extra, needle):
    with pytest.raises(UsageError, match=needle):
        _args(tmp_path, *extra)


def test_world_size_and_vocabulary_must_match(tmp_path):
    args, plan = _args(tmp_path)
    assert configs_from_args(args, 8, plan=plan).orig_vocab_size == 100
    with pytest.raises(UsageError, match="planned for 8 ranks .* launched with 4"):
        configs_from_args(args, 4, plan=plan)
    with pytest.raises(UsageError, match="padded vocabulary of 128"):
        configs_from_args(argparse.Namespace(**{**vars(args), "vocab_size": 300}), 8, plan=plan)
    with pytest.raises(UsageError, match="--rampup-batch-size: --plan .* fixes the micro-batches"):
        configs_from_args(argparse.Namespace(**{**vars(args), "rampup_batch_size": [8, 8, 100]}), 8, plan=plan)


def test_the_planners_view_of_the_run_is_the_plans(tmp_path):
    from megatron_bmw.planner.spec import spec_from_run_config

    args, plan = _args(tmp_path)
    assert spec_from_run_config(configs_from_args(args, 8, plan=plan), 8) == plan.spec


def test_bert_flags_beside_a_plan_must_agree(tmp_path):
    """The plan's model is the run's: a BERT model flag that differs from it is refused, not ignored."""
    from megatron_bmw.arguments import build_parser

    path = tmp_path / "plan.json"
    _plan().save(str(path))
    argv = ["--plan", str(path), "--mock-data", "--bert-no-binary-head"]
    parser = build_parser(model_type="bert")
    with pytest.raises(UsageError, match="^--bert-no-binary-head disagrees with --plan .* \\(on\\)$"):
        apply_plan(parse_args(argv, parser), argv, parser)


def test_megatron_choices_are_checked_beside_a_plan(tmp_path):
    args, plan = _args(tmp_path, "--ckpt-format", "zarr")
    with pytest.raises(UsageError, match="--ckpt-format zarr: not supported"):
        configs_from_args(args, 8, plan=plan)
    args, plan = _args(tmp_path, "--ckpt-format", "torch_dist")  # a plan runs with the layout-free format
    assert configs_from_args(args, 8, plan=plan).train is not None


def test_a_plans_unit_strategies_are_checked_as_the_flags_are(tmp_path):
    model = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32)
    spec = RunSpec.of(model, tp=1, pp=1, dp=4, pipeline=PipelineConfig(micro_batch_size=2, num_microbatches=1),
                   unit_strategies=("tp4", "dp4", "dp4", "dp4", "dp4", "dp4"))
    path = tmp_path / "plan.json"
    Plan(spec, global_batch_size=8, orig_vocab_size=128).save(str(path))
    argv = ["--plan", str(path), "--mock-data"]
    args = parse_args(argv)
    with pytest.raises(UsageError, match="a tied word embedding needs the same, unsharded strategy"):
        configs_from_args(args, 4, plan=apply_plan(args, argv))


def test_a_zero_bubble_plan_runs_as_planned_and_is_refused_where_the_flags_are(tmp_path):
    """A plan carries its schedule: zb-h1 round-trips and runs, with recomputation and dropout too."""
    from dataclasses import replace

    from megatron_bmw.arguments import plan_flags

    base = _plan()
    path = tmp_path / "zb.json"
    for model, recompute, needle in ((replace(MODEL, hidden_dropout=0.0, attention_dropout=0.0), RECOMPUTE, None),
                                     (MODEL, None, None), (MODEL, RECOMPUTE, None)):
        pipe = replace(base.spec.pipeline, schedule="zb-h1", slicing=0, recompute=recompute)
        plan = replace(base, spec=replace(base.spec, model=model, pipeline=pipe))
        plan.save(str(path))
        assert Plan.load(str(path)).spec.pipeline.schedule == "zb-h1"
        assert plan_flags(plan)["pipeline_schedule"] == "zb-h1"
        argv = ["--plan", str(path), "--mock-data", "--train-iters", "3"]
        args = parse_args(argv)
        if needle is None:
            assert configs_from_args(args, 8, plan=apply_plan(args, argv)).pipeline.schedule == "zb-h1"
        else:
            with pytest.raises(UsageError, match=needle):
                configs_from_args(args, 8, plan=apply_plan(args, argv))


def test_a_plan_written_before_the_run_schema_still_loads_and_runs(tmp_path):
    """tests/planner/data/plan_written_at_a4b9409.json: `autoconfig.py search` at commit a4b9409, before the
    configs declared their flags and RunSpec held the ParallelConfig; it loads, and a run lays it over its flags."""
    path = os.path.join(os.path.dirname(__file__), "data", "plan_written_at_a4b9409.json")
    old = json.load(open(path))
    plan = Plan.load(path)
    assert (plan.spec.tp, plan.spec.pp, plan.spec.dp) == tuple(old["parallel"][k] for k in (
        "tensor_model_parallel_size", "pipeline_model_parallel_size", "data_parallel_size"))
    assert plan.spec.pipeline.micro_batch_size == old["pipeline"]["micro_batch_size"]
    again = tmp_path / "again.json"
    plan.save(str(again))
    assert Plan.load(str(again)).spec == plan.spec
    argv = ["--plan", path, "--mock-data", "--train-iters", "2", "--seq-length", "1024"]
    run = configs_from_args(parse_args(argv), plan.spec.world_size, plan=plan)
    assert spec_from_run_config(run, plan.spec.world_size) == plan.spec


def test_a_zb_2p_plan_hands_the_run_its_stage_times(tmp_path):
    """The times a ZB-2p plan was searched with reach the run's PipelineConfig, so every rank builds its order."""
    from dataclasses import replace

    from megatron_bmw.pipeline.build import build_schedule

    base = _plan()
    times = ((0.5, 0.6, 0.3, 0.01), (0.9, 1.0, 0.4, 0.0))
    pipe = replace(base.spec.pipeline, schedule="zb-2p", slicing=0, schedule_times=times)
    plan = replace(base, spec=replace(base.spec, pipeline=pipe))
    path = tmp_path / "zb2p.json"
    plan.save(str(path))
    assert json.loads(path.read_text())["pipeline"]["schedule_times"] == [list(t) for t in times]
    argv = ["--plan", str(path), "--mock-data", "--train-iters", "3"]
    args = parse_args(argv)
    run = configs_from_args(args, 8, plan=apply_plan(args, argv)).pipeline
    assert run.schedule == "zb-2p" and run.schedule_times == times
    assert build_schedule(run, 2).to_text(comm=True) == build_schedule(pipe, 2).to_text(comm=True)


def test_a_zbv_plan_hands_the_run_its_v_layout(tmp_path):
    """A searched ZB-V plan (2p stages, two chunks per rank in a V) reaches the run as planned: schedule zbv,
    virtual stages 2, placement v, its partition per virtual stage; rank 0 builds the embedding's and the head's
    chunks (pretrain_gpt.py --plan)."""
    from dataclasses import replace

    from megatron_bmw.pipeline.partition import rank_chunks

    base = _plan()
    part = (2, 1, 2, 1, 1, 1, 1, 1)  # 10 units; rank 0: stages 0 and 7, rank 1: 1 and 6, ...
    pipe = replace(base.spec.pipeline, schedule="zbv", virtual_stages=2, slicing=0, partition=part, recompute=None)
    plan = replace(base, spec=RunSpec.of(MODEL, tp=2, pp=4, dp=1, pipeline=pipe, sequence_parallel=True),
                   global_batch_size=8)
    path = tmp_path / "zbv.json"
    plan.save(str(path))
    loaded = json.loads(path.read_text())["pipeline"]
    assert (loaded["schedule"], loaded["virtual_stages"]) == ("zbv", 2)
    argv = ["--plan", str(path), "--mock-data", "--train-iters", "3"]
    args = parse_args(argv)
    run = configs_from_args(args, 8, plan=apply_plan(args, argv)).pipeline
    assert (run.schedule, run.virtual_stages, run.placement, run.partition) == ("zbv", 2, "v", part)
    assert rank_chunks(list(part), 4, 0, run.placement) == [[0, 1], [9]]
