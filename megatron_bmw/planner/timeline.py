"""Timeline PNG of a simulation (or of a measured trace laid out the same way): one row per rank."""

from __future__ import annotations

from ..pipeline.schedule import Kind
from .simulator import Simulation

COLORS = {"forward": "#4C72B0", "backward": "#55A868", "transfer": "#DD8452", "sync": "#8172B2"}


def render_timeline(sim: Simulation, path: str, title: str = "") -> None:
    """Write a PNG: compute bars per rank (forward/backward), transfers and EVICT/LOAD on a thin lane below,
    the gradient synchronisation after the pipeline, and the critical path outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    p = len(sim.computes)
    show_chunk = sim.schedule.virtual_stages > 1
    width = max(8.0, min(40.0, 0.12 * sum(len(c) for c in sim.computes) / max(p, 1)))
    fig, ax = plt.subplots(figsize=(width, 0.7 * p + 1.8))
    critical = {(r, a, s) for r, a, s, _ in sim.critical_path}
    scale = 1e3 if sim.iteration_time < 10 else 1.0
    unit = "ms" if scale == 1e3 else "s"
    few = sum(len(c) for c in sim.computes) <= 400
    for r, acts in enumerate(sim.computes):
        y = p - 1 - r
        for a, s, e in acts:
            color = COLORS["forward" if a.kind is Kind.FORWARD else "backward"]
            edge = "red" if (r, a, s) in critical else "none"
            ax.broken_barh([(s * scale, (e - s) * scale)], (y + 0.3, 0.6), facecolors=color, edgecolors=edge,
                           linewidth=1.0)
            if few:
                ax.text((s + e) / 2 * scale, y + 0.6, a.label(show_chunk), ha="center", va="center", fontsize=6,
                        color="white")
        for a, s, e in sim.copies[r]:
            ax.broken_barh([(s * scale, max(e - s, 1e-9) * scale)], (y + 0.05, 0.2), facecolors=COLORS["transfer"])
        if sim.finish[r] > (acts[-1][2] if acts else 0.0):
            end = acts[-1][2] if acts else 0.0
            ax.broken_barh([(end * scale, (sim.finish[r] - end) * scale)], (y + 0.3, 0.6),
                           facecolors=COLORS["sync"], alpha=0.6)
    for src, dst, _, s, e in sim.transfers:
        ax.broken_barh([(s * scale, max(e - s, 1e-12) * scale)], (p - 1 - dst + 0.05, 0.2),
                       facecolors=COLORS["transfer"], alpha=0.7)
    ax.set_yticks([p - 1 - r + 0.6 for r in range(p)])
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.set_xlabel(f"time ({unit})")
    ax.set_xlim(0, sim.iteration_time * scale * 1.01)
    ax.set_ylim(0, p)
    ax.set_title(title or f"{sim.schedule.name}: p={p}, m={sim.schedule.num_microbatches}, "
                          f"iteration {sim.iteration_time * scale:.2f} {unit}, bubble {100 * sim.bubble_fraction:.1f}%, "
                          f"master stage {sim.master_stage}")
    handles = [Patch(color=c, label=k) for k, c in COLORS.items()]
    handles.append(Patch(facecolor="white", edgecolor="red", label="critical path"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12 - 0.3 / max(p, 1)), fontsize=7,
              ncol=5, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
