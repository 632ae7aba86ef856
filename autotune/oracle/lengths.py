"""Peaks along the length axis: each segment's peak as an affine function of the sequence length, from two traces.

A segment's live bytes are sums of tensors whose sizes are affine in the length (activations, their gradients, the
logits of a tile) or independent of it (parameters, optimizer states, one tile's temporaries once the length
spans whole tiles). Two things bend that line: a tile count ``ceil(tokens / tile)`` (one tile is the untiled path;
a partial last tile is a smaller shard) and a kernel's block rounding. At lengths where every rank's share of the
sequence is a whole number (two or more) of every tile, both are exact, so the oracle's segment peaks at two such
lengths give a line that holds at every other such length as long as the same op holds each segment's peak (a
segment's peak is the largest of its ops' live bytes); between such lengths the real peak may step a little off it.

``LengthModel`` is that line per segment (device bytes by category, host bytes), the model's tensor peak (the
largest segment) plus the hardware's runtime overheads, and the longest grid length it says fits. It is a guess:
``autotune.search.max_seq`` confirms the guess with the oracle itself, tracing the answer and the next grid step,
so the answer is always the oracle's own record.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

from autotune.oracle.results import Trace
from trials.stack.techniques import knobs


def grid_tiles(techniques) -> list[int]:
    """The tile sizes (tokens per rank) of ``techniques``'s ``grid`` knobs that are on."""
    return [
        int(getattr(techniques, k.name)) for k in knobs() if k.length_unit == "grid" and getattr(techniques, k.name)
    ]


def probe_steps(techniques, unit: int, min_tokens: int = 64 * 1024) -> tuple[int, int]:
    """Two grid indices (multiples of ``unit``) where every rank's share of the sequence is a whole number, two or
    more, of every tile, and the length at least ``min_tokens``: the lengths ``LengthModel`` is built from. A
    segment's peak is the largest of its ops' live bytes, each affine in the length: at short lengths the op
    whose bytes do not grow with it can hold the peak, so the traces start where the length dominates."""
    # the ranks one sequence is split over: Ulysses x ring (``unit`` holds the ring's 2 x ring x Ulysses)
    split = max(1, int(getattr(techniques, "ulysses_degree", 1) or 1)) * max(1, getattr(techniques, "ring_degree", 1))
    tiles = grid_tiles(techniques)
    period = 1
    for tile in tiles:
        period = math.lcm(period, math.lcm(unit, tile * split) // unit)
    floor_tokens = max([min_tokens] + [2 * tile * split for tile in tiles])
    first = period * max(1, math.ceil(floor_tokens / (period * unit)))
    second = first + period * max(1, first // (2 * period))
    return first, second


@dataclass
class _Line:
    """``at(m) = a + slope * (m - m0)``, exact (``Fraction``)."""

    m0: int
    a: int
    slope: Fraction

    @classmethod
    def through(cls, m1: int, v1: int, m2: int, v2: int) -> _Line:
        return cls(m1, int(v1), Fraction(int(v2) - int(v1), m2 - m1))

    def at(self, m: int) -> int:
        return math.floor(self.a + self.slope * (m - self.m0))


class LengthModel:
    """Each segment's full-depth peak (device and host bytes) as a line in the grid index ``m`` (the length is
    ``m * unit``), through the oracle's traces at two grid indices (``probe_steps``)."""

    def __init__(self, hardware, m1: int, first: Trace, m2: int, second: Trace):
        if set(first.segments) != set(second.segments):
            raise ValueError("the two traces have different segments")
        self.hardware = hardware
        self.device = {
            key: _Line.through(m1, first.segments[key].device_bytes, m2, second.segments[key].device_bytes)
            for key in first.segments
        }
        self.host_by_segment = {
            key: _Line.through(m1, first.segments[key].host_bytes, m2, second.segments[key].host_bytes)
            for key in first.segments
        }
        self.host = _Line.through(m1, first.peak_host_bytes, m2, second.peak_host_bytes)

    def peak_device_bytes(self, m: int) -> int:
        """The model's peak at grid index ``m``: the largest segment's tensor bytes plus the runtime overheads."""
        tensor = max(line.at(m) for line in self.device.values())
        return tensor + self.hardware.overhead_bytes(tensor)

    def host_bytes(self, m: int) -> int:
        return max([self.host.at(m)] + [line.at(m) for line in self.host_by_segment.values()])

    def fits(self, m: int) -> bool:
        """What the oracle's record would say at ``m`` if the lines held there: ``ok`` by device and host memory."""
        return self.peak_device_bytes(m) <= self.hardware.device_memory_bytes and self.hardware.host_fits(
            self.host_bytes(m)
        )

    def longest(self, low: int, top: int) -> int | None:
        """The largest ``m`` in ``[low, top]`` the model says fits (bisecting: the lines' peaks grow with the
        length), or None when ``low`` does not."""
        if not self.fits(low):
            return None
        lo, hi = low, top + 1  # fits(lo), not fits(hi) (top + 1 stands for "beyond the range")
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.fits(mid):
                lo = mid
            else:
                hi = mid
        return lo
