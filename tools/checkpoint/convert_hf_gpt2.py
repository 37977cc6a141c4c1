"""Convert a Hugging Face GPT-2 directory to a tensor- and pipeline-parallel Megatron checkpoint, and back.

    python tools/checkpoint/convert_hf_gpt2.py --direction hf-to-megatron --hf-dir gpt2/ --save ckpt/ \\
        --tensor-model-parallel-size 2 [--pipeline-model-parallel-size 2] [--make-vocab-size-divisible-by 128]
    python tools/checkpoint/convert_hf_gpt2.py --direction megatron-to-hf --load ckpt/ --hf-dir gpt2-out/

Checkpoint layout: <save>/latest_checkpointed_iteration.txt ("release") and
<save>/release/mp_rank_TT[_PPP]/model_optim_rng.pt = {"model", "args", "iteration", "checkpoint_version"}.
megatron-to-hf reads any checkpoint the runtime writes (any tp x pp, virtual stages); the padded vocabulary rows
go to megatron_vocab_padding.safetensors beside the HF weights, and an import at the same padding restores them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_bmw.errors import OneLineParser, UsageError, exit_on_usage_error
from megatron_bmw.convert.checkpoint_files import load_full, save_release
from megatron_bmw.convert.gpt2 import hf_config_from_megatron, hf_to_megatron, megatron_to_hf
from megatron_bmw.convert.vocab_padding import padded_rows, restore_from, write_rows


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(description=__doc__.splitlines()[0])
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
    return p


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face files


def read_hf_dir(hf_dir: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(config.json dict, state dict) of a local HF GPT-2 directory.

    Weights come from model.safetensors or pytorch_model.bin (or their sharded index files).
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
        try:
            if path.endswith(".safetensors"):
                from safetensors.torch import load_file  # installed with transformers

                sd.update(load_file(path))
            else:
                sd.update(torch.load(path, map_location="cpu", weights_only=True))
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


def write_hf_dir(hf_dir: str, hf_sd: dict[str, torch.Tensor], hf_config: dict[str, Any]) -> None:
    """save_pretrained a GPT2LMHeadModel holding `hf_sd` into `hf_dir`."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise UsageError("--direction megatron-to-hf needs the transformers package") from None

    model = GPT2LMHeadModel(GPT2Config(**hf_config))
    model.to(hf_sd["transformer.wte.weight"].dtype)
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    if missing or unexpected:
        raise UsageError(f"--load: converted weights do not fit GPT2LMHeadModel (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    try:
        os.makedirs(hf_dir, exist_ok=True)
        model.save_pretrained(hf_dir)
    except OSError as exc:
        raise UsageError(f"--hf-dir {hf_dir}: cannot write: {exc}") from None


# ----------------------------------------------------------------------------------------------------------------
# Directions


def hf_to_megatron_dir(hf_dir: str, save: str, tp: int, divisible_by: int, pp: int = 1) -> dict[str, Any]:
    """Convert `hf_dir` into a Megatron checkpoint at `save`; returns the checkpoint's args."""
    config, hf_sd = read_hf_dir(hf_dir)
    kwargs, full = hf_to_megatron(hf_sd, config, make_vocab_size_divisible_by=divisible_by, tp=tp)
    note = restore_from(hf_dir, full, config["vocab_size"])
    if note:
        print(f"note: {note}")
    args = dict(kwargs, padded_vocab_size=kwargs["vocab_size"], orig_vocab_size=config["vocab_size"],
                make_vocab_size_divisible_by=divisible_by)
    return save_release(save, full, args, tp, pp)


def megatron_to_hf_dir(load: str, hf_dir: str) -> None:
    """Convert the Megatron checkpoint at `load` (any tp x pp) into a HF GPT-2 directory `hf_dir`."""
    full, args = load_full(load)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        if key not in args:
            raise UsageError(f"--load: checkpoint args lack {key!r}")
    rows = padded_rows(full, args.get("orig_vocab_size"))
    hf_sd = megatron_to_hf(full, args)
    write_hf_dir(hf_dir, hf_sd, hf_config_from_megatron(args))
    write_rows(hf_dir, rows)


def check_sizes(args: argparse.Namespace) -> None:
    for flag, value in (("--tensor-model-parallel-size", args.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", args.pipeline_model_parallel_size)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    """Run the conversion named by --direction."""
    args = build_parser().parse_args(argv)
    if args.direction == "hf-to-megatron":
        if not args.save:
            raise UsageError("--save is required for --direction hf-to-megatron")
        check_sizes(args)
        out = hf_to_megatron_dir(args.hf_dir, args.save, args.tensor_model_parallel_size,
                                 args.make_vocab_size_divisible_by, args.pipeline_model_parallel_size)
        print(f"wrote {args.save}: tp={out['tensor_model_parallel_size']}, pp={out['pipeline_model_parallel_size']}, "
              f"layers={out['num_layers']}, "
              f"vocab {out['orig_vocab_size']} padded to {out['padded_vocab_size']}")
    else:
        if not args.load:
            raise UsageError("--load is required for --direction megatron-to-hf")
        megatron_to_hf_dir(args.load, args.hf_dir)
        print(f"wrote {args.hf_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
