"""Convert a Hugging Face Llama directory (LlamaForCausalLM; a Mistral config without a sliding window) to a
tensor- and pipeline-parallel Megatron checkpoint of our Llama-family GPT, and back.

    python tools/checkpoint/convert_hf_llama.py --direction hf-to-megatron --hf-dir llama/ --save ckpt/ \\
        --tensor-model-parallel-size 2 [--pipeline-model-parallel-size 2] [--make-vocab-size-divisible-by 128]
    python tools/checkpoint/convert_hf_llama.py --direction megatron-to-hf --load ckpt/ --hf-dir llama-out/

hf-to-megatron prints the pretrain_gpt.py flags of the model. megatron-to-hf reads any checkpoint the runtime
writes (any tp x pp); files and layout as convert_hf_gpt2.py, the mapping in megatron_bmw/convert/llama.py.
"""

from __future__ import annotations

import os
import sys
from typing import Any

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_bmw.errors import UsageError, exit_on_usage_error
from megatron_bmw.convert.hf_files import build_parser, import_hf_dir, run_direction
from megatron_bmw.convert.checkpoint_files import load_full
from megatron_bmw.convert.llama import hf_config_from_megatron, hf_to_megatron, megatron_to_hf  # noqa: E402
from megatron_bmw.convert.vocab_padding import padded_rows, write_rows  # noqa: E402


def run_flags(args: dict[str, Any]) -> str:
    """The pretrain_gpt.py flags of the converted model."""
    flags = ["--position-embedding-type rope", "--swiglu", "--normalization RMSNorm",
             f"--num-layers {args['num_layers']}", f"--hidden-size {args['hidden_size']}",
             f"--num-attention-heads {args['num_attention_heads']}", f"--ffn-hidden-size {args['ffn_hidden_size']}",
             f"--max-position-embeddings {args['max_position_embeddings']}", f"--norm-epsilon {args['layernorm_epsilon']}",
             f"--rotary-base {args['rotary_base']}"]
    if args.get("num_query_groups"):
        flags.append(f"--group-query-attention --num-query-groups {args['num_query_groups']}")
    if args.get("rotary_seq_len_interpolation_factor"):
        flags.append(f"--rotary-seq-len-interpolation-factor {args['rotary_seq_len_interpolation_factor']}")
    if not args["add_bias_linear"]:
        flags.append("--disable-bias-linear")
    if args["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    flags.append("--hidden-dropout 0 --attention-dropout " + str(args["attention_dropout"]))
    return " ".join(flags)  # run_direction adds the layout and the vocabulary's padding


def hf_to_megatron_dir(hf_dir: str, save: str, tp: int, divisible_by: int, pp: int = 1) -> dict[str, Any]:
    """Convert `hf_dir` into a Megatron checkpoint at `save`; returns the checkpoint's args."""
    return import_hf_dir(hf_dir, save, tp, divisible_by, pp, hf_to_megatron)


def write_hf_dir(hf_dir: str, hf_sd: dict, hf_config: dict[str, Any]) -> None:
    """save_pretrained a LlamaForCausalLM holding `hf_sd` into `hf_dir`."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise UsageError("--direction megatron-to-hf needs the transformers package") from None
    model = LlamaForCausalLM(LlamaConfig(**hf_config))
    model.to(hf_sd["model.embed_tokens.weight"].dtype)
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise UsageError(f"--load: converted weights do not fit LlamaForCausalLM (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    if hf_config["tie_word_embeddings"]:
        model.tie_weights()
    try:
        os.makedirs(hf_dir, exist_ok=True)
        model.save_pretrained(hf_dir)
    except OSError as exc:
        raise UsageError(f"--hf-dir {hf_dir}: cannot write: {exc}") from None


def megatron_to_hf_dir(load: str, hf_dir: str) -> None:
    """Convert the Megatron checkpoint at `load` (any tp x pp) into a HF Llama directory `hf_dir`."""
    full, args = load_full(load)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings"):
        if key not in args:
            raise UsageError(f"--load: checkpoint args lack {key!r}")
    hf_sd = megatron_to_hf(full, args)
    rows = padded_rows(full, args.get("orig_vocab_size"))
    write_hf_dir(hf_dir, hf_sd, hf_config_from_megatron(args))
    write_rows(hf_dir, rows)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    """Run the conversion named by --direction."""
    return run_direction(build_parser(__doc__.splitlines()[0]).parse_args(argv), hf_to_megatron_dir,
                         megatron_to_hf_dir, lambda out: f"pretrain_gpt.py {run_flags(out)}")


if __name__ == "__main__":
    sys.exit(main())
