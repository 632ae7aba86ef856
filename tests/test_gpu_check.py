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
    gpu_check.print_real_scale(rows, results, None, worst, "cpu")
    table = capsys.readouterr().out
    assert all(row["name"] in table for row in rows)
    assert table.count("not run: the budget ran out") == 2
    assert worst["not run"] == (2, "config 2")


def test_a_config_the_budget_cannot_give_its_minimum_is_not_started(gpu_check):
    """50 s left beside the reserve and nothing run yet: a config needs at least ``minimum_s`` (60 s), so it is
    listed as not run rather than started and killed as failed."""
    clock = _Clock()
    budget = gpu_check.Budget(80.0, reserve_s=30.0, clock=clock, minimum_s=60.0)
    results = gpu_check.run_rows([{"name": "config 0"}], lambda row, left_s: pytest.fail("started"), budget)
    assert results == [None]
    assert gpu_check.run_rows([{}], lambda row, left_s: {"left": left_s}, gpu_check.Budget(100.0, 30.0, clock, 60.0))


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
    assert line.endswith("Missing here: deepspeed (Ulysses: those configs)")
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
        (["--simulate-tests-s", "60"], "--simulate-tests-s rehearses --scale 8b-reduced on --device cpu only"),
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


CUDA_TESTS_STAND_IN = """
import time
import pytest

pytestmark = pytest.mark.cuda


def test_a():
    pass


def test_b():
    pytest.skip("needs 2 GPUs")


def test_c():
    assert {fail}


def test_d():
    time.sleep({sleep})
"""


@pytest.mark.parametrize(
    "fail, sleep, deadline, status, says",
    [
        ("True", 60, 12, "not run", "2 passed, 0 failed, 1 skipped; stopped at their share of the budget (12 s)"),
        ("False", 60, 12, "failed", "1 passed, 1 failed, 1 skipped; stopped at their share"),
        ("True", 0, 60, "ok", "3 passed, 0 failed, 1 skipped"),
    ],
)
def test_the_cuda_tests_keep_the_outcomes_of_those_that_ended_when_their_deadline_stops_them(
    gpu_check, monkeypatch, tmp_path, fail, sleep, deadline, status, says
):
    """Each test's outcome is read as it ends: a deadline that stops the phase lists the rest as not run (budget),
    not the whole phase failed; a test that failed before it is a failure."""
    (tmp_path / "test_cuda_stand_in.py").write_text(CUDA_TESTS_STAND_IN.format(fail=fail, sleep=sleep))
    monkeypatch.setattr(gpu_check, "CUDA_TESTS", str(tmp_path / "test_cuda_*.py"))
    lines, got = gpu_check.run_cuda_tests(deadline)
    assert got == status and says in lines[0], lines
    assert any(line.endswith("test_cuda_stand_in.py::test_a") for line in lines[1:]), lines
    assert any("needs 2 GPUs" in line for line in lines[1:]), lines


def test_a_simulated_test_phase_takes_its_time_under_the_same_deadline(gpu_check):
    assert gpu_check.run_cuda_tests(10.0, simulate_s=0.1)[1] == "ok"
    lines, status = gpu_check.run_cuda_tests(1.0, simulate_s=30.0)
    assert status == "not run" and "not run (budget)" in lines[0]


def test_a_ratio_outside_its_band_fails_the_check_and_step_time_counts_on_a_gpu_only(gpu_check, capsys):
    worst: dict = {}
    gpu_check.note_ratio(worst, "peak_allocated_bytes", 1.02, "a", "cuda")
    gpu_check.note_ratio(worst, "step_time_s", 0.6, "b", "cpu")  # the CPU stand-in's time: not the GPU's
    assert gpu_check.print_worst(worst, tests_ok=True) == 0
    gpu_check.note_ratio(worst, "step_time_s", 0.6, "b", "cuda")
    gpu_check.note_ratio(worst, "peak_reserved_bytes", 1.2, "c", "cpu")
    assert gpu_check.print_worst(worst, tests_ok=True) == 1
    out = capsys.readouterr().out
    assert "OUT OF BAND: step time (predicted / measured) 0.600 outside [0.8, 1.25] (b)" in out
    assert "OUT OF BAND: reserved peak (predicted / measured) 1.200 outside [0.85, 1.15] (c)" in out


def test_a_kernel_the_gpu_runs_but_the_node_lacks_is_named_as_missing(gpu_check, monkeypatch):
    """A Hopper node where set-up left out FlashAttention-3 (what the main job's best config runs) does not pass."""
    import torch

    from autotune.timing.calibration import device_bench
    from trials.kernels.registry import FLASH_KERNELS, KERNELS

    assert gpu_check.missing_kernels("cpu") == []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(device_bench, "flash_kernels_here", lambda device: ["flash"])
    missing = [line.split(":")[0] for line in gpu_check.missing_kernels("cuda")]
    assert missing == [name for name in FLASH_KERNELS if name != "flash" and KERNELS[name].runs_on(9)]
    assert "flash3" in missing


def test_tiles_run_without_deepspeed_and_ulysses_needs_it(gpu_check):
    assert not gpu_check.needs_deepspeed({"mlp_tile_tokens": 8192, "loss_tile_tokens": 8192})
    assert gpu_check.needs_deepspeed({"ulysses_degree": 2})
