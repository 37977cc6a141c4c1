"""Convert a Hugging Face BERT pretraining model (BertForPreTraining or MegatronBertForPreTraining) to a
tensor-parallel megatron_bmw BERT checkpoint, and back.

    python tools/checkpoint/convert_hf_bert.py --direction hf-to-megatron --hf-dir bert/ --save ckpt/ \\
        --tensor-model-parallel-size 2 [--make-vocab-size-divisible-by 128]
    python tools/checkpoint/convert_hf_bert.py --direction megatron-to-hf --load ckpt/ --hf-dir bert-out/

A post-LayerNorm BertForPreTraining converts to a model that pretrain_bert.py runs with
--apply-residual-connection-post-layernorm (the tool prints the flags); see megatron_bmw/convert/bert.py.
Weights only; megatron-to-hf reads any tp x pp checkpoint, and the padded vocabulary rows round-trip (files and
layout as convert_hf_gpt2.py).
"""

from __future__ import annotations

import os
import sys

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_bmw.errors import UsageError, exit_on_usage_error
from megatron_bmw.convert.hf_files import build_parser, import_hf_dir, run_direction  # noqa: E402
from megatron_bmw.convert.bert import check_hf_config, hf_to_ours, ours_to_hf  # noqa: E402
from megatron_bmw.convert.checkpoint_files import load_full
from megatron_bmw.convert.vocab_padding import padded_rows, write_rows  # noqa: E402


def _flags(kwargs: dict) -> str:
    flags = ["--bert-binary-head"]
    if kwargs["apply_residual_connection_post_layernorm"]:
        flags.append("--apply-residual-connection-post-layernorm")
    if kwargs["openai_gelu"]:
        flags.append("--openai-gelu")
    if kwargs["untie_embeddings_and_output_weights"]:
        flags.append("--untie-embeddings-and-output-weights")
    return " ".join(flags + [f"--num-layers {kwargs['num_layers']}", f"--hidden-size {kwargs['hidden_size']}",
                             f"--num-attention-heads {kwargs['num_attention_heads']}",
                             f"--ffn-hidden-size {kwargs['ffn_hidden_size']}",
                             f"--max-position-embeddings {kwargs['max_position_embeddings']}",
                             f"--layernorm-epsilon {kwargs['layernorm_epsilon']}"])


def hf_to_megatron_dir(hf_dir: str, save: str, tp: int, divisible_by: int, pp: int = 1) -> dict:
    return import_hf_dir(hf_dir, save, tp, divisible_by, pp, hf_to_ours, check_hf_config)


def megatron_to_hf_dir(load: str, hf_dir: str) -> None:
    full, args = load_full(load)
    orig = args.get("orig_vocab_size") or args.get("padded_vocab_size") or args.get("vocab_size")
    rows = padded_rows(full, int(orig))
    hf_sd, config = ours_to_hf(full, args, int(orig))
    try:
        import transformers
    except ImportError:
        raise UsageError("--direction megatron-to-hf needs the transformers package") from None
    arch = config["architectures"][0]
    config_cls = transformers.BertConfig if arch == "BertForPreTraining" else transformers.MegatronBertConfig
    model = getattr(transformers, arch)(config_cls(**config))
    model.to(hf_sd["bert.embeddings.word_embeddings.weight"].dtype)
    missing, unexpected = model.load_state_dict(hf_sd, strict=False)
    missing = [k for k in missing if not k.endswith(("position_ids", "token_type_ids"))]
    if missing or unexpected:
        raise UsageError(f"--load: converted weights do not fit {arch} (missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]})")
    try:
        os.makedirs(hf_dir, exist_ok=True)
        model.save_pretrained(hf_dir)
    except OSError as exc:
        raise UsageError(f"--hf-dir {hf_dir}: cannot write: {exc}") from None
    write_rows(hf_dir, rows)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    """Run the conversion named by --direction."""
    return run_direction(build_parser(__doc__.splitlines()[0]).parse_args(argv), hf_to_megatron_dir,
                         megatron_to_hf_dir, lambda out: f"pretrain_bert.py {_flags(out)}")


if __name__ == "__main__":
    sys.exit(main())
