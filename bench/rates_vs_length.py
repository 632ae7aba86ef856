"""Where does the time model's error grow with sequence length? Measured / predicted seconds per kind of work.

Over the fidelity runs the raw ratio (predicted / measured step time) correlates with the step's length: 1K-token
steps read 0.75-0.95 of the run's offset, 8K-16K ones 1.03-1.10 (bench/results/throughput_fidelity_summary.txt).
This bench splits one real training step of a fidelity model on one rank (``trials.step.train_step`` under the
trials' memory tracker, as a trial runs it) by kind of work, at several lengths:

- measured: every kernel timed by the calibration's own ``_kernel_timer`` (matmul / attention / other work, per
  phase), and the step's wall time; overhead = wall - kernels;
- predicted: ``StepCounter``'s counts of the same step through the preset's rates, per kind
  (``autotune.timing.model``: matmul FLOPs / matmul rate, ``attention_time``, elementwise bytes / rate, dispatches
  x per-op overhead).

The calibration's own in-step step (``microbench.in_step_training``, 2,048 tokens) is measured the same way in the
same rounds (row ``calib 2048``), and each length's ratios are printed again over its: the calibration fits its
rates to that step, so those ratios are free of the host's drift (this row found the attention factor taken with
the wrong tiles, 2026-11-25).

Prints measured / predicted per kind and length, then the kind whose ratio moves most with length. Each cell is
the median of ``--samples`` uncontended samples, taken in rounds over the lengths (so the host's drift
moves every length alike); the spread is printed beside it. Run it with the malloc settings CPU trials run with
(``trials.allocator``; glibc reads them at start-up):

    GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=70368744177664 \
        .venv/bin/python bench/rates_vs_length.py --preset bench/results/calibrated-cpu.yaml
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

KINDS = ("matmul", "attention", "elementwise", "overhead")


def build(model: str, seq_len: int, techniques: dict):
    from trials.data import make_batch, synthetic_sample
    from trials.dist import Mesh
    from trials.memory import DeviceMemoryTracker
    from trials.model_config import load_model_config
    from trials.step import build_training, train_step
    from trials.techniques import Techniques

    cfg = load_model_config(model)
    tracker = DeviceMemoryTracker(None)
    mesh = Mesh.single()
    with tracker:
        model_, optimizer = build_training(cfg, Techniques.from_dict(techniques, cfg["num_hidden_layers"]), mesh, 0,
                                           tracker)
        batch = make_batch(synthetic_sample(0, seq_len, cfg["vocab_size"]), 0, 1, "cpu")
        train_step(model_, optimizer, batch, mesh, tracker)
    return model_, optimizer, batch, mesh, tracker


def predicted_by_kind(training, seq_len: int, rates, techniques) -> tuple[dict, float]:
    from trials.step import train_step
    from autotune.timing.counting import StepCounter
    from autotune.timing.model import attention_time, host_overhead_s, predict_step_time, work_by_kind

    model_, optimizer, batch, mesh, tracker = training
    with tracker:
        counter = StepCounter(tracker, seq_len=seq_len, world_size=1)
        with counter:
            train_step(model_, optimizer, batch, mesh, tracker)
    counts = counter.counts
    out = dict.fromkeys(KINDS, 0.0)
    for phase, pc in counts.phases.items():  # the model's own per-phase terms (autotune.timing.model)
        out["overhead"] += host_overhead_s(pc, rates)
        if phase == "optimizer":
            continue
        work = work_by_kind(pc, rates, attention_time(counts, (phase,), rates))
        out["matmul"] += work["matmul"]
        out["attention"] += work["attention"] + work["attention_backward"]
        out["elementwise"] += work["elementwise"]
    step = predict_step_time(counts, rates, 1, techniques, seq_len=seq_len).step_time_s
    return out, step


def measured_by_kind(training, timer) -> dict:
    from autotune.timing.calibration.microbench import _wall_and_kernels

    kernels, wall = _wall_and_kernels(*training, timer)
    out = {kind: sum(s for (phase, k), s in kernels.items() if k == kind and phase != "optimizer")
           for kind in ("matmul", "attention", "elementwise")}
    out["overhead"] = wall - sum(kernels.values())
    out["wall"] = wall
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="cpu", help="hardware preset name or file (its 1-rank rates)")
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--techniques", default="{}", help='JSON, e.g. \'{"activation_checkpointing": true}\'')
    args = parser.parse_args(argv)

    import torch

    from autotune.core.hardware import load_hardware
    from autotune.timing.calibration.microbench import (IN_STEP_TOKENS, _kernel_timer, in_step_training,
                                                        reference_step_s)
    from autotune.timing.calibration.sampling import CONTENDED, cpu_snapshot, others_share
    from trials.model_config import load_model_config
    from trials.techniques import Techniques

    hardware = load_hardware(args.preset)
    rates = hardware.rates_for(1)
    torch.manual_seed(0)
    started = time.time()
    techniques = json.loads(args.techniques)
    tech = Techniques.from_dict(techniques, load_model_config(args.model)["num_hidden_layers"])
    # rows: (label, training, tokens, techniques); the last is the calibration's own in-step step, measured in the
    # same rounds, so each kind's ratio over its ratio there is free of the host's drift (same moment, same rates)
    rows = [(str(L), build(args.model, L, techniques), L, tech) for L in args.lengths]
    rows.append((f"calib {IN_STEP_TOKENS}", in_step_training(), IN_STEP_TOKENS, Techniques()))
    reference = rows[-1][1]
    timers = {label: _kernel_timer(training[4]) for label, training, _, _ in rows}
    predicted = {label: predicted_by_kind(training, L, rates, t) for label, training, L, t in rows}
    samples = {label: [] for label, _, _, _ in rows}
    # drift: the calibration's own in-step step now / at the calibration (as bench/throughput_fidelity.py gauges it)
    recorded_s = (((hardware.calibration or {}).get("worlds") or {}).get("1") or {}).get("in_step", {}).get("wall_s")
    drifts, contended = [], 0
    for round_ in range(args.samples):  # rounds over the rows: drift moves every row alike
        for label, training, _, _ in rows:
            for attempt in range(5):  # a sample during which other processes used the CPUs is retaken
                measured_by_kind(training, timers[label])  # warm-up: the previous row left other buffers
                before = cpu_snapshot()
                got = measured_by_kind(training, timers[label])
                busy = others_share(before, cpu_snapshot()) > CONTENDED
                if not busy or attempt == 4:
                    contended += busy
                    samples[label].append(got)
                    break
                time.sleep(1.0)
        if recorded_s:
            drifts.append(reference_step_s(reference) / recorded_s)
        print(f"round {round_ + 1}/{args.samples} done ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)

    lines = [f"# {args.model} {args.techniques}, 1 rank x {torch.get_num_threads()} threads, preset {args.preset}; "
             f"measured / predicted seconds per kind (median of {args.samples} samples, spread in brackets)",
             "# drift (the calibration's in-step step now / then): " + (" ".join(f"{d:.2f}" for d in drifts) or "n/a")
             + (f"; {contended} sample(s) kept although contended (5 tries)" if contended else ""),
             f"{'tokens':>11} " + " ".join(f"{k:>20}" for k in KINDS) + f" {'step':>20}  {'pred/meas step':>14}"]
    ratios = {label: {} for label in samples}
    for label, _, _, _ in rows:
        pred, pred_step = predicted[label]
        cells = []
        for kind in KINDS:
            values = [s[kind] for s in samples[label]]
            med = statistics.median(values)
            spread = (max(values) - min(values)) / med if med else 0.0
            ratios[label][kind] = med / pred[kind] if pred[kind] else float("nan")
            cells.append(f"{med:7.3f}/{pred[kind]:6.3f}={ratios[label][kind]:4.2f}[{spread:.2f}]")
        wall = statistics.median(s["wall"] for s in samples[label])
        ratios[label]["step"] = wall / pred_step
        cells.append(f"{wall:7.3f}/{pred_step:6.3f}={wall / pred_step:4.2f}")
        lines.append(f"{label:>11} " + " ".join(f"{c:>20}" for c in cells) + f"  {pred_step / wall:14.2f}")
    calib = ratios[rows[-1][0]]
    lines.append("# each length's measured/predicted over the calibration step's, same rounds (drift cancels):")
    for label, _, _, _ in rows[:-1]:
        lines.append(f"{label:>11} " + " ".join(f"{k}={ratios[label][k] / calib[k]:.2f}" for k in KINDS + ("step",)))
    by_kind = {k: [ratios[label][k] for label, _, _, _ in rows[:-1]] for k in KINDS}  # over the lengths
    moves = {k: max(v) / min(v) for k, v in by_kind.items() if all(x == x and x > 0 for x in v)}
    worst = max(moves, key=moves.get)
    lines.append(f"# measured/predicted moves most with length in: {worst} "
                 f"({min(by_kind[worst]):.2f}..{max(by_kind[worst]):.2f}); took {time.time() - started:.0f} s")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
