"""The search's answer for LoRA adapters beside full training: ``autotune search`` at each target with and without
``--lora-rank`` on one node (the plan backend: predictions, not measurements), side by side.

    .venv/bin/python bench/lora_fronts.py | tee bench/results/lora_fronts.txt
    .venv/bin/python bench/lora_fronts.py --model tiny-llama --hardware cpu --gpus 2 --targets 4K --memory-gib 0.5

For each target and workload: best.json's config (the fastest that reaches the target), its tokens/s, its peak
per GPU on the device and on the host with the share of the preset's capacity each is, then the front (each length
the search reached, with its fastest tokens/s; its longest is the wall the search found). Each search starts from an empty plan store and its
wall time is printed. The last line: LoRA's tokens/s at each target against full training's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30


def _search(args, target: str, rank: int, out: Path, cache: Path) -> tuple[dict, list[dict], float]:
    """(best.json, the front, wall seconds) of one search."""
    command = [str(ROOT / ".venv" / "bin" / "autotune"), "search", "--model", args.model, "--hardware", args.hardware,
               "--gpus", str(args.gpus), "--target", target, "--out", str(out), "--json"]  # fmt: skip
    if rank:
        command += ["--lora-rank", str(rank)]
    if args.memory_gib:
        command += ["--memory-gib", str(args.memory_gib)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "XDG_CACHE_HOME": str(cache)})
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    best = json.loads((out / "best.json").read_text())
    return best, json.loads((out / "pareto.json").read_text())["front"], wall


def _peaks(record: dict, device_cap: int, host_cap: int) -> str:
    device, host = record.get("peak_device_bytes") or 0, record.get("host_bytes") or 0
    held = f"device {device / GIB:.2f} GiB ({device / device_cap:.0%})"
    return held + (f", host {host / GIB:.1f} GiB ({host / host_cap:.0%})" if host_cap else "")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--targets", default="1M,5M", help="comma-separated")
    parser.add_argument("--rank", type=int, default=16, help="the LoRA rank (alpha twice it, every linear layer)")
    parser.add_argument("--memory-gib", type=float, default=None)
    args = parser.parse_args(argv)
    from autotune.core.hardware import load_hardware

    hw = load_hardware(args.hardware).with_memory_gib(args.memory_gib)
    device_cap, host_cap = hw.device_memory_bytes, hw.host_memory_bytes_per_device
    print(
        f"{args.model} on {args.gpus}x {args.hardware} (device {device_cap / GIB:.2f} GiB, host {host_cap / GIB:.1f} "
        f"GiB per GPU): full training and LoRA rank {args.rank} (alpha {2 * args.rank}) on every linear layer"
    )
    ratios = []
    with tempfile.TemporaryDirectory() as scratch:
        for target in args.targets.split(","):
            speeds = {}
            for name, rank in (("full", 0), (f"LoRA r{args.rank}", args.rank)):
                out, cache = Path(scratch) / f"{target}-{rank}", Path(scratch) / f"cache-{target}-{rank}"
                best, front, wall = _search(args, target, rank, out, cache)
                record = best.get("predicted") or {}
                speeds[name] = record.get("tokens_per_s") or 0.0
                knobs = ", ".join(f"{k}={v}" for k, v in best["techniques"].items())
                print(f"\ntarget {target}, {name} (search {wall:.0f} s, empty plan store)")
                print(f"  best.json: {best['seq_len']:,} tokens at {speeds[name]:,.0f} tokens/s; "
                      f"{_peaks(record, device_cap, host_cap)}")  # fmt: skip
                print(f"  its stack: {knobs}")
                fastest: dict[int, dict] = {}
                for entry in front:
                    if (
                        entry["seq_len"] not in fastest
                        or entry["tokens_per_s"] > fastest[entry["seq_len"]]["tokens_per_s"]
                    ):
                        fastest[entry["seq_len"]] = entry
                print("  front: " + "; ".join(f"{n:,} at {e['tokens_per_s']:,.0f}" for n, e in sorted(fastest.items())))
            full, lora = speeds["full"], speeds[f"LoRA r{args.rank}"]
            ratios.append(f"{target} {lora / full:.2f}x" if full else f"{target} (full training reaches no best)")
    print(
        f"\nLoRA rank {args.rank}'s tokens/s against full training's at the target, best.json each: {', '.join(ratios)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
