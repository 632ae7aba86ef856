"""Plots (matplotlib, Agg): the Pareto front of sequence length vs tokens/s, and peak memory by category."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from autotune.core.record import BREAKDOWN_CATEGORIES
from autotune.core.sizes import format_tokens
from trials.techniques import knobs


def knob_label(techniques: dict) -> str:
    """A short label of a config from each knob's declared ``label`` (shown when not the default): a knob with a
    parent joins its parent's part (``fsdp+optoff``, ``sp8/hc1``, ``ac+off32``), equal parts once (``tiled``)."""
    parts: dict[str, str] = {}
    for knob in knobs():
        value = techniques.get(knob.name, knob.default)
        if knob.label is None or knob.is_off(value):
            continue
        text = knob.label.format(value)
        if knob.parent is not None:
            if knob.parent in parts:
                parts[knob.parent] += text
        elif text not in parts.values():
            parts[knob.name] = text
    return " ".join(parts.values()) or "baseline"


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
            ax.scatter(
                [r["seq_len"] for r in pts],
                [r["tokens_per_s"] for r in pts],
                marker=marker,
                alpha=0.3,
                color="tab:blue",
                label=f"{source} (fits)",
            )
    for statuses, color, label in (
        (("oom",), "tab:red", "out of memory"),
        (("error", "timeout"), "grey", "failed (error / timeout)"),
    ):
        for source, marker in (("measured", "v"), ("predicted", "x")):  # a real OOM vs one never launched
            pts = [r for r in rows if r["status"] in statuses and r.get("source", "predicted") == source]
            if pts:
                ax.scatter(
                    [r["seq_len"] for r in pts],
                    [floor] * len(pts),
                    marker=marker,
                    color=color,
                    alpha=0.5,
                    label=f"{label}, {source}",
                )
    if front:
        xs = [f["seq_len"] for f in front]
        ys = [f["tokens_per_s"] for f in front]
        ax.plot(xs, ys, "-o", color="tab:red", label="Pareto front", zorder=3)
        for f in front:
            ax.annotate(
                knob_label(f["techniques"]),
                (f["seq_len"], f["tokens_per_s"]),
                fontsize=7,
                textcoords="offset points",
                xytext=(4, 4),
            )
    ax.axvline(target, color="tab:green", linestyle="--", label=f"target {target:,}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("tokens / s")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)
    drawn = {
        "points": sum(len(c.get_offsets()) for c in ax.collections),
        "front": sum(len(line.get_xdata()) for line in ax.lines if line.get_label() == "Pareto front"),
    }
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


_COLORS = {
    "params": "tab:blue",
    "grads": "tab:orange",
    "optimizer": "tab:green",
    "activations": "tab:red",
    "temporaries": "tab:purple",
    "other": "tab:gray",
}


def plot_memory(records, capacity: int, path, labels: list[str] | None = None, title: str = "") -> int:
    """Stacked bars of peak device memory per rank by category (one bar per record; ``ResultRecord`` or
    dict), the device capacity as a line; host bytes noted above each bar. Matplotlib, Agg backend.
    Returns the number of bars (stacks) drawn, counted from the figure's bar containers."""
    rows = [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in records]
    names = labels or [format_tokens(r["seq_len"]) + f" ({r['status']})" for r in rows]
    gib = 2.0**30
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 3.5), 5), dpi=110)
    bottoms = [0.0] * len(rows)
    for category in BREAKDOWN_CATEGORIES:
        values = [(r.get("breakdown") or {}).get(category, 0) / gib for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottoms, color=_COLORS[category], label=category, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for index, row in enumerate(rows):
        total = (row.get("peak_device_bytes") or 0) / gib
        note = f"{total:.1f} GiB"
        if row.get("host_bytes"):
            note += f"\nhost {row['host_bytes'] / gib:.1f}"
        ax.annotate(
            note,
            (index, max(total, bottoms[index])),
            ha="center",
            va="bottom",
            fontsize=7,
            textcoords="offset points",
            xytext=(0, 3),
        )
    ax.axhline(capacity / gib, color="black", linestyle="--", label=f"capacity {capacity / gib:.0f} GiB")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(
        names, rotation=20 if len(rows) > 3 else 0, ha="right" if len(rows) > 3 else "center", fontsize=8
    )
    ax.set_ylabel("peak device memory per rank (GiB)")
    ax.set_title(title or "predicted peak device memory by category")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(max(bottoms, default=0), capacity / gib) * 1.18)
    fig.tight_layout()
    fig.savefig(path)
    stacks = len({round(bar.get_x(), 6) for container in ax.containers for bar in container})
    plt.close(fig)
    return stacks
