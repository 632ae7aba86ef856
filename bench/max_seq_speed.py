"""``autotune estimate --max-seq`` of the full stack, cold, by the length model and by the grid probes alone, back to
back: each a fresh ``autotune`` process with an empty plan store of its own (``AUTOTUNE_CACHE_DIR`` in a temp dir).

    .venv/bin/python bench/max_seq_speed.py                         # llama3-8b on 8x h100-sxm, the default space's
                                                                   # most frugal config (the full stack)
    .venv/bin/python bench/max_seq_speed.py --model tiny-llama --gpus 2 --hardware cpu --memory-gib 0.47

Each line gives the wall time and the CPU time of the process (on a shared machine the wall follows the load; the
CPU time much less), how many lengths the backend evaluated and the answer. The answers must be equal record for
record (``--json`` without ``max_seq_search``); the last lines say whether they are and the ratio of the times.
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


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _frugal_techniques(model: str, gpus: int) -> dict:
    """The default search space's most memory-frugal config for ``model`` on ``gpus`` (``SearchSpace.frugal``)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from autotune.search.space import load_space
    from trials.models.config import load_model_config

    model_config = load_model_config(model)
    space = load_space(None, model_config, gpus, 1024**2)
    return space.frugal(model_config["num_hidden_layers"]).to_dict()


def _max_seq(autotune: str, config: Path, extra: list[str], scratch: Path, name: str) -> dict:
    env = dict(os.environ, AUTOTUNE_CACHE_DIR=str(scratch / f"cache-{name}"))
    command = [autotune, "estimate", "--config", str(config), "--max-seq", "--json", *extra]
    cpu, started = _children_cpu_s(), time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    wall, cpu = time.perf_counter() - started, _children_cpu_s() - cpu
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    record = json.loads(done.stdout)
    how = record.pop("max_seq_search")
    traced = f"{len(how['lengths'])} lengths evaluated" + (
        f" + {len(how['model_lengths'])} model traces" if how["model_lengths"] else ""
    )
    print(
        f"{name:<13} {wall:7.1f} s wall {cpu:7.1f} s CPU  {traced:<40} --max-seq {record['seq_len']:,} "
        f"({record['status']}, by {how['method']}{'; ' + how['reason'] if how['reason'] else ''})",
        flush=True,
    )
    return {"record": record, "wall": wall, "cpu": cpu}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--autotune", default=str(Path(sys.executable).parent / "autotune"))
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--memory-gib", default=None)
    parser.add_argument("--seq", type=int, default=1024**2, help="the config's length: the probes' first guess")
    args = parser.parse_args(argv)

    scratch = Path(tempfile.mkdtemp(prefix="max_seq_speed-"))
    techniques = _frugal_techniques(args.model, args.gpus)
    config = scratch / "full-stack.json"
    config.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": args.model,
                "hardware": args.hardware,
                "gpus": args.gpus,
                "seq_len": args.seq,
                "techniques": techniques,
            }
        )
    )
    extra = ["--memory-gib", args.memory_gib] if args.memory_gib else []
    print(f"$ autotune estimate --config full-stack.json --max-seq   (empty plan store each; {args.model})")
    print(f"full stack: {json.dumps(techniques, sort_keys=True)}")
    one, five, _ = os.getloadavg()
    print(f"load {one:.2f} {five:.2f} on {os.cpu_count()} cores")
    model = _max_seq(args.autotune, config, extra, scratch, "length model")
    probes = _max_seq(args.autotune, config, extra + ["--probes-only"], scratch, "probes")
    equal = model["record"] == probes["record"]
    print(f"answers equal (whole record): {'yes' if equal else 'NO'}")
    print(
        f"length model / probes: {model['wall'] / probes['wall']:.2f}x the wall, "
        f"{model['cpu'] / probes['cpu']:.2f}x the CPU time"
    )
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
