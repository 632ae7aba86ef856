"""How much real trial time a local search spends in trials that end out of memory (issue 6: goal <= 10%).

    .venv/bin/python bench/local_oom_time.py [--trials 12] [--target 8K] [--memory-gib 1] [--no-prefilter]
        | tee bench/results/local_oom_time.txt

Runs ``autotune search --backend local`` on this CPU machine (tiny-llama, 2 gloo ranks, a tracked per-rank
capacity of ``--memory-gib``), the way a GPU node runs it: every candidate first goes through the oracle
prefilter (a clear predicted OOM never launches), then monotone inference (an OOM at L answers every length
above L for the same config), then a real trial, which aborts at the first allocation over capacity. Prints
each trial (how it was answered, its status, its wall time) and, last, the fraction of real-trial wall time
spent in trials that ended OOM. ``--no-prefilter`` shows what the oracle saves (the same search without it).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-llama")
    parser.add_argument("--target", default="8K")
    parser.add_argument("--gpus", default="2")
    parser.add_argument("--memory-gib", default="1")
    parser.add_argument("--trials", default="12")
    parser.add_argument("--no-prefilter", action="store_true")
    args = parser.parse_args(argv)

    import optuna

    with tempfile.TemporaryDirectory() as tmp:
        command = [sys.executable, "-m", "autotune.cli", "search", "--model", args.model, "--target", args.target,
                   "--gpus", args.gpus, "--backend", "local", "--memory-gib", args.memory_gib,
                   "--trials", args.trials, "--out", tmp, "--json"]
        if args.no_prefilter:
            command.append("--no-prefilter")
        print("# " + " ".join(["autotune"] + command[3:-3] + ["--out", "TMP", "--json"]), flush=True)
        started = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
        wall = time.perf_counter() - started
        if done.returncode not in (0, 1):  # 1: no config reached the target, still a finished search
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        storage = f"sqlite:///{tmp}/study.db"
        study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
        finished = [t for t in study.trials if "record" in t.user_attrs and t.datetime_complete]
        print(f"{'trial':>5} {'answered by':<11} {'seq_len':>8} {'status':<7} {'wall s':>7}  config")
        real_s = oom_s = 0.0
        for t in finished:
            how, record = t.user_attrs.get("answered_by"), t.user_attrs["record"]
            seconds = (t.datetime_complete - t.datetime_start).total_seconds()
            if how == "local":
                real_s += seconds
                oom_s += seconds if record["status"] == "oom" else 0.0
            knobs = {k: v for k, v in t.user_attrs["techniques"].items() if v not in (False, 0, None, "sdpa")}
            print(f"{t.number:>5} {how:<11} {record['seq_len']:>8} {record['status']:<7} {seconds:7.1f}  {knobs}")
        counts = {how: sum(1 for t in finished if t.user_attrs.get("answered_by") == how)
                  for how in ("local", "oracle", "monotone", "cache")}
        real_ooms = sum(1 for t in finished if t.user_attrs.get("answered_by") == "local"
                        and t.user_attrs["record"]["status"] == "oom")
        print(f"# search wall {wall:.0f} s; real trials {counts['local']} ({real_ooms} ended OOM), answered without "
              f"running: oracle {counts['oracle']}, monotone {counts['monotone']}, cache {counts['cache']}")
        print(f"OOM share of real trial time: {oom_s:.0f} s of {real_s:.0f} s = {oom_s / max(real_s, 1e-9):.3f} "
              f"(goal <= 0.10)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
