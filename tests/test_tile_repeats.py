"""Identical sequence tiles in the oracle (``trials.core.repeats``, ``autotune.oracle.repeats``): a trace that
accounts for the middle tiles gives the record of one that traces every tile, count for count and byte for byte
(full traces, stopped ones, the time counts), and the loop itself keeps what a ``for`` loop keeps."""

from __future__ import annotations

import contextlib

import pytest
import torch

from autotune.backends import Evaluation
from autotune.backends.plan import PlanBackend, step_counts
from autotune.core.hardware import load_hardware
from autotune.oracle import repeats as oracle_repeats
from trials.core.memory import DeviceMemoryTracker
from trials.core.repeats import LoopWatcher, for_each_kind, for_each_tile, watching
from trials.kernels.documents import ONE, DocumentsSpec
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques
from trials.trial.segments import SegmentPeaks

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

K = 1024
# document lengths as a lengths file gives them: no two neighbours equal, each length again further on
MIXED = (700, 212, 1000, 300, 77, 700, 1000, 212, 300, 77, 512, 1200, 212, 700)
TILED = dict(mlp_tile_tokens=512, loss_tile_tokens=256, norm_tile_tokens=512)  # 8-16 tiles of each per rank


def _record(
    seq_len: int,
    memory_gib: float,
    every_tile: bool,
    monkeypatch,
    stop_above=None,
    documents=ONE,
    hardware="cpu",
    world=1,
    **techniques,
) -> dict:
    repeated = []
    repeat = oracle_repeats.TileWatcher.repeat

    def counting_repeat(self, signature, times, like=None):
        stand_ins = repeat(self, signature, times, like)
        repeated.append(times if like is None or stand_ins is not None else 0)
        return stand_ins

    monkeypatch.setattr(oracle_repeats.TileWatcher, "repeat", counting_repeat)
    if every_tile:
        monkeypatch.setenv(oracle_repeats.EVERY_TILE_ENV, "1")
    else:
        monkeypatch.delenv(oracle_repeats.EVERY_TILE_ENV, raising=False)
    model, on = load_model_config("tiny-llama"), load_hardware(hardware).with_memory_gib(memory_gib)
    evaluation = Evaluation(model, Techniques(**techniques), seq_len, world, on, documents=documents)
    backend = PlanBackend(stop_above=stop_above)
    record = backend.evaluate(evaluation).to_dict()
    if record["status"] == "ok":  # the step's counts themselves, phase by phase, not only the time they price to
        record["counts"] = step_counts(backend.last_prediction)
    return record, sum(repeated)


@pytest.mark.parametrize(
    "techniques",
    [
        pytest.param(dict(TILED), marks=pytest.mark.slow),
        dict(TILED, activation_checkpointing=True, activation_offload_layers=1),
        pytest.param(dict(TILED, head_chunk=1, activation_checkpointing=True), marks=pytest.mark.slow),
    ],
    ids=["tiles", "tiles+checkpoint+offload", "tiles+head chunks"],
)
def test_repeated_tiles_give_the_record_of_every_tile(monkeypatch, techniques):
    every, none_repeated = _record(8 * K, 4.0, True, monkeypatch, **techniques)
    shortened, repeated = _record(8 * K, 4.0, False, monkeypatch, **techniques)
    assert none_repeated == 0 and repeated > 0  # the watcher stood in for tiles, and only where asked
    assert every["status"] == "ok" and every["tokens_per_s"] > 0
    assert shortened == every


@pytest.mark.parametrize(
    "documents, techniques",
    [
        ((512,), {}),  # 16 documents of one length: a whole layer's per-document calls
        ((512,) * 12 + (1024, 1024), dict(head_chunk=1, activation_checkpointing=True)),  # head chunks; a longer tail
        ((512,), dict(attention="flash", head_chunk=1, hardware="h100-sxm")),  # FA2's residuals: lse and RNG state
        ((512,) * 12 + (1024, 1024), dict(ring_degree=2, world=2)),  # each ring step's blocks per document
        ((512,), dict(ring_degree=2, world=2, attention="flash", hardware="h100-sxm", activation_checkpointing=True)),
        (MIXED, {}),  # lengths in any order: the first document of each length traced, the others accounted for
        (MIXED, dict(head_chunk=1, activation_checkpointing=True, activation_offload_layers=1)),
        (MIXED, dict(attention="flash3", head_chunk=1, hardware="h100-sxm", activation_checkpointing=True)),
        (MIXED, dict(ring_degree=2, world=2, activation_checkpointing=True)),
    ],
    ids=[
        "whole layer",
        "head chunks+checkpoint",
        "flash head chunks",
        "ring",
        "flash ring+checkpoint",
        "mixed lengths",
        "mixed lengths+head chunks+offload",
        "mixed lengths+flash3 head chunks",
        "mixed lengths+ring+checkpoint",
    ],
)
def test_repeated_documents_give_the_record_of_every_document(monkeypatch, documents, techniques):
    """Packed documents of one length are identical iterations of each layer's attention, forward and backward,
    wherever they stand among other lengths: the record accounting for them equals the one tracing each document,
    byte for byte and count for count."""
    spec = DocumentsSpec(documents)
    every, none_repeated = _record(8 * K, 80.0, True, monkeypatch, documents=spec, **techniques)
    shortened, repeated = _record(8 * K, 80.0, False, monkeypatch, documents=spec, **techniques)
    assert none_repeated == 0 and repeated > 0
    assert every["status"] == "ok"  # no tile knobs: what was repeated is documents
    assert shortened == every


def test_a_stopped_trace_stops_where_every_tile_would(monkeypatch):
    """A search's trace that crosses the device's capacity: the same ``oom`` record, stopped at the same bytes."""
    every, _ = _record(16 * K, 0.13, True, monkeypatch, stop_above=1.0, **TILED)
    shortened, _ = _record(16 * K, 0.13, False, monkeypatch, stop_above=1.0, **TILED)
    assert every["status"] == "oom"
    assert shortened == every


@pytest.mark.parametrize("capacity", [None, 7_000, 20_000])
def test_kept_tiles_that_would_cross_the_capacity_run(capacity):
    """Each tile makes a 1 KB temporary and keeps a 1 KB result: with a capacity that tile 5 (or none) crosses,
    the tracker stops at the same tile and bytes as the loop run whole, and stand-ins are made only where none
    of the tiles they stand for would cross it."""

    def run(watched: bool):
        tracker = DeviceMemoryTracker(capacity)
        watcher = oracle_repeats.TileWatcher(tracker, lambda: ("tiles",), [], lambda: tracker.capacity_bytes)
        made: list[int] = []

        def body(index):
            made.append(index)
            temporary = torch.ones(256)  # 1 KB, freed when the tile ends
            return temporary * index

        with tracker, watching(watcher) if watched else contextlib.nullcontext():
            try:
                results = for_each_tile(12, body, uniform=12, keep_all=True)
                stopped = None
            except torch.OutOfMemoryError:
                results, stopped = [], made[-1]
        return stopped, tracker.peak_device_bytes, watcher.repeated, [tuple(t.shape) for t in results]

    whole, shortened = run(False), run(True)
    assert shortened[:2] == whole[:2] and shortened[3] == whole[3]
    assert whole[0] == (None if capacity in (None, 20_000) else 5)
    assert shortened[2] == (0 if whole[0] is not None else 9)  # 0 and 1 run, 2..10 stood in for, 11 runs


def test_an_iteration_of_a_known_kind_runs_where_it_would_raise_a_peak():
    """A ``for_each_kind`` loop of 1 KB and 2 KB device iterations and a 3 KB host one (kinds "a", "b", "h"), run
    at an empty state and again above a 10 KB tensor on the device and one on the host: at the empty state the
    second of each kind is accounted for (its peak repeats one reached), above the tensors each kind runs once
    more (its peak would stand higher) and then repeats. Peaks, device and host, and the segment's, equal those
    of the loops run whole."""

    def run(watched: bool):
        tracker = DeviceMemoryTracker()
        peaks = SegmentPeaks()
        tracker.add_listener(peaks)
        watcher = oracle_repeats.TileWatcher(
            tracker, lambda: peaks.segment, [], segment_peak=lambda: peaks.segments.get(peaks.segment)
        )
        kinds = ["a", "b", "h", "a", "b", "h"]

        def body(index):  # 1, 2 or 3 KB, freed as the iteration ends
            with tracker.on_host() if kinds[index] == "h" else contextlib.nullcontext():
                torch.ones(256 * (1 + "abh".index(kinds[index])))

        with tracker, watching(watcher) if watched else contextlib.nullcontext():
            torch.ones(1)  # the segment's first change (freed at once): its peak exists from here on
            for_each_kind(6, body, lambda index: kinds[index])
            held = torch.ones(2560)  # 10 KB
            with tracker.on_host():
                held_on_host = torch.ones(2560)
            for_each_kind(6, body, lambda index: kinds[index])
            del held, held_on_host
        segment = peaks.segments[peaks.segment]
        return (tracker.peak_device_bytes, tracker.peak_host_bytes, segment.device_bytes), watcher.repeated

    whole, shortened = run(False), run(True)
    assert shortened[0] == whole[0] == (12 * 1024, 13 * 1024, 12 * 1024)
    assert shortened[1] == 6  # the second of each kind in each loop


class _Recorder(LoopWatcher):
    """Stands in for every middle tile; remembers what it saw."""

    def __init__(self):
        self.signatures, self.repeats = [], []

    def observe(self, run, kept):
        result = run()
        self.signatures.append(tuple(result.shape))
        return self.signatures[-1]

    def repeat(self, signature, times, like=None):
        self.repeats.append(times)
        return [torch.full(like.shape, -1.0) for _ in range(times)] if like is not None else None


@pytest.mark.parametrize("watched", [False, True])
def test_the_loop_keeps_what_a_for_loop_keeps(watched):
    """Each result lives until the next exists (the previous one is alive while the next is computed), the last
    is returned; with ``keep_all`` every result, in order, stand-ins for the tiles not run."""
    alive_during: list[bool] = []
    previous: list = []

    def body(index):
        alive_during.append(bool(previous) and previous[-1]() is not None)
        tensor = torch.full((4,), float(index))
        previous.append(__import__("weakref").ref(tensor))
        return tensor

    recorder = _Recorder()
    with watching(recorder) if watched else __import__("contextlib").nullcontext():
        last = for_each_tile(10, body, uniform=9)
        kept = for_each_tile(10, lambda i: torch.full((2,), float(i)), uniform=9, keep_all=True)
    assert last.tolist() == [9.0] * 4 and alive_during[1:] == [True] * (len(alive_during) - 1)
    ran = [int(t[0]) for t in kept]
    if watched:
        # 0 and 1 run and are the same; 2..8 stood in for, 9 (the short tile) runs; keeping every result, 8 (the
        # last full tile) runs too
        assert recorder.repeats == [7, 6] and len(alive_during) == 3
        assert ran == [0, 1, -1, -1, -1, -1, -1, -1, 8, 9]
    else:
        assert len(alive_during) == 10 and ran == list(range(10))
