"""Ctrl-C and SIGTERM (a job scheduler's stop) as a ``KeyboardInterrupt``, raised only where that is safe.

Python raises ``KeyboardInterrupt`` wherever the main thread happens to be. Inside the study's storage (SQLAlchemy,
sqlite3, Optuna's storages, Optuna recording a trial's end) that can leave a transaction open -- the next write
then finds the database locked -- or Optuna half-way through telling a trial (its ``AssertionError: Should not
reach``): a traceback and exit 1 instead of saved outputs and exit 130. So the handler looks at where the main
thread is: in such code it tries again a moment later (a timer thread signals the main thread again), anywhere
else it raises at once. Storage calls take milliseconds, so the interrupt still lands within a fraction of a
second; one held longer than ``HOLD_AT_MOST_S`` (a database that does not answer) is raised where it is."""

from __future__ import annotations

import _thread
import contextlib
import signal
import threading
import time

# code an interrupt must not cut in two (paths of the modules' files)
UNSAFE_CODE = ("/sqlalchemy/", "/sqlite3/", "/optuna/storages/", "/optuna/study/_tell.py")
RETRY_S = 0.05
HOLD_AT_MOST_S = 10.0

_held_since: float | None = None
_retry: threading.Timer | None = None
_deferral: Deferral | None = None  # set while work that must finish runs (``interrupts_deferred``)


def in_unsafe_code(frame) -> bool:
    """Whether ``frame`` or a caller of it runs code of ``UNSAFE_CODE``."""
    while frame is not None:
        if any(part in frame.f_code.co_filename for part in UNSAFE_CODE):
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame) -> None:
    global _held_since, _retry
    if _deferral is not None and _deferral.deferring:
        _deferral.arrived = True
        return
    now = time.monotonic()
    if in_unsafe_code(frame) and (_held_since is None or now - _held_since < HOLD_AT_MOST_S):
        _held_since = _held_since or now
        _retry = threading.Timer(RETRY_S, _thread.interrupt_main, args=(signal.SIGINT,))
        _retry.daemon = True
        _retry.start()
        return
    _held_since = None
    raise KeyboardInterrupt


@contextlib.contextmanager
def interrupts_at_safe_points():
    """For the block: SIGINT and SIGTERM raise ``KeyboardInterrupt`` in the main thread, never inside storage code."""
    global _held_since
    _held_since = None
    before = {signum: signal.signal(signum, _interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        if _retry is not None:  # an interrupt held as the block ended: the command finished first
            _retry.cancel()
        for signum, handler in before.items():
            signal.signal(signum, handler)


class Deferral:
    """What ``interrupts_deferred`` yields: ``arrived`` once an interrupt came while deferred; ``lifted()`` a block
    inside where interrupts raise again (the search itself)."""

    def __init__(self):
        self.deferring, self.arrived = True, False

    @contextlib.contextmanager
    def lifted(self):
        self.deferring = False
        try:
            yield
        finally:  # an interrupt before this line raises out of the block, one after it is deferred: no gap
            self.deferring = True


@contextlib.contextmanager
def interrupts_deferred():
    """For the block: an interrupt is remembered (``Deferral.arrived``), not raised, so that what must finish
    does -- the outputs of a search whose last trial ended as Ctrl-C came (Typer turns a KeyboardInterrupt it
    sees into a silent exit 130, the outputs unwritten). Only under ``interrupts_at_safe_points``."""
    global _deferral
    before, _deferral = _deferral, Deferral()
    try:
        yield _deferral
    finally:
        _deferral = before
