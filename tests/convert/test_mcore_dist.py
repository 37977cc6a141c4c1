"""Our torch_dist model weights in megatron-core's torch_dist layout (convert/mcore_dist.py).

Always: the layout is megatron-core 0.16.1's (keys and global shapes its GPTModel's sharded_state_dict gives for
the same model, recorded in data/mcore_0_16_1_gpt_layout.json by mcore_side.py), and the mapping round-trips bit for
bit. With an interpreter that has megatron-core (MCORE_PYTHON, or this one if it imports megatron.core):
megatron-core loads what we write and gives our logits, and we load what it lays out and give its logits."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_bmw.config import ModelConfig
from megatron_bmw.convert.mcore_dist import mcore_to_ours, ours_to_mcore, read_mcore, write_mcore
from megatron_bmw.errors import UsageError
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel.state import ParallelState

HERE = os.path.dirname(os.path.abspath(__file__))
LAYOUT = json.load(open(os.path.join(HERE, "data", "mcore_0_16_1_gpt_layout.json")))
C = LAYOUT["config"]
MODEL = dict(num_layers=C["num_layers"], hidden_size=C["hidden_size"], num_attention_heads=C["num_attention_heads"],
             ffn_hidden_size=C["ffn_hidden_size"], vocab_size=C["vocab"], seq_length=C["seq"], hidden_dropout=0.0,
             attention_dropout=0.0, attention_backend="unfused")


def _ours(seed=3, **kw):
    cfg = ModelConfig(**{**MODEL, **kw})
    chunk = ModelChunk(build_units(cfg, ParallelState.serial(), seed)).eval()
    return cfg, chunk


def _full(chunk):
    return {n: p.detach().clone() for n, p in chunk.named_parameters()}


def _logits(cfg, chunk, tokens):
    with torch.no_grad():
        hidden = None
        for name, unit in chunk.units.items():
            if name == "head":
                return unit.logits(hidden).transpose(0, 1).float()  # [b, s, v]
            hidden = unit(hidden, {"tokens": tokens})


def test_the_layout_is_megatron_cores():
    _, chunk = _ours()
    flat = ours_to_mcore(_full(chunk), tied=True)
    assert {k: list(t.shape) for k, t in flat.items()} == LAYOUT["keys"]


@pytest.mark.parametrize("untied", [False, True])
def test_round_trip_is_bit_exact(tmp_path, untied):
    _, chunk = _ours(untie_embeddings_and_output_weights=untied)
    full = _full(chunk)
    write_mcore(str(tmp_path / "m"), ours_to_mcore(full, tied=not untied))
    back = mcore_to_ours(read_mcore(str(tmp_path / "m")), tied=not untied)
    assert set(back) == set(full) and all(torch.equal(back[k], full[k]) for k in full)
    with pytest.raises(UsageError, match="exists and is not empty"):
        write_mcore(str(tmp_path / "m"), {})
    with pytest.raises(UsageError, match="no metadata.json"):
        read_mcore(str(tmp_path))


def _mcore_python():
    exe = os.environ.get("MCORE_PYTHON")
    if exe:
        return exe
    try:
        import megatron.core  # noqa: F401
    except ImportError:
        pytest.skip("megatron-core is not importable here (set MCORE_PYTHON to an interpreter that has it)")
    return sys.executable


def _side(*args):
    exe = _mcore_python()
    out = subprocess.run([exe, os.path.join(HERE, "mcore_side.py"), *args], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.slow
def test_megatron_core_loads_ours_and_we_load_its(tmp_path):
    tokens = torch.randint(0, C["vocab"], (2, C["seq"]), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    # ours -> megatron-core
    cfg, chunk = _ours()
    write_mcore(str(tmp_path / "ours"), ours_to_mcore(_full(chunk), tied=True))
    _side("load", str(tmp_path / "ours"), str(tmp_path / "tokens.pt"), str(tmp_path / "theirs_logits.pt"))
    torch.testing.assert_close(torch.load(tmp_path / "theirs_logits.pt"), _logits(cfg, chunk, tokens),
                               rtol=1e-5, atol=1e-5)
    # megatron-core -> ours
    _side("save", str(tmp_path / "mc"), str(tmp_path / "tokens.pt"), str(tmp_path / "mc_logits.pt"))
    cfg, chunk = _ours(seed=9)
    missing = chunk.load_state_dict(mcore_to_ours(read_mcore(str(tmp_path / "mc")), tied=True), strict=False)
    assert not missing.unexpected_keys and not missing.missing_keys, missing
    torch.testing.assert_close(_logits(cfg, chunk, tokens), torch.load(tmp_path / "mc_logits.pt"),
                               rtol=1e-5, atol=1e-5)
    shutil.rmtree(tmp_path / "mc")
