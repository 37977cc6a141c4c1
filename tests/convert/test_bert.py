"""Hugging Face BERT pretraining models <-> our BERT units: logits equal at tp 1 and 2 (models built from configs,
nothing downloaded), both directions, both Hugging Face layouts (post-LN BertForPreTraining, pre-LN
MegatronBertForPreTraining), and the CLI tool."""

import os
import subprocess
import sys

import pytest
import torch

from megatron_bmw.config import ModelConfig, ParallelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.convert.bert import hf_to_ours, merge_shards, ours_to_hf, shard_state_dict
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel.mappings import gather_along
from megatron_bmw.parallel.state import ParallelState
from tests.dist_harness import run_distributed

transformers = pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMALL = dict(vocab_size=53, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             max_position_embeddings=16, type_vocab_size=2)


def _hf_model(arch: str, act: str = "gelu_pytorch_tanh", tied: bool = True):
    torch.manual_seed(0)
    if arch == "BertForPreTraining":
        model = transformers.BertForPreTraining(transformers.BertConfig(**SMALL, hidden_act=act,
                                                                        tie_word_embeddings=tied))
    else:
        model = transformers.MegatronBertForPreTraining(transformers.MegatronBertConfig(**SMALL, hidden_act=act,
                                                                                        tie_word_embeddings=tied))
    with torch.no_grad():  # random LayerNorms and biases too, so a misplaced one shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    model.config.architectures = [arch]
    return model.eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, SMALL["vocab_size"], (3, 12), generator=g)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, 10:] = 0
    types = (torch.arange(12)[None, :] >= 5).long().expand(3, 12).contiguous() * mask
    return ids, mask, types


def _ours_logits(kwargs, shard, state):
    cfg = ModelConfig(**kwargs)
    model = ModelChunk(build_units(cfg, state, seed=0)).eval()
    model.load_state_dict(shard, strict=True)
    ids, mask, types = _inputs()
    batch = {"tokens": ids, "types": types, "padding_mask": mask.bool()}
    units = list(model.units.values())
    with torch.no_grad():
        hidden = None
        for unit in units[:-1]:
            hidden = unit(hidden, batch)
        lm, sop = units[-1].outputs(hidden, batch)
    lm = gather_along(lm, -1, state.tp_group).transpose(0, 1)  # [b, s, padded vocab]
    return lm[..., :SMALL["vocab_size"]], sop


def _hf_logits(model):
    ids, mask, types = _inputs()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    return out.prediction_logits, out.seq_relationship_logits


def _check_close(ours, theirs, atol):
    ids, mask, _ = _inputs()
    real = mask.bool()
    torch.testing.assert_close(ours[0][real], theirs[0][real], rtol=0, atol=atol)
    torch.testing.assert_close(ours[1], theirs[1], rtol=0, atol=atol)


@pytest.mark.parametrize("arch", ["BertForPreTraining", "MegatronBertForPreTraining"])
def test_hf_logits_equal_ours_tp1_and_round_trip(arch):
    hf = _hf_model(arch)
    kwargs, full = hf_to_ours(hf.state_dict(), hf.config.to_dict(), make_vocab_size_divisible_by=8)
    assert kwargs["apply_residual_connection_post_layernorm"] == (arch == "BertForPreTraining")
    _check_close(_ours_logits(kwargs, full, ParallelState.serial()), _hf_logits(hf), atol=2e-5)
    back, config = ours_to_hf(full, kwargs, SMALL["vocab_size"])
    assert config["architectures"] == [arch] and config["hidden_act"] == "gelu_pytorch_tanh"
    theirs = {k: v for k, v in hf.state_dict().items() if not k.endswith(("position_ids", "token_type_ids"))}
    assert set(back) == set(theirs)
    for name, t in theirs.items():
        assert torch.equal(back[name], t), name


def test_hf_exact_gelu_converts_closely_and_untied():
    hf = _hf_model("BertForPreTraining", act="gelu", tied=False)
    kwargs, full = hf_to_ours(hf.state_dict(), hf.config.to_dict(), make_vocab_size_divisible_by=8)
    assert kwargs["untie_embeddings_and_output_weights"] and not kwargs["openai_gelu"]
    _check_close(_ours_logits(kwargs, full, ParallelState.serial()), _hf_logits(hf), atol=5e-3)


def _tp2_case(rank, world_size, arch):
    hf = _hf_model(arch)
    kwargs, full = hf_to_ours(hf.state_dict(), hf.config.to_dict(), make_vocab_size_divisible_by=8, tp=2)
    state = ParallelState.build(ParallelConfig(tensor_model_parallel_size=2))
    ours = _ours_logits(kwargs, shard_state_dict(full, 2, state.tp_rank), state)
    _check_close(ours, _hf_logits(hf), atol=2e-5)
    merged = merge_shards([shard_state_dict(full, 2, r) for r in range(2)])
    return all(torch.equal(merged[k], full[k]) for k in full)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["BertForPreTraining", "MegatronBertForPreTraining"])
def test_hf_logits_equal_ours_tp2(arch):
    assert all(run_distributed(2, _tp2_case, arch))


def test_refused_configs():
    hf = _hf_model("BertForPreTraining")
    config = hf.config.to_dict()
    with pytest.raises(UsageError, match="position_embedding_type relative_key"):
        hf_to_ours(hf.state_dict(), {**config, "position_embedding_type": "relative_key"})
    with pytest.raises(UsageError, match="hidden_act 'relu'"):
        hf_to_ours(hf.state_dict(), {**config, "hidden_act": "relu"})
    with pytest.raises(UsageError, match="architecture BertForMaskedLM"):
        hf_to_ours(hf.state_dict(), {**config, "architectures": ["BertForMaskedLM"]})
    kwargs, full = hf_to_ours(hf.state_dict(), config)
    with pytest.raises(UsageError, match="without the binary head"):
        ours_to_hf(full, {**kwargs, "bert_binary_head": False}, SMALL["vocab_size"])
    from megatron_bmw.convert.megatron import read_ours  # the Megatron-LM converter is GPT only

    with pytest.raises(UsageError, match="holds a BERT model; only GPT checkpoints convert"):
        read_ours({(0, 0): {"args": {**kwargs, "tensor_model_parallel_size": 1}, "model": {}}})


@pytest.mark.slow
def test_cli_round_trip(tmp_path):
    hf = _hf_model("BertForPreTraining")
    hf.save_pretrained(tmp_path / "hf")
    tool = os.path.join(ROOT, "tools", "checkpoint", "convert_hf_bert.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, tool, "--direction", "hf-to-megatron", "--hf-dir", str(tmp_path / "hf"),
                          "--save", str(tmp_path / "ours"), "--tensor-model-parallel-size", "2",
                          "--pipeline-model-parallel-size", "2", "--make-vocab-size-divisible-by", "8"], capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr
    assert "--apply-residual-connection-post-layernorm" in out.stdout
    assert sorted(os.listdir(tmp_path / "ours" / "release"))[-1] == "mp_rank_01_001"  # tp 2 x pp 2, exported below
    back = subprocess.run([sys.executable, tool, "--direction", "megatron-to-hf", "--load", str(tmp_path / "ours"),
                           "--hf-dir", str(tmp_path / "hf2")], capture_output=True, text=True, timeout=180, env=env)
    assert back.returncode == 0, back.stderr
    again = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf2")).eval()
    _check_close(_hf_logits(again), _hf_logits(hf), atol=1e-6)
