"""Which tier runs (scripts/test.sh --fast sets MBMW_TEST_TIER=fast)."""

import os

FAST = os.environ.get("MBMW_TEST_TIER") == "fast"


def sample(cases: list, every: int) -> list:
    """All of `cases` in the whole suite; every `every`-th one (the first and the last always) in the fast tier, for
    exhaustive sweeps whose neighbouring cases check the same thing."""
    if not FAST or len(cases) <= 2:
        return list(cases)
    picked = cases[::every]
    return picked if picked[-1] is cases[-1] else picked + [cases[-1]]
