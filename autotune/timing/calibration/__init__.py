"""Calibrate the ``cpu`` hardware preset on this machine: measured rates for the time model.

CPU trials (``trials.trial.runner`` on gloo, fp32) run ``world_size`` processes that share this machine's cores,
each with ``cpus // world_size`` threads (what the local backend sets). So the calibration is per world size:
for each world size ``w`` (1 and, when there are at least two cores, 2 and 4), ``w`` worker processes run the same
microbenchmarks at the same time, with the same thread count a trial rank gets, and rank 0's numbers are kept:

- ``bf16_flops``: fp32 matmul FLOP/s over a handful of transformer-like GEMM shapes (total FLOPs / total time);
- ``attention_by_head_dim``: the CPU flash-attention kernel's computed-FLOP rate, forward and backward, at head
  dims 16/64/128, as a fraction of the matmul rate (computed = the tiles the kernel really runs: query tiles of
  256 and key tiles of 512, ``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``);
- ``hbm_bytes_per_s``: output bytes per second of a mix of elementwise ops (``elementwise_traffic_factor`` 1);
- ``host_bytes_per_s``: memcpy bandwidth (``clone`` of 64 MiB) -- the CPU path's "host" copies are memcpys;
- ``host_optimizer_bytes_per_s``: ``torch.optim.AdamW(foreach=False)`` output bytes per second (as counted by
  ``StepCounter``) with the per-op overhead taken out;
- ``op_overhead_s`` / ``view_overhead_s``: host seconds per dispatched op of an eager training step outside its
  kernels (Python module code, autograd, the optimizer's loop, and the trials' memory tracker -- a Python
  dispatch mode every CPU trial runs under): one step of a small Llama that is none of the presets, at 16
  tokens, less its timed kernels (their fixed per-call cost is already in the in-step rates);
- ``intra_node_bytes_per_s`` (all-to-all), ``all_gather_efficiency`` / ``reduce_scatter_efficiency`` /
  ``all_reduce_efficiency`` (relative to it), ``collective_latency_s`` (w > 1): gloo collectives over loopback
  at several sizes, as ``latency + wire_bytes / bandwidth``.

Nothing calibrates implicitly: ``calibrate()`` / ``load_or_calibrate()`` measure only when called (benches, and
``python -m autotune.timing.calibration [--force]``). The result is cached (``autotune.core.calibration_store``)
keyed by machine, and the ``cpu`` preset uses a cached calibration of this machine when there is one.

    sampling.py     contention-aware timing on a shared machine, the drift probe
    microbench.py   the measurements
    worker.py       one worker process of a world (``python -m autotune.timing.calibration.worker``)
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from autotune.core import calibration_store
from autotune.timing.calibration.sampling import wait_for_idle
from trials.core import allocator


def world_sizes() -> list[int]:
    """The world sizes calibrated: 1, and with 2+ cores 2 and 4 (trials of 4 ranks share the cores too)."""
    cpus = os.cpu_count() or 1
    return [1, 2, 4] if cpus >= 2 else [1]


def load_or_calibrate(force: bool = False, quiet: bool = True, repeats: int = 1) -> dict:
    """This machine's cached calibration, measuring (and caching) it first when there is none or ``force``
    (~1.5 min per repeat; see ``calibrate``)."""
    cached = None if force else calibration_store.load_cached()
    if cached is not None:
        return cached
    data = calibrate(quiet=quiet, repeats=repeats)
    calibration_store.save(data)
    return data


def calibrate(quiet: bool = True, repeats: int = 1, max_world: int | None = None) -> dict:
    """Measure every world size ``repeats`` times and keep one whole repeat per world (``_pick_repeat``), with
    every repeat's self-check under ``repeats`` and the spread of each rate under ``spread``. Each timing already
    discards samples taken while other processes were busy (see ``_sample``); benchmarks that never got a quiet
    sample are listed under ``contended``."""
    result = {
        "machine": calibration_store.machine_key(),
        "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        "worlds": {},
    }
    cpus = os.cpu_count() or 1
    for world in [w for w in world_sizes() if max_world is None or w <= max_world]:
        threads = max(1, cpus // world)
        runs = []
        for index in range(repeats):
            busy = wait_for_idle(timeout_s=20.0)
            if not quiet:
                print(
                    f"calibrating {world} rank(s) x {threads} thread(s), run {index + 1}/{repeats} "
                    f"(others busy {busy:.0%}) ...",
                    file=sys.stderr,
                    flush=True,
                )
            runs.append(_run_workers(world, threads))
        kept = _pick_repeat(runs)
        result["worlds"][str(world)] = runs[kept]
        if len(runs) > 1:
            checks = [self_check(run) for run in runs]
            result.setdefault("spread", {})[str(world)] = _spread_of(runs)
            result.setdefault("repeats", {})[str(world)] = {
                "kept": kept + 1,
                "self_checks": [round(c, 4) for c in checks],
            }
            if not quiet:
                print(
                    f"  {world} rank(s): kept run {kept + 1} of {len(runs)} (in-step predicted / measured "
                    + ", ".join(f"{c:.2f}" for c in checks)
                    + ")",
                    file=sys.stderr,
                    flush=True,
                )
    return result


def self_check(run: dict) -> float:
    """A repeat's (or a calibrated world's) in-step training step predicted from the rates the same repeat measured (before any
    ``collective_wait_s``), over that step's measured wall time: how well its microbenchmarks explain a real step
    timed minutes later in the same run."""
    return run["in_step"]["predicted_s"] / run["in_step"]["wall_s"]


def _pick_repeat(runs: list[dict]) -> int:
    """The index of the repeat a calibration keeps: the fewest contended benchmarks, then the self-check nearest 1.

    A whole repeat, not the best of each number across repeats: the numbers of one repeat were measured at one
    moment of a drifting host, and the rank wait (``collective_wait_s``) is fitted to the residual of that
    repeat's own rates, so the fastest rates of one repeat beside the lowest wait of another would predict every
    step of several ranks too short. The self-check nearest 1 is the
    repeat whose microbenchmarks best explain its own real step -- one where gloo or a kernel came out several
    times slow, or rank 0 ran beside a slow peer, is far from 1."""
    return min(range(len(runs)), key=lambda i: (len(runs[i].get("contended", ())), abs(math.log(self_check(runs[i])))))


def _spread_of(runs: list[dict]) -> dict:
    """(max - min) / max over the runs of each top-level rate: how far apart the repeats were."""
    spread = {}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("threads", "world_size"):
            values = [r[key] for r in runs]
            spread[key] = round((max(values) - min(values)) / max(values), 4) if max(values) else 0.0
    return spread


def _run_workers(world: int, threads: int) -> dict:
    """``world`` concurrent worker processes (gloo group when world > 1); rank 0's measurements."""
    with tempfile.TemporaryDirectory(prefix="autotune-calibrate-") as tmp:
        # the workers run as a CPU trial's ranks do: same threads, same malloc settings (trials.core.allocator)
        env = dict(
            allocator.trial_environment(dict(os.environ), cpu=True),
            OMP_NUM_THREADS=str(threads),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(_free_port()),
            WORLD_SIZE=str(world),
        )
        procs = []
        for rank in range(world):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "autotune.timing.calibration.worker",
                        str(rank),
                        str(world),
                        str(threads),
                        tmp,
                    ],
                    env=dict(env, RANK=str(rank)),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                )
            )
        errors = []
        for proc in procs:
            _, err = proc.communicate(timeout=1800)
            if proc.returncode:
                errors.append(err.decode(errors="replace")[-2000:])
        if errors:
            raise RuntimeError("cpu calibration worker failed:\n" + errors[0])
        return json.loads((Path(tmp) / "rank0.json").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """``python -m autotune.timing.calibration [--force]``: print this machine's calibration (measuring it first
    when there is none cached, or with ``--force``)."""
    argv = sys.argv[1:] if argv is None else argv
    data = load_or_calibrate(force="--force" in argv, quiet=False)
    print(json.dumps(data, indent=2))
    print(f"cached at {calibration_store.cache_path()}", file=sys.stderr)
    return 0
