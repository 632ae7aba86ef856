"""Does glibc's malloc cost a CPU trial time the time model does not price? One training step per kind of work,
with glibc's default malloc and with the settings CPU trials now run under (``trials.allocator.HOST_MALLOC_TUNABLES``:
freed memory is kept, as CUDA's caching allocator keeps it), side by side.

By default glibc gives every block above its mmap threshold (dynamic, at most 32 MiB) its own mapping and unmaps it
on free, and trims the heap's free top: a long step's large activations are mapped afresh and page-faulted in at
every step, inside the kernels that first write them. The calibration's in-step step (2,048 tokens) stays under
the threshold, so its rates never see that cost.

Each case runs in a fresh process (glibc reads its tunables at start-up) for each setting, alternately, over
``--rounds`` rounds, so the host's drift moves both alike. A process builds the step as ``bench/rates_vs_length.py``
does (``trials.step.train_step`` under the trials' memory tracker, every kernel timed by the calibration's kernel
timer), warms it up, and reports the median of ``--samples`` (kernels by kind, wall) pairs and its peak RSS.
Prints, per case, seconds per kind with each setting and their ratio (kept / default: below 1 is faster with the
memory kept), the spread over rounds of the step's ratio, and the peak RSS of each; the figure last.

    .venv/bin/python bench/cpu_malloc.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

CASES = [  # (model, tokens, techniques): the calibration's scale, then long plain and checkpointed steps
    ("tiny-llama", 2048, {}),
    ("tiny-llama", 8192, {}),
    ("tiny-llama", 8192, {"activation_checkpointing": True}),
    ("tiny-qwen3", 6144, {}),
]
KINDS = ("matmul", "attention", "elementwise", "overhead", "wall")


def worker(model: str, tokens: int, techniques: dict, samples: int) -> dict:
    import torch

    import rates_vs_length as split  # the bench beside this one
    from autotune.timing.calibration.microbench import _kernel_timer

    torch.manual_seed(0)
    training = split.build(model, tokens, techniques)
    timer = _kernel_timer(training[4])
    split.measured_by_kind(training, timer)  # warm-up
    got = [split.measured_by_kind(training, timer) for _ in range(samples)]
    out = {kind: statistics.median(g[kind] for g in got) for kind in KINDS}
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def run_case(case: tuple, kept: bool, samples: int) -> dict:
    from trials import allocator

    model, tokens, techniques = case
    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count() or 1))
    env.pop("GLIBC_TUNABLES", None)
    if kept:
        env = allocator.trial_environment(env, cpu=True)
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps([model, tokens, techniques, samples])],
                          env=env, capture_output=True, text=True, timeout=1200)
    if proc.returncode:
        raise SystemExit(f"worker failed for {case}: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def name(case: tuple) -> str:
    model, tokens, techniques = case
    return f"{model} {tokens // 1024}K {'ckpt' if techniques.get('activation_checkpointing') else 'plain'}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2, help="(kernels, wall) pairs per process")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        model, tokens, techniques, samples = json.loads(args.worker)
        print(json.dumps(worker(model, tokens, techniques, samples)))
        return 0

    from trials.allocator import HOST_MALLOC_TUNABLES

    started = time.time()
    results = {(i, kept): [] for i in range(len(CASES)) for kept in (False, True)}
    for round_ in range(args.rounds):
        for i, case in enumerate(CASES):
            for kept in ((False, True) if round_ % 2 == 0 else (True, False)):  # alternate which goes first
                results[(i, kept)].append(run_case(case, kept, args.samples))
        print(f"round {round_ + 1}/{args.rounds} done ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)

    tunables = ":".join(f"{k}={v}" for k, v in HOST_MALLOC_TUNABLES.items())
    lines = [f"# seconds per kind of one training step, 1 rank x {os.cpu_count()} threads, median over {args.rounds} "
             f"rounds of the median of {args.samples} steps per process: default malloc -> memory kept "
             f"(GLIBC_TUNABLES={tunables}) = kept / default",
             f"{'case':24s} " + " ".join(f"{k:>22}" for k in KINDS) + f" {'step ratio per round':>24} {'peak RSS GB':>14}"]
    step_ratios = []
    for i, case in enumerate(CASES):
        default, kept = results[(i, False)], results[(i, True)]
        cells = []
        for kind in KINDS:
            d = statistics.median(r[kind] for r in default)
            k = statistics.median(r[kind] for r in kept)
            cells.append(f"{d:7.3f}->{k:6.3f}={k / d:5.2f}" if abs(d) > 1e-3 else f"{d:7.3f}->{k:6.3f}=  n/a")
        per_round = [k["wall"] / d["wall"] for d, k in zip(default, kept)]
        step_ratios.append(statistics.median(per_round))
        rss = (f"{statistics.median(r['peak_rss_bytes'] for r in default) / 1e9:5.2f}->"
               f"{statistics.median(r['peak_rss_bytes'] for r in kept) / 1e9:5.2f}")
        lines.append(f"{name(case):24s} " + " ".join(f"{c:>22}" for c in cells)
                     + f" {' '.join(f'{x:.2f}' for x in per_round):>24} {rss:>14}")
    lines.append(f"# took {time.time() - started:.0f} s")
    lines.append("step time with the memory kept / default, per case: "
                 + ", ".join(f"{name(c)} {r:.2f}" for c, r in zip(CASES, step_ratios)))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
