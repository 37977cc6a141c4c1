import pytest

from megatron_bmw.config import ParallelConfig
from megatron_bmw.errors import UsageError
from megatron_bmw.parallel.layout import RankLayout, pair_adjacent_slot


@pytest.mark.parametrize("order", ["tp-dp-pp", "bpipe"])
@pytest.mark.parametrize("tp,dp,pp", [(1, 1, 1), (2, 2, 2), (2, 1, 4), (1, 3, 6), (4, 2, 1), (2, 2, 5)])
def test_rank_coords_round_trip(order, tp, dp, pp):
    layout = RankLayout(tp, dp, pp, order)
    seen = set()
    for r in range(layout.world_size):
        c = layout.coords(r)
        assert layout.rank(*c) == r
        seen.add(c)
    assert len(seen) == layout.world_size
    groups = layout.tp_groups() + layout.dp_groups() + layout.pp_groups()
    assert all(len(set(g)) == len(g) for g in groups)
    assert sorted(r for g in layout.pp_groups() for r in g) == list(range(layout.world_size))


def test_megatron_order_matches_megatron_groups():
    # Megatron-LM, 16 ranks, tp=2 pp=4 (dp=2): tp groups [0,1],[2,3]..., pp groups [0,4,8,12], [1,5,9,13]...
    layout = RankLayout(2, 2, 4)
    assert layout.tp_groups()[:2] == [[0, 1], [2, 3]]
    assert [0, 4, 8, 12] in layout.pp_groups() and [1, 5, 9, 13] in layout.pp_groups()
    assert [0, 2] in layout.dp_groups() and [9, 11] in layout.dp_groups()
    assert [0, 12] in layout.embedding_groups()
    assert layout.mp_groups()[0] == [0, 1, 4, 5, 8, 9, 12, 13]


def test_bpipe_order_puts_pairs_side_by_side():
    pp = 8
    order = sorted(range(pp), key=lambda s: pair_adjacent_slot(s, pp))
    assert order == [0, 7, 1, 6, 2, 5, 3, 4]
    layout = RankLayout(2, 1, pp, "bpipe")
    for s in range(pp // 2):
        a, b = layout.rank(0, 0, s), layout.rank(0, 0, pp - 1 - s)
        assert abs(a - b) == layout.tp  # neighbouring model-parallel slots


def test_bad_world_size():
    with pytest.raises(UsageError, match="not divisible"):
        ParallelConfig(tensor_model_parallel_size=2, pipeline_model_parallel_size=2).data_parallel_size(6)


def test_slurm_environment_mapping():
    from megatron_bmw.parallel.state import first_host, slurm_environment

    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "1", "SLURM_JOB_ID": "1234",
           "SLURM_JOB_NODELIST": "gpu[003-004,010]"}
    assert slurm_environment(env) == {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "1", "MASTER_PORT": "29734",
                                      "MASTER_ADDR": "gpu003"}
    assert slurm_environment({**env, "MASTER_ADDR": "x", "RANK": "0"})["WORLD_SIZE"] == "16"
    assert "RANK" not in slurm_environment({**env, "RANK": "0"})
    assert slurm_environment({}) == {}
    assert first_host("node7,node8") == "node7"
    assert first_host("a[1-3],b2") == "a1"


@pytest.mark.parametrize("order", ["tp-dp-pp", "bpipe"])
def test_context_parallel_coordinates_and_groups(order):
    layout = RankLayout(2, 2, 2, order, cp=2)
    assert layout.world_size == 16
    assert sorted(layout.rank(*_tdp(c)) for c in map(layout.all_coords, range(16))) == list(range(16))
    for name, varies in (("cp", 1), ("dp", 2)):
        for group in getattr(layout, f"{name}_groups")():
            coords = [layout.all_coords(r) for r in group]
            assert all(len({c[i] for c in coords}) == (1 if i != varies else 2) for i in range(4))
    # tp fastest, then cp (Megatron's tp-cp-dp-pp): a cp group's ranks are tp apart
    assert layout.cp_groups()[0] == [0, 2]
    dp_cp = layout.dp_cp_groups()
    assert all(len(g) == 4 for g in dp_cp) and sorted(r for g in dp_cp for r in g) == list(range(16))
    assert sorted(r for g in layout.mp_groups() for r in g) == list(range(16))


def _tdp(coords):
    tp, cp, dp, pp = coords
    return tp, dp, pp, cp


@pytest.mark.parametrize("order", ["tp-dp-pp", "bpipe"])
@pytest.mark.parametrize("tp,cp,dp,pp,ep,etp", [(2, 1, 2, 2, 2, 1), (2, 2, 2, 2, 4, 2), (2, 1, 4, 1, 8, 1),
                                                (1, 1, 4, 2, 2, 2), (4, 1, 2, 1, 2, 4), (2, 2, 1, 1, 1, 2)])
def test_expert_groups_follow_the_local_index(order, tp, cp, dp, pp, ep, etp):
    layout = RankLayout(tp, dp, pp, order, cp, ep, etp)
    assert layout.edp == tp * cp * dp // (ep * etp)
    kinds = {"ep": (layout.ep_groups(), 1, ep), "etp": (layout.etp_groups(), 0, etp),
             "edp": (layout.edp_groups(), 2, layout.edp)}
    for name, (groups, varies, size) in kinds.items():
        assert sorted(r for g in groups for r in g) == list(range(layout.world_size)), name
        for g in groups:
            assert len(g) == size and len({layout.all_coords(r)[3] for r in g}) == 1  # one stage
            coords = [layout.expert_coords(r) for r in g]
            assert [c[varies] for c in coords] == list(range(size))  # members by their rank in the group
            assert all(len({c[i] for c in coords}) == 1 for i in range(3) if i != varies)
    for g in layout.etp_ep_groups():
        coords = [layout.expert_coords(r) for r in g]
        assert [c[0] + etp * c[1] for c in coords] == list(range(ep * etp)) and len({c[2] for c in coords}) == 1
    for r in range(layout.world_size):
        tp_r, cp_r, dp_r, _ = layout.all_coords(r)
        local = tp_r + tp * (cp_r + cp * dp_r)
        assert layout.expert_coords(r) == (local % etp, local // etp % ep, local // (etp * ep))


def test_expert_groups_megatron_example():
    # 8 ranks, tp2 dp4 (pp1), ep4 etp1: ep groups are 4 consecutive local indices; edp pairs them across
    layout = RankLayout(2, 4, 1, ep=4, etp=1)
    assert layout.ep_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.edp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.etp_groups() == [[r] for r in range(8)]
    # pp2: the second stage's groups follow the first's, on its own ranks
    layout = RankLayout(1, 2, 2, ep=2, etp=1)
    assert layout.ep_groups() == [[0, 1], [2, 3]] and layout.edp_groups() == [[0], [1], [2], [3]]


def test_expert_sizes_must_divide_the_stage():
    with pytest.raises(UsageError, match="--expert-model-parallel-size 4 x --expert-tensor-parallel-size 2 must "
                                         "divide"):
        RankLayout(2, 2, 1, ep=4, etp=2)
    with pytest.raises(UsageError, match="must divide"):
        RankLayout(1, 3, 2, ep=2)
