"""The plan backend's cold answers, the path that traces every tile beside the one that accounts for identical
tiles (``autotune.oracle.repeats``), side by side in one run, each a fresh ``autotune`` process with an empty plan
store of its own (``AUTOTUNE_CACHE_DIR`` in a temp dir):

1. ``autotune estimate --config <the full stack> --max-seq`` for llama3-8b on 8x h100-sxm (the length model);
2. the README's main job, ``autotune search --model llama3-8b --target 5M``, cold; then again warm (its store).
   With ``--documents 64K`` the search is over packed documents (``--documents 64K``: 80 per 5M sequence, each its
   own attention call, identical documents accounted for like tiles), its best config is set beside the
   single-document best (``bench/results/main_job.txt``'s point at 5,242,880 tokens), and the single-document main
   job runs cold right after it: the last line is the packed search's wall and CPU time over that one's.

    .venv/bin/python bench/planner_speed.py
    .venv/bin/python bench/planner_speed.py --skip-main-job     # the --max-seq lines only
    .venv/bin/python bench/planner_speed.py --skip-max-seq --skip-warm --documents 64K   # the packed search

Each line gives the wall time and the CPU time of the process: on a shared machine the wall follows the load
(printed), the CPU time much less. The answers must be equal: the --max-seq record whole, the main job's
``pareto.json`` front (lengths and tokens/s) and ``best.json`` byte for byte. The last line is the main job's cold
wall time with identical tiles accounted for, and its ratio to tracing every tile.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

EVERY_TILE_ENV = "AUTOTUNE_TRACE_EVERY_TILE"
PATHS = (("every tile", {EVERY_TILE_ENV: "1"}), ("tiles repeated", {EVERY_TILE_ENV: ""}))
MAIN_JOB = ["search", "--model", "llama3-8b", "--target", "5M"]  # README's main job


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.2f} {five:.2f} on {os.cpu_count()} cores"


def _run(command: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float, float]:
    cpu, started = _children_cpu_s(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall, cpu = time.perf_counter() - started, _children_cpu_s() - cpu
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done, wall, cpu


def _frugal_config(scratch: Path) -> Path:
    """The default search space's most frugal config for the main job (the full stack) at 1M tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from autotune.search.space import load_space
    from trials.models.config import load_model_config

    model_config = load_model_config("llama3-8b")
    techniques = load_space(None, model_config, 8, 1024**2).frugal(model_config["num_hidden_layers"]).to_dict()
    config = scratch / "full-stack.json"
    config.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": "llama3-8b",
                "hardware": "h100-sxm",
                "gpus": 8,
                "seq_len": 1024**2,
                "techniques": techniques,
            }
        )
    )
    return config


def _max_seq(autotune: str, scratch: Path) -> bool:
    config = _frugal_config(scratch)
    print(f"$ autotune estimate --config full-stack.json --max-seq --json   (llama3-8b, 8x h100-sxm; {_load()})")
    records = {}
    for name, extra in PATHS:
        env = dict(os.environ, AUTOTUNE_CACHE_DIR=str(scratch / f"max-seq-{len(records)}"), **extra)
        done, wall, cpu = _run([autotune, "estimate", "--config", str(config), "--max-seq", "--json"], env)
        record = json.loads(done.stdout)
        how = record.pop("max_seq_search")
        records[name] = (record, wall, cpu)
        print(
            f"  {name:<15} {wall:7.1f} s wall {cpu:7.1f} s CPU   --max-seq {record['seq_len']:,} ({record['status']}, "
            f"by {how['method']})",
            flush=True,
        )
    (old, old_wall, old_cpu), (new, new_wall, new_cpu) = records.values()
    equal = old == new
    print(f"  records equal: {'yes' if equal else 'NO'}; repeated / every tile: {new_cpu / old_cpu:.2f}x the CPU time")
    return equal


def _front(out: Path) -> list:
    return [(e["seq_len"], e["tokens_per_s"]) for e in json.loads((out / "pareto.json").read_text())["front"]]


def _main_job(autotune: str, scratch: Path, documents: str | None, warm: bool) -> tuple[bool, float, float, float]:
    search = MAIN_JOB + (["--documents", documents] if documents else [])
    print(f"$ autotune {' '.join(search)}   (cold: an empty plan store each; {_load()})")
    runs = {}
    for name, extra in PATHS:
        env = dict(os.environ, AUTOTUNE_CACHE_DIR=str(scratch / f"store-{len(runs)}"), **extra)
        out = scratch / f"out-{len(runs)}"
        _, wall, cpu = _run([autotune, *search, "--out", str(out)], env)
        runs[name] = (out, wall, cpu, env)
        print(
            f"  {name:<15} {wall:7.1f} s wall {cpu:7.1f} s CPU   front {len(_front(out))} points   (after: {_load()})",
            flush=True,
        )
    (old_out, old_wall, old_cpu, _), (new_out, new_wall, new_cpu, new_env) = runs.values()
    outs = [old_out, new_out]
    if warm:
        outs.append(scratch / "out-warm")
        _, warm_wall, warm_cpu = _run([autotune, *search, "--out", str(outs[-1])], new_env)
        print(
            f"  {'warm (repeated)':<15} {warm_wall:7.1f} s wall {warm_cpu:7.1f} s CPU   (the store the run above filled)"
        )
    fronts = all(_front(out) == _front(old_out) for out in outs)
    best = (old_out / "best.json").read_bytes() == (new_out / "best.json").read_bytes()
    print(
        f"  fronts equal (lengths, tokens/s): {'yes' if fronts else 'NO'}; best.json equal: {'yes' if best else 'NO'}"
    )
    print(f"  repeated / every tile: {new_wall / old_wall:.2f}x the wall, {new_cpu / old_cpu:.2f}x the CPU time")
    if documents:
        _beside_single_document(new_out / "best.json")
    return fronts and best, new_wall, old_wall, new_cpu


def _beside_single_document(best_json: Path) -> None:
    """The packed search's best config beside the single-document best at 5M (``bench/results/main_job.txt``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from packed_documents import main_job_best

    best = json.loads(best_json.read_text())
    single = main_job_best(5 * 1024**2)
    techniques = best["techniques"]
    differs = {k: (single.get(k), v) for k, v in techniques.items() if single.get(k) != v}
    print(f"  best.json: {best['seq_len']:,} tokens at {best['predicted']['tokens_per_s']:,.0f} tokens/s")
    print(f"  best config: {json.dumps(techniques, sort_keys=True)}")
    if differs:
        said = ", ".join(f"{k} {a} -> {b}" for k, a, b in ((k, *ab) for k, ab in sorted(differs.items())))
        print(f"  differs from the single-document best at 5M (bench/results/main_job.txt) in: {said}")
    else:
        print("  the same config as the single-document best at 5M (bench/results/main_job.txt)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--autotune", default=str(Path(sys.executable).parent / "autotune"))
    parser.add_argument("--skip-main-job", action="store_true")
    parser.add_argument("--skip-max-seq", action="store_true")
    parser.add_argument("--skip-warm", action="store_true", help="no warm run of the search after the cold ones")
    parser.add_argument("--documents", help="search over packed documents (the search's --documents)")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="planner_speed-"))
    ok = args.skip_max_seq or _max_seq(args.autotune, scratch)
    if args.skip_main_job:
        return 0 if ok else 1
    equal, new_wall, old_wall, new_cpu = _main_job(args.autotune, scratch, args.documents, not args.skip_warm)
    if not args.documents:
        print(f"after: {_load()}")
        print(f"cold main job: {new_wall:.0f} s wall ({new_wall / old_wall:.2f}x tracing every tile)")
        return 0 if ok and equal else 1
    single_wall, single_cpu = _single_document_job(args.autotune, scratch)
    print(f"after: {_load()}")
    print(
        f"cold packed search (--documents {args.documents}): {new_wall:.0f} s wall ({new_wall / old_wall:.2f}x tracing "
        f"every tile), {new_wall / single_wall:.2f}x the single-document main job's wall, "
        f"{new_cpu / single_cpu:.2f}x its CPU time"
    )
    return 0 if ok and equal else 1


def _single_document_job(autotune: str, scratch: Path) -> tuple[float, float]:
    """The README's main job (one document per sequence) cold, identical tiles accounted for: the packed search's
    yardstick, run right after it."""
    search = MAIN_JOB
    env = dict(os.environ, AUTOTUNE_CACHE_DIR=str(scratch / "store-single"), **dict(PATHS)["tiles repeated"])
    print(f"$ autotune {' '.join(search)}   (cold, tiles repeated; {_load()})")
    _, wall, cpu = _run([autotune, *search, "--out", str(scratch / "out-single")], env)
    print(f"  {'one document':<15} {wall:7.1f} s wall {cpu:7.1f} s CPU   (after: {_load()})", flush=True)
    return wall, cpu


if __name__ == "__main__":
    sys.exit(main())
