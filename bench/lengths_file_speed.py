"""README's main job over packed documents from a lengths file beside the same search over documents of one length,
each cold (a fresh ``autotune`` process with an empty plan store of its own), back to back in one run.

The lengths file holds 200 document lengths drawn uniformly from 2K to 64K tokens (seed 0; about 144 documents per
5M sequence, no two of one length side by side), what a tokenized corpus gives; ``--documents 64K`` packs 80 equal
documents. The oracle traces one document of each length per phase and accounts for the others
(``trials.core.repeats.for_each_kind``), so a lengths file costs about what one length does; the last line is the
lengths file's wall time over the single length's (goal <= 1.5).

    .venv/bin/python bench/lengths_file_speed.py > bench/results/lengths_file_speed.txt
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAIN_JOB = ["search", "--model", "llama3-8b", "--target", "5M"]  # README's main job
GOAL_RATIO = 1.5


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} {five:.2f} on {os.cpu_count()} cores"


def _search(autotune: str, documents: str, scratch: Path, name: str) -> tuple[float, float, list]:
    env = dict(os.environ, AUTOTUNE_CACHE_DIR=str(scratch / f"store-{name}"))
    out = scratch / f"out-{name}"
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu, started = usage.ru_utime + usage.ru_stime, time.perf_counter()
    done = subprocess.run([autotune, *MAIN_JOB, "--documents", documents, "--out", str(out)], capture_output=True,
                          text=True, env=env)  # fmt: skip
    wall = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"autotune search --documents {documents} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    front = [(e["seq_len"], round(e["tokens_per_s"])) for e in json.loads((out / "pareto.json").read_text())["front"]]
    return wall, usage.ru_utime + usage.ru_stime - cpu, front


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--autotune", default=str(Path(sys.executable).with_name("autotune")))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="lengths-file-speed-") as scratch:
        scratch = Path(scratch)
        lengths = random.Random(0).choices(range(2048, 65537), k=200)
        lengths_file = scratch / "lengths.json"
        lengths_file.write_text(json.dumps(lengths))
        print(f"$ autotune {' '.join(MAIN_JOB)} --documents ...   (cold: an empty plan store each; {_load()})")
        print(
            f"  lengths file: 200 lengths, {min(lengths):,} to {max(lengths):,} tokens, mean {sum(lengths) / 200:,.0f}"
        )
        runs = {}
        for name, documents in (("64K", "64K"), ("lengths file", str(lengths_file))):
            wall, cpu, front = _search(args.autotune, documents, scratch, name.replace(" ", "-"))
            runs[name] = wall
            print(f"  --documents {name:<13} {wall:7.1f} s wall {cpu:7.1f} s CPU   front {len(front)} points "
                  f"(longest {max(front)[0]:,} tokens)   (after: {_load()})", flush=True)  # fmt: skip
    ratio = runs["lengths file"] / runs["64K"]
    print(f"lengths file / one length: {ratio:.2f}x the wall time (goal <= {GOAL_RATIO})")
    return 0 if ratio <= GOAL_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
