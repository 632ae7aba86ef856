"""One calibration worker: ``python -m autotune.timing.calibration.worker RANK WORLD THREADS OUT_DIR``.

``WORLD`` workers run at once (a gloo group when WORLD > 1) with the thread count a trial rank gets; each writes
``OUT_DIR/rank{RANK}.json`` (rank 0's is kept)."""

from __future__ import annotations

import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from autotune.core.hardware import HOST_PRESET, Rates, load_hardware
from autotune.timing.calibration import microbench as bench
from autotune.timing.calibration import sampling
from autotune.timing.counts import StepCounts
from autotune.timing.model import predict_step_time
from trials.stack.techniques import Techniques


def _model_rates(result: dict, world: int) -> dict:
    """The ``Rates`` fields (less its name) the time model will use from this worker's measurements so far, as the
    written preset derives them (``rates_from_calibration`` through ``Hardware.rates_for``)."""
    rates = replace(load_hardware(HOST_PRESET), calibration={"worlds": {str(world): result}}).rates_for(world)
    return {f: getattr(rates, f) for f in Rates.__dataclass_fields__ if f != "name"}


def in_step_rates(microbenchmarks: dict, world: int) -> dict:
    """The rates ``measure_in_step`` prices its step's kernels with: the microbenchmarks' alone, as the preset
    derives them. Derived through the preset, not assembled here, so that every field the model prices with
    (the CPU kernel's 256 x 512 attention tiles, not ``Rates``' GPU default) is the one the written preset
    gives: any difference would skew the in-step factors, and with them every CPU prediction."""
    return _model_rates(dict(microbenchmarks, op_overhead_s=0.0, view_overhead_s=0.0, optimizer_bytes_per_s=1.0), world)


def _worker(rank: int, world: int, threads: int, out_dir: str) -> None:

    torch.set_num_threads(threads)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {"threads": threads, "world_size": world}
    sampling.WORKER_PIDS[:] = [os.getpid()]
    if world > 1:
        pids = [None] * world
        dist.all_gather_object(pids, os.getpid())
        sampling.WORKER_PIDS[:] = pids

    probes = []  # the speed probe beside each group of measurements (see speed_probe_s)
    sampling.barrier()
    probes.append(sampling.speed_probe_s())
    result["matmul_flops"] = bench.measure_matmul()
    sampling.barrier()
    result["attention_flops"] = {str(d): bench.measure_attention(d) for d in bench.HEAD_DIMS}
    sampling.barrier()
    result["elementwise_bytes_per_s"] = bench.measure_elementwise()
    result["memcpy_bytes_per_s"] = bench.measure_memcpy()
    sampling.barrier()
    sampling.barrier()
    probes.append(sampling.speed_probe_s())
    result["in_step"] = bench.measure_in_step(in_step_rates(result, world))
    sampling.barrier()
    probes.append(sampling.speed_probe_s())
    if world > 1:
        result["gloo"] = bench.measure_gloo()
        sampling.barrier()
    # everything but the per-op overhead, as the time model will use it, then the overhead on top
    result.update(
        op_overhead_s=0.0, view_overhead_s=0.0, optimizer_bytes_per_s=result["in_step"]["optimizer_bytes_per_s"]
    )

    partial = _model_rates(result, world)
    op, view = bench.measure_dispatch_overhead(partial)
    result["op_overhead_s"], result["view_overhead_s"] = op, view
    sampling.barrier()
    probes.append(sampling.speed_probe_s())
    # the rates the time model uses come from the in-step run and the dispatch overhead: the probes around those
    result["probe_s"] = statistics.median(probes[1:])
    result["probes_s"] = probes
    # what the model still misses on the in-step run: on several ranks, waiting for the slower one at every
    # collective call (its residual over the step's collective calls; see autotune.timing.model)
    in_step = result["in_step"]
    counts = StepCounts.from_dict(in_step.pop("counts"))
    timing = predict_step_time(
        counts,
        Rates(name="cpu", **dict(partial, op_overhead_s=op, view_overhead_s=view)),
        world,
        Techniques(ulysses_degree=in_step["ulysses_degree"]),
    )
    in_step["predicted_s"] = timing.step_time_s
    in_step["collective_calls"] = counts.collective_calls()
    residual_s = max(0.0, in_step["wall_s"] - timing.step_time_s)
    result["collective_wait_s"] = residual_s / max(in_step["collective_calls"], 1) if world > 1 else 0.0
    result["optimizer_microbench_bytes_per_s"] = bench.measure_optimizer(op, view)
    result["contended"] = sorted(set(sampling.CONTENDED_BENCHMARKS))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
