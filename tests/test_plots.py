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
    assert plot_pareto(rows, front, 4096, tmp_path / "pareto.png") == {"points": 9, "front": 3}
    _png(tmp_path / "pareto.png")
    (fig,) = figures
    (ax,) = fig.axes
    # the four that fit at their rates; the five without one on the floor, half the slowest rate (2000 / 2)
    assert _markers(ax) == sorted(
        [
            (1024, 5000, "tab:blue"),
            (2048, 4000, "tab:blue"),
            (4096, 2000, "tab:blue"),
            (2048, 3800, "tab:blue"),
            (8192, 1000, "tab:red"),
            (8192, 1000, "tab:red"),
            (16384, 1000, "tab:red"),
            (4096, 1000, "grey"),
            (8192, 1000, "grey"),
        ]
    )
    (line,) = [line for line in ax.lines if line.get_label() == "Pareto front"]
    assert list(line.get_xdata()) == [1024, 2048, 4096] and list(line.get_ydata()) == [5000, 4000, 2000]


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
