import pytest

from megatron_bmw.errors import UsageError
from megatron_bmw.strategy import (UnitStrategy, galvatron_space_size, parse_strategy, parse_unit_strategies,
                                   stage_strategies)


def test_text_round_trip():
    for text in ("tp2-dp2", "dp2-tp2", "sdp4", "tp4", "dp1", "tp2-sdp2", "sdp2-tp2", "dp8"):
        assert str(parse_strategy(text)) == text
    assert parse_strategy("dp1-tp4") == UnitStrategy(4, 1)
    assert parse_strategy("sdp2-tp2") == UnitStrategy(2, 2, sharded=True, tp_consecutive=False)


@pytest.mark.parametrize("bad", ["tp0", "xp2", "tp2-tp2", "tp2dp2", ""])
def test_bad_text(bad):
    with pytest.raises(UsageError):
        parse_strategy(bad)


def test_width_checked():
    with pytest.raises(UsageError, match="spans 2 ranks"):
        parse_strategy("tp2", width=4)
    with pytest.raises(UsageError, match="3 strategies given"):
        parse_unit_strategies("dp4,tp4,dp4", 6, 4)
    assert parse_unit_strategies("tp2-dp2", 3, 4) == (UnitStrategy(2, 2),) * 3


def test_coords_and_groups_cover_the_stage():
    for width in (1, 2, 4, 8):
        for s in stage_strategies(width):
            seen = {s.coords(r) for r in range(width)}
            assert len(seen) == width
            assert all(s.local_rank(*s.coords(r)) == r for r in range(width))
            assert sorted(r for g in s.tp_groups() for r in g) == list(range(width))
            assert sorted(r for g in s.dp_groups() for r in g) == list(range(width))
    s = parse_strategy("dp2-tp2")
    assert s.tp_groups() == [[0, 2], [1, 3]] and s.dp_groups() == [[0, 1], [2, 3]]
    s = parse_strategy("tp2-dp2")
    assert s.tp_groups() == [[0, 1], [2, 3]] and s.dp_groups() == [[0, 2], [1, 3]]


def test_sample_shards():
    s = parse_strategy("tp2-dp2")
    assert [s.samples(r, 8) for r in range(4)] == [(0, 4), (0, 4), (4, 8), (4, 8)]
    s = parse_strategy("dp2-tp2")
    assert [s.samples(r, 8) for r in range(4)] == [(0, 4), (4, 8), (0, 4), (4, 8)]
    with pytest.raises(UsageError):
        parse_strategy("dp4").samples(0, 6)


def test_galvatron_counts():
    assert len(stage_strategies(8)) == 11
    assert galvatron_space_size(8) == 44
