"""Plan evaluations on every core: a ``PlanBackend`` in each of N worker processes, asked ahead of time.

A search asks for one record at a time, and its next question depends on the answer (follow-ups, TPE), so the
pool cannot simply run many trials at once without changing the study. Instead the search says what it will
ask next (``prefetch``): evaluations it *will* ask for (the trials already queued in the study, in queue order)
and evaluations it *may* ask for (a likely follow-up). Idle workers evaluate them while the search waits for
the record it needs; when the search then asks, the record is there (or on its way). The study -- every
trial, in the same order, with the same record -- is exactly the study one process would make: a record is
a pure function of the evaluation (``tests/test_plan_parallel.py``), and nothing but the timing changes.

At most ``workers`` evaluations run at once, and of those at most ``workers - 1`` are guesses (``likely``), so
a worker is always free for what the search asks for next. A worker that dies (killed, out of host memory)
is replaced and the evaluation it held is asked again; when that evaluation kills a worker a second time, its
record is an ``error`` (the search records a failed trial and goes on); an exception inside an evaluation (a bug: the plan
backend turns every failing config into an ``error`` record) is raised in the search when it asks for that
record, never swallowed.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from autotune.backends.base import Backend, Evaluation
from autotune.backends.plan import PlanBackend, record_key
from autotune.core import quiet
from autotune.core.record import ResultRecord

WORKERS_ENV = "AUTOTUNE_WORKERS"  # processes evaluating plan trials; default: one per core this process may use
DIE_AT_ENV = "AUTOTUNE_TEST_PLAN_WORKER_DIES_AT"  # tests: a worker asked for this seq_len exits

_backend: PlanBackend | None = None  # each worker's own


@contextlib.contextmanager
def sigint_deferred():
    """Hold a Ctrl-C that arrives inside until the block ends, then deliver it to the handler there was. Submitting
    work may spawn a worker, and a spawn cut off half-way leaves the new interpreter reading a truncated start-up
    message: it prints that traceback on the user's terminal. Signal handlers live in the main thread; elsewhere
    this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


def default_workers() -> int:
    """``$AUTOTUNE_WORKERS``, else the cores this process may run on."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value:
        return max(1, int(value))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def end_workers(executor: ProcessPoolExecutor) -> None:
    """End ``executor``'s worker processes now: what they are computing is dropped, queued work cancelled."""
    processes = list((executor._processes or {}).values())
    executor.shutdown(wait=False, cancel_futures=True)
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(timeout=5)


def _start_worker(options: dict) -> None:
    global _backend
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the search's to handle; it ends the workers
    quiet.configure()  # as the command that started the pool says (``autotune -v``: $AUTOTUNE_VERBOSE)
    _backend = PlanBackend(**options)


def _evaluate_in_worker(evaluation: Evaluation) -> dict:
    if os.environ.get(DIE_AT_ENV) == str(evaluation.seq_len):  # test hook: this evaluation kills its worker
        os._exit(1)
    return _backend.evaluate(evaluation).to_dict()


class PooledBackend(Backend):
    """A ``PlanBackend`` (built from ``options``) in ``workers`` processes, with ``prefetch``."""

    name = "plan"

    def __init__(self, options: dict, workers: int, lookahead: Callable[[Evaluation], tuple[list, list]] | None = None):
        """``options``: a ``PlanBackend``'s (``PlanBackend.options()``). ``lookahead(evaluation)``: called each
        time a record is asked for, returns ``prefetch``'s (wanted, likely) as seen then."""
        self.options = dict(options)
        self.workers = max(1, workers)
        self.lookahead = lookahead
        self._here = PlanBackend(**options)  # answers from the store without a worker (workers start when needed)
        self._executor: ProcessPoolExecutor | None = None
        self._running: dict[str, tuple[Future, Evaluation, bool]] = {}  # key -> (future, evaluation, a guess)
        self._done: dict[str, Future] = {}
        self._deaths: dict[str, int] = {}
        self._wanted: list[Evaluation] = []  # prefetch: will be asked, in order
        self._likely: list[Evaluation] = []  # prefetch: may be asked
        self.stats = {"asked": 0, "stored": 0, "ready": 0, "running": 0, "waited_s": 0.0, "guessed": 0}

    # -- the Backend interface -------------------------------------------------------------------------
    def evaluate(self, evaluation: Evaluation) -> ResultRecord:
        key = record_key(evaluation)
        self.stats["asked"] += 1
        if self.lookahead is not None:
            self._wanted, self._likely = self.lookahead(evaluation)
        self._collect()
        future = self._done.pop(key, None)
        stored = self._here.stored(evaluation) if future is None and key not in self._running else None
        if stored is not None:
            self.stats["stored"] += 1
            self._fill()
            return stored
        if future is not None:
            self.stats["ready"] += 1
        else:
            started = time.perf_counter()
            running = self._running.get(key)
            self.stats["running"] += running is not None
            future = running[0] if running is not None else self._submit(evaluation, guess=False)
            self._fill()
            while not future.done():
                wait([f for f, _, _ in self._running.values()], return_when=FIRST_COMPLETED)
                self._collect()
                if key in self._done:
                    future = self._done.pop(key)
                elif key not in self._running:  # its worker died: ask again, once
                    self._deaths[key] = self._deaths.get(key, 0) + 1
                    if self._deaths[key] > 1:  # a failed trial: recorded, and the search goes on
                        self._fill()
                        return ResultRecord(
                            status="error",
                            source="predicted",
                            seq_len=evaluation.seq_len,
                            error=f"RuntimeError: a plan worker died twice evaluating this config at "
                            f"{evaluation.seq_len:,} tokens (out of host memory?)",
                        )
                    future = self._submit(evaluation, guess=False)
                self._fill()
            self._done.pop(key, None)
            self._running.pop(key, None)
            self.stats["waited_s"] += time.perf_counter() - started
        self._fill()
        return ResultRecord.from_dict(future.result())

    def prefetch(self, wanted: list[Evaluation], likely: list[Evaluation] = ()) -> None:
        """What the caller will ask next (``wanted``, in order) and may ask (``likely``): idle workers start on
        them. Each call replaces the previous lists; evaluations already running keep running."""
        self._wanted, self._likely = list(wanted), list(likely)
        self._collect()
        self._fill()

    def close(self) -> None:
        """End the workers (what they are evaluating is dropped)."""
        executor, self._executor = self._executor, None
        self._running.clear()
        self._done.clear()
        if executor is not None:
            end_workers(executor)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- inside ----------------------------------------------------------------------------------------
    def _pool(self) -> ProcessPoolExecutor:
        if self._executor is None:
            # spawn: a fresh interpreter per worker (the search process may hold threads and a torch state that
            # a fork would copy half-way)
            self._executor = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self.options,),
            )
        return self._executor

    def _submit(self, evaluation: Evaluation, guess: bool) -> Future:
        key = record_key(evaluation)
        with sigint_deferred():  # a worker spawned by the submit starts whole
            try:
                future = self._pool().submit(_evaluate_in_worker, evaluation)
            except BrokenProcessPool:
                self._restart()
                future = self._pool().submit(_evaluate_in_worker, evaluation)
        self._running[key] = (future, evaluation, guess)
        if guess:
            self.stats["guessed"] += 1
        return future

    def _collect(self) -> None:
        """Move finished evaluations to ``_done``; a worker's death drops what it held (asked again if needed)."""
        broken = False
        for key, (future, _evaluation, _guess) in list(self._running.items()):
            if not future.done():
                continue
            del self._running[key]
            if future.cancelled() or isinstance(future.exception(), BrokenProcessPool):
                broken = True
                continue
            self._done[key] = future
        if broken:
            self._restart()

    def _restart(self) -> None:
        """A worker died: the pool is unusable; start a new one (evaluations it held are asked again)."""
        executor, self._executor = self._executor, None
        for key, (future, _, _) in list(self._running.items()):
            if not future.done() or future.cancelled() or isinstance(future.exception(), BrokenProcessPool):
                del self._running[key]
        if executor is not None:
            executor.shutdown(wait=False, cancel_futures=True)

    def _fill(self) -> None:
        """Start prefetched evaluations on idle workers: ``wanted`` first, in order, then ``likely`` guesses
        (at most ``workers - 1`` guesses running)."""
        for evaluation, guess in [(e, False) for e in self._wanted] + [(e, True) for e in self._likely]:
            if len(self._running) >= self.workers:
                return
            key = record_key(evaluation)
            if key in self._running or key in self._done or self._here.stored(evaluation) is not None:
                continue
            if guess and sum(1 for _, _, g in self._running.values() if g) >= self.workers - 1:
                return
            self._submit(evaluation, guess)
