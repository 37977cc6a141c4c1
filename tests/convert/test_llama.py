"""HF Llama <-> Megatron checkpoint conversion: our serial model's logits equal LlamaForCausalLM's (GQA, MQA, MHA,
tied and untied heads, biases, linear rope scaling), tp 2 and tp 2 x pp 2 checkpoints run like the serial one on
real gloo ranks, HF -> ours -> HF is bit-exact, pretrain_gpt.py trains on from a conversion, bad inputs are one
line (exit 2). Small random models built here; nothing is downloaded."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_bmw.config import ModelConfig, ParallelConfig
from megatron_bmw.convert.llama import hf_to_megatron, megatron_to_hf, qkv_hf_to_ours, qkv_ours_to_hf
from megatron_bmw.convert.tp_shards import merge_shards, shard_state_dict
from megatron_bmw.errors import UsageError
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel.init import shard
from megatron_bmw.parallel.state import ParallelState
from tests.dist_harness import run_distributed
from tests.reference import head_logits

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "checkpoint", "convert_hf_llama.py")
SMALL = dict(vocab_size=100, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
             num_hidden_layers=2, max_position_embeddings=32, rms_norm_eps=1e-5, tie_word_embeddings=False,
             bos_token_id=0, eos_token_id=0)
TOL = 1e-5


def _tool():
    spec = importlib.util.spec_from_file_location("convert_hf_llama", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _hf_model(**overrides):
    """A small random LlamaForCausalLM; weights widened (std 0.2) and norms perturbed so layout errors show."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**SMALL, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, SMALL["vocab_size"], (2, 16), generator=g)


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_tokens()).logits.transpose(0, 1).contiguous()  # [s, b, v]


def _config(args: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"params_dtype"}
    return ModelConfig(**{**{k: v for k, v in args.items() if k in names}, "attention_backend": "unfused"})


def _serial_logits(kwargs: dict, full: dict) -> torch.Tensor:
    model = ModelChunk(build_units(_config(kwargs), ParallelState.serial(), seed=0))
    model.load_state_dict(full, strict=True)
    return head_logits(model, _tokens())


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """An HF dir (GQA, untied), its logits, and checkpoints written by the CLI at tp 1, tp 2 and tp 2 x pp 2 (all
    padded to 112 rows)."""
    root = tmp_path_factory.mktemp("convert_llama")
    model = _hf_model()
    hf_dir = str(root / "hf")
    model.save_pretrained(hf_dir)
    tool = _tool()
    saves = {}
    for tp, pp, divisible in ((1, 1, 16), (2, 1, 8), (2, 2, 8)):
        saves[tp, pp] = str(root / f"megatron_tp{tp}pp{pp}")
        assert tool.main(["--direction", "hf-to-megatron", "--hf-dir", hf_dir, "--save", saves[tp, pp],
                          "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
                          "--make-vocab-size-divisible-by", str(divisible)]) == 0
    return dict(root=root, hf_dir=hf_dir, ref=_hf_logits(model), saves=saves, hf_sd=model.state_dict(), tool=tool)


def _rank_file(save: str, tp_rank: int, pp_rank: int | None = None) -> dict:
    mp = f"mp_rank_{tp_rank:02d}" + ("" if pp_rank is None else f"_{pp_rank:03d}")
    return torch.load(os.path.join(save, "release", mp, "model_optim_rng.pt"), weights_only=True)


# ----------------------------------------------------------------------------------------------------------------
# Layout


def test_qkv_layout_is_per_group_and_inverts():
    heads, groups, d, h = 4, 2, 3, 5
    q = torch.arange(heads * d * h, dtype=torch.float32).reshape(heads * d, h)
    k, v = -1 - torch.arange(groups * d * h).reshape(groups * d, h).float(), 1000 + torch.rand(groups * d, h)
    fused = qkv_hf_to_ours(q, k, v, groups)
    # group 0: q heads 0 and 1, then k_0, then v_0; group 1 likewise
    assert torch.equal(fused[:2 * d], q[:2 * d]) and torch.equal(fused[2 * d:3 * d], k[:d])
    assert torch.equal(fused[3 * d:4 * d], v[:d]) and torch.equal(fused[4 * d:6 * d], q[2 * d:])
    back = qkv_ours_to_hf(fused, heads, groups)
    assert all(torch.equal(a, b) for a, b in zip(back, (q, k, v)))


def test_swiglu_fc1_shards_by_stride_as_the_runtime_does():
    hf = _hf_model()
    kwargs, full = hf_to_megatron(hf.state_dict(), hf.config.to_dict(), make_vocab_size_divisible_by=8, tp=2)
    shards = [shard_state_dict(full, 2, r, swiglu=True) for r in range(2)]
    for r in range(2):  # parallel/init.shard is what the model's layers hold
        assert torch.equal(shards[r]["units.mlp_0.fc1.weight"], shard(full["units.mlp_0.fc1.weight"], 0, r, 2, 2))
        assert torch.equal(shards[r]["units.attn_1.qkv.weight"], shard(full["units.attn_1.qkv.weight"], 0, r, 2))
    ffn = SMALL["intermediate_size"]
    assert torch.equal(shards[1]["units.mlp_0.fc1.weight"][:ffn // 2], full["units.mlp_0.fc1.weight"][ffn // 2:ffn])
    merged = merge_shards(shards, swiglu=True)
    assert all(torch.equal(merged[k], full[k]) for k in full)
    assert not torch.equal(merge_shards(shards)["units.mlp_0.fc1.weight"], full["units.mlp_0.fc1.weight"])


# ----------------------------------------------------------------------------------------------------------------
# Logits equal Hugging Face's


@pytest.mark.parametrize("overrides", [
    dict(),                                                     # GQA, untied
    dict(num_key_value_heads=4, tie_word_embeddings=True),      # MHA, tied
    dict(num_key_value_heads=1),                                # MQA
    dict(attention_bias=True, mlp_bias=True),                   # all projections biased
    dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500000.0}),
    dict(model_type="mistral", sliding_window=None),            # a Mistral config of the same architecture
], ids=["gqa", "mha-tied", "mqa", "bias", "rope-linear", "mistral"])
def test_serial_logits_match_hf(overrides):
    model_type = overrides.pop("model_type", None)
    hf = _hf_model(**overrides)
    cfg = hf.config.to_dict()
    if model_type:
        cfg.update(model_type=model_type, sliding_window=overrides.get("sliding_window"))
    kwargs, full = hf_to_megatron(hf.state_dict(), cfg, make_vocab_size_divisible_by=8)
    assert kwargs["vocab_size"] == 104 and full["units.embedding.word_embeddings.weight"].shape == (104, 64)
    logits = _serial_logits(kwargs, full)
    ref = _hf_logits(hf)
    assert ref.abs().max() > 1.0  # weights wide enough that a wrong layout shows
    assert (logits[..., :100] - ref).abs().max().item() <= TOL
    back = megatron_to_hf(full, {**kwargs, "orig_vocab_size": 100})
    sd = hf.state_dict()
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_an_interleaved_rotary_layout_would_not_match():
    """Our rope rotates halves like HF's rotate_half, so q/k rows need no permutation; the interleaved (Meta)
    order gives other logits, so the identity above is checked, not assumed."""
    hf = _hf_model()
    kwargs, full = hf_to_megatron(hf.state_dict(), hf.config.to_dict(), make_vocab_size_divisible_by=8)
    w = full["units.attn_0.qkv.weight"].view(2, 4, 16, 64)  # [group, q q k v, d, h]
    full["units.attn_0.qkv.weight"] = w.view(2, 4, 2, 8, 64).transpose(2, 3).reshape(128, 64)
    assert (_serial_logits(kwargs, full)[..., :100] - _hf_logits(hf)).abs().max().item() > 1e-2


def test_checkpoint_files(converted):
    args = _rank_file(converted["saves"][2, 1], 1)["args"]
    assert (args["num_query_groups"], args["swiglu"], args["normalization"]) == (2, True, "RMSNorm")
    assert args["position_embedding_type"] == "rope" and args["add_bias_linear"] is False
    assert args["orig_vocab_size"] == 100 and args["padded_vocab_size"] == 112
    assert args["tensor_model_parallel_size"] == 2 and args["pipeline_model_parallel_size"] == 1
    stage0 = _rank_file(converted["saves"][2, 2], 0, 0)["model"]
    stage1 = _rank_file(converted["saves"][2, 2], 1, 1)["model"]
    assert "units.embedding.word_embeddings.weight" in stage0 and "units.head.output_weight" in stage1
    assert {k.split(".")[1] for k in stage1} == {"attn_1", "mlp_1", "head"}
    assert stage1["units.mlp_1.fc1.weight"].shape == (96, 64) and stage1["units.attn_1.qkv.weight"].shape == (64, 64)


def _tp_logits(rank, world_size, save):
    import torch.distributed as dist

    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=world_size))
    ckpt = _rank_file(save, st.tp_rank)
    model = ModelChunk(build_units(_config(ckpt["args"]), st, seed=0))
    model.load_state_dict(ckpt["model"], strict=True)
    local = head_logits(model, _tokens())
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous(), group=st.tp_group)
    return torch.cat(parts, dim=-1)


@pytest.mark.slow
def test_tp2_logits_match_hf(converted):
    for logits in run_distributed(2, _tp_logits, converted["saves"][2, 1]):
        assert logits.shape == (16, 2, 112)
        assert (logits[..., :100] - converted["ref"]).abs().max().item() <= TOL


def test_round_trip_is_bit_exact(converted):
    from safetensors.torch import load_file

    with open(os.path.join(converted["hf_dir"], "config.json")) as f:
        orig_cfg = json.load(f)
    for key in ((1, 1), (2, 2)):
        out = str(converted["root"] / f"hf_back_{key[0]}{key[1]}")
        assert converted["tool"].main(["--direction", "megatron-to-hf", "--load", converted["saves"][key],
                                       "--hf-dir", out]) == 0
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings", "hidden_act", "attention_bias",
                  "max_position_embeddings", "rope_parameters"):
            assert cfg.get(k) == orig_cfg.get(k), k
        back = load_file(os.path.join(out, "model.safetensors"))
        assert set(back) == set(converted["hf_sd"])
        for k, v in converted["hf_sd"].items():
            assert torch.equal(back[k], v), k
        # the padded rows were zero on import and are carried, so a re-import is exact too
        assert load_file(os.path.join(out, "megatron_vocab_padding.safetensors"))[
            "units.embedding.word_embeddings.weight"].shape == (12, 64)


# ----------------------------------------------------------------------------------------------------------------
# Training continues


def _run_flags(tp: int = 1, pp: int = 1, divisible: int = 16) -> list[str]:
    return ["--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", str(divisible),
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "96",
            "--position-embedding-type", "rope", "--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-5",
            "--group-query-attention", "--num-query-groups", "2", "--disable-bias-linear",
            "--untie-embeddings-and-output-weights", "--seq-length", "16", "--max-position-embeddings", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
            "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--attention-backend", "unfused",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]


def _train_history(rank, world_size, argv):
    from megatron_bmw.training.loop import build_trainer

    trainer = build_trainer(argv)
    trainer.train()
    return trainer.history


@pytest.mark.slow
def test_tp2pp2_conversion_trains_like_the_serial_one(converted):
    """The tp 2 x pp 2 conversion (grouped QKV and stride-2 fc1 shards, the head on stage 1) loads into 4 ranks
    and trains exactly like the tp 1 conversion on one."""
    ref = run_distributed(1, _train_history, _run_flags(divisible=16) + ["--load", converted["saves"][1, 1]])[0]
    runs = run_distributed(4, _train_history, _run_flags(2, 2, 8) + ["--load", converted["saves"][2, 2]])
    hist = runs[-1]  # the last rank holds the loss
    assert [h[0] for h in hist] == [h[0] for h in ref] == [1, 2]
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5), it
        assert norm == pytest.approx(ref_norm, rel=1e-4), it


@pytest.mark.slow
def test_pretrain_gpt_continues_from_an_imported_checkpoint(converted):
    """pretrain_gpt.py --load on the converted directory, with the flags the tool prints, trains on; its training
    checkpoint exports back to a LlamaForCausalLM whose logits are our trained model's."""
    trained = converted["root"] / "trained"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    args = _rank_file(converted["saves"][1, 1], 0)["args"]
    from megatron_bmw.convert.hf_files import layout_flags

    argv = (converted["tool"].run_flags(args) + " " + layout_flags(args)).split() + [
        "--mock-data", "--vocab-size", "100", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size",
        "4", "--train-iters", "3", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0",
        "--attention-backend", "unfused", "--load", converted["saves"][1, 1], "--save", str(trained)]
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *argv], capture_output=True,
                         text=True, timeout=240, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "successfully loaded checkpoint" in out.stdout and " iteration        3/       3 |" in out.stdout
    hf_out = str(converted["root"] / "hf_trained")
    assert converted["tool"].main(["--direction", "megatron-to-hf", "--load", str(trained), "--hf-dir", hf_out]) == 0
    hf = transformers.LlamaForCausalLM.from_pretrained(hf_out).eval()
    ckpt = torch.load(trained / "iter_0000003" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    ours = _serial_logits(ckpt["args"], ckpt["model"])
    assert not torch.allclose(ours[..., :100], converted["ref"], atol=1e-3)  # it trained
    assert (ours[..., :100] - _hf_logits(hf)).abs().max().item() <= TOL


# ----------------------------------------------------------------------------------------------------------------
# Bad input: one line, exit 2


def _save_config(tmp_path, **overrides) -> str:
    hf = _hf_model()
    d = tmp_path / "hf_bad"
    hf.save_pretrained(str(d))
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(overrides)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


@pytest.mark.parametrize("overrides, needle", [
    (dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "rope_theta": 500000.0}), "rope scaling 'llama3'"),
    (dict(rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope scaling 'dynamic'"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    (dict(attention_bias=True), "attention_bias True with mlp_bias False"),
    (dict(mlp_bias=True), "attention_bias False with mlp_bias True"),
    (dict(model_type="mistral", sliding_window=4096), "sliding_window 4096"),
    (dict(model_type="qwen2"), "'qwen2' model"),
    (dict(head_dim=32), "head_dim 32"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.5}), "rope theta 10000.5"),
])
def test_unsupported_configs_are_one_line(tmp_path, capsys, overrides, needle):
    hf_dir = _save_config(tmp_path, **overrides)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        _tool().main(["--direction", "hf-to-megatron", "--hf-dir", hf_dir, "--save", str(tmp_path / "out")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --hf-dir") and needle in err[0], err
    assert not (tmp_path / "out").exists()


def test_bad_layouts_and_models_are_one_line(converted, tmp_path, capsys):
    tool = converted["tool"]
    cases = [
        (["--direction", "hf-to-megatron", "--hf-dir", converted["hf_dir"], "--save", str(tmp_path / "a"),
          "--tensor-model-parallel-size", "4"], "--tensor-model-parallel-size 4 does not divide --num-query-groups 2"),
        (["--direction", "hf-to-megatron", "--hf-dir", converted["hf_dir"], "--save", str(tmp_path / "b"),
          "--pipeline-model-parallel-size", "3"], "--pipeline-model-parallel-size 3"),
        (["--direction", "hf-to-megatron", "--hf-dir", converted["hf_dir"], "--save", converted["saves"][1, 1]],
         "already holds a checkpoint"),
        (["--direction", "megatron-to-hf", "--load", str(tmp_path / "none"), "--hf-dir", str(tmp_path / "c")],
         "is not a directory"),
    ]
    for argv, needle in cases:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exc:
            tool.main(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], (needle, err)
    # MQA shards over no more tp ranks than it has groups
    hf = _hf_model(num_key_value_heads=1)
    with pytest.raises(UsageError, match="does not divide --num-query-groups 1"):
        hf_to_megatron(hf.state_dict(), hf.config.to_dict(), tp=2)


def test_the_other_converters_name_this_one(converted, tmp_path):
    """The GPT-2 converter refuses a Llama checkpoint, pointing here; this one refuses a GPT-2-style model."""
    gpt2 = importlib.util.spec_from_file_location("convert_hf_gpt2", os.path.join(ROOT, "tools", "checkpoint",
                                                                                   "convert_hf_gpt2.py"))
    mod = importlib.util.module_from_spec(gpt2)
    gpt2.loader.exec_module(mod)
    with pytest.raises(UsageError, match="convert_hf_llama.py"):
        mod.megatron_to_hf_dir(converted["saves"][1, 1], str(tmp_path / "x"))
    with pytest.raises(UsageError, match="needs --position-embedding-type rope .*convert_hf_gpt2.py"):
        megatron_to_hf({}, dict(num_layers=2, hidden_size=64, num_attention_heads=4))
    with pytest.raises(UsageError, match="--rotary-percent 0.5"):
        megatron_to_hf({}, dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm",
                                rotary_percent=0.5))
    for key, flag in (("qk_layernorm", "--qk-layernorm"), ("apply_layernorm_1p", "--apply-layernorm-1p")):
        with pytest.raises(UsageError, match=f"{flag} has no LlamaForCausalLM equivalent"):
            megatron_to_hf({}, dict(position_embedding_type="rope", swiglu=True, normalization="RMSNorm", **{key: True}))


@pytest.mark.slow
def test_missing_hf_dir_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, TOOL, "--direction", "hf-to-megatron", "--hf-dir", str(tmp_path / "nope"),
                           "--save", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --hf-dir"), proc.stderr
