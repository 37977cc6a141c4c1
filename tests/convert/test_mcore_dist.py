"""Our torch_dist model weights in megatron-core's torch_dist layout (convert/mcore_dist.py).

Always: the layout is megatron-core 0.16.1's (keys and global shapes its GPTModel's sharded_state_dict gives for
the same GPT-2-style and Llama-style models, recorded in data/mcore_0_16_1_{gpt,llama}_layout.json by
mcore_side.py), the mapping round-trips bit for bit, and tools/checkpoint/convert_megatron.py writes and reads it.
With an interpreter that has megatron-core (MCORE_PYTHON, or this one if it has megatron.core, as the "test"
extras install it): megatron-core
loads what we write (and what the tool writes) and gives our logits, and we load what it lays out and give its
logits, for both models."""

import json
import os
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
LLAMA_LAYOUT = json.load(open(os.path.join(HERE, "data", "mcore_0_16_1_llama_layout.json")))
C = LAYOUT["config"]
MODEL = dict(num_layers=C["num_layers"], hidden_size=C["hidden_size"], num_attention_heads=C["num_attention_heads"],
             ffn_hidden_size=C["ffn_hidden_size"], vocab_size=C["vocab"], seq_length=C["seq"], hidden_dropout=0.0,
             attention_dropout=0.0, attention_backend="unfused")
LLAMA = dict(position_embedding_type="rope", swiglu=True, num_query_groups=2, normalization="RMSNorm",
             add_bias_linear=False, untie_embeddings_and_output_weights=True)


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
    # Llama-style: rope (no position table), SwiGLU's fc1 [gate; up] as one key, 2 query groups, RMSNorm, untied
    _, chunk = _ours(**LLAMA)
    flat = ours_to_mcore(_full(chunk), tied=False)
    assert {k: list(t.shape) for k, t in flat.items()} == LLAMA_LAYOUT["keys"]


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
    import importlib.util

    try:  # megatron-core is in the "test" extras; found, not imported here (its import takes seconds)
        found = importlib.util.find_spec("megatron.core") is not None
    except ImportError:
        found = False
    if not found:
        pytest.skip("megatron-core is not importable here (pip install megatron-core==0.16.1, or set MCORE_PYTHON "
                    "to an interpreter that has it)")
    return sys.executable


def _side(*args, llama=False):
    exe = _mcore_python()
    out = subprocess.run([exe, os.path.join(HERE, "mcore_side.py"), *args], capture_output=True, text=True,
                         timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1", MCORE_SIDE_LLAMA=str(int(llama))))
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.slow
def test_megatron_core_loads_ours_and_we_load_its(tmp_path):
    tokens = torch.randint(0, C["vocab"], (2, C["seq"]), generator=torch.Generator().manual_seed(0))
    torch.save(tokens, tmp_path / "tokens.pt")
    cfg, chunk = _ours()
    # ours -> megatron-core: written by write_mcore, and by the tool from our torch_dist checkpoint (its common.pt,
    # args and all, read by megatron-core's loader)
    write_mcore(str(tmp_path / "ours"), ours_to_mcore(_full(chunk), tied=True))
    _save_ours_dist(tmp_path / "ours_dist", cfg, chunk)
    assert _tool().main(["--direction", "ours-to-megatron", "--ckpt-format", "torch_dist", "--load-dir",
                         str(tmp_path / "ours_dist"), "--save-dir", str(tmp_path / "tool")]) == 0
    t = str(tmp_path / "tokens.pt")
    _side("load", str(tmp_path / "ours"), t, str(tmp_path / "theirs.pt"),
          "load", str(tmp_path / "tool" / "iter_0000005"), t, str(tmp_path / "tool.pt"),
          "save", str(tmp_path / "mc"), t, str(tmp_path / "mc.pt"))
    for name in ("theirs.pt", "tool.pt"):
        torch.testing.assert_close(torch.load(tmp_path / name), _logits(cfg, chunk, tokens), rtol=1e-5, atol=1e-5)
    # megatron-core -> ours
    cfg, chunk = _ours(seed=9)
    missing = chunk.load_state_dict(mcore_to_ours(read_mcore(str(tmp_path / "mc")), tied=True), strict=False)
    assert not missing.unexpected_keys and not missing.missing_keys, missing
    torch.testing.assert_close(_logits(cfg, chunk, tokens), torch.load(tmp_path / "mc.pt"), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# tools/checkpoint/convert_megatron.py with torch_dist on either side

TOOL = os.path.join(os.path.dirname(os.path.dirname(HERE)), "tools", "checkpoint", "convert_megatron.py")


def _tool():
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_megatron_tool_dist", TOOL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _save_ours_dist(path, cfg, chunk, iteration=5):
    """One of our torch_dist checkpoints, as a serial training run saves it."""
    from megatron_bmw.training import dist_checkpoint

    args = {k: v for k, v in cfg.to_json().items() if k != "params_dtype"}
    args.update(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, padded_vocab_size=cfg.vocab_size,
                orig_vocab_size=cfg.vocab_size, params_dtype="torch.float32")
    dist_checkpoint.save(str(path), iteration, ParallelState.serial(),
                         {"iteration": iteration, "args": args, "consumed_train_samples": 40}, [chunk])


def test_tool_writes_megatron_cores_torch_dist_and_reads_it_back(tmp_path, capsys):
    tool = _tool()
    cfg, chunk = _ours()
    _save_ours_dist(tmp_path / "ours", cfg, chunk)
    assert tool.main(["--direction", "ours-to-megatron", "--ckpt-format", "torch_dist", "--load-dir",
                      str(tmp_path / "ours"), "--save-dir", str(tmp_path / "mc")]) == 0
    assert "--ckpt-format torch_dist --no-load-optim --no-load-rng" in capsys.readouterr().out
    it_dir = tmp_path / "mc" / "iter_0000005"
    assert (tmp_path / "mc" / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
    assert json.load(open(it_dir / "metadata.json"))["sharded_backend"] == "torch_dist"
    common = torch.load(it_dir / "common.pt", weights_only=False)
    assert common["iteration"] == 5 and common["args"].ckpt_format == "torch_dist"
    assert common["args"].num_layers == C["num_layers"] and common["args"].consumed_train_samples == 40
    assert {k: list(t.shape) for k, t in read_mcore(str(it_dir)).items()} == LAYOUT["keys"]
    # and back: megatron-core's torch_dist -> ours (torch format), bit for bit
    assert tool.main(["--direction", "megatron-to-ours", "--load-dir", str(tmp_path / "mc"), "--save-dir",
                      str(tmp_path / "back")]) == 0
    back = torch.load(tmp_path / "back" / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    full = _full(chunk)
    assert set(back["model"]) == set(full) and all(torch.equal(back["model"][k], full[k]) for k in full)
    assert back["iteration"] == 5 and back["consumed_train_samples"] == 40


def test_tool_refuses_layouts_for_torch_dist(tmp_path, capsys):
    tool = _tool()
    cfg, chunk = _ours()
    _save_ours_dist(tmp_path / "ours", cfg, chunk)
    for extra, said in ((["--direction", "ours-to-megatron", "--target-tensor-parallel-size", "2"],
                         "--target-tensor-parallel-size: a torch_dist checkpoint has no parallel layout"),
                        (["--direction", "megatron-to-ours"], "--ckpt-format torch_dist names the Megatron-LM")):
        with pytest.raises(SystemExit) as exc:
            tool.main([*extra, "--ckpt-format", "torch_dist", "--load-dir", str(tmp_path / "ours"), "--save-dir",
                       str(tmp_path / "out")])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err



@pytest.mark.slow
def test_megatron_core_llama_both_ways(tmp_path):
    tokens = torch.randint(0, C["vocab"], (2, C["seq"]), generator=torch.Generator().manual_seed(1))
    torch.save(tokens, tmp_path / "tokens.pt")
    cfg, chunk = _ours(**LLAMA)
    _save_ours_dist(tmp_path / "ours", cfg, chunk)
    assert _tool().main(["--direction", "ours-to-megatron", "--ckpt-format", "torch_dist", "--load-dir",
                         str(tmp_path / "ours"), "--save-dir", str(tmp_path / "tool")]) == 0
    t = str(tmp_path / "tokens.pt")
    _side("load", str(tmp_path / "tool" / "iter_0000005"), t, str(tmp_path / "t.pt"),
          "save", str(tmp_path / "mc"), t, str(tmp_path / "mc.pt"), llama=True)
    torch.testing.assert_close(torch.load(tmp_path / "t.pt"), _logits(cfg, chunk, tokens), rtol=1e-5, atol=1e-5)
    cfg, chunk = _ours(seed=9, **LLAMA)
    missing = chunk.load_state_dict(mcore_to_ours(read_mcore(str(tmp_path / "mc")), tied=False), strict=False)
    assert not missing.unexpected_keys and not missing.missing_keys, missing
    torch.testing.assert_close(_logits(cfg, chunk, tokens), torch.load(tmp_path / "mc.pt"), rtol=1e-5, atol=1e-5)
