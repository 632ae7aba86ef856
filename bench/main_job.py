"""The README's main job, timed as a user runs it: ``autotune search --model llama3-8b --target 5M`` in a fresh out
dir (a subprocess of the installed ``autotune``), then its front, ``autotune estimate --max-seq`` of the front's
longest config, and ``autotune estimate`` of ``best.json``. The wall time of the search is the last line.

    .venv/bin/python bench/main_job.py            # a warm run: plan records already in the store are reused
    .venv/bin/python bench/main_job.py --cold     # an empty plan store (AUTOTUNE_CACHE_DIR in a temp dir),
                                                  # then the same search again, warm, in a fresh out dir
    .venv/bin/python bench/main_job.py --autotune /path/to/clone/.venv/bin/autotune   # another install

The machine's load (``os.getloadavg``) is printed before and after: on a shared 2-core machine the wall time
follows it. The goals are checked and printed: wall <= 60 s warm, the front's longest point >= 97% of its
config's --max-seq and of the default space's most frugal config's (the node's wall), best.json >= the target and confirmed by ``estimate``, which answers within 5 s from the plan
store the search filled.
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

MODEL, TARGET, TARGET_TOKENS = "llama3-8b", "5M", 5 * 1024**2
GOAL_WALL_S, GOAL_FRACTION = 60.0, 0.97
GOAL_ESTIMATE_S = 5.0  # estimate of best.json right after the search: answered from the plan store it filled


def _load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def _run(command: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    return done, time.perf_counter() - started


def _estimate(autotune: str, config: Path, env: dict, max_seq: bool) -> dict:
    command = [autotune, "estimate", "--model", MODEL, "--config", str(config), "--json"] + (["--max-seq"] * max_seq)
    done, seconds = _run(command, env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout)
    record["_seconds"] = seconds
    return record


def _frugal_techniques() -> dict:
    """The default search space's most memory-frugal config for the main job (``SearchSpace.frugal``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from autotune.search.space import load_space
    from trials.models.config import load_model_config

    model_config = load_model_config(MODEL)
    space = load_space(None, model_config, 8, TARGET_TOKENS)
    return space.frugal(model_config["num_hidden_layers"]).to_dict()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--autotune",
        default=str(Path(sys.executable).parent / "autotune"),
        help="the autotune executable (default: this venv's)",
    )
    parser.add_argument("--cold", action="store_true", help="start from an empty plan store")
    parser.add_argument("--out", type=Path, default=None, help="out dir (default: a new temp dir)")
    args = parser.parse_args(argv)

    env = dict(os.environ)
    scratch = Path(tempfile.mkdtemp(prefix="main_job-"))
    if args.cold:
        env["AUTOTUNE_CACHE_DIR"] = str(scratch / "cache")
    out = args.out or scratch / "autotune-out"
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: the main job is timed in a fresh out dir")
    command = [args.autotune, "search", "--model", MODEL, "--target", TARGET, "--out", str(out)]
    print(f"$ {' '.join(command)}{'   (empty plan store)' if args.cold else ''}")
    print(f"before: {_load()}")
    done, wall = _run(command, env)
    print(f"after:  {_load()}")
    if done.returncode not in (0, 1):
        print(done.stdout[-3000:], done.stderr[-3000:], sep="\n")
        raise SystemExit(f"the search failed with exit code {done.returncode}")

    front = json.loads((out / "pareto.json").read_text())["front"]
    print(f"front ({len(front)} points):")
    for entry in front:
        print(
            f"  trial {entry['trial']:>3}  {entry['seq_len']:>12,} tokens  {entry['tokens_per_s']:>9,.0f} tokens/s  "
            f"{json.dumps(entry['techniques'], sort_keys=True)}"
        )

    longest = max(front, key=lambda e: e["seq_len"])
    best_path = out / "best.json"
    template = json.loads(best_path.read_text()) if best_path.is_file() else None
    ok = True
    if template is None:
        print(f"best.json: not written (no config reaches {TARGET})")
        ok = False
    else:
        config = {k: v for k, v in template.items() if k not in ("predicted", "measured")}
        config.update(techniques=longest["techniques"], seq_len=longest["seq_len"])
        longest_path = scratch / "longest.json"
        longest_path.write_text(json.dumps(config, indent=2))
        wall_record = _estimate(args.autotune, longest_path, env, max_seq=True)
        fraction = longest["seq_len"] / wall_record["seq_len"] if wall_record["status"] == "ok" else float("nan")
        print(
            f"longest front point: {longest['seq_len']:,} tokens; its config's --max-seq: "
            f"{wall_record['seq_len']:,} ({wall_record['status']}, {wall_record['_seconds']:.0f} s): "
            f"{fraction:.1%} of it (goal >= {GOAL_FRACTION:.0%})"
        )
        ok &= fraction >= GOAL_FRACTION
        frugal_path = scratch / "frugal.json"
        frugal_path.write_text(json.dumps(dict(config, techniques=_frugal_techniques(), seq_len=TARGET_TOKENS)))
        frugal = _estimate(args.autotune, frugal_path, env, max_seq=True)
        reach = longest["seq_len"] / frugal["seq_len"] if frugal["status"] == "ok" else float("nan")
        print(
            f"the space's most frugal config (the full stack): --max-seq {frugal['seq_len']:,} "
            f"({frugal['status']}, {frugal['_seconds']:.0f} s); the front reaches {reach:.1%} of it "
            f"(goal >= {GOAL_FRACTION:.0%})"
        )
        ok &= reach >= GOAL_FRACTION
        best = _estimate(args.autotune, best_path, env, max_seq=False)
        from autotune.core.sizes import format_duration  # the repo's, on sys.path since _frugal_techniques

        print(
            f"best.json: {template['seq_len']:,} tokens at {template['predicted']['tokens_per_s']:,.0f} tokens/s; "
            f"autotune estimate says {best['status']} (peak {best['peak_device_bytes'] / 2**30:.1f} GiB, "
            f"host {(best['host_bytes'] or 0) / 2**30:.1f} GiB, per GPU; {format_duration(best['step_time_s'])} a step)"
        )
        ok &= template["seq_len"] >= TARGET_TOKENS and best["status"] == "ok"
        print(f"autotune estimate --config best.json took {best['_seconds']:.1f} s (goal <= {GOAL_ESTIMATE_S:.0f} s)")
        ok &= best["_seconds"] <= GOAL_ESTIMATE_S
    warm = wall
    if args.cold:  # the same search again on the store the cold one filled: what every later run costs
        again, warm = _run(command[:-1] + [str(scratch / "again")], env)
        if again.returncode not in (0, 1):
            raise SystemExit(f"the warm search failed with exit code {again.returncode}:\n{again.stderr[-3000:]}")
        print(f"the same search again, warm (its plan records stored), in a fresh out dir: {warm:.1f} s")
    ok &= warm <= GOAL_WALL_S
    print(f"goals {'met' if ok else 'NOT met'}")
    print(f"main job wall time: {wall:.1f} s{' (empty plan store)' if args.cold else ''}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
