"""The memory oracle's stand-in for identical tiles: a ``trials.core.repeats.LoopWatcher`` over one fake trace.

A tile loop at millions of tokens runs hundreds of identical iterations (sequence tiles; packed documents of one
length, each its own attention call); under fake tensors each costs the oracle ~100 dispatches and computes
nothing. ``TileWatcher.observe`` runs one iteration and returns its signature: how it changed the live device
and host bytes by category and the number of live storages (not at all, or by one kept result), the highest
live bytes above where it started, the segment it ran in, and every increment it made to the step counters
(``StepCounter.recording``: the phases' counts and the attention calls). Two consecutive iterations with equal
signatures are the same computation on the same state (or, for a loop that keeps each result, on a state grown
by one result); every further one would be too. ``repeat`` adds the counted increments again, in the same order,
once per iteration not run, so the counts are those of the whole loop to the last bit. Memory needs nothing where
the state repeats: the peak and every segment's peak were reached by the iterations that ran. Where each result
is kept, ``repeat`` allocates a stand-in of each (a tensor, or a tuple of tensors: a kernel's residuals;
uncounted: no op of the step made it), so the iterations that still run start from the live bytes they would
have, and does so only when none of the skipped iterations would have crossed a limit that stops the trace (its
peak then is where it stopped).

A ``for_each_kind`` loop (packed documents of any lengths) names each iteration's kind: ``run_kind`` traces the
first iteration of each kind, keeps its signature and the host bytes it rose by (in ``KNOWN_KINDS``, shared by every
trace of the process), and accounts for a later one of that kind (its increments added once, moved to the phase
counted then) when its peak, from the live bytes then, stays at or below the current segment's peak, device and
host; otherwise it runs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Hashable

import torch

from trials.core.memory import DeviceMemoryTracker, TrackerListener
from trials.core.repeats import LoopWatcher, watching

EVERY_TILE_ENV = "AUTOTUNE_TRACE_EVERY_TILE"  # "1": trace every tile (the path the watcher shortens; benches)


class _Highest(TrackerListener):
    """The highest live device and host bytes while it listens."""

    def __init__(self, tracker: DeviceMemoryTracker):
        self.highest, self.highest_host = tracker.device_bytes, tracker.host_bytes

    def on_change(self, tracker: DeviceMemoryTracker) -> None:
        self.highest = max(self.highest, tracker.device_bytes)
        self.highest_host = max(self.highest_host, tracker.host_bytes)


def _state(tracker: DeviceMemoryTracker) -> tuple[int, ...]:
    return (tracker.device_bytes, tracker.host_bytes, *tracker.current.values(), len(tracker.live_storages()))


def _kept_tensors(result) -> tuple:
    """The tensors a kept iteration's result is: one tensor, or a tuple of tensors (a kernel's residuals); ()
    for anything else."""
    parts = result if isinstance(result, tuple) else (result,)
    return parts if all(isinstance(part, torch.Tensor) for part in parts) else ()


class _Shape:
    """A tensor's shape, stride, dtype and device, without the tensor (what ``_stand_in`` reads)."""

    def __init__(self, tensor: torch.Tensor):
        self.shape, self._stride, self.dtype, self.device = tensor.shape, tensor.stride(), tensor.dtype, tensor.device

    def stride(self) -> tuple:
        return self._stride


def _like(result):
    """What ``_stand_in`` needs to make a result like ``result`` (a tensor, or a tuple of tensors), keeping none."""
    return tuple(_Shape(part) for part in result) if isinstance(result, tuple) else _Shape(result)


def _stand_in(like):
    """A tensor (or tuple of tensors) of ``like``'s shapes, strides, dtypes and devices."""
    if isinstance(like, tuple):
        return tuple(_stand_in(part) for part in like)
    return torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)


class TileWatcher(LoopWatcher):
    """Shortens the identical tiles of one trace (see the module doc). ``segment()``: the trace's current segment;
    ``counters``: its step counters (``StepCounter``), whose increments are recorded and repeated;
    ``device_limit()``: the live device bytes above which the trace stops now, or None; ``segment_peak()``: the
    current segment's peak so far (``trials.trial.segments.Segment``), or None before its first change;
    ``kinds``: what ``run_kind`` learnt of each kind, shared with other traces (``KNOWN_KINDS``), else this
    trace's own."""

    def __init__(
        self,
        tracker: DeviceMemoryTracker,
        segment: Callable[[], tuple],
        counters: list,
        device_limit: Callable[[], int | None] = lambda: None,
        segment_peak: Callable[[], object] = lambda: None,
        kinds: dict | None = None,
    ):
        self.tracker, self.segment, self.counters, self.device_limit = tracker, segment, counters, device_limit
        self.segment_peak = segment_peak
        self.repeated = 0  # iterations accounted for without running (tests and benches read it)
        # run_kind: (kind, kept, tracker phase if kept, host-ness, counters) -> (signature, host bytes above, the
        # result's shapes if kept, the counters' phases it was learnt in)
        self._kinds: dict[Hashable, tuple] = {} if kinds is None else kinds

    def observe(self, run: Callable[[], object], kept: bool) -> Hashable | None:
        _, signature, _ = self._observe(run, kept)
        return signature

    def run_kind(self, run: Callable[[], object], kind: Hashable, kept: bool = False):
        """Accounts for an iteration of a kind seen before (its increments replayed once, moved to the phase the
        counters count in now: a forward's documents stand for the recompute's; where the loop keeps each result,
        a stand-in of the result's shapes made) when its peak, from the live bytes now, stays at or below the
        current segment's peak, device and host: the peaks, the breakdowns at them, the limits and the capacity
        then see nothing it would have changed. Else it runs, and a run that left the state as it found it (or
        grown by its result alone) teaches the kind. A kept result's category follows the tracker's phase, so
        there the phase is part of the kind."""
        tracker = self.tracker
        phases = tuple(counter.current_phase() for counter in self.counters)
        key = (kind, kept, tracker.phase if kept else None, tracker.new_storages_on_host, len(phases))
        known, peak = self._kinds.get(key), self.segment_peak()
        if known is not None and peak is not None:
            signature, host_above, like, learnt = known
            if (
                tracker.device_bytes + signature[3] <= peak.device_bytes
                and tracker.host_bytes + host_above <= peak.host_bytes
            ):
                signature = self._in_phases(signature, learnt, phases)
                stand_ins = None if signature is None else self.repeat(signature, 1, like)
                if signature is not None and not kept:
                    return None
                if stand_ins is not None:
                    return stand_ins[0]
        result, signature, host_above = self._observe(run, kept)
        if signature is not None:
            self._kinds[key] = (signature, host_above, _like(result) if kept else None, phases)
        return result

    def _in_phases(self, signature: tuple, learnt: tuple, phases: tuple) -> tuple | None:
        """``signature`` with each counter's increments moved from the phase they were learnt in to ``phases``;
        None where a counter's cannot be (``StepCounter.moved_to_phase``)."""
        if learnt == phases:
            return signature
        increments = []
        for counter, counted, was, now in zip(self.counters, signature[4], learnt, phases):
            moved = counted if was == now else counter.moved_to_phase(counted, was, now)
            if moved is None:
                return None
            increments.append(moved)
        return (*signature[:4], tuple(increments))

    def _observe(self, run: Callable[[], object], kept: bool) -> tuple[object, Hashable | None, int]:
        """``run()``'s result, ``observe``'s signature of it, and the host bytes it rose above where it started."""
        before, segment, phase = _state(self.tracker), self.segment(), self.tracker.phase
        highest = _Highest(self.tracker)
        self.tracker.add_listener(highest)
        try:
            with contextlib.ExitStack() as stack:
                logs = [stack.enter_context(counter.recording()) for counter in self.counters]
                result = run()
        finally:
            self.tracker.remove_listener(highest)
        change = tuple(a - b for a, b in zip(_state(self.tracker), before))
        if self.segment() != segment or self.tracker.phase != phase or any(log.other_changes for log in logs):
            return result, None, 0  # a collective, an optimizer step, a new segment: not what counters can repeat
        if kept:
            parts = _kept_tensors(result)
            infos = [self.tracker.storage_info(part) for part in parts]
            if not infos or any(info is None or info.host for info in infos) or len(set(map(id, infos))) < len(infos):
                return result, None, 0  # not tensors each in a device storage of its own
            if change[0] != sum(info.nbytes for info in infos) or change[-1] != len(infos):
                return result, None, 0  # the state grew by more than the result
        elif any(change):
            return result, None, 0  # it changed what the next iteration starts from: each must run
        signature = (
            change,
            segment,
            phase,
            highest.highest - before[0],
            tuple(tuple(log.increments) for log in logs),
        )
        return result, signature, highest.highest_host - before[1]

    def repeat(self, signature: Hashable, times: int, like=None) -> list | None:
        change, _, _, above, increments = signature
        stand_ins = None
        if like is not None:
            grown, limit = change[0], self.device_limit()
            if limit is not None and self.tracker.device_bytes + (times - 1) * grown + above > limit:
                return None  # one of them would stop the trace: they run, and it stops where it would
            expected = tuple(now + times * c for now, c in zip(_state(self.tracker), change))
            with contextlib.ExitStack() as stack:
                for counter in self.counters:
                    stack.enter_context(counter.paused())
                stand_ins = [_stand_in(like) for _ in range(times)]
            if _state(self.tracker) != expected:
                raise RuntimeError(f"tile stand-ins changed the live state to {_state(self.tracker)}, not {expected}")
        for counter, counted in zip(self.counters, increments):
            counter.replay(counted, times)
        self.repeated += times
        return stand_ins


class KindStore(dict):
    """What ``run_kind`` learnt of each kind, shared by every trace in this process: a kind's key holds everything
    the iteration's ops depend on (shapes, strides, dtypes, devices, arguments, grad mode, where new storages live,
    how many counters count them), so what one trace learnt holds in another. Emptied when it grows
    past ``MAX_KINDS`` keys (a long search's worker goes through many shapes)."""

    MAX_KINDS = 20_000  # a few KB each (the increments of a document's ops): tens of MB at most

    def __setitem__(self, key, value):
        if len(self) >= self.MAX_KINDS:
            self.clear()
        super().__setitem__(key, value)


KNOWN_KINDS = KindStore()


def tile_watching(
    tracker: DeviceMemoryTracker,
    segment: Callable[[], tuple],
    counters: list,
    device_limit: Callable[[], int | None] = lambda: None,
    segment_peak: Callable[[], object] = lambda: None,
    kinds: dict | None = None,
):
    """A context in which the trace's tile loops are shortened, or a no-op where ``$AUTOTUNE_TRACE_EVERY_TILE``
    is set."""
    if os.environ.get(EVERY_TILE_ENV, "").strip() not in ("", "0"):
        return contextlib.nullcontext()
    return watching(TileWatcher(tracker, segment, counters, device_limit, segment_peak, kinds))
