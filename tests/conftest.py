"""Shared test helpers: run the CLI in-process or as a subprocess, and model presets."""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# The suite's budget: with AUTOTUNE_TEST_BUDGET_S set (.ci/run sets it for each pytest run), a run whose wall time
# exceeds it fails after its summary, naming its slowest tests (docs/layout.md, "Keeping the suite cheap").
BUDGET_ENV = "AUTOTUNE_TEST_BUDGET_S"
_test_seconds: dict[str, float] = {}
_started = time.monotonic()


def pytest_collection_modifyitems(config, items) -> None:
    """The files with the most ``slow`` tests first, each file's tests in their own order: under pytest-xdist
    (``bin/test``: each file whole on one worker, in this order) the long files start first, so none is left
    running alone at the end while the other workers idle."""
    slow: dict[Path, int] = {}
    for item in items:
        slow[item.path] = slow.get(item.path, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: -slow[item.path])  # stable: a file's tests stay together, in order


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker's torch (and the trials it launches) uses its share of the cores: workers
    whose OpenMP threads outnumber the cores slow each other down several times over. So do its plan searches
    (``AUTOTUNE_WORKERS``: a pool of plan workers, each a fresh interpreter importing torch, that evaluate ahead
    of the search): with a core each, they evaluate in the search's own process, the records the pool would give
    (tests/test_plan_parallel.py); tests of the pool itself ask for their workers. The suite's searches leave
    their fronts unpolished (``AUTOTUNE_POLISH``: polishing evaluates each front config's one-knob neighbours,
    several times a small search's own trials) except where a test sets it: tests/test_polish.py."""
    os.environ.setdefault("AUTOTUNE_POLISH", "0")
    workers = int(getattr(config, "workerinput", {}).get("workercount", 1))
    if workers > 1:
        share = str(max(1, (os.cpu_count() or 1) // workers))
        os.environ.setdefault("OMP_NUM_THREADS", share)
        os.environ.setdefault("AUTOTUNE_WORKERS", share)


@contextlib.contextmanager
def _turn(config, alone: bool):
    """A test's turn on the machine: an ``alone`` test (one that times the machine) waits for the other workers'
    running tests to end and keeps them from starting others until it ends; other tests share the machine. A
    readers-writer lock on two files every worker of the run opens: ``intent`` (taken exclusively by an alone test,
    so no new test starts while it waits) and ``running`` (shared by each running test, exclusive while alone)."""
    worker = getattr(config, "workerinput", None)  # a worker's own, not inherited by a pytest it launches
    if not worker or int(worker["workercount"]) < 2:
        yield
        return
    folder = Path(tempfile.gettempdir()) / f"autotune-tests-{worker['testrunuid']}"
    folder.mkdir(exist_ok=True)
    with open(folder / "intent", "a") as intent, open(folder / "running", "a") as running:
        fcntl.flock(intent, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(intent, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)
            fcntl.flock(intent, fcntl.LOCK_UN)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with _turn(item.config, item.get_closest_marker("alone") is not None):
        return (yield)


def pytest_runtest_logreport(report) -> None:
    """Each test's setup, call and teardown, summed (under pytest-xdist the controller sees every worker's)."""
    _test_seconds[report.nodeid] = _test_seconds.get(report.nodeid, 0.0) + report.duration


_overrun: list[tuple[float, float]] = []  # (wall seconds, budget) when the run exceeded its budget


def pytest_sessionfinish(session, exitstatus) -> None:
    budget = os.environ.get(BUDGET_ENV)
    elapsed = time.monotonic() - _started
    if hasattr(session.config, "workerinput") or not budget or elapsed <= float(budget):
        return
    _overrun.append((elapsed, float(budget)))
    if session.exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _overrun:
        return
    elapsed, budget = _overrun[0]
    slowest = sorted(_test_seconds.items(), key=lambda item: -item[1])[:10]
    terminalreporter.write_line(
        f"the suite took {elapsed:.0f} s, over its budget of {budget:.0f} s ({BUDGET_ENV}); its slowest tests:",
        red=True,
    )
    for nodeid, seconds in slowest:
        terminalreporter.write_line(f"  {seconds:7.1f} s  {nodeid}")


def tiny_plan_search(target: str = "4K") -> list[str]:
    """``autotune search``'s options for a small plan search: tiny-llama on 2 CPU ranks of 0.5 GiB."""
    return f"--model tiny-llama --target {target} --gpus 2 --backend plan --hardware cpu --memory-gib 0.5".split()


def run_judge(*args: str) -> list[dict]:
    """A trainer's judge of exports (tests/trainer_judges.py: the trainer's own loader) in a fresh process; its
    JSON lines."""
    import json

    result = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "trainer_judges.py"), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def here(*args: str) -> subprocess.CompletedProcess:
    """``autotune ARGS`` in this process (``autotune.cli.main``, the console script's entry point, whose code is the
    exit status): its exit code, stdout and stderr. A fresh interpreter (``run_cli``) imports torch again, seconds
    per command; a test whose claim is the process itself (signals, exit codes, what a rank leaves) runs one."""
    import contextlib
    import io

    from autotune.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["autotune", *args], code, out.getvalue(), err.getvalue())


def run_cli(*args: str, timeout: float = 600, env: dict | None = None) -> subprocess.CompletedProcess:
    """``autotune ARGS`` as a user runs it (a fresh process), capturing stdout and stderr."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "autotune.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=full_env,
    )


@pytest.fixture
def tiny_llama():
    from trials.models.config import load_model_config

    return load_model_config("tiny-llama")
