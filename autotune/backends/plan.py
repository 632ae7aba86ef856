"""The ``plan`` backend: predicted records, no GPU needed.

Memory: ``autotune.oracle.predict`` -- the trial's own code under FakeTensorMode with a fake process group of
``gpus`` ranks, rank 0's tracked tensor peak plus the hardware preset's runtime overheads (CUDA context, NCCL
buffers, allocator fragmentation), compared with ``hardware.device_memory_bytes``: ``ok`` or ``oom``.

Time: ``autotune.timing``'s ``StepCounter`` watches the same fake step (inside the oracle's tracker) and
``predict_step_time`` turns the counts into ``step_time_s`` / ``tokens_per_s``; counts of the 3- and 4-layer
traces are extended to full depth like the memory. A time prediction that fails (an op the counter could not
count, a model error) makes the record ``error`` with the reason: a config never drops off the front silently.

Records are cached per (model, techniques, seq_len, gpus, hardware), so the search and ``--max-seq`` never
trace the same point twice in one process; with a ``store`` (``autotune.backends.plan_store``) never twice on
this machine, across studies and runs, as long as the code is the same. The store also keeps the records of the
3- and 4-layer copies a deep model's prediction traced to their end (``shallow_copies``): the evaluations a
reduced-depth trial predicts before it runs, so ``trial`` / ``verify`` after a search read them back too.
"""

from __future__ import annotations

import json
import traceback
from collections import OrderedDict
from dataclasses import replace

from autotune.backends.base import Backend, Evaluation
from autotune.backends.plan_store import Entry, PlanStore, evaluation_key
from autotune.core.record import ResultRecord
from autotune.oracle import Prediction, extend_value, model_runs, predict, stop_tensor_bytes, with_overheads
from autotune.oracle.extrapolation import plan_traces
from autotune.timing.counting import StepCounter
from autotune.timing.counts import StepCounts
from autotune.timing.model import TimeBreakdown, predict_step_time
from trials.core.errors import ConfigError
from trials.models.config import copy_for_runs
from trials.trial.segments import techniques_for_runs


def record_key(evaluation: Evaluation) -> str:
    """The in-process cache key of one evaluation."""
    hw = evaluation.hardware
    return json.dumps(
        [
            evaluation.model_config,
            evaluation.techniques.to_dict(),
            evaluation.seq_len,
            evaluation.gpus,
            hw.name,
            hw.device_memory_bytes,
            evaluation.nodes,
            hw.runtime_overhead_bytes,
            evaluation.documents.to_json(),
            evaluation.lora.to_json(),
        ],
        sort_keys=True,
        default=str,
    )


class PlanBackend(Backend):
    """Predictions from the memory oracle and the time model."""

    name = "plan"

    def __init__(
        self,
        throughput: bool = True,
        cache_size: int = 4096,
        stop_above: float | None = None,
        store: PlanStore | None = None,
    ):
        """``stop_above``: a fraction of device capacity (e.g. 1.0, or 1.05 for a prefilter's margin) and of the
        node's host memory per device; a trace crossing it stops there (a 4-layer copy as soon as its extension
        to full depth is known to) and the record is ``oom`` with the bytes at the crossing as a lower bound of
        the peak -- much cheaper for the search, which only needs to know it does not fit. None (estimate,
        --max-seq, the ablation): always the full trace, with the whole breakdown. ``store``: records kept on
        disk (``plan_store``); ``last_prediction`` is then None after a record read back from it."""
        self.throughput = throughput
        self.stop_above = stop_above
        self.cache_size = cache_size
        self.store = store
        self._cache: OrderedDict[str, ResultRecord] = OrderedDict()
        self._peak_at: dict[str, tuple | None] = {}
        self.last_prediction = None  # the oracle's full Prediction of the latest uncached evaluation
        self.timeline = None  # a TimelineRecorder: the next evaluation that traces records its first trace into it

    def options(self) -> dict:
        """The constructor's arguments: another process builds the same backend from them (``PooledBackend``)."""
        return {
            "throughput": self.throughput,
            "cache_size": self.cache_size,
            "stop_above": self.stop_above,
            "store": self.store,
        }

    def peak_at(self, evaluation: Evaluation):
        """Where the peak of an evaluated point is: (phase, position) of the oracle's segment, or None."""
        return self._peak_at.get(record_key(evaluation))

    def stored(self, evaluation: Evaluation) -> ResultRecord | None:
        """The record of ``evaluation`` if this backend has it without tracing (in memory or in its store)."""
        cached = self._cache.get(record_key(evaluation))
        if cached is None:
            entry = self._from_store(evaluation)
            cached = entry.record if entry is not None else None
        return None if cached is None else ResultRecord.from_dict(cached.to_dict())

    def evaluate(self, evaluation: Evaluation) -> ResultRecord:
        key = record_key(evaluation)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return ResultRecord.from_dict(cached.to_dict())
        stored = self._from_store(evaluation)
        if stored is not None:
            record, peak_at = stored.record, stored.peak_segment
            self.last_prediction = None
        else:
            record = self._evaluate(evaluation)
            peak_at = self.last_prediction.peak_segment if self.last_prediction is not None else None
            self._to_store(evaluation, record)
        self._cache[key] = record
        if peak_at is not None and record.status in ("ok", "oom"):
            self._peak_at[key] = peak_at
        while len(self._cache) > self.cache_size:
            old_key, _ = self._cache.popitem(last=False)
            self._peak_at.pop(old_key, None)
        return ResultRecord.from_dict(record.to_dict())

    # -- the store: whole records answer any stop they stay below; stopped ones only their own stop ----------
    def _limits(self, evaluation: Evaluation) -> dict | None:
        """Where traces stop for ``evaluation`` (tensor bytes on the device, host bytes), or None."""
        if self.stop_above is None:
            return None
        hw = evaluation.hardware
        host = int(hw.host_memory_bytes_per_device * self.stop_above) if hw.host_memory_bytes_per_device else None
        return {"device": stop_tensor_bytes(hw, int(hw.device_memory_bytes * self.stop_above)), "host": host}

    def _store_key(self, evaluation: Evaluation) -> str:
        return evaluation_key(evaluation, {"throughput": self.throughput})

    def _from_store(self, evaluation: Evaluation) -> Entry | None:
        if self.store is None:
            return None
        return self.store.get(self._store_key(evaluation), self._limits(evaluation))

    def _to_store(self, evaluation: Evaluation, record: ResultRecord) -> None:
        prediction = self.last_prediction
        if self.store is None or prediction is None:  # an invalid config: no trace to keep
            return
        self.store.put(self._store_key(evaluation), _entry(record, prediction, self._limits(evaluation)))
        for copy, alone in shallow_copies(evaluation, prediction):  # traced to their end: no limits
            self.store.put(self._store_key(copy), _entry(self._record(copy, alone), alone, None))

    def _evaluate(self, evaluation: Evaluation) -> ResultRecord:
        self.last_prediction = None  # first: an invalid config leaves no trace to keep (``_to_store``)
        hw = evaluation.hardware
        try:
            evaluation.techniques.validate(
                evaluation.model_config,
                evaluation.world_size,
                evaluation.seq_len,
                on_gpu=not hw.device_is_host,
                compute_capability_major=hw.compute_capability or None,
            )
            unlisted = hw.kernel_problem(evaluation.techniques.attention)
            if unlisted:
                raise ConfigError(unlisted)
        except ConfigError as exc:
            return ResultRecord(status="error", error=str(exc), **_record_base(evaluation))
        modes = counter_modes(evaluation) if self.throughput else None
        try:
            stop = None if self.stop_above is None else int(hw.device_memory_bytes * self.stop_above)
            host_stop = (self._limits(evaluation) or {}).get("host")
            prediction = predict(
                evaluation, modes=modes, stop_above_bytes=stop, stop_host_bytes=host_stop, timeline=self.timeline
            )
        except Exception as exc:  # a config the trial code cannot run is an error record, not a crash
            return ResultRecord(
                status="error",
                error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}",
                **_record_base(evaluation),
            )
        self.last_prediction = prediction
        return self._record(evaluation, prediction)

    def _record(self, evaluation: Evaluation, prediction: Prediction) -> ResultRecord:
        """The record of ``evaluation`` from the oracle's ``prediction`` of it: the memory verdict, and the step
        time where the trace ran to its end."""
        hw = evaluation.hardware
        base = _record_base(evaluation)
        host_stop = (self._limits(evaluation) or {}).get("host")
        capacity = hw.device_memory_bytes
        fits = prediction.peak_device_bytes <= capacity and not prediction.stopped
        where = "/".join(str(p) for p in prediction.peak_segment or ())
        error = None
        copy = prediction.traces[-1].layers
        extended = (
            f"the {copy}-layer copy extended to {evaluation.model_config['num_hidden_layers']} layers"
            if prediction.extension
            else f"a {copy}-layer copy"
        )
        if fits and not hw.host_fits(prediction.host_bytes):  # offloaded states need the node's RAM too
            fits = False
            error = (
                f"predicted host memory {prediction.host_bytes:,} bytes per rank > the node's "
                f"{hw.host_memory_bytes_per_device:,} bytes per device (host out of memory)"
            )
        elif prediction.stopped and prediction.stop_reason == "host":
            error = (
                f"predicted host out of memory: {extended} already holds {prediction.host_bytes:,} bytes per "
                f"rank on the host > {host_stop:,} bytes (trace stopped there; the full amount is higher)"
            )
        elif prediction.stopped:
            error = (
                f"predicted out of memory: {extended} already reaches {prediction.peak_device_bytes:,} bytes "
                f"> capacity {capacity:,} bytes at {where} (trace stopped there; the full peak is higher)"
            )
        elif not fits:
            error = f"predicted peak {prediction.peak_device_bytes:,} bytes > capacity {capacity:,} bytes (at {where})"
        tensor_peak = int(prediction.tensor_peak_bytes)
        record = ResultRecord(
            status="ok" if fits else "oom",
            peak_device_bytes=int(prediction.peak_device_bytes),
            peak_allocated_bytes=tensor_peak,
            peak_reserved_bytes=tensor_peak + hw.fragmentation_bytes(tensor_peak),
            host_bytes=int(prediction.host_bytes),
            breakdown=dict(prediction.breakdown),
            error=error,
            **base,
        )
        if self.throughput and not prediction.stopped:
            try:
                timing = step_time(evaluation, prediction)
            except Exception as exc:  # the memory verdict stands, but a config without a time cannot be ranked
                return ResultRecord(
                    status="error",
                    peak_device_bytes=record.peak_device_bytes,
                    host_bytes=record.host_bytes,
                    breakdown=record.breakdown,
                    error=f"time prediction failed ({record.status} by memory): {type(exc).__name__}: {exc}",
                    **base,
                )
            record.step_time_s = float(timing.step_time_s)
            record.tokens_per_s = float(timing.tokens_per_s) if timing.tokens_per_s else None
        return record


def _entry(record: ResultRecord, prediction: Prediction, limits: dict | None) -> Entry:
    """The store's entry of ``record``: the most bytes its traces reached, and the limits they stopped at (a
    stopped trace answers only under the same limits)."""
    reached = {
        "device": prediction.reached_tensor_bytes,
        "host": max([prediction.host_bytes] + [t.peak_host_bytes for t in prediction.traces]),
    }
    return Entry(record, prediction.peak_segment, reached, limits if prediction.stopped else None)


def _record_base(evaluation: Evaluation) -> dict:
    """The fields every predicted record of ``evaluation`` has."""
    hw, nodes = evaluation.hardware, str(evaluation.nodes) if evaluation.nodes > 1 else ""  # "2x8": 2 nodes of 8
    return dict(
        source="predicted", seq_len=evaluation.seq_len, device=f"{hw.name} {nodes}x{evaluation.gpus} (predicted)"
    )


def shallow_copies(evaluation: Evaluation, prediction: Prediction) -> list[tuple[Evaluation, Prediction]]:
    """The shallow copies of the model that ``prediction`` traced to their end, each as an evaluation of its own
    with the prediction the oracle gives it: one trace of the same layer runs (``predict`` traces a model of at
    most 4 layers, or of runs shorter than 3, whole). A reduced-depth trial asks the plan backend for exactly
    these evaluations before it runs (``LocalBackend.deadlines``), so the store keeps their records too. A copy
    whose own prediction would trace other copies, or whose techniques do not validate at its depth, is left
    out (its evaluation traces it)."""
    layers = evaluation.model_config["num_hidden_layers"]
    found = []
    for trace in prediction.traces:
        runs = [(kind, int(count)) for kind, count in trace.runs]
        depth = sum(count for _, count in runs)
        if trace.stopped or depth >= layers or plan_traces(runs)[1]:
            continue
        techniques = techniques_for_runs(evaluation.techniques, runs)
        config = copy_for_runs(evaluation.model_config, runs)
        if model_runs(techniques, config) != runs:
            continue
        try:
            techniques.validate(config, evaluation.world_size, evaluation.seq_len)
        except ConfigError:
            continue
        alone = with_overheads(trace, evaluation.hardware, traces=[trace], elapsed_s=trace.elapsed_s)  # as ``predict``
        found.append((replace(evaluation, model_config=config, techniques=techniques), alone))
    return found


def counter_modes(evaluation: Evaluation):
    """The oracle's ``modes``: a step counter inside each traced step's memory tracker."""

    def modes(tracker):
        return [StepCounter(tracker, seq_len=evaluation.seq_len, world_size=evaluation.world_size)]

    return modes


def step_counts(prediction: Prediction) -> StepCounts:
    """The throughput counter's counts at full depth, extended from the traced copies like the memory. Raises
    when the counter could not count an op (the counts would miss its work)."""
    counters = []
    for trace in prediction.traces:
        modes = trace.extras[0] if trace.extras else []
        if not modes:
            raise RuntimeError(f"the {trace.layers}-layer trace ran without a step counter")
        counters.append(modes[0])
    failures = {op: why for counter in counters for op, why in counter.failures.items()}
    if failures:
        op, why = next(iter(failures.items()))
        raise RuntimeError(f"the step counter could not count {len(failures)} op(s), e.g. {op}: {why}")
    counts = [counter.counts for counter in counters]
    if len(counts) == 1:
        return counts[0]
    return extend_value(counts[0], list(zip(counts[1:], prediction.extension)))


def step_time(evaluation: Evaluation, prediction: Prediction) -> TimeBreakdown:
    return predict_step_time(
        step_counts(prediction),
        evaluation.hardware.rates_for(evaluation.world_size),
        evaluation.world_size,
        evaluation.techniques,
        seq_len=evaluation.seq_len,
        gpus_per_node=evaluation.gpus if evaluation.nodes > 1 else None,
    )
