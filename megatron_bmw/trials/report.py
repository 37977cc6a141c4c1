"""The sweep's report: trials sorted by measured throughput with the planner's prediction beside them, a summary
(median |error|, Spearman of predicted against measured, how far the predicted-fastest trial is from the
measured best), and a predicted-vs-measured PNG."""

from __future__ import annotations

import os

from ..planner.accuracy import error_summary
from .grid import layout_label

GiB = 2**30


def measured_rows(records: list[dict]) -> list[dict]:
    """ok trials, fastest throughput first."""
    ok = [r for r in records if r.get("status") == "ok" and r.get("median_iteration_s")]
    return sorted(ok, key=lambda r: -(r.get("tokens_per_s") or 0.0))


def _label(r: dict) -> str:
    return layout_label(r["layout"]) if r.get("layout") else r.get("label") or " ".join(r.get("argv", []))[:48]


def _size(nbytes: float | None) -> str:
    if not nbytes:
        return "-"
    return f"{nbytes / GiB:.2f}G" if nbytes >= GiB else f"{nbytes / 2**20:.1f}M"


def _rss(r: dict) -> float | None:
    """A CPU trial's largest peak resident memory over its stages (trials/entry.py)."""
    values = [s.get("peak_rss") for s in (r.get("stage_memory") or {}).values() if s.get("peak_rss")]
    return max(values) if values else None


def table(records: list[dict], predictions: dict[str, float]) -> str:
    rows = measured_rows(records)
    width = max([len(_label(r)) for r in records] + [6])
    rss = any(_rss(r) for r in rows)
    lines = [f"{'#':>3} {'trial':<12} {'layout':<{width}} {'iter s':>9} {'tokens/s':>10} {'pred s':>9} "
             f"{'error':>7} {'peak alloc':>10}" + (f" {'peak RSS':>9}" if rss else "")]
    for i, r in enumerate(rows, 1):
        pred = predictions.get(r["id"])
        err = f"{100 * (pred / r['median_iteration_s'] - 1):+6.1f}%" if pred else f"{'-':>7}"
        mem = f"{_size(r.get('peak_memory_bytes')):>10}" + (f" {_size(_rss(r)):>9}" if rss else "")
        lines.append(f"{i:>3} {r['id']:<12} {_label(r):<{width}} {r['median_iteration_s']:9.4f} "
                     f"{r.get('tokens_per_s') or 0:10.0f} {(f'{pred:9.4f}' if pred else f'{chr(45):>9}')} "
                     f"{err} {mem}")
    others = [r for r in records if r.get("status") != "ok" or not r.get("median_iteration_s")]
    for r in sorted(others, key=lambda r: r.get("status", "")):
        reason = (r.get("reason") or "").replace("\n", " ")
        lines.append(f"{'-':>3} {r['id']:<12} {_label(r):<{width}} {r.get('status', '?'):>9}  {reason[:100]}")
    lines.append("peak alloc: the largest rank's peak tensor bytes (CUDA: torch's peak allocation; CPU: model states, "
                 "plus saved activations where the run tracks them)" + ("; peak RSS: its process's peak resident "
                                                                        "memory" if rss else ""))
    counts = {}
    for r in records:
        counts[r.get("status")] = counts.get(r.get("status"), 0) + 1
    lines.append(", ".join(f"{n} {s}" for s, n in sorted(counts.items())))
    paired = [(predictions[r["id"]], r["median_iteration_s"], i) for i, r in enumerate(rows, 1)
              if predictions.get(r["id"])]
    if paired:
        s = error_summary([p for p, _, _ in paired], [m for _, m, _ in paired])
        lines.append(f"prediction over {s['n']} trials: median |error| {100 * s['median_abs_error']:.1f}%, Spearman "
                     f"{s['spearman']:.3f}; the predicted fastest (#{paired[s['pick_index']][2]}) ran "
                     f"{100 * s['pick_vs_best']:.1f}% slower than the measured best")
    return "\n".join(lines)


def plot(records: list[dict], predictions: dict[str, float], path: str) -> str:
    """Write the predicted-vs-measured PNG; returns a note (the path, or why there is none)."""
    rows = [(i, predictions[r["id"]], r["median_iteration_s"]) for i, r in enumerate(measured_rows(records), 1)
            if predictions.get(r["id"])]
    if not rows:
        return "no PNG: no trial has both a measurement and a prediction"
    try:
        import matplotlib
    except ImportError:
        return "no PNG: matplotlib is not installed"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p * 1e3 for _, p, _ in rows]
    ys = [m * 1e3 for _, _, m in rows]
    fig, ax = plt.subplots(figsize=(6, 6))
    ax.scatter(xs, ys, s=18, color="#4C72B0")
    for (i, _, _), x, y in zip(rows, xs, ys):
        ax.annotate(str(i), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=7)
    lo, hi = min(xs + ys) * 0.9, max(xs + ys) * 1.1
    ax.plot([lo, hi], [lo, hi], color="grey", linewidth=0.8, linestyle="--", label="predicted = measured")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted iteration time (ms)")
    ax.set_ylabel("measured iteration time (ms)")
    s = error_summary([p for _, p, _ in rows], [m for _, _, m in rows])
    ax.set_title(f"{s['n']} trials: median |error| {100 * s['median_abs_error']:.1f}%, Spearman {s['spearman']:.2f}",
                 fontsize=9)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    if not os.path.splitext(path)[1]:  # (matplotlib would add it unsaid)
        path += ".png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"predicted vs measured written to {path}"
