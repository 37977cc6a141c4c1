"""Converters read any layout the runtime writes: checkpoints of real short training runs at pp 2 (tied output
copy on the last stage) and tp 2 x pp 2 with two virtual stages per rank (untied) export to Hugging Face, and
export then import restores every weight bit for bit, padded vocabulary rows included."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from megatron_bmw.config import ModelConfig
from megatron_bmw.convert.checkpoint_files import load_full, save_release, stage_state_dicts
from megatron_bmw.convert.vocab_padding import PADDING_FILE
from megatron_bmw.errors import UsageError
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel.state import ParallelState
from tests.dist_harness import run_distributed

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORD = "units.embedding.word_embeddings.weight"


def _gpt2_tool():
    spec = importlib.util.spec_from_file_location("convert_hf_gpt2", os.path.join(ROOT, "tools", "checkpoint",
                                                                                   "convert_hf_gpt2.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _flags(tp: int, pp: int, divisible: int, *extra: str) -> list[str]:
    return ["--mock-data", "--vocab-size", "100", "--make-vocab-size-divisible-by", str(divisible),
            "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "2", "--lr", "1e-2", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters",
            "0", "--hidden-dropout", "0", "--attention-dropout", "0", "--attention-backend", "unfused",
            "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]


def _train(rank, world_size, argv):
    from megatron_bmw.training.loop import build_trainer

    trainer = build_trainer(argv)
    trainer.train()
    return trainer.history


LAYOUTS = {  # name: (world size, flags of the run that writes the checkpoint)
    "pp2": (2, _flags(1, 2, 8)),
    "tp2pp2v2": (4, _flags(2, 2, 8, "--num-layers-per-virtual-pipeline-stage", "1",
                           "--untie-embeddings-and-output-weights")),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("any_layout")
    out = {}
    for name, (world, argv) in LAYOUTS.items():
        save = str(root / name)
        run_distributed(world, _train, argv + ["--save", save])
        out[name] = save
    return root, out


def _serial_loss(args: dict, full: dict) -> torch.Tensor:
    """Our serial model's mean loss on a fixed batch."""
    names = {"num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
             "untie_embeddings_and_output_weights", "layernorm_epsilon"}
    cfg = ModelConfig(**{k: args[k] for k in names}, vocab_size=full[WORD].size(0), seq_length=16,
                      hidden_dropout=0.0, attention_dropout=0.0, attention_backend="unfused")
    model = ModelChunk(build_units(cfg, ParallelState.serial(), seed=0)).eval()
    model.load_state_dict(full, strict=True)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 100, (2, 17), generator=g)
    batch = {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(2, 16)}
    hidden = None
    with torch.no_grad():
        for unit in model.units.values():
            hidden = unit(hidden, batch)
    return hidden


def _convert(tool, *argv):
    assert tool.main(list(argv)) == 0


REIMPORT = {"pp2": ("1", "8"), "tp2pp2v2": ("1", "16")}  # tp and divisible-by giving the trained padded size


def _export_import(root, saves, name: str) -> tuple[str, str]:
    """(HF dir, re-imported checkpoint) of a trained checkpoint, made once."""
    hf_dir, back = str(root / f"{name}_hf"), str(root / f"{name}_back")
    if not os.path.isdir(back):
        tool = _gpt2_tool()
        _convert(tool, "--direction", "megatron-to-hf", "--load", saves[name], "--hf-dir", hf_dir)
        _convert(tool, "--direction", "hf-to-megatron", "--hf-dir", hf_dir, "--save", back,
                 "--tensor-model-parallel-size", REIMPORT[name][0], "--make-vocab-size-divisible-by",
                 REIMPORT[name][1])
    return hf_dir, back


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pp2", "tp2pp2v2"])
def test_export_then_import_is_exact(trained, name, capsys):
    """megatron-to-hf from the trained pp / tp x pp (virtual) checkpoint, then hf-to-megatron at the same padded
    vocabulary size: every tensor back bit for bit, so the loss is the same; without the carried padded rows (the
    export alone) the re-imported model's loss differs."""
    root, saves = trained
    tool = _gpt2_tool()
    full, args = load_full(saves[name])
    assert args["pipeline_model_parallel_size"] == 2 and "units.attn_3.qkv.weight" in full
    assert full[WORD].shape[0] == (104 if name == "pp2" else 112) and args["orig_vocab_size"] == 100
    assert full[WORD][100:].abs().sum() > 0  # the padded rows trained away from their initial values
    capsys.readouterr()
    hf_dir, back = _export_import(root, saves, name)
    assert f"note: restored the padded vocabulary rows from {PADDING_FILE}" in capsys.readouterr().out
    again, _ = load_full(back)
    assert set(again) == set(full)
    for k, v in full.items():
        assert torch.equal(again[k], v), k
    loss = _serial_loss(args, full)
    assert torch.equal(_serial_loss(args, again), loss)
    os.remove(os.path.join(hf_dir, PADDING_FILE))  # the export without the padded rows: they come back as zeros
    _convert(tool, "--direction", "hf-to-megatron", "--hf-dir", hf_dir, "--save", str(root / f"{name}_zeros"),
             "--tensor-model-parallel-size", REIMPORT[name][0], "--make-vocab-size-divisible-by", REIMPORT[name][1])
    zeros, _ = load_full(str(root / f"{name}_zeros"))
    assert abs(_serial_loss(args, zeros).item() - loss.item()) > 1e-4
    print(f"{name}: loss {loss.item():.6f}; re-imported without the padded rows {_serial_loss(args, zeros).item():.6f}")


@pytest.mark.slow
def test_the_tied_copy_is_dropped_and_equal(trained):
    _, saves = trained
    stage1 = torch.load(os.path.join(saves["pp2"], "iter_0000002", "mp_rank_00_001", "model_optim_rng.pt"),
                        weights_only=False)["model"]
    full, _ = load_full(saves["pp2"])
    assert torch.equal(stage1["units.head.output_weight"], full[WORD]) and "units.head.output_weight" not in full


def _finetune(rank, world_size, argv):
    from megatron_bmw.training.loop import build_trainer

    trainer = build_trainer(argv + ["--finetune"])
    trainer.train()
    return trainer.history


@pytest.mark.slow
def test_reimported_checkpoint_trains_like_the_original_layout(trained):
    """The tp 2 x pp 2 (virtual) training checkpoint on 4 ranks and its export re-imported at tp 1 on one rank
    train on alike (same data from iteration 0): the merge put every shard where the serial model wants it."""
    root, saves = trained
    back = _export_import(root, saves, "tp2pp2v2")[1]
    argv = LAYOUTS["tp2pp2v2"][1]
    ref = run_distributed(4, _finetune, argv + ["--load", saves["tp2pp2v2"]])[-1]
    serial = _flags(1, 1, 16, "--untie-embeddings-and-output-weights")  # 112 rows, as at tp 2
    hist = run_distributed(1, _finetune, serial + ["--load", back])[0]
    assert [h[0] for h in hist] == [h[0] for h in ref] == [1, 2]
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(hist, ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5), it
        assert norm == pytest.approx(ref_norm, rel=1e-4), it


def test_save_release_splits_stages_like_the_runtime(tmp_path):
    full = {WORD: torch.randn(16, 8), "units.embedding.position_embeddings": torch.randn(4, 8),
            "units.attn_0.qkv.weight": torch.randn(24, 8), "units.mlp_1.fc2.weight": torch.randn(8, 32),
            "units.head.final_layernorm.weight": torch.randn(8)}
    stages = stage_state_dicts(full, 2, untied=False, pp=2)
    assert set(stages[0]) == {WORD, "units.embedding.position_embeddings", "units.attn_0.qkv.weight"}
    assert torch.equal(stages[1]["units.head.output_weight"], full[WORD])  # the tied copy of the last stage
    args = save_release(str(tmp_path / "c"), full, {"num_layers": 2}, tp=2, pp=2)
    assert args["pipeline_partition"] == [3, 3]
    assert sorted(os.listdir(tmp_path / "c" / "release")) == [f"mp_rank_0{t}_00{r}" for t in (0, 1) for r in (0, 1)]
    again, _ = load_full(str(tmp_path / "c"))
    assert set(again) == set(full) and all(torch.equal(again[k], v) for k, v in full.items())
    with pytest.raises(UsageError, match="already holds a checkpoint"):
        save_release(str(tmp_path / "c"), full, {"num_layers": 2})


def test_unreadable_layouts_are_one_line(tmp_path):
    full = {WORD: torch.randn(16, 8), "units.head.final_layernorm.weight": torch.randn(8)}
    save_release(str(tmp_path / "c"), full, {"num_layers": 2}, tp=2, pp=2)
    os.rename(tmp_path / "c" / "release" / "mp_rank_01_001", tmp_path / "c" / "release" / "gone")
    with pytest.raises(UsageError, match=r"sizes \(2, 2\) but .* holds 3 mp_rank directories \(missing \[\(1, 1\)\]\)"):
        load_full(str(tmp_path / "c"))
    save_release(str(tmp_path / "h"), full, {"num_layers": 2, "unit_strategies": ["tp2", "dp2"]})
    with pytest.raises(UsageError, match="--unit-strategies"):
        load_full(str(tmp_path / "h"))


def test_a_megatron_lm_checkpoint_is_named_as_such(tmp_path):
    """Megatron-LM's args hold megatron.core's ModelType enum (read as an inert stand-in): the HF export says to
    convert it with convert_megatron.py first."""
    import argparse

    from tests.convert.test_megatron import ModelType, megatron_enums

    d = tmp_path / "m" / "iter_0000003" / "mp_rank_00"
    d.mkdir(parents=True)
    with megatron_enums():
        torch.save({"args": argparse.Namespace(num_layers=2, model_type=ModelType.encoder_or_decoder),
                    "model": {"embedding.word_embeddings.weight": torch.zeros(4, 2)}}, d / "model_optim_rng.pt")
    (tmp_path / "m" / "latest_checkpointed_iteration.txt").write_text("3")
    with pytest.raises(UsageError, match="is a Megatron-LM checkpoint; convert it first with "
                                         "tools/checkpoint/convert_megatron.py --direction megatron-to-ours"):
        load_full(str(tmp_path / "m"))
