"""Where a rank's tensors sit in the global tensors of a torch_dist checkpoint, and DCP's planners and reader for
them.

A `Slices` is a rank's part of one global tensor: chunks (global offset, local view). `slices_of` places a
tensor-parallel shard (SwiGLU's stride-2 fc1 as two chunks) or an FSDP2 shard inside it; `piece_slices` places a
ZeRO-1 flat range as boxes. An expert parameter's shard (docs/moe.md) is also offset by ep_rank x its local
experts on its `expert_dim`, whose global size is ep x theirs. DCP's planners read and write the chunks in place.
`SafeReader` is DCP's file reader with the index (.metadata, a pickle DCP itself loads with pickle.load) read as
data.
"""

from __future__ import annotations

import math
import os
import pickle

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, \
    TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..safe_load import dcp_metadata_globals, unpickle


class Slices:
    """Chunks (global offset, local view) of a tensor of global shape `shape` that this rank holds. DCP's planners
    call the three dunder methods (its `_Checkpointable` protocol, as DTensor implements it)."""

    def __init__(self, shape: torch.Size, chunks: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        self.shape = torch.Size(shape)
        self.chunks = chunks

    def size(self) -> torch.Size:
        return self.shape

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(off)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for off, t in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(off), t.size()) for off, t in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for off, t in self.chunks:
            if torch.Size(off) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no chunk at offset {tuple(index.offset)} on this rank")


def slices_of(param: torch.Tensor, local: torch.Tensor, tp_rank: int, tp_size: int, ep_rank: int = 0,
              ep_size: int = 1) -> Slices:
    """`local` (this rank's part of `param`, shaped like it) placed in the parameter's global tensor, as the
    tensor-parallel attributes of `param` say (parallel/layers.py; tp is etp for an expert parameter, which ep
    offsets too); an FSDP2-sharded parameter (a DTensor, or the optimizer's local view of one: `fsdp_param`) adds
    its dp shard's offset inside the tp shard."""
    return _expert_box(_tp_slices(param, local, tp_rank, tp_size), param, ep_rank, ep_size)


def _expert_box(s: Slices, param: torch.Tensor, ep_rank: int, ep_size: int) -> Slices:
    """An expert parameter's tp slices moved to its ep rank's experts: the global tensor holds every ep rank's."""
    dim = getattr(param, "expert_dim", None)
    if ep_size == 1 or dim is None or not getattr(param, "expert_parallel", False):
        return s
    local = param.shape[dim]  # this rank's experts
    shape = list(s.shape)
    shape[dim] *= ep_size
    moved = []
    for off, t in s.chunks:
        off = list(off)
        off[dim] += ep_rank * local
        moved.append((tuple(off), t))
    return Slices(torch.Size(shape), moved)


def _tp_slices(param: torch.Tensor, local: torch.Tensor, tp_rank: int, tp_size: int) -> Slices:
    dt = getattr(param, "fsdp_param", param)
    inner = [0] * local.dim()
    shape = list(local.shape)
    if isinstance(dt, DTensor):
        shape = list(dt.shape)  # the tp shard's shape; `local` is this rank's rows of it
        _, inner = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
        inner = list(inner)
    if local.numel() == 0:
        return Slices(_tp_global(shape, param, tp_size), [])
    dim = getattr(param, "partition_dim", None)
    if dim is None or tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        return Slices(torch.Size(shape), [(tuple(inner), local)])
    stride = getattr(param, "partition_stride", 1)
    block = shape[dim] // stride  # this rank's part of each of the `stride` blocks
    chunks = []
    if stride == 1:
        off = list(inner)
        off[dim] += tp_rank * block
        chunks.append((tuple(off), local))
    else:  # (not with FSDP: hybrid strategies refuse SwiGLU)
        for j, part in enumerate(local.split(block, dim=dim)):
            off = [0] * local.dim()
            off[dim] = j * block * tp_size + tp_rank * block
            chunks.append((tuple(off), part))
    return Slices(_tp_global(shape, param, tp_size), chunks)


def _flat_boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple, tuple, int]]:
    """(offsets, sizes, flat start - a) of the boxes that tile the flattened range [a, b) of a shape: a partial
    first row, whole rows, a partial last row (a row of an N-D shape is its first index; partial ones tile as
    (N-1)-D shapes do)."""
    if len(shape) == 1:
        return [((a,), (b - a,), 0)]
    inner, out, pos = math.prod(shape[1:]), [], a
    while pos < b:
        row, rest = divmod(pos, inner)
        if rest or b - pos < inner:
            n = min(inner - rest, b - pos)
            out += [((row, *off), (1, *size), pos - a + lo) for off, size, lo in _flat_boxes(shape[1:], rest, rest + n)]
        else:
            n = (b - pos) // inner * inner
            out.append(((row,) + (0,) * (len(shape) - 1), (n // inner, *shape[1:]), pos - a))
        pos += n
    return out


def piece_slices(param: torch.Tensor, start: int, end: int, flat: torch.Tensor, tp_rank: int,
                 tp_size: int, ep_rank: int = 0, ep_size: int = 1) -> Slices:
    """A ZeRO-1 piece: `flat` holds the range [start, end) of this rank's flattened tp shard of `param`; its boxes
    placed in the global tensor (a box crossing a stride block boundary, SwiGLU's gate | up, is split there; an
    expert parameter's moved to its ep rank's experts)."""
    return _expert_box(_piece_tp_slices(param, start, end, flat, tp_rank, tp_size), param, ep_rank, ep_size)


def _piece_tp_slices(param: torch.Tensor, start: int, end: int, flat: torch.Tensor, tp_rank: int,
                     tp_size: int) -> Slices:
    shape = tuple(param.shape)
    dim = getattr(param, "partition_dim", None)
    if tp_size == 1 or not getattr(param, "tensor_model_parallel", False):
        dim = None
    stride = getattr(param, "partition_stride", 1)
    chunks = []
    for off, size, lo in _flat_boxes(shape, start, end):
        box = flat[lo:lo + math.prod(size)].view(size)
        if dim is None:
            chunks.append((off, box))
            continue
        block, first, pos = shape[dim] // stride, off[dim], off[dim]
        while pos < first + size[dim]:
            j = pos // block
            stop = min(first + size[dim], (j + 1) * block)
            g = list(off)
            g[dim] = j * block * tp_size + tp_rank * block + pos - j * block
            chunks.append((tuple(g), box.narrow(dim, pos - first, stop - pos)))
            pos = stop
    return Slices(_tp_global(list(shape), param, tp_size), chunks)


def _tp_global(shape: list[int], param: torch.Tensor, tp_size: int) -> torch.Size:
    dim = getattr(param, "partition_dim", None)
    out = list(shape)
    if dim is not None and tp_size > 1 and getattr(param, "tensor_model_parallel", False):
        out[dim] *= tp_size
    return torch.Size(out)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter (a DTensor), else the tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


class SavePlanner(DefaultSavePlanner):
    """DCP's default planner, finding a Slices' chunk by its offset (the state dict is flat already)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def lookup_object(self, index: MetadataIndex):
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Slices) else super().lookup_object(index)


class LoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, reading into a Slices' chunks in place."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        kept = dict(state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(kept)  # DCP's meta-tensor pass replaces objects it does not know by None
        self.state_dict = state_dict

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        obj = self.state_dict[index.fqn]
        return obj.__get_tensor_shard__(index) if isinstance(obj, Slices) else super().lookup_tensor(index)

    def load_bytes(self, read_item, value) -> None:
        """DCP unpickles a saved object with weights_only=False; our checkpoints hold tensors only."""
        raise ValueError(f"{read_item.dest_index.fqn}: the checkpoint holds a pickled object where a tensor was saved; "
                         "refused")


# what DCP's index names: its metadata classes, and the torch values and paths in them
# DCP's index classes, less the bytes entries: DCP loads those with weights_only=False, and ours hold tensors only
_INDEX_GLOBALS = {k: v for k, v in dcp_metadata_globals().items() if not k.endswith(".BytesStorageMetadata")}


class SafeReader(FileSystemReader):
    """DCP's file reader, reading .metadata with safe_load's unpickler that builds DCP's metadata classes only (any
    other global raises safe_load.Refused before anything in the file runs). The shards' tensors DCP reads with
    weights_only=True itself."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        with open(os.path.join(self.path, ".metadata"), "rb") as f:
            metadata = unpickle(f, _INDEX_GLOBALS)
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"holds a {type(metadata).__name__}, not DCP's Metadata")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
