"""What the Hugging Face checkpoint tools share (tools/checkpoint/convert_hf_*.py): their flags, reading a local
Hugging Face directory (config.json and safetensors or .bin weights, sharded or not), and the run of a direction."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from ..errors import OneLineParser, UsageError
from ..safe_load import load_file


def build_parser(description: str) -> argparse.ArgumentParser:
    """The flags every Hugging Face converter takes."""
    p = OneLineParser(description=description)
    p.add_argument("--direction", required=True, choices=("hf-to-megatron", "megatron-to-hf"))
    p.add_argument("--hf-dir", required=True,
                   help="Hugging Face model directory: read for hf-to-megatron, written for megatron-to-hf")
    p.add_argument("--save", help="Megatron checkpoint directory to write (hf-to-megatron)")
    p.add_argument("--load", help="Megatron checkpoint directory to read (megatron-to-hf)")
    p.add_argument("--tensor-model-parallel-size", type=int, default=1, help="tp ranks to shard into (default 1)")
    p.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                   help="pipeline stages to split into, Megatron's default partition (default 1)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times tp (default 128)")
    p.add_argument("--check-logits", action="store_true",
                   help="after converting, run one random token batch through our model (from the checkpoint, one "
                        "process, fp32) and the transformers model of the Hugging Face folder, print the largest "
                        "logit difference, and exit 1 when it is beyond --check-logits-tolerance")
    p.add_argument("--check-logits-tolerance", type=float, default=1e-3,
                   help="largest absolute logit difference --check-logits accepts (default 1e-3)")
    return p


def check_sizes(args: argparse.Namespace) -> None:
    for flag, value in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if not args.check_logits_tolerance >= 0:
        raise UsageError(f"--check-logits-tolerance must be >= 0, got {args.check_logits_tolerance}")


def read_hf_dir(hf_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json dict, state dict) of a local Hugging Face model directory.

    Weights come from model.safetensors (or its sharded index) where present, else pytorch_model.bin (or its index),
    read as data.
    """
    if not os.path.isdir(hf_dir):
        raise UsageError(f"--hf-dir {hf_dir} is not a directory")
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise UsageError(f"--hf-dir {hf_dir} has no config.json")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--hf-dir: cannot read {config_path}: {exc}") from None
    if not isinstance(config, dict):
        raise UsageError(f"--hf-dir: {config_path} is not a JSON object")
    files = _weight_files(hf_dir)
    sd: dict[str, torch.Tensor] = {}
    for path in files:
        if not path.endswith(".safetensors"):  # a pickle: read as data, no global outside safe_load's allow-list
            weights = load_file(path, "--hf-dir")
            if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
                raise UsageError(f"--hf-dir: {path} does not hold a state dict of tensors")
            sd.update(weights)
            continue
        try:
            from safetensors.torch import load_file as load_safetensors  # installed with transformers

            sd.update(load_safetensors(path))
        except Exception as exc:  # noqa: BLE001 - any unreadable file is a user error
            raise UsageError(f"--hf-dir: cannot read {path}: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return config, sd


def _weight_files(hf_dir: str) -> list[str]:
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if os.path.isfile(os.path.join(hf_dir, single)):
            return [os.path.join(hf_dir, single)]
        index_path = os.path.join(hf_dir, index)
        if os.path.isfile(index_path):
            try:
                with open(index_path) as f:
                    names = sorted(set(json.load(f)["weight_map"].values()))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise UsageError(f"--hf-dir: cannot read {index_path}: {exc}") from None
            paths = [os.path.join(hf_dir, n) for n in names]
            for path in paths:
                if not os.path.isfile(path):
                    raise UsageError(f"--hf-dir: {index_path} names missing file {path}")
            return paths
    raise UsageError(f"--hf-dir {hf_dir} has no model.safetensors or pytorch_model.bin")


def layout_flags(args: dict[str, Any]) -> str:
    """The flags a converted checkpoint's layout and vocabulary padding need (every tool's run line ends so)."""
    return (f"--make-vocab-size-divisible-by {args['make_vocab_size_divisible_by']} "
            f"--tensor-model-parallel-size {args['tensor_model_parallel_size']} "
            f"--pipeline-model-parallel-size {args['pipeline_model_parallel_size']}")


def run_direction(args: argparse.Namespace, to_megatron: Callable[..., dict[str, Any]],
                  to_hf: Callable[[str, str], None], run_with: Callable[[dict[str, Any]], str] | None = None) -> int:
    """The conversion --direction names; `run_with(args)` gives the line saying how to train the converted model.
    With --check-logits the converted pair's logits are compared (logit_check.py): beyond the tolerance, exit 1."""
    if args.direction == "hf-to-megatron":
        if not args.save:
            raise UsageError("--save is required for --direction hf-to-megatron")
        check_sizes(args)
        out = to_megatron(args.hf_dir, args.save, args.tensor_model_parallel_size,
                          args.make_vocab_size_divisible_by, args.pipeline_model_parallel_size)
        print(f"wrote {args.save}: tp={out['tensor_model_parallel_size']}, pp={out['pipeline_model_parallel_size']}, "
              f"layers={out['num_layers']}, vocab {out['orig_vocab_size']} padded to {out['padded_vocab_size']}")
        if run_with is not None:
            print(f"run it with: {run_with(out)} {layout_flags(out)} --load {args.save} --finetune")
    else:
        if not args.load:
            raise UsageError("--load is required for --direction megatron-to-hf")
        if os.path.exists(args.hf_dir) and (not os.path.isdir(args.hf_dir) or os.listdir(args.hf_dir)):
            what = "is not a directory" if not os.path.isdir(args.hf_dir) else "is not empty"
            raise UsageError(f"--hf-dir {args.hf_dir} {what}; choose a new directory (the export would overwrite "
                             "what is there)")
        check_sizes(args)
        to_hf(args.load, args.hf_dir)
        print(f"wrote {args.hf_dir}")
    if args.check_logits:
        from .logit_check import check_logits

        check_logits(args.save if args.direction == "hf-to-megatron" else args.load, args.hf_dir,
                     args.check_logits_tolerance)
    return 0


class HFTensors:
    """A Hugging Face state dict read tensor by tensor: each by name with the shape the config implies, and at
    the end every tensor nothing took is an error."""

    def __init__(self, src: dict[str, torch.Tensor]) -> None:
        self.src, self.used = src, set()

    def take(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in self.src:
            raise UsageError(f"--hf-dir: checkpoint lacks {name!r}")
        t = self.src[name]
        if tuple(t.shape) != shape:
            raise UsageError(f"--hf-dir: {name} has shape {tuple(t.shape)}, config implies {shape}")
        self.used.add(name)
        return t

    def check_all_taken(self) -> None:
        extra = sorted(set(self.src) - self.used)
        if extra:
            raise UsageError(f"--hf-dir: checkpoint has unexpected tensors, e.g. {extra[:3]}")


def import_hf_dir(hf_dir: str, save: str, tp: int, divisible_by: int, pp: int,
                  convert: Callable[..., tuple[dict[str, Any], dict[str, torch.Tensor]]],
                  check: Callable[[dict[str, Any]], list[str]] | None = None) -> dict[str, Any]:
    """Read `hf_dir`, map it with `convert(hf_sd, config, make_vocab_size_divisible_by=, tp=)` -> (ModelConfig
    kwargs, full state dict), restore padded vocabulary rows an export left, and write a release checkpoint at
    `save` over tp x pp; returns its args. `check(config)`: notes on the config to print first (or it raises)."""
    from .checkpoint_files import save_release
    from .vocab_padding import restore_from

    config, hf_sd = read_hf_dir(hf_dir)
    notes = check(config) if check is not None else []
    kwargs, full = convert(hf_sd, config, make_vocab_size_divisible_by=divisible_by, tp=tp)
    restored = restore_from(hf_dir, full, config["vocab_size"])
    for note in notes + ([restored] if restored else []):
        print(f"note: {note}")
    args = dict(kwargs, padded_vocab_size=kwargs["vocab_size"], orig_vocab_size=config["vocab_size"],
                make_vocab_size_divisible_by=divisible_by)
    return save_release(save, full, args, tp, pp)
