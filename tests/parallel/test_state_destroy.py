import pytest
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from megatron_bmw.config import ParallelConfig
from megatron_bmw.parallel.state import ParallelState
from tests.dist_harness import run_distributed


def _groups() -> int:
    return sum(1 for g in c10d._world.pg_map if g is not c10d._world.default_pg)


def _build_destroy(rank, world_size, cfg):
    before = _groups()
    st = ParallelState.build(cfg, num_units=6)
    made = _groups() - before
    st.destroy()
    st.destroy()  # idempotent
    dist.barrier()  # the default group is the caller's and still works
    return made, len(st.owned_groups), _groups() - before


@pytest.mark.slow
@pytest.mark.parametrize("cfg", [
    ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
    ParallelConfig(pipeline_model_parallel_size=4),
    ParallelConfig(unit_strategies=("tp2-dp2",) * 6),
], ids=["tp2-pp2", "pp4", "hybrid"])
def test_destroy_ends_every_group_build_made(cfg):
    for made, owned, left in run_distributed(4, _build_destroy, cfg):
        assert made > 0 and owned == 0 and left == 0


def test_serial_state_destroys_nothing():
    st = ParallelState.serial()
    st.destroy()
    assert st.owned_groups == []
