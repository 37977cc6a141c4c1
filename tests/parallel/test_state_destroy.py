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


def _expert_groups(rank, world_size, cfgs):
    out = []
    for cfg in cfgs:
        before = _groups()
        st = ParallelState.build(cfg)
        made = _groups() - before
        ranks = {name: (dist.get_process_group_ranks(g) if g is not None else [rank])
                 for name in ("ep_group", "etp_group", "edp_group", "etp_ep_group")
                 for g in [getattr(st, name)]}
        out.append((made, ranks, st.ep_ranks, (st.etp_rank, st.ep_rank, st.edp_rank),
                    (st.etp_size, st.ep_size, st.edp_size), st.etp_group is st.tp_group))
        st.destroy()
    return out


@pytest.mark.slow
def test_expert_groups_built_from_the_layout():
    cfgs = [ParallelConfig(tensor_model_parallel_size=2),  # dense defaults: etp = tp, ep 1: no new group
            ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=4,
                           expert_tensor_parallel_size=1),
            ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2),
            ParallelConfig(pipeline_model_parallel_size=2, expert_model_parallel_size=2)]
    results = run_distributed(4, _expert_groups, cfgs)
    dense, ep4, ep2tp2, ep2pp2 = zip(*results)
    assert [d[0] for d in dense] == [3] * 4  # tp, dp and mp only; etp is tp, edp is dp
    assert all(d[5] for d in dense)
    for rank, (_, ranks, ep_ranks, coords, sizes, _) in enumerate(ep4):
        assert ranks["ep_group"] == [0, 1, 2, 3] == list(ep_ranks) and ranks["edp_group"] == [rank]
        assert coords == (0, rank, 0) and sizes == (1, 4, 1)
    for rank, (_, ranks, ep_ranks, coords, sizes, same) in enumerate(ep2tp2):
        assert ranks["etp_group"] == [rank - rank % 2, rank - rank % 2 + 1] and same
        assert ranks["ep_group"] == [rank % 2, rank % 2 + 2] == list(ep_ranks)
        assert ranks["etp_ep_group"] == [0, 1, 2, 3] and coords == (rank % 2, rank // 2, 0)
    for rank, (_, ranks, ep_ranks, coords, sizes, _) in enumerate(ep2pp2):
        assert ranks["ep_group"] == [rank - rank % 2, rank - rank % 2 + 1] and sizes == (1, 2, 1)
