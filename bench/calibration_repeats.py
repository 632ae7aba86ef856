"""How alike are a calibration's repeats of one world? Each repeat's own self-check beside the merged result.

``autotune calibrate`` measures each world size twice and keeps each number's best (``calibrate._best_of``:
fastest rates, lowest overheads, wall times and rank imbalance). Trials are timed at their median step. This runs
``--repeats`` repeats of one world (``calibrate._run_workers``, what ``calibrate`` runs) and prints, per repeat,
its in-step step predicted from its own rates over its measured wall time, its attention factor, rank imbalance
and matmul rate; then the same for the best-of merge of the first two (what ``calibrate`` would keep) and the
repeats' median wall time against the merge's.

    .venv/bin/python bench/calibration_repeats.py --world 2 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def describe(result: dict) -> str:
    in_step = result["in_step"]
    return (f"in-step predicted {in_step['predicted_s']:.4f} s / wall {in_step['wall_s']:.4f} s = "
            f"{in_step['predicted_s'] / in_step['wall_s']:.2f}; attention factor {in_step['attention_factor']:.2f}; "
            f"rank imbalance {result['rank_imbalance']:.3f}; in-step matmul {in_step['matmul_flops']:.3g} FLOP/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import os

    from autotune.timing.calibration import _best_of, _run_workers

    threads = max(1, (os.cpu_count() or 1) // args.world)
    started = time.time()
    runs = []
    for index in range(args.repeats):
        runs.append(_run_workers(args.world, threads))
        print(f"repeat {index + 1}/{args.repeats}: {describe(runs[-1])}", flush=True)
    merged = _best_of(runs[:2])
    print(f"best-of repeats 1-2 (what calibrate keeps): {describe(merged)}")
    walls = [r["in_step"]["wall_s"] for r in runs]
    print(f"# {args.world} rank(s) x {threads} thread(s); took {time.time() - started:.0f} s")
    print(f"median repeat wall / best-of wall: {statistics.median(walls) / merged['in_step']['wall_s']:.2f} "
          f"(repeats' walls {min(walls):.4f}-{max(walls):.4f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
