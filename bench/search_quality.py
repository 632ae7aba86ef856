"""How good is the search with a tenth of the evaluations? (issue 6)

1. Exhaustive: every (config, seq_len) of search_spaces/reduced-tiny.yaml through the plan backend
   (tiny-llama, 2 ranks, the cpu preset at 0.5 GiB per rank), no inference: the true Pareto front.
2. Search: ``autotune.search`` on the same space with a budget of 10% of the grid's evaluations.
   Prints both fronts' hypervolumes (objectives: log2 seq_len and tokens/s, reference point at the
   grid's shortest length / 0 tokens/s), their ratio, and how many evaluations pruning answered without
   running the backend.
3. With ``--local``: a real local search on CPU (tiny-llama, 2 ranks, 1 GiB, 10 trials, oracle prefilter on)
   and the fraction of real trial time spent in trials that ended OOM.

    .venv/bin/python bench/search_quality.py [--local]      # last line: the hypervolume ratio
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autotune import search  # noqa: E402
from autotune.backends import Evaluation  # noqa: E402
from autotune.backends.plan import PlanBackend  # noqa: E402
from autotune.config import Techniques  # noqa: E402
from autotune.presets import load_hardware, load_model_config  # noqa: E402
from autotune.space import load_space  # noqa: E402

SPACE = ROOT / "search_spaces" / "reduced-tiny.yaml"
MODEL, GPUS, TARGET, MEMORY_GIB = "tiny-llama", 2, 8192, 0.5


def grid_configs(space, layers: int) -> list[Techniques]:
    c = space.choices
    configs = []
    for fsdp, degree, ckpt, mlp, loss in itertools.product(c["fsdp"], c["ulysses_degree"],
                                                           c["activation_checkpointing"], c["mlp_tile_tokens"],
                                                           c["loss_tile_tokens"]):
        for chunk in (space.head_chunks(degree) if degree > 1 else [None]):
            configs.append(Techniques(fsdp=fsdp, ulysses_degree=degree, head_chunk=chunk, activation_checkpointing=ckpt,
                                      mlp_tile_tokens=mlp, loss_tile_tokens=loss, attention=c["attention"][0]))
    return configs


def front(points: list[tuple[int, float]]) -> list[tuple[int, float]]:
    return sorted(p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points))


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


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--local", action="store_true", help="also measure OOM time in a real local search")
    args = parser.parse_args()
    model_config = load_model_config(MODEL)
    hardware = load_hardware("cpu").with_memory_gib(MEMORY_GIB)
    space = load_space(SPACE, model_config, GPUS, TARGET, flash_ok=False)
    backend = PlanBackend()
    configs = grid_configs(space, model_config["num_hidden_layers"])
    grid = [(t, s) for t in configs for s in space.seq_lens if s % t.ulysses_degree == 0]
    started = time.perf_counter()
    fits = []
    for techniques, seq_len in grid:
        record = backend.evaluate(Evaluation(model_config, techniques, seq_len, GPUS, hardware))
        if record.status == "ok" and record.tokens_per_s:
            fits.append((seq_len, record.tokens_per_s))
    grid_s = time.perf_counter() - started
    budget = max(1, round(0.1 * len(grid)))
    with tempfile.TemporaryDirectory() as tmp:
        job = search.SearchJob(model=MODEL, model_config=model_config, target=TARGET, gpus=GPUS, hardware=hardware,
                               space=space, backend=PlanBackend(), out=Path(tmp), trials=budget, seed=0)
        started = time.perf_counter()
        study = search.run(job)
        search_s = time.perf_counter() - started
        found = [(int(t.values[0]), t.values[1]) for t in search.pareto_front(study)]
        answered = dict(job.avoided)
    hv_grid = hypervolume(fits, space.seq_lens[0])
    hv_search = hypervolume(found, space.seq_lens[0])
    print(f"space: {SPACE.name}, {MODEL} on {GPUS}x cpu at {MEMORY_GIB} GiB, {len(configs)} configs x "
          f"{len(space.seq_lens)} lengths")
    print(f"exhaustive grid: {len(grid)} plan evaluations in {grid_s:.0f} s, {len(fits)} fit, "
          f"front {front(fits)}")
    print(f"search:          {budget} trials (10%) in {search_s:.0f} s, front {sorted(found)}")
    print(f"evaluations answered without the backend: {sum(answered.values())} "
          f"(cache {answered['cache']}, monotone {answered['monotone']}, oracle {answered['oracle']})")
    if args.local:
        local_oom_fraction()
    print(f"hypervolume ratio (search / exhaustive, goal >= 0.95): {hv_search / hv_grid:.3f}")
    return 0


def local_oom_fraction() -> None:
    import subprocess

    import optuna

    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "autotune.cli", "search", "--model", MODEL, "--target", "4K",
                        "--gpus", "2", "--backend", "local", "--memory-gib", "1", "--trials", "10", "--out", tmp,
                        "--json"], cwd=ROOT, check=False, capture_output=True)
        storage = f"sqlite:///{tmp}/study.db"
        study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
        real = [t for t in study.trials if t.user_attrs.get("answered_by") == "local" and t.datetime_complete]
        seconds = {t.number: (t.datetime_complete - t.datetime_start).total_seconds() for t in real}
        oom_s = sum(s for n, s in seconds.items() if study.trials[n].user_attrs["record"]["status"] == "oom")
        skipped = sum(1 for t in study.trials if t.user_attrs.get("answered_by") in ("oracle", "monotone"))
        print(f"local search: {len(real)} real trials, {sum(seconds.values()):.0f} s; {oom_s:.0f} s in trials that "
              f"ended OOM = {oom_s / max(sum(seconds.values()), 1e-9):.1%} (goal <= 10%); "
              f"{skipped} OOMs answered without a real trial")


if __name__ == "__main__":
    sys.exit(main())
