"""Every field of a plan file checked before it becomes configs: one line naming the file and the field.

A plan is JSON a user may edit. A wrong type used to crash inside the config classes, a wrong value was blamed on
flags the user never gave (`--tensor-model-parallel-size`), and some were taken as they came (`bpipe: "yes"`)."""

from __future__ import annotations


import dataclasses

from ..config import ModelConfig, ParallelConfig, PipelineConfig, padded_vocab_size
from ..config.codec import check_section, shown as _shown
from ..errors import UsageError
from ..strategy import parse_unit_strategies
from ..units import num_units, parse_recompute
from .engine import ENGINES, OURS


class _Fields:
    """Reads the fields of one plan, naming `where` (the file) and the field's path in every error."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, what: str):
        raise UsageError(f"{self.where}: field {path} {what}")

    def section(self, data: dict, name: str, required: bool = True) -> dict:
        if name not in data:
            if required:
                raise UsageError(f"{self.where}: missing field '{name}'")
            return {}
        if not isinstance(data[name], dict):
            self.fail(name, f"must be a mapping, got {_shown(data[name])}")
        return data[name]

    def integer(self, data: dict, key: str, path: str, low: int, default=..., optional: bool = False):
        value = self._get(data, key, path, default)
        if value is None and optional:
            return None
        if not _is_int(value) or value < low:
            self.fail(path, f"must be an integer >= {low}, got {_shown(value)}")
        return value

    def boolean(self, data: dict, key: str, path: str, default=...) -> bool:
        value = self._get(data, key, path, default)
        if not isinstance(value, bool):
            self.fail(path, f"must be true or false, got {_shown(value)}")
        return value

    def choice(self, data: dict, key: str, path: str, choices, default=...) -> str:
        value = self._get(data, key, path, default)
        if value not in choices:
            self.fail(path, f"must be one of {', '.join(choices)}, got {_shown(value)}")
        return value

    def kind(self, data: dict, key: str, path: str, cls, what: str, default=...):
        value = self._get(data, key, path, default)
        if not isinstance(value, cls):
            self.fail(path, f"must be {what}, got {_shown(value)}")
        return value

    def _get(self, data: dict, key: str, path: str, default):
        if key in data:
            return data[key]
        if default is ...:
            raise UsageError(f"{self.where}: missing field '{path}'")
        return default


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _defaults(cls) -> dict:
    """The defaults of `cls`'s fields that have one (what a plan file may leave out)."""
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


_SECTIONS = {
    "": ("format", "version", "model", "orig_vocab_size", "make_vocab_size_divisible_by", "parallel", "pipeline",
         "training", "devices", "cluster", "profiles", "prediction", "search"),
    "training": ("global_batch_size", "distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather",
                 "engine", "accumulate_allreduce_grads_in_fp32", "tp_comm_overlap", "gradient_accumulation_fusion"),
}


def _check_engine(f: _Fields, training: dict) -> None:
    engine = f.choice(training, "engine", "training.engine", ENGINES, OURS)
    f.boolean(training, "gradient_accumulation_fusion", "training.gradient_accumulation_fusion", True)
    if "tp_comm_overlap" in training:
        f.boolean(training, "tp_comm_overlap", "training.tp_comm_overlap")
        if training["tp_comm_overlap"] and engine not in ("megatron-core", "nemo"):
            f.fail("training.tp_comm_overlap", f"is true, but engine {engine} does not overlap tensor-parallel "
                   "communication (Megatron-core's --tp-comm-overlap)")
    fp32 = training.get("accumulate_allreduce_grads_in_fp32")
    if fp32 is None:
        return
    f.boolean(training, "accumulate_allreduce_grads_in_fp32", "training.accumulate_allreduce_grads_in_fp32")
    if engine == OURS and not fp32:
        f.fail("training.accumulate_allreduce_grads_in_fp32", "is false, but engine megatron_bmw accumulates and "
               "reduces gradients in fp32 (parallel/grad_sync.py)")
    if engine == "deepspeed":
        f.fail("training.accumulate_allreduce_grads_in_fp32", "is Megatron-LM's flag; engine deepspeed is planned "
               "with fp16 gradients")


def check_plan_fields(data: dict, where: str) -> None:
    f = _Fields(where)
    for name, allowed in _SECTIONS.items():
        section = f.section(data, name) if name else data
        extra = sorted(set(section) - set(allowed))
        if extra:
            raise UsageError(f"{where}: unknown {'top-level' if not name else name} key {extra[0]!r}")
    model, parallel, pipeline = _check_model(f, data), _check_parallel(f, data), f.section(data, "pipeline")
    training = f.section(data, "training")
    tp, pp, dp, cp = parallel
    _check_tensor_split(f, model, tp, parallel_sp=data["parallel"].get("sequence_parallel", False), cp=cp)
    _check_vocab(f, data, model, tp)
    _check_pipeline(f, pipeline, model["num_layers"], pp)
    gbs = f.integer(training, "global_batch_size", "training.global_batch_size", 1)
    zero1 = f.boolean(training, "distributed_optimizer", "training.distributed_optimizer", False)
    overlapped = f.boolean(training, "overlap_grad_reduce", "training.overlap_grad_reduce", False)
    if f.boolean(training, "overlap_param_gather", "training.overlap_param_gather", False) and not (zero1 and overlapped):
        f.fail("training.overlap_param_gather", "needs training.distributed_optimizer and training.overlap_grad_reduce")
    _check_engine(f, training)
    if gbs != dp * pipeline["micro_batch_size"] * pipeline["num_microbatches"]:
        f.fail("training.global_batch_size", f"{gbs} is not parallel.data_parallel_size {dp} x "
               f"pipeline.micro_batch_size {pipeline['micro_batch_size']} x pipeline.num_microbatches "
               f"{pipeline['num_microbatches']}")
    strategies = data["parallel"].get("unit_strategies")
    if strategies is not None:
        if not isinstance(strategies, list) or not all(isinstance(s, str) for s in strategies):
            f.fail("parallel.unit_strategies", f"must be a list of strategy strings, got {_shown(strategies)}")
        if tp != 1:
            f.fail("parallel.unit_strategies", "needs parallel.tensor_model_parallel_size 1 (each unit has its own tp)")
        parse_unit_strategies(strategies, num_units(model["num_layers"]), dp, f"{where}: field parallel.unit_strategies")
    devices = f.kind(data, "devices", "devices", list, "a list of device type names", [])
    if not all(isinstance(d, str) for d in devices):
        f.fail("devices", "must be a list of device type names")
    if devices and len(devices) != tp * cp * pp * dp:  # (empty: not recorded)
        with_cp = f" x cp {cp}" if cp > 1 else ""
        f.fail("devices", f"names {len(devices)} devices, but the plan runs on tp {tp}{with_cp} x pp {pp} x dp {dp} = "
               f"{tp * cp * pp * dp} ranks")
    for key in ("cluster", "prediction", "search"):
        f.kind(data, key, key, dict, "a mapping", {})
    profiles = f.kind(data, "profiles", "profiles", list, "a list of mappings", [])
    if not all(isinstance(p, dict) for p in profiles):
        f.fail("profiles", "must be a list of mappings")


def _check_model(f: _Fields, data: dict) -> dict:
    """Each field by its declared type and rules (config/codec.py), then how they fit together."""
    m = {**_defaults(ModelConfig), **check_section(ModelConfig, f.section(data, "model"), f.where, "model")}
    if m["hidden_size"] % m["num_attention_heads"]:
        f.fail("model.hidden_size", f"{m['hidden_size']} is not divisible by model.num_attention_heads "
               f"{m['num_attention_heads']}")
    groups = m.get("num_query_groups") or m["num_attention_heads"]
    if m["num_attention_heads"] % groups:
        f.fail("model.num_query_groups", f"{groups} does not divide model.num_attention_heads "
               f"{m['num_attention_heads']}")
    max_pos = m.get("max_position_embeddings") or m["seq_length"]
    if m["seq_length"] > max_pos:
        f.fail("model.seq_length", f"{m['seq_length']} exceeds model.max_position_embeddings {max_pos}")
    return m


def _check_parallel(f: _Fields, data: dict) -> tuple[int, int, int, int]:
    p = f.section(data, "parallel")
    values = check_section(ParallelConfig, p, f.where, "parallel", exclude=("gpus_per_node",),
                           extra=("data_parallel_size",))
    for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        f.integer(p, key, f"parallel.{key}", 1)  # required here, though the config has a default
    cp = values.get("context_parallel_size", 1)
    if cp > 1 and p.get("unit_strategies") is not None:
        f.fail("parallel.context_parallel_size", f"is {cp}, but per-unit strategies (parallel.unit_strategies) run "
               "whole sequences")
    return values["tensor_model_parallel_size"], values["pipeline_model_parallel_size"], \
        f.integer(p, "data_parallel_size", "parallel.data_parallel_size", 1), cp


def _check_vocab(f: _Fields, data: dict, model: dict, tp: int) -> None:
    multiple = f.integer(data, "make_vocab_size_divisible_by", "make_vocab_size_divisible_by", 1, 128)
    orig = f.integer(data, "orig_vocab_size", "orig_vocab_size", 2, None, optional=True)
    if orig is not None:
        padded = padded_vocab_size(orig, multiple, tp)
        if padded != model["vocab_size"]:
            f.fail("model.vocab_size", f"{model['vocab_size']} is not orig_vocab_size {orig} padded to a multiple of "
                   f"make_vocab_size_divisible_by {multiple} x tp {tp} ({padded})")


def _check_tensor_split(f: _Fields, model: dict, tp: int, parallel_sp, cp: int = 1) -> None:
    ffn = model.get("ffn_hidden_size") or 4 * model["hidden_size"]
    for key, value in (("num_attention_heads", model["num_attention_heads"]), ("hidden_size", model["hidden_size"]),
                       ("ffn_hidden_size", ffn), ("vocab_size", model["vocab_size"])):
        if value % tp:
            f.fail(f"model.{key}", f"{value} does not split over parallel.tensor_model_parallel_size {tp}")
    if cp > 1 and model["seq_length"] % (2 * cp):
        f.fail("parallel.context_parallel_size", f"{cp}: model.seq_length {model['seq_length']} does not split into "
               f"2 x {cp} chunks")
    if cp > 1 and model.get("model_type", "gpt") != "gpt":
        f.fail("parallel.context_parallel_size", f"{cp}: context parallelism splits causal (GPT) sequences")
    if parallel_sp is True and tp > 1 and (model["seq_length"] // cp) % tp:
        f.fail("parallel.sequence_parallel", f"model.seq_length {model['seq_length']}"
               f"{f' / parallel.context_parallel_size {cp}' if cp > 1 else ''} does not split over "
               f"parallel.tensor_model_parallel_size {tp}")


def _check_pipeline(f: _Fields, pl: dict, num_layers: int, pp: int) -> None:
    given = check_section(PipelineConfig, pl, f.where, "pipeline")
    for key in ("micro_batch_size", "num_microbatches"):
        f.integer(pl, key, f"pipeline.{key}", 1)  # required here, though the config has a default
    values = {**_defaults(PipelineConfig), **given}
    mb, n, virtual, schedule = (values[k] for k in ("micro_batch_size", "num_microbatches", "virtual_stages",
                                                     "schedule"))
    if virtual > 1 and schedule == "gpipe":
        f.fail("pipeline.schedule", f"gpipe cannot interleave pipeline.virtual_stages {virtual}")
    if schedule == "zbv" and virtual != 2:
        f.fail("pipeline.virtual_stages", f"is {virtual}, but pipeline.schedule zbv holds 2 model chunks per rank")
    if values["bpipe"] and schedule == "gpipe":
        f.fail("pipeline.bpipe", "works with the 1F1B schedules, not pipeline.schedule gpipe")
    slicing = pl.get("slicing", 0)
    if slicing != "auto" and (not _is_int(slicing) or slicing < 0):
        f.fail("pipeline.slicing", f"must be an integer >= 0 or 'auto', got {_shown(slicing)}")
    if slicing != 0:
        if mb < 2 or mb % 2:
            f.fail("pipeline.slicing", f"halves micro-batches: pipeline.micro_batch_size {mb} must be even")
        if slicing != "auto" and slicing > n:
            f.fail("pipeline.slicing", f"{slicing} is more than pipeline.num_microbatches {n}")
    stages, units = pp * virtual, num_units(num_layers)
    partition = pl.get("partition")
    if partition is None:
        if num_layers < stages:
            f.fail("pipeline.partition", f"is needed: model.num_layers {num_layers} is less than the {stages} "
                   "(virtual) pipeline stages")
    else:
        if not isinstance(partition, list) or not all(_is_int(x) and x >= 1 for x in partition):
            f.fail("pipeline.partition", f"must be a list of unit counts >= 1, got {_shown(partition)}")
        if len(partition) != stages:
            f.fail("pipeline.partition", f"has {len(partition)} entries for parallel.pipeline_model_parallel_size "
                   f"{pp} x pipeline.virtual_stages {virtual} = {stages} stages")
        if sum(partition) != units:
            f.fail("pipeline.partition", f"sums to {sum(partition)}, but model.num_layers {num_layers} makes {units} "
                   "units (embedding + 2 per layer + head)")
    recompute = pl.get("recompute")
    if recompute is not None and not isinstance(recompute, list):
        f.fail("pipeline.recompute", f"must be a list (none, selective or full per unit), got {_shown(recompute)}")
    parse_recompute(recompute, units, f"{f.where}: field pipeline.recompute")
