"""Convert a Hugging Face mixture of experts (MixtralForCausalLM, Qwen2MoeForCausalLM) to a tensor-, pipeline- and
expert-parallel Megatron checkpoint of our GPT with MoE layers, and back.

    python tools/checkpoint/convert_hf_moe.py --direction hf-to-megatron --hf-dir mixtral/ --save ckpt/ \\
        --tensor-model-parallel-size 2 [--pipeline-model-parallel-size 2] [--expert-model-parallel-size 2]
    python tools/checkpoint/convert_hf_moe.py --direction megatron-to-hf --load ckpt/ --hf-dir mixtral-out/

hf-to-megatron prints the pretrain_gpt.py flags of the model. megatron-to-hf reads any checkpoint the runtime
writes (any tp x pp x ep) and writes a Mixtral when every layer is MoE without shared experts, a Qwen2-MoE when
the model has gated shared experts; the mapping is megatron_bmw/convert/hf_moe.py's.
"""

from __future__ import annotations

import os
import sys
from typing import Any

try:
    import megatron_bmw  # noqa: F401
except ImportError:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from megatron_bmw.errors import UsageError, exit_on_usage_error  # noqa: E402
from megatron_bmw.convert.checkpoint_files import load_full, save_release  # noqa: E402
from megatron_bmw.convert.hf_files import build_parser, read_hf_dir, run_direction  # noqa: E402
from megatron_bmw.convert.hf_moe import hf_config_from_megatron, hf_to_megatron, megatron_to_hf  # noqa: E402
from megatron_bmw.convert.vocab_padding import padded_rows, restore_from, write_rows  # noqa: E402

_CONFIG_CLASS = {"mixtral": "MixtralConfig", "qwen2_moe": "Qwen2MoeConfig"}
_MODEL_CLASS = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}


def run_flags(args: dict[str, Any]) -> str:
    """The pretrain_gpt.py flags of the converted model."""
    moe = args["moe"]
    flags = ["--position-embedding-type rope", "--swiglu", "--normalization RMSNorm", "--disable-bias-linear",
             f"--num-layers {args['num_layers']}", f"--hidden-size {args['hidden_size']}",
             f"--num-attention-heads {args['num_attention_heads']}", f"--ffn-hidden-size {args['ffn_hidden_size']}",
             f"--max-position-embeddings {args['max_position_embeddings']}", f"--norm-epsilon {args['layernorm_epsilon']}",
             f"--rotary-base {args['rotary_base']}", f"--num-experts {moe['num_experts']}",
             f"--moe-router-topk {moe['router_topk']}", f"--moe-ffn-hidden-size {moe['ffn_hidden_size']}",
             f"--moe-aux-loss-coeff {moe['aux_loss_coeff']}"]
    if moe["layer_freq"] != "1":
        flags.append(f"--moe-layer-freq '{moe['layer_freq']}'")
    if moe.get("shared_expert_intermediate_size"):
        flags.append(f"--moe-shared-expert-intermediate-size {moe['shared_expert_intermediate_size']}")
    flags += [flag for flag, on in (("--moe-shared-expert-gate", moe.get("shared_expert_gate")),
                                    ("--moe-router-pre-softmax", moe.get("pre_softmax")),
                                    ("--add-qkv-bias", args.get("add_qkv_bias")),
                                    ("--untie-embeddings-and-output-weights",
                                     args["untie_embeddings_and_output_weights"])) if on]
    if args.get("num_query_groups"):
        flags.append(f"--group-query-attention --num-query-groups {args['num_query_groups']}")
    if args.get("rotary_seq_len_interpolation_factor"):
        flags.append(f"--rotary-seq-len-interpolation-factor {args['rotary_seq_len_interpolation_factor']}")
    flags.append("--hidden-dropout 0 --attention-dropout " + str(args["attention_dropout"]))
    flags.append(f"--expert-model-parallel-size {args.get('expert_model_parallel_size', 1)}")
    return " ".join(flags)  # run_direction adds the layout and the vocabulary's padding


def hf_to_megatron_dir(hf_dir: str, save: str, tp: int, divisible_by: int, pp: int = 1, ep: int = 1
                       ) -> dict[str, Any]:
    """Convert `hf_dir` into a Megatron checkpoint at `save` over tp x pp x ep; returns the checkpoint's args."""
    config, hf_sd = read_hf_dir(hf_dir)
    kwargs, full = hf_to_megatron(hf_sd, config, make_vocab_size_divisible_by=divisible_by, tp=tp, ep=ep)
    restored = restore_from(hf_dir, full, config["vocab_size"])
    if restored:
        print(f"note: {restored}")
    if config.get("router_jitter_noise"):
        print(f"note: router_jitter_noise {config['router_jitter_noise']} (multiplicative noise on the router's input "
              "while training) has no Megatron equivalent and is dropped")
    if ep > 1:
        print(f"note: experts over {ep} ranks are written as Megatron-LM's legacy mp_rank_TT[_PPP]_EEE files (for "
              "Megatron-LM and these converters); pretrain_gpt.py loads expert-parallel runs from torch_dist only: "
              "convert at --expert-model-parallel-size 1, load that once with --ckpt-convert-format torch_dist, and "
              "run any ep from the result")
    args = dict(kwargs, padded_vocab_size=kwargs["vocab_size"], orig_vocab_size=config["vocab_size"],
                make_vocab_size_divisible_by=divisible_by)
    return save_release(save, full, args, tp, pp, ep)


def write_hf_dir(hf_dir: str, hf_sd: dict, model_type: str, hf_config: dict[str, Any]) -> None:
    """config.json (transformers' config class of `model_type`) and model.safetensors holding `hf_sd` under the
    checkpoint's per-expert names, as save_pretrained writes them; a tied lm_head is left out."""
    try:
        import transformers
        from safetensors.torch import save_file
    except ImportError:
        raise UsageError("--direction megatron-to-hf needs the transformers package") from None
    config = getattr(transformers, _CONFIG_CLASS[model_type])(**hf_config)
    config.architectures = [_MODEL_CLASS[model_type]]
    config.torch_dtype = str(hf_sd["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    try:
        os.makedirs(hf_dir, exist_ok=True)
        config.save_pretrained(hf_dir)
        save_file({k: t.contiguous() for k, t in hf_sd.items()}, os.path.join(hf_dir, "model.safetensors"),
                  metadata={"format": "pt"})
    except OSError as exc:
        raise UsageError(f"--hf-dir {hf_dir}: cannot write: {exc}") from None


def megatron_to_hf_dir(load: str, hf_dir: str) -> None:
    """Convert the Megatron checkpoint at `load` (any tp x pp x ep) into a HF Mixtral or Qwen2-MoE `hf_dir`."""
    full, args = load_full(load)
    for key in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings"):
        if key not in args:
            raise UsageError(f"--load: checkpoint args lack {key!r}")
    hf_sd = megatron_to_hf(full, args)
    model_type, hf_config = hf_config_from_megatron(args)
    rows = padded_rows(full, args.get("orig_vocab_size"))
    write_hf_dir(hf_dir, hf_sd, model_type, hf_config)
    write_rows(hf_dir, rows)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    """Run the conversion named by --direction."""
    parser = build_parser(__doc__.splitlines()[0])
    parser.add_argument("--expert-model-parallel-size", type=int, default=1,
                        help="ranks the experts are split over (hf-to-megatron; default 1)")
    args = parser.parse_args(argv)
    ep = args.expert_model_parallel_size
    if ep < 1:
        raise UsageError(f"--expert-model-parallel-size must be >= 1, got {ep}")
    return run_direction(args, lambda *a: hf_to_megatron_dir(*a, ep=ep), megatron_to_hf_dir,
                         lambda out: f"pretrain_gpt.py {run_flags(out)}")


if __name__ == "__main__":
    sys.exit(main())
