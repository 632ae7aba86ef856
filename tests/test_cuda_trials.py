"""CUDA acceptance (``pytest -m cuda``): what launches processes on the GPUs -- the device calibration on one and
two GPUs, a reduced-depth trial against the full one, and an OOM on one rank of two -- checked through what they
report: rates, records, statuses.

Skipped, never passed, without CUDA (and the two-GPU cases with fewer than two)."""

from __future__ import annotations

import time

import psutil
import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.torch_release,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _hardware():
    from autotune.core.hardware import load_hardware
    from autotune.timing.calibration.preset import default_base

    try:
        return load_hardware(default_base())
    except Exception as exc:  # a GPU no shipped preset describes: its peaks are unknown, so are its efficiencies
        pytest.skip(f"no preset for {torch.cuda.get_device_name(0)}: {exc}")


def _config(layers: int) -> dict:
    """A small Llama (head size 128, GQA), big enough that its memory is GiBs, not the runtime's MiBs."""
    from trials.models.config import load_model_config

    return dict(
        load_model_config("llama3-8b"),
        hidden_size=1024,
        intermediate_size=3584,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        vocab_size=32768,
        num_hidden_layers=layers,
    )


# -- the device calibration ---------------------------------------------------------------------------------


@pytest.mark.parametrize("gpus", [1, pytest.param(2, marks=two_gpus)])
def test_the_device_calibration_measures_rates_a_gpu_can_have(gpus):
    """Every efficiency within (0, 1]: a bench that times the host's launches instead of the GPU's work (a missing
    synchronize) reports rates above the card's peak; one that fails on CUDA raises here."""
    from autotune.timing.calibration.device_bench import device_rates
    from autotune.timing.calibration.preset import measure_device
    from trials.kernels.attention import flash_available

    base = _hardware()
    measured = measure_device(gpus, _config(2), "small llama", base, small=True)
    assert measured["world_size"] == gpus and measured["device"] == torch.cuda.get_device_name(0)
    assert measured["dtype"] == "bfloat16"
    assert bool(measured["attention"].get("flash")) == flash_available(torch.device("cuda", 0))
    assert ("collectives" in measured) == (gpus > 1)
    rates = device_rates(measured, base)
    # small shapes reach a fraction of the peak; collectives' wire bytes can beat one link's nominal rate a little
    ceiling = {k: 2.0 for k in rates if k.endswith("_efficiency") and k.split("_")[0] in ("all", "reduce")}
    for key, value in rates.items():
        if key.endswith("_efficiency"):
            assert 0 < value <= ceiling.get(key, 1.05), (key, value)
    assert 1e8 < rates["host_bytes_per_s"] < 2e11, rates["host_bytes_per_s"]  # PCIe / C2C, not a cache
    if gpus > 1:
        assert 1e-7 < rates["collective_latency_s"] < 1e-2


def test_full_size_benches_time_the_gpus_work_not_the_hosts_launches():
    """An 8K GEMM and 256 MiB host copies take milliseconds on the GPU and microseconds to launch: timed without
    waiting for the device they would report many times the card's peak."""
    from autotune.timing.calibration.device_bench import measure_gemms, measure_host_copies

    base, device = _hardware(), torch.device("cuda", 0)
    gemm = measure_gemms(device, torch.bfloat16, [(8192, 8192, 8192)])
    assert 0.2 < gemm["flops_per_s"] / base.rates.bf16_flops <= 1.05, gemm
    copies = measure_host_copies(device, 1 << 27)
    assert all(1e9 < copies[k] < 2e11 for k in ("h2d_bytes_per_s", "d2h_bytes_per_s")), copies


# -- a reduced-depth trial ----------------------------------------------------------------------------------


def test_a_reduced_depth_trial_extends_to_the_full_trials_memory_and_time():
    """Its 3- and 4-layer copies' segment peaks (on CUDA: the allocator's) extended to 8 layers give the full
    trial's peaks, and its layer clock's split the step time."""
    from autotune.backends import Evaluation
    from autotune.backends.local import LocalBackend
    from trials.stack.techniques import Techniques

    layers, seq = 8, 16384
    techniques = Techniques.from_dict({"activation_checkpointing": True, "attention": "sdpa"}, layers)
    evaluation = Evaluation(_config(layers), techniques, seq, 1, _hardware())
    full = LocalBackend(steps=3, timeout_s=1200).evaluate(evaluation)
    reduced = LocalBackend(steps=3, timeout_s=1200, depth="reduced").evaluate(evaluation)
    assert full.status == "ok", full.error
    assert reduced.status == "ok", reduced.error
    assert reduced.source == "measured" and reduced.measured_layers == 4
    assert reduced.peak_allocated_bytes == pytest.approx(full.peak_allocated_bytes, rel=0.03)
    assert reduced.peak_reserved_bytes == pytest.approx(full.peak_reserved_bytes, rel=0.10)
    assert reduced.host_bytes == pytest.approx(full.host_bytes, rel=0.03, abs=64 << 20)
    assert reduced.step_time_s == pytest.approx(full.step_time_s, rel=0.25)


# -- an OOM on one rank of two --------------------------------------------------------------------------------


@two_gpus
def test_an_oom_on_one_rank_of_two_is_an_oom_trial_and_leaves_no_rank():
    """Rank 1's GPU is almost full (this process holds all but 2 GiB of it), so its trial runs out of memory while
    rank 0's goes on into the step's collectives: the trial must come back ``oom`` at once -- not after the
    collective timeout -- with no rank left running."""
    from autotune.backends import Evaluation
    from autotune.backends.local import LocalBackend
    from trials.stack.techniques import Techniques

    free, _ = torch.cuda.mem_get_info(1)
    hog = torch.empty(free - (2 << 30), dtype=torch.uint8, device="cuda:1")
    layers = 4
    techniques = Techniques.from_dict({"ulysses_degree": 2, "attention": "sdpa"}, layers)
    evaluation = Evaluation(_config(layers), techniques, 65536, 2, _hardware())
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    try:
        record = LocalBackend(steps=1, timeout_s=1500).evaluate(evaluation)
    finally:
        del hog
        torch.cuda.empty_cache()
    elapsed = time.monotonic() - started
    assert record.status == "oom", record.error
    assert elapsed < 400, f"the trial took {elapsed:.0f} s: a rank waited in a collective"
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before
