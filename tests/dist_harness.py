"""Run a test body on N gloo processes. Each world size is spawned once per test session and reused.

    from tests.dist_harness import run_distributed
    results = run_distributed(4, _body, arg1, arg2)   # _body(rank, world_size, *args) -> value, on every rank

`_body` must be a module-level function (it is pickled by name). torch.distributed is initialised (gloo)
in the workers; a failure on any rank raises here with that rank's traceback.
"""

from __future__ import annotations

import atexit
import os
import queue
import traceback

import torch.multiprocessing as mp

from megatron_bmw.device import free_port

_POOLS: dict[int, "_Pool"] = {}
DEFAULT_TIMEOUT = float(os.environ.get("MBMW_TEST_TIMEOUT", "300"))


def _worker(rank: int, world_size: int, port: int, tasks, results) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        try:
            results.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - report everything to the parent
            results.put((rank, False, traceback.format_exc()))
        _drop_groups(dist)
    dist.destroy_process_group()


def _drop_groups(dist) -> None:
    """Destroy the groups a task made: each gloo group keeps threads that wake up on their own, and hundreds of
    them left in a long-lived worker load a 2-core machine for the rest of the session."""
    import gc

    from torch.distributed import distributed_c10d as c10d

    try:
        dist.barrier()  # every rank is done with the task's groups
    except Exception:  # noqa: BLE001 - a broken task: the parent reports it
        return
    for group in [g for g in list(c10d._world.pg_map) if g is not c10d._world.default_pg]:
        dist.destroy_process_group(group)
    gc.collect()


class _Pool:
    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.results = ctx.Queue()
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(target=_worker, args=(r, world_size, port, self.tasks[r], self.results), daemon=True)
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
                rank, ok, value = self.results.get(timeout=timeout)
            except queue.Empty:
                self.broken = True
                dead = [r for r, p in enumerate(self.procs) if not p.is_alive()]
                raise TimeoutError(f"{fn.__name__} on {self.world_size} ranks timed out after {timeout}s (dead ranks: {dead})")
            if ok:
                out[rank] = value
            else:
                errors.append((rank, value))
        if errors:
            rank, tb = sorted(errors)[0]
            raise AssertionError(f"{fn.__name__} failed on rank {rank}/{self.world_size}:\n{tb}")
        return [out[r] for r in range(self.world_size)]

    def close(self) -> None:
        for q in self.tasks:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()


def run_distributed(world_size: int, fn, *args, timeout: float = DEFAULT_TIMEOUT) -> list:
    pool = _POOLS.get(world_size)
    if pool is None or pool.broken:
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool.run(fn, args, timeout)


@atexit.register
def _shutdown() -> None:
    for pool in _POOLS.values():
        pool.close()
