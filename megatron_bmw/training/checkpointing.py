"""Checkpoints in Megatron's directory layout, written atomically.

    <dir>/latest_checkpointed_iteration.txt        the iteration number (or "release")
    <dir>/iter_0000010/mp_rank_TT[_PPP]/model_optim_rng.pt    payload + optimizer state
    <dir>/iter_0000010/mp_rank_TT[_PPP]/distrib_optim.pt      per-parameter optimizer state (ZeRO-1 only)

DP rank 0 of each (tp, pp) writes. Everything goes into `iter_XXXXXXX.tmp-<token>` first; once every rank
has written (parallel/agree.py: a full disk on any rank stops all of them, the temporary directory removed)
rank 0 renames it into place and then replaces the tracker file, so a crash at any point leaves the
previous checkpoint and tracker intact. Re-saving an existing iteration moves the old directory to
`iter_XXXXXXX.old-<token>` for the instant of the swap; loading falls back to it if the swap was cut short.
"""

from __future__ import annotations

import glob
import os
import shutil

import torch
import torch.distributed as dist

from ..errors import Reported, RunError, UsageError
from ..parallel.agree import agree
from ..parallel.state import ParallelState
from .optimizer import MixedPrecisionOptimizer

TRACKER = "latest_checkpointed_iteration.txt"
DIST_FORMAT = "torch_dist"
DIST_METADATA_FILE = ".metadata"
MODEL_FILE = "model_optim_rng.pt"
DISTRIB_OPTIM_FILE = "distrib_optim.pt"
RELEASE = "release"


def iteration_dir_name(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


def mp_rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int) -> str:
    return f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"


def _mp_coords(state: ParallelState) -> tuple[int, int, bool]:
    """(rank, size) naming the mp_rank_* directory, and whether this rank writes one (parallel/placement.py)."""
    return state.units.checkpoint_shard(state)


def checkpoint_file(ckpt_dir: str, iteration: int | str, state: ParallelState, name: str = MODEL_FILE) -> str:
    """Where this rank's (tp, pp) file of `iteration` lives."""
    mp = mp_rank_dir_name(_mp_coords(state)[0], state.pp_rank, state.pp_size)
    return os.path.join(ckpt_dir, iteration_dir_name(iteration), mp, name)


def read_tracker(ckpt_dir: str) -> int | str | None:
    """The iteration the tracker names, "release", or None when there is no tracker file."""
    path = os.path.join(ckpt_dir, TRACKER)
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", errors="replace").strip()
    if text == RELEASE:
        return RELEASE
    try:
        return int(text)
    except ValueError:
        raise UsageError(f"--load {ckpt_dir}: {TRACKER} holds {text!r}, not an iteration number or 'release'") from None


def inside_checkpoint(path: str) -> str | None:
    """What marks `path` as a folder inside a checkpoint (an iteration's shard folders or torch_dist metadata, a
    shard's file), or None."""
    if not os.path.isdir(path):
        return None
    for entry in sorted(os.listdir(path)):
        if entry in (DIST_METADATA_FILE, MODEL_FILE) or \
                (entry.startswith("mp_rank_") and os.path.isdir(os.path.join(path, entry))):
            return entry
    return None


def is_dist_checkpoint(iter_dir: str) -> bool:
    """DCP directories (training/dist_checkpoint.py's torch_dist format) hold a .metadata file: how --load tells the
    formats apart without importing torch.distributed.checkpoint."""
    return os.path.isfile(os.path.join(iter_dir, DIST_METADATA_FILE))


def checkpoint_format(load_dir: str) -> str | None:
    """'torch_dist' or 'torch' for the checkpoint the tracker names; None without a tracker."""
    iteration = read_tracker(load_dir)
    if iteration is None:
        return None
    iter_dir = _resolve_iteration_dir(load_dir, iteration)
    if is_dist_checkpoint(iter_dir):
        return DIST_FORMAT
    if os.path.isdir(iter_dir) and not any(e.startswith("mp_rank_") for e in os.listdir(iter_dir)):
        shards = sorted(e for e in os.listdir(iter_dir) if e.endswith(".distcp"))
        if shards:
            raise UsageError(f"--load {load_dir}: {iter_dir} holds torch_dist shards ({shards[0]}, ...) but no "
                             f"{DIST_METADATA_FILE} (an incomplete copy?)")
    return "torch"


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shared_token(state: ParallelState) -> str:
    """A random name part every rank agrees on."""
    value = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64)
    if _world()[1] > 1:
        value = value.to(state.device)
        dist.broadcast(value, src=0)
    return f"{int(value.item()):016x}"


def save_checkpoint(
    save_dir: str,
    iteration: int,
    state: ParallelState,
    payload: dict,
    optimizer: MixedPrecisionOptimizer | None = None,
    save_optim: bool = True,
) -> str:
    """Save `payload` (+ the optimizer's state) as `iteration`. Every rank must call it. Returns the iteration dir."""
    if optimizer is not None:
        optimizer.finish_param_sync()  # the model's tensors in `payload` hold the last step's weights
    optim_sd = optimizer.state_dict() if optimizer is not None and save_optim else None  # collective under ZeRO
    token = _shared_token(state)
    name = iteration_dir_name(iteration)
    tmp_dir = os.path.join(save_dir, f"{name}.tmp-{token}")
    final_dir = os.path.join(save_dir, name)
    rank = _world()[0]

    def failed(exc: Exception) -> RunError:
        why = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return RunError(f"--save {save_dir}: cannot write the checkpoint of iteration {iteration} "
                        f"({why}); the previous checkpoint is kept")

    mp_rank, _, writes = _mp_coords(state)

    def write() -> None:
        if not writes:
            return
        try:
            mp_dir = os.path.join(tmp_dir, mp_rank_dir_name(mp_rank, state.pp_rank, state.pp_size))
            os.makedirs(mp_dir, exist_ok=True)
            data = dict(payload)
            if optim_sd is not None:
                if optimizer.distributed:
                    _save_synced({"params": optim_sd.pop("params")}, os.path.join(mp_dir, DISTRIB_OPTIM_FILE))
                data["optimizer"] = optim_sd
            _save_synced(data, os.path.join(mp_dir, MODEL_FILE))
        except OSError as exc:
            raise failed(exc) from None
        except RuntimeError as exc:  # torch.save's zip writer reports a full disk as a RuntimeError
            cause = _write_error(exc)
            if cause is None:
                raise
            raise failed(cause) from None

    def publish() -> None:
        if rank != 0:
            return
        try:
            _move_into_place(tmp_dir, final_dir, token)
            _write_tracker(save_dir, iteration, token)
        except OSError as exc:
            raise failed(exc) from None
        clear_debris(save_dir)

    try:  # the agreements stand in for barriers: a full disk on any rank stops every rank with its line
        agree(write)
        agree(publish)
    except (Reported, RunError):
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return final_dir


def _write_error(exc: RuntimeError) -> BaseException | None:
    """The disk error behind a RuntimeError of torch.save's zip writer (its own text for a failed write, or the
    OSError it was raised while handling: "unexpected pos" after ENOSPC), else None."""
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    text = str(exc)
    return exc if "PytorchStreamWriter failed writing" in text or "inline_container" in text else None


def clear_debris(save_dir: str) -> None:
    """Remove what crashed saves left (rank 0, after publishing a checkpoint)."""
    for pattern in ("iter_*.tmp-*", "iter_*.old-*", "release.tmp-*", "release.old-*"):
        for debris in glob.glob(os.path.join(save_dir, pattern)):
            shutil.rmtree(debris, ignore_errors=True)


def _save_synced(obj, path: str) -> None:
    """torch.save, then fsync: the file's bytes are on disk before the rename publishes them."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _move_into_place(tmp_dir: str, final_dir: str, token: str) -> None:
    if os.path.exists(final_dir):
        backup = f"{final_dir}.old-{token}"
        os.rename(final_dir, backup)
        os.rename(tmp_dir, final_dir)
        shutil.rmtree(backup)
    else:
        os.rename(tmp_dir, final_dir)
    _fsync_dir(os.path.dirname(final_dir))


def _write_tracker(save_dir: str, iteration: int | str, token: str) -> None:
    tmp = os.path.join(save_dir, f"{TRACKER}.tmp-{token}")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save_dir, TRACKER))
    _fsync_dir(save_dir)


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _resolve_iteration_dir(load_dir: str, iteration: int | str) -> str:
    path = os.path.join(load_dir, iteration_dir_name(iteration))
    if os.path.isdir(path):
        return path
    backups = sorted(glob.glob(f"{path}.old-*"), key=os.path.getmtime)
    if backups:
        return backups[-1]  # a re-save of this iteration was cut short between its two renames
    raise UsageError(f"--load {load_dir}: the tracker names iteration {iteration}, but {path} does not exist")


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
ARCHITECTURE = ("model_type", "num_layers", "num_attention_heads", "swiglu", "normalization",
                "position_embedding_type", "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias",
                "bert_binary_head", "apply_residual_connection_post_layernorm", "orig_vocab_size")


def check_model(load_dir: str, payload: dict, model_args: dict, why: str = "another model") -> None:
    """A checkpoint of another model type or architecture is refused with the first difference named (sizes
    show as a tensor's two shapes instead). `payload`: a checkpoint's, its "args" a dict or Megatron's Namespace."""
    for key in ARCHITECTURE:
        saved = _arg(payload, key)
        if saved is not None and model_args.get(key) is not None and saved != model_args[key]:
            raise UsageError(f"--load {load_dir}: checkpoint has {key} = {saved!r}, this run {model_args[key]!r} "
                             f"({why})")


def load_error(exc: BaseException, fallback_line: int = 0, unmatched: str = "{}") -> str:
    """One line for weights that do not fit the model, from torch's load_state_dict message (torch format) or
    torch.distributed.checkpoint's (torch_dist): the first tensor of another shape with both shapes, else the first
    missing (or unexpected) tensor, else line `fallback_line` of the message, put into `unmatched`."""
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
    return unmatched.format((text.strip().splitlines() or [type(exc).__name__])[fallback_line][:300])


def _sizes_of(payload: dict, state: ParallelState) -> tuple[int, int]:
    """(tp, pp) a shard's saved arguments name (this run's where they say nothing)."""
    return (_arg(payload, "tensor_model_parallel_size", state.tp_size),
            _arg(payload, "pipeline_model_parallel_size", state.pp_size))


def _saved_sizes(load_dir: str, iter_dir: str, state: ParallelState) -> tuple[int, int] | None:
    """(tp, pp) from the first shard present (read in full: only on the error path), None if none is."""
    for entry in sorted(os.listdir(iter_dir)):
        path = os.path.join(iter_dir, entry, MODEL_FILE)
        if entry.startswith("mp_rank_") and os.path.isfile(path):
            return _sizes_of(_read(load_dir, path), state)
    return None


def _mismatch(load_dir: str, saved: tuple[int, int], state: ParallelState) -> UsageError:
    return UsageError(
        f"--load {load_dir}: checkpoint was saved with tensor/pipeline parallel sizes ({saved[0]}, {saved[1]}), "
        f"but this run uses ({state.tp_size}, {state.pp_size})"
    )


def _strategies(state: ParallelState) -> list[str] | None:
    return state.units.names()


def _strategies_mismatch(load_dir: str, theirs, state: ParallelState) -> UsageError:
    said = lambda x: ",".join(x) if x else "none (a uniform layout)"  # noqa: E731
    return UsageError(f"--load {load_dir}: checkpoint was saved with unit strategies {said(theirs)}, but this run "
                      f"uses {said(_strategies(state))} (a hybrid checkpoint loads only into the same plan)")


def _saved_strategies(load_dir: str, iter_dir: str) -> list[str] | None:
    """The unit strategies a checkpoint was saved with (read from its first file), for a clear mismatch line."""
    for entry in sorted(os.listdir(iter_dir)):
        path = os.path.join(iter_dir, entry, MODEL_FILE)
        if entry.startswith("mp_rank_") and os.path.isfile(path):
            args = _read(load_dir, path).get("args") or {}
            got = args.get("unit_strategies") if isinstance(args, dict) else getattr(args, "unit_strategies", None)
            return list(got) if got else None
    return None


def _read(load_dir: str, path: str, needs: str | None = None) -> dict:
    """torch.load a checkpoint file that must hold a dict (with key `needs`); anything else is one error line."""
    try:
        data = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
        reason = (str(exc).strip().splitlines() or [""])[0]
        raise UsageError(f"--load {load_dir}: cannot read {path} (truncated or not a checkpoint: "
                         f"{type(exc).__name__}: {reason})") from None
    if not isinstance(data, dict) or (needs is not None and needs not in data):
        what = f"a {type(data).__name__}" if not isinstance(data, dict) else f"a dict without {needs!r}"
        raise UsageError(f"--load {load_dir}: {path} holds {what}, not a megatron_bmw checkpoint")
    return data


def load_checkpoint(
    load_dir: str,
    state: ParallelState,
    optimizer: MixedPrecisionOptimizer | None = None,
    load_optim: bool = True,
    iteration: int | str | None = None,
    model_args: dict | None = None,
) -> dict | None:
    """Load this rank's payload (and the optimizer's state into `optimizer`); with `model_args` (this run's saved
    arguments) a checkpoint of another architecture is refused first, naming the setting.

    Returns None when `load_dir` has no tracker file and no `iteration` was asked for. Without the optimizer
    state (`load_optim=False`) the optimizer re-reads its master weights from the model at its next step.
    """
    if iteration is None:
        iteration = read_tracker(load_dir)
        if iteration is None:
            return None
    iter_dir = _resolve_iteration_dir(load_dir, iteration)
    if is_dist_checkpoint(iter_dir):
        raise UsageError(f"--load {load_dir}: {iter_dir} is a torch_dist checkpoint; this reads the legacy torch "
                         "format (convert it with pretrain_gpt.py --load DIR --ckpt-convert-format torch "
                         "--ckpt-convert-save OUT)")
    mp_rank, mp_size, _ = _mp_coords(state)
    saved = _saved_layout(iter_dir)
    if saved is not None and saved != (mp_size, state.pp_size) and not _part_of(iter_dir, mp_size, state.pp_size):
        theirs = _saved_strategies(load_dir, iter_dir)
        if state.units.names() is not None or theirs:
            raise _strategies_mismatch(load_dir, theirs, state)
        raise _mismatch(load_dir, saved, state)
    mp_dir = os.path.join(iter_dir, mp_rank_dir_name(mp_rank, state.pp_rank, state.pp_size))
    path = os.path.join(mp_dir, MODEL_FILE)
    if not os.path.isfile(path):
        other = _saved_sizes(load_dir, iter_dir, state)  # another layout's checkpoint, or a lost shard?
        if other is not None and other != (state.tp_size, state.pp_size):
            raise _mismatch(load_dir, other, state)
        gone = "" if os.path.isdir(mp_dir) else f" (its shard directory {os.path.basename(mp_dir)} is gone)"
        raise UsageError(f"--load {load_dir}: checkpoint file {path} is missing{gone}")
    payload = _read(load_dir, path)
    saved_args = _sizes_of(payload, state)
    theirs = _arg(payload, "unit_strategies")
    if (list(theirs or []) or None) != _strategies(state):
        raise _strategies_mismatch(load_dir, theirs, state)
    if saved_args != (state.tp_size, state.pp_size):
        raise _mismatch(load_dir, saved_args, state)
    if model_args is not None:
        check_model(load_dir, payload, model_args)
    optim_sd = payload.pop("optimizer", None)
    if optimizer is None:
        return payload
    if not load_optim or iteration == RELEASE:
        optimizer.reload_model_params()
        return payload
    if optim_sd is None:
        raise UsageError(f"--load {load_dir}: {path} has no optimizer state; load with --no-load-optim")
    distrib = os.path.join(mp_dir, DISTRIB_OPTIM_FILE)
    if os.path.isfile(distrib):
        optim_sd["params"] = _read(load_dir, distrib, "params")["params"]
    try:
        optimizer.load_state_dict(optim_sd)
    except ValueError as exc:
        raise UsageError(f"--load {load_dir}: optimizer state in {mp_dir} does not fit this model: {exc}") from exc
    return payload
