"""``autotune calibrate --check``: does a preset still describe this machine?

A calibration is one moment of one machine. A shared host drifts (the 'drift' column of
``bench/throughput_fidelity.py`` tracks it), and a GPU can be throttled or shared with another job. Predicted step times
move with it one for one, so before trusting a plan made on a preset the user can ask, in seconds, how far this
machine now is from the moment it was measured. The check re-times the one recorded workload a step's time
follows most closely and divides:

- a preset whose device is the host (``calibration:``, the ``cpu`` kind): the calibration's own in-step training
  step on one rank (``microbench.in_step_training`` / ``reference_step_s``), recorded as
  ``calibration.worlds['1'].in_step.wall_s``;
- a preset ``autotune calibrate`` measured on GPUs (``calibrated.measurements.gemm``): the same GEMM shapes on
  device 0 in the same dtype, whose FLOP/s is the time model's matmul rate.

A preset with assumed rates has nothing measured to compare with; ``UserError`` says so. Writes nothing: the
remedy for a machine that moved is a new ``autotune calibrate``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

from autotune.core import calibration_store
from autotune.core.errors import UserError
from autotune.core.hardware import Hardware
from trials.core import allocator

# Within this factor either way the preset holds: about the time model's own scatter between configs
# (docs/validation.md, "Time model"), well inside the fidelity band [0.8, 1.25]
HOLDS_WITHIN = 1.10


@dataclass(frozen=True)
class SpeedCheck:
    """One re-timed reference workload: its seconds now and at the calibration."""

    workload: str  # what was timed, in words
    now_s: float  # median seconds now
    calibrated_s: float  # the preset's seconds for the same workload
    calibrated_at: str
    spread: float  # (max - min) / median of the samples now: the check's own noise
    same_machine: bool = True
    contended: bool = False  # other processes used the CPUs during every sample: the seconds are not this
    # machine's speed, only the load's

    @property
    def slowdown(self) -> float:
        """How many times slower this machine runs the workload now than at the calibration (< 1: faster)."""
        return self.now_s / self.calibrated_s

    @property
    def holds(self) -> bool:
        return 1 / HOLDS_WITHIN <= self.slowdown <= HOLDS_WITHIN

    def lines(self, preset: str) -> list[str]:
        """What ``autotune calibrate --check`` prints: the measurement, then the verdict."""
        direction = "slower" if self.slowdown >= 1 else "faster"
        factor = self.slowdown if self.slowdown >= 1 else 1 / self.slowdown
        first = (
            f"{self.workload}: {self.now_s:.4g} s now (spread {self.spread:.0%}), {self.calibrated_s:.4g} s "
            f"at the calibration ({self.calibrated_at}): {factor:.2f}x {direction}"
        )
        if not self.same_machine:
            first += " (the preset was calibrated on another machine)"
        if self.contended:
            return [
                first,
                "other processes kept the CPUs busy during every sample: this says nothing about the "
                "machine's speed; check again when it is quiet",
            ]
        if self.holds:
            verdict = f"{preset} holds here: this machine is within {HOLDS_WITHIN:.2f}x of the calibration's speed"
        else:
            verdict = (
                f"{preset} predicts step times {factor:.2f}x too {'short' if direction == 'slower' else 'long'}"
                f" on this machine now; measure it again: autotune calibrate --name NAME (a few minutes)"
            )
        return [first, verdict]


def check_preset(hw: Hardware, samples: int = 7, announce=None) -> SpeedCheck:
    """Re-time ``hw``'s reference workload on this machine (see the module docstring); ``announce(workload)`` is
    called once the preset is known to have one, before the seconds of timing."""
    if hw.calibration:
        return check_host(hw.calibration, samples, announce)
    measurements = (hw.calibrated or {}).get("measurements") or {}
    if "gemm" in measurements:
        return check_device(measurements, hw.calibrated.get("measured_at", "?"), samples, announce=announce)
    raise UserError(
        f"hardware {hw.name}: its rates are assumed, not measured, so there is nothing to compare this "
        f"machine with; measure them: autotune calibrate --name NAME"
    )


def check_host(calibration: dict, samples: int = 7, announce=None) -> SpeedCheck:
    """The calibration's in-step step on one rank, with the thread count the calibration gave it, timed in a child
    process started as a CPU trial's rank is (``_time_reference_step``)."""
    from autotune.timing.calibration import microbench
    from autotune.timing.calibration.sampling import relative_spread

    world_1 = calibration["worlds"].get("1") or {}
    if "wall_s" not in (world_1.get("in_step") or {}):
        raise UserError(
            "this preset's calibration records no one-rank in-step step (an older calibration): "
            "re-measure it: autotune calibrate --name NAME"
        )
    workload = f"the calibration's training step ({microbench.IN_STEP_TOKENS:,} tokens, 1 rank)"
    if announce:
        announce(workload)
    times, contended = _time_reference_step(int(world_1.get("threads") or os.cpu_count() or 1), samples)
    return SpeedCheck(
        workload=workload,
        now_s=statistics.median(times),
        calibrated_s=float(world_1["in_step"]["wall_s"]),
        calibrated_at=str(calibration.get("measured_at", "?")),
        spread=relative_spread(times),
        same_machine=calibration.get("machine") == calibration_store.machine_key(),
        contended=contended,
    )


def _time_reference_step(threads: int, samples: int) -> tuple[list[float], bool]:
    """(seconds of each sample, whether every sample was contended) of the in-step step, timed in a child process
    with a CPU trial's environment: the calibration's workers timed it under the trials' malloc settings
    (``trials.core.allocator``), which glibc reads only when a process starts; without them the same step runs
    slower."""
    env = dict(allocator.trial_environment(dict(os.environ), cpu=True), OMP_NUM_THREADS=str(threads))
    proc = subprocess.run(
        [sys.executable, "-m", "autotune.timing.calibration.check", str(threads), str(samples)],
        env=env,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError("timing the calibration's step failed:\n" + proc.stderr[-2000:])
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    return data["times"], data["contended"]


def _reference_step_worker(threads: int, samples: int) -> dict:
    import torch

    from autotune.timing.calibration import microbench, sampling

    torch.set_num_threads(threads)
    training = microbench.in_step_training()
    # each sample averages >= 1 s of steps: single steps on a shared host scatter too widely to compare
    times = sampling.sample(
        lambda: microbench.reference_step_s(training, steps=1), "reference step", samples=samples, min_seconds=1.0
    )
    return {"times": times, "contended": bool(sampling.CONTENDED_BENCHMARKS)}


def check_device(measurements: dict, measured_at: str, samples: int = 7, device=None, announce=None) -> SpeedCheck:
    """The calibration's GEMM shapes on ``device`` (default: CUDA device 0) in the calibration's dtype: total
    seconds of one of each, now and at the calibration (total FLOPs / the recorded FLOP/s)."""
    import torch

    from autotune.timing.calibration.device_bench import measure_gemms
    from autotune.timing.calibration.sampling import relative_spread

    if device is None:
        if not torch.cuda.is_available():
            raise UserError(
                "this preset was measured on GPUs, but this machine shows no CUDA device: run the check "
                "on the node it describes"
            )
        device = torch.device("cuda", 0)
    dtype_name = measurements.get("dtype", "bfloat16")
    shapes = [(p["m"], p["k"], p["n"]) for p in measurements["gemm"]["points"]]
    recorded_on = measurements.get("device", "GPU")
    workload = f"the calibration's {len(shapes)} GEMM shapes ({recorded_on}, {dtype_name})"
    if announce:
        announce(workload)
    flops = sum(2.0 * m * k * n for m, k, n in shapes)
    runs = [
        measure_gemms(device, getattr(torch, dtype_name), shapes)["flops_per_s"] for _ in range(max(1, samples // 3))
    ]
    times = [flops / rate for rate in runs]
    here = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return SpeedCheck(
        workload=workload,
        now_s=statistics.median(times),
        calibrated_s=flops / measurements["gemm"]["flops_per_s"],
        calibrated_at=measured_at,
        spread=relative_spread(times),
        same_machine=recorded_on in ("GPU", here),
    )


if __name__ == "__main__":  # the child of ``_time_reference_step``: THREADS SAMPLES -> one JSON line
    print(json.dumps(_reference_step_worker(int(sys.argv[1]), int(sys.argv[2]))))
