"""Model weights between our `torch_dist` checkpoints and megatron-core's `torch_dist` key layout.

megatron-core (checked against 0.16.1) saves a GPTModel's `sharded_state_dict()` through
torch.distributed.checkpoint: one key per parameter of all layers, `decoder.layers.<module>.<tensor>`, with the
layer as a leading axis of the global tensor ([num_layers, ...]; layer i at offset i), under the Transformer
Engine names (`self_attention.linear_qkv.layer_norm_weight` for the input norm, also with the local layer spec),
the embedding, final norm and (untied) `output_layer.weight` as they are (MoE layers: their router, every expert
stacked, `mlp.experts.experts.linear_fc1.weight` [layers, E, 2F, h], and shared experts; when dense and MoE layers
mix, every layer's keys are its own, `decoder.layers.<i>.<tensor>`, as megatron-core writes them), beside a
`metadata.json` naming the backends and a `common.pt`. Our torch_dist keys are `model.<unit>.<tensor>`. The
per-layer names are convert/megatron_names.py's; this module only stacks and unstacks layers and reads and writes
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
from ..safe_load import dcp_reader
from .megatron_moe import DIST
from .megatron_names import EXTRA_STATE, megatron_chunk_to_ours, ours_chunk_to_megatron

METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}
OURS_PREFIX = "model."  # training/dist_checkpoint.py's model keys
MCORE_MODEL_PREFIXES = ("embedding.", "decoder.", "output_layer.")  # a GPTModel's; optimizer.*, rng_state are not
_STACKED = re.compile(r"decoder\.layers\.(\d+)\.(.+)")


def stack_layers(megatron_sd: Mapping[str, torch.Tensor], per_layer: bool = False) -> dict[str, torch.Tensor]:
    """A whole model in megatron-core's per-layer names (`decoder.layers.<i>.<tensor>`) -> its torch_dist tensors:
    each layer tensor stacked over the layers on a leading axis, `_extra_state` dropped. `per_layer`: layers that
    differ (MoE and dense layers mixed: a list or N > 1 --moe-layer-freq) keep their own keys, by global layer
    number, as megatron-core's TransformerBlock writes them then (`non_homogeneous_layers`)."""
    per_key: dict[str, dict[int, torch.Tensor]] = {}
    out: dict[str, torch.Tensor] = {}
    for name, t in megatron_sd.items():
        if name.endswith(EXTRA_STATE):
            continue
        m = _STACKED.fullmatch(name)
        if m and not per_layer:
            per_key.setdefault(f"decoder.layers.{m.group(2)}", {})[int(m.group(1))] = t
        else:
            out[name] = t
    for key, layers in per_key.items():
        if sorted(layers) != list(range(len(layers))):
            raise UsageError(f"checkpoint: {key} misses layers (has {sorted(layers)})")
        out[key] = torch.stack([layers[i] for i in range(len(layers))])
    return out


def unstack_layers(flat: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """megatron-core's torch_dist tensors -> its per-layer names (the inverse of `stack_layers`; keys already per
    layer, `decoder.layers.<i>.*`, stay)."""
    out: dict[str, torch.Tensor] = {}
    for key, t in flat.items():
        if key.endswith(EXTRA_STATE) or not isinstance(t, torch.Tensor):
            continue
        if key.startswith("decoder.layers.") and not _STACKED.fullmatch(key):
            rest = key[len("decoder.layers."):]
            for i in range(t.shape[0]):
                out[f"decoder.layers.{i}.{rest}"] = t[i]
        else:
            out[key] = t
    return out


def per_layer_keys(moe_layer_freq) -> bool:
    """Whether megatron-core writes every layer's own keys for this --moe-layer-freq (a list, or N > 1)."""
    return isinstance(moe_layer_freq, (list, tuple)) or (isinstance(moe_layer_freq, int) and moe_layer_freq > 1)


def ours_to_mcore(full: Mapping[str, torch.Tensor], tied: bool, per_layer: bool = False) -> dict[str, torch.Tensor]:
    """Our full state dict (`units.<unit>.<tensor>`) -> megatron-core's torch_dist tensors (MoE layers' experts
    stacked as its `mlp.experts.experts.*`; `per_layer`: see `stack_layers`)."""
    out = stack_layers(ours_chunk_to_megatron(full, 0, "transformer_engine", DIST), per_layer)
    if tied:  # megatron-core's tied output layer is the word embedding: no key of its own
        out.pop("output_layer.weight", None)
    return out


def mcore_to_ours(flat: Mapping[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """megatron-core's torch_dist tensors -> our full state dict (a tied output layer dropped)."""
    unstacked = unstack_layers(flat)
    if tied:
        unstacked.pop("output_layer.weight", None)
    return megatron_chunk_to_ours(unstacked, 0, "megatron-core torch_dist checkpoint")


def _read_dcp(path: str, prefix: str | tuple[str, ...] = "", where: str = "torch_dist checkpoint"
              ) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory whose key starts with `prefix`, read in this one process; its `.metadata`
    (a pickle) read as data (safe_load.dcp_reader), `where` starting a refusal's line."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise UsageError(f"{path}: not a torch.distributed.checkpoint directory (no .metadata)")
    try:
        reader = dcp_reader(path, where)
        state = {k: torch.empty(m.size, dtype=m.properties.dtype)
                 for k, m in reader.read_metadata().state_dict_metadata.items()
                 if k.startswith(prefix) and hasattr(m, "size") and hasattr(m, "properties")}
        if state:
            dcp.load(state, storage_reader=reader, no_dist=True)
    except UsageError:
        raise
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign directory is a user error
        reason = (str(exc).strip().splitlines() or [""])[-1][:200]
        raise UsageError(f"{path}: cannot read this torch_dist checkpoint ({type(exc).__name__}: {reason})") from None
    if not state:
        names = " or ".join(f"{p}*" for p in ((prefix,) if isinstance(prefix, str) else prefix))
        raise UsageError(f"{path}: no tensors named {names}")
    return state


def read_ours(iter_dir: str, where: str = "torch_dist checkpoint") -> dict[str, torch.Tensor]:
    """Model weights of one of our torch_dist iteration directories, as our full state dict."""
    return {"units." + k[len(OURS_PREFIX):]: t for k, t in _read_dcp(iter_dir, OURS_PREFIX, where).items()}


def read_mcore(path: str, where: str = "torch_dist checkpoint") -> dict[str, torch.Tensor]:
    """The model tensors of a megatron-core torch_dist directory (optimizer state and RNG objects left out)."""
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise UsageError(f"{path}: not a megatron-core distributed checkpoint (no metadata.json)")
    return _read_dcp(path, MCORE_MODEL_PREFIXES, where)


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


# ----------------------------------------------------------------------------------------------------------------
# Whole checkpoints as convert/megatron.py's payloads (one rank, tp 1 pp 1: torch_dist has no layout)

_SERIAL = dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)


def _mcore_order(name: str) -> tuple:
    """Model order of megatron-core's per-layer names (convert/megatron.py reads the units in order)."""
    m = _STACKED.fullmatch(name)
    if m:
        rest = m.group(2)
        return 1, int(m.group(1)), int(rest.startswith(("mlp.", "pre_mlp_layernorm.")))
    return (0,) if name.startswith("embedding.") else (2,)


def _ours_order(name: str) -> tuple:
    m = re.fullmatch(r"units\.(attn|mlp)_(\d+)\..+", name)
    if m:
        return 1, int(m.group(2)), int(m.group(1) == "mlp")
    return (0,) if name.startswith("units.embedding.") else (2,)


def payload_from_ours_dist(iter_dir: str, common: Mapping, where: str = "torch_dist checkpoint") -> dict:
    """Our torch_dist iteration directory (with its common.pt payload) -> a read_ours payload."""
    args = dict(common.get("args") or {}, **_SERIAL, virtual_pipeline_model_parallel_size=1,
                expert_model_parallel_size=1, expert_tensor_parallel_size=1)  # every expert, whole
    args.pop("pipeline_partition", None)
    keep = {k: v for k, v in common.items() if k in ("iteration", "consumed_train_samples", "consumed_valid_samples",
                                                     "checkpoint_version")}
    model = read_ours(iter_dir, where)
    return dict(keep, args=args, model={k: model[k] for k in sorted(model, key=_ours_order)})


def payload_from_mcore_dist(iter_dir: str, common: Mapping, where: str = "torch_dist checkpoint") -> dict:
    """A megatron-core torch_dist iteration directory (with its common.pt) -> a read_megatron payload."""
    from .megatron_args import args_dict

    args = dict(args_dict(common.get("args")), **_SERIAL, virtual_pipeline_model_parallel_size=None,
                expert_model_parallel_size=1, expert_tensor_parallel_size=1)
    keep = {k: v for k, v in common.items() if k in ("iteration", "checkpoint_version")}
    model = unstack_layers(read_mcore(iter_dir, where))
    return dict(keep, args=args, model={k: model[k] for k in sorted(model, key=_mcore_order)})


# megatron-core's local layer spec saves its norms under the Transformer Engine spec's names (its
# sharded_state_dict_keys_map): input_layernorm as linear_qkv's, pre_mlp_layernorm as linear_fc1's, an MoE
# layer's too (the TE spec keeps an MoE layer's pre_mlp_layernorm, its router needs the normed input)
_LOCAL_NORM = re.compile(r"(?<=^decoder\.layers\.)(\d+\.)?(input_layernorm|pre_mlp_layernorm)\.(weight|bias)$")
_LOCAL_SHARDED = {"input_layernorm": "self_attention.linear_qkv.layer_norm_", "pre_mlp_layernorm":
                  "mlp.linear_fc1.layer_norm_"}


def mcore_dist_from_payload(payload: Mapping) -> tuple[dict[str, torch.Tensor], dict]:
    """A write_megatron payload of tp 1 pp 1 -> (megatron-core's torch_dist tensors, its common.pt dict)."""
    import argparse

    from .megatron_args import args_dict

    common = {k: v for k, v in payload.items() if not k.startswith("model")}
    args = args_dict(common["args"])
    common["args"] = argparse.Namespace(**dict(args, ckpt_format="torch_dist"))
    model = payload["model"]
    if args.get("transformer_impl") == "local":  # its layers' sharded keys map the norms to the TE spec's names
        model = {_LOCAL_NORM.sub(lambda m: (m.group(1) or "") + _LOCAL_SHARDED[m.group(2)] + m.group(3), k): t
                 for k, t in model.items()}
    flat = stack_layers(model, bool(args.get("num_experts")) and per_layer_keys(args.get("moe_layer_freq")))
    if not args.get("untie_embeddings_and_output_weights"):
        flat.pop("output_layer.weight", None)
    return flat, common
