"""Plots (matplotlib, Agg): the Pareto front of sequence length vs tokens/s, and peak memory by category."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from autotune.core.record import BREAKDOWN_CATEGORIES
from autotune.core.sizes import format_tokens, short_tokens
from trials.stack.techniques import knobs


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


def knob_labels(configs: list[dict]) -> list[str]:
    """Labels that tell ``configs`` (techniques dicts) apart: each one's ``knob_label``, then the value of each knob
    that differs between them where those labels do not show it (the tile sizes behind ``tiled``):
    ``fsdp sp8 tiled mlp_tile_tokens=16K``. Configs that are the same get the same label."""
    labels = [knob_label(techniques) for techniques in configs]
    extras: list[list[str]] = [[] for _ in configs]
    for knob in knobs():
        values = [techniques.get(knob.name, knob.default) for techniques in configs]
        by_label: dict[str, set] = {}
        for label, value in zip(labels, values):
            by_label.setdefault(label, set()).add(repr(value))
        if all(len(seen) == 1 for seen in by_label.values()):  # one value per label: the labels show it
            continue
        for extra, value in zip(extras, values):
            shown = "off" if knob.is_off(value) else short_tokens(value) if knob.kind == "tokens" else str(value)
            extra.append(f"{knob.name}={shown}")
    return [" ".join([label, *extra]) for label, extra in zip(labels, extras)]


def model_title(model: str) -> str:
    """A model as a plot's title names it: a preset by its name, a config.json by its folder (``Qwen3-8B``), another
    JSON file by its name without the suffix; never the whole path."""
    path = Path(model)
    if path.name == "config.json" and path.parent.name:
        return path.parent.name
    return path.stem if path.suffix == ".json" else path.name


def where_title(gpus: int, hardware: str, nodes: int = 1) -> str:
    """ "8x h100-sxm", or "2 nodes x 8x h100-sxm"."""
    return (f"{nodes} nodes x " if nodes > 1 else "") + f"{gpus}x {hardware}"


def plot_title(record, model: str, gpus: int, hardware: str, nodes: int = 1) -> str:
    """An estimate's memory plot's title: the model, the length and the world, then the step time and tokens/s
    (``record`` a ``ResultRecord``)."""
    title = f"{model_title(model)}, {format_tokens(record.seq_len)} tokens on {where_title(gpus, hardware, nodes)}"
    if record.step_time_s:
        title += f"\nstep {record.step_time_s:,.3g} s, {record.tokens_per_s:,.0f} tokens/s"
    return f"{title} ({record.source}, {record.status})"


# The failure strip below the rate axis, one row per kind of trial without a rate, top to bottom:
# (statuses, colour, the row's name, its name in the legend).
FAILURE_ROWS = (
    (("oom",), "tab:red", "out of memory", "out of memory"),
    (("error", "timeout"), "grey", "failed", "failed (error / timeout)"),
)
STRIP_SPREAD = 0.35  # trials at one length in one strip row spread over row +- this (the row is 1 high)
NO_FIT_NOTE = "no config fits"
LABEL_FONT = 7  # points


def _strip_offsets(count: int) -> list[float]:
    """Vertical offsets of ``count`` markers that share one length in one strip row: centred, at most 0.15
    apart, within +-``STRIP_SPREAD``, so each stays visible."""
    if count == 1:
        return [0.0]
    step = min(0.15, 2 * STRIP_SPREAD / (count - 1))
    return [(j - (count - 1) / 2) * step for j in range(count)]


def _length_ticks(value: float, _position=None) -> str:
    return short_tokens(round(value)) if value >= 1 else ""


def plot_pareto(
    rows: list[dict], front: list[dict], target: int, path: Path, title: str = "", best: dict | None = None
) -> dict:
    """Every trial at its length: those that fit at their tokens/s (measured = circles, predicted = squares),
    the rest in a labelled strip below, one row for out of memory (red) and one for failed (grey), measured =
    triangles, predicted = x. The front is a line whose points carry their key knobs (labels placed clear of
    one another, see ``_place_front_labels``), the target a vertical line; ``best`` (``pareto.json``'s: the config
    ``best.json`` holds, at the target) a gold star. When nothing fits, the rate axis has no scale and says so.
    Returns what the figure holds, counted from its artists: ``{"points": trial markers, "front": front points,
    "best": 1 where the star is drawn}``."""
    ok = [r for r in rows if r["status"] == "ok" and r.get("tokens_per_s")]
    rates = [r["tokens_per_s"] for r in ok] + [f["tokens_per_s"] for f in front]
    fig, (ax, strip) = plt.subplots(
        2,
        1,
        sharex=True,
        figsize=(11, 6),
        dpi=110,
        layout="constrained",
        gridspec_kw={"height_ratios": (4, 1) if rates else (3, 2)},  # nothing fits: the strip is the content
    )
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
    row_names, counts = [], []
    for height, (statuses, color, name, label) in zip(range(len(FAILURE_ROWS) - 1, -1, -1), FAILURE_ROWS):
        failed = [r for r in rows if r["status"] in statuses]
        row_names.append((height, f"{name} ({len(failed)})"))
        counts.append(f"{len(failed)} {name}")
        by_length: dict[int, list[dict]] = {}
        for r in failed:
            by_length.setdefault(r["seq_len"], []).append(r)
        heights = {id(r): height + o for same in by_length.values() for r, o in zip(same, _strip_offsets(len(same)))}
        for source, marker in (("measured", "v"), ("predicted", "x")):  # a real OOM vs one never launched
            pts = [r for r in failed if r.get("source", "predicted") == source]
            if pts:
                strip.scatter(
                    [r["seq_len"] for r in pts],
                    [heights[id(r)] for r in pts],
                    marker=marker,
                    color=color,
                    alpha=0.6,
                    label=f"{label}, {source}",
                )
    if front:
        ax.plot(
            [f["seq_len"] for f in front],
            [f["tokens_per_s"] for f in front],
            "-o",
            color="tab:red",
            label="Pareto front",
            zorder=3,
        )
    if best and best.get("tokens_per_s"):
        ax.plot(
            [best["seq_len"]],
            [best["tokens_per_s"]],
            "*",
            markersize=16,
            color="gold",
            markeredgecolor="black",
            label=f"best.json (trial {best['trial']})",
            zorder=4,
        )
    for axes in (ax, strip):
        axes.axvline(target, color="tab:green", linestyle="--", label=f"target {target:,}")
        axes.grid(True, which="both", axis="x", alpha=0.3)
    lengths = [r["seq_len"] for r in rows] + [f["seq_len"] for f in front] + [target]
    ax.set_xscale("log", base=2)
    ax.set_xlim(min(lengths) / 1.4, max(lengths) * 1.4)
    strip.xaxis.set_major_formatter(_length_ticks)
    strip.set_xlabel("sequence length (tokens)")
    strip.set_ylim(-0.5, len(FAILURE_ROWS) - 0.5)
    strip.set_yticks([h for h, _ in row_names], [name for _, name in row_names], fontsize=8)
    strip.tick_params(axis="y", length=0)
    ax.set_ylabel("tokens / s")
    if rates:
        ax.set_ylim(0, max(rates) * 1.15)
        ax.grid(True, axis="y", alpha=0.3)
    else:  # no rate to draw: no scale to read one from
        ax.set_ylim(0, 1)
        ax.set_yticks([])
        note = (
            f"{NO_FIT_NOTE}\n{len(rows)} trials: {', '.join(counts)} (below)" if rows else f"{NO_FIT_NOTE} (no trials)"
        )
        ax.text(
            0.5,
            0.5,
            note,
            transform=ax.transAxes,
            ha="center",
            va="center",
            fontsize=13,
            color="0.25",
            zorder=5,
            bbox={"facecolor": "white", "edgecolor": "0.7", "boxstyle": "round,pad=0.6"},
        )
    ax.set_title(title)
    handles, labels = ax.get_legend_handles_labels()
    more = [(h, t) for h, t in zip(*strip.get_legend_handles_labels()) if t not in labels]
    fig.legend(handles + [h for h, _ in more], labels + [t for _, t in more], fontsize=8, loc="outside right upper")
    fig.canvas.draw()  # lays the figure out; frozen, so the labels placed in its pixels stay where they are put
    fig.set_layout_engine("none")
    if front:
        _place_front_labels(fig, ax, front)
    fig.savefig(path)
    drawn = {
        "points": sum(len(c.get_offsets()) for a in (ax, strip) for c in a.collections),
        "front": sum(len(line.get_xdata()) for line in ax.lines if line.get_label() == "Pareto front"),
        "best": sum(len(line.get_xdata()) for line in ax.lines if line.get_label().startswith("best.json")),
    }
    plt.close(fig)
    return drawn


def _front_groups(front: list[dict], pixels: list[tuple[float, float]], near: float) -> list[tuple[str, list[int]]]:
    """The front's labels: (text, indices of the points it labels). Points closer than ``near`` pixels to a
    neighbour (by length) share one label, since their markers cannot be told apart: "config (n points)" when
    they share a config, else one line per point, "length: config", shortest first."""
    order = sorted(range(len(front)), key=lambda i: front[i]["seq_len"])
    clusters: list[list[int]] = []
    for i in order:
        if clusters:
            (x0, y0), (x1, y1) = pixels[clusters[-1][-1]], pixels[i]
            if (x1 - x0) ** 2 + (y1 - y0) ** 2 < near**2:
                clusters[-1].append(i)
                continue
        clusters.append([i])
    labels = knob_labels([f["techniques"] for f in front])
    groups = []
    for members in clusters:
        texts = [labels[i] for i in members]
        if len(members) == 1:
            text = texts[0]
        elif len(set(texts)) == 1:
            text = f"{texts[0]} ({len(members)} points)"
        else:
            text = "\n".join(f"{front[i]['seq_len']:,}: {t}" for i, t in zip(members, texts))
        groups.append((text, members))
    return groups


def _overlaps(a: tuple, b: tuple, pad: float = 1.0) -> bool:
    """Whether boxes (x0, y0, x1, y1) overlap, or come closer than ``pad`` pixels."""
    return a[0] < b[2] + pad and b[0] < a[2] + pad and a[1] < b[3] + pad and b[1] < a[3] + pad


def _free_box(points: tuple, width: float, height: float, bounds: tuple, taken: list[tuple]):
    """The first free place for a ``width`` x ``height`` pixel text beside the ``points`` (the box (x0, y0, x1,
    y1) around the points it labels): right, then left of them, above, then below, level with them or ``k``
    text heights further up or down (k = 0, 1, ...); inside ``bounds`` and clear of every ``taken`` box.
    Returns (box, k); right and above (k = 0) when none is free."""
    rows = int((bounds[3] - bounds[1]) / (height + 2)) + 1
    for k in range(rows):
        for x0 in (points[2] + 6, points[0] - 6 - width):
            for y0 in (points[3] + 3 + k * (height + 2), points[1] - 3 - height - k * (height + 2)):
                box = (x0, y0, x0 + width, y0 + height)
                inside = bounds[0] <= box[0] and box[2] <= bounds[2] and bounds[1] <= box[1] and box[3] <= bounds[3]
                if inside and not any(_overlaps(box, b) for b in taken):
                    return box, k
    return (points[2] + 6, points[3] + 3, points[2] + 6 + width, points[3] + 3 + height), 0


def _place_front_labels(fig, ax, front: list[dict]) -> None:
    """Label each front point (or each group of near points with one config) where its text overlaps no other
    label, no front marker, no part of the front line, and stays inside the axes: beside its point, right (or
    left) and above (or below), else stacked further up or down with a leader line to the point. Works in the
    figure's pixels, so it runs once the layout is final."""
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    bounds = (frame.x0 + 2, frame.y0 + 2, frame.x1 - 2, frame.y1 - 2)
    pixels = [tuple(ax.transData.transform((f["seq_len"], f["tokens_per_s"]))) for f in front]
    obstacles = [(x - 5, y - 5, x + 5, y + 5) for x, y in pixels]  # the front's markers
    for (xa, ya), (xb, yb) in zip(pixels, pixels[1:]):  # the front line, as small boxes every 4 pixels
        steps = max(1, int(((xb - xa) ** 2 + (yb - ya) ** 2) ** 0.5 / 4))
        for s in range(steps + 1):
            x, y = xa + (xb - xa) * s / steps, ya + (yb - ya) * s / steps
            obstacles.append((x - 1.5, y - 1.5, x + 1.5, y + 1.5))
    placed: list[tuple] = []
    for text, members in _front_groups(front, pixels, near=30.0):
        anchor = max(members, key=lambda i: pixels[i][1])  # the group's highest point, where a leader goes
        px, py = pixels[anchor]
        xs, ys = [pixels[i][0] for i in members], [pixels[i][1] for i in members]
        probe = ax.text(0, 0, text, fontsize=LABEL_FONT, transform=None)  # its size in pixels
        extent = probe.get_window_extent(renderer)
        probe.remove()
        width, height = extent.width, extent.height
        box, k = _free_box((min(xs), min(ys), max(xs), max(ys)), width, height, bounds, placed + obstacles)
        scale = 72.0 / fig.dpi  # pixels -> points
        leader = None
        if k > 0:  # moved away from its point: a leader line from the text's nearest corner
            relpos = (0.0 if box[0] > px else 1.0, 0.0 if box[1] > py else 1.0)
            leader = dict(arrowstyle="-", color="0.45", lw=0.6, shrinkA=0, shrinkB=4, relpos=relpos)
        ax.annotate(
            text,
            (front[anchor]["seq_len"], front[anchor]["tokens_per_s"]),
            textcoords="offset points",
            xytext=((box[0] - px) * scale, (box[1] - py) * scale),
            ha="left",
            va="bottom",
            fontsize=LABEL_FONT,
            zorder=4,
            arrowprops=leader,
        )
        placed.append(box)


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


def _gib(value: float, decimals: int = 1) -> str:
    """GiB with ``decimals`` from 1 GiB up, two significant digits below (a CPU test's 0.5 GiB is not "0")."""
    return f"{value:.{decimals}f}" if value >= 1 or value == 0 else f"{value:.2g}"


def plot_memory(
    records,
    capacity: int,
    path,
    labels: list[str] | None = None,
    title: str = "",
    host_capacity: int = 0,
) -> int:
    """Stacked bars of peak device memory per rank by category (one bar per record; ``ResultRecord`` or
    dict), the device capacity as a line; host bytes noted above each bar, against ``host_capacity`` (the host
    memory per rank, ``Hardware.host_memory_bytes_per_device``; 0: not checked) where it is known: the host is
    another memory, so its capacity is a figure in each note and in the legend, not a line on the device's axis.
    Matplotlib, Agg backend. Returns the number of bars (stacks) drawn, counted from the figure's bar containers."""
    rows = [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in records]
    names = labels or [format_tokens(r["seq_len"]) + f" ({r['status']})" for r in rows]
    gib = 2.0**30
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 3.5), 5), dpi=110)
    bottoms = [0.0] * len(rows)
    for category in BREAKDOWN_CATEGORIES:
        values = [(r.get("breakdown") or {}).get(category, 0) / gib for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottoms, color=_COLORS[category], label=category, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    notes = []
    for index, row in enumerate(rows):
        total = (row.get("peak_device_bytes") or 0) / gib
        note = f"{_gib(total)} GiB"
        if row.get("host_bytes"):
            note += f"\nhost {_gib(row['host_bytes'] / gib)}"
            note += f" of {_gib(host_capacity / gib)}" if host_capacity else ""
        notes.append((max(total, bottoms[index]), note))
    line = capacity / gib
    ax.axhline(line, color="black", linestyle="--", label=f"device capacity {_gib(line, 2)} GiB")
    if host_capacity:  # a legend entry only: what each note's "host X of Y" is measured against
        ax.plot([], [], " ", label=f"host capacity {_gib(host_capacity / gib, 2)} GiB per rank")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(
        names, rotation=20 if len(rows) > 3 else 0, ha="right" if len(rows) > 3 else "center", fontsize=8
    )
    ax.set_ylabel("peak device memory per rank (GiB)")
    ax.set_title(title or "predicted peak device memory by category")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(max(bottoms, default=0), line) * 1.18)
    fig.tight_layout()
    _place_memory_notes(fig, ax, notes, line)
    fig.savefig(path)
    stacks = len({round(bar.get_x(), 6) for container in ax.containers for bar in container})
    plt.close(fig)
    return stacks


def _place_memory_notes(fig, ax, notes: list[tuple[float, str]], line: float) -> None:
    """Each bar's note (``(top of the bar in GiB, text)``, bar i at x = i) just above its bar, or, where it
    would cross the capacity line at ``line`` GiB, just above the line; the y axis grows until every note fits
    inside it. Works in pixels, so it runs once the layout is final."""
    renderer = fig.canvas.get_renderer()
    lifted: set[int] = set()
    texts = [
        ax.annotate(text, (i, top), ha="center", va="bottom", fontsize=7, textcoords="offset points", xytext=(0, 3))
        for i, (top, text) in enumerate(notes)
    ]
    for _ in range(10):  # a taller axis moves the line closer to the notes below it: repeat until none changes
        frame = ax.get_window_extent(renderer)
        line_y = ax.transData.transform((0, line))[1]
        for i, text in enumerate(texts):
            box = text.get_window_extent(renderer)
            if i not in lifted and box.y0 - 2 <= line_y <= box.y1 + 2:
                lifted.add(i)
                text.xy = (i, line)
        highest = max((t.get_window_extent(renderer).y1 for t in texts), default=frame.y0)
        if highest <= frame.y1 - 4:
            break
        bottom, top = ax.get_ylim()
        per_pixel = (top - bottom) / frame.height
        ax.set_ylim(bottom, top + (highest - frame.y1 + 8) * per_pixel * 1.2)
