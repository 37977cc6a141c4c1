"""The legacy `torch` format: Megatron's files per (tp, pp) rank.

    <dir>/iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt    payload + optimizer state
    <dir>/iter_0000010/mp_rank_TT[_PPP]/distrib_optim.pt      per-parameter optimizer state (ZeRO-1 only)

DP rank 0 of each (tp, pp) writes its files (a hybrid layout: every rank of a stage its own shard); the files are
read as data (safe_load.py). Experts split other than the dense tensors (ep > 1 or etp != tp) are refused: Megatron
names those files mp_rank_TT_PPP_EEE, and torch_dist saves them here. The tracker, the temporary folder, the checksums and the rename are
checkpoint_dir.py's. `save_checkpoint` and `load_checkpoint` are the format on its own, for tools and tests: their
payloads hold the model ("model", or "model0", "model1", ... per virtual stage).
"""

from __future__ import annotations

import os

import torch  # noqa: F401 - tests/training/test_faults.py fills the disk through checkpointing.torch.save

from ..errors import UsageError
from ..parallel.agree import agree
from ..config.layout_rules import legacy_format_refusal
from ..parallel.expert_params import has_experts
from ..parallel.state import ParallelState
from ..safe_load import load_file
from .checkpoint_dir import (RELEASE, TORCH_FORMAT, TRACKER, Damaged, IterationDir, agree_damage,  # noqa: F401 - TRACKER for convert/
                             is_dist_checkpoint, read, read_tracker, resolve_iteration_dir, save, save_synced)
from .optimizer import MixedPrecisionOptimizer

MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"


def mp_rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


class TorchFormat:
    """Megatron's per-rank files of this rank's model chunks (None: the payload holds the model) and optimizer."""

    name = TORCH_FORMAT

    def __init__(self, state: ParallelState, chunks: list | None = None,
                 optimizer: MixedPrecisionOptimizer | None = None) -> None:
        self.state, self.chunks, self.optimizer = state, chunks, optimizer
        params = [p for c in chunks or () for p in c.parameters()] + list(optimizer.params if optimizer else ())
        why = legacy_format_refusal(state.ep_size, state.etp_size, state.tp_size) if has_experts(params) else None
        if why is not None:
            raise UsageError(why)

    def _shard(self) -> tuple[str, int, bool]:
        """(this rank's mp_rank_* folder, how many tp shards name them, whether this rank writes it)."""
        mp_rank, mp_size, writes = self.state.units.checkpoint_shard(self.state)
        return mp_rank_dir_name(mp_rank, self.state.pp_rank, self.state.pp_size), mp_size, writes

    # -- save ---------------------------------------------------------------------------------------------------------
    def write(self, target: IterationDir, payload: dict, rng_state: dict | None, save_optim: bool) -> list[str]:
        opt = self.optimizer
        if opt is not None:
            opt.finish_param_sync()  # the model's tensors hold the last step's weights
        optim_sd = opt.state_dict() if opt is not None and save_optim else None  # collective under ZeRO
        data = dict(payload)
        if rng_state is not None:
            data["rng_state"] = rng_state
        if self.chunks is not None:
            sd = self.state.units.state_dict
            data.update({"model": sd(self.chunks[0])} if len(self.chunks) == 1 else
                        {f"model{i}": sd(c) for i, c in enumerate(self.chunks)})
        return agree(self._write_files, target, data, optim_sd)

    def _write_files(self, target: IterationDir, data: dict, optim_sd: dict | None) -> list[str]:
        mp, _, writes = self._shard()
        if not writes:
            return []
        written = []
        try:
            os.makedirs(os.path.join(target.path, mp), exist_ok=True)
            if optim_sd is not None:
                if self.optimizer.distributed:
                    written.append(os.path.join(mp, DISTRIB_OPTIM_FILE))
                    save_synced({"params": optim_sd.pop("params")}, os.path.join(target.path, written[-1]))
                data["optimizer"] = optim_sd
            written.append(os.path.join(mp, MODEL_FILE))
            save_synced(data, os.path.join(target.path, written[-1]))
        except OSError as exc:
            raise target.failed(exc) from None
        except RuntimeError as exc:  # torch.save's zip writer reports a full disk as a RuntimeError
            if not _disk_error(exc):
                raise
            raise target.failed(exc) from None
        return written

    # -- load ---------------------------------------------------------------------------------------------------------
    def own_files(self, iter_dir: str, load_optim: bool) -> list[str]:
        mp, _, writes = self._shard()
        if not writes:  # another rank reads the same files and verifies them
            return []
        return [os.path.join(mp, MODEL_FILE)] + ([os.path.join(mp, DISTRIB_OPTIM_FILE)] if load_optim else [])

    def read(self, source: IterationDir, load_optim: bool, model_args: dict | None) -> dict:
        """Every rank reads its own files (no collectives until they agree)."""
        return agree_damage(self._read_files, source, load_optim, model_args)

    def _read_files(self, source: IterationDir, load_optim: bool, model_args: dict | None) -> dict:
        state, where, iter_dir = self.state, source.where, source.path
        mp, mp_size, _ = self._shard()
        saved = _saved_layout(iter_dir)
        if saved is not None and saved != (mp_size, state.pp_size) and not _part_of(iter_dir, mp_size, state.pp_size):
            theirs = _saved_strategies(where, iter_dir)
            if state.units.names() is not None or theirs:
                raise _strategies_mismatch(where, theirs, state)
            raise _mismatch(where, saved, state)
        path = os.path.join(iter_dir, mp, MODEL_FILE)
        if not os.path.isfile(path):
            other = _saved_sizes(where, iter_dir, state)  # another layout's checkpoint, or a lost shard?
            if other is not None and other != (state.tp_size, state.pp_size):
                raise _mismatch(where, other, state)
            gone = "" if os.path.isdir(os.path.join(iter_dir, mp)) else f" (its shard directory {mp} is gone)"
            raise Damaged(f"{where}: checkpoint file {path} is missing{gone}", f"{mp}/{MODEL_FILE} is missing")
        payload = _read(where, path)
        theirs = _arg(payload, "unit_strategies")
        if (list(theirs or []) or None) != _strategies(state):
            raise _strategies_mismatch(where, theirs, state)
        if _sizes_of(payload, state) != (state.tp_size, state.pp_size):
            raise _mismatch(where, _sizes_of(payload, state), state)
        if model_args is not None:
            check_model(where, payload, model_args)
        optim_sd = payload.pop("optimizer", None)
        if self.optimizer is not None:
            self._load_optimizer(where, os.path.join(iter_dir, mp), optim_sd, load_optim)
        if self.chunks is not None:
            self._load_model(where, payload)
        return payload

    def _load_optimizer(self, where: str, mp_dir: str, optim_sd: dict | None, load_optim: bool) -> None:
        if not load_optim:
            self.optimizer.reload_model_params()
            return
        if optim_sd is None:
            raise UsageError(f"{where}: {os.path.join(mp_dir, MODEL_FILE)} has no optimizer state; load with "
                             "--no-load-optim")
        distrib = os.path.join(mp_dir, DISTRIB_OPTIM_FILE)
        if os.path.isfile(distrib):
            optim_sd["params"] = _read(where, distrib, "params")["params"]
        try:
            self.optimizer.load_state_dict(optim_sd)
        except ValueError as exc:
            raise UsageError(f"{where}: optimizer state in {mp_dir} does not fit this model: {exc}") from exc

    def _load_model(self, where: str, payload: dict) -> None:
        for i, chunk in enumerate(self.chunks):
            key = "model" if len(self.chunks) == 1 else f"model{i}"
            if key not in payload:
                raise UsageError(f"{where}: checkpoint has no {key!r} (saved with another virtual pipeline size?)")
            try:
                self.state.units.load_state_dict(chunk, payload[key])
            except RuntimeError as exc:
                raise UsageError(f"{where}: {load_error(exc)}") from None


def _disk_error(exc: RuntimeError) -> bool:
    """Is this RuntimeError of torch.save's zip writer a disk error (its own text for a failed write, or the OSError
    it was raised while handling: "unexpected pos" after ENOSPC)?"""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return True
        seen = seen.__cause__ or seen.__context__
    return "PytorchStreamWriter failed writing" in str(exc) or "inline_container" in str(exc)


def _saved_layout(iter_dir: str) -> tuple[int, int] | None:
    """(tp, pp) the checkpoint was saved with, from its mp_rank_* directory names."""
    tps, pps = set(), set()
    for entry in os.listdir(iter_dir):
        fields = entry.split("_")
        if entry.startswith("mp_rank_") and len(fields) in (3, 4) and all(f.isdigit() for f in fields[2:]):
            tps.add(int(fields[2]))
            pps.add(int(fields[3]) if len(fields) == 4 else 0)
    if not tps:
        return None
    return max(tps) + 1, max(pps) + 1


def _part_of(iter_dir: str, mp_size: int, pp_size: int) -> bool:
    """Are the shard directories a part of this run's layout? Then shards may be missing (or the layout differs,
    as the shards' own arguments will tell): each rank's own file decides, not the directory names."""
    present = {e for e in os.listdir(iter_dir) if e.startswith("mp_rank_")}
    return present < {mp_rank_dir_name(t, p, pp_size) for t in range(mp_size) for p in range(pp_size)}


def _arg(payload: dict, key: str, default=None):
    """One of a shard's saved arguments (a dict, or Megatron's argparse Namespace)."""
    args = payload.get("args") or {}
    return args.get(key, default) if isinstance(args, dict) else getattr(args, key, default)


# saved arguments that make another model even where no tensor's shape tells (checked first, named on a mismatch)
ARCHITECTURE = ("model_type", "num_layers", "num_attention_heads", "swiglu", "squared_relu", "normalization",
                "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias",
                "bert_binary_head", "apply_residual_connection_post_layernorm", "orig_vocab_size")


def check_model(where: str, payload: dict, model_args: dict, why: str = "another model") -> None:
    """A checkpoint of another model type or architecture is refused with the first difference named (sizes
    show as a tensor's two shapes instead). `payload`: a checkpoint's, its "args" a dict or Megatron's Namespace."""
    for key in ARCHITECTURE:
        saved = _arg(payload, key)
        if saved is not None and model_args.get(key) is not None and saved != model_args[key]:
            raise UsageError(f"{where}: checkpoint has {key} = {saved!r}, this run {model_args[key]!r} "
                             f"({why})")


def load_error(exc: BaseException, fallback_line: int = 0, unmatched: str = "{}") -> str:
    """One line for weights that do not fit the model (model_misfit), else line `fallback_line` of the message, put
    into `unmatched`."""
    misfit = model_misfit(exc)
    if misfit is not None:
        return misfit
    return unmatched.format((str(exc).strip().splitlines() or [type(exc).__name__])[fallback_line][:300])


def model_misfit(exc: BaseException) -> str | None:
    """From torch's load_state_dict message (torch format) or torch.distributed.checkpoint's (torch_dist): the first
    tensor of another shape with both shapes, else the first missing (or unexpected) tensor; None for any other
    error."""
    import re

    text = str(exc)
    no_tensor = "the checkpoint has no tensor {} (saved from another model or architecture?)"
    dcp_missing = re.search(r"Missing key in checkpoint state_dict: ([^\s.]+(?:\.[^\s]+)?)\.?\s", text + " ")
    if dcp_missing:
        return no_tensor.format(dcp_missing.group(1).rstrip("."))
    sizes = r"torch\.Size\(\[([^\]]*)\]\)"
    torch_size = re.search(rf"size mismatch for (\S+): copying a param with shape {sizes} from checkpoint, the "
                           rf"shape in current model is {sizes}", text)  # (name, saved, current)
    dcp_size = re.search(rf"Size mismatch between saved {sizes} and current: {sizes} for (\S+)", text)
    if torch_size or dcp_size:
        name, saved, mine = torch_size.groups() if torch_size else (dcp_size.group(3).rstrip(","),
                                                                    *dcp_size.groups()[:2])
        shape = lambda s: str(tuple(int(x) for x in s.split(",") if x.strip()))  # noqa: E731
        return f"model tensor {name} has shape {shape(mine)} in this model but {shape(saved)} in the checkpoint"
    torch_missing = re.search(r'Missing key\(s\) in state_dict: "([^"]+)"', text)
    if torch_missing:
        return no_tensor.format(torch_missing.group(1))
    unexpected = re.search(r'Unexpected key\(s\) in state_dict: "([^"]+)"', text)
    if unexpected:
        return (f"the checkpoint has tensor {unexpected.group(1)}, which this model does not (another model or "
                "architecture?)")
    return None


def _sizes_of(payload: dict, state: ParallelState) -> tuple[int, int]:
    """(tp, pp) a shard's saved arguments name (this run's where they say nothing)."""
    return (_arg(payload, "tensor_model_parallel_size", state.tp_size),
            _arg(payload, "pipeline_model_parallel_size", state.pp_size))


def _saved_sizes(where: str, iter_dir: str, state: ParallelState) -> tuple[int, int] | None:
    """(tp, pp) from the first shard present (read in full: only on the error path), None if none is."""
    for entry in sorted(os.listdir(iter_dir)):
        path = os.path.join(iter_dir, entry, MODEL_FILE)
        if entry.startswith("mp_rank_") and os.path.isfile(path):
            return _sizes_of(_read(where, path), state)
    return None


# how a torch checkpoint reaches another layout: torch_dist loads into any (test_dist_checkpoint.py converts so)
_CONVERT = ("to load it into this layout, convert it first: run with the saved layout and --ckpt-convert-format "
            "torch_dist --ckpt-convert-save OUT, then --load OUT/torch_dist")


def _mismatch(where: str, saved: tuple[int, int], state: ParallelState) -> UsageError:
    return UsageError(
        f"{where}: checkpoint was saved with tensor/pipeline parallel sizes ({saved[0]}, {saved[1]}), "
        f"but this run uses ({state.tp_size}, {state.pp_size}); {_CONVERT}"
    )


def _strategies(state: ParallelState) -> list[str] | None:
    return state.units.names()


def _strategies_mismatch(where: str, theirs, state: ParallelState) -> UsageError:
    said = lambda x: ",".join(x) if x else "none (a uniform layout)"  # noqa: E731
    return UsageError(f"{where}: checkpoint was saved with unit strategies {said(theirs)}, but this run "
                      f"uses {said(_strategies(state))}; {_CONVERT}")


def _saved_strategies(where: str, iter_dir: str) -> list[str] | None:
    """The unit strategies a checkpoint was saved with (read from its first file), for a clear mismatch line."""
    for entry in sorted(os.listdir(iter_dir)):
        path = os.path.join(iter_dir, entry, MODEL_FILE)
        if entry.startswith("mp_rank_") and os.path.isfile(path):
            args = _read(where, path).get("args") or {}
            got = args.get("unit_strategies") if isinstance(args, dict) else getattr(args, "unit_strategies", None)
            return list(got) if got else None
    return None


def _read(where: str, path: str, needs: str | None = None) -> dict:
    """A checkpoint file as data (safe_load) that must hold a dict (with key `needs`); anything else is Damaged."""
    try:
        data = load_file(path, where)
    except UsageError as exc:
        raise Damaged(str(exc)) from None
    if not isinstance(data, dict) or (needs is not None and needs not in data):
        what = f"a {type(data).__name__}" if not isinstance(data, dict) else f"a dict without {needs!r}"
        raise Damaged(f"{where}: {path} holds {what}, not a megatron_bmw checkpoint")
    return data


# -- the format on its own (tools, tests) ------------------------------------------------------------------------------
def save_checkpoint(save_dir: str, iteration: int, state: ParallelState, payload: dict,
                    optimizer: MixedPrecisionOptimizer | None = None, save_optim: bool = True) -> str:
    """Save `payload` (with the model in it) and the optimizer's state as `iteration`. Every rank must call it.
    Returns the iteration folder."""
    return save(TorchFormat(state, None, optimizer), state, save_dir, iteration, payload, save_optim=save_optim)


def load_checkpoint(load_dir: str, state: ParallelState, optimizer: MixedPrecisionOptimizer | None = None,
                    load_optim: bool = True, iteration: int | str | None = None,
                    model_args: dict | None = None) -> dict | None:
    """This rank's payload (and the optimizer's state, into `optimizer`), verified; with `model_args` (this run's
    saved arguments) a checkpoint of another architecture is refused first, naming the setting.

    Returns None when `load_dir` has no tracker file and no `iteration` was asked for. Without the optimizer
    state (`load_optim=False`) the optimizer re-reads its master weights from the model at its next step.
    """
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            return None
    source = IterationDir(load_dir, iteration, resolve_iteration_dir(load_dir, iteration))
    if is_dist_checkpoint(source.path):
        raise UsageError(f"--load {load_dir}: {source.path} is a torch_dist checkpoint; this reads the legacy torch "
                         "format (convert it with pretrain_gpt.py --load DIR --ckpt-convert-format torch "
                         "--ckpt-convert-save OUT)")
    return read(TorchFormat(state, None, optimizer), source, load_optim and iteration != RELEASE, model_args)
