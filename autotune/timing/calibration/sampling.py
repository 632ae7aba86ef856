"""Timing on a shared machine: samples taken while other processes were busy are discarded, and a fixed
probe workload tracks the host's speed drift (see ``speed_probe_s``)."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes


def cpu_busy_fraction(interval: float = 0.5) -> float:
    """Fraction of this machine's CPU time used (by anyone) over ``interval`` seconds, from /proc/stat."""

    def read():
        with open("/proc/stat") as f:
            parts = [float(x) for x in f.readline().split()[1:]]
        idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
        return idle, sum(parts)

    try:
        idle0, total0 = read()
        time.sleep(interval)
        idle1, total1 = read()
    except OSError:
        return 0.0
    total = total1 - total0
    return 1.0 - (idle1 - idle0) / total if total > 0 else 0.0


def wait_for_idle(threshold: float = 0.12, timeout_s: float = 60.0) -> float:
    """Wait (up to ``timeout_s``) until other processes use less than ``threshold`` of the CPUs; returns the last
    busy fraction seen. Timings on a shared machine are only meaningful when it is quiet."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy_fraction()
    return busy


# -- contention-aware timing ---------------------------------------------------------------------------------
# This machine may be shared. Every timed sample also measures how much CPU *other* processes used meanwhile
# (/proc/stat minus the calibration workers' own jiffies); a sample during which others used more than
# CONTENDED of the CPUs is discarded, and sampling goes on (up to a time budget) until enough clean ones exist.
# All workers take the same number of samples (rank 0 decides), so they keep loading the machine together.

CONTENDED = 0.10
WORKER_PIDS: list[int] = []  # the calibration workers' process ids (set by the worker)
CONTENDED_BENCHMARKS: list[str] = []


def _stat_busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        parts = [float(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
    return sum(parts) - idle, sum(parts)


def _own_jiffies() -> float:
    total = 0.0
    for pid in WORKER_PIDS or [os.getpid()]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += float(fields[11]) + float(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total


def others_share(before, after) -> float:
    """Share of all CPUs used by other processes between two ``cpu_snapshot()``s."""
    (busy0, total0, own0), (busy1, total1, own1) = before, after
    total = total1 - total0
    if total <= 0:
        return 0.0
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / total


def cpu_snapshot():
    """(busy jiffies of all CPUs, all jiffies, ``WORKER_PIDS``' own jiffies) now: two give ``others_share``."""
    try:
        busy, total = _stat_busy()
    except OSError:
        return 0.0, 0.0, 0.0
    return busy, total, _own_jiffies()


def _agree(value: int) -> int:
    """Rank 0's value, for every worker (all take the same number of samples and repetitions, which matters
    when the timed function is itself a collective)."""

    if not dist.is_initialized():
        return int(value)

    flag = torch.tensor([int(value)])
    dist.broadcast(flag, 0)
    return int(flag.item())


def sample(
    fn, name: str, samples: int = 5, min_seconds: float = 0.15, budget_s: float = 20.0, returns_times: bool = False
):
    """Clean timings of ``fn`` (its wall time, or with ``returns_times`` the tuple of seconds it returns), at
    least ``samples`` of them or whatever the time budget allowed; all samples if none was clean."""
    fn()  # warm-up
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    reps = _agree(1 if returns_times else max(1, int(min_seconds / max(once, 1e-6))))
    clean, dirty = [], []
    deadline = time.monotonic() + budget_s
    while True:
        before = cpu_snapshot()
        start = time.perf_counter()
        for _ in range(reps):
            value = fn()
        seconds = (time.perf_counter() - start) / reps
        share = others_share(before, cpu_snapshot())
        value = value if returns_times else seconds
        (clean if share <= CONTENDED else dirty).append(value)
        done = len(clean) >= samples or time.monotonic() > deadline
        if _agree(done):
            break
        if os.environ.get("AUTOTUNE_CALIBRATE_VERBOSE"):
            print(f"{name}: sample {seconds:.4g}s, others {share:.0%}", file=sys.stderr, flush=True)
        if share > CONTENDED:
            time.sleep(0.5)
    if not clean:
        CONTENDED_BENCHMARKS.append(name)
    return clean or dirty


def relative_spread(times: list[float]) -> float:
    """(max - min) / median of some timings: how far apart the samples of one measurement lie."""
    median = statistics.median(times)
    return (max(times) - min(times)) / median if median else 0.0


def median_time(fn, name: str = "", samples: int = 5) -> float:
    """The median of the clean samples. Not the minimum: a shared host's speed also varies with no other
    process visible, and a trial's multi-second step averages over that, so the typical sample is the one that
    predicts it."""
    return statistics.median(sample(fn, name, samples))


def barrier():

    if dist.is_initialized():
        dist.barrier()


def speed_probe_s(samples: int = 5) -> float:
    """Seconds of a fixed small workload (matmuls, memory-bound elementwise ops, many tiny dispatched ops: the mix
    of a CPU training step), median of ``samples``. A shared host's speed drifts over minutes with no other
    process visible; the calibration records the probe beside its measurements
    (``probe_s``), so a later measurement that runs the probe beside itself can be put in the calibration's
    units: ``seconds * probe_s / probe_now`` (``bench/throughput_fidelity.py`` does). Not contention-filtered:
    callers check contention around it as around everything else."""

    with _disable_current_modes():  # a trial's memory tracker (a Python dispatch mode) must not time itself here
        return _speed_probe_s(torch, samples)


def _speed_probe_s(torch, samples: int) -> float:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    x, small = torch.randn(1 << 19), torch.randn(64)

    def work():  # small: cheap enough to run beside every group of measurements
        for _ in range(16):
            torch.mm(a, b)
        for _ in range(32):
            x.mul_(1.0001).add_(1e-4)
        for _ in range(600):
            small.add_(1e-4)

    work()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
