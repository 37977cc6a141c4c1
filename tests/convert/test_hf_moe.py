"""HF Mixtral / Qwen2-MoE <-> our MoE checkpoints (convert/hf_moe.py, tools/checkpoint/convert_hf_moe.py): the
per-expert names stack into our experts tensors and back bit-exactly, a tp x pp x ep checkpoint holds each rank's
experts and tp shards, the exported folder loads into transformers with the original's logits, the routing each
HF model computes is the one its flags name, and unsupported configs are one line. Tiny random models built here;
nothing is downloaded. (Logits of our own MoE forward: test_hf_moe_logits.py.)"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from megatron_bmw.config import ModelConfig
from megatron_bmw.convert.checkpoint_files import load_full, save_release
from megatron_bmw.convert.hf_moe import hf_config_from_megatron, hf_to_megatron, megatron_to_hf
from megatron_bmw.convert.tp_shards import join_experts, merge_shards, shard_state_dict, split_experts
from megatron_bmw.errors import UsageError
from megatron_bmw.safe_load import load_file

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "checkpoint", "convert_hf_moe.py")
BASE = dict(vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=4,
            max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
MIXTRAL = dict(BASE, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
QWEN = dict(BASE, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[2])


def _tool():
    spec = importlib.util.spec_from_file_location("convert_hf_moe", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hf_model(kind: str, **overrides):
    """A tiny random MixtralForCausalLM or Qwen2MoeForCausalLM, weights widened (std 0.2), norms perturbed."""
    torch.manual_seed(0)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**{**MIXTRAL, **overrides}))
    else:
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(**{**QWEN, **overrides}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model.eval()


def saved(model, path) -> tuple[dict, dict]:
    """(config.json, state dict) as save_pretrained writes them: the per-expert checkpoint names."""
    from safetensors.torch import load_file as load_safetensors

    model.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f), load_safetensors(os.path.join(path, "model.safetensors"))


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_hf_names_stack_into_ours_and_back_bit_exact(kind, tmp_path):
    config, hf_sd = saved(hf_model(kind), tmp_path / "hf")
    kwargs, full = hf_to_megatron(hf_sd, config, make_vocab_size_divisible_by=16, tp=1)
    m = "units.mlp_0."
    e, f = kwargs["moe"]["num_experts"], kwargs["moe"]["ffn_hidden_size"]
    assert full[m + "experts.fc1.weight"].shape == (e, 2 * f, 64)
    assert full[m + "experts.fc2.weight"].shape == (e, 64, f)
    assert full[m + "router.weight"].shape == (e, 64)
    block = "block_sparse_moe" if kind == "mixtral" else "mlp"
    gate, up, down = ("w1", "w3", "w2") if kind == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    x = f"model.layers.0.{block}.experts.3."
    assert torch.equal(full[m + "experts.fc1.weight"][3], torch.cat([hf_sd[x + gate + ".weight"],
                                                                     hf_sd[x + up + ".weight"]]))
    assert torch.equal(full[m + "experts.fc2.weight"][3], hf_sd[x + down + ".weight"])
    back = megatron_to_hf(full, {**kwargs, "orig_vocab_size": config["vocab_size"]})
    assert set(back) == set(hf_sd)
    assert all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)


def test_qwen2_moe_settings_and_dense_layers(tmp_path):
    config, hf_sd = saved(hf_model("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[]), tmp_path / "hf")
    kwargs, full = hf_to_megatron(hf_sd, config, make_vocab_size_divisible_by=16)
    moe = kwargs["moe"]
    assert moe == {**moe, "num_experts": 4, "router_topk": 2, "ffn_hidden_size": 16, "layer_freq": "[0,1,0,1]",
                   "pre_softmax": True, "shared_expert_intermediate_size": 32, "shared_expert_gate": True}
    assert kwargs["add_qkv_bias"] and not kwargs["add_bias_linear"] and kwargs["ffn_hidden_size"] == 48
    cfg = ModelConfig(**kwargs)
    assert [cfg.moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert full["units.mlp_0.fc1.weight"].shape == (96, 64) and "units.mlp_0.router.weight" not in full
    assert full["units.mlp_1.shared_expert.fc1.weight"].shape == (64, 64)
    assert full["units.mlp_1.shared_expert_gate.weight"].shape == (1, 64)
    model_type, hf_kwargs = hf_config_from_megatron(kwargs)
    assert model_type == "qwen2_moe"
    assert (hf_kwargs["decoder_sparse_step"], hf_kwargs["mlp_only_layers"], hf_kwargs["norm_topk_prob"]) == (2, [], False)
    normed, _ = hf_to_megatron(hf_sd, dict(config, norm_topk_prob=True), make_vocab_size_divisible_by=16)
    assert not normed["moe"]["pre_softmax"]


def test_router_semantics_match_transformers():
    """Mixtral: top-k of the softmax renormalised = the softmax over the k chosen logits (our default); Qwen2-MoE
    with norm_topk_prob false: the top-k of the softmax over all experts (--moe-router-pre-softmax)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    torch.manual_seed(1)
    x = torch.randn(10, 64)
    for router_cls, cfg, pre_softmax in ((MixtralTopKRouter, MIXTRAL, False),
                                         (Qwen2MoeTopKRouter, dict(QWEN, norm_topk_prob=False), True),
                                         (Qwen2MoeTopKRouter, dict(QWEN, norm_topk_prob=True), False)):
        config = (transformers.MixtralConfig if router_cls is MixtralTopKRouter else transformers.Qwen2MoeConfig)(**cfg)
        router = router_cls(config)
        torch.nn.init.normal_(router.weight)
        _, scores, index = router(x)
        logits = x @ router.weight.T
        if pre_softmax:  # Megatron's pre-softmax: softmax over all experts, then top-k
            want, want_index = torch.topk(torch.softmax(logits, -1), 2)
        else:  # top-k, then softmax over the k
            top, want_index = torch.topk(logits, 2)
            want = torch.softmax(top, -1)
        assert torch.equal(index, want_index)
        torch.testing.assert_close(scores, want, rtol=1e-6, atol=1e-6)


def test_experts_split_over_ep_and_etp():
    """ep rank j holds experts j*E/ep...; each expert's fc1 [gate; up] splits over tp as [gate_r; up_r], fc2 by
    columns; the router and the shared experts' gate are whole on every rank; the inverse is bit-exact."""
    g = torch.Generator().manual_seed(0)
    full = {"units.mlp_0.experts.fc1.weight": torch.randn(4, 8, 6, generator=g),
            "units.mlp_0.experts.fc2.weight": torch.randn(4, 6, 4, generator=g),
            "units.mlp_0.router.weight": torch.randn(4, 6, generator=g),
            "units.mlp_0.shared_expert.fc1.weight": torch.randn(8, 6, generator=g),
            "units.mlp_0.shared_expert.fc2.weight": torch.randn(6, 4, generator=g),
            "units.mlp_0.shared_expert_gate.weight": torch.randn(1, 6, generator=g)}
    grid = {(e, t): shard_state_dict(split_experts(full, 2, e), 2, t, swiglu=True) for e in range(2) for t in range(2)}
    fc1 = full["units.mlp_0.experts.fc1.weight"]
    got = grid[1, 0]["units.mlp_0.experts.fc1.weight"]
    assert got.shape == (2, 4, 6)
    assert torch.equal(got, torch.cat([fc1[2:, 0:2], fc1[2:, 4:6]], dim=1))  # experts 2, 3: gate rows 0-1, up 4-5
    assert torch.equal(grid[1, 1]["units.mlp_0.experts.fc2.weight"], full["units.mlp_0.experts.fc2.weight"][2:, :, 2:])
    assert torch.equal(grid[0, 1]["units.mlp_0.router.weight"], full["units.mlp_0.router.weight"])
    assert torch.equal(grid[0, 1]["units.mlp_0.shared_expert.fc1.weight"],
                       torch.cat([full["units.mlp_0.shared_expert.fc1.weight"][2:4],
                                  full["units.mlp_0.shared_expert.fc1.weight"][6:8]]))
    back = join_experts([merge_shards([grid[e, t] for t in range(2)], swiglu=True) for e in range(2)])
    assert set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)
    with pytest.raises(UsageError, match="--expert-model-parallel-size 3 does not divide the 4 experts"):
        split_experts(full, 3, 0)


@pytest.mark.parametrize("kind, tp, pp, ep", [("mixtral", 2, 2, 2), ("qwen2_moe", 2, 1, 4), ("mixtral", 1, 2, 1)])
def test_checkpoint_at_tp_pp_ep_reassembles(kind, tp, pp, ep, tmp_path):
    config, hf_sd = saved(hf_model(kind), tmp_path / "hf")
    kwargs, full = hf_to_megatron(hf_sd, config, make_vocab_size_divisible_by=16, tp=tp, ep=ep)
    args = save_release(str(tmp_path / "ckpt"), full, dict(kwargs, orig_vocab_size=100), tp, pp, ep)
    assert (args["expert_model_parallel_size"], args["expert_tensor_parallel_size"]) == (ep, tp)
    dirs = sorted(os.listdir(tmp_path / "ckpt" / "release"))
    assert len(dirs) == tp * pp * ep
    if ep > 1:
        last = os.path.join(tmp_path, "ckpt", "release", dirs[-1], "model_optim_rng.pt")
        sd = load_file(last, "test")["model"]
        experts = [k for k in sd if k.endswith("experts.fc1.weight")]
        assert experts and all(sd[k].shape[0] == 4 // ep for k in experts)
        i = int(experts[0].split(".")[1].split("_")[1])
        want = full[experts[0]][-(4 // ep):]
        f = want.shape[1] // 2
        assert torch.equal(sd[experts[0]], torch.cat([want[:, f // tp * (tp - 1):f], want[:, -(f // tp):]], 1)), i
    merged, saved_args = load_full(str(tmp_path / "ckpt"))
    assert set(merged) == set(full) and all(torch.equal(merged[k], full[k]) for k in full)
    assert saved_args["moe"] == kwargs["moe"]


def test_tool_round_trip_loads_into_transformers(tmp_path, capsys):
    """HF -> tp 2 x pp 2 x ep 2 checkpoint -> HF with the CLI: the same tensors under the same names, and
    transformers loads the export with the original's logits."""
    tool = _tool()
    model = hf_model("qwen2_moe")
    config, hf_sd = saved(model, tmp_path / "hf")
    assert tool.main(["--direction", "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"), "--save",
                      str(tmp_path / "ckpt"), "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size",
                      "2", "--expert-model-parallel-size", "2", "--make-vocab-size-divisible-by", "16"]) == 0
    out = capsys.readouterr().out
    assert "--num-experts 4" in out and "--moe-router-pre-softmax" in out and "--moe-layer-freq '[1,1,0,1]'" in out
    assert "--expert-model-parallel-size 2" in out and "--moe-shared-expert-gate" in out
    assert tool.main(["--direction", "megatron-to-hf", "--load", str(tmp_path / "ckpt"), "--hf-dir",
                      str(tmp_path / "out")]) == 0
    from safetensors.torch import load_file as load_safetensors

    back = load_safetensors(os.path.join(tmp_path, "out", "model.safetensors"))
    assert set(back) == set(hf_sd) and all(torch.equal(back[k], hf_sd[k]) for k in hf_sd)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).eval()
    assert type(reloaded).__name__ == "Qwen2MoeForCausalLM"
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)


@pytest.mark.parametrize("overrides, needle", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(sliding_window=16), "sliding_window 16"),
    (dict(num_experts_per_tok=5), "num_experts_per_tok 5"),
])
def test_unsupported_mixtral_configs(overrides, needle, tmp_path):
    config, hf_sd = saved(hf_model("mixtral"), tmp_path / "hf")
    with pytest.raises(UsageError, match=needle.replace("(", r"\(")):
        hf_to_megatron(hf_sd, dict(config, **overrides))


def test_bad_layouts_and_exports_are_one_line(tmp_path):
    config, hf_sd = saved(hf_model("mixtral"), tmp_path / "hf")
    with pytest.raises(UsageError, match="--expert-model-parallel-size 3 does not divide the 4 experts"):
        hf_to_megatron(hf_sd, config, ep=3)
    with pytest.raises(UsageError, match="use_sliding_window"):
        hf_to_megatron({}, dict(QWEN, model_type="qwen2_moe", use_sliding_window=True))
    kwargs, full = hf_to_megatron(hf_sd, config, make_vocab_size_divisible_by=16)
    for change, needle in ((dict(pre_softmax=True), "--moe-router-pre-softmax without shared experts"),
                           (dict(layer_freq="[1,0,1,0]"), "leaves dense layers"),
                           (dict(score_function="sigmoid"), "--moe-router-score-function sigmoid"),
                           (dict(shared_expert_intermediate_size=8), "without --moe-shared-expert-gate")):
        with pytest.raises(UsageError, match=needle):
            megatron_to_hf(full, dict(kwargs, moe=dict(kwargs["moe"], **change)))
    with pytest.raises(UsageError, match="a dense model"):
        megatron_to_hf(full, dict(kwargs, moe=None))
