"""Convert checkpoints between Megatron-LM (--ckpt-format torch, megatron-core GPT) and megatron_bmw, both ways.

    python tools/checkpoint/convert_megatron.py --direction megatron-to-ours --load-dir megatron_ckpt/ \\
        --save-dir ours_ckpt/ [--target-tensor-parallel-size 2 --target-pipeline-model-parallel-size 2 \\
        --target-pipeline-partition 5,5]
    python tools/checkpoint/convert_megatron.py --direction ours-to-megatron --load-dir ours_ckpt/ \\
        --save-dir megatron_ckpt/ [--megatron-layer-spec local | --ckpt-format torch_dist]

Models: megatron-core GPTs with GPT-2-style layers, and Llama-style ones (rope, --swiglu, --group-query-attention,
RMSNorm, --disable-bias-linear, --qk-layernorm, --apply-layernorm-1p, untied output), in the names of either layer
spec (Transformer Engine's fused norms, or local).

Weights only: optimizer state, RNG state and the LR schedule are not converted. The iteration and the consumed
samples are kept, so training continues from the result with --no-load-optim --no-load-rng (or starts afresh with
--finetune). The tensor/pipeline shards of the source are merged and split again for the target layout (default:
the source's). Reads the checkpoint named by <load-dir>/latest_checkpointed_iteration.txt, in either format
(a torch_dist source, ours or megatron-core's, is read whole; megatron-core's --ckpt-format torch_dist is written
with --ckpt-format torch_dist, convert/mcore_dist.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import sys
from typing import Any

import torch

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_bmw.errors import OneLineParser, UsageError, exit_on_usage_error
from megatron_bmw.convert.megatron import read_megatron, read_ours, write_megatron, write_ours
from megatron_bmw.convert.megatron_args import args_dict
from megatron_bmw.convert.megatron_moe import DIST, EXPERT_LAYOUTS
from megatron_bmw.convert.megatron_layout import Layout, Model, Target, megatron_stage_layers, retarget
from megatron_bmw.convert.megatron_names import MEGATRON_SPECS
from megatron_bmw.convert.mcore_dist import (
    mcore_dist_from_payload, payload_from_mcore_dist, payload_from_ours_dist, write_mcore,
)
from megatron_bmw.pipeline.partition import default_partition
from megatron_bmw.safe_load import load_file

TRACKER = "latest_checkpointed_iteration.txt"
RANK_FILE = "model_optim_rng.pt"
DIST_COMMON = "common.pt"
CKPT_FORMATS = ("torch", "torch_dist")
DIRECTIONS = ("megatron-to-ours", "ours-to-megatron")
_RANK_DIR = re.compile(r"mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.split("\n\n")[0],
                epilog="Weights only: no optimizer or RNG state is written; continue training from the result with "
                       "--no-load-optim --no-load-rng, or fine-tune with --finetune.")
    p.add_argument("--direction", required=True, choices=DIRECTIONS)
    p.add_argument("--load-dir", required=True,
                   help="checkpoint directory to read (its tracker file names the iteration)")
    p.add_argument("--save-dir", required=True, help="directory to write the converted checkpoint into")
    p.add_argument("--target-tensor-parallel-size", type=int, default=None, help="default: the source's")
    p.add_argument("--target-pipeline-model-parallel-size", type=int, default=None, help="default: the source's")
    p.add_argument("--target-virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline rank (default: the source's when the pipeline size is kept, else 1)")
    p.add_argument("--target-pipeline-partition", default=None,
                   help="units per (virtual) pipeline stage, as pretrain_gpt.py's --pipeline-partition (units are "
                        "[embedding, attn_0, mlp_0, ..., head]); Megatron stages must hold whole layers. Default: "
                        "the source's when the layout's stage count is kept, else the default split")
    p.add_argument("--ckpt-format", default="torch", choices=CKPT_FORMATS,
                   help="ours-to-megatron: the Megatron-LM format written (default torch; torch_dist: "
                        "megatron-core's dist_checkpointing layout, model weights only). Sources of either format "
                        "are recognised by themselves")
    p.add_argument("--megatron-layer-spec", default="transformer_engine", choices=MEGATRON_SPECS,
                   help="ours-to-megatron: the parameter names of Megatron's --transformer-impl (default "
                        "transformer_engine)")
    p.add_argument("--target-expert-model-parallel-size", type=int, default=None,
                   help="MoE: ranks the experts are split over (default: the source's)")
    p.add_argument("--megatron-expert-layout", default="sequential", choices=EXPERT_LAYOUTS,
                   help="ours-to-megatron, MoE: Megatron's experts module: sequential (SequentialMLP, the default), "
                        "te_grouped (--moe-grouped-gemm with Transformer Engine) or legacy_grouped "
                        "(--moe-use-legacy-grouped-gemm); megatron-to-ours reads any by its names")
    p.add_argument("--true-vocab-size", type=int, default=None,
                   help="the tokenizer's vocabulary size, needed to re-pad the vocabulary when the tensor-parallel "
                        "size changes and the checkpoint does not record it")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=None,
                   help="vocabulary padding multiple (default: the checkpoint's, else inferred)")
    p.add_argument("--tokenizer-type", default=None,
                   help="ours-to-megatron: tokenizer_type recorded in Megatron's args (default: the checkpoint's, "
                        "else GPT2BPETokenizer; Megatron compares it when given --vocab-file)")
    return p


# ----------------------------------------------------------------------------------------------------------------
# Reading checkpoint directories


def _torch_load(path: str, where: str) -> Any:
    """A checkpoint file as data (safe_load: Megatron's classes as inert stand-ins, any other global refused in one
    line before anything in the file runs), mapped rather than read where torch's zip format allows."""
    return load_file(path, where, mmap=True)


def read_tracker(load_dir: str) -> int | str:
    if not os.path.isdir(load_dir):
        raise UsageError(f"--load-dir {load_dir} is not a directory")
    path = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(path):
        raise UsageError(f"--load-dir {load_dir} has no {TRACKER}")
    with open(path) as f:
        text = f.read().strip()
    if text == "release":
        return text
    if not text.isdigit():
        raise UsageError(f"--load-dir: {path} holds {text!r}, not an iteration number or 'release'")
    return int(text)


def iteration_dir_name(iteration: int | str) -> str:
    return "release" if iteration == "release" else f"iter_{int(iteration):07d}"


def rank_dir_name(tp_rank: int, pp_rank: int, pp: int, ep_rank: int = 0, ep: int = 1) -> str:
    name = f"mp_rank_{tp_rank:02d}" if pp == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name + (f"_{ep_rank:03d}" if ep > 1 else "")


def _rank_keys(paths: dict[tuple[int, ...], str], first: dict) -> dict[tuple, str]:
    """Directory numbers -> (tp, pp) keys, or (tp, pp, ep) with experts over ep > 1 ranks: Megatron writes `_PPP` only
    with pp > 1 and `_EEE` only with ep > 1, so a name with two numbers is read by the args' sizes."""
    a = args_dict(first.get("args"))
    pp, ep = int(a.get("pipeline_model_parallel_size") or 1), int(a.get("expert_model_parallel_size") or 1)
    fields = [f for f, size in (("pp", pp), ("ep", ep)) if size > 1]
    out: dict[tuple, str] = {}
    for numbers, path in paths.items():
        if len(numbers) != 1 + len(fields):
            raise UsageError(f"--load-dir: {os.path.basename(os.path.dirname(path))} does not fit the args' pipeline "
                             f"and expert parallel sizes ({pp}, {ep})")
        named = dict(zip(fields, numbers[1:]))
        key = (numbers[0], named.get("pp", 0))
        out[key + ((named["ep"],) if ep > 1 else ())] = path
    return out


def read_checkpoint_dir(load_dir: str) -> tuple[dict[tuple, dict], int | str]:
    """({(tp_rank, pp_rank[, ep_rank]): payload}, iteration) of the checkpoint the tracker names."""
    iteration = read_tracker(load_dir)
    it_dir = os.path.join(load_dir, iteration_dir_name(iteration))
    if not os.path.isdir(it_dir):
        raise UsageError(f"--load-dir: the tracker names {iteration}, but {it_dir} does not exist")
    entries = sorted(os.listdir(it_dir))
    paths: dict[tuple[int, ...], str] = {}
    for e in entries:
        m = _RANK_DIR.fullmatch(e)
        if m:
            paths[tuple(int(g) for g in m.groups() if g is not None)] = os.path.join(it_dir, e, RANK_FILE)
    if not paths:
        if ".metadata" in entries:
            return {(0, 0): _dist_payload(it_dir)}, iteration
        raise UsageError(f"--load-dir: {it_dir} has no mp_rank_* directories")
    if len({len(k) for k in paths}) > 1:
        raise UsageError(f"--load-dir: {it_dir} mixes mp_rank directory styles")
    payloads = {}
    for numbers, path in sorted(paths.items()):
        if not os.path.isfile(path):
            raise UsageError(f"--load-dir: missing {path}")
        payload = _torch_load(path, "--load-dir")
        if not isinstance(payload, dict):
            raise UsageError(f"--load-dir: {path} holds a {type(payload).__name__}, not a checkpoint dict")
        payloads[numbers] = payload
    keys = _rank_keys(paths, payloads[min(payloads)])
    by_path = {path: numbers for numbers, path in paths.items()}
    return {key: payloads[by_path[path]] for key, path in keys.items()}, iteration


def _dist_payload(it_dir: str) -> dict:
    """A torch_dist iteration directory, megatron-core's (metadata.json) or ours, as one rank's payload."""
    common_path = os.path.join(it_dir, DIST_COMMON)
    if not os.path.isfile(common_path):
        raise UsageError(f"--load-dir: {it_dir} is a torch_dist checkpoint without {DIST_COMMON}")
    where = f"--load-dir: torch_dist checkpoint {it_dir}"
    common = _torch_load(common_path, where)
    if not isinstance(common, dict):
        raise UsageError(f"--load-dir: {common_path} holds a {type(common).__name__}, not a dict")
    if os.path.isfile(os.path.join(it_dir, "metadata.json")):
        return payload_from_mcore_dist(it_dir, common, where)
    if common.get("checkpoint_format") == "torch_dist":
        return payload_from_ours_dist(it_dir, common, where)
    raise UsageError(f"--load-dir: {it_dir} is neither a megatron-core torch_dist checkpoint (no metadata.json) "
                     "nor one of ours")


# ----------------------------------------------------------------------------------------------------------------
# Writing


def _publish(save_dir: str, iteration: int | str, write_into) -> str:
    """`write_into(tmp)` fills a temporary iteration directory, renamed into place before the tracker names it;
    returns the iteration directory. A directory that already holds a checkpoint is refused."""
    final = os.path.join(save_dir, iteration_dir_name(iteration))
    if os.path.exists(final) or os.path.exists(os.path.join(save_dir, TRACKER)):
        raise UsageError(f"--save-dir {save_dir} already holds a checkpoint; choose a new directory")
    tmp = f"{final}.tmp-convert"
    try:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        write_into(tmp)
        os.rename(tmp, final)
        with open(os.path.join(save_dir, TRACKER), "w") as f:
            f.write(f"{iteration}\n")
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"--save-dir {save_dir}: cannot write: {exc}") from None
    return final


def write_dist_checkpoint_dir(save_dir: str, payload: dict, iteration: int | str) -> str:
    """megatron-core's torch_dist directory for a tp 1 pp 1 Megatron payload, then the tracker."""
    flat, common = mcore_dist_from_payload(payload)
    return _publish(save_dir, iteration, lambda tmp: write_mcore(tmp, flat, common))


def write_checkpoint_dir(save_dir: str, files: dict[tuple, dict], iteration: int | str, pp: int, ep: int = 1) -> str:
    """Write one model_optim_rng.pt per (tp, pp[, ep]) rank and then the tracker; returns the iteration directory."""

    def write_into(tmp: str) -> None:
        for key, payload in sorted(files.items()):
            d = os.path.join(tmp, rank_dir_name(key[0], key[1], pp, key[2] if len(key) == 3 else 0, ep))
            os.makedirs(d, exist_ok=True)
            torch.save(payload, os.path.join(d, RANK_FILE))

    return _publish(save_dir, iteration, write_into)


# ----------------------------------------------------------------------------------------------------------------
# Conversion


def convert(direction: str, load_dir: str, save_dir: str, target: Target, spec: str = "transformer_engine",
            tokenizer_type: str | None = None, ckpt_format: str = "torch", experts: str = "sequential"
            ) -> tuple[Model, Layout]:
    """Read `load_dir`, convert, write `save_dir`; returns the model written and its layout."""
    if direction not in DIRECTIONS:
        raise UsageError(f"--direction must be one of {', '.join(DIRECTIONS)}")
    to_megatron = direction == "ours-to-megatron"
    dist_out = ckpt_format == "torch_dist"
    if dist_out:
        if not to_megatron:
            raise UsageError("--ckpt-format torch_dist names the Megatron-LM checkpoint written by --direction "
                             "ours-to-megatron; megatron-to-ours reads either format by itself")
        given = [f for f, v in (("--target-tensor-parallel-size", target.tp),
                                ("--target-pipeline-model-parallel-size", target.pp),
                                ("--target-virtual-pipeline-model-parallel-size", target.virtual),
                                ("--target-pipeline-partition", target.partition),
                                ("--target-expert-model-parallel-size", target.ep)) if v is not None]
        if given:
            raise UsageError(f"{given[0]}: a torch_dist checkpoint has no parallel layout (Megatron-LM loads it "
                             "at any)")
        target = dataclasses.replace(target, tp=1, pp=1, virtual=1, partition=None, ep=1)
        experts = DIST  # every expert in one stacked tensor per layer, as megatron-core's torch_dist names them
    files, iteration = read_checkpoint_dir(load_dir)
    read = read_ours if to_megatron else read_megatron
    model = read(files, iteration=iteration, where=f"--load-dir {load_dir}")
    del files
    if dist_out and model.layout.tp != 1 and target.true_vocab_size is None \
            and target.make_vocab_size_divisible_by is None:
        model.layout = dataclasses.replace(model.layout, tp=1)  # keep the padded vocabulary as it is
    model, layout = retarget(model, target, to_megatron=to_megatron)
    out = write_megatron(model, layout, spec, tokenizer_type, experts) if to_megatron else write_ours(model, layout)
    if dist_out:
        write_dist_checkpoint_dir(save_dir, out[0, 0], iteration)
    else:
        write_checkpoint_dir(save_dir, out, iteration, layout.pp, layout.ep)
    return model, layout


def _moe_flags(cfg: dict, layout: Layout, experts: str | None = None) -> str:
    """The expert-parallel size (and Megatron's experts module) a run of the converted MoE checkpoint takes."""
    if not cfg.get("moe"):
        return ""
    grouped = {"te_grouped": " --moe-grouped-gemm",
               "legacy_grouped": " --moe-grouped-gemm --moe-use-legacy-grouped-gemm"}.get(experts or "", "")
    return f" --expert-model-parallel-size {layout.ep}{grouped}"


def _summary(direction: str, save_dir: str, model: Model, layout: Layout, ckpt_format: str = "torch",
             experts: str = "sequential") -> list[str]:
    cfg = model.config
    if ckpt_format == "torch_dist":
        return [f"wrote {save_dir}: Megatron-LM torch_dist checkpoint at iteration {model.iteration}, "
                f"{cfg['num_layers']} layers, padded vocabulary {cfg['vocab_size']} (weights only)",
                "load it in Megatron-LM with --ckpt-format torch_dist --no-load-optim --no-load-rng"]
    lines = [f"wrote {save_dir}: {'Megatron-LM' if direction == 'ours-to-megatron' else 'megatron_bmw'} checkpoint "
             f"at iteration {model.iteration}, {layout.describe()}, {cfg['num_layers']} layers, "
             f"padded vocabulary {cfg['vocab_size']} (weights only)"]
    if direction == "ours-to-megatron":
        layers = megatron_stage_layers(layout, cfg["num_layers"])
        flags = "--ckpt-format torch --no-load-optim --no-load-rng" + _moe_flags(cfg, layout, experts)
        if layout.virtual > 1 and len(set(layers)) == 1:
            flags += f" --num-layers-per-virtual-pipeline-stage {layers[0]}"
        if len(set(layers)) > 1:
            flags += f", and Megatron's pipeline stages must hold {','.join(map(str, layers))} layers"
            if layout.virtual == 1 and len(set(layers[1:-1])) <= 1:
                flags += (f" (--decoder-first-pipeline-num-layers {layers[0]} "
                          f"--decoder-last-pipeline-num-layers {layers[-1]})")
        lines.append(f"load it in Megatron-LM with {flags}")
    else:
        flags = "--no-load-optim --no-load-rng" + _moe_flags(cfg, layout)
        if layout.virtual > 1:
            flags += f" --virtual-pipeline-model-parallel-size {layout.virtual}"
        try:
            default = default_partition(cfg["num_layers"], layout.pp, layout.virtual)
        except UsageError:  # fewer layers than stages: only an explicit partition works
            default = None
        if layout.partition != default:
            flags += f" --pipeline-partition {','.join(map(str, layout.partition))}"
        lines.append(f"continue training with --load {save_dir} {flags} (or --finetune)")
    return lines


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    """Run the conversion named by --direction."""
    args = build_parser().parse_args(argv)
    target = Target(tp=args.target_tensor_parallel_size, pp=args.target_pipeline_model_parallel_size,
                    virtual=args.target_virtual_pipeline_model_parallel_size, partition=args.target_pipeline_partition,
                    true_vocab_size=args.true_vocab_size,
                    make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                    ep=args.target_expert_model_parallel_size)
    for flag, value in (("--true-vocab-size", args.true_vocab_size),
                        ("--make-vocab-size-divisible-by", args.make_vocab_size_divisible_by)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    model, layout = convert(args.direction, args.load_dir, args.save_dir, target, args.megatron_layer_spec,
                            args.tokenizer_type, args.ckpt_format, args.megatron_expert_layout)
    for note in model.notes:
        print(f"note: {note}", file=sys.stderr)
    for line in _summary(args.direction, args.save_dir, model, layout, args.ckpt_format, args.megatron_expert_layout):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
