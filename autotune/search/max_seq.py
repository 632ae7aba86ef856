"""The longest sequence one config fits: ``find_max_seq`` (``autotune estimate --max-seq``, the ablation)."""

from __future__ import annotations

import math
import multiprocessing
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from autotune.backends import Backend, make_backend
from autotune.backends.plan import PlanBackend
from autotune.backends.plan_store import default_store
from autotune.backends.pool import default_workers, end_workers, sigint_deferred
from autotune.core import quiet
from autotune.core.evaluation import Evaluation
from autotune.core.record import ResultRecord
from autotune.core.trainers import ExportJob, Trainer
from autotune.oracle import full_depth_trace
from autotune.oracle.lengths import LengthModel, probe_steps
from trials.stack.rules import length_unit
from trials.stack.techniques import Techniques, knobs


@dataclass
class MaxSeqSearch:
    """How ``find_max_seq`` found its answer: ``method`` "length model" (a line per segment from two short traces,
    its answer and the next grid step confirmed by the oracle) or "probes" (bracketing and secant steps along
    the grid); ``reason``: why the length model did not answer (None when it did); ``lengths``: every length the
    backend evaluated, in order; ``model_lengths``: the lengths the model was built from."""

    method: str
    reason: str | None
    lengths: list[int] = field(default_factory=list)
    model_lengths: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line: how the answer was found, how many lengths it took, and why the model did not answer."""
        built = f", the model built from {len(self.model_lengths)} traces" if self.model_lengths else ""
        return f"by {self.method} ({len(self.lengths)} lengths evaluated{built})" + (
            f"; {self.reason}" if self.reason else ""
        )


def find_max_seq(
    evaluation: Evaluation,
    backend: Backend | None = None,
    max_tokens: int = 1024**3,
    progress: Callable | None = None,
    length_model: bool = True,
) -> ResultRecord:
    """The longest sequence that fits ``evaluation``'s config: the record (``ResultRecord``) at that length, status
    ``ok``; or, when not even one grid step fits, the ``oom`` (or ``error``) record of the shortest length.
    ``search_max_seq`` says how (and takes the same arguments)."""
    return search_max_seq(evaluation, backend, max_tokens, progress, length_model)[0]


def search_max_seq(
    evaluation: Evaluation,
    backend: Backend | None = None,
    max_tokens: int = 1024**3,
    progress: Callable | None = None,
    length_model: bool = True,
) -> tuple[ResultRecord, MaxSeqSearch]:
    """``find_max_seq``'s record and how it was found. Lengths are multiples of ``trials.stack.rules.length_unit``
    up to ``max_tokens``; ``evaluation.seq_len`` (if > 0) is the probes' first guess. ``backend``: a plan backend
    (default: a new one, with the on-disk ``plan_store``: records a search or an earlier run already has are read
    back, not traced).

    ``length_model`` (a ``PlanBackend``): the oracle traces two short lengths (``autotune.oracle.lengths``), the
    line through each segment's peaks says where the config stops fitting, and the backend evaluates that length
    and the next grid step; when the first fits and the next does not, that is the answer, the backend's own
    record. When the lines miss (a knob that changes shape with the length), the probes go on from the points
    evaluated. Without it (or with another backend), the probes alone: peak memory grows with the sequence (nearly
    affinely), so they bracket the capacity crossing and then step to where the line through the two nearest points
    meets the capacity (bisecting when that makes no progress); ~5-10 evaluations.
    """

    if backend is None:
        backend = make_backend("plan", store=default_store())
    unit = length_unit(evaluation.techniques)
    top = max(1, max_tokens // unit)
    capacity = evaluation.hardware.device_memory_bytes
    seen: dict[int, Any] = {}
    how = MaxSeqSearch("probes", None if length_model else "not asked")

    def run(m: int):
        if m not in seen:
            record = backend.evaluate(replace(evaluation, seq_len=m * unit))
            seen[m] = record
            how.lengths.append(m * unit)
            if progress is not None:
                progress(record)
        return seen[m]

    def fits(record) -> bool:
        return record.status == "ok"

    lo = hi = None
    if length_model:
        with _SecondProcess(isinstance(backend, PlanBackend) and default_workers() > 1) as second:
            guess, how.reason = _model_guess(evaluation, backend, unit, top, how, second)
            if guess is not None:
                above = replace(evaluation, seq_len=(guess + 1) * unit)
                verdict = second.submit(_verdict, above, backend.store) if guess < top else None
                record = run(guess)
                if record.status not in ("ok", "oom"):
                    return record, how
                if fits(record) and (guess >= top or not _fits_by_memory(backend, above, how, verdict)):
                    how.method = "length model"
                    return record, how
        if guess is not None:
            if fits(record):
                lo = guess
                if run(guess + 1).status not in ("ok", "oom"):  # the probes go on from its whole record
                    return seen[guess + 1], how
                lo = guess + 1
            else:
                hi = guess
                if guess == 1 or fits(run(guess - 1)):
                    how.method = "length model"
                    return run(max(1, guess - 1)), how
                hi = guess - 1
            how.reason = (
                f"the length model's answer {guess * unit:,} was {'short' if lo else 'long'}: the peak is not "
                f"affine in the length there"
            )
    if lo is None and hi is None:
        first = min(top, max(1, (evaluation.seq_len or 128 * 1024) // unit))
        record = run(first)
        if record.status not in ("ok", "oom"):
            return record, how
        lo, hi = (first, None) if fits(record) else (None, first)
    # bracket: jump along the line through the last two points (at most x16, at least x2 per jump)
    while lo is None or hi is None:
        points = sorted(seen)
        if lo is None:
            if hi == 1:
                return run(1), how
            guess = max(1, min(hi // 2, _crossing(seen, points, capacity, default=hi // 4)))
        else:
            if lo >= top:
                return run(lo), how
            guess = min(top, max(lo * 2, min(lo * 16, _crossing(seen, points, capacity, default=lo * 4))))
        record = run(guess)
        if record.status not in ("ok", "oom"):
            return record, how
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
            return record, how
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
    return run(lo), how


def _fits_by_memory(
    backend: PlanBackend, evaluation: Evaluation, how: MaxSeqSearch, verdict: Future | None = None
) -> bool:
    """Whether ``evaluation`` fits, as ``backend``'s record would say: by a plan backend without the time model
    whose traces stop where they cross the device's or the host's memory (the search's own verdict, exact, and
    cheaper than the whole record, which nobody reads). ``verdict``: that record, on its way from a second
    process."""
    how.lengths.append(evaluation.seq_len)
    record = verdict.result() if verdict is not None else _verdict(evaluation, backend.store)
    return record.status == "ok"


def _verdict(evaluation: Evaluation, store) -> ResultRecord:
    return PlanBackend(throughput=False, stop_above=1.0, store=store).evaluate(evaluation)


class _SecondProcess:
    """The length model's traces and its confirmation come in independent pairs (the two short lengths; the answer
    and the next grid step): on a machine with a second core, one of each pair runs in a second process (spawned:
    a fresh interpreter, as the search's pool) while this one runs the other. Each answer is the one this process
    would compute (a plan record is a pure function of its evaluation). ``submit`` returns None where there is no
    second process; leaving the block ends it, and drops what it was still computing."""

    def __init__(self, wanted: bool):
        spawn = multiprocessing.get_context("spawn")
        self.executor = ProcessPoolExecutor(1, mp_context=spawn, initializer=quiet.configure) if wanted else None

    def submit(self, fn, *args) -> Future | None:
        if self.executor is None:
            return None
        with sigint_deferred():  # a worker spawned by the submit starts whole
            return self.executor.submit(fn, *args)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.executor is not None:
            end_workers(self.executor)


def _model_guess(
    evaluation: Evaluation, backend: Backend, unit: int, top: int, how: MaxSeqSearch, second: _SecondProcess
) -> tuple[int | None, str | None]:
    """The grid index ``LengthModel`` says is the longest that fits, or (None, why it has no answer)."""
    if not isinstance(backend, PlanBackend):
        return None, "the backend is not the plan backend: no oracle traces to build the length model from"
    m1, m2 = probe_steps(evaluation.techniques, unit)
    if m2 > top:
        return None, f"the length model's traces ({m2 * unit:,} tokens) lie beyond the longest length asked"
    traces = []
    probes = [replace(evaluation, seq_len=m * unit) for m in (m1, m2)]
    try:  # the second length traces beside the first (where it does not validate, its own turn says why)
        probes[1].techniques.validate(probes[1].model_config, probes[1].world_size, probes[1].seq_len)
        later = second.submit(full_depth_trace, probes[1])
    except Exception:
        later = None
    for m, probe in zip((m1, m2), probes):
        try:
            probe.techniques.validate(probe.model_config, probe.world_size, probe.seq_len)
            traces.append(later.result() if m == m2 and later is not None else full_depth_trace(probe))
        except Exception as exc:  # the probes answer what the model-free search would find too
            return None, f"the length model's trace at {m * unit:,} tokens failed: {type(exc).__name__}: {exc}"
        how.model_lengths.append(m * unit)
    try:
        model = LengthModel(evaluation.hardware, m1, traces[0], m2, traces[1])
    except ValueError as exc:
        return None, f"no length model: {exc}"
    guess = model.longest(m1, top)
    if guess is None:
        return None, f"the length model's first trace ({m1 * unit:,} tokens) does not fit: the wall lies below it"
    return guess, None


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
    """``find_max_seq`` of what ``trainer`` runs for ``evaluation``'s config (``search_trainer_max_seq``)."""
    return search_trainer_max_seq(evaluation, trainer, backend, progress)[0]


def search_trainer_max_seq(
    evaluation: Evaluation,
    trainer: Trainer,
    backend: Backend | None = None,
    progress: Callable | None = None,
    length_model: bool = True,
) -> tuple[ResultRecord, MaxSeqSearch]:
    """``search_max_seq`` of what ``trainer`` runs for ``evaluation``'s config, evaluated at each length as the
    trainer runs it there. Lengths tried are multiples of 1024 and of what the length must divide (the Ulysses
    degree), not of the trainer's tile sizes: tiles need not divide the sequence. A trainer whose techniques
    change with the length has no length model: the probes answer."""
    if backend is None:
        backend = make_backend("plan", store=default_store())
    if all(expression.as_asked for expression in trainer.expresses.values()):
        return search_max_seq(evaluation, backend, progress=progress, length_model=length_model)
    untiled = {k.name: 0 for k in knobs() if k.length_unit == "grid"}  # the grid find_max_seq steps on
    record, how = search_max_seq(
        replace(evaluation, techniques=replace(evaluation.techniques, **untiled)),
        backend=_TrainerAtEachLength(trainer, evaluation, backend),
        progress=progress,
        length_model=False,
    )
    if length_model:
        how.reason = f"what {trainer.name} runs changes with the length: no length model"
    return record, how
