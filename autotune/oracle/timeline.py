"""A predicted step's memory timeline: one fake trace of a config with a ``trials.trial.memory_timeline.TimelineRecorder``,
as a torch memory snapshot that torch's viewer draws.

The trace is the one the oracle's prediction starts from: the model itself when it has at most
``EXTRAPOLATE_FROM[1]`` layers, else its shallow copy (each run of identical layers cut to ``EXTRAPOLATE_FROM[0]``).
The picture shows the traced copy's layers as they ran and says how many identical layers the model has; it does
not draw an extension. Its peak (the largest sum of live sizes) is that trace's tensor peak, which for a model
traced whole is the oracle's predicted tensor peak."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.core.evaluation import Evaluation
from autotune.core.sizes import format_tokens
from autotune.oracle.extrapolation import plan_traces
from autotune.oracle.results import Trace
from autotune.oracle.tracing import compute_dtype_for, trace
from trials.trial.memory_timeline import TimelineRecorder
from trials.trial.segments import model_runs, segment_label


@dataclass
class PredictedTimeline:
    """One rank's predicted step as a snapshot, and what it shows."""

    snapshot: dict  # torch's memory snapshot format (``trials.trial.memory_timeline``)
    rank: int
    world_size: int
    layers: int  # decoder layers of the traced copy
    model_layers: int  # decoder layers of the model
    tensor_peak_bytes: int  # the traced copy's tensor peak: the snapshot's replay peak
    host_peak_bytes: int  # host memory (offloads), kept out of the device trace
    peak_segment: str
    title: str


def predicted_timeline(evaluation: Evaluation, rank: int = 0, model_name: str = "") -> PredictedTimeline:
    """Trace ``evaluation``'s step on ``rank`` of its fake world with a timeline recorder (see the module doc)."""
    hardware = evaluation.hardware
    runs = model_runs(evaluation.techniques, evaluation.model_config)
    base, varied = plan_traces(runs)
    recorder = TimelineRecorder()
    result = trace(
        evaluation.model_config,
        evaluation.techniques,
        evaluation.seq_len,
        evaluation.world_size,
        runs=base if varied else runs,
        compute_dtype=compute_dtype_for(hardware),
        gpu_kernels=not hardware.device_is_host,
        timeline=recorder,
        rank=rank,
    )
    return recorded_timeline(evaluation, recorder, result, rank, model_name)


def recorded_timeline(
    evaluation: Evaluation, recorder: TimelineRecorder, result: Trace, rank: int = 0, model_name: str = ""
) -> PredictedTimeline:
    """The timeline ``recorder`` recorded during ``result``, the first trace of ``evaluation`` on ``rank`` (the
    prediction's own: ``predict(..., timeline=recorder)``, or ``predicted_timeline``'s)."""
    hardware = evaluation.hardware
    model_layers = evaluation.model_config["num_hidden_layers"]
    title = timeline_title(
        "predicted",
        model_name or evaluation.model_config.get("model_type", "model"),
        evaluation.seq_len,
        rank,
        evaluation.world_size,
        hardware.name,
        result.layers,
        model_layers,
        result.peak_device_bytes,
        segment_label(result.peak_segment),
    )
    return PredictedTimeline(
        snapshot=recorder.snapshot(title),
        rank=rank,
        world_size=evaluation.world_size,
        layers=result.layers,
        model_layers=model_layers,
        tensor_peak_bytes=result.peak_device_bytes,
        host_peak_bytes=result.peak_host_bytes,
        peak_segment=segment_label(result.peak_segment),
        title=title,
    )


def timeline_title(
    source: str,
    model: str,
    seq_len: int,
    rank: int,
    world_size: int,
    device: str,
    layers: int,
    model_layers: int,
    peak_bytes: int,
    peak_at: str = "",
) -> str:
    """What a timeline shows, in one line: whose step, which layers, and its peak."""
    depth = (
        f"all {model_layers} layers"
        if layers == model_layers
        else f"the {layers}-layer traced copy; the step extends to {model_layers} identical layers"
    )
    where = f" in {peak_at}" if peak_at else ""
    return (
        f"{source} memory timeline: {model}, {format_tokens(seq_len)} tokens, rank {rank} of {world_size} "
        f"({device}); {depth}; tensor peak {peak_bytes / 2**30:.2f} GiB{where}"
    )
