"""Run one trial: torchrun on this machine or srun inside a SLURM allocation, output to a log file, killed with
its whole process tree when it outlives its timeout (or when the sweep itself is stopped)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from ..errors import UsageError

ENTRY_MODULE = "megatron_bmw.trials.entry"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass(frozen=True)
class LaunchConfig:
    launcher: str = "torchrun"  # or "srun"
    nproc_per_node: int = 1
    nnodes: int = 1
    python: str = sys.executable
    script: str | None = None  # None: python -m megatron_bmw.trials.entry (pretrain_gpt.py plus memory lines)
    timeout_s: float = 600.0
    grace_s: float = 10.0  # between SIGTERM and SIGKILL
    srun_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.launcher not in ("torchrun", "srun"):
            raise UsageError(f"--launcher must be torchrun or srun, not {self.launcher!r}")
        if self.nproc_per_node < 1 or self.nnodes < 1:
            raise UsageError("--nproc-per-node and --nnodes must be >= 1")
        if self.launcher == "torchrun" and self.nnodes > 1:
            raise UsageError("--launcher torchrun runs on this machine only; use --launcher srun for several nodes")
        if self.timeout_s <= 0:
            raise UsageError(f"--trial-timeout must be > 0, got {self.timeout_s}")

    @property
    def world_size(self) -> int:
        return self.nproc_per_node * self.nnodes


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(cfg: LaunchConfig, argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """(command, environment additions) that run `argv` (pretrain_gpt.py flags) on cfg.world_size ranks.
    torchrun runs standalone: its rendezvous binds a port the system chooses, so two trials never race for one."""
    target = ["-m", ENTRY_MODULE] if cfg.script is None else [cfg.script]
    env = {"PYTHONPATH": os.pathsep.join(x for x in (REPO_ROOT, os.environ.get("PYTHONPATH")) if x)}
    if cfg.launcher == "torchrun":
        cmd = [cfg.python, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
               str(cfg.nproc_per_node), *target]
    else:
        env["MASTER_PORT"] = str(free_port())  # on the first node; srun has no port choice of its own
        cmd = ["srun", "--nodes", str(cfg.nnodes), "--ntasks", str(cfg.world_size), "--ntasks-per-node",
               str(cfg.nproc_per_node), "--kill-on-bad-exit=1", *cfg.srun_args, cfg.python, *target]
    return cmd + list(argv), env


@dataclass
class Outcome:
    exit_code: int | None
    timed_out: bool
    wall_s: float


class Runner:
    """Runs trials one at a time; `stop()` (from a signal handler) kills the one running."""

    def __init__(self, cfg: LaunchConfig) -> None:
        self.cfg = cfg
        self._proc: subprocess.Popen | None = None

    def run(self, argv: list[str], log_path: str) -> Outcome:
        cmd, extra = launch_command(self.cfg, argv)
        env = {**os.environ, **extra}
        t0 = time.time()
        with open(log_path, "wb") as log:
            log.write(("$ " + " ".join(cmd) + "\n").encode())
            log.flush()
            try:
                self._proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True)
            except FileNotFoundError:
                raise UsageError(f"{cmd[0]}: not found (launcher {self.cfg.launcher})") from None
            try:
                code = self._proc.wait(timeout=self.cfg.timeout_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                kill_tree(self._proc, self.cfg.grace_s)
                code, timed_out = self._proc.returncode, True
            finally:
                self._proc = None
        return Outcome(code, timed_out, time.time() - t0)

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            kill_tree(self._proc, min(self.cfg.grace_s, 5.0))


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, from /proc (Linux); empty elsewhere."""
    out: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        out.setdefault(ppid, []).append(int(name))
    return out


def descendants(pid: int) -> list[int]:
    tree, out, todo = _children(), [], [pid]
    while todo:
        for child in tree.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _signal_all(pids: list[int], groups: set[int], sig: int) -> None:
    for pgid in groups:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the launcher's process group and every descendant's (torchrun starts each worker in a session of
    its own), wait `grace_s`, then SIGKILL whatever is left."""
    pids = descendants(proc.pid)
    groups = {proc.pid}
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except ProcessLookupError:
            pass
    _signal_all(pids, groups, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        pass
    pids += [p for p in descendants(proc.pid) if p not in pids]
    _signal_all(pids, groups, signal.SIGKILL)
    proc.wait()
