"""What the oracle returns: per-segment peaks (``Segment``), one traced depth (``Trace``), the answer
(``Prediction``). See ``autotune.oracle`` for what a segment is."""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune.core.record import BREAKDOWN_CATEGORIES
from trials.trial.segments import Segment

EXTRAPOLATE_FROM = (3, 4)  # traced depths when a model is deeper than the larger one


@dataclass
class Trace:
    """What one fake trace (or an extrapolation of two) says about rank 0 of one config."""

    layers: int
    peak_device_bytes: int  # tensor bytes only
    breakdown: dict[str, int]  # by category at the peak
    peak_host_bytes: int
    peak_segment: tuple | None = None  # where the peak is: (phase, position)
    segments: dict[tuple, Segment] = field(default_factory=dict)
    elapsed_s: float = 0.0
    extras: list = field(default_factory=list)  # what ``modes`` returned, per traced depth (see ``trace``)
    runs: list = field(default_factory=list)  # the traced decoder layers as runs (``layer_runs``)
    stopped: bool = False  # ``stop_above_bytes`` crossed: the step was cut short there
    stop_reason: str | None = None  # what stopped it: "device" or "host" (``tracing.Limits``)


@dataclass
class Prediction:
    """The oracle's answer for one evaluation (rank 0 = the most loaded rank)."""

    tensor_peak_bytes: int  # peak of live tensor bytes
    peak_device_bytes: int  # tensor peak + runtime overheads (what the OOM decision uses)
    breakdown: dict[str, int]  # categories at the peak; ``other`` includes the overheads
    host_bytes: int
    overhead_bytes: int
    peak_segment: tuple | None
    traces: list[Trace]  # [base] or [base, one per extended run]
    elapsed_s: float
    extension: list[int] = field(default_factory=list)  # per extended run: layers beyond the base trace
    stopped: bool = False  # cut short at a crossing of ``stop_above_bytes``: peak is a lower bound
    stop_reason: str | None = None  # "device" or "host" (the host limit: ``host_bytes`` is a lower bound)
    reached_tensor_bytes: int = 0  # the most live tensor bytes any traced copy or the extension reached


def full_breakdown(breakdown: dict) -> dict[str, int]:
    """Every category of the result record, 0 where absent."""
    return {c: int(breakdown.get(c, 0)) for c in BREAKDOWN_CATEGORIES}
