"""Regenerate the README gallery from real runs: the plots a search writes, copied here.

    .venv/bin/python docs/gallery/make.py            # ~2 min (plan search) + ~4 min (local CPU search)

1. ``autotune search --model llama3-8b --target 5M`` -- the main job, plan backend, default space and trials
   -> llama3-8b-5M-pareto.png, llama3-8b-5M-memory.png
2. ``autotune search --model tiny-llama --target 8K --gpus 2 --backend local --memory-gib 0.5 --trials 10`` --
   real CPU trials (measured, circles) with the oracle prefilter's predicted OOMs (squares/crosses)
   -> tiny-llama-local-pareto.png, tiny-llama-local-memory.png
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
RUNS = {
    "llama3-8b-5M": ["--model", "llama3-8b", "--target", "5M"],
    "tiny-llama-local": [
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
}


def main() -> int:
    for name, args in RUNS.items():
        with tempfile.TemporaryDirectory() as tmp:
            command = [sys.executable, "-m", "autotune.cli", "search", *args, "--out", tmp]
            print("autotune search " + " ".join(args), flush=True)
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if done.returncode not in (0, 1):  # 1: no config reached the target, the plots still exist
                print(done.stderr[-3000:], file=sys.stderr)
                return done.returncode
            for plot in ("pareto", "memory"):
                target = HERE / f"{name}-{plot}.png"
                shutil.copyfile(Path(tmp) / f"{plot}.png", target)
                print(f"  wrote {target.relative_to(ROOT)} ({target.stat().st_size // 1024} KB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
