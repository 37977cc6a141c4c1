"""`--ckpt-format torch_dist`: layout-free checkpoints on torch.distributed.checkpoint (DCP).

    <dir>/latest_checkpointed_iteration.txt        the iteration (Megatron's tracker)
    <dir>/iter_0000010/.metadata                   DCP's index of every tensor's chunks
    <dir>/iter_0000010/__R_0.distcp                what rank R wrote
    <dir>/iter_0000010/common.pt                   iteration, args, LR schedule, loss scaler, every rank's RNG

Keys name tensors globally: `model.<unit>.<tensor>` (units are named over the whole model: embedding, attn_i,
mlp_i, head) and `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<unit>.<tensor>`. Every tensor is stored in
its full global shape; a tensor-parallel shard is this rank's chunk of it at its global offset (SwiGLU's fc1,
stride 2, is two chunks: a part of the gate and a part of the up block); a ZeRO-1 rank's flat range of a
parameter is a few boxes of it (partial first row, whole rows, partial last row), so optimizer state is never
gathered. Replicated copies (over dp, or tp for norms) are written once: DCP keeps one copy and spreads the
writes over the ranks. A load reads only the chunks a rank needs, so any tp/pp/dp/virtual-stage/partition/
ZeRO/hybrid layout reads any other's (training/dist_chunks.py places the chunks). The tied output weight of
a last pipeline stage is not saved: it loads from the word embedding.

Atomic as the `torch` format: DCP writes into `iter_XXXXXXX.tmp-<token>`, rank 0 adds common.pt, renames the
directory into place and then replaces the tracker (training/checkpointing.py's helpers).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import Reported, RunError, UsageError
from ..parallel.agree import agree
from ..parallel.state import ParallelState
from .checkpointing import (DIST_FORMAT as FORMAT, DIST_METADATA_FILE as METADATA_FILE, RELEASE,  # noqa: F401
                            _fsync_dir, _move_into_place, _resolve_iteration_dir, _shared_token, _world, _write_tracker,
                            check_model, checkpoint_format, clear_debris, is_dist_checkpoint, iteration_dir_name,
                            load_error, read_tracker)
from .dist_chunks import LoadPlanner, SavePlanner, Slices, local_of, piece_slices, slices_of
from .optimizer import MOMENTS, MixedPrecisionOptimizer

COMMON_FILE = "common.pt"
MODEL = "model."
OPTIM = "optimizer.state."
MASTER = "fp32_param"
WORD_EMBEDDING = "embedding.word_embeddings.weight"


def _optim_slices(optimizer: MixedPrecisionOptimizer, param: torch.Tensor, start: int, end: int,
                  t: torch.Tensor, tp: tuple[int, int]) -> Slices:
    """An optimizer tensor of a piece: flat under ZeRO-1, else shaped like the parameter."""
    return piece_slices(param, start, end, t, *tp) if optimizer.distributed else slices_of(param, t, *tp)


def global_name(chunk_key: str, param: torch.Tensor | None = None) -> str:
    """A chunk's state-dict key ('units.attn_0.qkv.weight') as the layout-free name ('attn_0.qkv.weight'); the
    last stage's tied copy of the word embedding is the embedding's."""
    name = chunk_key[len("units."):] if chunk_key.startswith("units.") else chunk_key
    if param is not None and getattr(param, "shared_embedding_copy", False):
        return WORD_EMBEDDING
    return name


# -- what a rank saves and loads -------------------------------------------------------------------------------------
def _unit_states(chunks: list, state: ParallelState) -> dict:
    """Unit name -> the ParallelState it was built with (hybrid strategies: each unit's own tp)."""
    return {name: getattr(unit, "state", state) for c in chunks for name, unit in c.units.items()}


def _tp_of(name: str, units: dict, state: ParallelState) -> tuple[int, int]:
    s = units.get(name.split(".", 1)[0], state)
    return s.tp_rank, s.tp_size


def _model_tensors(chunks: list, state: ParallelState) -> list[tuple[str, torch.Tensor, bool, tuple[int, int]]]:
    """(global name, tensor, is the tied copy, (tp rank, tp size)) of every tensor of this rank's chunks (buffers
    included)."""
    units = _unit_states(chunks, state)
    out = []
    for chunk in chunks:
        for key, t in chunk.state_dict(keep_vars=True).items():
            copy = getattr(t, "shared_embedding_copy", False)
            name = global_name(key, t)
            out.append((name, t, copy, _tp_of(global_name(key), units, state)))
    return out


def layout_of(state: ParallelState) -> dict:
    """What the RNG streams' meaning depends on: every rank keeps its coordinates when these agree."""
    return {"tp": state.tp_size, "pp": state.pp_size, "dp": state.dp_size, "order": state.layout.order,
            "world": _world()[1], "unit_strategies": state.units.names()}


def save(save_dir: str, iteration: int, state: ParallelState, payload: dict, chunks: list,
         optimizer: MixedPrecisionOptimizer | None = None, save_optim: bool = True, rng_state=None) -> str:
    """Save as torch_dist (every rank calls it). `payload`: the common part (no model); `rng_state`: this
    rank's RNG streams (gathered into common.pt). Returns the iteration directory."""
    with_optim = optimizer is not None and save_optim
    if optimizer is not None:
        optimizer.finish_param_sync()  # the model's tensors hold the last step's weights
    rngs = _gather_objects(rng_state)
    token = _shared_token(state)
    name = iteration_dir_name(iteration)
    tmp_dir = os.path.join(save_dir, f"{name}.tmp-{token}")
    final_dir = os.path.join(save_dir, name)
    rank = _world()[0]
    tensors = {}
    for gname, t, copy, tp in _model_tensors(chunks, state):
        if not copy:
            tensors[MODEL + gname] = slices_of(t, local_of(t).detach(), *tp)
    common = dict(payload, checkpoint_format=FORMAT, layout=layout_of(state), rng_state=rngs)
    if with_optim:  # each rank its own pieces: ZeRO-1's flat ranges as boxes of the global tensors, no gather
        units = _unit_states(chunks, state)
        for (i, start, end), st in zip(optimizer.pieces(), optimizer.piece_state()):
            p, pname = optimizer.params[i], optimizer.names[i]
            if getattr(p, "shared_embedding_copy", False):
                continue
            tp = _tp_of(global_name(pname), units, state)
            for key, value in ((MASTER, st["master"]), *((k, st[k]) for k in MOMENTS)):
                if value is not None:  # no master: fp32 weights without ZeRO are their own
                    tensors[f"{OPTIM}{key}.{global_name(pname)}"] = _optim_slices(optimizer, p, start, end,
                                                                                 value.detach(), tp)
        common["optimizer"] = optimizer.state_meta()

    def failed(exc: BaseException) -> RunError:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return RunError(f"--save {save_dir}: cannot write the checkpoint of iteration {iteration} "
                        f"({why}); the previous checkpoint is kept")

    error = None
    try:
        with _single_process_quiet():
            dcp.save(tensors, checkpoint_id=tmp_dir, planner=SavePlanner(), no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises every rank's failure on all
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        error = failed(exc)
    agree(_raise, error)

    def publish() -> None:
        if rank != 0:
            return
        try:
            with open(os.path.join(tmp_dir, COMMON_FILE), "wb") as f:
                torch.save(common, f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_dir(tmp_dir)
            _move_into_place(tmp_dir, final_dir, token)
            _write_tracker(save_dir, iteration, token)
        except OSError as exc:
            raise failed(exc) from None
        clear_debris(save_dir)

    try:
        agree(publish)
    except (Reported, RunError):
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return final_dir


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns when it runs without a process group (tools, tests); that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _gather_objects(obj) -> list | None:
    if obj is None:
        return None
    rank, world = _world()
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _unreadable(load_dir: str, path: str, exc: Exception) -> UsageError:
    reason = (str(exc).strip().splitlines() or [""])[0]
    return UsageError(f"--load {load_dir}: cannot read {path} ({type(exc).__name__}: {reason})")


def read_common(load_dir: str, iter_dir: str) -> dict:
    path = os.path.join(iter_dir, COMMON_FILE)
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - missing, truncated or foreign
        raise _unreadable(load_dir, path, exc) from None
    if not isinstance(data, dict) or data.get("checkpoint_format") != FORMAT:
        raise UsageError(f"--load {load_dir}: {path} is not a megatron_bmw torch_dist common file")
    return data


def load(load_dir: str, state: ParallelState, chunks: list, optimizer: MixedPrecisionOptimizer | None,
         load_optim: bool = True, model_args: dict | None = None) -> dict:
    """Load the tracker's torch_dist checkpoint into this rank's chunks (and the optimizer). Collective; an error
    on any rank stops every rank with one line. Returns the common payload; its "rng_state" is this rank's
    streams when the layout is the same, else absent ("rng_layout_changed" says so)."""
    want_optim = optimizer is not None and load_optim
    common, tensors, targets, entries = agree(_load_plan, load_dir, state, chunks, optimizer if want_optim else None,
                                              model_args)
    with torch.no_grad():
        error = None
        iter_dir = _resolve_iteration_dir(load_dir, read_tracker(load_dir))
        try:
            with _single_process_quiet():
                dcp.load(tensors, checkpoint_id=iter_dir, planner=LoadPlanner(), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises every rank's failure on all
            why = load_error(exc, -1, f"cannot read the tensors in {iter_dir} ({{}})")
            error = UsageError(f"--load {load_dir}: {why}")
        agree(_raise, error)
        for src, *extra in targets.values():
            for t in extra:
                t.detach().copy_(src)
    if optimizer is not None:
        if entries is not None:
            optimizer.load_piece_state(common["optimizer"], entries)
        else:
            optimizer.reload_model_params()
    out = {k: v for k, v in common.items() if k not in ("optimizer", "rng_state", "layout")}
    rngs = common.get("rng_state")
    if rngs is not None and common.get("layout") == layout_of(state):
        out["rng_state"] = rngs[_world()[0]]
    out["rng_layout_changed"] = rngs is not None and "rng_state" not in out
    out["saved_layout"] = common.get("layout")
    saved_rows = (common.get("args") or {}).get("padded_vocab_size")
    if model_args is not None and saved_rows not in (None, model_args.get("padded_vocab_size")):
        out["vocab_repadded"] = (saved_rows, model_args.get("padded_vocab_size"))
    return out


def _vocab_rows(mine: torch.Size, saved: torch.Size, rows: tuple) -> bool:
    """Is this a vocabulary tensor whose padding differs (Megatron pads the vocabulary to a multiple of
    make_vocab_size_divisible_by x tp, so it changes with tp)?"""
    return (len(mine) == len(saved) and len(mine) > 0 and tuple(mine[1:]) == tuple(saved[1:])
            and (saved[0], mine[0]) == rows)


def _repad(s: Slices, saved: torch.Size) -> Slices:
    """Read the rows the checkpoint has; rows it lacks (more padding here) start at zero, as the converters pad."""
    chunks = []
    for off, t in s.chunks:
        keep = max(0, min(t.size(0), saved[0] - off[0]))
        if keep < t.size(0):
            t[keep:].zero_()
        if keep:
            chunks.append((off, t[:keep]))
    return Slices(saved, chunks)


def _raise(error: Exception | None) -> None:
    if error is not None:
        raise error


def _load_plan(load_dir: str, state: ParallelState, chunks: list, optimizer: MixedPrecisionOptimizer | None,
               model_args: dict | None):
    """(common payload, {key: Slices} to read, {key: further tensors to copy it into}, optimizer entries or None);
    no collectives."""
    iteration = read_tracker(load_dir)
    iter_dir = _resolve_iteration_dir(load_dir, iteration)
    common = read_common(load_dir, iter_dir)
    if model_args is not None:
        check_model(load_dir, common, model_args, "another model; a torch_dist checkpoint reshards the layout only")
    tensors, targets, first = {}, {}, {}

    units = _unit_states(chunks, state)

    try:
        metadata = FileSystemReader(iter_dir).read_metadata()
    except Exception as exc:  # noqa: BLE001 - truncated or foreign
        raise _unreadable(load_dir, os.path.join(iter_dir, METADATA_FILE), exc) from None
    sizes = {k: md.size for k, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}
    rows = ((common.get("args") or {}).get("padded_vocab_size"), (model_args or {}).get("padded_vocab_size"))

    def want(key: str, param: torch.Tensor, target: torch.Tensor, tp: tuple[int, int], piece=None) -> None:
        if key in tensors:  # one rank holding a tensor twice reads it once, into the first
            targets.setdefault(key, [first[key]]).append(target)
            return
        first[key] = target
        s = slices_of(param, target.detach(), *tp) if piece is None else \
            _optim_slices(optimizer, param, *piece, target.detach(), tp)
        saved = sizes.get(key)
        if saved is not None and rows[0] != rows[1] and _vocab_rows(s.shape, saved, rows):
            s = _repad(s, saved)
        tensors[key] = s

    # fp32 weights that are their own masters read the saved fp32 masters where there are some (a bf16 or fp16
    # checkpoint resumed in fp32 keeps full precision)
    own = set() if optimizer is None or iteration == RELEASE else \
        {id(optimizer.params[i]) for (i, _, _), st in zip(optimizer.pieces(), optimizer.piece_state())
         if st["master"] is None}
    for gname, t, _, tp in _model_tensors(chunks, state):
        master = f"{OPTIM}{MASTER}.{gname}"
        want(master if id(t) in own and master in sizes else MODEL + gname, t, local_of(t), tp)
    if optimizer is None or iteration == RELEASE:
        return common, tensors, targets, None
    saved = common.get("optimizer")
    if saved is None:
        raise UsageError(f"--load {load_dir}: the checkpoint has no optimizer state; load with --no-load-optim")
    moments = MOMENTS if int(saved.get("step", 0)) > 0 else ()
    entries = []
    for i, start, end in optimizer.pieces():  # this rank's pieces only (ZeRO-1: flat ranges)
        p, pname = optimizer.params[i], optimizer.names[i]
        # fp32 weights without ZeRO are their own masters (not saved twice): the optimizer then takes the weights
        keys = (MASTER, *moments) if f"{OPTIM}{MASTER}.{global_name(pname, p)}" in sizes else moments
        shape = (end - start,) if optimizer.distributed else p.shape
        e = {k: torch.empty(shape, dtype=torch.float32, device=p.device) for k in keys}
        tp = _tp_of(global_name(pname), units, state)
        for k in keys:
            want(f"{OPTIM}{k}.{global_name(pname, p)}", p, e[k], tp, (start, end))
        entries.append({"master": e.get(MASTER), **{k: e.get(k) for k in MOMENTS}})
    return common, tensors, targets, entries
