"""One fake trace: the trial's own training step under FakeTensorMode on one rank (rank 0 unless asked) of a fake
world."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autotune.core.record import BREAKDOWN_CATEGORIES
from autotune.oracle.fake_world import fake_flash_kernels, fake_process_group, oracle_mode
from autotune.oracle.repeats import tile_watching
from autotune.oracle.results import Segment, Trace, full_breakdown
from trials.core import patches
from trials.core.dist import Mesh, build_mesh, ensure_device_mesh
from trials.core.memory import DeviceMemoryTracker, TrackerListener
from trials.kernels.documents import ONE, DocumentsSpec
from trials.models.config import copy_for_runs
from trials.models.lora import FULL_TRAINING, LoraSpec
from trials.stack.rules import ring_document_unit
from trials.training.data import mesh_batch
from trials.training.step import build_training, train_step
from trials.training.step import prime_optimizer as prime_optimizer_states
from trials.trial.memory_timeline import TimelineRecorder
from trials.trial.segments import SegmentPeaks, install_segment_hooks, model_runs, segment_label, techniques_for_runs


def compute_dtype_for(hardware) -> torch.dtype:
    """The precision a real trial on ``hardware`` computes in: fp32 where the device is the host (CPU trials),
    bf16 on GPUs."""
    return torch.float32 if hardware.device_is_host else torch.bfloat16


def trace(
    model_config: dict,
    techniques,
    seq_len: int,
    world_size: int,
    *,
    compute_dtype: torch.dtype = torch.float32,
    gpu_kernels: bool = False,
    layers: int | None = None,
    runs: list[tuple[str, int]] | None = None,
    modes: Callable[[Any], Iterable] | None = None,
    prime_optimizer: bool = True,
    steps: int = 1,
    seed: int = 0,
    explain: bool = False,
    stop_above_bytes: int | None = None,
    segment_limits: dict[tuple, int] | None = None,
    host_limit: int | None = None,
    timeline: TimelineRecorder | None = None,
    rank: int = 0,
    documents: DocumentsSpec = ONE,
    known_kinds: dict | None = None,
    lora: LoraSpec = FULL_TRAINING,
) -> Trace:
    """Run ``steps`` training steps of the trial under FakeTensorMode on rank 0 of a fake world and return
    the tracked peak.

    ``layers``: trace a copy of the model with this many decoder layers (default: the model's own), all alike
    (``activation_offload_layers`` must be 0 or all); ``runs``: the layers as runs of identical layers
    (``layer_runs``) for a copy of the model, e.g. ``[("offload", 3), ("device", 4)]``.
    ``modes(tracker)``: extra ``TorchDispatchMode``s (e.g. ``autotune.timing.counting.StepCounter``) entered
    inside the tracker around the traced steps only (not the priming); they are returned in ``extras``.
    ``prime_optimizer``: create the AdamW states before the traced step (see module doc); with False, trace
    ``steps`` >= 2 to see them. ``explain``: keep, per segment, the op at its peak and the largest live
    storages then (with the op, shape and dtype that made each) -- slower; see ``explain``.
    ``stop_above_bytes``: stop the step at the first allocation that takes live tensor bytes above this (like
    a real trial's OOM); the returned trace is then ``stopped`` and its peak is where it stopped.
    ``segment_limits`` ({segment: tensor bytes}) and ``host_limit`` (host bytes) stop it the same way, as soon
    as the current segment's live bytes, or the host bytes, go above their limit (``Limits``); they need
    ``stop_above_bytes``. The trace's ``stop_reason`` says which limit stopped it.
    ``timeline``: a ``trials.trial.memory_timeline.TimelineRecorder`` that records every device allocation and free of
    the trace, each labelled with its segment and module. ``rank``: the rank of the fake world this process is
    (rank 0 unless asked: the most loaded one).
    ``documents``: the documents packed into the sequence (their boundaries are host integers: the fake step
    runs each document's attention as the real one does). ``known_kinds``: a store of what per-document loops did
    (``autotune.oracle.repeats.TileWatcher``'s ``kinds``) to share with other traces. ``lora``: the adapters trained
    on the frozen model (``trials.models.lora``).
    """

    started = time.perf_counter()
    num_layers = model_config["num_hidden_layers"]
    if runs is None:
        if layers is None or layers == num_layers:
            runs = model_runs(techniques, model_config)
        elif techniques.activation_offload_layers not in (0, num_layers):
            raise ValueError("a partial activation offload needs ``runs`` to trace a shallower copy")
        else:
            runs = [("layers", layers)]
    layers = sum(n for _, n in runs)
    config = copy_for_runs(model_config, runs)
    techniques = techniques_for_runs(techniques, runs)
    device = torch.device("cpu")
    tracker = DeviceMemoryTracker(stop_above_bytes)
    peaks = SegmentPeaks(explain)
    tracker.add_listener(peaks)
    if timeline is not None:
        timeline.where = lambda: segment_label(peaks.segment)
        tracker.add_listener(timeline)
    limits = None
    if segment_limits or host_limit is not None:
        if stop_above_bytes is None:
            raise ValueError("segment_limits / host_limit stop a trace: they need stop_above_bytes")
        limits = Limits(peaks, segment_limits or {}, host_limit)
        tracker.add_listener(limits)
    extras: list = []
    stopped = False
    with fake_process_group(world_size, world_size > 1 or techniques.fsdp, rank=rank):
        # groups and the device mesh hold small real tensors: build them before faking
        if world_size > 1:
            mesh = build_mesh(techniques.ulysses_degree, device, ring_degree=techniques.ring_degree)
        else:
            mesh = Mesh.single(device)
        if world_size > 1 and not mesh.distributed:
            raise RuntimeError("fake process group did not take")
        if techniques.fsdp and mesh.device_mesh is None:
            ensure_device_mesh(mesh)  # one rank with FSDP: a 1-rank (fake) group, as trials.stack.apply makes
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode, tracker, oracle_mode(gpu_kernels):
            model = optimizer = batch = tokens = None
            extra_modes = []
            try:  # a stop may come while the model is built (it is whole on the device before sharding)
                model, optimizer = build_training(
                    config,
                    techniques,
                    mesh,
                    seed,
                    tracker,
                    compute_dtype=compute_dtype,
                    fused_optimizer=gpu_kernels and not techniques.optimizer_offload,
                    lora=lora,
                )
                install_segment_hooks(model, tracker, peaks, runs)
                if timeline is not None:
                    timeline.watch(model)
                tokens = torch.zeros(seq_len + 1, dtype=torch.long)
                padded_to = ring_document_unit(techniques.ring_degree)  # a ring's documents, padded as the trainer pads
                batch = mesh_batch(tokens, mesh, device, documents.for_length(seq_len, padded_to))
                if prime_optimizer:
                    prime_optimizer_states(model, optimizer, tracker)
                    peaks.segment = ("setup", None)
                extra_modes = list(modes(tracker)) if modes is not None else []
                with contextlib.ExitStack() as stack:
                    # the step alone: flash stand-ins for its attention, FSDP's buffers labelled params
                    stack.enter_context(fake_flash_kernels(gpu_kernels, techniques.attention))
                    stack.enter_context(
                        patches.fsdp_all_gather_buffers(
                            lambda fsdp_param: tracker.retag(fsdp_param.all_gather_outputs, "params")
                        )
                    )
                    for mode in extra_modes:
                        stack.enter_context(mode)
                    if (
                        timeline is None
                        and not explain
                        and all(
                            hasattr(m, "recording") and hasattr(m, "current_phase") and hasattr(m, "moved_to_phase")
                            for m in extra_modes
                        )
                    ):
                        # identical tiles are accounted for, not traced each (``autotune.oracle.repeats``); a
                        # timeline or an explanation wants every allocation, another mode every op
                        stack.enter_context(
                            tile_watching(
                                tracker,
                                lambda: peaks.segment,
                                extra_modes,
                                device_limit(tracker, limits),
                                lambda: peaks.segments.get(peaks.segment),
                                known_kinds,
                            )
                        )
                    for _ in range(steps):
                        train_step(model, optimizer, batch, mesh, tracker)
            except torch.OutOfMemoryError:
                if stop_above_bytes is None:
                    raise
                stopped = True
            extras = extra_modes
            if timeline is not None:
                timeline.unwatch()
            model = optimizer = batch = tokens = None
    # ("setup", None) is building the model and the batch: trial code builds the whole model on the device
    # before FSDP shards it, so that can be the peak (a real trial measures it too); it scales with depth
    # like any other segment
    segments = dict(peaks.segments)
    peak_key = max(segments, key=lambda k: segments[k].device_bytes) if segments else None
    peak = segments[peak_key] if peak_key else Segment(0, dict.fromkeys(BREAKDOWN_CATEGORIES, 0))
    return Trace(
        layers=layers,
        peak_device_bytes=int(peak.device_bytes),
        breakdown=full_breakdown(peak.breakdown),
        peak_host_bytes=int(tracker.peak_host_bytes),
        peak_segment=peak_key,
        segments=segments,
        elapsed_s=time.perf_counter() - started,
        extras=[extras],
        runs=list(runs),
        stopped=stopped,
        stop_reason=((limits.reason if limits is not None else None) or "device") if stopped else None,
    )


def device_limit(tracker: DeviceMemoryTracker, limits: Limits | None) -> Callable[[], int | None]:
    """The live device bytes above which the trace stops now: the tracker's capacity or the current segment's
    limit, the lower."""

    def limit() -> int | None:
        found = [tracker.capacity_bytes]
        if limits is not None:
            found.append(limits.segment_limits.get(limits.peaks.segment))
        found = [b for b in found if b is not None]
        return min(found) if found else None

    return limit


class Limits(TrackerListener):
    """Stops a trace (``torch.OutOfMemoryError``, like the tracker's own capacity) as soon as the live bytes of the
    current segment go above that segment's limit, or the host bytes above ``host_limit``; ``reason`` says
    which ("device" / "host"). Listeners run after ``SegmentPeaks`` has seen the change and before the
    tracker's capacity check."""

    def __init__(self, peaks: SegmentPeaks, segment_limits: dict[tuple, int], host_limit: int | None):
        self.peaks, self.segment_limits, self.host_limit = peaks, segment_limits, host_limit
        self.reason: str | None = None

    def on_change(self, tracker: DeviceMemoryTracker) -> None:
        if self.host_limit is not None and tracker.host_bytes > self.host_limit:
            self.reason = "host"
            raise torch.OutOfMemoryError(f"host bytes {tracker.host_bytes:,} > limit {self.host_limit:,}")
        limit = self.segment_limits.get(self.peaks.segment)
        if limit is not None and tracker.device_bytes > limit:
            self.reason = "device"
            raise torch.OutOfMemoryError(
                f"{tracker.device_bytes:,} bytes live in segment {self.peaks.segment} > limit {limit:,}"
            )
