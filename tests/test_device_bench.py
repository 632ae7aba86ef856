"""The device microbenchmarks of `autotune calibrate` on a GPU preset (``device_bench``): that every rank issues the
same collectives, and that the attention table times the kernels the trials call. Run on CPU tensors (gloo) and on
meta tensors, which take the trials' non-CPU attention path."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.timing.calibration import _free_port
from autotune.timing.calibration.device_bench import measure_attention
from trials.kernels.attention import attention_backward, attention_forward, causal_attention

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

# One rank of ``measure_collectives`` over a gloo group. Rank 1's clock runs 4x fast, so its first call of each
# collective seems 4x longer than rank 0's and its own repetition count comes out lower: ranks that each picked
# their own count would issue different numbers of collectives and wait on each other until the group's timeout.
# The sizes include one (3) that does not divide among 2 ranks.
_RANK = """
import datetime, json, os, time
import torch
import torch.distributed as dist
from autotune.timing.calibration.device_bench import measure_collectives

if os.environ["RANK"] == "1":
    real_clock = time.perf_counter
    time.perf_counter = lambda: 4 * real_clock()
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
result = measure_collectives(torch.device("cpu"), torch.float32, sizes=(3, 1 << 8, 1 << 10))
dist.barrier()
dist.destroy_process_group()
print(json.dumps(result))
"""


def test_collectives_are_timed_with_the_same_repetitions_on_every_rank():
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK],
            env={**env, "RANK": str(rank)},
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=120))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-2000:]
    measured = json.loads(outputs[0][0])
    assert set(measured) == {"all_to_all", "all_gather", "reduce_scatter", "all_reduce"}
    for kind in measured.values():
        assert kind["latency_s"] > 0 and kind["bytes_per_s"] > 0
    # 3 fp32 elements rounded up to 4, half of them sent to the other rank
    assert measured["all_to_all"]["points"][0][0] == 4 * 4 * 0.5


class _Ops(TorchDispatchMode):
    """The aten ops run inside."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_the_attention_table_times_every_kernel_the_trials_call_for_sdpa():
    """Meta tensors take the trials' non-CPU path: head-chunked attention calls an explicit SDPA kernel there (on
    CUDA the memory-efficient one) that ``F.scaled_dot_product_attention`` need not pick, so the table must time
    that call as well as the whole-layer one."""
    meta = torch.device("meta")
    q, k, v = (torch.randn(1, 2, 256, 16, device=meta, requires_grad=True) for _ in range(3))
    with _Ops() as trials:
        out = causal_attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        with torch.no_grad():
            out, residuals = attention_forward(q, k, v, 0.25)
            attention_backward(torch.randn_like(out), q, k, v, out, residuals, 0.25)
    with _Ops() as bench:
        table = measure_attention(meta, torch.float32, 16, 256, 512, lengths=(256,), heads=(2,))
    kernels = {name for name in trials.names if "scaled_dot_product" in name}
    assert "aten._scaled_dot_product_efficient_attention_backward" in kernels
    assert kernels <= bench.names, kernels - bench.names
    assert table["sdpa_chunked"][0]["kernel"] == "aten._scaled_dot_product_efficient_attention"
    assert table["sdpa"][0]["kernel"] == "MATH"  # the backend SDPA picked on meta tensors, recorded per point


def test_the_attention_table_on_cpu_times_the_cpu_flash_kernel_both_ways():
    cpu = torch.device("cpu")
    table = measure_attention(cpu, torch.float32, 16, 256, 512, lengths=(128,), heads=(1,))
    assert [p["kernel"] for p in table["sdpa"]] == ["FLASH_ATTENTION"]
    assert [p["kernel"] for p in table["sdpa_chunked"]] == ["aten._scaled_dot_product_flash_attention_for_cpu"]
    assert all(p["fwd_flops_per_s"] > 0 and p["bwd_flops_per_s"] > 0 for points in table.values() for p in points)


def test_head_chunked_sdpa_is_priced_at_the_rate_of_the_kernel_it_calls():
    """On CUDA, SDPA under head chunking calls another kernel than a whole layer's SDPA: calibration keeps its
    rate apart, and the time model prices exactly the configs that run it (``attention="sdpa"`` with chunks)."""
    from dataclasses import replace

    from autotune.core.hardware import load_hardware
    from autotune.timing.calibration.device_bench import device_rates

    base = load_hardware("h100-sxm")
    peak = base.rates.bf16_flops

    def point(kernel, efficiency):
        return {
            "seq": 8192,
            "kernel": kernel,
            "fwd_flops_per_s": efficiency * peak,
            "bwd_flops_per_s": efficiency * peak,
        }

    measured = {
        "gemm": {"flops_per_s": 0.7 * peak},
        "attention": {"sdpa": [point("cudnn", 0.5)], "sdpa_chunked": [point("efficient", 0.25)]},
        "elementwise": {"bytes_per_s": base.rates.hbm_bytes_per_s},
        "host_copies": {"h2d_bytes_per_s": 5e10, "d2h_bytes_per_s": 5e10},
        "host_optimizer": {"bytes_per_s": 1e10},
    }
    values = device_rates(measured, base)
    assert values["attention_efficiency"] == 0.5 and values["chunked_sdpa_efficiency"] == 0.25
    rates = replace(base.rates, **values)
    assert rates.for_kernel("sdpa", 1).attention_efficiency == 0.25
    assert rates.for_kernel("sdpa", None).attention_efficiency == 0.5  # a whole layer's SDPA
    # flash-attn chunks run flash-attn: at its own rate (not measured here: the base preset's, still assumed)
    assert rates.for_kernel("flash", 1).attention_efficiency == base.rates.kernel("flash").forward_efficiency
    assert rates.kernel("sdpa").forward_efficiency == 0.5 and not rates.kernel("sdpa").assumed
    assert rates.kernel("flash").assumed
    # one kernel for both (the CPU's): no separate rate
    measured["attention"]["sdpa_chunked"] = [point("cudnn", 0.25)]
    assert "chunked_sdpa_efficiency" not in device_rates(measured, base)


def test_the_time_model_uses_the_chunked_sdpa_rate_for_head_chunked_sdpa_only():
    from dataclasses import replace

    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend
    from autotune.core.hardware import load_hardware
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    base = load_hardware("h100-sxm")
    slow = replace(base, rates=replace(base.rates, chunked_sdpa_efficiency=0.01, chunked_sdpa_backward_efficiency=0.01))
    config = load_model_config("tiny-llama")

    def step_s(hardware, **techniques):
        evaluation = Evaluation(config, Techniques(**techniques), 65536, 1, hardware)
        return PlanBackend().evaluate(evaluation).step_time_s

    chunked = {"attention": "sdpa", "head_chunk": 1}
    assert step_s(slow, **chunked) > 1.5 * step_s(base, **chunked)
    assert step_s(slow, attention="sdpa") == step_s(base, attention="sdpa")
