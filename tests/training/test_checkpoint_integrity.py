"""Checkpoints read as data, verified per file: a poisoned file in either format is refused in one line before
anything in it runs; a flipped byte in any file a checkpoint wrote is named; --load-fallback loads the previous
iteration and says so."""

import contextlib
import io
import json
import os
import pickle
import shutil

import pytest
import torch

from megatron_bmw.errors import Reported, UsageError
from megatron_bmw.training import checksums
from megatron_bmw.training.loop import build_trainer
from tests.dist_harness import run_distributed
from tests.training.test_pretrain import _cli

BASE = ["--mock-data", "--vocab-size", "128", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
        "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--make-vocab-size-divisible-by", "4",
        "--attention-backend", "unfused"]
GPT = BASE + ["--train-iters", "4"]
FILES = {"torch": ["mp_rank_00/model_optim_rng.pt", "mp_rank_00/distrib_optim.pt"],
         "torch_dist": ["__0_0.distcp", ".metadata", "common.pt"]}
SUMS = {"torch": "mp_rank_00/checksums.json", "torch_dist": "checksums.json"}  # beside the files they cover


class _Poison:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _saved(tmp_path, fmt: str, name: str = "ckpt") -> str:
    """Iterations 2 and 4 of a serial run in `fmt` (ZeRO-1, so the torch format writes distrib_optim.pt too)."""
    ckpt = str(tmp_path / name)
    trainer = build_trainer(GPT + ["--save", ckpt, "--save-interval", "2", "--ckpt-format", fmt,
                                   "--use-distributed-optimizer"])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    return ckpt


def _load(ckpt: str, *extra: str):
    """(trainer, what it printed) of a run resuming from `ckpt`."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        trainer = build_trainer(GPT + ["--load", ckpt, "--use-distributed-optimizer", *extra])
    return trainer, out.getvalue()


def _refused(ckpt: str, *extra: str) -> str:
    with pytest.raises(UsageError) as err:
        _load(ckpt, *extra)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"--load {ckpt}: "), message
    return message


def _flip(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))


def _poison(path: str, marker: str) -> None:
    """Replace a checkpoint file by a pickle that would run `touch marker` when unpickled."""
    if path.endswith(".metadata"):
        with open(path, "wb") as f:
            pickle.dump({"index": _Poison(marker)}, f)
    else:
        torch.save({"args": _Poison(marker), "iteration": 4, "checkpoint_format": "torch_dist"}, path)


@pytest.mark.parametrize("fmt,rel", [("torch", "mp_rank_00/model_optim_rng.pt"), ("torch_dist", "common.pt"),
                                     ("torch_dist", ".metadata")])
def test_a_poisoned_file_is_refused_in_one_line_and_nothing_runs(tmp_path, fmt, rel):
    """An older checkpoint (no checksums.json): the reader refuses the global; with checksums.json the checksum
    names the file first. Either way the pickle never runs."""
    ckpt, marker = _saved(tmp_path, fmt), str(tmp_path / "ran")
    path = os.path.join(ckpt, "iter_0000004", rel)
    _poison(path, marker)
    message = _refused(ckpt)
    assert f"{path} is damaged (" in message, message
    os.remove(os.path.join(ckpt, "iter_0000004", SUMS[fmt]))
    message = _refused(ckpt)
    assert path in message and "global posix.system" in message and "refused" in message, message
    assert not os.path.exists(marker)


def test_a_metadata_naming_a_pickled_object_is_refused(tmp_path):
    """DCP would unpickle an object the index declares as bytes with weights_only=False: the index may not declare
    one (our checkpoints hold tensors only)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    ckpt = _saved(tmp_path, "torch_dist")
    path = os.path.join(ckpt, "iter_0000004", ".metadata")
    with open(path, "rb") as f:
        metadata = pickle.load(f)  # our own, trusted here
    metadata.state_dict_metadata["model.embedding.word_embeddings.weight"] = BytesStorageMetadata()
    with open(path, "wb") as f:
        pickle.dump(metadata, f)
    os.remove(os.path.join(ckpt, "iter_0000004", SUMS["torch_dist"]))
    message = _refused(ckpt)
    assert message == (f"--load {ckpt}: {path} names the global torch.distributed.checkpoint.metadata."
                       "BytesStorageMetadata, which a torch_dist index never needs; refused (nothing in the file was "
                       "run); --load-fallback would load iteration 2 instead")


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_checksums_cover_every_file_and_a_flipped_byte_is_named(tmp_path, fmt):
    ckpt = _saved(tmp_path, fmt)
    it = os.path.join(ckpt, "iter_0000004")
    folder = os.path.join(it, os.path.dirname(SUMS[fmt]))
    recorded = json.load(open(os.path.join(folder, "checksums.json")))["files"]
    assert sorted(recorded) == sorted(os.path.basename(f) for f in FILES[fmt])
    for name, entry in recorded.items():
        assert entry == checksums.digest(os.path.join(folder, name))
    clean = str(tmp_path / "clean")
    shutil.copytree(ckpt, clean)
    for rel in FILES[fmt]:
        shutil.rmtree(ckpt)
        shutil.copytree(clean, ckpt)
        _flip(os.path.join(it, rel))
        message = _refused(ckpt)
        assert message == (f"--load {ckpt}: {os.path.join(it, rel)} is damaged ({checksums.algorithm()} checksum "
                           "differs); --load-fallback would load iteration 2 instead"), message
    with open(os.path.join(it, SUMS[fmt]), "w") as f:
        f.write("{not json")
    assert f"cannot read {os.path.join(it, SUMS[fmt])} (not a checksum file" in _refused(ckpt)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_load_fallback_loads_the_previous_iteration_and_says_so(tmp_path, fmt):
    ckpt = _saved(tmp_path, fmt)
    rel = FILES[fmt][0]
    _flip(os.path.join(ckpt, "iter_0000004", rel))
    trainer, out = _load(ckpt, "--load-fallback")
    assert trainer.iteration == 2 and trainer.consumed_train == 8
    assert (f" > --load-fallback: iter_0000004 is damaged ({rel}: {checksums.algorithm()} checksum differs); "
            "loading iter_0000002") in out.splitlines()
    assert f"  successfully loaded checkpoint from {ckpt} at iteration 2" in out.splitlines()
    _flip(os.path.join(ckpt, "iter_0000002", rel))  # nothing intact is left
    assert _refused(ckpt, "--load-fallback").endswith(f"; --load-fallback found no earlier checkpoint in {ckpt}")
    shutil.rmtree(os.path.join(ckpt, "iter_0000004"))  # the tracker names a folder that is gone
    shutil.rmtree(os.path.join(ckpt, "iter_0000002"))
    shutil.copytree(os.path.join(_saved(tmp_path, fmt, "again"), "iter_0000002"), os.path.join(ckpt, "iter_0000002"))
    trainer, out = _load(ckpt, "--load-fallback")
    assert trainer.iteration == 2 and " > --load-fallback: iter_0000004 is damaged (its folder does not exist); " \
                                      "loading iter_0000002" in out


def test_an_older_checkpoint_without_checksums_loads_and_digests_this_machine_lacks_are_skipped(tmp_path):
    ckpt = _saved(tmp_path, "torch")
    it = os.path.join(ckpt, "iter_0000004")
    sums = json.load(open(os.path.join(it, SUMS["torch"])))
    os.remove(os.path.join(it, SUMS["torch"]))
    assert _load(ckpt)[0].iteration == 4
    entry = sums["files"]["model_optim_rng.pt"]
    assert checksums.differs(os.path.join(it, "mp_rank_00/model_optim_rng.pt"), {"bytes": entry["bytes"],
                                                                                 "blake3": "00"}) is None
    assert checksums.differs(os.path.join(it, "mp_rank_00/model_optim_rng.pt"), {"bytes": 1}) == \
        f"{entry['bytes']} bytes, 1 were saved"


PP2 = [a if a != "1" else "2" for a in BASE] + ["--train-iters", "4", "--pipeline-model-parallel-size", "2"]


def _damaged_stage(rank, world_size, ckpt, fallback):
    """pp2: stage 1's file of iteration 4 is damaged; (exit code or iteration, what this rank printed)."""
    err, out = io.StringIO(), io.StringIO()
    argv = PP2 + ["--load", ckpt] + (["--load-fallback"] if fallback else [])
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            result = build_trainer(argv).iteration
        except Reported as exc:
            result = -exc.exit_code
    return result, err.getvalue(), out.getvalue()


def _save_pp2(rank, world_size, ckpt):
    trainer = build_trainer(PP2 + ["--save", ckpt, "--save-interval", "2"])
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()


@pytest.mark.slow
def test_a_damaged_stage_stops_every_rank_once_or_every_rank_falls_back(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_distributed(2, _save_pp2, ckpt)
    path = os.path.join(ckpt, "iter_0000004", "mp_rank_00_001", "model_optim_rng.pt")
    _flip(path)
    (r0, err0, _), (r1, err1, _) = run_distributed(2, _damaged_stage, ckpt, False)
    assert (r0, r1, err0) == (-2, -2, "")
    assert err1.strip() == (f"error: rank 1: --load {ckpt}: {path} is damaged ({checksums.algorithm()} checksum "
                            "differs); --load-fallback would load iteration 2 instead")
    (r0, err0, out0), (r1, err1, out1) = run_distributed(2, _damaged_stage, ckpt, True)
    assert (r0, r1, err0, err1) == (2, 2, "", "")
    assert " > --load-fallback: iter_0000004 is damaged (mp_rank_00_001/model_optim_rng.pt: " in out0
    assert "--load-fallback" not in out1  # said once


@pytest.mark.slow
def test_the_command_line_exits_2_on_a_damaged_file_and_falls_back_with_the_flag(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    base = BASE + ["--lr-decay-iters", "6"]
    assert _cli(base + ["--train-iters", "4", "--save", ckpt, "--save-interval", "2"]).returncode == 0
    _flip(os.path.join(ckpt, "iter_0000004", "mp_rank_00", "model_optim_rng.pt"))
    out = _cli(base + ["--train-iters", "6", "--load", ckpt])
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "model_optim_rng.pt is damaged" in out.stderr and "--load-fallback would load iteration 2" in out.stderr
    out = _cli(base + ["--train-iters", "6", "--load", ckpt, "--load-fallback"])
    assert out.returncode == 0, out.stderr
    assert "loading iter_0000002" in out.stdout and "at iteration 2" in out.stdout


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_checkpoint_written_before_safe_loading_still_loads(tmp_path, fmt):
    """tests/training/data/written_at_a4b9409: a serial run of this file's model saved at iteration 2 by commit
    a4b9409, which read checkpoints with weights_only=False and wrote no checksums: it loads as data, unverified,
    and training goes on."""
    source = os.path.join(os.path.dirname(__file__), "data", "written_at_a4b9409", fmt)
    ckpt = str(tmp_path / fmt)
    shutil.copytree(source, ckpt)
    trainer, printed = _load(ckpt, "--use-checkpoint-opt_param-scheduler")  # it was saved for 2 iterations, not 4
    assert trainer.iteration == 2 and f"successfully loaded checkpoint from {ckpt} at iteration 2" in printed
    with contextlib.redirect_stdout(io.StringIO()):
        trainer.train()
    assert trainer.iteration == 4
