"""The spine end to end: a real local search on CPU (issue 2's done-when)."""

import json

import pyarrow.parquet as pq
import pytest
from conftest import run_cli


@pytest.mark.slow
def test_local_search_end_to_end(tmp_path):
    # --no-prefilter: every trial runs for real, so the OOM below comes from the tracked capacity itself (0.09 GiB:
    # the first trial, the baseline at 1K, stops above it; the second, at the 2K target, fits with a fifth to spare)
    out = tmp_path / "search"
    result = run_cli(
        "search",
        "--model",
        "tiny-llama",
        "--target",
        "2K",
        "--gpus",
        "2",
        "--backend",
        "local",
        "--memory-gib",
        "0.09",
        "--trials",
        "2",
        "--out",
        str(out),
        "--no-prefilter",
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("study.db", "trials.parquet", "pareto.json", "pareto.png", "best.json"):
        assert (out / name).is_file(), name
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    assert len(rows) >= 2
    measured = [r for r in rows if r["answered_by"] == "local"]
    assert measured and all(r["source"] == "measured" for r in measured)
    assert any(r["status"] == "oom" for r in rows), [(r["seq_len"], r["status"]) for r in rows]
    assert any(r["status"] == "ok" and r["tokens_per_s"] > 0 for r in measured)
    best = json.loads((out / "best.json").read_text())
    assert best["schema"] == "autotune/config-v1" and best["seq_len"] >= 2048
    assert best["measured"]["status"] == "ok"
