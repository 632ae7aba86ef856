"""How alike are a calibration's repeats of one world? Each repeat's own self-check beside the merged result.

``autotune calibrate`` measures each world size ``--repeats`` times (2 by default) and keeps one whole repeat
(``calibrate._pick_repeat``: fewest contended benchmarks, then the in-step self-check nearest 1). Until
2026-11-24 it kept the best of each number across repeats instead (fastest rates, lowest overheads and rank
imbalance), which this bench's first run showed pairs one repeat's rates with another's imbalance. This runs
``--repeats`` repeats of one world (``calibrate._run_workers``, what ``calibrate`` runs) and prints, per repeat,
its in-step step predicted from its own rates over its measured wall time, its attention factor, rank wait per
collective call and matmul rate; then which of the first two ``calibrate --repeats 2`` would keep, and the repeats' median wall
time against the kept one's.

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
    from autotune.timing.calibration import self_check

    in_step = result["in_step"]
    return (f"in-step predicted {in_step['predicted_s']:.4f} s / wall {in_step['wall_s']:.4f} s = "
            f"{self_check(result):.2f}; attention factor {in_step['attention_factor']:.2f}; "
            f"collective wait {result['collective_wait_s'] * 1e3:.2f} ms/call; in-step matmul {in_step['matmul_flops']:.3g} FLOP/s")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    import os

    from autotune.timing.calibration import _pick_repeat, _run_workers

    threads = max(1, (os.cpu_count() or 1) // args.world)
    started = time.time()
    runs = []
    for index in range(args.repeats):
        runs.append(_run_workers(args.world, threads))
        print(f"repeat {index + 1}/{args.repeats}: {describe(runs[-1])}", flush=True)
    kept = _pick_repeat(runs[:2])
    print(f"of repeats 1-2, calibrate --repeats 2 keeps repeat {kept + 1}: {describe(runs[kept])}")
    walls = [r["in_step"]["wall_s"] for r in runs]
    print(f"# {args.world} rank(s) x {threads} thread(s); took {time.time() - started:.0f} s")
    print(f"median repeat wall / kept wall: {statistics.median(walls) / runs[kept]['in_step']['wall_s']:.2f} "
          f"(repeats' walls {min(walls):.4f}-{max(walls):.4f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
