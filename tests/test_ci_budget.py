"""The suite's budget (tests/conftest.py): a pytest run over AUTOTUNE_TEST_BUDGET_S fails after its summary and
names its slowest tests; within it, the run's own exit status stands."""

import os
import subprocess
import sys

from conftest import BUDGET_ENV, ROOT


def _pytest(budget: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_sizes.py"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, BUDGET_ENV: budget, "PYTEST_ADDOPTS": ""},
    )


def test_a_run_over_its_budget_fails_naming_its_slowest_tests():
    over = _pytest("0")
    assert over.returncode == 1, over.stdout[-2000:]
    assert "passed" in over.stdout and "over its budget of 0 s (AUTOTUNE_TEST_BUDGET_S)" in over.stdout
    slowest = over.stdout.split("its slowest tests:", 1)[1].splitlines()[1:]
    assert slowest and all(" s  tests/test_sizes.py::test_" in line for line in slowest[:3]), over.stdout[-2000:]


def test_a_run_within_its_budget_keeps_its_exit_status():
    within = _pytest("3600")
    assert within.returncode == 0 and "over its budget" not in within.stdout, within.stdout[-2000:]


ALONE_TESTS = {
    "conftest.py": "from tests.conftest import pytest_configure, pytest_runtest_protocol  # noqa: F401\n",
    "test_times.py": """
import os, time
import pytest

def _span(name, seconds):
    start = time.time()
    time.sleep(seconds)
    with open(os.environ["SPANS"], "a") as f:
        f.write(f"{name} {start} {time.time()}\\n")

@pytest.mark.alone
def test_timed():
    _span("alone", 1.0)
""",
    "test_others.py": """
import pytest
from test_times import _span

@pytest.mark.parametrize("n", range(6))
def test_other(n):
    _span(f"other{n}", 0.4)
""",
}


def test_an_alone_test_runs_while_no_other_test_does(tmp_path):
    for name, text in ALONE_TESTS.items():
        (tmp_path / name).write_text(text)
    spans = tmp_path / "spans.txt"
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile"]
        + ["-o", "markers=alone", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": f"{ROOT}:{tmp_path}", "SPANS": str(spans), "PYTEST_ADDOPTS": ""},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    rows = {name: (float(start), float(end)) for name, start, end in map(str.split, spans.read_text().splitlines())}
    alone = rows.pop("alone")
    assert len(rows) == 6 and all(end <= alone[0] or start >= alone[1] for start, end in rows.values()), (alone, rows)
