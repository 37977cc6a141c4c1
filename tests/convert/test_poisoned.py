"""Every converter reads checkpoint files as data: a checkpoint whose pickle would run a command (a __reduce__ that
touches a marker file) is refused by each entry point, in each input format, in one line with exit code 2, and the
marker never appears. Each tool runs as a subprocess, as a user runs it (slow tier), and in this process through its
main (fast tier: a process may not start there)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from megatron_bmw.config import ModelConfig
from megatron_bmw.convert.checkpoint_files import save_release
from megatron_bmw.convert.mcore_dist import ours_to_mcore, write_mcore
from megatron_bmw.convert.megatron_names import ours_chunk_to_megatron
from megatron_bmw.models.chunk import ModelChunk, build_units
from megatron_bmw.parallel.state import ParallelState

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MEGATRON_TOOL = os.path.join(ROOT, "tools", "checkpoint", "convert_megatron.py")
HF_TOOLS = {name: os.path.join(ROOT, "tools", "checkpoint", f"convert_hf_{name}.py")
            for name in ("gpt2", "llama", "bert")}
HF_CONFIGS = {"gpt2": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": 64,
                       "n_positions": 16},
              "llama": {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                        "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 16},
              "bert": {"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 4,
                       "intermediate_size": 64, "vocab_size": 64, "max_position_embeddings": 16}}
MODEL = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, hidden_dropout=0.0,
             attention_dropout=0.0)


class Poison:
    """Unpickled by a reader that resolves any global, it runs `touch <marker>` (os.system)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


MODES = ["main", pytest.param("process", marks=pytest.mark.slow)]
_TOOLS: dict[str, object] = {}


def _run(mode: str, capsys, tool: str, *argv: str) -> tuple[int, str]:
    """(exit code, stderr) of `tool argv`: a subprocess, or the tool's main in this process."""
    if mode == "process":
        env = dict(os.environ, OMP_NUM_THREADS="1")
        env.pop("RANK", None)
        proc = subprocess.run([sys.executable, tool, *argv], capture_output=True, text=True, timeout=180, env=env,
                              cwd=ROOT)
        return proc.returncode, proc.stderr
    if tool not in _TOOLS:
        spec = importlib.util.spec_from_file_location(f"poisoned_{os.path.basename(tool)[:-3]}", tool)
        _TOOLS[tool] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_TOOLS[tool])
    capsys.readouterr()
    try:
        code = _TOOLS[tool].main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def _assert_refused(result: tuple[int, str], marker, poisoned: str, *not_written) -> None:
    code, stderr = result
    lines = stderr.strip().splitlines()
    assert code == 2 and len(lines) == 1, stderr
    assert lines[0].startswith("error: ") and "posix.system" in lines[0] and poisoned in lines[0], lines[0]
    assert "nothing in" in lines[0] and "was run" in lines[0]
    assert not marker.exists(), "the poisoned pickle ran"
    for path in not_written:
        assert not os.path.exists(path), path


def _poison_torch_file(path: str, marker, zipped: bool = True) -> None:
    """Add a poisoned entry to a checkpoint file (where a payload holds its RNG state), rewritten in place."""
    payload = torch.load(path, map_location="cpu", weights_only=False)
    payload["rng_state"] = [{"random_rng_state": Poison(str(marker))}]
    torch.save(payload, path, _use_new_zipfile_serialization=zipped)


def _full() -> dict[str, torch.Tensor]:
    chunk = ModelChunk(build_units(ModelConfig(**MODEL), ParallelState.serial(), seed=0))
    return {n: p.detach().clone() for n, p in chunk.named_parameters()}


def _our_args() -> dict:
    args = {k: v for k, v in ModelConfig(**MODEL).to_json().items() if k != "params_dtype"}
    return dict(args, padded_vocab_size=64, orig_vocab_size=64, params_dtype="torch.float32")


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Unpoisoned checkpoints of each input format, copied and poisoned by each test."""
    root = tmp_path_factory.mktemp("clean")
    full = _full()
    save_release(str(root / "ours_torch"), full, _our_args())
    # Megatron-LM's --ckpt-format torch: megatron-core names, its args a Namespace
    it_dir = root / "megatron_torch" / "iter_0000007" / "mp_rank_00"
    it_dir.mkdir(parents=True)
    megatron_args = argparse.Namespace(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16,
                                       max_position_embeddings=16, tensor_model_parallel_size=1,
                                       pipeline_model_parallel_size=1, params_dtype=torch.float32)
    torch.save({"args": megatron_args, "checkpoint_version": 3.0, "iteration": 7,
                "model": ours_chunk_to_megatron(full, 0, "transformer_engine")}, it_dir / "model_optim_rng.pt")
    (root / "megatron_torch" / "latest_checkpointed_iteration.txt").write_text("7")
    # megatron-core's torch_dist
    write_mcore(str(root / "megatron_dist" / "iter_0000005"), ours_to_mcore(full, tied=True),
                {"args": megatron_args, "iteration": 5, "checkpoint_version": 3.0})
    (root / "megatron_dist" / "latest_checkpointed_iteration.txt").write_text("5")
    # ours, torch_dist
    from megatron_bmw.training import dist_checkpoint

    chunk = ModelChunk(build_units(ModelConfig(**MODEL), ParallelState.serial(), seed=0))
    dist_checkpoint.save(str(root / "ours_dist"), 5, ParallelState.serial(),
                         {"iteration": 5, "args": dict(_our_args(), tensor_model_parallel_size=1,
                                                       pipeline_model_parallel_size=1)}, [chunk])
    return root


def _copy(clean, name: str, tmp_path) -> str:
    return str(shutil.copytree(clean / name, tmp_path / name))


def _rank_file(ckpt: str) -> str:
    tag = open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip()
    it_dir = os.path.join(ckpt, tag if tag == "release" else f"iter_{int(tag):07d}")
    return os.path.join(it_dir, "mp_rank_00", "model_optim_rng.pt")


def _dist_file(ckpt: str, name: str) -> str:
    tag = open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip()
    return os.path.join(ckpt, f"iter_{int(tag):07d}", name)


def _poison_dist(ckpt: str, which: str, marker) -> str:
    """Poison a torch_dist checkpoint's common.pt (torch.save'd) or its .metadata (a plain pickle)."""
    path = _dist_file(ckpt, which)
    if which == "common.pt":
        common = torch.load(path, map_location="cpu", weights_only=False)
        common["rng_state"] = [Poison(str(marker))]
        torch.save(common, path)
    else:
        with open(path, "wb") as f:
            pickle.dump(Poison(str(marker)), f)
    return path


# ----------------------------------------------------------------------------------------------------------------
# tools/checkpoint/convert_megatron.py


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("zipped", [True, False])
def test_megatron_to_ours_refuses_a_poisoned_megatron_checkpoint(clean, tmp_path, capsys, mode, zipped):
    ckpt = _copy(clean, "megatron_torch", tmp_path)
    marker, path = tmp_path / "ran", _rank_file(ckpt)
    _poison_torch_file(path, marker, zipped)
    result = _run(mode, capsys, MEGATRON_TOOL, "--direction", "megatron-to-ours", "--load-dir", ckpt, "--save-dir",
                  str(tmp_path / "out"))
    _assert_refused(result, marker, path, tmp_path / "out")


@pytest.mark.parametrize("mode", MODES)
def test_ours_to_megatron_refuses_a_poisoned_checkpoint_of_ours(clean, tmp_path, capsys, mode):
    ckpt = _copy(clean, "ours_torch", tmp_path)
    marker, path = tmp_path / "ran", _rank_file(ckpt)
    _poison_torch_file(path, marker)
    result = _run(mode, capsys, MEGATRON_TOOL, "--direction", "ours-to-megatron", "--load-dir", ckpt, "--save-dir",
                  str(tmp_path / "out"))
    _assert_refused(result, marker, path, tmp_path / "out")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("source,direction", [("megatron_dist", "megatron-to-ours"),
                                              ("ours_dist", "ours-to-megatron")])
@pytest.mark.parametrize("which", ["common.pt", ".metadata"])
def test_torch_dist_sources_are_refused_poisoned(clean, tmp_path, capsys, mode, source, direction, which):
    """megatron-core's torch_dist (-> ours) and ours (-> Megatron-LM): a poisoned common.pt, or a poisoned .metadata
    (which torch.distributed.checkpoint itself reads with pickle.load)."""
    ckpt = _copy(clean, source, tmp_path)
    marker = tmp_path / "ran"
    path = _poison_dist(ckpt, which, marker)
    result = _run(mode, capsys, MEGATRON_TOOL, "--direction", direction, "--load-dir", ckpt, "--save-dir",
                  str(tmp_path / "out"))
    _assert_refused(result, marker, path, tmp_path / "out")


@pytest.mark.parametrize("source,direction", [("megatron_torch", "megatron-to-ours"),
                                              ("megatron_dist", "megatron-to-ours"),
                                              ("ours_torch", "ours-to-megatron"), ("ours_dist", "ours-to-megatron")])
def test_the_clean_sources_convert(clean, tmp_path, capsys, source, direction):
    """The same checkpoints unpoisoned convert (what the tests above refuse is the poison alone)."""
    code, stderr = _run("main", capsys, MEGATRON_TOOL, "--direction", direction, "--load-dir", str(clean / source),
                        "--save-dir", str(tmp_path / "out"))
    assert code == 0, stderr
    assert os.path.isfile(tmp_path / "out" / "latest_checkpointed_iteration.txt")


# ----------------------------------------------------------------------------------------------------------------
# tools/checkpoint/convert_hf_*.py


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_export_refuses_a_poisoned_checkpoint_of_ours(clean, tmp_path, capsys, mode, name):
    ckpt = _copy(clean, "ours_torch", tmp_path)
    marker, path = tmp_path / "ran", _rank_file(ckpt)
    _poison_torch_file(path, marker)
    result = _run(mode, capsys, HF_TOOLS[name], "--direction", "megatron-to-hf", "--load", ckpt, "--hf-dir",
                  str(tmp_path / "hf"))
    _assert_refused(result, marker, path, tmp_path / "hf")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_hf_import_refuses_a_poisoned_pytorch_model_bin(tmp_path, capsys, mode, name):
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text(json.dumps(HF_CONFIGS[name]))
    marker = tmp_path / "ran"
    torch.save({"wte.weight": torch.zeros(2, 2), "extra": Poison(str(marker))}, hf_dir / "pytorch_model.bin")
    result = _run(mode, capsys, HF_TOOLS[name], "--direction", "hf-to-megatron", "--hf-dir", str(hf_dir), "--save",
                  str(tmp_path / "out"))
    _assert_refused(result, marker, str(hf_dir / "pytorch_model.bin"), tmp_path / "out")


def test_safetensors_are_read_where_present(tmp_path, capsys):
    """A Hugging Face folder with model.safetensors converts from it: a (poisoned) pytorch_model.bin beside it is
    never opened."""
    transformers = pytest.importorskip("transformers")
    hf_dir = tmp_path / "hf"
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**{k: v for k, v in HF_CONFIGS["gpt2"].items()
                                                            if k != "model_type"})).save_pretrained(hf_dir)
    marker = tmp_path / "ran"
    torch.save({"extra": Poison(str(marker))}, hf_dir / "pytorch_model.bin")
    code, stderr = _run("main", capsys, HF_TOOLS["gpt2"], "--direction", "hf-to-megatron", "--hf-dir", str(hf_dir),
                        "--save", str(tmp_path / "out"), "--make-vocab-size-divisible-by", "8")
    assert code == 0, stderr
    assert not marker.exists() and os.path.isfile(tmp_path / "out" / "latest_checkpointed_iteration.txt")
