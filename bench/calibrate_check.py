"""How steady is `autotune calibrate --check`, and what does it say about this host? Runs the installed command
as a user would, several times minutes apart, and prints each reading (seconds now, seconds at the calibration,
the slowdown, exit code, wall time), then their spread: the check's own noise next to the drift it reports.

    .venv/bin/python bench/calibrate_check.py --hardware bench/results/calibrated-cpu.yaml [--runs 5] [--gap 30]

Writes the same text to bench/results/calibrate_check.txt (``--out``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
READING = re.compile(r": ([0-9.e+-]+) s now \(spread (\d+)%\), ([0-9.e+-]+) s at the calibration \(([^)]*)\): "
                     r"([0-9.]+)x (slower|faster)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", required=True, help="the preset to check (NAME or FILE)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--gap", type=float, default=30.0, help="seconds between runs")
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "calibrate_check.txt"))
    args = parser.parse_args()
    if args.runs < 1 or args.gap < 0:
        parser.error("--runs must be >= 1 and --gap >= 0")
    autotune = REPO / ".venv" / "bin" / "autotune"
    command = [str(autotune), "calibrate", "--check", "--hardware", args.hardware]
    lines = [f"# $ autotune calibrate --check --hardware {args.hardware}   ({args.runs} runs, {args.gap:g} s apart, "
             f"{time.strftime('%Y-%m-%d %H:%M')})",
             f"{'run':>3} {'at':>8} {'now_s':>8} {'spread':>6} {'calib_s':>8} {'slowdown':>8} {'rc':>3} {'wall_s':>6}"]
    print("\n".join(lines), flush=True)
    slowdowns, verdicts = [], []
    for run in range(args.runs):
        if run:
            time.sleep(args.gap)
        start = time.perf_counter()
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
        wall = time.perf_counter() - start
        match = READING.search(result.stdout)
        if match is None:
            print(f"unexpected output (exit {result.returncode}):\n{result.stdout}{result.stderr}", file=sys.stderr)
            return 1
        now_s, spread, calibrated_s, _, factor, direction = match.groups()
        slowdown = float(factor) if direction == "slower" else 1 / float(factor)
        if result.returncode == 0:
            slowdowns.append(slowdown)
            verdicts.append(result.stdout.strip().splitlines()[-1])
        line = (f"{run + 1:>3} {time.strftime('%H:%M:%S'):>8} {float(now_s):>8.4f} {spread + '%':>6} "
                f"{float(calibrated_s):>8.4f} {slowdown:>8.2f} {result.returncode:>3} {wall:>6.1f}")
        lines.append(line)
        print(line, flush=True)
    if verdicts:
        lines.append(f"last verdict: {verdicts[-1]}")
    if slowdowns:
        lines.append(f"# {len(slowdowns)}/{args.runs} checks measured (exit 0); slowdown {min(slowdowns):.2f}-"
                     f"{max(slowdowns):.2f}, median {statistics.median(slowdowns):.2f}: the check's own spread "
                     f"{(max(slowdowns) - min(slowdowns)) / statistics.median(slowdowns):.0%} of its reading")
    else:
        lines.append(f"# 0/{args.runs} checks measured: every one was contended")
    print("\n".join(lines[-2:] if verdicts else lines[-1:]))
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0 if slowdowns else 1


if __name__ == "__main__":
    sys.exit(main())
