"""How much of a multi-rank fidelity prediction is the rank-wait term, and does the measured step need it?

The time model adds, on several ranks, a wait for the slower rank at the step's collectives (``autotune.timing.model``:
``rank_wait_s``), fitted by the calibration to the residual of its one 2,048-token in-step step per world: until
2026-11-25 ``rank_imbalance x (compute + recompute)``, since then ``collective_wait_s`` x the step's collective
calls (a preset from before carries only the first, which the model no longer reads). This bench re-predicts the
multi-rank configs of a table ``bench/throughput_fidelity.py`` wrote, on the preset that table was measured
against (plan backend, no trial runs: seconds), and prints per config the measured step, the prediction, its wait
term, the ratio without it, and what the measured step leaves over the prediction without it (``residual``), in
all and per collective call. Were the wait a share of compute, the residual would grow with the step; the last
line says whether it does (its correlation with compute + recompute).

    .venv/bin/python bench/rank_wait.py --preset bench/results/calibrated-cpu-2026-11-25b.yaml \\
        --table bench/results/throughput_fidelity_2026-11-25b.txt
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput_fidelity as fidelity  # noqa: E402  (the bench whose tables this reads)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, help="the preset the table was measured against")
    parser.add_argument("--table", required=True, help="a table bench/throughput_fidelity.py wrote")
    args = parser.parse_args(argv)

    from autotune.core.hardware import load_hardware

    hardware = load_hardware(args.preset)
    measured = {row.label: row.measured_s for row in fidelity.read_rows(Path(args.table))}
    lines = [f"# {args.table} against {args.preset}: multi-rank configs, re-predicted (plan backend)",
             f"{'config':62s} {'ranks':>5s} {'measured_s':>10s} {'predicted_s':>11s} {'wait_s':>7s} {'ratio':>6s} "
             f"{'no wait':>7s} {'residual_s':>10s} {'busy_s':>7s} {'calls':>5s} {'per call':>8s}"]
    busy, residual, calls = [], [], []
    for config in fidelity.CONFIGS:
        name, ranks = fidelity.label(*config), config[2]
        if ranks < 2 or name not in measured:
            continue
        record, timing, counts = fidelity.predict(*config, hardware)
        wait = timing.detail["rank_wait_s"]
        without = record.step_time_s - wait
        busy.append(timing.compute_s + timing.recompute_s)
        residual.append(measured[name] - without)
        calls.append(counts.collective_calls())
        lines.append(f"{name:62s} {ranks:5d} {measured[name]:10.4f} {record.step_time_s:11.4f} {wait:7.3f} "
                     f"{record.step_time_s / measured[name]:6.2f} {without / measured[name]:7.2f} "
                     f"{residual[-1]:+10.3f} {busy[-1]:7.3f} {calls[-1]:5d} {residual[-1] / calls[-1] * 1e3:6.2f}ms")
    if len(busy) > 2:
        lines.append(f"# residual over the prediction without the wait: {min(residual):+.3f}..{max(residual):+.3f} s, "
                     f"correlation with compute + recompute {statistics.correlation(busy, residual):.2f} "
                     "(the wait term's is 1 by construction)")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
