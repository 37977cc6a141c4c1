"""Model weights between our `torch_dist` checkpoints and megatron-core's `torch_dist` key layout.

megatron-core (checked against 0.16.1) saves a GPTModel's `sharded_state_dict()` through
torch.distributed.checkpoint: one key per parameter of all layers, `decoder.layers.<module>.<tensor>`, with the
layer as a leading axis of the global tensor ([num_layers, ...]; layer i at offset i), under the Transformer
Engine names (`self_attention.linear_qkv.layer_norm_weight` for the input norm, also with the local layer spec),
the embedding, final norm and (untied) `output_layer.weight` as they are, beside a
`metadata.json` naming the backends and a `common.pt`. Our torch_dist keys are `model.<unit>.<tensor>`. The
per-layer names are convert/megatron.py's; this module only stacks and unstacks layers and reads and writes
the directories. `_extra_state` entries (None without FP8) are not written; megatron-core loads without them when
they are left out of the state dict it asks for.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

import torch

from ..errors import UsageError
from .megatron import EXTRA_STATE, megatron_chunk_to_ours, ours_chunk_to_megatron

METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
OURS_PREFIX = "model."  # training/dist_checkpoint.py's model keys
_STACKED = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def ours_to_mcore(full: Mapping[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Our full state dict (`units.<unit>.<tensor>`) -> megatron-core's torch_dist tensors."""
    per_layer: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in ours_chunk_to_megatron(full, 0, "transformer_engine").items():
        if name.endswith(EXTRA_STATE):
            continue
        m = _STACKED.fullmatch(name)
        if m:
            per_layer.setdefault(f"decoder.layers.{m.group(2)}", {})[int(m.group(1))] = t
        else:
            out[name] = t
    for key, layers in per_layer.items():
        if sorted(layers) != list(range(len(layers))):
            raise UsageError(f"checkpoint: {key} misses layers (has {sorted(layers)})")
        out[key] = torch.stack([layers[i] for i in range(len(layers))])
    if tied:  # megatron-core's tied output layer is the word embedding: no key of its own
        out.pop("output_layer.weight", None)
    return out


def mcore_to_ours(flat: Mapping[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """megatron-core's torch_dist tensors -> our full state dict (a tied output layer dropped)."""
    unstacked: dict[str, torch.Tensor] = {}
    for key, t in flat.items():
        if key.endswith(EXTRA_STATE) or not isinstance(t, torch.Tensor):
            continue
        if key.startswith("decoder.layers."):
            rest = key[len("decoder.layers."):]
            for i in range(t.shape[0]):
                unstacked[f"decoder.layers.{i}.{rest}"] = t[i]
        elif key == "output_layer.weight" and tied:
            continue
        else:
            unstacked[key] = t
    return megatron_chunk_to_ours(unstacked, 0, "megatron-core torch_dist checkpoint")


def _read_dcp(path: str, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory whose key starts with `prefix`, read in this one process."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise UsageError(f"{path}: not a torch.distributed.checkpoint directory (no .metadata)")
    meta = dcp.FileSystemReader(path).read_metadata()
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in meta.state_dict_metadata.items()
             if k.startswith(prefix) and hasattr(m, "size") and hasattr(m, "properties")}
    if not state:
        raise UsageError(f"{path}: no tensors named {prefix}*")
    dcp.load(state, checkpoint_id=path, no_dist=True)
    return state


def read_ours(iter_dir: str) -> dict[str, torch.Tensor]:
    """Model weights of one of our torch_dist iteration directories, as our full state dict."""
    return {"units." + k[len(OURS_PREFIX):]: t for k, t in _read_dcp(iter_dir, OURS_PREFIX).items()}


def read_mcore(path: str) -> dict[str, torch.Tensor]:
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise UsageError(f"{path}: not a megatron-core distributed checkpoint (no metadata.json)")
    return _read_dcp(path)


def write_mcore(path: str, flat: Mapping[str, torch.Tensor], common: dict | None = None) -> None:
    """A megatron-core torch_dist directory: the tensors, metadata.json and common.pt (`common`: e.g. args)."""
    import torch.distributed.checkpoint as dcp

    if os.path.exists(path) and os.listdir(path):
        raise UsageError(f"{path} exists and is not empty")
    os.makedirs(path, exist_ok=True)
    dcp.save({k: t.contiguous() for k, t in flat.items()}, checkpoint_id=path, no_dist=True)
    with open(os.path.join(path, "metadata.json"), "w") as f:
        json.dump(METADATA, f)
    torch.save(common or {}, os.path.join(path, "common.pt"))
