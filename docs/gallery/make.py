"""Regenerate the README gallery from real runs: the plots a search writes, copied here.

    .venv/bin/python docs/gallery/make.py            # ~2 min (plan search) + ~4 min (local CPU search) + ~1 min
    .venv/bin/python docs/gallery/make.py failed-search  # only the runs named

1. ``autotune search --model llama3-8b --target 5M`` -- the main job, plan backend, default space and trials
   -> llama3-8b-5M-pareto.png, llama3-8b-5M-memory.png
2. ``autotune search --model tiny-llama --target 8K --gpus 2 --backend local --memory-gib 0.5 --trials 10`` --
   real CPU trials (measured, circles) with the oracle prefilter's predicted OOMs (squares/crosses)
   -> tiny-llama-local-pareto.png, tiny-llama-local-memory.png
3. ``autotune search --model tiny-llama --target 4K --gpus 2 --hardware cpu --memory-gib 0.001 --backend plan
   --trials 6`` -- a search where nothing fits (every trial out of memory): the rate axis says so, the trials
   stand in the failure strip -> failed-search-pareto.png (no front, so no memory plot)
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# name -> (search arguments, the plots it yields)
RUNS = {
    "llama3-8b-5M": (["--model", "llama3-8b", "--target", "5M"], ("pareto", "memory")),
    "tiny-llama-local": (
        [
            "--model",
            "tiny-llama",
            "--target",
            "8K",
            "--gpus",
            "2",
            "--backend",
            "local",
            "--memory-gib",
            "0.5",
            "--trials",
            "10",
        ],
        ("pareto", "memory"),
    ),
    "failed-search": (
        [
            "--model",
            "tiny-llama",
            "--target",
            "4K",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--memory-gib",
            "0.001",
            "--backend",
            "plan",
            "--trials",
            "6",
        ],
        ("pareto",),
    ),
}


def main(names: list[str]) -> int:
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        print(f"unknown run {', '.join(unknown)}; the runs: {', '.join(RUNS)}", file=sys.stderr)
        return 2
    for name, (args, plots) in RUNS.items():
        if names and name not in names:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "autotune.cli", "search", *args, "--out", tmp]
            print("autotune search " + " ".join(args), flush=True)
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if done.returncode not in (0, 1):  # 1: no config reached the target, the plots still exist
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            for plot in plots:
                target = HERE / f"{name}-{plot}.png"
                shutil.copyfile(Path(tmp) / f"{plot}.png", target)
                print(f"  wrote {target.relative_to(ROOT)} ({target.stat().st_size // 1024} KB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
