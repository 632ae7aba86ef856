"""Live progress for a search: trials done / answered without running / failed, and the fastest trial so far
that reaches the target, at its own length (``best.json`` is chosen after the trials, at the target itself).

On a terminal, a rich progress bar. Anywhere else (a pipe, a log file, CI) whole lines instead: one per trial and
a summary at the end, each written as is -- a bar rendered to a console that is not a terminal is cut to its width
(``t… ok 6 … fastest trial >= target: 5,2…``), and a long line wrapped by rich breaks mid-word or mid-path."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column

from autotune.core.sizes import format_memory, format_tokens


class SearchProgress:
    """Fed by the search's per-trial callback: a rich progress bar on a terminal, whole lines elsewhere."""

    def __init__(self, job, console: Console, enabled: bool = True):
        self.job, self.console, self.enabled = job, console, enabled
        self.live = enabled and console.is_terminal  # the bar; otherwise (enabled) plain lines
        self.counts = {"ok": 0, "oom": 0, "error": 0, "timeout": 0, "skipped": 0}
        self.done = 0
        self.polished = 0  # trials ``autotune.search.polish`` added (one knob from the front), beyond the budget
        self.best: tuple[int, float] | None = None
        self._progress = Progress(  # the count and the time first: a narrow terminal cuts the tally, not them
            TextColumn("[bold]trials", table_column=Column(no_wrap=True, min_width=len("trials"))),
            MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=2 * len(str(job.trials)) + 1)),
            TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=len("0:00:00"))),
            BarColumn(bar_width=20),  # dropped before the count and the time where the width is short
            TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=True, overflow="ellipsis")),
            console=console,
            disable=not self.live,
            transient=False,
        )
        self._task = None

    def __enter__(self):
        self._progress.__enter__()
        self._task = self._progress.add_task(self._describe(), total=self.job.trials)
        return self

    def __exit__(self, *exc):
        result = self._progress.__exit__(*exc)
        if self.enabled and not self.live:
            polished = f" (+{self.polished} one knob from the front)" if self.polished else ""
            self._line(f"trials {self.done} of {self.job.trials}{polished}: {self._describe()}")
        return result

    def _line(self, text: str) -> None:
        """One line, as written: no markup, no highlighting, never wrapped or cut to the console's width."""
        self.console.print(text, markup=False, highlight=False, soft_wrap=True)

    def _describe(self) -> str:
        c = self.counts
        best = (
            f"fastest trial >= target: {format_tokens(self.best[0])} at {self.best[1]:,.0f} tok/s"
            if self.best
            else "no config reaches the target yet"
        )
        return (
            f"ok {c['ok']}  oom {c['oom']}  failed {c['error'] + c['timeout']}  "
            f"answered without running {c['skipped']} | {best}"
        )

    def on_polish_record(self, record) -> None:
        """A trial ``autotune.search.polish`` added: counted, and a faster config at the target, without a line."""
        self.polished += 1
        self._tally(record, None)

    def on_record(self, number: int, techniques, record, answered_by) -> None:
        self.done += 1
        self._tally(record, answered_by)
        if self._task is not None:
            self._progress.update(self._task, advance=1, description=self._describe())
        if self.enabled and not self.live:  # logs get one line per trial instead of a bar
            # an OOM plan record may carry the rate it would have had: only a config that fits has a rate
            rate = f"{record.tokens_per_s:,.0f} tok/s" if record.status == "ok" and record.tokens_per_s else "-"
            peak = format_memory(record.peak_device_bytes) if record.peak_device_bytes else "-"
            self._line(
                f"trial {number}: {record.seq_len:,} tokens {record.status} {rate} peak {peak} "
                f"({answered_by or record.source})"
            )

    def _tally(self, record, answered_by) -> None:
        self.counts[record.status] = self.counts.get(record.status, 0) + 1
        if answered_by is not None:
            self.counts["skipped"] += 1
        if record.status == "ok" and record.seq_len >= self.job.target and record.tokens_per_s:
            if self.best is None or record.tokens_per_s > self.best[1]:
                self.best = (record.seq_len, record.tokens_per_s)
