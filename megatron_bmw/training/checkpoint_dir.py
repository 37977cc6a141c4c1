"""Megatron's checkpoint directory, the same for every format: the tracker, the iteration folders, the atomic save
and the verified read. A format (`torch`: checkpointing.TorchFormat; `torch_dist`: dist_checkpoint.DistFormat)
writes and reads one iteration's files; everything around them is here, once.

    <dir>/latest_checkpointed_iteration.txt        the iteration number (or "release")
    <dir>/iter_0000010/...                         the format's files
    <dir>/iter_0000010/.../checksums.json          size and digest of the files beside it (checksums.py)

`save`: every file goes into `iter_XXXXXXX.tmp-<token>` first; once every rank has written and hashed its files
(parallel/agree.py: a full disk on any rank stops all of them, the temporary folder removed), rank 0 writes a
checksums.json into each folder that holds some (`torch`: each mp_rank_* folder, so the iteration folder still
holds only those; `torch_dist`: the iteration folder), renames the folder into place and then replaces the tracker,
so a crash at any point leaves the previous checkpoint and tracker intact. Re-saving an existing iteration moves the
old folder to `iter_XXXXXXX.old-<token>` for the instant of the swap; loading falls back to it if the swap was cut
short. The next successful save removes what crashed saves left; every published iteration is kept (as Megatron).

`read`: the files each rank is to read are compared with their checksums.json first (a checkpoint without, older or
Megatron-LM's, loads unverified); a file that differs, or that cannot be read, is `Damaged`, which every rank
raises together, so the caller may try an earlier iteration (training/checkpointer.py, --load-fallback).
"""

from __future__ import annotations

import glob
import os
import re
import shutil
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from ..errors import RunError, UsageError
from ..parallel.agree import agree
from ..parallel.state import ParallelState
from . import checksums

TRACKER = "latest_checkpointed_iteration.txt"
RELEASE = "release"
TORCH_FORMAT = "torch"
DIST_FORMAT = "torch_dist"
DIST_METADATA_FILE = ".metadata"  # torch.distributed.checkpoint's index: what marks a torch_dist iteration
_ITERATION = re.compile(r"iter_(\d{7})")


class Damaged(UsageError):
    """A checkpoint file that is not as it was saved (its checksum or size differs, it is missing, truncated or
    refused): one line, plus `detail` (the file and why) for --load-fallback's line."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail or message.split(": ", 1)[-1]


@dataclass(frozen=True)
class IterationDir:
    """One iteration of the checkpoint directory `root` (--save or --load), whose files are in `path` (a temporary
    folder while it is being saved)."""

    root: str
    iteration: int | str
    path: str

    @property
    def where(self) -> str:
        """How a load's error lines begin."""
        return f"--load {self.root}"

    def failed(self, exc: BaseException) -> RunError:
        """The one line for a save whose files could not be written (`exc`: the disk's error, or what carried it)."""
        cause = _os_error(exc) or exc
        why = getattr(cause, "strerror", None) or (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        return RunError(f"--save {self.root}: cannot write the checkpoint of iteration {self.iteration} ({why}); "
                        "the previous checkpoint is kept")


class CheckpointFormat(Protocol):
    """How one format writes and reads an iteration's files, for one rank's model chunks and optimizer."""

    name: str

    def write(self, target: IterationDir, payload: dict, rng_state: dict | None, save_optim: bool) -> list[str]:
        """Write into target.path (collective; a failed write raises target.failed(...) on every rank, agreed); the
        files this rank wrote, relative to target.path."""

    def own_files(self, iter_dir: str, load_optim: bool) -> list[str]:
        """The files this rank verifies before `read` (relative to iter_dir): the ones it reads, each by one rank
        where several ranks read it."""

    def read(self, source: IterationDir, load_optim: bool, model_args: dict | None) -> dict:
        """Load source.path into the model and the optimizer (collective; a damaged file raises Damaged on every
        rank); the payload."""


# -- names and the tracker -------------------------------------------------------------------------------------------
def iteration_dir_name(iteration: int | str) -> str:
    return RELEASE if iteration == RELEASE else f"iter_{int(iteration):07d}"


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
        if entry in (DIST_METADATA_FILE, "model_optim_rng.pt") or \
                (entry.startswith("mp_rank_") and os.path.isdir(os.path.join(path, entry))):
            return entry
    return None


def is_dist_checkpoint(iter_dir: str) -> bool:
    """torch_dist iterations hold a .metadata file: how --load tells the formats apart without importing
    torch.distributed.checkpoint."""
    return os.path.isfile(os.path.join(iter_dir, DIST_METADATA_FILE))


def format_of(root: str, iter_dir: str) -> str:
    """The format an iteration folder was saved in, from its file names."""
    if is_dist_checkpoint(iter_dir):
        return DIST_FORMAT
    if os.path.isdir(iter_dir) and not any(e.startswith("mp_rank_") for e in os.listdir(iter_dir)):
        shards = sorted(e for e in os.listdir(iter_dir) if e.endswith(".distcp"))
        if shards:
            raise Damaged(f"--load {root}: {iter_dir} holds torch_dist shards ({shards[0]}, ...) but no "
                          f"{DIST_METADATA_FILE} (an incomplete copy?)", f"{DIST_METADATA_FILE} is missing")
    return TORCH_FORMAT


def resolve_iteration_dir(load_dir: str, iteration: int | str) -> str:
    path = os.path.join(load_dir, iteration_dir_name(iteration))
    if os.path.isdir(path):
        return path
    backups = sorted(glob.glob(f"{path}.old-*"), key=os.path.getmtime)
    if backups:
        return backups[-1]  # a re-save of this iteration was cut short between its two renames
    raise Damaged(f"--load {load_dir}: the tracker names iteration {iteration}, but {path} does not exist",
                  "its folder does not exist")


def earlier_iterations(load_dir: str, before: int | str) -> list[int]:
    """The saved iterations before `before`, latest first (none before a release)."""
    if before == RELEASE or not os.path.isdir(load_dir):
        return []
    found = (_ITERATION.fullmatch(e) for e in os.listdir(load_dir))
    return sorted((int(m.group(1)) for m in found if m and int(m.group(1)) < int(before)), reverse=True)


# -- the atomic save ---------------------------------------------------------------------------------------------------
def save(fmt: CheckpointFormat, state: ParallelState, save_dir: str, iteration: int | str, payload: dict,
         rng_state: dict | None = None, save_optim: bool = True) -> str:
    """Save `iteration` in `fmt` (every rank calls it): the format's files, checksums.json, the rename, the tracker.
    Returns the iteration folder."""
    token = _shared_token(state)
    name = iteration_dir_name(iteration)
    target = IterationDir(save_dir, iteration, os.path.join(save_dir, f"{name}.tmp-{token}"))
    rank = world()[0]
    try:
        written = fmt.write(target, payload, rng_state, save_optim)
        digests = gather_first(agree(_digests, target, written))
        agree(_publish, target, os.path.join(save_dir, name), token, digests)
    except BaseException:
        if rank == 0:
            shutil.rmtree(target.path, ignore_errors=True)
        raise
    return os.path.join(save_dir, name)


def _digests(target: IterationDir, written: list[str]) -> dict[str, dict]:
    """This rank's files' sizes and digests (read back from the page cache, in which they still are)."""
    try:
        return {rel: checksums.digest(os.path.join(target.path, rel)) for rel in written}
    except OSError as exc:
        raise target.failed(exc) from None


def _publish(target: IterationDir, final_dir: str, token: str, digests: list[dict] | None) -> None:
    """Rank 0: each folder's checksums.json, then the iteration folder into place, then the tracker."""
    if world()[0] != 0:
        return
    folders: dict[str, dict] = {}
    for per_rank in digests:
        for rel, d in per_rank.items():
            folders.setdefault(os.path.dirname(rel), {})[os.path.basename(rel)] = d
    try:
        for folder, entries in folders.items():
            checksums.record(os.path.join(target.path, folder), entries)
        _fsync_dir(target.path)
        move_into_place(target.path, final_dir, token)
        _write_tracker(target.root, target.iteration, token)
    except OSError as exc:
        raise target.failed(exc) from None
    clear_debris(target.root)


def save_synced(obj, path: str) -> None:
    """torch.save, then fsync: the file's bytes are on disk before the rename publishes them."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def clear_debris(save_dir: str) -> None:
    """Remove what crashed saves left (rank 0, after publishing a checkpoint)."""
    for pattern in ("iter_*.tmp-*", "iter_*.old-*", "release.tmp-*", "release.old-*"):
        for debris in glob.glob(os.path.join(save_dir, pattern)):
            shutil.rmtree(debris, ignore_errors=True)


def move_into_place(tmp_dir: str, final_dir: str, token: str) -> None:
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


def _os_error(exc: BaseException) -> OSError | None:
    seen = exc
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


# -- the verified read -----------------------------------------------------------------------------------------------
def read(fmt: CheckpointFormat, source: IterationDir, load_optim: bool = True, model_args: dict | None = None) -> dict:
    """`fmt.read` of `source` once every rank has compared its files with checksums.json."""
    agree_damage(verify, fmt, source, load_optim)
    return fmt.read(source, load_optim, model_args)


def verify(fmt: CheckpointFormat, source: IterationDir, load_optim: bool = True) -> None:
    """Compare this rank's files with their folders' checksums.json (no collectives); a difference is Damaged."""
    saved: dict[str, dict | None] = {}
    for rel in fmt.own_files(source.path, load_optim):
        folder, name = os.path.split(rel)
        if folder not in saved:
            try:
                saved[folder] = checksums.recorded(os.path.join(source.path, folder))
            except ValueError as exc:
                sums = os.path.join(folder, checksums.FILE)
                raise Damaged(f"{source.where}: cannot read {os.path.join(source.path, sums)} ({exc})",
                              f"{sums}: {exc}") from None
        entry = (saved[folder] or {}).get(name)
        why = None if entry is None else checksums.differs(os.path.join(source.path, rel), entry)
        if why is not None:
            raise Damaged(f"{source.where}: {os.path.join(source.path, rel)} is damaged ({why})", f"{rel}: {why}")


def agree_damage(fn, *args):
    """agree(fn, *args), except that a Damaged on any rank raises that Damaged (the lowest rank's) on every rank,
    unprinted: the caller decides (an earlier iteration, or the error)."""

    def run():
        try:
            return fn(*args), None
        except Damaged as exc:
            if world()[1] == 1:
                raise
            return None, (world()[0], str(exc), exc.detail)

    result, damage = agree(run)
    if world()[1] > 1:
        every: list = [None] * world()[1]
        dist.all_gather_object(every, damage)
        damage = next((d for d in every if d is not None), None)
    if damage is not None:
        raise _AgreedDamage(*damage)
    return result


class _AgreedDamage(Damaged):
    """Damaged as every rank raises it: `rank` found it (and prints it, if it stops the run)."""

    def __init__(self, rank: int, message: str, detail: str) -> None:
        super().__init__(message, detail)
        self.rank = rank


# -- ranks -----------------------------------------------------------------------------------------------------------
def world() -> tuple[int, int]:
    """(this rank, the world size); (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shared_token(state: ParallelState) -> str:
    """A random name part every rank agrees on."""
    value = torch.tensor([int.from_bytes(os.urandom(7), "little")], dtype=torch.int64)
    if world()[1] > 1:
        value = value.to(state.device)
        dist.broadcast(value, src=0)
    return f"{int(value.item()):016x}"


def gather_first(obj) -> list | None:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    rank, size = world()
    if size == 1:
        return [obj]
    out = [None] * size if rank == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out
