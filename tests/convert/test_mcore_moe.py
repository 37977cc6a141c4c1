"""megatron-core runs what the MoE converters write: a Hugging Face Mixtral / Qwen2-MoE converted to our checkpoint
(tools/checkpoint/convert_hf_moe.py) and on to megatron-core's torch_dist (convert_megatron.py --ckpt-format
torch_dist) loads into megatron-core 0.16.1's own MoE GPTModel (SequentialMLP experts, its router, shared experts and
layer pattern, built from the Megatron arguments the tool wrote) with the Hugging Face model's logits, and its
sharded_state_dict asks for exactly the keys and shapes written. Needs megatron-core (the "test" extras, or
MCORE_PYTHON); skipped otherwise."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from megatron_bmw.safe_load import load_file
from tests.convert.test_hf_moe import _tool as _hf_tool, hf_model, saved
from tests.convert.test_mcore_dist import _mcore_python
from tests.convert.test_megatron_moe import _tool as _megatron_tool

pytest.importorskip("transformers")
HERE = os.path.dirname(os.path.abspath(__file__))
# Megatron's saved argument -> megatron-core TransformerConfig field, for the side's model
_CONFIG_FIELDS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "num_attention_heads": "num_attention_heads",
                  "ffn_hidden_size": "ffn_hidden_size", "num_query_groups": "num_query_groups",
                  "normalization": "normalization", "norm_epsilon": "layernorm_epsilon",
                  "add_bias_linear": "add_bias_linear", "add_qkv_bias": "add_qkv_bias", "num_experts": "num_moe_experts",
                  "moe_router_topk": "moe_router_topk", "moe_ffn_hidden_size": "moe_ffn_hidden_size",
                  "moe_layer_freq": "moe_layer_freq", "moe_router_pre_softmax": "moe_router_pre_softmax",
                  "moe_shared_expert_intermediate_size": "moe_shared_expert_intermediate_size",
                  "moe_shared_expert_gate": "moe_shared_expert_gate", "moe_router_dtype": "moe_router_dtype",
                  "moe_token_dispatcher_type": "moe_token_dispatcher_type", "moe_aux_loss_coeff": "moe_aux_loss_coeff"}


def _side(*args) -> None:
    out = subprocess.run([_mcore_python(), os.path.join(HERE, "mcore_moe_side.py"), *args], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]


def _convert(kind: str, tmp_path) -> tuple[object, str, dict]:
    """(the HF model, megatron-core's torch_dist iteration directory, the side's model description)."""
    model = hf_model(kind)
    saved(model, tmp_path / "hf")
    assert _hf_tool().main(["--direction", "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--save",
                            str(tmp_path / "ours"), "--make-vocab-size-divisible-by", "16",
                            "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"]) == 0
    assert _megatron_tool().main(["--direction", "ours-to-megatron", "--load-dir", str(tmp_path / "ours"),
                                  "--save-dir", str(tmp_path / "mc"), "--ckpt-format", "torch_dist",
                                  "--megatron-layer-spec", "local"]) == 0
    it_dir = str(tmp_path / "mc" / "release")
    args = vars(load_file(os.path.join(it_dir, "common.pt"), "test")["args"])
    transformer = {theirs: args[ours] for ours, theirs in _CONFIG_FIELDS.items() if args.get(ours) is not None}
    spec = dict(transformer=transformer, vocab=args["padded_vocab_size"], seq=args["max_position_embeddings"],
                rotary_base=args["rotary_base"], untied=args["untie_embeddings_and_output_weights"])
    with open(tmp_path / "spec.json", "w") as f:
        json.dump(spec, f)
    return model, it_dir, spec


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_megatron_core_gives_the_hf_logits(kind, tmp_path):
    model, it_dir, spec = _convert(kind, tmp_path)
    tokens = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    _side(str(tmp_path / "spec.json"), "load", it_dir, str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt"))
    theirs = torch.load(tmp_path / "logits.pt")[..., :100]  # megatron-core: [b, s, padded vocab]
    with torch.no_grad():
        want = model(tokens).logits
    torch.testing.assert_close(theirs, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_megatron_core_asks_for_the_keys_written(tmp_path):
    """The Qwen2-MoE's mixed layers ([1,1,0,1]): megatron-core's own keys per layer, and exactly these shapes."""
    _, it_dir, _ = _convert("qwen2_moe", tmp_path)
    _side(str(tmp_path / "spec.json"), "layout", str(tmp_path / "keys.json"))
    with open(tmp_path / "keys.json") as f:
        want = json.load(f)
    from megatron_bmw.convert.mcore_dist import read_mcore

    got = {k: list(t.shape) for k, t in read_mcore(it_dir).items()}
    assert got == want
