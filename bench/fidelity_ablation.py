"""Which technique does the time model under-price? The one config of bench/throughput_fidelity.py that sits low
in both recent runs (``tiny-qwen3 4K x1 fsdp+optoff+ckpt+actoff4``: raw 0.77 at a run offset of 0.94, then 0.75
at 0.87) measured beside its technique subsets, on a calibrated preset.

Each variant is measured as the fidelity bench measures (``throughput_fidelity.measure``: the real trial, median
uncontended step, the calibration's in-step step re-timed beside every step as 'drift') and predicted by the
plan backend; 'x drift' is predicted / measured in the calibration's time, and 'vs base' that over the first
variant's: below 1, the model misses time that the added techniques cost. Passes interleave the variants, so
drift moves them alike.

    .venv/bin/python bench/fidelity_ablation.py --preset bench/results/calibrated-cpu.yaml

Any other config and variants: ``--model M --seq N --ranks R --variant JSON --variant JSON ...`` (the first
variant is the base), e.g. plain against checkpointed to see whether recompute is priced right.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput_fidelity as fidelity  # noqa: E402  (the bench beside this one)

MODEL, SEQ_LEN, RANKS = "tiny-qwen3", 4096, 1
VARIANTS = [  # the first is the base the others are compared with
    {"activation_checkpointing": True},
    {"activation_checkpointing": True, "activation_offload_layers": 4},
    {"fsdp": True, "optimizer_offload": True, "activation_checkpointing": True},
    {"fsdp": True, "optimizer_offload": True, "activation_checkpointing": True, "activation_offload_layers": 4},
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, help="a preset `autotune calibrate` wrote (its in-step wall time "
                                                        "is the drift gauge's reference)")
    parser.add_argument("--passes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--seq", type=int, default=SEQ_LEN)
    parser.add_argument("--ranks", type=int, default=RANKS)
    parser.add_argument("--variant", action="append", type=json.loads, metavar="JSON",
                        help="techniques of one variant (repeat; the first is the base); default: the low config's subsets")
    parser.add_argument("--out", default=str(fidelity.REPO / "bench" / "results" / "fidelity_ablation.txt"))
    args = parser.parse_args(argv)
    model, seq_len, ranks, variants = args.model, args.seq, args.ranks, args.variant or VARIANTS

    from autotune.core.hardware import load_hardware

    started = time.time()
    hardware = load_hardware(args.preset)
    calibrated = hardware.calibration["worlds"][str(ranks)]
    launches = [[] for _ in variants]
    for pass_index in range(args.passes):
        for index, techniques in enumerate(variants):
            print(f"pass {pass_index + 1}/{args.passes}: {fidelity.describe(techniques)}", file=sys.stderr, flush=True)
            launches[index].append(fidelity.measure(model, seq_len, ranks, techniques, args.steps, attempts=3))
    lines = [f"# {model} {seq_len // 1024}K x{ranks}, preset {Path(args.preset).name} "
             f"(calibrated {hardware.calibrated['measured_at']}), {args.passes} passes x {args.steps} steps",
             f"{'variant':40s} {'measured_s':>10s} {'spread':>6s} {'drift':>6s} {'predicted_s':>11s} {'ratio':>6s} "
             f"{'x drift':>7s} {'vs base':>7s}  predicted recompute/host/opt"]
    base = None
    for techniques, measured_launches in zip(variants, launches):
        measured = fidelity._combine(measured_launches, calibrated.get("probe_s"), calibrated["in_step"]["wall_s"])
        record, timing, _ = fidelity.predict(model, seq_len, ranks, techniques, hardware)
        if "error" in measured or record.step_time_s is None:
            lines.append(f"{fidelity.describe(techniques):40s} error: {measured.get('error') or record.error}")
            continue
        ratio = record.step_time_s / measured["step_time_s"]
        drifted = ratio * measured["drift"]
        base = base or drifted
        lines.append(f"{fidelity.describe(techniques):40s} {measured['step_time_s']:10.4f} {measured['spread']:6.2f} "
                     f"{measured['drift']:6.3f} {record.step_time_s:11.4f} {ratio:6.3f} {drifted:7.3f} "
                     f"{drifted / base:7.3f}  {timing.recompute_s:.3f}/{timing.exposed_host_s:.3f}/{timing.optimizer_s:.3f}")
    lines.append(f"# took {time.time() - started:.0f} s")
    print("\n".join(lines))
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
