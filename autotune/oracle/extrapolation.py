"""Depth extrapolation: decoder layers are identical, so a model of ``L`` layers is traced at 3 and 4 layers and
each segment's peak extended exactly to ``L`` (see ``autotune.oracle``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.core.record import BREAKDOWN_CATEGORIES
from autotune.oracle.results import EXTRAPOLATE_FROM, Segment, Trace, full_breakdown


def plan_traces(runs: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], list[tuple[int, list]]]:
    """Which shallow copies to trace for a model of ``runs``: a base (each run of 3+ layers cut to 3, shorter
    runs as they are) and, per cut run, the base with that run at 4 layers. Returns (base, [(run index,
    runs), ...]); no cut runs (all shorter than 3, or a model of at most 4 layers) means: run the model itself."""
    short, long = EXTRAPOLATE_FROM
    if sum(n for _, n in runs) <= long:  # the copies would be no shallower than the model
        return list(runs), []
    base = [(kind, min(n, short)) for kind, n in runs]
    varied = []
    for index, (kind, n) in enumerate(runs):
        if n > short:
            longer = list(base)
            longer[index] = (kind, long)
            varied.append((index, longer))
    return base, varied


def extension_limits(
    base: Trace, layers_added: int, device_limit: int, host_limit: int | None
) -> tuple[dict[tuple, int], int | None]:
    """Limits for the one deeper copy of a model with a single cut run, above which its extension cannot fit:
    a segment whose running peak ``b`` in that copy passes ``a + (device_limit - a) // n`` (``a`` its peak in
    ``base``, ``n`` = ``layers_added``) extends to ``a + (b - a) * n > device_limit``, and so does the host.
    Peaks only grow as a trace runs, and the extension grows with them, so a copy stopped there proves an OOM
    (``extrapolate(..., partial=True)`` gives its lower bound)."""
    n = layers_added
    segments = {key: seg.device_bytes + (device_limit - seg.device_bytes) // n for key, seg in base.segments.items()}
    host = None if host_limit is None else base.peak_host_bytes + (host_limit - base.peak_host_bytes) // n
    return segments, host


def extrapolate(
    base: Trace, varied: list[tuple[int, Trace]], runs: list[tuple[str, int]], partial: bool = False
) -> Trace:
    """Extend the traces of ``plan_traces`` to the model of ``runs``: each segment's peak (and each category
    in it, and the host bytes then) is ``base + sum over cut runs of (trace_run - base) * (length - 3)``.

    ``partial``: the one deeper copy was stopped (``extension_limits``); the segments it reached are extended
    from their peaks so far and the result, ``stopped``, is a lower bound of the model's peak and host bytes."""
    short = EXTRAPOLATE_FROM[0]
    steps = [(trace, runs[index][1] - short) for index, trace in varied]
    segments: dict[tuple, Segment] = {}
    for key, a in base.segments.items():
        device, host = a.device_bytes, a.host_bytes
        breakdown = {c: a.breakdown.get(c, 0) for c in BREAKDOWN_CATEGORIES}
        if partial and any(key not in trace.segments for trace, _ in steps):
            continue
        for trace, n in steps:
            b = trace.segments.get(key)
            if b is None:
                raise RuntimeError(f"segment {key} is missing from the {trace.layers}-layer trace")
            device += (b.device_bytes - a.device_bytes) * n
            host += (b.host_bytes - a.host_bytes) * n
            for c in BREAKDOWN_CATEGORIES:
                breakdown[c] += (b.breakdown.get(c, 0) - a.breakdown.get(c, 0)) * n
        segments[key] = Segment(int(device), {c: int(v) for c, v in breakdown.items()}, int(host))
    if not segments:  # a deeper copy stopped before its first segment: the model holds at least the base's
        segments = dict(base.segments)
    peak_key = max(segments, key=lambda k: segments[k].device_bytes)
    peak = segments[peak_key]
    host = base.peak_host_bytes + sum((t.peak_host_bytes - base.peak_host_bytes) * n for t, n in steps)
    host = max(host, max(s.host_bytes for s in segments.values()))
    traces = [base] + [t for _, t in varied]
    return Trace(
        layers=sum(n for _, n in runs),
        peak_device_bytes=peak.device_bytes,
        breakdown=full_breakdown(peak.breakdown),
        peak_host_bytes=int(host),
        peak_segment=peak_key,
        segments=segments,
        elapsed_s=sum(t.elapsed_s for t in traces),
        extras=[e for t in traces for e in t.extras],
        runs=list(runs),
        stopped=partial,
        stop_reason=traces[-1].stop_reason if partial else None,
    )


def extend_value(base, others: list[tuple[Any, int]]):
    """Linear extension of any numeric structure (numbers, dicts, lists, dataclasses) the way ``extrapolate``
    extends segment peaks: ``base + sum of (other - base) * n`` over ``others = [(other, n), ...]`` -- e.g. a
    throughput counter's counts of the traces in ``Prediction.traces`` with ``Prediction.extension``."""

    if isinstance(base, bool) or base is None:
        return base if not others else others[-1][0]
    if isinstance(base, (int, float)):
        value = base + sum((other - base) * n for other, n in others)
        return int(value) if isinstance(base, int) and all(isinstance(o, int) for o, _ in others) else value
    if isinstance(base, dict):
        keys = list(base) + [k for other, _ in others for k in other if k not in base]
        keys = list(dict.fromkeys(keys))
        return {
            k: extend_value(
                base[k] if k in base else _zero_like(next(o[k] for o, _ in others if k in o)),
                [(o[k] if k in o else _zero_like(base[k]), n) for o, n in others],
            )
            for k in keys
        }
    if isinstance(base, (list, tuple)) and all(isinstance(o, (list, tuple)) and len(o) == len(base) for o, _ in others):
        return type(base)(extend_value(v, [(o[i], n) for o, n in others]) for i, v in enumerate(base))
    if dataclasses.is_dataclass(base) and not isinstance(base, type):
        return type(base)(
            **{
                f.name: extend_value(getattr(base, f.name), [(getattr(o, f.name), n) for o, n in others])
                for f in dataclasses.fields(base)
                if f.init
            }
        )
    return base if not others else others[-1][0]


def _zero_like(value):

    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return type(value)(0)
    if isinstance(value, dict):
        return {k: _zero_like(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value)(**{f.name: _zero_like(getattr(value, f.name)) for f in dataclasses.fields(value)})
    return value
