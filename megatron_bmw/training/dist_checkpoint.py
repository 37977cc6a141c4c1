"""`--ckpt-format torch_dist`: layout-free checkpoints on torch.distributed.checkpoint (DCP).

    <dir>/latest_checkpointed_iteration.txt        the iteration (Megatron's tracker)
    <dir>/iter_0000010/.metadata                   DCP's index of every tensor's chunks
    <dir>/iter_0000010/__R_0.distcp                what rank R wrote
    <dir>/iter_0000010/common.pt                   iteration, args, LR schedule, loss scaler, every rank's RNG
    <dir>/iter_0000010/checksums.json              size and digest of each of them (checkpoint_dir.py)

Keys name tensors globally: `model.<unit>.<tensor>` (units are named over the whole model: embedding, attn_i,
mlp_i, head) and `optimizer.state.{fp32_param,exp_avg,exp_avg_sq}.<unit>.<tensor>`. Every tensor is stored in
its full global shape; a tensor-parallel shard is this rank's chunk of it at its global offset (SwiGLU's fc1,
stride 2, is two chunks: a part of the gate and a part of the up block); a ZeRO-1 rank's flat range of a
parameter is a few boxes of it (partial first row, whole rows, partial last row), so optimizer state is never
gathered. Replicated copies (over dp, or tp for norms) are written once: DCP keeps one copy and spreads the
writes over the ranks. A load reads only the chunks a rank needs, so any tp/pp/dp/virtual-stage/partition/
ZeRO/hybrid layout reads any other's (training/dist_chunks.py places the chunks). The tied output weight of
a last pipeline stage is not saved: it loads from the word embedding.

Everything is read as data: common.pt through safe_load.py, .metadata (which DCP itself unpickles) through
dist_chunks.SafeReader's allow-list. The temporary folder, the checksums, the rename and the tracker are
checkpoint_dir.py's; rank 0 adds common.pt once DCP has written the shards and .metadata.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import UsageError
from ..parallel.agree import agree
from ..parallel.expert_params import split_of
from ..parallel.state import ParallelState
from ..safe_load import Refused, load_file
from . import checkpoint_dir
from .checkpoint_dir import (DIST_FORMAT as FORMAT, DIST_METADATA_FILE as METADATA_FILE, Damaged, IterationDir,
                             agree_damage, gather_first, save_synced, world)
from .checkpointing import check_model, model_misfit
from .dist_chunks import LoadPlanner, SafeReader, SavePlanner, Slices, local_of, piece_slices, slices_of
from .optimizer import MOMENTS, MixedPrecisionOptimizer

COMMON_FILE = "common.pt"
MODEL = "model."
OPTIM = "optimizer.state."
MASTER = "fp32_param"
WORD_EMBEDDING = "embedding.word_embeddings.weight"


def _optim_slices(optimizer: MixedPrecisionOptimizer, param: torch.Tensor, start: int, end: int,
                  t: torch.Tensor, tp: tuple[int, ...]) -> Slices:
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


def _tp_of(name: str, param: torch.Tensor, units: dict, state: ParallelState) -> tuple[int, int, int, int]:
    """(tp rank, tp size, ep rank, ep size) of the tensor's shard: an expert's etp and ep (expert_params.py)."""
    return split_of(param, units.get(name.split(".", 1)[0], state))


def _model_tensors(chunks: list, state: ParallelState) -> list[tuple[str, torch.Tensor, bool, tuple[int, ...]]]:
    """(global name, tensor, is the tied copy, (tp rank, tp size, ep rank, ep size)) of every tensor of this rank's
    chunks (buffers included)."""
    units = _unit_states(chunks, state)
    out = []
    for chunk in chunks:
        for key, t in chunk.state_dict(keep_vars=True).items():
            copy = getattr(t, "shared_embedding_copy", False)
            name = global_name(key, t)
            out.append((name, t, copy, _tp_of(global_name(key), t, units, state)))
    return out


def layout_of(state: ParallelState) -> dict:
    """What the RNG streams' meaning depends on: every rank keeps its coordinates when these agree."""
    out = {"tp": state.tp_size, "pp": state.pp_size, "dp": state.dp_size, "order": state.layout.order,
           "world": world()[1], "unit_strategies": state.units.names()}
    if state.cp_size > 1:  # as before context parallelism where cp is 1
        out["cp"] = state.cp_size
    if state.ep_size > 1 or state.etp_size != state.tp_size:  # as before experts where they split as dense tensors
        out.update(ep=state.ep_size, etp=state.etp_size)
    return out


class DistFormat:
    """torch_dist files of this rank's model chunks and optimizer."""

    name = FORMAT

    def __init__(self, state: ParallelState, chunks: list, optimizer: MixedPrecisionOptimizer | None = None) -> None:
        self.state, self.chunks, self.optimizer = state, chunks, optimizer

    # -- save ---------------------------------------------------------------------------------------------------------
    def write(self, target: IterationDir, payload: dict, rng_state: dict | None, save_optim: bool) -> list[str]:
        """DCP writes the shards and .metadata, then rank 0 common.pt: `payload` is the common part (no model),
        `rng_state` this rank's RNG streams (gathered into common.pt)."""
        opt = self.optimizer
        if opt is not None:
            opt.finish_param_sync()  # the model's tensors hold the last step's weights
        common = dict(payload, checkpoint_format=FORMAT, layout=layout_of(self.state),
                      rng_state=gather_first(rng_state) if rng_state is not None else None)
        tensors = self._tensors(opt is not None and save_optim)
        if opt is not None and save_optim:
            common["optimizer"] = opt.state_meta()
        error = None
        try:
            with _single_process_quiet():
                dcp.save(tensors, checkpoint_id=target.path, planner=SavePlanner(), no_dist=not dist.is_initialized())
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises every rank's failure on all
            error = target.failed(exc)
        agree(_raise, error)
        agree(_write_common, target, common)
        rank = world()[0]
        shards = sorted(e for e in os.listdir(target.path) if e.startswith(f"__{rank}_") and e.endswith(".distcp"))
        return shards + ([METADATA_FILE, COMMON_FILE] if rank == 0 else [])

    def _tensors(self, with_optim: bool) -> dict[str, Slices]:
        """Every tensor this rank saves, by global key; with the optimizer each rank its own pieces (ZeRO-1's flat
        ranges as boxes of the global tensors, no gather)."""
        state, opt = self.state, self.optimizer
        tensors = {MODEL + gname: slices_of(t, local_of(t).detach(), *tp)
                   for gname, t, copy, tp in _model_tensors(self.chunks, state) if not copy}
        if not with_optim:
            return tensors
        units = _unit_states(self.chunks, state)
        for (i, start, end), st in zip(opt.pieces(), opt.piece_state()):
            p, pname = opt.params[i], opt.names[i]
            if getattr(p, "shared_embedding_copy", False):
                continue
            tp = _tp_of(global_name(pname), p, units, state)
            for key, value in ((MASTER, st["master"]), *((k, st[k]) for k in MOMENTS)):
                if value is not None:  # no master: fp32 weights without ZeRO are their own
                    tensors[f"{OPTIM}{key}.{global_name(pname)}"] = _optim_slices(opt, p, start, end, value.detach(),
                                                                                 tp)
        return tensors

    # -- load ---------------------------------------------------------------------------------------------------------
    def own_files(self, iter_dir: str, load_optim: bool) -> list[str]:
        """common.pt and .metadata (every rank reads them), and this rank's share of the shards: between them the
        ranks verify every shard once."""
        rank, size = world()
        shards = sorted(e for e in os.listdir(iter_dir) if e.endswith(".distcp"))
        return [COMMON_FILE, METADATA_FILE] + shards[rank::size]

    def read(self, source: IterationDir, load_optim: bool, model_args: dict | None) -> dict:
        """The common payload; its "rng_state" is this rank's streams when the layout is the same, else absent
        ("rng_layout_changed" says so)."""
        opt = self.optimizer
        common, tensors, targets, entries = agree_damage(self._plan, source, opt if load_optim else None, model_args)
        with torch.no_grad():
            error = None
            try:
                with _single_process_quiet():
                    dcp.load(tensors, storage_reader=SafeReader(source.path), planner=LoadPlanner(),
                             no_dist=not dist.is_initialized())
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - DCP raises every rank's failure on all
                error = _read_failed(source, exc)
            agree_damage(_raise, error)
            for src, *extra in targets.values():
                for t in extra:
                    t.detach().copy_(src)
        if opt is not None:
            if entries is not None:
                opt.load_piece_state(common["optimizer"], entries)
            else:
                opt.reload_model_params()
        return self._payload(common, model_args)

    def _payload(self, common: dict, model_args: dict | None) -> dict:
        out = {k: v for k, v in common.items() if k not in ("optimizer", "rng_state", "layout")}
        rngs = common.get("rng_state")
        if rngs is not None and common.get("layout") == layout_of(self.state):
            out["rng_state"] = rngs[world()[0]]
        out["rng_layout_changed"] = rngs is not None and "rng_state" not in out
        out["saved_layout"] = common.get("layout")
        was, now = (common.get("args") or {}).get("padded_vocab_size"), (model_args or {}).get("padded_vocab_size")
        if model_args is not None and was not in (None, now) and world()[0] == 0:
            what = f"padded rows beyond {was} start at zero" if now > was else f"its padded rows beyond {now} are dropped"
            print(f" vocabulary padding: the checkpoint has {was} rows, this run {now} (Megatron pads to a multiple of "
                  f"--make-vocab-size-divisible-by x tp): {what}", flush=True)
        return out

    def _plan(self, source: IterationDir, optimizer: MixedPrecisionOptimizer | None, model_args: dict | None):
        """(common payload, {key: Slices} to read, {key: further tensors to copy it into}, optimizer entries or
        None); no collectives. `optimizer`: None unless its state is loaded."""
        state, chunks = self.state, self.chunks
        common = read_common(source)
        if model_args is not None:
            check_model(source.where, common, model_args,
                        "another model; a torch_dist checkpoint reshards the layout only")
        tensors, targets, first = {}, {}, {}
        units = _unit_states(chunks, state)
        metadata = read_metadata(source)
        sizes = {k: md.size for k, md in metadata.state_dict_metadata.items() if hasattr(md, "size")}
        rows = ((common.get("args") or {}).get("padded_vocab_size"), (model_args or {}).get("padded_vocab_size"))

        def want(key: str, param: torch.Tensor, target: torch.Tensor, tp: tuple[int, ...], piece=None) -> None:
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
        own = set() if optimizer is None else \
            {id(optimizer.params[i]) for (i, _, _), st in zip(optimizer.pieces(), optimizer.piece_state())
             if st["master"] is None}
        for gname, t, _, tp in _model_tensors(chunks, state):
            master = f"{OPTIM}{MASTER}.{gname}"
            want(master if id(t) in own and master in sizes else MODEL + gname, t, local_of(t), tp)
        if optimizer is None:
            return common, tensors, targets, None
        saved = common.get("optimizer")
        if saved is None:
            raise UsageError(f"{source.where}: the checkpoint has no optimizer state; load with --no-load-optim")
        moments = MOMENTS if int(saved.get("step", 0)) > 0 else ()
        entries = []
        for i, start, end in optimizer.pieces():  # this rank's pieces only (ZeRO-1: flat ranges)
            p, pname = optimizer.params[i], optimizer.names[i]
            # fp32 weights without ZeRO are their own masters (not saved twice): the optimizer then takes the weights
            keys = (MASTER, *moments) if f"{OPTIM}{MASTER}.{global_name(pname, p)}" in sizes else moments
            shape = (end - start,) if optimizer.distributed else p.shape
            e = {k: torch.empty(shape, dtype=torch.float32, device=p.device) for k in keys}
            tp = _tp_of(global_name(pname), p, units, state)
            for k in keys:
                want(f"{OPTIM}{k}.{global_name(pname, p)}", p, e[k], tp, (start, end))
            entries.append({"master": e.get(MASTER), **{k: e.get(k) for k in MOMENTS}})
        return common, tensors, targets, entries


@contextlib.contextmanager
def _single_process_quiet():
    """DCP warns when it runs without a process group (tools, tests); that is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_common(target: IterationDir, common: dict) -> None:
    """Rank 0: common.pt beside the shards."""
    if world()[0] != 0:
        return
    try:
        save_synced(common, os.path.join(target.path, COMMON_FILE))
    except OSError as exc:
        raise target.failed(exc) from None


def read_common(source: IterationDir) -> dict:
    path = os.path.join(source.path, COMMON_FILE)
    try:
        data = load_file(path, source.where)
    except UsageError as exc:  # missing, truncated, foreign or refused
        raise Damaged(str(exc)) from None
    if not isinstance(data, dict) or data.get("checkpoint_format") != FORMAT:
        raise Damaged(f"{source.where}: {path} is not a megatron_bmw torch_dist common file")
    return data


def read_metadata(source: IterationDir):
    """DCP's index of the tensors, read as data (dist_chunks.SafeReader)."""
    path = os.path.join(source.path, METADATA_FILE)
    try:
        return SafeReader(source.path).read_metadata()
    except Refused as exc:
        raise Damaged(f"{source.where}: {path} names the global {exc.name}, which a torch_dist index never needs; "
                      "refused (nothing in the file was run)") from None
    except Exception as exc:  # noqa: BLE001 - missing, truncated or foreign
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise Damaged(f"{source.where}: cannot read {path} ({type(exc).__name__}: {reason})") from None


def _read_failed(source: IterationDir, exc: BaseException) -> UsageError:
    """Weights that do not fit this model, or shards that cannot be read (Damaged)."""
    misfit = model_misfit(exc)
    if misfit is not None:
        return UsageError(f"{source.where}: {misfit}")
    last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
    return Damaged(f"{source.where}: cannot read the tensors in {source.path} ({last})")


def save(save_dir: str, iteration: int, state: ParallelState, payload: dict, chunks: list,
         optimizer: MixedPrecisionOptimizer | None = None, save_optim: bool = True, rng_state=None) -> str:
    """Save as torch_dist on its own (tools, tests; every rank calls it). Returns the iteration folder."""
    return checkpoint_dir.save(DistFormat(state, chunks, optimizer), state, save_dir, iteration, payload, rng_state,
                               save_optim)


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
