"""Quiet by default, whole lines when piped (issue 35, item 5): the installed ``autotune`` as a user runs it in a
log or CI, stdout and stderr pipes (not a terminal), with a fresh plan store and a fresh torch extensions folder.

- no stderr line comes from DeepSpeed or torch: the accelerator banner (``autotune.core.quiet``), the JIT build of
  DeepSpeed's shared-memory comm op (``trials.core.patches.deepspeed_shm_comm_op_skipped``; the extensions folder stays
  empty), Python warnings; in the search's plan workers as much as in the command's own process;
- ``$AUTOTUNE_VERBOSE=1`` (what ``-v`` sets) shows DeepSpeed's banner again: the patterns below do see it;
- the search's progress is whole lines (``autotune.outputs.progress``): one per trial and a summary, never a bar
  cut to 80 columns (``t… ok 6 … fastest trial >= target: 5,2…``)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, tiny_plan_search

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

AUTOTUNE = Path(sys.executable).parent / "autotune"  # the installed CLI of the environment running the tests
TRIALS = 6

# a library's voice: DeepSpeed's logger ("[2026-...] [WARNING] [real_accelerator.py:213:get_accelerator] ..."),
# its op builder ("DeepSpeed ... built successfully", ninja, g++), a Python warning ("x.py:12: UserWarning: ..."),
# torch's C++ log ("[W1125 20:01:02.000 ProcessGroupGloo.cpp:...]")
NOISE = re.compile(
    r"\[WARNING\]|\[INFO\]|real_accelerator|(?i:deepspeed)|ninja|g\+\+|c\+\+|\w+Warning\b|"
    r"\.(py|cpp|h):\d+|^\[[WIE]\d{4}|^\[rank\d+\]"
)
TRIAL_LINE = re.compile(
    r"trial \d+: [\d,]+ tokens (ok|oom|error|timeout) ([\d,]+ tok/s|-) peak ([\d.]+ [GMK]iB|-) \([\w ,.-]+\)"
)
SUMMARY_LINE = re.compile(
    rf"trials {TRIALS} of {TRIALS}: ok \d+  oom \d+  failed \d+  answered without running \d+ \| "
    r"(fastest trial >= target: [\d,]+( \([\d.]+[KM]\))? at [\d,]+ tok/s|no config reaches the target yet)"
)
# ulysses (deepspeed.comm, UlyssesSPAttentionHF) and MLP tiling (TiledMLP): DeepSpeed on the plan path
DEEPSPEED_CONFIG = {
    "schema": "autotune/config-v1",
    "model": "tiny-llama",
    "hardware": "cpu",
    "gpus": 2,
    "seq_len": 2048,
    "techniques": {"ulysses_degree": 2, "mlp_tile_tokens": 1024},
}


def _autotune(folder: Path, *args: str, verbose: bool = False) -> tuple[subprocess.CompletedProcess, Path]:
    """``autotune ARGS`` with pipes for stdout and stderr and fresh caches under ``folder``; returns the result and
    the torch extensions folder (what a JIT build would write)."""
    extensions = folder / "torch_extensions"
    extensions.mkdir(parents=True)
    env = {
        key: value
        for key, value in os.environ.items()
        # a terminal's width or rich's terminal overrides would hide what a log sees (80 columns, no terminal)
        if key not in ("COLUMNS", "LINES", "FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "AUTOTUNE_VERBOSE")
    }
    # two plan workers (a user's default on two cores): what they print is checked too
    env.update(AUTOTUNE_CACHE_DIR=str(folder / "cache"), TORCH_EXTENSIONS_DIR=str(extensions), AUTOTUNE_WORKERS="2")
    if verbose:
        env["AUTOTUNE_VERBOSE"] = "1"
    result = subprocess.run(
        [str(AUTOTUNE), *args], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env, stdin=subprocess.DEVNULL
    )
    return result, extensions


def _noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if NOISE.search(line)]


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    folder = tmp_path_factory.mktemp("search")
    out = folder / "out"
    result, extensions = _autotune(
        folder,
        *("search", *tiny_plan_search(), "--trials", str(TRIALS), "--out", str(out)),
    )
    assert result.returncode == 0, result.stderr
    return result, extensions, out


@pytest.fixture(scope="module")
def deepspeed_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("config") / "sp2.json"
    path.write_text(json.dumps(DEEPSPEED_CONFIG))
    return path


def test_search_says_nothing_of_deepspeed_or_torch(search):
    import pyarrow.parquet as pq

    result, extensions, out = search
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    # DeepSpeed ran in a worker: a ulysses trial was traced, not refused
    assert any(row["ulysses_degree"] > 1 and row["status"] in ("ok", "oom") for row in rows), rows
    assert _noise(result.stderr) == []
    assert _noise(result.stdout) == []
    assert sorted(p.name for p in extensions.iterdir()) == []  # nothing JIT-built


def test_search_progress_is_whole_lines(search):
    result = search[0]
    lines = result.stderr.splitlines()
    assert "…" not in result.stderr and "…" not in result.stdout
    trial_lines = [line for line in lines if line.startswith("trial ")]
    assert len(trial_lines) == TRIALS, lines
    for line in trial_lines:
        assert TRIAL_LINE.fullmatch(line), line
    summaries = [line for line in lines if line.startswith("trials ")]
    assert len(summaries) == 1 and SUMMARY_LINE.fullmatch(summaries[0]), lines
    assert len(summaries[0]) > 80  # longer than a piped console's width, on one line all the same
    assert lines.index(summaries[0]) > lines.index(trial_lines[-1])


def test_search_header_and_best_are_one_line_each(search):
    result, _, out = search
    assert any(
        line.startswith("autotune: tiny-llama") and line.endswith(f"out {out}") for line in result.stderr.splitlines()
    )
    assert any(
        line.startswith("best for ") and line.endswith(str(out / "best.json")) for line in result.stdout.splitlines()
    )


def test_estimate_of_a_deepspeed_config_is_quiet_and_verbose_shows_it(tmp_path, deepspeed_config):
    quiet, extensions = _autotune(tmp_path / "quiet", "estimate", "--config", str(deepspeed_config), "--json")
    assert quiet.returncode == 0, quiet.stderr
    assert json.loads(quiet.stdout)["status"] == "ok"
    assert _noise(quiet.stderr) == []
    assert list(extensions.iterdir()) == []
    # the same command, verbose: DeepSpeed's banner is back (so the patterns above would see it), still no build
    verbose, extensions = _autotune(
        tmp_path / "verbose", "estimate", "--config", str(deepspeed_config), "--json", verbose=True
    )
    assert verbose.returncode == 0, verbose.stderr
    assert any("Setting accelerator to CPU" in line for line in _noise(verbose.stderr)), verbose.stderr
    assert list(extensions.iterdir()) == []
