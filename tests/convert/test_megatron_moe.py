"""Megatron-LM MoE checkpoints <-> ours (convert/megatron_moe.py, megatron_moe_args.py, the ep ranks of
megatron.py and tools/checkpoint/convert_megatron.py, mcore_dist.py): megatron-core's names for the router, the
experts in its three modules (SequentialMLP, TEGroupedMLP, the legacy GroupedMLP) and the shared experts, one file
per (tp, pp, ep) rank with its local experts, the torch_dist keys with every expert stacked, and every round trip
and reshard bit-exact. The expected Megatron tensors are written out here from megatron-core 0.16.1's definitions
(experts.py: weight1.view(E/ep, h, -1), the sharded_state_dict's global expert offsets)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_bmw.config import ModelConfig
from megatron_bmw.convert.mcore_dist import mcore_to_ours, ours_to_mcore, read_mcore, write_mcore
from megatron_bmw.convert.megatron import read_megatron, read_ours, write_megatron, write_ours
from megatron_bmw.convert.megatron_layout import Layout, Model, Target, expected_shapes, retarget
from megatron_bmw.errors import UsageError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
E, H, F, FS = 4, 32, 16, 32  # experts, hidden, expert FFN, shared experts' FFN


def _tool():
    spec = importlib.util.spec_from_file_location("convert_megatron_moe", os.path.join(ROOT, "tools", "checkpoint",
                                                                                      "convert_megatron.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(**moe) -> Model:
    cfg = ModelConfig(num_layers=4, hidden_size=H, num_attention_heads=4, ffn_hidden_size=48, vocab_size=128,
                      seq_length=16, position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
                      add_bias_linear=False, num_query_groups=2, untie_embeddings_and_output_weights=True,
                      moe=dict(dict(num_experts=E, router_topk=2, ffn_hidden_size=F, layer_freq="[1,1,0,1]",
                                    shared_expert_intermediate_size=FS, shared_expert_gate=True), **moe)).to_json()
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(*s, generator=g) for k, s in expected_shapes(cfg).items()}
    return Model(full=full, config=cfg, layout=Layout(1, 1, 1, [10]), iteration=5, orig_vocab_size=100,
                 make_vocab_size_divisible_by=16)


def _same(a: dict, b: dict, rows: int | None = None) -> None:
    """The same tensors (the vocabulary's first `rows` rows only: another tp size pads it otherwise)."""
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:4]
    vocab = ("units.embedding.word_embeddings.weight", "units.head.output_weight")
    bad = [k for k in a if not torch.equal(a[k][:rows], b[k][:rows]) if k in vocab and rows] + \
          [k for k in a if not (k in vocab and rows) and not torch.equal(a[k], b[k])]
    assert not bad, bad[:4]


@pytest.mark.parametrize("experts", ["sequential", "te_grouped", "legacy_grouped"])
def test_megatron_rank_files_hold_megatron_core_tensors(experts):
    """tp 2 x pp 2 x ep 2: the file of (tp 1, pp 0, ep 1) holds experts 2 and 3 as local experts 0 and 1, each the
    tp rank's [gate_1; up_1] rows (fc2: its columns), in the module's own layout; the router whole, the shared experts
    split as a dense MLP; the MoE layer's norm as pre_mlp_layernorm also with the TE spec."""
    model = _model()
    m, layout = retarget(model, Target(tp=2, pp=2, ep=2), to_megatron=True)
    files = write_megatron(m, layout, "transformer_engine", None, experts)
    assert sorted(files) == [(t, r, e) for t in range(2) for r in range(2) for e in range(2)]
    sd, full = files[1, 0, 1]["model"], model.full
    fc1, fc2 = full["units.mlp_0.experts.fc1.weight"], full["units.mlp_0.experts.fc2.weight"]
    want1 = [torch.cat([fc1[2 + j][F // 2:F], fc1[2 + j][F + F // 2:]]) for j in range(2)]  # [gate_1; up_1]
    want2 = [fc2[2 + j][:, F // 2:] for j in range(2)]
    p = "decoder.layers.0.mlp."
    if experts == "sequential":
        got1 = [sd[f"{p}experts.local_experts.{j}.linear_fc1.weight"] for j in range(2)]
        got2 = [sd[f"{p}experts.local_experts.{j}.linear_fc2.weight"] for j in range(2)]
        assert sd[f"{p}experts.local_experts.1.linear_fc2._extra_state"] is None
    elif experts == "te_grouped":
        got1 = [sd[f"{p}experts.linear_fc1.weight{j}"] for j in range(2)]
        got2 = [sd[f"{p}experts.linear_fc2.weight{j}"] for j in range(2)]
        assert sd[f"{p}experts.linear_fc1._extra_state"] is None
    else:  # GroupedMLP's forward: w1 = weight1.view(E/ep, h, -1), w2 = weight2.view(E/ep, -1, h), x @ w
        assert sd[f"{p}experts.weight1"].shape == (H, 2 * F)  # [h, E/ep * rows/tp]
        got1 = list(sd[f"{p}experts.weight1"].view(2, H, -1).transpose(1, 2))
        got2 = list(sd[f"{p}experts.weight2"].view(2, -1, H).transpose(1, 2))
        assert not any(k.endswith("_extra_state") and ".experts." in k for k in sd)
    assert all(torch.equal(g, w) for g, w in zip(got1 + got2, want1 + want2))
    assert torch.equal(sd[p + "router.weight"], full["units.mlp_0.router.weight"])
    assert torch.equal(sd[p + "shared_experts.gate_weight"], full["units.mlp_0.shared_expert_gate.weight"])
    shared = full["units.mlp_0.shared_expert.fc1.weight"]
    assert torch.equal(sd[p + "shared_experts.linear_fc1.weight"], torch.cat([shared[16:32], shared[48:]]))
    assert torch.equal(sd["decoder.layers.0.pre_mlp_layernorm.weight"],
                       full["units.mlp_0.post_attention_layernorm.weight"])
    assert "decoder.layers.0.mlp.linear_fc1._extra_state" not in sd
    dense = files[1, 1, 1]["model"]  # pp rank 1 holds layers 2 (dense) and 3 (MoE), numbered 0 and 1
    assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in dense and "decoder.layers.1.mlp.router.weight" in dense
    a = files[0, 0, 0]["args"]
    assert (a.num_experts, a.moe_router_topk, a.moe_ffn_hidden_size, a.moe_layer_freq) == (E, 2, F, [1, 1, 0, 1])
    assert (a.moe_shared_expert_intermediate_size, a.moe_shared_expert_gate, a.expert_model_parallel_size) == (FS, True,
                                                                                                             2)
    assert a.moe_grouped_gemm == (experts != "sequential") and a.moe_use_legacy_grouped_gemm == (experts ==
                                                                                                 "legacy_grouped")
    back = read_megatron(files)
    _same(back.full, m.full)
    assert back.layout.ep == 2 and back.config["moe"]["layer_freq"] == "[1,1,0,1]"


def test_ours_ep_files_round_trip_and_reshard():
    model = _model(pre_softmax=True)
    m, layout = retarget(model, Target(tp=2, pp=2, ep=4), to_megatron=False)
    files = write_ours(m, layout)
    assert files[0, 0, 3]["args"]["expert_model_parallel_size"] == 4
    assert files[1, 1, 3]["model"]["units.mlp_3.experts.fc1.weight"].shape == (1, F, H)
    back = read_ours(files)
    _same(back.full, m.full)
    assert back.config["moe"] == m.config["moe"]
    serial, layout1 = retarget(back, Target(tp=1, pp=1, ep=1), to_megatron=False)
    _same(read_ours(write_ours(serial, layout1)).full, serial.full)
    with pytest.raises(UsageError, match="expert-parallel size 3 does not divide the 4 experts"):
        retarget(back, Target(ep=3), to_megatron=False)


def test_torch_dist_stacks_every_expert_and_the_layers(tmp_path):
    """megatron-core's torch_dist keys: with every layer MoE, `decoder.layers.mlp.experts.experts.linear_fc1.weight`
    [L, E, 2F, h] (global expert J at offset J) and the router [L, E, h]; with dense and MoE layers mixed, each
    layer's own keys (its TransformerBlock's non_homogeneous_layers); read back bit-exact."""
    model = _model(layer_freq="1")
    flat = ours_to_mcore(model.full, tied=False)
    assert flat["decoder.layers.mlp.experts.experts.linear_fc1.weight"].shape == (4, E, 2 * F, H)
    assert torch.equal(flat["decoder.layers.mlp.experts.experts.linear_fc2.weight"][3, 2],
                       model.full["units.mlp_3.experts.fc2.weight"][2])
    assert flat["decoder.layers.mlp.router.weight"].shape == (4, E, H)
    assert torch.equal(flat["decoder.layers.pre_mlp_layernorm.weight"][1],
                       model.full["units.mlp_1.post_attention_layernorm.weight"])
    write_mcore(str(tmp_path / "m"), flat)
    _same(mcore_to_ours(read_mcore(str(tmp_path / "m")), tied=False), model.full)
    mixed = _model()
    flat = ours_to_mcore(mixed.full, tied=False, per_layer=True)
    assert flat["decoder.layers.3.mlp.experts.experts.linear_fc1.weight"].shape == (E, 2 * F, H)
    assert torch.equal(flat["decoder.layers.2.mlp.linear_fc1.weight"], mixed.full["units.mlp_2.fc1.weight"])
    assert "decoder.layers.2.mlp.router.weight" not in flat
    write_mcore(str(tmp_path / "mixed"), flat)
    _same(mcore_to_ours(read_mcore(str(tmp_path / "mixed")), tied=False), mixed.full)


@pytest.mark.parametrize("experts", ["te_grouped", "legacy_grouped"])
def test_tool_converts_both_ways_and_formats(experts, tmp_path, capsys):
    """ours tp 2 x pp 2 x ep 2 -> Megatron (torch in each expert layout, and torch_dist) -> ours at tp 1 x ep 4:
    the same weights."""
    tool = _tool()
    m, layout = retarget(_model(), Target(tp=2, pp=2, ep=2), to_megatron=False)
    tool.write_checkpoint_dir(str(tmp_path / "ours"), write_ours(m, layout), 5, 2, 2)
    assert tool.main(["--direction", "ours-to-megatron", "--load-dir", str(tmp_path / "ours"), "--save-dir",
                      str(tmp_path / "meg"), "--megatron-expert-layout", experts]) == 0
    assert "--expert-model-parallel-size 2 --moe-grouped-gemm" in capsys.readouterr().out
    assert "mp_rank_01_001_001" in os.listdir(tmp_path / "meg" / "iter_0000005")
    assert tool.main(["--direction", "ours-to-megatron", "--load-dir", str(tmp_path / "ours"), "--save-dir",
                      str(tmp_path / "dist"), "--ckpt-format", "torch_dist"]) == 0
    for src in ("meg", "dist"):
        assert tool.main(["--direction", "megatron-to-ours", "--load-dir", str(tmp_path / src), "--save-dir",
                          str(tmp_path / f"back_{src}"), "--target-tensor-parallel-size", "1",
                          "--target-pipeline-model-parallel-size", "1", "--target-expert-model-parallel-size", "4",
                          "--make-vocab-size-divisible-by", "16"]) == 0
        files, _ = tool.read_checkpoint_dir(str(tmp_path / f"back_{src}"))
        assert sorted(files) == [(0, 0, e) for e in range(4)]
        back = read_ours(files)
        assert back.config["vocab_size"] == 112  # 100 padded for tp 1
        _same(back.full, m.full, rows=100)


def test_unsupported_megatron_moe_is_one_line(tmp_path):
    model = _model()
    m, layout = retarget(model, Target(tp=2, ep=2), to_megatron=True)
    files = write_megatron(m, layout)
    for change, needle in ((dict(moe_router_enable_expert_bias=True), "expert bias"),
                           (dict(add_bias_linear=True, disable_bias_linear=False), "MoE with biases"),
                           (dict(moe_router_num_groups=2), "group-limited routing"),
                           (dict(expert_tensor_parallel_size=1), "expert_tensor_parallel_size 1 differs"),
                           (dict(moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"]), "one only")):
        bad = {k: dict(p, args=type(p["args"])(**dict(vars(p["args"]), **change))) for k, p in files.items()}
        with pytest.raises(UsageError, match=needle):
            read_megatron(bad)
    one = {k: p for k, p in files.items() if k[2] == 0}
    with pytest.raises(UsageError, match="expert_model_parallel_size 2, the checkpoint holds 1 expert ranks"):
        read_megatron(one)
