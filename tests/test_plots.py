"""The plots of a search folder (issue 7): valid PNGs of a sensible size holding one marker per trial and one
bar per front point -- the expected counts read back from trials.parquet and pareto.json -- and pareto.html."""

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
    done = subprocess.run([sys.executable, "-m", "autotune.cli", "search", "--model", "tiny-llama", "--target", "4K",
                           "--gpus", "2", "--hardware", "cpu", "--memory-gib", "0.5", "--backend", "plan",
                           "--trials", "12", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    return out


def _png(path):
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = mpimg.imread(path)
    height, width = pixels.shape[:2]
    assert 400 <= width <= 3000 and 300 <= height <= 2000
    assert pixels.std() > 0.01  # not a blank canvas


def test_pareto_and_memory_plots_hold_every_trial_and_front_point(search_dir, tmp_path):
    from autotune.outputs.plots import plot_pareto
    from autotune.outputs.report import plot_front_memory

    rows = pq.read_table(search_dir / "trials.parquet").to_pylist()
    doc = json.loads((search_dir / "pareto.json").read_text())
    drawn_trials = [r for r in rows if (r["status"] == "ok" and r["tokens_per_s"])
                    or r["status"] in ("oom", "error", "timeout")]
    assert len(rows) == 12 and doc["front"]
    _png(search_dir / "pareto.png")
    _png(search_dir / "memory.png")
    drawn = plot_pareto(rows, doc["front"], doc["target"], tmp_path / "pareto.png")
    assert drawn == {"points": len(drawn_trials), "front": len(doc["front"])}
    bars = plot_front_memory(doc["front"], doc["capacity_bytes"], tmp_path / "memory.png")
    assert bars == len(doc["front"])
    _png(tmp_path / "pareto.png")
    _png(tmp_path / "memory.png")


def test_plot_command_redraws_and_writes_the_interactive_html(search_dir):
    pytest.importorskip("plotly")
    for name in ("pareto.png", "memory.png", "pareto.html"):
        (search_dir / name).unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "autotune.cli", "plot", str(search_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    for name in ("pareto.png", "memory.png"):
        _png(search_dir / name)
    html = (search_dir / "pareto.html").read_text()
    assert "Plotly.newPlot" in html and "seq_len (tokens)" in html
