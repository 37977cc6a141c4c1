"""megatron-core's side of tests/convert/test_mcore_dist.py, run in a subprocess by an interpreter that has
megatron-core (it needs torch.distributed set up and its own parallel state). Usage:

    python mcore_side.py layout OUT.json              # the sharded_state_dict keys and global shapes
    python mcore_side.py load CKPT TOKENS.pt OUT.pt   # load a torch_dist directory, logits of TOKENS
    python mcore_side.py save CKPT TOKENS.pt OUT.pt   # a seeded model written in megatron-core's layout, its logits
    python mcore_side.py load A T A.pt save B T B.pt  # several jobs in one process

With MCORE_SIDE_LLAMA=1 the model is Llama-style (LLAMA: rope, SwiGLU, 2 query groups, RMSNorm, no biases,
untied output).

Its own dist_checkpointing.save needs CUDA (torch.cuda.synchronize / current_device in its writer), so `save`
writes the same layout with torch.distributed.checkpoint: layer tensors stacked on a leading axis; and its local
attention allocates its score buffer with torch.cuda.current_device() (replaced here by a CPU allocation)
builds its default causal mask on the GPU (given here) and forks the CUDA RNG tracker (a no-op here: no dropout)."""

import json
import os
import sys

import torch
import torch.nn.functional as F

CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=128, vocab=64, seq=16)
LLAMA = os.environ.get("MCORE_SIDE_LLAMA") == "1"


def _model(seed: int = 0):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    llama = dict(normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                 num_query_groups=2) if LLAMA else dict(activation_func=lambda x: F.gelu(x, approximate="tanh"))
    cfg = TransformerConfig(num_layers=CONFIG["num_layers"], hidden_size=CONFIG["hidden_size"],
                            num_attention_heads=CONFIG["num_attention_heads"], ffn_hidden_size=CONFIG["ffn_hidden_size"],
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            bias_activation_fusion=False, init_method_std=0.05, **llama)
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(
                         normalization="RMSNorm" if LLAMA else None), vocab_size=CONFIG["vocab"],
                     max_sequence_length=CONFIG["seq"], share_embeddings_and_output_weights=not LLAMA,  # as ours
                     position_embedding_type="rope" if LLAMA else "learned_absolute")
    return model.eval()


def _logits(model, tokens):
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    s = tokens.shape[1]
    causal = torch.ones(s, s).triu(1).bool()[None, None]  # its default mask is built on the GPU
    with torch.no_grad():
        return model(tokens, positions, attention_mask=causal).float()


def _wanted(model):
    return {k: v for k, v in model.sharded_state_dict().items() if not k.endswith("_extra_state")}


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(1, 1)
    from megatron.core import utils

    # the local attention's score buffer is allocated on torch.cuda.current_device(): on a CPU-only torch, here
    utils.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, mem_alloc_context=None: \
        torch.empty(shape, dtype=dtype)
    import contextlib

    from megatron.core.tensor_parallel import random

    # its attention forks the CUDA RNG tracker even without dropout; no CUDA RNG here
    random.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    # its rotary embedding moves its frequencies to torch.cuda.current_device() at the first forward
    torch.cuda.current_device = lambda: "cpu"
    if sys.argv[1] == "layout":
        layout = {sh.key: list(sh.global_shape) for v in _wanted(_model()).values()
                  for sh in (v.build() if hasattr(v, "build") else [v])}
        with open(sys.argv[2], "w") as f:
            json.dump({"megatron_core": __import__("megatron.core").core.__version__ if hasattr(
                __import__("megatron.core").core, "__version__") else "?", "config": dict(CONFIG, **({"llama": True} if LLAMA else {})), "keys": layout}, f,
                indent=1, sort_keys=True)
        return
    args = sys.argv[1:]
    while args:  # several jobs per process: importing megatron-core takes seconds
        what, ckpt, tokens, out, args = *args[:4], args[4:]
        _job(what, ckpt, torch.load(tokens), out)


def _job(what: str, ckpt: str, tokens: torch.Tensor, out: str) -> None:
    from megatron.core import dist_checkpointing

    model = _model()
    if what == "load":
        model.load_state_dict(dist_checkpointing.load(_wanted(model), ckpt), strict=False)
    elif what == "save":
        import torch.distributed.checkpoint as dcp

        model = _model(seed=1)
        flat = {}
        for v in _wanted(model).values():  # every shard at its global offset (SwiGLU's fc1: two, gate and up)
            for sh in (v.build() if hasattr(v, "build") else [v]):
                t = flat.setdefault(sh.key, torch.full(sh.global_shape, float("nan"), dtype=sh.data.dtype))
                box = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, (1,) * sh.prepend_axis_num
                                                            + tuple(sh.data.shape)))
                t[box] = sh.data.reshape(t[box].shape)
        assert all(not t.isnan().any() for t in flat.values())
        os.makedirs(ckpt)
        dcp.save(flat, checkpoint_id=ckpt)
        with open(os.path.join(ckpt, "metadata.json"), "w") as f:
            json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                       "common_backend_version": 1}, f)
        torch.save({}, os.path.join(ckpt, "common.pt"))
    else:
        raise SystemExit(f"unknown job {what!r}")
    torch.save(_logits(model, tokens), out)

if __name__ == "__main__":
    main()
