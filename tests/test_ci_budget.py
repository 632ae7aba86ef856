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
