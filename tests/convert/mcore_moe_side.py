"""megatron-core's side of tests/convert/test_mcore_moe.py: an MoE GPTModel (local spec, SequentialMLP experts,
megatron-core's decoder block spec for the layer pattern) described by a JSON file, run in a subprocess by an
interpreter that has megatron-core. Usage:

    python mcore_moe_side.py CONFIG.json layout OUT.json          # sharded_state_dict keys and global shapes
    python mcore_moe_side.py CONFIG.json load CKPT TOKENS.pt OUT.pt  # load a torch_dist directory, logits of TOKENS

CONFIG.json: {"transformer": TransformerConfig kwargs (activation "silu" by name), "vocab", "seq", "rotary_base",
"untied"}. The CPU stand-ins of mcore_side.py, plus one: its router's GEMM asks for Transformer Engine's
general_gemm by a name that is undefined without it (set to None here)."""

import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F


def _setup() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29700 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, utils
    from megatron.core.tensor_parallel import random

    parallel_state.initialize_model_parallel(1, 1)
    utils.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, mem_alloc_context=None: \
        torch.empty(shape, dtype=dtype)
    random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.current_device = lambda: "cpu"
    import megatron.core.transformer.moe.moe_utils as moe_utils

    moe_utils.te_general_gemm = None


def _model(spec: dict):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(spec["transformer"], activation_func=F.silu, use_cpu_initialization=True, hidden_dropout=0.0,
                  attention_dropout=0.0, bias_activation_fusion=False, gated_linear_unit=True)
    cfg = TransformerConfig(**kwargs)
    block = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization="RMSNorm")
    return GPTModel(config=cfg, transformer_layer_spec=block, vocab_size=spec["vocab"],
                    max_sequence_length=spec["seq"], share_embeddings_and_output_weights=not spec["untied"],
                    position_embedding_type="rope", rotary_base=spec["rotary_base"]).eval()


def _wanted(model):
    return {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    _setup()
    model = _model(spec)
    if sys.argv[2] == "layout":
        keys = {sh.key: list(sh.global_shape) for v in _wanted(model).values()
                for sh in (v.build() if hasattr(v, "build") else [v])}
        with open(sys.argv[3], "w") as f:
            json.dump(keys, f, indent=1, sort_keys=True)
        return
    from megatron.core import dist_checkpointing

    ckpt, tokens_path, out = sys.argv[3:6]
    model.load_state_dict(dist_checkpointing.load(_wanted(model), ckpt), strict=False)
    tokens = torch.load(tokens_path)
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    s = tokens.shape[1]
    with torch.no_grad():
        logits = model(tokens, positions, attention_mask=torch.ones(s, s).triu(1).bool()[None, None])
    torch.save(logits.float(), out)


if __name__ == "__main__":
    main()
