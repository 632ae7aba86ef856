"""``bench/gpu_check.py --scale 8b-reduced``: the budget, the packages line, its options, and one reduced-depth row
against the oracle on CPU (the memory byte-exact there)."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import ROOT


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "bench" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_budget_stops_adding_configs_and_the_table_still_lists_every_one(gpu_check, capsys):
    """Each config takes 40 s of a 130 s budget that keeps 30 s for the checks after them: after two, 20 s are left
    beside the reserve, less than the longest one took, so the third and fourth do not start; each started one gets
    the time left less the reserve as its deadline; the table lists all four."""
    clock = _Clock()
    budget = gpu_check.Budget(130.0, reserve_s=30.0, clock=clock)
    deadlines = []

    def run_row(row, left_s):
        deadlines.append(left_s)
        clock.now += 40.0
        return {"status": "skipped", "error": "stand-in"}

    rows = [{"name": f"config {i}", "seq": 1024} for i in range(4)]
    results = gpu_check.run_rows(rows, run_row, budget)
    assert [r is not None for r in results] == [True, True, False, False]
    assert deadlines == [100.0, 60.0]
    worst: dict = {}
    gpu_check.print_real_scale(rows, results, None, worst)
    table = capsys.readouterr().out
    assert all(row["name"] in table for row in rows)
    assert table.count("not run: the budget ran out") == 2
    assert worst["not run"] == (2, "config 2")


def test_no_budget_runs_every_config(gpu_check):
    clock = _Clock()

    def run_row(row, left_s):
        clock.now += 1e6
        return {"status": "ok"}

    assert all(gpu_check.run_rows([{}] * 3, run_row, gpu_check.Budget(None, clock=clock)))


def test_one_line_names_the_packages_and_what_each_missing_one_costs(gpu_check):
    line, missing, fatal = gpu_check.missing_packages(importable=lambda module: module != "deepspeed")
    assert "\n" not in line and not fatal and missing == {"deepspeed"}
    for _, package, _, _ in gpu_check.PACKAGES:
        assert package in line
    assert line.endswith("Missing here: deepspeed (MLP tiles (TiledMLP) and Ulysses: those configs)")
    assert gpu_check.missing_packages(importable=lambda module: True) == (None, set(), False)


def test_a_required_package_missing_is_one_line_on_stderr_and_exit_2_before_anything(gpu_check, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "_importable", lambda module: module != "transformers")
    monkeypatch.setattr(gpu_check, "real_scale", lambda *a: pytest.fail("ran past a missing required package"))
    assert gpu_check.main(["--device", "cpu", "--scale", "8b-reduced"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "transformers (required: every model)" in err


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--scale", "8b-reduced", "--seq", "4096"], "drop --seq"),
        (["--scale", "8b-reduced", "--budget", "0"], "--budget must be positive"),
        (["--budget", "60"], "--budget applies to --scale 8b-reduced"),
    ],
)
def test_options_the_scale_cannot_take_are_one_line_and_exit_2(gpu_check, monkeypatch, capsys, argv, says):
    monkeypatch.setattr(gpu_check, "real_scale", lambda *a: pytest.fail("ran with a bad option"))
    monkeypatch.setattr(gpu_check, "run_cuda_tests", lambda *a: pytest.fail("ran with a bad option"))
    assert gpu_check.main(["--device", "cpu", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and says in err


@pytest.mark.slow
def test_a_reduced_row_on_cpu_meets_the_oracle_of_the_whole_model_exactly(gpu_check):
    """A 32-layer tiny model measured as its 3- and 4-layer copies, extended to 32 layers, against the plan
    backend's prediction of the 32 layers: the tracker and the oracle agree to the byte."""
    from autotune.core.hardware import load_hardware
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    config = dict(load_model_config("tiny-llama"), num_hidden_layers=32)
    knobs = {"activation_checkpointing": True, "activation_offload_layers": 16, "loss_tile_tokens": 128}
    row = {"name": "offload 16 of 32", "world": 1, "model_config": config, "seq": 256}
    row["techniques"] = Techniques.from_dict(knobs, 32).to_dict()
    hardware = load_hardware("cpu")
    real = gpu_check.reduced_trial(row, hardware, steps=1, deadline_s=300)
    assert real["status"] == "ok", real["error"]
    assert real["measured_layers"] < 32 and not real["extended_over"]  # copies of each run, offloaded or not
    predicted = gpu_check.predict_row(row, config, row["seq"], hardware, "fp32")
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "host_bytes"):
        assert predicted[key] == real[key], key
    assert predicted["step_time_s"] > 0 and real["step_time_s"] > 0
