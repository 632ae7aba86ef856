"""How far LoRA adapters reach beside full training: ``autotune estimate --max-seq`` of the same stack, with and
without ``--lora-rank``, on one and on eight GPUs (the plan backend: predictions, not measurements).

    .venv/bin/python bench/lora_reach.py | tee bench/results/lora_reach.txt
    .venv/bin/python bench/lora_reach.py --model tiny-llama --hardware cpu --gpus 1 --memory-gib 0.5   # a quick look

The stack on each world is the default search space's most memory-frugal config (``SearchSpace.frugal``: FSDP with
optimizer offload, Ulysses over every GPU, head chunks of one, checkpointing with every layer's input offloaded,
tiled MLP, loss and RMSNorm), the same for both workloads, so the rows differ only by what the frozen base saves: its
gradients, its AdamW states (on the host, with optimizer offload) and its weight-gradient GEMMs. Each row: the
longest length that fits, the peak per GPU on the device and on the host against the preset's capacities (which one
binds), and tokens/s at that length. A search (``autotune search --lora-rank``) may find a faster stack for the
adapters; this bench holds the stack fixed to show what the adapters alone move.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GIB = 2**30


def _frugal(model: str, gpus: int, hw) -> dict:
    from autotune.search.request import search_kernels
    from autotune.search.space import load_space
    from trials.models.config import load_model_config

    model_config = load_model_config(model)
    kernels = search_kernels("plan", hw)  # the preset's kernels, as a plan search weighs them
    space = load_space(None, model_config, gpus, 1024**2, on_gpu=not hw.device_is_host, kernels=kernels)
    return space.frugal(model_config["num_hidden_layers"]).to_dict()


def _max_seq(config: Path, extra: list[str]) -> tuple[dict, float]:
    command = [str(ROOT / ".venv" / "bin" / "autotune"), "estimate", "--config", str(config), "--max-seq", "--json"]
    started = time.perf_counter()
    done = subprocess.run([*command, *extra], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command + extra)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout), time.perf_counter() - started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--gpus", default="1,8", help="GPU counts, comma-separated (one node each)")
    parser.add_argument("--rank", type=int, default=16, help="the LoRA rank (alpha twice it, every linear layer)")
    parser.add_argument("--memory-gib", type=float, default=None)
    args = parser.parse_args(argv)
    from autotune.core.hardware import load_hardware

    hw = load_hardware(args.hardware).with_memory_gib(args.memory_gib)
    device_cap, host_cap = hw.device_memory_bytes, hw.host_memory_bytes_per_device
    memory = ["--memory-gib", str(args.memory_gib)] if args.memory_gib else []
    print(
        f"{args.model} on {args.hardware}: device {device_cap / GIB:.2f} GiB and host {host_cap / GIB:.1f} GiB per GPU; "
        f"LoRA rank {args.rank} (alpha {2 * args.rank}) on every linear layer"
    )
    print(
        f"{'GPUs':>4}  {'training':<12} {'longest':>11} {'device GiB':>10} {'host GiB':>9} {'binds':<7} {'tokens/s':>9}"
    )
    reach = {}
    with tempfile.TemporaryDirectory() as scratch:
        for gpus in (int(g) for g in args.gpus.split(",")):
            config = Path(scratch) / f"frugal-{gpus}.json"
            techniques = _frugal(args.model, gpus, hw)
            doc = {
                "schema": "autotune/config-v1",
                "model": args.model,
                "hardware": args.hardware,
                "gpus": gpus,
                "seq_len": None,
                "techniques": techniques,
                "predicted": None,
                "measured": None,
            }
            config.write_text(json.dumps(doc))
            knobs = ", ".join(f"{k}={v}" for k, v in techniques.items() if v not in (0, None, False))
            print(f"{gpus:>4}  the stack: {knobs}")
            for name, extra in (("full", []), (f"LoRA r{args.rank}", ["--lora-rank", str(args.rank)])):
                record, _ = _max_seq(config, [*extra, *memory])
                device, host = record["peak_device_bytes"], record["host_bytes"] or 0
                binds = "host" if host_cap and host / host_cap > device / device_cap else "device"
                reach[(gpus, name)] = record["seq_len"]
                print(
                    f"{gpus:>4}  {name:<12} {record['seq_len']:>11,} {device / GIB:>10.2f} {host / GIB:>9.1f} "
                    f"{binds:<7} {record['tokens_per_s']:>9,.0f}"
                    + ("" if record["status"] == "ok" else f"  ({record['status']})"),
                    flush=True,
                )
    gains = [
        f"{g} GPU{'s' if g > 1 else ''} {reach[(g, n)] / reach[(g, 'full')]:.2f}x" for (g, n) in reach if n != "full"
    ]
    print(f"longest length with LoRA against full training, the same stack: {', '.join(gains)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
