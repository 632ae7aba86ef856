"""Plots (matplotlib, Agg): the Pareto front of sequence length vs tokens/s."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def _knob_label(techniques: dict) -> str:
    parts = []
    if techniques.get("fsdp"):
        parts.append("fsdp" + ("+optoff" if techniques.get("optimizer_offload") else ""))
    if techniques.get("ulysses_degree", 1) > 1:
        chunk = techniques.get("head_chunk")
        parts.append(f"sp{techniques['ulysses_degree']}" + (f"/hc{chunk}" if chunk else ""))
    if techniques.get("activation_checkpointing"):
        parts.append("ac" + (f"+off{techniques['activation_offload_layers']}" if techniques.get("activation_offload_layers") else ""))
    if techniques.get("mlp_tile_tokens") or techniques.get("loss_tile_tokens") or techniques.get("norm_tile_tokens"):
        parts.append("tiled")
    return " ".join(parts) or "baseline"


def plot_pareto(rows: list[dict], front: list[dict], target: int, path: Path, title: str = "") -> dict:
    """Every trial (measured = circles, predicted = squares; OOM red and failed grey on the floor: measured =
    triangles, predicted = x), the front highlighted and labelled with its key knobs, and the target as a
    vertical line. Returns what the figure holds, counted from its artists: ``{"points": trial markers,
    "front": front points}``."""
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    ok = [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")]
    floor = min((r["tokens_per_s"] for r in ok), default=1.0) * 0.5  # where points without a rate are drawn
    for source, marker in (("measured", "o"), ("predicted", "s")):
        pts = [r for r in ok if r["source"] == source]
        if pts:
            ax.scatter([r["seq_len"] for r in pts], [r["tokens_per_s"] for r in pts], marker=marker, alpha=0.3,
                       color="tab:blue", label=f"{source} (fits)")
    for statuses, color, label in ((("oom",), "tab:red", "out of memory"),
                                   (("error", "timeout"), "grey", "failed (error / timeout)")):
        for source, marker in (("measured", "v"), ("predicted", "x")):  # a real OOM vs one never launched
            pts = [r for r in rows if r["status"] in statuses and r.get("source", "predicted") == source]
            if pts:
                ax.scatter([r["seq_len"] for r in pts], [floor] * len(pts), marker=marker, color=color, alpha=0.5,
                           label=f"{label}, {source}")
    if front:
        xs = [f["seq_len"] for f in front]
        ys = [f["tokens_per_s"] for f in front]
        ax.plot(xs, ys, "-o", color="tab:red", label="Pareto front", zorder=3)
        for f in front:
            ax.annotate(_knob_label(f["techniques"]), (f["seq_len"], f["tokens_per_s"]), fontsize=7,
                        textcoords="offset points", xytext=(4, 4))
    ax.axvline(target, color="tab:green", linestyle="--", label=f"target {target:,}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    drawn = {"points": sum(len(c.get_offsets()) for c in ax.collections),
             "front": sum(len(line.get_xdata()) for line in ax.lines if line.get_label() == "Pareto front")}
    plt.close(fig)
    return drawn


def write_pareto_html(study, path: Path) -> bool:
    """``pareto.html``: Optuna's interactive Pareto-front view (plotly; infeasible trials -- OOMs, failures --
    greyed out from their constraints), self-contained so it opens offline. False when plotly is missing."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        return False
    from optuna.visualization import plot_pareto_front

    fig = plot_pareto_front(study, target_names=["seq_len (tokens)", "tokens/s"])
    fig.update_xaxes(type="log")
    fig.write_html(str(path), include_plotlyjs=True)
    return True
