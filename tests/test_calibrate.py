"""`autotune calibrate` (issue 17): the presets it writes, where they live, how every command finds them, and the
device microbenchmarks' arithmetic (run on CPU tensors here; the same code measures CUDA devices)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import yaml
from conftest import ROOT, here

from autotune.core.errors import UserError
from autotune.core.hardware import hardware_names, load_hardware, preset_path
from autotune.timing.calibration import preset as preset_mod
from autotune.timing.calibration.device_bench import device_rates, gemm_shapes


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config"


def _env(config_dir):
    import os

    return {**os.environ, "AUTOTUNE_CONFIG_DIR": str(config_dir), "PYTHONPATH": str(ROOT)}


def test_calibrate_needs_exactly_one_destination_and_never_shadows_a_shipped_preset(config_dir):
    with pytest.raises(UserError, match="exactly one"):
        preset_mod.output_path(None, None)
    with pytest.raises(UserError, match="exactly one"):
        preset_mod.output_path("mine", config_dir / "x.yaml")
    with pytest.raises(UserError, match="shipped"):
        preset_mod.output_path("h100-sxm", None)
    assert preset_mod.output_path("my-node", None) == ("my-node", config_dir / "hardware" / "my-node.yaml")


def _cpu_preset_as_calibrated(name: str) -> dict:
    """What `calibrate --hardware cpu` writes, with the shipped typical machine's measurements standing in."""
    data = yaml.safe_load(preset_path("cpu")[0].read_text())
    data.update(name=name, description="test node")
    data["calibrated"] = {
        "device": "test cpu",
        "measured_at": "2026-11-23 06:00:00",
        "base": "cpu",
        "how": preset_mod.CPU_HOW,
        "spread": {},
    }
    return data


def test_a_user_preset_is_found_by_name_listed_and_used_by_every_command(config_dir):
    path = preset_mod.write_preset(_cpu_preset_as_calibrated("my-node"), config_dir / "hardware" / "my-node.yaml")
    hw = load_hardware("my-node")
    assert hw.source == "user" and hw.calibrated["device"] == "test cpu"
    assert "measured by `autotune calibrate`" in hw.rate_provenance()
    assert "my-node" in hardware_names() and load_hardware(str(path)).source == "file"
    # the commands in-process (conftest.here): AUTOTUNE_CONFIG_DIR is this process's (the config_dir fixture)
    listed = here("hardware")
    assert listed.returncode == 0 and "my-node" in listed.stdout and "measured 2026-11-23" in listed.stdout

    def estimate(hardware):
        return here(
            "estimate", "--model", "tiny-llama", "--seq", "1K", "--gpus", "1", "--config", "baseline", "--hardware",
            hardware, "--json",
        )  # fmt: skip

    measured, assumed = estimate("my-node"), estimate("h100-sxm")
    assert measured.returncode == 0 and assumed.returncode == 0, (measured.stderr[-2000:], assumed.stderr[-2000:])
    assert json.loads(measured.stdout)["status"] == "ok"
    notes = [line for line in assumed.stderr.splitlines() if line.startswith("note: hardware h100-sxm")]
    assert len(notes) == 1 and "assumed" in notes[0] and "autotune calibrate --name" in notes[0]
    assert not any(line.startswith("note: hardware") for line in measured.stderr.splitlines())


def test_device_rates_divide_measured_rates_by_the_base_presets_peaks():
    base = load_hardware("h100-sxm")
    r = base.rates
    measured = {
        "gemm": {"flops_per_s": 0.6 * r.bf16_flops, "spread": 0.01},
        "attention": {
            "flash": [
                {"seq": 4096, "heads": 4, "fwd_flops_per_s": 1.0, "bwd_flops_per_s": 1.0},
                {
                    "seq": 65536,
                    "heads": 1,
                    "fwd_flops_per_s": 0.40 * r.bf16_flops,
                    "bwd_flops_per_s": 0.30 * r.bf16_flops,
                },
                {
                    "seq": 65536,
                    "heads": 16,
                    "fwd_flops_per_s": 0.42 * r.bf16_flops,
                    "bwd_flops_per_s": 0.32 * r.bf16_flops,
                },
            ],
            "sdpa": [],
        },
        "elementwise": {"bytes_per_s": 0.25 * r.hbm_bytes_per_s, "spread": 0.0},
        "host_copies": {"h2d_bytes_per_s": 50e9, "d2h_bytes_per_s": 40e9, "spread": 0.0},
        "host_optimizer": {"bytes_per_s": 12e9, "spread": 0.0},
        "collectives": {
            k: {"latency_s": latency, "bytes_per_s": 0.5 * r.intra_node_bytes_per_s}
            for k, latency in (
                ("all_to_all", 1e-5),
                ("all_gather", 2e-5),
                ("reduce_scatter", 3e-5),
                ("all_reduce", 4e-5),
            )
        },
    }
    values = device_rates(measured, base)
    assert values["matmul_efficiency"] == pytest.approx(0.6)
    # the longest length only (what millions of tokens run at), the median over head counts
    assert values["attention_efficiency"] == pytest.approx(0.41)
    assert values["attention_backward_efficiency"] == pytest.approx(0.31)
    assert values["elementwise_efficiency"] == pytest.approx(0.25 * r.elementwise_traffic_factor)
    assert values["host_bytes_per_s"] == 40e9 and values["host_optimizer_bytes_per_s"] == 12e9
    assert values["all_gather_efficiency"] == pytest.approx(0.5) and values["collective_latency_s"] == 2.5e-5


def test_gemm_shapes_are_the_models_projections_forward_and_backward(tiny_llama):
    shapes = gemm_shapes(tiny_llama, tokens=512)
    hidden, inter = tiny_llama["hidden_size"], tiny_llama["intermediate_size"]
    assert (512, hidden, inter) in shapes and (512, inter, hidden) in shapes and (hidden, 512, inter) in shapes
    assert len(shapes) == len(set(shapes))


@pytest.mark.slow
def test_the_device_worker_measures_every_rate_on_cpu_tensors(tmp_path, tiny_llama):
    settings = {
        "model_config": tiny_llama,
        "model_name": "tiny-llama",
        "head_dim": 16,
        "tile_q": 256,
        "tile_kv": 512,
        "host_threads": 1,
        "small": True,
    }
    (tmp_path / "settings.json").write_text(json.dumps(settings))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.timing.calibration.device_worker",
            str(tmp_path / "settings.json"),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    measured = json.loads((tmp_path / "device.json").read_text())
    assert measured["gemm"]["flops_per_s"] > 0 and measured["attention"]["sdpa"]
    assert all(p["fwd_flops_per_s"] > 0 and p["bwd_flops_per_s"] > 0 for p in measured["attention"]["sdpa"])
    values = device_rates(measured, load_hardware("h100-sxm"))
    kernels = {kernel.name: kernel for kernel in values.pop("attention_kernels")}
    assert all(v > 0 for v in values.values()), values
    assert kernels["sdpa"].forward_efficiency > 0 and not kernels["sdpa"].assumed  # timed here
    assert kernels["flash3"].assumed  # not on CPU tensors: the base's figures stay


@pytest.mark.slow
@pytest.mark.alone
def test_calibrate_writes_a_cpu_preset_that_search_and_estimate_accept(tmp_path, config_dir):
    env = _env(config_dir)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "autotune.cli",
            "calibrate",
            "--hardware",
            "cpu",
            "--name",
            "this-vm",
            "--repeats",
            "1",
            "--gpus",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=850,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "use it: --hardware this-vm" in result.stdout and "calibrating" in result.stderr
    hw = load_hardware("this-vm")
    assert hw.calibrated["base"] == "cpu" and hw.calibration["machine"]["cpus"] >= 1
    assert list(hw.calibration["worlds"]) == ["1"]  # --gpus 1: trials of one rank only
    assert hw.device_memory_bytes == load_hardware("cpu").device_memory_bytes  # the base's memory facts
    assert hw.rates_for(1).bf16_flops == hw.calibration["worlds"]["1"]["in_step"]["matmul_flops"]


def _repeat(predicted_s: float, wall_s: float, matmul: float, wait_s: float, contended=()) -> dict:
    return {
        "threads": 1,
        "world_size": 2,
        "matmul_flops": matmul,
        "collective_wait_s": wait_s,
        "contended": list(contended),
        "in_step": {"predicted_s": predicted_s, "wall_s": wall_s},
    }


def test_calibrate_keeps_one_whole_repeat_per_world_the_one_its_own_step_explains_best(monkeypatch):
    """Never the fastest rate of one repeat beside the lowest imbalance of another: that pairing predicts steps of
    several ranks too short. Contended repeats lose first; then the self-check nearest 1 wins, either side."""
    import autotune.timing.calibration as calibration

    repeats = {
        1: [_repeat(0.80, 1.0, 9e10, 0.0), _repeat(1.05, 1.0, 6e10, 0.0), _repeat(0.97, 1.0, 7e10, 0.0)],
        2: [
            _repeat(0.266, 0.28, 6e10, 0.07),
            _repeat(0.2574, 0.26, 7e10, 0.17, contended=["gloo"]),
            _repeat(0.2132, 0.26, 8e10, 0.28),
        ],
    }
    served = {1: iter(repeats[1]), 2: iter(repeats[2])}
    monkeypatch.setattr(calibration, "world_sizes", lambda: [1, 2])
    monkeypatch.setattr(calibration, "wait_for_idle", lambda timeout_s: 0.0)
    monkeypatch.setattr(calibration, "_run_workers", lambda world, threads: next(served[world]))
    result = calibration.calibrate(repeats=3)
    assert result["worlds"]["1"] is repeats[1][2]  # 0.97 is nearer 1 than 1.05 or 0.80
    assert result["worlds"]["2"] is repeats[2][0]  # 0.99 was contended; 0.95 beats 0.82
    assert result["repeats"]["2"] == {"kept": 1, "self_checks": [0.95, 0.99, 0.82]}
    assert result["repeats"]["1"]["self_checks"] == [0.8, 1.05, 0.97]
    assert result["spread"]["2"]["matmul_flops"] == pytest.approx((8e10 - 6e10) / 8e10, abs=1e-4)


def test_the_in_step_attention_factor_makes_the_preset_price_that_steps_attention_as_measured():
    """The calibration times the attention kernels inside a 2,048-token step and scales the microbenchmark's rate
    so the model prices them as measured. The written preset must then price that step's attention at exactly the
    measured seconds: the factor has to be taken with the attention tiles the preset prices with (a factor taken
    with Rates' GPU-default tiles left every CPU prediction's attention 1.18x the measured)."""
    import torch

    from autotune.core.hardware import Rates
    from autotune.timing.calibration import microbench, worker
    from autotune.timing.counts import StepCounts
    from autotune.timing.model import attention_time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rate = 5e10  # microbenchmark rates (FLOP/s, bytes/s): any plausible ones; the step itself is timed for real
    microbenchmarks = {
        "threads": 1,
        "world_size": 1,
        "matmul_flops": rate,
        "elementwise_bytes_per_s": rate / 5,
        "memcpy_bytes_per_s": rate / 5,
        "attention_flops": {str(d): [rate / 2, rate / 3] for d in microbench.HEAD_DIMS},
    }
    try:
        in_step = microbench.measure_in_step(worker.in_step_rates(microbenchmarks, 1))
    finally:
        torch.set_num_threads(threads)  # the rest of the session's tests run with what they had
    preset_rates = worker._model_rates(
        dict(microbenchmarks, in_step=in_step, op_overhead_s=0.0, view_overhead_s=0.0, optimizer_bytes_per_s=1.0), 1
    )
    measured_s = in_step["kernel_seconds"]["forward/attention"] + in_step["kernel_seconds"]["backward/attention"]
    predicted_s = attention_time(
        StepCounts.from_dict(in_step["counts"]), ("forward", "backward"), Rates(name="cpu", **preset_rates)
    )
    assert measured_s > 0
    assert predicted_s == pytest.approx(measured_s, rel=1e-6)


def _with_reference_step(data: dict, wall_s: float) -> dict:
    data["calibration"]["worlds"]["1"]["in_step"]["wall_s"] = wall_s
    return data


def test_check_re_times_the_calibrations_step_and_says_how_far_this_machine_moved(config_dir):
    from autotune.timing.calibration.check import check_preset

    # a recorded step far faster than any real one: the check must find this machine slower, by its own ratio
    slow_path = preset_mod.write_preset(
        _with_reference_step(_cpu_preset_as_calibrated("fast-moment"), 1e-4),
        config_dir / "hardware" / "fast-moment.yaml",
    )
    check = check_preset(load_hardware(str(slow_path)), samples=3)
    assert check.calibrated_s == 1e-4 and check.now_s > 1e-3 and check.slowdown == check.now_s / 1e-4
    assert not check.holds
    verdict = replace(check, contended=False).lines("fast-moment")[1]  # (a busy CI machine may contend it)
    assert f"{check.slowdown:.2f}x too short" in verdict and "autotune calibrate --name" in verdict
    # the verdict's arithmetic on recorded seconds either side of the band
    for now_s, holds, words in ((1.05, True, "holds here"), (0.5, False, "2.00x too long"), (1.2, False, "too short")):
        other = replace(check, now_s=now_s, calibrated_s=1.0, contended=False)
        assert other.holds == holds and words in other.lines("p")[1]
    # seconds taken while other processes were busy are no verdict at all
    assert "says nothing about the machine's speed" in replace(check, contended=True).lines("p")[1]


@pytest.mark.alone
def test_check_of_a_gpu_preset_re_times_its_recorded_gemm_shapes(tiny_llama):
    import torch

    from autotune.timing.calibration.check import check_device
    from autotune.timing.calibration.device_bench import gemm_shapes, measure_gemms

    shapes = gemm_shapes(tiny_llama, tokens=256)
    recorded = measure_gemms(torch.device("cpu"), torch.float32, shapes)
    measurements = {
        "device": "cpu",
        "dtype": "float32",
        "gemm": dict(recorded, flops_per_s=recorded["flops_per_s"] * 4),
    }
    check = check_device(measurements, "2026-11-23 06:00:00", samples=3, device=torch.device("cpu"))
    flops = sum(2.0 * m * k * n for m, k, n in shapes)
    assert check.calibrated_s == pytest.approx(flops / (4 * recorded["flops_per_s"]))
    # recorded 4x faster than this CPU runs them: the check says so (within the CPU's own noise)
    assert 2 < check.slowdown < 8 and f"{len(shapes)} GEMM shapes" in check.workload


def test_check_from_the_command_line(config_dir, monkeypatch, capsys):
    from autotune import cli
    from autotune.core import calibration_store
    from autotune.timing.calibration import check as check_mod

    preset = _with_reference_step(_cpu_preset_as_calibrated("my-node"), 0.2)
    preset["calibration"]["machine"] = calibration_store.machine_key()  # calibrated on this machine
    preset_mod.write_preset(preset, config_dir / "hardware" / "my-node.yaml")
    calibrated_on = preset["calibration"]["measured_at"]

    # the re-timed step's samples are fixed here (the real timing has its own test above), so every outcome's
    # lines and exit code are checked whatever else runs on this host
    def check_with(times, contended):
        monkeypatch.setattr(check_mod, "_time_reference_step", lambda threads, samples: (times, contended))
        code = cli.main(["calibrate", "--check", "--hardware", "my-node"])
        out, err = capsys.readouterr()
        return code, out.strip().splitlines(), err.strip().splitlines()

    # samples 0.5, 0.6, 0.7 s: median 0.6 s, spread (0.7 - 0.5) / 0.6 = 33%; 0.6 / 0.2 = 3.00x slower
    code, out, err = check_with([0.7, 0.5, 0.6], False)
    assert code == 0, err
    assert out == [
        f"the calibration's training step (2,048 tokens, 1 rank): 0.6 s now (spread 33%), 0.2 s at the "
        f"calibration ({calibrated_on}): 3.00x slower",
        "my-node predicts step times 3.00x too short on this machine now; measure it again: autotune "
        "calibrate --name NAME (a few minutes)",
    ]
    # 0.1 s: 0.2 / 0.1 = 2.00x faster -> step times too long
    code, out, err = check_with([0.1, 0.1, 0.1], False)
    assert code == 0 and out[0].endswith("2.00x faster"), out
    assert out[1].startswith("my-node predicts step times 2.00x too long"), out
    # 0.21 s: 1.05x slower, inside the 1.10x band
    code, out, err = check_with([0.21, 0.21, 0.21], False)
    assert code == 0 and "1.05x slower" in out[0], out
    assert out[1] == "my-node holds here: this machine is within 1.10x of the calibration's speed"
    # every sample contended: the measurement, no verdict, exit 1 with the reason as stderr's last line
    code, out, err = check_with([0.7, 0.5, 0.6], True)
    assert code == 1 and len(out) == 1 and "3.00x slower" in out[0], (out, err)
    assert err[-1] == (
        "autotune: other processes kept the CPUs busy during every sample: this says nothing about "
        "the machine's speed; check again when it is quiet"
    )

    def run(*args):
        return here("calibrate", "--check", *args)  # bad input's one line: in-process, as conftest.here runs it

    # nothing measured to compare with, a destination given, a GPU preset without a GPU: one line each, exit 2
    assumed, destination = run("--hardware", "h100-sxm"), run("--hardware", "my-node", "--name", "x")
    for result, words in ((assumed, "assumed, not measured"), (destination, "writes nothing")):
        assert result.returncode == 2 and words in result.stderr and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    gpu = yaml.safe_load(preset_path("h100-sxm")[0].read_text())
    gpu.update(
        name="my-h100",
        calibrated={
            "device": "NVIDIA H100 x8",
            "measured_at": "2026-11-23 06:00:00",
            "base": "h100-sxm",
            "measurements": {
                "dtype": "bfloat16",
                "gemm": {"flops_per_s": 6e14, "points": [{"m": 8192, "k": 4096, "n": 4096}]},
            },
        },
    )
    preset_mod.write_preset(gpu, config_dir / "hardware" / "my-h100.yaml")
    no_gpu = run("--hardware", "my-h100")
    assert no_gpu.returncode == 2 and "no CUDA device" in no_gpu.stderr and "Traceback" not in no_gpu.stderr
