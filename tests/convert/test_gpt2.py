"""HF GPT-2 <-> Megatron checkpoint conversion: logits match HF at tp=1 and tp=2, and the round trip is exact."""

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
from megatron_bmw.errors import UsageError
from megatron_bmw.config import padded_vocab_size
from megatron_bmw.convert.gpt2 import (
    hf_to_megatron, megatron_to_hf, merge_shards, partition_dim, shard_state_dict,
)
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel.state import ParallelState
from tests.dist_harness import run_distributed
from tests.reference import head_logits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "tools", "checkpoint", "convert_hf_gpt2.py")
HF_CONFIG = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                 attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
TOL = 1e-4


def _tool():
    spec = importlib.util.spec_from_file_location("convert_hf_gpt2", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _random_hf_model(**overrides):
    """A small random GPT2LMHeadModel; biases and LayerNorm params perturbed so layout errors show up."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**{**HF_CONFIG, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, HF_CONFIG["vocab_size"], (2, 16), generator=g)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """HF dir, HF logits [s, b, v], and Megatron checkpoints at tp=1 and tp=2 written by the CLI."""
    root = tmp_path_factory.mktemp("convert_gpt2")
    model = _random_hf_model()
    hf_dir = str(root / "hf")
    model.save_pretrained(hf_dir)
    with torch.no_grad():
        ref = model(_tokens()).logits.transpose(0, 1).contiguous()
    tool = _tool()
    saves = {}
    for tp in (1, 2):
        saves[tp] = str(root / f"megatron_tp{tp}")
        assert tool.main(["--direction", "hf-to-megatron", "--hf-dir", hf_dir, "--save", saves[tp],
                          "--tensor-model-parallel-size", str(tp)]) == 0
    return dict(root=root, hf_dir=hf_dir, ref=ref, saves=saves, hf_sd=model.state_dict(), tool=tool)


def _load(save: str, tp_rank: int) -> dict:
    with open(os.path.join(save, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == "release"
    return torch.load(os.path.join(save, "release", f"mp_rank_{tp_rank:02d}", "model_optim_rng.pt"),
                      weights_only=True)


def _model_config(args: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    return ModelConfig(**{k: v for k, v in args.items() if k in names})


def _logits(save: str, state: ParallelState, tokens: torch.Tensor) -> torch.Tensor:
    """This tp rank's vocab-parallel logits [s, b, v/tp] from the checkpoint at `save`."""
    ckpt = _load(save, state.tp_rank)
    model = ModelChunk(build_units(_model_config(ckpt["args"]), state, seed=0))
    model.load_state_dict(ckpt["model"], strict=True)
    return head_logits(model, tokens)


def _tp_logits(rank, world_size, save, tokens):
    import torch.distributed as dist

    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=world_size))
    local = _logits(save, st, tokens)
    parts = [torch.empty_like(local) for _ in range(world_size)]
    dist.all_gather(parts, local.contiguous(), group=st.tp_group)
    return torch.cat(parts, dim=-1)


def test_checkpoint_args_and_padding(converted):
    for tp, save in converted["saves"].items():
        ckpt = _load(save, 0)
        args = ckpt["args"]
        assert ckpt["iteration"] == 0 and ckpt["checkpoint_version"] == 3.0
        assert args["orig_vocab_size"] == 100 and args["padded_vocab_size"] == args["vocab_size"] == 128 * tp
        assert args["tensor_model_parallel_size"] == tp and args["pipeline_model_parallel_size"] == 1
        assert (args["num_layers"], args["hidden_size"], args["num_attention_heads"]) == (2, 64, 4)
        assert args["ffn_hidden_size"] == 256 and args["max_position_embeddings"] == 32
        assert args["untie_embeddings_and_output_weights"] is False
        wte = ckpt["model"]["units.embedding.word_embeddings.weight"]
        assert wte.shape == (128, 64)  # each rank's shard of the padded table
        if tp == 2:
            assert not (os.path.exists(os.path.join(save, "release", "mp_rank_02")))
            assert torch.count_nonzero(_load(save, 1)["model"]["units.embedding.word_embeddings.weight"]) == 0


def test_logits_match_hf_serial(converted):
    logits = _logits(converted["saves"][1], ParallelState.serial(), _tokens())
    assert logits.shape == (16, 2, 128)
    diff = (logits[..., :100] - converted["ref"]).abs().max().item()
    assert diff <= TOL, diff


@pytest.mark.slow
def test_logits_match_hf_tp2(converted):
    outs = run_distributed(2, _tp_logits, converted["saves"][2], _tokens())
    for logits in outs:
        assert logits.shape == (16, 2, 256)
        diff = (logits[..., :100] - converted["ref"]).abs().max().item()
        assert diff <= TOL, diff


def test_round_trip_to_hf(converted):
    from safetensors.torch import load_file

    out = str(converted["root"] / "hf_back")
    assert converted["tool"].main(["--direction", "megatron-to-hf", "--load", converted["saves"][2],
                                   "--hf-dir", out]) == 0
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(converted["hf_dir"], "config.json")) as f:
        orig_cfg = json.load(f)
    for key in ("n_layer", "n_embd", "n_head", "vocab_size", "n_positions", "layer_norm_epsilon", "n_inner",
                "activation_function", "tie_word_embeddings"):
        assert cfg.get(key) == orig_cfg.get(key), key
    back = load_file(os.path.join(out, "model.safetensors"))
    orig = {k: v for k, v in converted["hf_sd"].items() if k != "lm_head.weight"}  # tied: not saved
    assert set(back) - {"lm_head.weight"} == set(orig)
    for k, v in orig.items():
        assert torch.equal(back[k], v), k


def test_export_refuses_a_used_hf_dir_and_import_prints_a_complete_run_line(converted, capsys):
    """Probe, session 12: megatron-to-hf overwrote an existing model directory with exit 0, and the printed run
    line lacked the layout and padding flags the checkpoint needs."""
    victim = converted["root"] / "victim"
    victim.mkdir()
    (victim / "config.json").write_text("{}")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        converted["tool"].main(["--direction", "megatron-to-hf", "--load", converted["saves"][1], "--hf-dir",
                                str(victim)])
    assert exc.value.code == 2 and (victim / "config.json").read_text() == "{}"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --hf-dir {victim} is not empty; choose a new directory (the export would overwrite "
                   "what is there)"], err
    assert converted["tool"].main(["--direction", "hf-to-megatron", "--hf-dir", converted["hf_dir"], "--save",
                                   str(converted["root"] / "tp2_again"), "--tensor-model-parallel-size", "2"]) == 0
    run = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("run it with: pretrain_gpt.py ")]
    assert len(run) == 1 and ("--make-vocab-size-divisible-by 128 --tensor-model-parallel-size 2 "
                              "--pipeline-model-parallel-size 1 --load") in run[0], run


def test_untied_round_trip_and_sharding():
    hf = _random_hf_model(tie_word_embeddings=False)
    hf_sd = hf.state_dict()
    kwargs, full = hf_to_megatron(hf_sd, hf.config.to_dict(), make_vocab_size_divisible_by=8, tp=4)
    assert kwargs["untie_embeddings_and_output_weights"] and kwargs["vocab_size"] == 128
    assert full["units.head.output_weight"].shape == (128, 64)
    shards = [shard_state_dict(full, 4, r) for r in range(4)]
    assert shards[1]["units.attn_0.qkv.weight"].shape == (48, 64)
    assert shards[1]["units.mlp_1.fc2.weight"].shape == (64, 64)
    assert torch.equal(shards[3]["units.head.final_layernorm.weight"], full["units.head.final_layernorm.weight"])
    back = megatron_to_hf(merge_shards(shards), {**kwargs, "orig_vocab_size": 100})
    assert set(back) == set(hf_sd)
    for k, v in hf_sd.items():
        assert torch.equal(back[k], v), k
    # The serial model built from the converted weights reproduces HF's logits with an untied head.
    model = ModelChunk(build_units(ModelConfig(**kwargs), ParallelState.serial(), seed=0))
    model.load_state_dict(full, strict=True)
    model.eval()
    with torch.no_grad():
        hidden = None
        for name, unit in model.units.items():
            if name == "head":
                logits = unit.logits(hidden)
            else:
                hidden = unit(hidden, {"tokens": _tokens()})
        ref = hf(_tokens()).logits.transpose(0, 1)
    assert (logits[..., :100] - ref).abs().max().item() <= TOL


def test_partition_dims_and_padding():
    assert partition_dim("units.attn_0.qkv.weight") == 0 and partition_dim("units.attn_0.qkv.bias") == 0
    assert partition_dim("units.mlp_3.fc1.bias") == 0 and partition_dim("units.head.output_weight") == 0
    assert partition_dim("units.embedding.word_embeddings.weight") == 0
    assert partition_dim("units.attn_0.proj.weight") == 1 and partition_dim("units.mlp_0.fc2.weight") == 1
    for name in ("units.attn_0.proj.bias", "units.mlp_0.fc2.bias", "units.embedding.position_embeddings",
                 "units.attn_1.input_layernorm.weight", "units.head.final_layernorm.bias"):
        assert partition_dim(name) is None, name
    assert padded_vocab_size(50257, 128, 1) == 50304 and padded_vocab_size(50257, 128, 8) == 51200


def test_bad_tp_is_usage_error(converted, capsys):
    with pytest.raises(SystemExit) as exc:
        converted["tool"].main(["--direction", "hf-to-megatron", "--hf-dir", converted["hf_dir"],
                                "--save", str(converted["root"] / "bad"), "--tensor-model-parallel-size", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --tensor-model-parallel-size 3"), err
    with pytest.raises(UsageError, match="--tensor-model-parallel-size"):
        hf_to_megatron({}, {**HF_CONFIG, "model_type": "gpt2"}, tp=3)


@pytest.mark.slow
def test_missing_hf_dir_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, TOOL, "--direction", "hf-to-megatron", "--hf-dir", str(tmp_path / "nope"),
                           "--save", str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --hf-dir"), proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_pretrain_gpt_finetunes_from_converted_checkpoint(converted, capsys):
    """pretrain_gpt.py loads the converter's `release` checkpoint (weights only) and trains on; the training
    checkpoint it saves (RNG and optimizer state included) converts back to Hugging Face, and the converter never
    writes over it."""
    import subprocess
    import sys

    args = ["--mock-data", "--vocab-size", "100", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "32",
            "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-4",
            "--log-interval", "1", "--load", converted["saves"][1], "--attention-backend", "unfused",
            "--save", str(converted["root"] / "trained")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("RANK", None)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args], capture_output=True,
                         text=True, timeout=120, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "successfully loaded checkpoint" in out.stdout
    assert " iteration        1/       3 |" in out.stdout
    trained = converted["root"] / "trained"
    hf_out = converted["root"] / "hf_from_training"
    assert converted["tool"].main(["--direction", "megatron-to-hf", "--load", str(trained), "--hf-dir",
                                   str(hf_out)]) == 0
    assert (hf_out / "config.json").is_file()
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        converted["tool"].main(["--direction", "hf-to-megatron", "--hf-dir", converted["hf_dir"], "--save",
                                str(trained)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds a checkpoint" in err[0], err
    assert (trained / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def test_llama_checkpoints_are_refused_in_one_line():
    """The converters map GPT-2-style layers; a Llama-family checkpoint is named, not mis-converted."""
    from megatron_bmw.convert.tp_shards import refuse_llama

    args = {"num_layers": 2, "hidden_size": 32, "num_attention_heads": 4, "swiglu": True, "num_query_groups": 2,
            "position_embedding_type": "rope", "normalization": "RMSNorm", "add_bias_linear": False}
    with pytest.raises(UsageError, match=r"ckpt: a model with --position-embedding-type rope, --swiglu, "
                                         r"--num-query-groups 2, --normalization RMSNorm, --disable-bias-linear"):
        refuse_llama(args, "ckpt")
    with pytest.raises(UsageError, match="--swiglu"):
        megatron_to_hf({}, args)
    refuse_llama({"num_attention_heads": 4, "num_query_groups": None, "add_bias_linear": True}, "ckpt")  # GPT-2
