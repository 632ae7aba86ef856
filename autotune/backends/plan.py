"""The ``plan`` backend: predicted records, no GPU needed.

Memory: ``autotune.oracle.predict`` -- the trial's own code under FakeTensorMode with a fake process group of
``gpus`` ranks, rank 0's tracked tensor peak plus the hardware preset's runtime overheads (CUDA context, NCCL
buffers, allocator fragmentation), compared with ``hardware.device_memory_bytes``: ``ok`` or ``oom``.

Time: when ``autotune.throughput`` is importable, its ``StepCounter`` watches the same fake step (inside the
oracle's tracker) and ``predict_step_time`` turns the counts into ``step_time_s`` / ``tokens_per_s``; counts of
the 3- and 4-layer traces are extended to full depth like the memory. Without it both stay None.

Records are cached per (model, techniques, seq_len, gpus, hardware), so the search and ``--max-seq`` never
trace the same point twice in one process.
"""

from __future__ import annotations

import json
import traceback
from collections import OrderedDict

from autotune.backends import Backend, Evaluation
from autotune.record import ResultRecord


def _key(evaluation: Evaluation) -> str:
    hw = evaluation.hardware
    return json.dumps([evaluation.model_config, evaluation.techniques.to_dict(), evaluation.seq_len,
                       evaluation.gpus, hw.name, hw.device_memory_bytes], sort_keys=True, default=str)


def _throughput_module():
    try:
        from autotune import throughput
    except Exception:  # not there yet, or broken: memory-only predictions
        return None
    if not (hasattr(throughput, "StepCounter") and hasattr(throughput, "predict_step_time")):
        return None
    return throughput


class PlanBackend(Backend):
    """Predictions from the memory oracle (+ the throughput model when present)."""

    name = "plan"

    def __init__(self, throughput: bool = True, cache_size: int = 4096, stop_above: float | None = None):
        """``stop_above``: a fraction of device capacity (e.g. 1.0, or 1.05 for a prefilter's margin); a trace
        crossing it stops there and the record is ``oom`` with the bytes at the crossing as a lower bound of
        the peak -- much cheaper for the search, which only needs to know it does not fit. None (estimate,
        --max-seq, the ablation): always the full trace, with the whole breakdown."""
        self.throughput = throughput
        self.stop_above = stop_above
        self.cache_size = cache_size
        self._cache: OrderedDict[str, ResultRecord] = OrderedDict()
        self._peak_at: dict[str, tuple | None] = {}
        self.last_prediction = None  # the oracle's full Prediction of the latest uncached evaluation

    def peak_at(self, evaluation: Evaluation):
        """Where the peak of an evaluated point is: (phase, position) of the oracle's segment, or None."""
        return self._peak_at.get(_key(evaluation))

    def evaluate(self, evaluation: Evaluation) -> ResultRecord:
        key = _key(evaluation)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            return ResultRecord.from_dict(cached.to_dict())
        record = self._evaluate(evaluation)
        self._cache[key] = record
        if self.last_prediction is not None and record.status in ("ok", "oom"):
            self._peak_at[key] = self.last_prediction.peak_segment
        while len(self._cache) > self.cache_size:
            old_key, _ = self._cache.popitem(last=False)
            self._peak_at.pop(old_key, None)
        return ResultRecord.from_dict(record.to_dict())

    def _evaluate(self, evaluation: Evaluation) -> ResultRecord:
        from autotune.errors import UserError
        from autotune.oracle import predict

        hw = evaluation.hardware
        base = dict(source="predicted", seq_len=evaluation.seq_len, device=f"{hw.name} x{evaluation.gpus} (predicted)")
        try:
            evaluation.techniques.validate(evaluation.model_config, evaluation.gpus, evaluation.seq_len)
        except UserError as exc:
            return ResultRecord(status="error", error=str(exc), **base)
        self.last_prediction = None
        throughput = _throughput_module() if self.throughput else None
        modes = None
        if throughput is not None:
            def modes(tracker):
                return [throughput.StepCounter(tracker, seq_len=evaluation.seq_len, world_size=evaluation.gpus)]
        try:
            stop = None if self.stop_above is None else int(hw.device_memory_bytes * self.stop_above)
            prediction = predict(evaluation, modes=modes, stop_above_bytes=stop)
        except Exception as exc:  # a config the trial code cannot run is an error record, not a crash
            return ResultRecord(status="error", error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}",
                                **base)
        self.last_prediction = prediction
        capacity = hw.device_memory_bytes
        fits = prediction.peak_device_bytes <= capacity and not prediction.stopped
        where = '/'.join(str(p) for p in prediction.peak_segment or ())
        error = None
        if fits and not hw.host_fits(prediction.host_bytes):  # offloaded states need the node's RAM too
            fits = False
            error = (f"predicted host memory {prediction.host_bytes:,} bytes per rank > the node's "
                     f"{hw.host_memory_bytes_per_device:,} bytes per device (host out of memory)")
        elif prediction.stopped:
            error = (f"predicted out of memory: a {prediction.traces[-1].layers}-layer copy already reaches "
                     f"{prediction.peak_device_bytes:,} bytes > capacity {capacity:,} bytes at {where} "
                     f"(trace stopped there; the full peak is higher)")
        elif not fits:
            error = f"predicted peak {prediction.peak_device_bytes:,} bytes > capacity {capacity:,} bytes (at {where})"
        record = ResultRecord(
            status="ok" if fits else "oom", peak_device_bytes=int(prediction.peak_device_bytes),
            host_bytes=int(prediction.host_bytes), breakdown=dict(prediction.breakdown), error=error, **base)
        if throughput is not None and not prediction.stopped:
            try:
                timing = _step_time(throughput, evaluation, prediction)
            except Exception:
                timing = None
            if timing is not None:
                record.step_time_s = float(timing.step_time_s)
                record.tokens_per_s = float(timing.tokens_per_s) if timing.tokens_per_s else None
        return record


def step_counts(prediction):
    """The throughput counter's counts at full depth, extended from the traced copies like the memory."""
    from autotune.oracle import extend_value

    counts = []
    for trace in prediction.traces:
        modes = trace.extras[0] if trace.extras else []
        if not modes:
            return None
        counts.append(modes[0].counts)
    if len(counts) == 1:
        return counts[0]
    return extend_value(counts[0], list(zip(counts[1:], prediction.extension)))


def _step_time(throughput, evaluation: Evaluation, prediction):
    counts = step_counts(prediction)
    if counts is None:
        return None
    return throughput.predict_step_time(counts, evaluation.hardware, evaluation.gpus, evaluation.techniques,
                                        seq_len=evaluation.seq_len)
