"""Statistics the benchmarks share: the package's rank correlation (also used by tools/grid_search.py reports)."""

from megatron_bmw.planner.accuracy import spearman

__all__ = ["spearman"]
