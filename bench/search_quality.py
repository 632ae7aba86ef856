"""How good is the search with a tenth of the evaluations?

1. Exhaustive: every (config, seq_len) of search_spaces/reduced-tiny.yaml through the plan backend
   (tiny-llama, 2 ranks, the cpu preset at 0.5 GiB per rank), no inference: the true Pareto front. The grid
   runs on every core and is cached under ~/.cache/autotune keyed by a digest of the code, presets, space and
   cpu calibration (``--no-cache`` re-evaluates it).
2. Search: ``autotune.search.run`` on the same space with a budget of 10% of the grid's evaluations (trials),
   as ``autotune search`` runs it (plan backend stopping at capacity), side by side with the same search
   without follow-ups (TPE alone, with the seeds and inference). Prints each front's hypervolume ratio to the
   exhaustive front (objectives: log2 seq_len and tokens/s, reference point one doubling below the grid's
   shortest length and 0 tokens/s) and how many trials were answered without the backend.

    .venv/bin/python bench/search_quality.py | tee bench/results/search_quality.txt   # last line: the hypervolume ratio
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune import search
from autotune.backends import Evaluation
from autotune.backends.plan import PlanBackend
from autotune.backends.plan_store import PlanStore
from autotune.core.hardware import load_hardware
from autotune.search.space import (
    SPACES_DIR,
    WALL_PARAM,
    load_space,
)
from autotune.timing import calibration as calibrate
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

SPACE = SPACES_DIR / "reduced-tiny.yaml"
MODEL, GPUS, TARGET, MEMORY_GIB = "tiny-llama", 2, 8192, 0.5


def grid_configs(space, layers: int) -> list[Techniques]:
    c = space.choices
    configs = []
    for fsdp, degree, ckpt, mlp, loss in itertools.product(
        c["fsdp"], c["ulysses_degree"], c["activation_checkpointing"], c["mlp_tile_tokens"], c["loss_tile_tokens"]
    ):
        for chunk in space.head_chunks(degree) if degree > 1 else [None]:
            configs.append(
                Techniques(
                    fsdp=fsdp,
                    ulysses_degree=degree,
                    head_chunk=chunk,
                    activation_checkpointing=ckpt,
                    mlp_tile_tokens=mlp,
                    loss_tile_tokens=loss,
                    attention=c["attention"][0],
                )
            )
    return configs


def front(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return sorted({p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)})


def hypervolume(points: list[tuple[int, float]], min_seq: int) -> float:
    """2-D hypervolume of (log2 seq_len, tokens/s), reference (log2 min_seq - 1, 0)."""
    ref = math.log2(min_seq) - 1
    area, best_rate = 0.0, 0.0
    for seq, rate in sorted(front(points), key=lambda p: -p[0]):  # longest first
        x = math.log2(seq) - ref
        if rate > best_rate:
            area += x * (rate - best_rate)
            best_rate = rate
    return area


def code_digest() -> str:
    """Hash of everything a plan record depends on: the code, presets and this space (the grid cache key)."""
    digest = hashlib.sha256(f"{MODEL} {GPUS} {TARGET} {MEMORY_GIB}".encode())
    digest.update(json.dumps(calibrate.load_or_calibrate(), sort_keys=True).encode())  # the cpu preset's rates
    files = sorted(
        [
            *(ROOT / "autotune").rglob("*.py"),
            *(ROOT / "autotune").rglob("*.yaml"),
            *(ROOT / "trials").rglob("*.py"),
            SPACE,
        ]
    )
    for path in files:
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def _evaluate_point(args) -> dict:
    model_config, techniques, seq_len, hardware = args
    record = PlanBackend().evaluate(Evaluation(model_config, techniques, seq_len, GPUS, hardware))
    return {
        "techniques": techniques.to_dict(),
        "seq_len": seq_len,
        "status": record.status,
        "tokens_per_s": record.tokens_per_s,
        "peak_device_bytes": record.peak_device_bytes,
    }


def exhaustive(grid, model_config, hardware, workers: int, use_cache: bool = True) -> tuple[list[dict], float, bool]:
    """Every grid point through the plan backend (full traces), cached under ~/.cache/autotune by code digest:
    the grid takes ~20 CPU-minutes and only changes when the code does."""
    cache = (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "autotune"
        / f"search_quality_grid-{code_digest()}.json"
    )
    if use_cache and cache.is_file():
        data = json.loads(cache.read_text())
        return data["records"], data["seconds"], True
    started = time.perf_counter()
    jobs = [(model_config, techniques, seq_len, hardware) for techniques, seq_len in grid]
    if workers > 1:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            records = pool.map(_evaluate_point, jobs, chunksize=1)
    else:
        records = [_evaluate_point(job) for job in jobs]
    seconds = time.perf_counter() - started
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps({"records": records, "seconds": seconds}))
    return records, seconds, False


def run_search(model_config, hardware, space, budget: int, follow_ups: bool) -> dict:
    """The product's search (``autotune.search.run``, plan backend stopping traces at capacity as the CLI does, on
    a worker per core), with an empty plan store of its own: its time is the work, not what earlier runs kept."""
    with tempfile.TemporaryDirectory() as tmp:
        backend = PlanBackend(stop_above=1.0, store=PlanStore(Path(tmp) / "plan"))
        job = search.SearchJob(
            model=MODEL,
            model_config=model_config,
            target=TARGET,
            gpus=GPUS,
            hardware=hardware,
            space=space,
            backend=backend,
            out=Path(tmp),
            trials=budget,
            seed=0,
            follow_ups=follow_ups,
        )
        started = time.perf_counter()
        study = search.run(job)
        trials = search.finished_trials(study)
        return {
            "seconds": time.perf_counter() - started,
            "front": sorted((int(t.values[0]), t.values[1]) for t in search.pareto_front(study)),
            "avoided": dict(job.avoided),
            "trials": len(trials),
            "stopped": sum(1 for t in trials if "trace stopped" in (t.user_attrs["record"].get("error") or "")),
            "follow_ups": sum(1 for t in trials if "follow_up_of" in t.user_attrs),
            "walls": sum(1 for t in trials if WALL_PARAM in t.params),
            "workers": job.stats.get("workers", 1),
        }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes for the exhaustive grid")
    parser.add_argument("--no-cache", action="store_true", help="re-evaluate the grid even if a cached copy matches")
    args = parser.parse_args()
    calibrate.load_or_calibrate()  # here, once: grid workers must not each calibrate (and time each other)
    model_config = load_model_config(MODEL)
    hardware = load_hardware("cpu").with_memory_gib(MEMORY_GIB)
    space = load_space(SPACE, model_config, GPUS, TARGET, kernels=["sdpa"])
    configs = grid_configs(space, model_config["num_hidden_layers"])
    grid = [(t, s) for t in configs for s in space.seq_lens if s % t.ulysses_degree == 0]
    records, grid_s, cached = exhaustive(grid, model_config, hardware, args.workers, use_cache=not args.no_cache)
    fits = [(r["seq_len"], r["tokens_per_s"]) for r in records if r["status"] == "ok" and r["tokens_per_s"]]
    budget = max(1, round(0.1 * len(grid)))
    hv_grid = hypervolume(fits, space.seq_lens[0])
    print(
        f"space: {SPACE.name}, {MODEL} on {GPUS}x cpu at {MEMORY_GIB} GiB, {len(configs)} configs x "
        f"{len(space.seq_lens)} lengths"
    )
    print(
        f"exhaustive grid: {len(grid)} plan evaluations in {grid_s:.0f} s{' (cached)' if cached else ''}, "
        f"{len(fits)} fit, front:"
    )
    print("    " + ", ".join(f"{seq:,} @ {rate:,.0f}" for seq, rate in front(fits)))
    results = {}
    for name, follow in (("TPE alone", False), ("search", True)):
        result = results[name] = run_search(model_config, hardware, space, budget, follow)
        avoided = result["avoided"]
        print(
            f"{name + ':':11s}{budget} trials (10%) in {result['seconds']:.0f} s on {result['workers']} worker(s), "
            f"{result['follow_ups']} of them follow-ups ({result['walls']} wall steps); "
            f"{avoided['cache'] + avoided['monotone']} answered from the study (cache "
            f"{avoided['cache']}, monotone {avoided['monotone']}), {avoided.get('follow_up_inferred', 0)} "
            f"follow-ups never queued (monotone), {result['stopped']} OOMs cut short at capacity; hypervolume ratio {hypervolume(result['front'], space.seq_lens[0]) / hv_grid:.3f}; front:"
        )
        print("    " + ", ".join(f"{seq:,} @ {rate:,.0f}" for seq, rate in result["front"]))
    ratio = hypervolume(results["search"]["front"], space.seq_lens[0]) / hv_grid
    print(f"hypervolume ratio (search / exhaustive, goal >= 0.95): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
