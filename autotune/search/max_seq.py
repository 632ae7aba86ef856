"""The longest sequence one config fits: ``find_max_seq`` (``autotune estimate --max-seq``, the ablation)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from autotune.backends import Backend, make_backend
from autotune.backends.plan_store import default_store
from autotune.core.evaluation import Evaluation
from autotune.core.record import ResultRecord
from autotune.core.trainers import ExportJob, Trainer
from trials.stack.rules import length_unit
from trials.stack.techniques import Techniques, knobs


def find_max_seq(
    evaluation: Evaluation, backend: Backend | None = None, max_tokens: int = 1024**3, progress: Callable | None = None
) -> ResultRecord:
    """The longest sequence that fits ``evaluation``'s config (its ``seq_len``, if > 0, is the first guess):
    the record (``ResultRecord``) at that length, status ``ok``; or, when not even one grid step fits, the
    ``oom`` (or ``error``) record of the shortest length.

    Peak memory grows with the sequence (nearly affinely: every activation is linear in it), so the search
    brackets the capacity crossing and then steps to where the line through the two nearest points meets
    the capacity (bisecting when that makes no progress); ~5-10 evaluations on a grid of
    ``trials.stack.rules.length_unit`` multiples. ``backend``: a plan backend (default: a new one, with the on-disk
    ``plan_store``: records a search or an earlier run already has are read back, not traced).
    """

    if backend is None:
        backend = make_backend("plan", store=default_store())
    unit = length_unit(evaluation.techniques)
    top = max(1, max_tokens // unit)
    capacity = evaluation.hardware.device_memory_bytes
    seen: dict[int, Any] = {}

    def run(m: int):
        if m not in seen:
            record = backend.evaluate(replace(evaluation, seq_len=m * unit))
            seen[m] = record
            if progress is not None:
                progress(record)
        return seen[m]

    def fits(record) -> bool:
        return record.status == "ok"

    first = min(top, max(1, (evaluation.seq_len or 128 * 1024) // unit))
    record = run(first)
    if record.status not in ("ok", "oom"):
        return record
    lo, hi = (first, None) if fits(record) else (None, first)
    # bracket: jump along the line through the last two points (at most x16, at least x2 per jump)
    while lo is None or hi is None:
        points = sorted(seen)
        if lo is None:
            if hi == 1:
                return run(1)
            guess = max(1, min(hi // 2, _crossing(seen, points, capacity, default=hi // 4)))
        else:
            if lo >= top:
                return run(lo)
            guess = min(top, max(lo * 2, min(lo * 16, _crossing(seen, points, capacity, default=lo * 4))))
        record = run(guess)
        if record.status not in ("ok", "oom"):
            return record
        if fits(record):
            lo = max(lo or 0, guess)
        else:
            hi = guess if hi is None else min(hi, guess)
    # narrow: secant steps inside (lo, hi), bisection as the fallback
    while hi - lo > 1:
        guess = _crossing(seen, [lo, hi], capacity, default=(lo + hi) // 2)
        if not lo < guess < hi:
            guess = (lo + hi) // 2
        # keep the guess just inside the side the line points to, so a good line closes the bracket quickly
        record = run(guess)
        if record.status not in ("ok", "oom"):
            return record
        if fits(record):
            lo = guess
            if hi - lo > 1 and guess + 1 < hi:  # probe one step above: the line is usually right to the step
                above = run(guess + 1)
                if fits(above):
                    lo = guess + 1
                else:
                    hi = guess + 1
        else:
            hi = guess
            if hi - lo > 1 and guess - 1 > lo:
                below = run(guess - 1)
                if fits(below):
                    lo = guess - 1
                else:
                    hi = guess - 1
    return run(lo)


def _crossing(seen: dict, points: list[int], capacity: int, default: int) -> int:
    """Grid index where the line through the peaks at the last two ``points`` reaches ``capacity``."""
    usable = [m for m in points if seen[m].peak_device_bytes]
    if len(usable) < 2:
        return default
    a, b = usable[-2], usable[-1]
    pa, pb = seen[a].peak_device_bytes, seen[b].peak_device_bytes
    if pb == pa:
        return default
    slope = (pb - pa) / (b - a)
    if slope <= 0:
        return default
    return int(math.floor(a + (capacity - pa) / slope))


def trainer_techniques_at(trainer: Trainer, evaluation: Evaluation, seq_len: int) -> Techniques:
    """What ``trainer`` runs for ``evaluation``'s config at ``seq_len`` (its own values can depend on the length:
    ArcticTraining's loss tile)."""
    job = ExportJob("", evaluation.model_config, evaluation.gpus, seq_len, evaluation.techniques, evaluation.nodes)
    return trainer.runs(job)


class _TrainerAtEachLength:
    """``find_max_seq``'s backend for a trainer: at each length it is asked for, the plan backend evaluates what
    the trainer runs there for the config."""

    name = "plan"

    def __init__(self, trainer: Trainer, asked: Evaluation, plan: Backend):
        self.trainer, self.asked, self.plan = trainer, asked, plan

    def evaluate(self, evaluation: Evaluation) -> ResultRecord:
        techniques = trainer_techniques_at(self.trainer, self.asked, evaluation.seq_len)
        return self.plan.evaluate(replace(evaluation, techniques=techniques))


def find_trainer_max_seq(
    evaluation: Evaluation, trainer: Trainer, backend: Backend | None = None, progress: Callable | None = None
) -> ResultRecord:
    """``find_max_seq`` of what ``trainer`` runs for ``evaluation``'s config, evaluated at each length as the trainer
    runs it there. Lengths tried are multiples of 1024 and of what the length must divide (the Ulysses degree), not
    of the trainer's tile sizes: tiles need not divide the sequence."""
    if backend is None:
        backend = make_backend("plan", store=default_store())
    if all(expression.as_asked for expression in trainer.expresses.values()):
        return find_max_seq(evaluation, backend, progress=progress)
    untiled = {k.name: 0 for k in knobs() if k.length_unit == "grid"}  # the grid find_max_seq steps on
    return find_max_seq(
        replace(evaluation, techniques=replace(evaluation.techniques, **untiled)),
        backend=_TrainerAtEachLength(trainer, evaluation, backend),
        progress=progress,
    )
