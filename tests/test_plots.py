"""The plots: the Pareto plot's markers and front line and the memory plot's stacks, read from the figures they
build on hand-made rows; the PNGs a search folder gets; and pareto.html (issue 7)."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image as mpimg
import pyarrow.parquet as pq
import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def search_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("plots") / "out"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.cli",
            "search",
            "--model",
            "tiny-llama",
            "--target",
            "4K",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--memory-gib",
            "0.5",
            "--backend",
            "plan",
            "--trials",
            "12",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return out


def _png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(path)
    height, width = pixels.shape[:2]
    assert 400 <= width <= 3000 and 300 <= height <= 2000
    assert pixels.std() > 0.01  # not a blank canvas


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions build, kept open after they are saved (instead of closed) for inspection."""
    import matplotlib.pyplot as plt

    close, kept = plt.close, []
    monkeypatch.setattr(plt, "close", kept.append)
    yield kept
    for fig in kept:
        close(fig)


def _row(seq_len, status, source, tokens_per_s=None):
    return {"seq_len": seq_len, "status": status, "source": source, "tokens_per_s": tokens_per_s}


def _colour(rgba) -> str:
    from matplotlib.colors import to_rgb

    for name in ("tab:blue", "tab:red", "grey"):
        if all(abs(a - b) < 1e-6 for a, b in zip(to_rgb(name), rgba[:3])):
            return name
    return str(rgba)


def _markers(ax) -> list[tuple[float, float, str]]:
    """Every scatter marker on ``ax`` as (x, y, colour name), sorted."""
    return sorted(
        (float(x), float(y), _colour(collection.get_facecolors()[0]))
        for collection in ax.collections
        for x, y in collection.get_offsets()
    )


def _pareto_axes(fig):
    """(the tokens/s axes, the failure strip below it) of a Pareto figure."""
    ax, strip = fig.axes
    assert strip.get_xlabel() == "sequence length (tokens)" and ax.get_ylabel() == "tokens / s"
    return ax, strip


def _strip_rows(strip) -> dict[str, float]:
    """The strip's rows: name (its count cut off) -> height."""
    return {label.get_text().rsplit(" (", 1)[0]: y for y, label in zip(strip.get_yticks(), strip.get_yticklabels())}


def test_the_pareto_plot_draws_every_trial_once_where_it_belongs(figures, tmp_path):
    from autotune.outputs.plots import plot_pareto

    rows = [
        _row(1024, "ok", "predicted", 5000.0),
        _row(2048, "ok", "predicted", 4000.0),
        _row(4096, "ok", "predicted", 2000.0),
        _row(2048, "ok", "measured", 3800.0),
        _row(8192, "oom", "predicted"),
        _row(8192, "oom", "measured"),
        _row(16384, "oom", "predicted"),
        _row(4096, "error", "predicted"),
        _row(8192, "timeout", "measured"),
    ]
    front = [
        {"seq_len": s, "tokens_per_s": t, "techniques": {}} for s, t in ((1024, 5000.0), (2048, 4000.0), (4096, 2000.0))
    ]
    assert plot_pareto(rows, front, 4096, tmp_path / "pareto.png") == {"points": 9, "front": 3, "best": 0}
    _png(tmp_path / "pareto.png")
    (fig,) = figures
    ax, strip = _pareto_axes(fig)
    # the four that fit at their rates, on an axis from 0 to 15 % above the fastest (5000 * 1.15)
    assert _markers(ax) == sorted(
        [(1024, 5000, "tab:blue"), (2048, 4000, "tab:blue"), (4096, 2000, "tab:blue"), (2048, 3800, "tab:blue")]
    )
    assert ax.get_ylim() == pytest.approx((0, 5750))
    # the five without a rate in the strip: out of memory on the top row (1), failed on the bottom one (0); the
    # two OOMs at 8192 (predicted first, as in rows) 0.15 apart around their row, the rest on it
    assert [t.get_text() for t in strip.get_yticklabels()] == ["out of memory (3)", "failed (2)"]
    assert _strip_rows(strip) == {"out of memory": 1, "failed": 0}
    assert _markers(strip) == sorted(
        [
            (8192, 0.925, "tab:red"),
            (8192, 1.075, "tab:red"),
            (16384, 1, "tab:red"),
            (4096, 0, "grey"),
            (8192, 0, "grey"),
        ]
    )
    assert strip.get_ylim() == (-0.5, 1.5)
    (line,) = [line for line in ax.lines if line.get_label() == "Pareto front"]
    assert list(line.get_xdata()) == [1024, 2048, 4096] and list(line.get_ydata()) == [5000, 4000, 2000]
    # the length axis spans every trial and the target, with 1.4x room on each side
    assert ax.get_xlim() == pytest.approx((1024 / 1.4, 16384 * 1.4))


def test_out_of_memory_markers_sit_in_the_strip_row_named_so(figures, tmp_path):
    from autotune.outputs.plots import plot_pareto

    rows = [_row(4096, "ok", "predicted", 900.0)] + [_row(8192, "oom", "predicted") for _ in range(3)]
    rows.append(_row(16384, "oom", "measured"))
    plot_pareto(rows, [{"seq_len": 4096, "tokens_per_s": 900.0, "techniques": {}}], 8192, tmp_path / "p.png")
    ax, strip = _pareto_axes(figures[0])
    assert _markers(ax) == [(4096, 900, "tab:blue")]  # none of them on the rate axis
    height = _strip_rows(strip)["out of memory"]
    # three at one length spread 0.15 apart around the row, the measured one (a triangle) on it
    assert _markers(strip) == [
        (8192, height - 0.15, "tab:red"),
        (8192, height, "tab:red"),
        (8192, height + 0.15, "tab:red"),
        (16384, height, "tab:red"),
    ]
    markers = sorted(c.get_paths()[0].vertices.shape[0] for c in strip.collections)
    assert len(markers) == 2  # one collection per source: x for predicted, triangle for measured


@pytest.mark.parametrize(
    "statuses, counts",
    [
        (["oom"] * 4, "4 trials: 4 out of memory, 0 failed"),
        (["oom", "error", "timeout"], "3 trials: 1 out of memory, 2 failed"),
    ],
)
def test_an_all_failed_search_has_no_rate_scale_and_says_nothing_fits(figures, tmp_path, statuses, counts):
    from autotune.outputs.plots import plot_pareto

    lengths = [1024, 4096, 16384, 11264]
    rows = [_row(n, s, "predicted") for n, s in zip(lengths, statuses)]
    assert plot_pareto(rows, [], 4096, tmp_path / "p.png")["points"] == len(rows)
    _png(tmp_path / "p.png")
    ax, strip = _pareto_axes(figures[0])
    # no rate anywhere: no markers, no ticks or tick labels on the tokens/s axis, the note instead
    assert len(ax.collections) == 0 and list(ax.get_yticks()) == []
    fig = figures[0]
    fig.canvas.draw()
    assert [t.get_text() for t in ax.get_yticklabels()] == []
    (note,) = ax.texts
    assert note.get_text() == f"no config fits\n{counts} (below)"
    frame, box = ax.get_window_extent(), note.get_window_extent()
    assert frame.x0 < box.x0 and box.x1 < frame.x1 and frame.y0 < box.y0 and box.y1 < frame.y1
    # the trials in the strip; a length axis around them and the target
    assert len(_markers(strip)) == len(rows)
    lo = min(lengths[: len(rows)] + [4096])
    hi = max(lengths[: len(rows)] + [4096])
    assert ax.get_xlim() == pytest.approx((lo / 1.4, hi * 1.4))
    low, high = strip.get_xlim()
    shown = [t.get_text() for t in strip.get_xticklabels() if low <= t.get_position()[0] <= high]
    assert shown == ["1K", "2K", "4K", "8K", "16K"]  # lengths as a user types them


# The llama3-8b 5M search's front (docs/gallery/llama3-8b-5M-pareto.png): three points within 6 pixels of one
# another near 5M, two apart at 0.5-0.6M.
_MAIN = {
    "fsdp": True,
    "optimizer_offload": True,
    "activation_checkpointing": True,
    "activation_offload_layers": 32,
    "mlp_tile_tokens": 65536,
    "loss_tile_tokens": 8192,
    "norm_tile_tokens": 65536,
}
MAIN_FRONT = [
    (5505024, 355.2, {**_MAIN, "ulysses_degree": 8}),
    (5439488, 359.5, {**_MAIN, "ulysses_degree": 8}),
    (5242880, 372.9, {**_MAIN, "ulysses_degree": 8}),
    (655360, 2837.8, _MAIN),
    (463872, 3916.5, _MAIN),
]


def _drawn_labels(fig, ax):
    """The front's labels as (text, pixel box, the point it points at in pixels)."""
    fig.canvas.draw()
    return [(t.get_text(), t.get_window_extent(), tuple(ax.transData.transform(t.xy))) for t in ax.texts]


def _assert_clear(fig, ax, front):
    """Every label inside the axes, apart from every other label and from every front marker (7-pixel
    markers: 3.5 pixels around the point)."""
    labels = _drawn_labels(fig, ax)
    frame = ax.get_window_extent()
    markers = [ax.transData.transform((f["seq_len"], f["tokens_per_s"])) for f in front]
    for i, (text, box, _) in enumerate(labels):
        assert frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1, text
        for other, other_box, _ in labels[i + 1 :]:
            assert not box.overlaps(other_box), (text, other)
        for x, y in markers:
            assert not (box.x0 - 3.5 < x < box.x1 + 3.5 and box.y0 - 3.5 < y < box.y1 + 3.5), (text, x, y)
    return labels


def _front(points):
    return [{"seq_len": s, "tokens_per_s": t, "techniques": tech} for s, t, tech in points]


def _fits(front):
    """The trials of a front: each point a predicted trial that fits."""
    return [_row(f["seq_len"], "ok", "predicted", f["tokens_per_s"]) for f in front]


def test_the_main_jobs_front_labels_do_not_overlap(figures, tmp_path):
    from autotune.outputs.plots import plot_pareto

    front = _front(MAIN_FRONT)
    plot_pareto(_fits(front) + [_row(7414784, "oom", "predicted")], front, 5242880, tmp_path / "p.png")
    fig = figures[0]
    ax, _ = _pareto_axes(fig)
    labels = _assert_clear(fig, ax, front)
    # the three near 5M share a config: one label for them, pointing at the fastest of them; one each for the rest
    at = {text: point for text, _, point in labels}
    assert sorted(at) == ["fsdp+optoff ac+off32 tiled", "fsdp+optoff sp8 ac+off32 tiled (3 points)"]
    assert at["fsdp+optoff sp8 ac+off32 tiled (3 points)"] == pytest.approx(
        tuple(ax.transData.transform((5242880, 372.9)))
    )
    points = sorted(point for text, _, point in labels if text == "fsdp+optoff ac+off32 tiled")
    expected = sorted(tuple(ax.transData.transform((s, t))) for s, t, _ in MAIN_FRONT[3:])
    assert [c for p in points for c in p] == pytest.approx([c for p in expected for c in p])


def test_near_points_with_different_configs_share_one_label_listing_each(figures, tmp_path):
    from autotune.outputs.plots import plot_pareto

    configs = [{"fsdp": True}, {"fsdp": True, "optimizer_offload": True}, {"ulysses_degree": 8}, {}]
    front = _front([(5_000_000 + 100_000 * i, 420.0 - 10 * i, c) for i, c in enumerate(configs)])
    front.append({"seq_len": 400_000, "tokens_per_s": 4000.0, "techniques": {"fsdp": True}})
    plot_pareto(_fits(front), front, 5242880, tmp_path / "p.png")
    ax, _ = _pareto_axes(figures[0])
    labels = _assert_clear(figures[0], ax, front)
    assert sorted(text for text, _, _ in labels) == [
        "5,000,000: fsdp\n5,100,000: fsdp+optoff\n5,200,000: sp8\n5,300,000: baseline",
        "fsdp",
    ]


def test_labels_that_would_collide_stack_with_leader_lines(figures, tmp_path):
    from autotune.outputs.plots import plot_pareto

    # four points at one rate, 2^0.625 apart on a length axis of 16 doublings (two more trials widen it):
    # apart enough for labels of their own (over 30 pixels), closer than a label is long
    configs = [
        {"fsdp": True, "optimizer_offload": True, "activation_checkpointing": True},
        {"fsdp": True, "ulysses_degree": 8, "activation_checkpointing": True},
        {"fsdp": True, "ulysses_degree": 4, "loss_tile_tokens": 8192},
        {"fsdp": True, "ulysses_degree": 2, "mlp_tile_tokens": 65536},
    ]
    front = _front([(round(2**20 * 2 ** (0.625 * i)), 1000.0 - i, c) for i, c in enumerate(configs)])
    wide = [_row(2**13, "ok", "predicted", 10.0), _row(2**28, "ok", "predicted", 10.0)]
    plot_pareto(_fits(front) + wide, front, 2**20, tmp_path / "p.png")
    ax, _ = _pareto_axes(figures[0])
    labels = _assert_clear(figures[0], ax, front)
    assert len(labels) == 4
    xs = [ax.transData.transform((f["seq_len"], f["tokens_per_s"]))[0] for f in front]
    assert all(30 < b - a < min(box.width for _, box, _ in labels) for a, b in zip(xs, xs[1:]))
    # each label points at its own point; the ones moved off their point's side carry a leader line to it
    for (_, _, point), f in zip(sorted(labels, key=lambda t: t[2]), front):
        assert point == pytest.approx(tuple(ax.transData.transform((f["seq_len"], f["tokens_per_s"]))))
    moved = [t for t in ax.texts if t.arrow_patch is not None]
    assert moved, "no label needed to move: the case does not test stacking"
    for t in moved:
        box, y = t.get_window_extent(), ax.transData.transform(t.xy)[1]
        assert box.y0 > y + 5 or box.y1 < y - 5  # a text height or more above or below


def test_the_memory_plot_stacks_each_front_points_breakdown(figures, tmp_path):
    from autotune.outputs.report import plot_front_memory

    gib = 2**30

    def point(seq_len, params, activations, temporaries):
        breakdown = {
            "params": params * gib,
            "grads": 0,
            "optimizer": 0,
            "activations": activations * gib,
            "temporaries": temporaries * gib,
            "other": 0,
        }
        record = {
            "seq_len": seq_len,
            "status": "ok",
            "breakdown": breakdown,
            "peak_device_bytes": sum(breakdown.values()),
            "host_bytes": 0,
        }
        return {"seq_len": seq_len, "tokens_per_s": 1.0, "techniques": {}, "record": record}

    front = [point(1024, 1, 2, 0), point(2048, 1, 3, 1), point(4096, 0.5, 4, 2)]
    assert plot_front_memory(front, 8 * gib, tmp_path / "memory.png") == 3
    _png(tmp_path / "memory.png")
    (fig,) = figures
    ax = fig.axes[0]
    stacks: dict[float, list[float]] = {}
    tops: dict[float, float] = {}
    for container in ax.containers:
        for bar in container:
            x = round(bar.get_x() + bar.get_width() / 2, 6)
            stacks.setdefault(x, []).append(bar.get_height())
            tops[x] = max(tops.get(x, 0.0), bar.get_y() + bar.get_height())
    # one stack per front point (x = 0, 1, 2), each category's GiB in the order of the breakdown, one on another:
    # 1 + 2 = 3, 1 + 3 + 1 = 5 and 0.5 + 4 + 2 = 6.5 GiB high
    assert sorted(stacks) == [0, 1, 2]
    assert [stacks[x] for x in (0, 1, 2)] == [[1, 0, 0, 2, 0, 0], [1, 0, 0, 3, 1, 0], [0.5, 0, 0, 4, 2, 0]]
    assert [tops[x] for x in (0, 1, 2)] == [3, 5, 6.5]


def test_a_searchs_plots_are_pngs_of_a_sensible_size(search_dir):
    rows = pq.read_table(search_dir / "trials.parquet").to_pylist()
    assert len(rows) == 12 and json.loads((search_dir / "pareto.json").read_text())["front"]
    _png(search_dir / "pareto.png")
    _png(search_dir / "memory.png")


def test_a_search_writes_the_front_peak_configs_memory_timeline(search_dir):
    """front-memory.html beside memory.png: the predicted timeline of the front point with the highest peak; on the
    cpu preset its replay peak is that point's predicted peak to the byte."""
    from trials.trial.memory_timeline import replay_peak, snapshots_in_html

    front = json.loads((search_dir / "pareto.json").read_text())["front"]
    peak = max(f["record"]["peak_device_bytes"] for f in front if f["record"]["status"] == "ok")
    (snapshot,) = snapshots_in_html((search_dir / "front-memory.html").read_text())
    assert replay_peak(snapshot) == peak


def test_plot_command_redraws_and_writes_the_interactive_html(search_dir):
    pytest.importorskip("plotly")
    for name in ("pareto.png", "memory.png", "pareto.html"):
        (search_dir / name).unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "plot", str(search_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("pareto.png", "memory.png"):
        _png(search_dir / name)
    html = (search_dir / "pareto.html").read_text()
    assert "Plotly.newPlot" in html and "seq_len (tokens)" in html


@pytest.mark.parametrize(
    "tops, capacity, notes",
    [
        # the llama3-8b 5M front (docs/gallery/llama3-8b-5M-memory.png): four bars just under the 79.65 GiB line
        (
            [79.43, 78.57, 75.99, 75.92, 55.83],
            79.65,
            ["79.4 GiB\nhost 158.9", "78.6 GiB\nhost 157.1", "76.0 GiB\nhost 152.0", "75.9 GiB\nhost 151.8"]
            + ["55.8 GiB\nhost 111.7"],
        ),
        # one bar over the line, one just under it, one far under it; below 1 GiB two significant digits
        ([0.6, 0.48, 0.1], 0.5, ["0.6 GiB\nhost 1.2", "0.48 GiB\nhost 0.96", "0.1 GiB\nhost 0.2"]),
    ],
)
def test_the_capacity_line_crosses_no_bar_note(figures, tmp_path, tops, capacity, notes):
    from autotune.outputs.plots import plot_memory

    gib = 2**30
    records = [
        {
            "seq_len": 2**20 * (i + 1),
            "status": "ok",
            "breakdown": {"params": top * 0.1 * gib, "temporaries": top * 0.9 * gib},
            "peak_device_bytes": top * gib,
            "host_bytes": 2 * top * gib,
        }
        for i, top in enumerate(tops)
    ]
    assert plot_memory(records, capacity * gib, tmp_path / "memory.png") == len(tops)
    _png(tmp_path / "memory.png")
    (fig,) = figures
    ax = fig.axes[0]
    fig.canvas.draw()
    (line,) = [line for line in ax.lines if line.get_label() == f"device capacity {capacity:g} GiB"]
    assert list(line.get_ydata()) == [capacity, capacity]
    line_y = ax.transData.transform((0, capacity))[1]
    half_width = line.get_linewidth() * fig.dpi / 72 / 2
    frame = ax.get_window_extent()
    drawn = sorted(ax.texts, key=lambda t: t.get_window_extent().x0)
    assert [t.get_text() for t in drawn] == notes
    for i, (note, top) in enumerate(zip(drawn, tops)):
        box = note.get_window_extent()
        assert box.y1 < line_y - half_width or box.y0 > line_y + half_width, note.get_text()
        # inside the axes, centred over its bar, not below its top
        assert frame.y0 < box.y0 and box.y1 < frame.y1
        assert (box.x0 + box.x1) / 2 == pytest.approx(ax.transData.transform((i, 0))[0], abs=1)
        assert box.y0 >= ax.transData.transform((0, top))[1]


def test_the_host_capacity_is_each_notes_measure_and_a_legend_entry(figures, tmp_path):
    """Where the host memory per rank is checked, each bar's host figure reads against it and the legend names it
    beside the device's capacity (as the preset states it, not rounded); where it is not, neither appears."""
    from autotune.outputs.plots import plot_memory

    gib = 2**30
    record = {"seq_len": 2**20, "status": "ok", "breakdown": {"params": 60 * gib}, "peak_device_bytes": 60 * gib}
    for host_capacity, note, legend in (
        (int(232.8 * gib), "60.0 GiB\nhost 231.4 of 232.8", "host capacity 232.80 GiB per rank"),
        (0, "60.0 GiB\nhost 231.4", None),
    ):
        figures.clear()
        plot_memory([{**record, "host_bytes": int(231.4 * gib)}], int(79.65 * gib), tmp_path / "m.png",
                    host_capacity=host_capacity)  # fmt: skip
        (fig,) = figures
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.texts] == [note]
        labels = ax.get_legend_handles_labels()[1]
        assert "device capacity 79.65 GiB" in labels
        assert [label for label in labels if label.startswith("host")] == ([legend] if legend else [])


def test_the_pareto_plot_marks_best_jsons_config(figures, tmp_path):
    """pareto.json's ``best`` (best.json's config at the target) is a star of its own, named in the legend; a search
    without one draws none."""
    from autotune.outputs.plots import plot_pareto

    rows = [_row(2048, "ok", "predicted", 4000.0), _row(4096, "ok", "predicted", 2000.0)]
    front = [{"seq_len": s, "tokens_per_s": t, "techniques": {}} for s, t in ((2048, 4000.0), (4096, 2000.0))]
    best = {"trial": 7, "seq_len": 4096, "tokens_per_s": 2000.0}
    assert plot_pareto(rows, front, 4096, tmp_path / "p.png", best=best) == {"points": 2, "front": 2, "best": 1}
    ax = _pareto_axes(figures[0])[0]
    (star,) = [line for line in ax.lines if line.get_label() == "best.json (trial 7)"]
    assert (list(star.get_xdata()), list(star.get_ydata()), star.get_marker()) == ([4096], [2000.0], "*")
    assert plot_pareto(rows, front, 4096, tmp_path / "p.png", best=None)["best"] == 0


def test_labels_tell_apart_configs_that_differ_only_in_knobs_their_short_label_hides(figures, tmp_path):
    """Front points whose short labels read alike (the tile sizes behind ``tiled``) are labelled with the knobs that
    differ between them, in the Pareto plot and in the memory plot; configs that are the same read the same."""
    from autotune.outputs.plots import knob_labels, plot_pareto
    from autotune.outputs.report import plot_front_memory

    base = {"fsdp": True, "ulysses_degree": 8, "activation_checkpointing": True, "attention": "flash3"}
    configs = [
        {**base, "mlp_tile_tokens": 16384},
        {**base, "mlp_tile_tokens": 4096},
        {**base, "loss_tile_tokens": 2048},
    ]
    assert knob_labels(configs + [configs[0]]) == [
        "fsdp sp8 ac tiled flash3 mlp_tile_tokens=16K loss_tile_tokens=off",
        "fsdp sp8 ac tiled flash3 mlp_tile_tokens=4K loss_tile_tokens=off",
        "fsdp sp8 ac tiled flash3 mlp_tile_tokens=off loss_tile_tokens=2K",
        "fsdp sp8 ac tiled flash3 mlp_tile_tokens=16K loss_tile_tokens=off",
    ]
    assert knob_labels([{"fsdp": True}, {}]) == ["fsdp", "baseline"]  # the short labels tell these apart
    front = _front([(2**20 * 4**i, 1000.0 / (i + 1), c) for i, c in enumerate(configs)])
    plot_pareto(_fits(front), front, 2**20, tmp_path / "p.png")
    ax, _ = _pareto_axes(figures[0])
    texts = sorted(text for text, _, _ in _assert_clear(figures[0], ax, front))
    assert texts == sorted(knob_labels(configs))
    for f in front:
        f["record"] = {"seq_len": f["seq_len"], "status": "ok", "breakdown": {}, "peak_device_bytes": 2**30}
    plot_front_memory(front, 8 * 2**30, tmp_path / "memory.png")
    ticks = [t.get_text() for t in figures[1].axes[0].get_xticklabels()]
    assert len(set(ticks)) == 3 and all(label in tick for tick, label in zip(ticks, knob_labels(configs)))


def test_a_plots_title_names_the_model_not_the_path_of_its_config(tmp_path, monkeypatch):
    """A model given as a config.json path is named by its folder; ``estimate --plot`` titles its figure with the
    model, the length, the world, the step time and tokens/s (the "time" its help promises)."""
    from autotune.cli import main
    from autotune.outputs import plots

    assert plots.model_title("/data/models/Qwen3-8B/config.json") == "Qwen3-8B"
    assert plots.model_title("/data/qwen3.json") == "qwen3" and plots.model_title("llama3-8b") == "llama3-8b"
    folder = tmp_path / "Tiny-Model"
    folder.mkdir()
    (folder / "config.json").write_text((ROOT / "trials/models/presets/tiny-llama.json").read_text())
    titles = []
    monkeypatch.setattr(plots, "plot_memory", lambda *args, title="", **kwargs: titles.append(title))
    argv = ["estimate", "--model", str(folder / "config.json"), "--config", "baseline", "--seq", "1K"]
    assert main([*argv, "--hardware", "cpu", "--gpus", "1", "--plot", str(tmp_path / "m.png")]) == 0
    (title,) = titles
    assert title.startswith("Tiny-Model, 1,024 (1K) tokens on 1x cpu") and str(tmp_path) not in title
    assert " s, " in title and "tokens/s" in title
