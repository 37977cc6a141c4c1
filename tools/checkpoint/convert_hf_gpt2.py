"""Convert a Hugging Face GPT-2 directory to a tensor- and pipeline-parallel Megatron checkpoint, and back.

    python tools/checkpoint/convert_hf_gpt2.py --direction hf-to-megatron --hf-dir gpt2/ --save ckpt/ \\
        --tensor-model-parallel-size 2 [--pipeline-model-parallel-size 2] [--make-vocab-size-divisible-by 128]
    python tools/checkpoint/convert_hf_gpt2.py --direction megatron-to-hf --load ckpt/ --hf-dir gpt2-out/ \\
        [--vocab-file gpt2-vocab.json --merge-file gpt2-merges.txt] [--check-logits]

Checkpoint layout: <save>/latest_checkpointed_iteration.txt ("release") and
<save>/release/mp_rank_TT[_PPP]/model_optim_rng.pt = {"model", "args", "iteration", "checkpoint_version"}.
megatron-to-hf reads any checkpoint the runtime writes (any tp x pp, virtual stages); the padded vocabulary rows
go to megatron_vocab_padding.safetensors beside the HF weights, and an import at the same padding restores them.
The run's GPT-2 BPE tokenizer (--vocab-file/--merge-file, else the files the checkpoint's args record) is written
beside config.json (vocab.json, merges.txt, tokenizer_config.json, special_tokens_map.json) for
transformers.AutoTokenizer. --check-logits compares the logits of the two models on a random batch (exit 1 beyond
--check-logits-tolerance).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_bmw.errors import UsageError, exit_on_usage_error
from megatron_bmw.convert.hf_files import build_parser, import_hf_dir, run_direction
from megatron_bmw.convert.checkpoint_files import load_full
from megatron_bmw.convert.gpt2 import hf_config_from_megatron, hf_to_megatron, megatron_to_hf
from megatron_bmw.convert.hf_tokenizer import read_gpt2_files, write_gpt2_files
from megatron_bmw.convert.vocab_padding import padded_rows, write_rows


def run_flags(args: dict[str, Any]) -> str:
    """The pretrain_gpt.py flags of the converted model (run_direction adds the layout and padding)."""
    untie = " --untie-embeddings-and-output-weights" if args.get("untie_embeddings_and_output_weights") else ""
    return (f"--num-layers {args['num_layers']} --hidden-size {args['hidden_size']} "
            f"--num-attention-heads {args['num_attention_heads']} --ffn-hidden-size {args['ffn_hidden_size']} "
            f"--max-position-embeddings {args['max_position_embeddings']} --layernorm-epsilon "
            f"{args['layernorm_epsilon']}{untie}")


# ----------------------------------------------------------------------------------------------------------------
# Hugging Face files


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
    return import_hf_dir(hf_dir, save, tp, divisible_by, pp, hf_to_megatron)


def megatron_to_hf_dir(load: str, hf_dir: str, vocab_file: str | None = None, merge_file: str | None = None) -> None:
    """Convert the Megatron checkpoint at `load` (any tp x pp) into a HF GPT-2 directory `hf_dir`, with the run's
    tokenizer files when they are known (`vocab_file`/`merge_file`, else the checkpoint's args)."""
    full, args = load_full(load)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "max_position_embeddings"):
        if key not in args:
            raise UsageError(f"--load: checkpoint args lack {key!r}")
    hf_config = hf_config_from_megatron(args)
    tokenizer = read_gpt2_files(vocab_file, merge_file, args, hf_config["vocab_size"])
    if not isinstance(tokenizer, str):
        hf_config.update(bos_token_id=tokenizer.eod, eos_token_id=tokenizer.eod)
    rows = padded_rows(full, args.get("orig_vocab_size"))
    hf_sd = megatron_to_hf(full, args)
    write_hf_dir(hf_dir, hf_sd, hf_config)
    write_rows(hf_dir, rows)
    if isinstance(tokenizer, str):
        print(f"note: {tokenizer}")
    else:
        names = write_gpt2_files(hf_dir, tokenizer, hf_config["n_positions"])
        print(f"wrote the tokenizer ({', '.join(names)}) from {tokenizer.origin}")


def build_gpt2_parser():
    p = build_parser(__doc__.splitlines()[0])
    p.add_argument("--vocab-file", help="megatron-to-hf: the run's GPT-2 BPE vocab.json, written beside the model "
                                        "with --merge-file (default: the files the checkpoint's args record)")
    p.add_argument("--merge-file", help="megatron-to-hf: the run's GPT-2 BPE merges.txt")
    return p


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    """Run the conversion named by --direction."""
    args = build_gpt2_parser().parse_args(argv)
    if args.direction == "hf-to-megatron" and (args.vocab_file or args.merge_file):
        raise UsageError("--vocab-file/--merge-file name the tokenizer an export writes (--direction megatron-to-hf)")
    return run_direction(args, hf_to_megatron_dir,
                         lambda load, hf_dir: megatron_to_hf_dir(load, hf_dir, args.vocab_file, args.merge_file),
                         lambda out: f"pretrain_gpt.py {run_flags(out)}")


if __name__ == "__main__":
    sys.exit(main())
