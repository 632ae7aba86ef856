"""The per-trial log line of a search (what a non-terminal console, e.g. CI or a log file, shows)."""

import io
from types import SimpleNamespace

from rich.console import Console

from autotune.core.record import ResultRecord
from autotune.outputs.progress import SearchProgress


def _lines(*records):
    out = io.StringIO()
    progress = SearchProgress(SimpleNamespace(trials=len(records), target=4096), Console(file=out, width=200))
    with progress:
        for number, (record, how) in enumerate(records):
            progress.on_record(number, None, record, how)
    return [line for line in out.getvalue().splitlines() if line.startswith("trial ")], progress


def test_oom_lines_show_no_rate_and_best_counts_only_fits():
    fits = ResultRecord(status="ok", source="predicted", seq_len=4096, tokens_per_s=1234.0, peak_device_bytes=2**30)
    # a plan OOM keeps the rate it would have had if it fit; the log must not present it as achieved
    oom = ResultRecord(status="oom", source="predicted", seq_len=8192, tokens_per_s=999.0, peak_device_bytes=3 * 2**30)
    lines, progress = _lines((fits, None), (oom, "oracle"))
    assert lines[0] == "trial 0: 4,096 tokens ok 1,234 tok/s peak 1.0 GiB (predicted)"
    assert lines[1] == "trial 1: 8,192 tokens oom - peak 3.0 GiB (oracle)"
    assert progress.best == (4096, 1234.0)
    tiny = ResultRecord(status="ok", source="measured", seq_len=1024, tokens_per_s=5.0, peak_device_bytes=76 * 2**20)
    assert _lines((tiny, None))[0][0] == "trial 0: 1,024 tokens ok 5 tok/s peak 76 MiB (measured)"  # not 0.1 GiB
    assert progress.counts == {"ok": 1, "oom": 1, "error": 0, "timeout": 0, "skipped": 1}


def test_the_bar_keeps_its_count_and_time_on_an_80_column_terminal():
    """On a terminal of 80 columns the tally is what gets cut, never the n/N count or the elapsed time."""
    out = io.StringIO()
    console = Console(file=out, width=80, force_terminal=True, color_system=None)
    progress = SearchProgress(SimpleNamespace(trials=30, target=4096), console)
    record = ResultRecord(status="ok", source="predicted", seq_len=4096, tokens_per_s=1234.0, peak_device_bytes=2**30)
    with progress:
        for number in range(3):
            progress.on_record(number, None, record, None)
    last = [line for line in out.getvalue().replace("\r", "\n").splitlines() if "trials" in line][-1]
    assert "3/30" in last and "0:00:0" in last, last
