"""Run a test body on N gloo processes. Each world size is spawned once per test session and reused.

    from tests.dist_harness import run_distributed
    results = run_distributed(4, _body, arg1, arg2)   # _body(rank, world_size, *args) -> value, on every rank

`_body` must be a module-level function (it is pickled by name). torch.distributed is initialised (gloo, on a
file store: no port to race for) in the workers; a failure on any rank raises here with that rank's traceback,
and the next case gets a fresh pool (a failed case may leave a collective half done).
"""

from __future__ import annotations

import atexit
import os
import queue
import shutil
import tempfile
import time
import traceback

import torch.multiprocessing as mp

from tests.tiers import FAST

_POOLS: dict[int, "_Pool"] = {}
DEFAULT_TIMEOUT = float(os.environ.get("MBMW_TEST_TIMEOUT", "300"))
AFTER_FAILURE_S = 20.0  # how long the other ranks may take to report once one rank has failed
CLOSE_S = 5.0  # how long a pool's workers may take to leave once told to
PARENT_POLL_S = 5.0  # an idle worker checks this often whether the test session still exists


def _worker(rank: int, world_size: int, init_file: str, tasks, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    parent = os.getppid()
    while True:
        try:
            task = tasks.get(timeout=PARENT_POLL_S)
        except queue.Empty:
            if os.getppid() != parent:  # the test session is gone without stopping us
                os._exit(0)
            continue
        if task is None:
            break
        fn, args = task
        try:
            value = fn(rank, world_size, *args)
            ok = True
        except BaseException:  # noqa: BLE001 - report everything to the parent
            value, ok = traceback.format_exc(), False
        if not _drop_groups(dist) and ok:
            value, ok = "the task's groups could not be destroyed (a peer is gone)", False
        results.put((rank, ok, value))
    dist.destroy_process_group()


def _drop_groups(dist) -> bool:
    """Destroy the groups a task made (each gloo group keeps threads that wake up on their own); False when a
    peer does not reach the barrier."""
    import gc

    from torch.distributed import distributed_c10d as c10d

    try:
        dist.barrier()  # every rank is done with the task's groups
    except Exception:  # noqa: BLE001
        return False
    for group in [g for g in list(c10d._world.pg_map) if g is not c10d._world.default_pg]:
        dist.destroy_process_group(group)
    gc.collect()
    return True


def _thread_names(rank: int, world_size: int) -> dict[str, int]:
    names: dict[str, int] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
        except OSError:
            continue
        names[name] = names.get(name, 0) + 1
    return names


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.store_dir = tempfile.mkdtemp(prefix=f"mbmw-pool{world_size}-")
        init_file = os.path.join(self.store_dir, "store")
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, self.tasks[r], self.results), daemon=True)
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()
        self.broken = False

    def run(self, fn, args, timeout: float):
        for q in self.tasks:
            q.put((fn, args))
        out: dict[int, object] = {}
        errors = []
        while len(out) + len(errors) < self.world_size:
            try:
                rank, ok, value = self.results.get(timeout=min(timeout, AFTER_FAILURE_S) if errors else timeout)
            except queue.Empty:
                self.broken = True
                if errors:
                    break
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise TimeoutError(f"{fn.__name__} on {self.world_size} ranks timed out after {timeout}s (dead ranks: {dead})")
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
        if errors:
            self.broken = True
            rank, tb = sorted(errors)[0]
            raise AssertionError(f"{fn.__name__} failed on rank {rank}/{self.world_size}:\n{tb}")
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        if not self.broken:
            for q in self.tasks:
                q.put(None)
            deadline = time.monotonic() + CLOSE_S
            for p in self.procs:
                p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)
        shutil.rmtree(self.store_dir, ignore_errors=True)


def run_distributed(world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT) -> list:
    if FAST:
        raise RuntimeError(f"{fn.__name__} starts {world_size} processes: mark its test @pytest.mark.slow")
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool.run(fn, args, timeout)


def worker_threads() -> dict[int, dict[str, int]]:
    """Thread names and counts of rank 0 of each live pool, by world size."""
    return {ws: run_distributed(ws, _thread_names)[0] for ws, pool in sorted(_POOLS.items()) if not pool.broken}


@atexit.register
def shutdown_pools() -> None:
    """Stop every pool's workers (a later run_distributed spawns afresh)."""
    while _POOLS:
        _POOLS.popitem()[1].close()
