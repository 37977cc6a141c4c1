"""safe_load reads checkpoint files as data: what ours and Megatron-LM's hold loads; a global outside the
allow-list is refused in one line before anything in the file runs."""

from __future__ import annotations

import argparse
import collections
import enum
import io
import os
import pickle
import random
import sys
import types

import numpy as np
import pytest
import torch

from megatron_bmw.errors import UsageError
from megatron_bmw.safe_load import Foreign, dcp_reader, load_file, load_pickle, unpickle


class _Poison:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _megatron_enum(monkeypatch):
    """An enum pickled under Megatron's module name, then the module removed (Megatron is not installed)."""
    ModelType = enum.Enum("ModelType", {"encoder_or_decoder": 1}, module="megatron.core.enums",
                          qualname="ModelType")
    for name in ("megatron", "megatron.core", "megatron.core.enums"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["megatron.core.enums"].ModelType = ModelType
    return ModelType.encoder_or_decoder


@pytest.mark.parametrize("zipped", [True, False])
def test_a_poisoned_file_is_refused_and_nothing_runs(tmp_path, zipped):
    marker = tmp_path / "ran"
    path = tmp_path / "model_optim_rng.pt"
    torch.save({"args": _Poison(str(marker)), "model": {}}, path, _use_new_zipfile_serialization=zipped)
    with pytest.raises(UsageError) as err:
        load_file(str(path), "--load")
    assert "posix.system" in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)
    assert not marker.exists()


def test_a_checkpoint_with_megatron_args_and_rng_state_loads(tmp_path, monkeypatch):
    value = _megatron_enum(monkeypatch)
    args = argparse.Namespace(num_layers=2, model_type=value, params_dtype=torch.bfloat16)
    rng = {"random": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    path = tmp_path / "ckpt.pt"
    torch.save({"args": args, "rng_state": [rng], "model": {"w": torch.arange(3.0)}}, path)
    for name in ("megatron.core.enums", "megatron.core", "megatron"):
        monkeypatch.delitem(sys.modules, name)
    data = load_file(str(path), "--load")
    assert data["args"].num_layers == 2 and data["args"].params_dtype == torch.bfloat16
    assert isinstance(data["args"].model_type, Foreign) and data["args"].model_type.value == 1
    np.random.set_state(data["rng_state"][0]["numpy"])  # NumPy's state round-trips
    random.setstate(data["rng_state"][0]["random"])
    assert torch.equal(data["model"]["w"], torch.arange(3.0))


def test_a_truncated_or_missing_file_is_one_line(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"w": torch.ones(4)}, path)
    path.write_bytes(path.read_bytes()[:64])
    for target in (path, tmp_path / "absent.pt"):
        with pytest.raises(UsageError) as err:
            load_file(str(target), "--load")
        assert str(target) in str(err.value) and str(err.value).startswith("--load: ")


def test_transformer_engines_extra_state_and_a_legacy_file_under_mmap(tmp_path):
    """Megatron-LM's model state holds Transformer Engine's `_extra_state` as a serialized buffer (io.BytesIO);
    mmap maps zip-format files and reads a file of torch's legacy format."""
    buf = io.BytesIO()
    torch.save(None, buf)
    model = {"decoder.layers.0.self_attention.linear_qkv._extra_state": buf, "w": torch.arange(4.0)}
    for zipped in (True, False):
        path = tmp_path / f"m{zipped}.pt"
        torch.save({"model": model}, path, _use_new_zipfile_serialization=zipped)
        data = load_file(str(path), "--load", mmap=True)["model"]
        assert torch.equal(data["w"], torch.arange(4.0))
        assert data["decoder.layers.0.self_attention.linear_qkv._extra_state"].getvalue() == buf.getvalue()


def test_a_plain_pickle_is_read_as_data(tmp_path):
    marker = tmp_path / "ran"
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps({"segments": [{"size": 4, "blocks": []}], "device_traces": [[]]}))
    assert load_pickle(str(path), "snapshot")["segments"][0]["size"] == 4
    path.write_bytes(pickle.dumps({"segments": [_Poison(str(marker))]}))
    with pytest.raises(UsageError) as err:
        load_pickle(str(path), "snapshot")
    assert "posix.system" in str(err.value) and str(path) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UsageError, match="names the global collections.OrderedDict"):  # only what the caller allows
        path.write_bytes(pickle.dumps(collections.OrderedDict(a=1)))
        load_pickle(str(path), "snapshot")
    with open(path, "rb") as f:
        assert unpickle(f, {"collections.OrderedDict": collections.OrderedDict}) == {"a": 1}
    assert not marker.exists()


def test_torch_distributed_checkpoint_metadata_is_read_as_data(tmp_path):
    """torch.distributed.checkpoint reads `.metadata` with pickle.load; dcp_reader reads it under an allow-list."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path / "dcp"
    dcp.save({"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.bfloat16), "n": 3},
             checkpoint_id=str(ckpt), no_dist=True)
    state = {"a": torch.empty(2, 3), "b": torch.empty(2, dtype=torch.bfloat16)}
    dcp.load(state, storage_reader=dcp_reader(str(ckpt), "--load"), no_dist=True)
    assert torch.equal(state["a"], torch.arange(6.0).view(2, 3)) and torch.equal(state["b"], torch.ones(2))
    marker = tmp_path / "ran"
    (ckpt / ".metadata").write_bytes(pickle.dumps(_Poison(str(marker))))
    with pytest.raises(UsageError) as err:
        dcp_reader(str(ckpt), "--load")
    assert "posix.system" in str(err.value) and "\n" not in str(err.value) and str(err.value).startswith("--load: ")
    assert not marker.exists()
