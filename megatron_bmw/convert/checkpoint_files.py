"""Our checkpoints as the Hugging Face converters write and read them (training/checkpointing.py's layout).

    save_release(save, full, args, tp=2, pp=2)   # <save>/release/mp_rank_TT[_PPP]/model_optim_rng.pt + tracker
    full, args = load_full(load)                 # any tp x pp (x virtual stages) checkpoint -> one state dict

Pipeline stages hold units named globally (units.attn_3...), so merging is a union over stages of the tensor-
parallel merges; the tied output-weight copy of a last stage is dropped. Hybrid (--unit-strategies) checkpoints
are refused.

With experts over ep > 1 ranks (docs/moe.md) the files are Megatron's `mp_rank_TT[_PPP]_EEE`: ep rank EEE's file
of tp rank TT holds its tp shard of every dense tensor and experts EEE * E/ep ... of every MoE unit, split over
the experts' tensor-parallel ranks as over tp (etp = tp; Megatron's legacy files have one tp index). A name with
two numbers is (tp, pp) or (tp, ep) as the args' sizes say.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from typing import Any

import torch

from ..errors import UsageError
from ..pipeline.partition import default_partition, rank_chunks
from ..safe_load import Foreign, load_file
from ..training.checkpointing import MODEL_FILE, RELEASE, TRACKER, is_dist_checkpoint, mp_rank_dir_name
from ..units import owns_output_weight, unit_names
from .tp_shards import join_experts, merge_shards, shard_state_dict, split_experts

CHECKPOINT_VERSION = 3.0
WORD_EMBEDDING = "units.embedding.word_embeddings.weight"
OUTPUT_WEIGHT = "units.head.output_weight"
_MP_DIR = re.compile(r"mp_rank_(\d{2})((?:_\d{3}){0,2})")


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    """Megatron's directory of a (tp, pp, ep) rank: `_PPP` only with pp > 1, `_EEE` only with ep > 1."""
    return mp_rank_dir_name(tp_rank, pp_rank, pp) + (f"_{ep_rank:03d}" if ep > 1 else "")


def expert_sizes(args: Mapping[str, Any], where: str) -> int:
    """The expert-parallel size of a checkpoint's args (1: none), refusing an expert tensor-parallel size other
    than tp (the per-rank files have one tp index)."""
    ep = int(args.get("expert_model_parallel_size") or 1)
    etp = args.get("expert_tensor_parallel_size")
    tp = int(args.get("tensor_model_parallel_size") or 1)
    if etp is not None and int(etp) != tp:
        raise UsageError(f"{where}: expert tensor-parallel size {etp} differs from the tensor-parallel size {tp}; "
                         "the converters read and write per-rank files with etp = tp (save it with --ckpt-format "
                         "torch_dist and convert that to the torch format at etp = tp first)")
    return ep


def _unit(name: str) -> str:
    return name.split(".")[1]


def stage_state_dicts(full: Mapping[str, torch.Tensor], num_layers: int, untied: bool, pp: int
                      ) -> list[dict[str, torch.Tensor]]:
    """The full state dict split into pipeline stages as the runtime builds them (default partition): a tied
    model's last stage holds its copy of the word embeddings as the output weight."""
    names = unit_names(num_layers)
    partition = default_partition(num_layers, pp)
    out = []
    for r in range(pp):
        units = [names[i] for i in rank_chunks(partition, pp, r)[0]]
        sd = {n: t for n, t in full.items() if _unit(n) in units}
        if "head" in units and not untied and owns_output_weight(untied, pp, units):
            sd[OUTPUT_WEIGHT] = full[WORD_EMBEDDING]
        out.append(sd)
    return out


def save_release(save: str, full: Mapping[str, torch.Tensor], args: Mapping[str, Any], tp: int = 1, pp: int = 1,
                 ep: int = 1) -> dict[str, Any]:
    """Write `full` as a `release` checkpoint sharded over tp x pp (x ep for the experts; never over an existing
    checkpoint); returns the args written (`args` + the layout)."""
    if os.path.exists(os.path.join(save, TRACKER)) or glob.glob(os.path.join(save, "iter_*")) \
            or os.path.exists(os.path.join(save, RELEASE)):
        raise UsageError(f"--save {save} already holds a checkpoint; choose a new directory")
    layers, untied = int(args["num_layers"]), bool(args.get("untie_embeddings_and_output_weights"))
    if not 1 <= pp <= layers:
        raise UsageError(f"--pipeline-model-parallel-size {pp}: need 1 to the model's {layers} layers")
    stages = stage_state_dicts(full, layers, untied, pp)
    out = dict(args, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
               pipeline_partition=default_partition(layers, pp))
    if args.get("moe") or ep > 1:
        out.update(expert_model_parallel_size=ep, expert_tensor_parallel_size=tp)
    swiglu = bool(args.get("swiglu"))
    try:
        for r, stage in enumerate(stages):
            for e in range(ep):
                local = split_experts(stage, ep, e)
                for t in range(tp):
                    d = os.path.join(save, RELEASE, rank_dir_name(t, r, pp, e, ep))
                    os.makedirs(d, exist_ok=True)
                    torch.save({"model": shard_state_dict(local, tp, t, swiglu=swiglu), "args": dict(out),
                                "iteration": 0, "checkpoint_version": CHECKPOINT_VERSION}, os.path.join(d, MODEL_FILE))
        with open(os.path.join(save, TRACKER), "w") as f:
            f.write(RELEASE + "\n")
    except OSError as exc:
        raise UsageError(f"--save {save}: cannot write: {exc}") from None
    return out


def _iteration_dir(load: str) -> str:
    if not os.path.isdir(load):
        raise UsageError(f"--load {load} is not a directory")
    tracker = os.path.join(load, TRACKER)
    if not os.path.isfile(tracker):
        raise UsageError(f"--load {load} has no {TRACKER}")
    with open(tracker) as f:
        tag = f.read().strip()
    if tag == RELEASE:
        it_dir = os.path.join(load, RELEASE)
    elif tag.isdigit():
        it_dir = os.path.join(load, f"iter_{int(tag):07d}")
    else:
        raise UsageError(f"--load: {tracker} holds {tag!r}, expected 'release' or an iteration number")
    if not os.path.isdir(it_dir):
        raise UsageError(f"--load: checkpoint directory {it_dir} does not exist")
    return it_dir


def _read(path: str) -> dict:
    """A checkpoint file as data (safe_load: no global outside its allow-list runs); mapped, not read, so the
    optimizer and RNG state a training checkpoint also holds cost no memory."""
    ckpt = load_file(path, "--load", mmap=True)
    if not isinstance(ckpt, dict) or "args" not in ckpt:
        raise UsageError(f"--load: {path} is not a megatron_bmw checkpoint (no 'args')")
    if isinstance(_arg(ckpt["args"], "model_type"), Foreign):  # megatron.core's ModelType enum: Megatron-LM's args
        raise UsageError(f"--load: {path} is a Megatron-LM checkpoint; convert it first with "
                         "tools/checkpoint/convert_megatron.py --direction megatron-to-ours")
    return ckpt


def _arg(args: Any, key: str) -> Any:
    return args.get(key) if isinstance(args, Mapping) else getattr(args, key, None)


def _chunks(payload: Mapping[str, Any], path: str) -> list[dict]:
    """["model"], or the virtual stages' ["model0", "model1", ...]."""
    if "model" in payload:
        return [payload["model"]]
    keys = sorted(int(k[5:]) for k in payload if re.fullmatch(r"model\d+", str(k)))
    if not keys or keys != list(range(len(keys))):
        raise UsageError(f"--load: {path} holds no 'model' (or model0..modelN) weights")
    return [payload[f"model{i}"] for i in keys]


def check_uniform_layout(args: Mapping[str, Any], where: str) -> None:
    """The converters read uniform tp x pp checkpoints: one saved with --unit-strategies is refused."""
    if args.get("unit_strategies"):
        raise UsageError(f"{where}: saved with --unit-strategies (a hybrid layout); the converters read uniform "
                         "tp x pp checkpoints only")


def _rank_grid(it_dir: str) -> tuple[dict[tuple[int, ...], str], dict]:
    """({numbers in the mp_rank name: file}, the payload of the first file) of an iteration directory."""
    grid: dict[tuple[int, ...], str] = {}
    for entry in os.listdir(it_dir):
        m = _MP_DIR.fullmatch(entry)
        if m:
            rest = tuple(int(x) for x in m.group(2).split("_")[1:])
            grid[(int(m.group(1)),) + rest] = os.path.join(it_dir, entry, MODEL_FILE)
    if not grid:
        if is_dist_checkpoint(it_dir):
            raise UsageError(f"--load: {it_dir} is a torch_dist checkpoint; convert it to the torch format first "
                             "(pretrain_gpt.py --load ... --ckpt-convert-format torch --ckpt-convert-save DIR)")
        raise UsageError(f"--load: {it_dir} has no mp_rank_* directories")
    if len({len(k) for k in grid}) > 1:
        raise UsageError(f"--load: {it_dir} mixes mp_rank directory styles (mp_rank_TT, _PPP, _EEE)")
    return grid, _read(grid[min(grid)])


def _by_rank(grid: dict[tuple[int, ...], str], tp: int, pp: int, ep: int, it_dir: str) -> dict[tuple[int, int, int], str]:
    """The files keyed (tp, pp, ep), reading each name's numbers as the args' sizes say (Megatron writes `_PPP` only
    with pp > 1 and `_EEE` only with ep > 1)."""
    fields = [f for f, size in (("pp", pp), ("ep", ep)) if size > 1]
    out = {}
    for key, path in grid.items():
        if len(key) != 1 + len(fields):
            raise UsageError(f"--load: args say pipeline and expert parallel sizes ({pp}, {ep}) but {it_dir} holds "
                             f"{os.path.basename(os.path.dirname(path))}")
        named = dict(zip(fields, key[1:]))
        out[key[0], named.get("pp", 0), named.get("ep", 0)] = path
    want = {(t, r, e) for t in range(tp) for r in range(pp) for e in range(ep)}
    if set(out) != want:
        n = 3 if ep > 1 else 2  # name the expert rank only where there is one
        what = "tensor/pipeline/expert" if ep > 1 else "tensor/pipeline"
        raise UsageError(f"--load: args say {what} parallel sizes {(tp, pp, ep)[:n]} but {it_dir} holds {len(out)} "
                         f"mp_rank directories (missing {[k[:n] for k in sorted(want - set(out))][:3]})")
    return out


def load_full(load: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(full state dict, args) of the checkpoint `<load>/latest_checkpointed_iteration.txt` names, whatever its tp,
    pp, ep and virtual pipeline sizes."""
    it_dir = _iteration_dir(load)
    grid, first = _rank_grid(it_dir)
    args = dict(first["args"]) if isinstance(first["args"], dict) else dict(vars(first["args"]))
    check_uniform_layout(args, f"--load {load}")
    tp = int(args.get("tensor_model_parallel_size") or 1)
    pp = int(args.get("pipeline_model_parallel_size") or 1)
    ep = expert_sizes(args, f"--load {load}")
    files = _by_rank(grid, tp, pp, ep, it_dir)
    first_key = next(k for k, p in files.items() if p == grid[min(grid)])
    swiglu = bool(args.get("swiglu"))
    full: dict[str, torch.Tensor] = {}
    for r in range(pp):
        per_ep = []
        for e in range(ep):
            per_tp = [first if (t, r, e) == first_key else _read(files[t, r, e]) for t in range(tp)]
            chunks = [_chunks(p, files[t, r, e]) for t, p in enumerate(per_tp)]
            if len({len(c) for c in chunks}) != 1:
                raise UsageError(f"--load: the tp ranks of pipeline stage {r} hold different numbers of model chunks")
            per_ep.append([merge_shards([c[i] for c in chunks], swiglu=swiglu) for i in range(len(chunks[0]))])
        if len({len(c) for c in per_ep}) != 1:
            raise UsageError(f"--load: the ep ranks of pipeline stage {r} hold different numbers of model chunks")
        for i in range(len(per_ep[0])):
            for name, tensor in join_experts([c[i] for c in per_ep]).items():
                if name in full:
                    raise UsageError(f"--load: {name} is held by two pipeline stages")
                full[name] = tensor
    if not args.get("untie_embeddings_and_output_weights"):
        full.pop(OUTPUT_WEIGHT, None)  # the last stage's copy of the tied embedding
    return full, args
