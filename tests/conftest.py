"""Shared test helpers: run the CLI in-process or as a subprocess, and model presets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
