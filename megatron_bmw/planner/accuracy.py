"""How well predicted times match measured ones: rank correlation, median error, and the cost of trusting the
prediction's pick. No torch."""

from __future__ import annotations

import statistics


def spearman(xs: list[float], ys: list[float]) -> float:
    """Rank correlation (ties share their mean rank)."""
    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    if len(xs) < 2:
        return float("nan")
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / var if var else 0.0


def error_summary(predicted: list[float], measured: list[float]) -> dict:
    """Median |predicted - measured| / measured, Spearman, and the measured cost of trusting the prediction:
    how much slower the predicted-fastest trial ran than the measured-fastest one."""
    if not measured:
        return {"n": 0}
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured)]
    fastest = min(predicted)
    tied = [i for i, p in enumerate(predicted) if p <= fastest * (1 + 1e-9)]
    pick = max(tied, key=lambda i: measured[i])  # a tie is settled against the prediction
    return {"n": len(measured), "median_abs_error": statistics.median(errors),
            "spearman": spearman(predicted, measured), "pick_index": pick,
            "pick_vs_best": measured[pick] / min(measured) - 1}
