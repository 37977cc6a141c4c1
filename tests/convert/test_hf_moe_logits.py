"""Our MoE forward (models/moe.py) on a converted Mixtral / Qwen2-MoE gives the Hugging Face logits: serially (tp 1,
ep 1, as --check-logits runs it) and from the converter's rank files at tp 1 x ep 2 (2 gloo ranks) and tp 2 x ep 2
(4 gloo ranks, etp 2); pretrain_gpt.py continues training from an imported checkpoint with the loss of a run
that starts from the same weights. Tiny random models built here; nothing is downloaded."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from megatron_bmw.config import ModelConfig, ParallelConfig
from megatron_bmw.convert.logit_check import max_logit_difference, our_logits, our_model
from megatron_bmw.convert.checkpoint_files import load_full
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel.state import ParallelState
from megatron_bmw.safe_load import load_file
from tests.convert.test_hf_moe import _tool, hf_model, saved
from tests.dist_harness import run_distributed
from tests.reference import head_logits

transformers = pytest.importorskip("transformers")
TOL = 1e-4
KINDS = ["mixtral", "qwen2_moe"]


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(3))


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(_tokens()).logits.transpose(0, 1).contiguous()  # [s, b, v]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """For each kind: the HF folder, its logits, and the tool's checkpoints at (tp, ep) (1, 1), (1, 2), (2, 2)."""
    out = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp(kind)
        model = hf_model(kind)
        saved(model, root / "hf")
        saves = {}
        for tp, ep in ((1, 1), (1, 2), (2, 2)):
            saves[tp, ep] = str(root / f"tp{tp}ep{ep}")
            assert _tool().main(["--direction", "hf-to-megatron", "--hf-dir", str(root / "hf"), "--save",
                                 saves[tp, ep], "--tensor-model-parallel-size", str(tp),
                                 "--expert-model-parallel-size", str(ep), "--make-vocab-size-divisible-by", "16"]) == 0
        out[kind] = dict(hf=str(root / "hf"), ref=_hf_logits(model), saves=saves)
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_serial_logits_match_hf(kind, converted):
    c = converted[kind]
    full, args = load_full(c["saves"][1, 1])
    model, cfg = our_model(full, args)
    logits = our_logits(model, cfg, _tokens())[..., :100].transpose(0, 1)
    assert (logits - c["ref"]).abs().max().item() <= TOL
    diff, _ = max_logit_difference(full, args, c["hf"])  # --check-logits' own comparison
    assert diff <= TOL


def _config(args: dict) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)} - {"params_dtype"}
    return ModelConfig(**{**{k: v for k, v in args.items() if k in names}, "attention_backend": "unfused"})


def _rank_logits(rank, world_size, save, tp, ep):
    import torch.distributed as dist

    st = ParallelState.build(ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep))
    name = f"mp_rank_{st.tp_rank:02d}" + (f"_{st.ep_rank:03d}" if ep > 1 else "")
    ckpt = load_file(os.path.join(save, "release", name, "model_optim_rng.pt"), "test")
    model = ModelChunk(build_units(_config(ckpt["args"]), st, seed=0))
    model.load_state_dict(ckpt["model"], strict=True)
    local = head_logits(model, _tokens())
    if tp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(tp)]
    dist.all_gather(parts, local.contiguous(), group=st.tp_group)
    return torch.cat(parts, dim=-1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp, ep, world", [(1, 2, 2), (2, 2, 4)])
def test_tp_ep_logits_match_hf(kind, tp, ep, world, converted):
    c = converted[kind]
    for logits in run_distributed(world, _rank_logits, c["saves"][tp, ep], tp, ep):
        assert (logits[..., :100] - c["ref"]).abs().max().item() <= TOL


# ----------------------------------------------------------------------------------------------------------------
# Training continues from an import


def _run_flags(kind: str, save: str) -> list[str]:
    """pretrain_gpt.py's flags for the converted model, as the tool prints them (layout flags included)."""
    from megatron_bmw.convert.hf_files import layout_flags

    args = load_file(os.path.join(save, "release", "mp_rank_00", "model_optim_rng.pt"), "test")["args"]
    text = _tool().run_flags(args) + " " + layout_flags(args)
    return [a.strip("'") for a in text.split()] + [
        "--mock-data", "--vocab-size", "100", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size",
        "4", "--lr", "1e-3", "--log-interval", "1", "--eval-iters", "0", "--attention-backend", "unfused"]


def _train(rank, world_size, argv):
    from megatron_bmw.training.loop import build_trainer

    trainer = build_trainer(argv)
    if trainer.run.train.ckpt_convert_format is not None:
        trainer.convert_checkpoint()
        return None
    trainer.train()
    return trainer.history


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_training_continues_from_an_import_at_ep1_and_ep2(kind, converted, tmp_path):
    """pretrain_gpt.py's trainer, with the flags the tool prints, loads the ep 1 import and trains on (finite losses);
    the same weights turned into torch_dist (Megatron's --ckpt-convert-format, which our runs load at any expert
    layout) train on 2 gloo ranks at ep 2 (dp 2) with the same losses and grad norms; that run's torch_dist
    checkpoint converts to Megatron-LM's (ep 2 files), back to ours and on to Hugging Face with our trained model's
    logits."""
    save = converted[kind]["saves"][1, 1]
    flags = _run_flags(kind, save)
    ref = run_distributed(1, _train, flags + ["--train-iters", "3", "--load", save, "--finetune"])[0]
    assert [h[0] for h in ref] == [1, 2, 3] and all(torch.isfinite(torch.tensor(h[1])) for h in ref)
    dist_dir = str(tmp_path / "converted")
    run_distributed(1, _train, flags + ["--load", save, "--ckpt-convert-format", "torch_dist", "--ckpt-convert-save",
                                        dist_dir, "--train-iters", "3"])
    ep2 = [a if a != "1" or flags[i - 1] != "--expert-model-parallel-size" else "2" for i, a in enumerate(flags)]
    trained = str(tmp_path / "trained")
    runs = run_distributed(2, _train, ep2 + ["--train-iters", "3", "--load", os.path.join(dist_dir, "torch_dist"),
                                             "--finetune", "--save", trained, "--ckpt-format", "torch_dist"])
    for (it, loss, norm), (_, ref_loss, ref_norm) in zip(runs[-1], ref):
        assert loss == pytest.approx(ref_loss, rel=1e-5), it
        assert norm == pytest.approx(ref_norm, rel=1e-4), it
    # the ep 2 run's torch_dist checkpoint -> Megatron-LM's files at ep 2 -> ours at ep 1 -> Hugging Face
    from tests.convert.test_megatron_moe import _tool as _megatron_tool

    megatron = _megatron_tool()
    assert megatron.main(["--direction", "ours-to-megatron", "--load-dir", trained, "--save-dir",
                          str(tmp_path / "megatron"), "--target-expert-model-parallel-size", "2"]) == 0
    assert megatron.main(["--direction", "megatron-to-ours", "--load-dir", str(tmp_path / "megatron"),
                          "--save-dir", str(tmp_path / "torch"), "--target-expert-model-parallel-size", "1"]) == 0
    assert _tool().main(["--direction", "megatron-to-hf", "--load", str(tmp_path / "torch"), "--hf-dir",
                         str(tmp_path / "hf_trained")]) == 0
    full, args = load_full(str(tmp_path / "torch"))
    assert max_logit_difference(full, args, str(tmp_path / "hf_trained"))[0] <= TOL
    model, cfg = our_model(full, args)
    moved = our_logits(model, cfg, _tokens())[..., :100].transpose(0, 1)
    assert (moved - converted[kind]["ref"]).abs().max().item() > 1e-3  # it trained
