"""Checkpoints read as data: a poisoned file in either format is refused in one line before anything in it runs."""

import contextlib
import io
import os
import pickle

import pytest
import torch

from megatron_bmw.errors import UsageError
from megatron_bmw.training.loop import build_trainer

BASE = ["--mock-data", "--vocab-size", "128", "--num-layers", "1", "--hidden-size", "32", "--num-attention-heads",
        "4", "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--log-interval", "1", "--eval-iters", "0", "--make-vocab-size-divisible-by", "4",
        "--attention-backend", "unfused"]
GPT = BASE + ["--train-iters", "4"]


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
    ckpt, marker = _saved(tmp_path, fmt), str(tmp_path / "ran")
    path = os.path.join(ckpt, "iter_0000004", rel)
    _poison(path, marker)
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
    message = _refused(ckpt)
    assert message == (f"--load {ckpt}: {path} names the global torch.distributed.checkpoint.metadata."
                       "BytesStorageMetadata, which a torch_dist index never needs; refused (nothing in the file was "
                       "run)")
