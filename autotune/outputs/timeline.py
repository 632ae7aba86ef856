"""Memory timelines as files: torch's viewer page (``--memory-timeline FILE.html``) and the snapshot itself
(``--memory-snapshot FILE.pickle``, which pytorch.org/memory_viz opens), for a prediction (``estimate``), a
measured trial beside its prediction (``trial``), and the front's peak config of a search (``front-memory.html``).

The snapshots come from ``trials.trial.memory_timeline`` (the tracker's events, or CUDA's recorded history) and
``autotune.oracle.timeline`` (a fake trace of the config)."""

from __future__ import annotations

import os
from pathlib import Path

from autotune.core.errors import UserError
from autotune.oracle.timeline import PredictedTimeline, predicted_timeline, recorded_timeline, timeline_title
from trials.trial import memory_timeline

FRONT_TIMELINE = "front-memory.html"


def check_output_file(path: Path | None, option: str) -> None:
    """Refuse (``UserError``: exit 2, one line) an output file that cannot be written: a directory, a path under a
    file, a place this process may not write. A missing folder is made, as ``export -o`` makes it. Checked by
    opening it, before any work; a file the check creates is removed again."""
    if path is None:
        return
    if path.is_dir():
        raise UserError(f"{option} {path}: is a directory; give a file name")
    existed = path.exists()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise UserError(f"{option} {path}: cannot write there ({exc.strerror or exc})") from None
    if not existed:
        os.unlink(path)


def check_rank(rank: int, world_size: int) -> None:
    """Refuse a ``--rank`` outside the job's world."""
    if not 0 <= rank < world_size:
        raise UserError(f"--rank {rank}: the job has {world_size} ranks, 0 to {world_size - 1}")


def estimate_with_timeline(backend, evaluation, rank: int, model_name: str = ""):
    """``backend.evaluate(evaluation)`` (a plan backend) and the predicted timeline of ``rank``: recorded in the
    prediction's own first trace where the backend traces rank 0, else by one more trace (a record read back from
    the plan store, or another rank). Returns (the record, the ``PredictedTimeline``)."""
    recorder = memory_timeline.TimelineRecorder() if rank == 0 else None
    backend.timeline = recorder
    try:
        record = backend.evaluate(evaluation)
    finally:
        backend.timeline = None
    prediction = backend.last_prediction
    if recorder is not None and recorder.events and prediction is not None and prediction.traces:
        return record, recorded_timeline(evaluation, recorder, prediction.traces[0], rank, model_name)
    return record, predicted_timeline(evaluation, rank, model_name)


def write_predicted(timeline: PredictedTimeline, html_path: Path | None, pickle_path: Path | None) -> None:
    """A predicted timeline's page and snapshot (either may be None)."""
    if html_path is not None:
        html_path.write_text(memory_timeline.html(timeline.snapshot, timeline.title))
    if pickle_path is not None:
        memory_timeline.write_pickle(timeline.snapshot, pickle_path)


def write_trial(
    measured: dict,
    evaluation,
    rank: int,
    reduced: bool,
    html_path: Path | None,
    pickle_path: Path | None,
    model_name: str = "",
) -> tuple[str, list[Path]]:
    """A real trial's memory timeline on ``rank`` beside the prediction for the same config and rank (one more fake
    trace): ``write_measured``. ``reduced``: the trial ran the shallow copies, and the timeline is the first
    copy's, the one the prediction traces. Returns (the measured timeline's title, the files written)."""
    predicted = predicted_timeline(evaluation, rank, model_name)
    model_layers = evaluation.model_config["num_hidden_layers"]
    on_gpu = not evaluation.hardware.device_is_host  # the trial ran on CUDA: its snapshot is the allocator's
    device = "CUDA allocator, the first measured step" if on_gpu else "cpu tracker, the whole run"
    title = timeline_title(
        "measured",
        model_name or evaluation.model_config.get("model_type", "model"),
        evaluation.seq_len,
        rank,
        evaluation.world_size,
        device,
        predicted.layers if reduced else model_layers,
        model_layers,
        memory_timeline.replay_peak(measured, _device_of(measured)),
    )
    return title, write_measured(measured, title, predicted, html_path, pickle_path)


def _device_of(snapshot: dict) -> int:
    """The device whose trace holds events (a rank's process records on its own device)."""
    traces = snapshot.get("device_traces", [])
    return next((i for i, trace in enumerate(traces) if trace), 0)


def write_measured(
    measured: dict,
    measured_title: str,
    predicted: PredictedTimeline | None,
    html_path: Path | None,
    pickle_path: Path | None,
) -> list[Path]:
    """A measured trial's snapshot beside the prediction for the same config: one page with both timelines side by
    side, each under its title; the measured snapshot at ``pickle_path`` and the predicted one beside it
    (``NAME-predicted.pickle``). Returns the files written."""
    written = []
    if html_path is not None:
        pages = [(measured_title, memory_timeline.html(measured, measured_title))]
        if predicted is not None:
            pages.append((predicted.title, memory_timeline.html(predicted.snapshot, predicted.title)))
        html_path.write_text(memory_timeline.side_by_side_html(pages))
        written.append(html_path)
    if pickle_path is not None:
        memory_timeline.write_pickle(measured, pickle_path)
        written.append(pickle_path)
        if predicted is not None:
            beside = predicted_pickle_path(pickle_path)
            memory_timeline.write_pickle(predicted.snapshot, beside)
            written.append(beside)
    return written


def predicted_pickle_path(pickle_path: Path) -> Path:
    """Where ``trial --memory-snapshot`` puts the prediction beside the measured snapshot."""
    return pickle_path.with_name(f"{pickle_path.stem}-predicted{pickle_path.suffix or '.pickle'}")


def peak_front_entry(front: list[dict]) -> dict | None:
    """The front's point with the highest peak device memory (the longest where peaks tie): the one at the wall."""
    fitting = [f for f in front if (f.get("record") or {}).get("status") == "ok"] or front
    if not fitting:
        return None
    return max(fitting, key=lambda f: ((f["record"] or {}).get("peak_device_bytes") or 0, f["seq_len"]))


def write_front_timeline(job, front: list[dict], out: Path) -> Path | None:
    """``front-memory.html`` beside ``memory.png``: the predicted timeline of the front's peak config
    (``peak_front_entry``) on rank 0, from one more trace of that config. None (and no file) without a front."""
    from trials.stack.techniques import Techniques

    path = out / FRONT_TIMELINE
    path.unlink(missing_ok=True)  # a previous front's
    entry = peak_front_entry(front)
    if entry is None:
        return None
    techniques = Techniques.from_dict(entry["techniques"])
    timeline = predicted_timeline(job.evaluation(techniques, entry["seq_len"]), 0, job.model)
    title = f"{timeline.title} (the front's peak config, trial {entry['trial']})"
    path.write_text(memory_timeline.html(memory_timeline.titled(timeline.snapshot, title), title))
    return path
