"""Is a front point or best.json beaten by a config one knob away? Over several nodes, does the search reach the
longest ``--max-seq`` of the layouts the world admits?

For each search (the main job; packed documents, ``--documents 64K --target 1M``; two nodes, ``--target 14M``):
``autotune search`` as a user runs it (a fresh process, the plan backend, its polish on), then every front point
and best.json's config compared with each of its one-knob neighbours *either way* (``SearchSpace.neighbours``:
the search itself only tries those that can run faster) at the same length, through the plan backend (the on-disk
store answers what the search evaluated). A point is beaten when a neighbour fits there and runs more than 2%
faster (best.json: at the target). For the multi-node search, each admitted layout's most frugal config
(``SearchSpace.layouts``, ``frugal``) is taken to its ``--max-seq`` and compared with the front's longest point.
The last line is the number of points beaten over all searches (goal: 0).

    .venv/bin/python bench/front_optimality.py | tee bench/results/front_optimality.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune.core.evaluation import Evaluation  # noqa: E402
from autotune.core.sizes import parse_tokens  # noqa: E402
from autotune.search.front import BEST_SPEED_TOLERANCE, asked_of, best_point, front_points  # noqa: E402
from autotune.search.max_seq import find_max_seq  # noqa: E402
from autotune.search.parallel import plan_workers  # noqa: E402
from autotune.search.policy import infer_record, seed_kernel  # noqa: E402
from autotune.search.polish import evaluation_at  # noqa: E402
from autotune.search.request import SearchRequest, prepare_search  # noqa: E402
from trials.stack.techniques import Techniques  # noqa: E402

SEARCHES = {  # label -> autotune search's options (the model, the target, the rest)
    "main job": ["--model", "llama3-8b", "--target", "5M"],
    "packed documents": ["--model", "llama3-8b", "--target", "1M", "--documents", "64K"],
    "2 nodes": ["--model", "llama3-8b", "--target", "14M", "--nodes", "2", "--gpus", "8"],
}


def _option(args: list[str], name: str, default=None):
    return args[args.index(name) + 1] if name in args else default


def run_search(args: list[str], out: Path) -> tuple[int, float]:
    env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_POLISH"}
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "search", *args, "--backend", "plan", "--out", str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**env, "PYTHONPATH": str(ROOT)},
    )
    return done.returncode, time.perf_counter() - started


def prepared(args: list[str], out: Path):
    request = SearchRequest(
        model=_option(args, "--model"),
        target=parse_tokens(_option(args, "--target"), "--target"),
        gpus=int(_option(args, "--gpus", 8)),
        nodes=int(_option(args, "--nodes", 1)),
        backend="plan",
        out=out,
        documents=_option(args, "--documents"),
    )
    search = prepare_search(request)
    return search.job, search.study


def _changes(before: Techniques, after: Techniques) -> str:
    a, b = before.to_dict(), after.to_dict()
    return ", ".join(f"{k} {a[k]} -> {b[k]}" for k in a if a[k] != b[k])


def compare(job, study) -> tuple[list[str], int, int]:
    """(lines of the points beaten, points compared, neighbours evaluated)."""
    layers = job.model_config["num_hidden_layers"]
    points = [
        (f"front trial {p.number}", Techniques.from_dict(asked_of(p.trial), layers), int(p.values[0]), p.values[1])
        for p in front_points(study, verified=False)
    ]
    best = best_point(study, job.target)
    if best is not None:
        points.append((f"best.json (trial {best.number})", Techniques.from_dict(asked_of(best.trial), layers),
                       job.target, best.tokens_per_s))  # fmt: skip
    todo: list[tuple[int, Techniques, Evaluation]] = []
    for index, (_, config, length, _) in enumerate(points):
        for neighbour in job.space.neighbours(config, layers):
            evaluation = evaluation_at(job, neighbour, length)
            if evaluation is not None and infer_record(study, evaluation.techniques, length) is None:
                todo.append((index, neighbour, evaluation))
    evaluations = [evaluation for _, _, evaluation in todo]

    def lookahead(current: Evaluation):
        return evaluations[evaluations.index(current) + 1 :], []

    beaten = []
    with plan_workers(job, study, lookahead=lookahead):
        for index, neighbour, evaluation in todo:
            record = job.backend.evaluate(evaluation)
            label, config, length, rate = points[index]
            if record.status == "ok" and (record.tokens_per_s or 0.0) > rate * (1 + BEST_SPEED_TOLERANCE):
                beaten.append(
                    f"  {label} at {length:,} tokens, {rate:,.0f} tokens/s: beaten by {_changes(config, neighbour)} "
                    f"({record.tokens_per_s:,.0f} tokens/s, peak {record.peak_device_bytes / 2**30:.1f} GiB)"
                )
    return beaten, len(points), len(todo)


def layouts(job, study) -> list[str]:
    """Each admitted layout's most frugal config at its --max-seq, and the front's longest point against them."""
    layers = job.model_config["num_hidden_layers"]
    lines, walls = [], []
    for layout in job.space.layouts(job.world_size, job.gpus):
        frugal = dataclasses.replace(job.space.frugal(layers, layout), attention=seed_kernel(job))
        evaluation = Evaluation(job.model_config, frugal, job.target, job.gpus, job.hardware, job.nodes)
        record = find_max_seq(evaluation)
        walls.append(record.seq_len if record.status == "ok" else 0)
        lines.append(f"  Ulysses {layout[0]} x ring {layout[1]}: --max-seq {walls[-1]:,} ({record.status})")
    longest = int(front_points(study, verified=False)[0].values[0])
    if walls:
        lines.append(
            f"  the front's longest point: {longest:,} tokens, {longest / max(walls):.1%} of the longest layout's"
        )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=list(SEARCHES), action="append", help="run these searches only")
    options = parser.parse_args()
    total = 0
    with tempfile.TemporaryDirectory() as tmp:
        for label, args in SEARCHES.items():
            if options.only and label not in options.only:
                continue
            out = Path(tmp) / label.replace(" ", "-")
            code, seconds = run_search(args, out)
            print(f"{label}: autotune search {' '.join(args)}: exit {code} in {seconds:.0f} s", flush=True)
            if code != 0:
                continue
            job, study = prepared(args, out)
            beaten, compared, evaluated = compare(job, study)
            print(f"  {compared} points (front and best.json), {evaluated} neighbours evaluated: {len(beaten)} beaten")
            print("\n".join(beaten)) if beaten else None
            total += len(beaten)
            if job.nodes > 1:
                print("\n".join(layouts(job, study)), flush=True)
    print(f"points beaten by more than {BEST_SPEED_TOLERANCE:.0%} by a fitting one-knob neighbour (goal 0): {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
