"""Ablation: the longest sequence Llama-3-8B trains on with 8x H100 80 GB, one technique added per row.

    .venv/bin/python bench/ablation.py [--model llama3-8b] [--hardware h100-sxm] [--gpus 8] [--explain]
        | tee bench/results/ablation.txt

Every row is the plan backend's ``find_max_seq`` (memory oracle: the trial's own code under FakeTensorMode,
bf16 compute with fp32 master weights, flash-attn footprint, the preset's runtime overheads), the way
long-context papers tabulate their ablations (ALST Table 2, UPipe Table 3). Columns: the longest length
that fits (grid: multiples of lcm(1024, degree, tiles)), the predicted peak per rank there and its
breakdown, where in the step the peak is, host memory per rank, the predicted tokens/s (throughput model).

The last row, the tiled RMSNorm (``norm_tile_tokens``), is autotune's own addition to ALST's stack: without it
the peak at multi-million tokens is RMSNorm's fp32 temporaries in a checkpointed layer's backward (``--explain``
shows the largest live tensors at the peak).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

K = 1024
MLP_TILE = 16 * K
LOSS_TILE = 4 * K
NORM_TILE = 64 * K

# each row adds one knob to the previous one (attention is flash-attn throughout: a kernel, not a technique)
ROWS = [
    ("baseline (DDP, flash-attn)", {"attention": "flash"}),
    ("+ FSDP (ZeRO-3)", {"fsdp": True}),
    ("+ activation checkpointing", {"activation_checkpointing": True}),
    ("+ Ulysses SP x8", {"ulysses_degree": 8}),
    ("+ head chunk 1 (UPipe)", {"head_chunk": 1}),
    (f"+ tiled loss ({LOSS_TILE // K}K)", {"loss_tile_tokens": LOSS_TILE}),
    (f"+ tiled MLP ({MLP_TILE // K}K)", {"mlp_tile_tokens": MLP_TILE}),
    ("+ activation offload (all layers)", {"activation_offload_layers": "all"}),
    ("+ optimizer offload (ALST's stack)", {"optimizer_offload": True}),
    (f"+ tiled RMSNorm ({NORM_TILE // K}K) = full stack", {"norm_tile_tokens": NORM_TILE}),
]


# -- the table ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--explain", action="store_true", help="explain the full stack's peak at its max length")
    args = parser.parse_args(argv)

    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend
    from autotune.core.hardware import load_hardware
    from autotune.core.sizes import format_tokens
    from autotune.oracle import explain
    from autotune.search.max_seq import find_max_seq
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    model_config = load_model_config(args.model)
    hardware = load_hardware(args.hardware)
    layers = model_config["num_hidden_layers"]
    gib = 2.0**30
    print(
        f"{args.model} on {args.gpus}x {hardware.name} ({hardware.device_memory_bytes / gib:.0f} GiB per device; "
        f"runtime overheads {hardware.runtime_overhead_bytes / gib:.0f} GiB + "
        f"{hardware.allocator_fragmentation:.0%} fragmentation), predicted by the memory oracle\n"
    )
    header = (
        f"{'configuration':<36} {'max seq (tokens)':>22} {'peak GiB':>8} {'params':>6} {'grads':>6} "
        f"{'optim':>6} {'activ':>6} {'temps':>6} {'other':>6} {'host GiB':>8} {'tokens/s':>9}  peak at"
    )
    print(header)
    print("-" * len(header))
    rows = list(ROWS)
    knobs: dict = {}
    results = []
    for label, add in rows:
        knobs.update(add)
        techniques = Techniques.from_dict(dict(knobs), layers)
        evaluation = Evaluation(model_config, techniques, 512 * K, args.gpus, hardware)
        backend = PlanBackend()
        started = time.perf_counter()
        record = find_max_seq(evaluation, backend=backend)
        elapsed = time.perf_counter() - started
        results.append((label, techniques, record))
        b = record.breakdown or {}
        if record.status != "ok":
            print(
                f"{label:<36} {'does not fit at ' + format(record.seq_len, ','):>22} "
                f"{(record.peak_device_bytes or 0) / gib:8.1f} "
                + " ".join(
                    f"{b.get(c, 0) / gib:6.1f}"
                    for c in ("params", "grads", "optimizer", "activations", "temporaries", "other")
                )
                + f" {(record.host_bytes or 0) / gib:8.1f} {'':>9}  {record.status} ({elapsed:.0f} s)",
                flush=True,
            )
            continue
        peak_at = backend.peak_at(replace(evaluation, seq_len=record.seq_len))
        where = "/".join(str(p if not isinstance(p, tuple) else p[1]) for p in (peak_at or ()))
        rate = f"{record.tokens_per_s:9,.0f}" if record.tokens_per_s else f"{'n/a':>9}"
        print(
            f"{label:<36} {format_tokens(record.seq_len):>22} {record.peak_device_bytes / gib:8.1f} "
            + " ".join(
                f"{b.get(c, 0) / gib:6.1f}"
                for c in ("params", "grads", "optimizer", "activations", "temporaries", "other")
            )
            + f" {(record.host_bytes or 0) / gib:8.1f} {rate}  {where} ({elapsed:.0f} s)",
            flush=True,
        )

    target = 5 * 1024**2
    full = next(r for r in results if r[0].endswith("full stack"))
    print(
        f"\nfull stack: {format_tokens(full[2].seq_len)} tokens "
        f"({'reaches' if full[2].status == 'ok' and full[2].seq_len >= target else 'short of'} the 5M = "
        f"{target:,} goal; ALST reports 3.7M, UPipe 5M on this node)"
    )
    if args.explain or full[2].status != "ok" or full[2].seq_len < target:
        print(f"\nwhere the full stack's memory goes at {target:,} tokens:")
        print(explain(Evaluation(model_config, full[1], target, args.gpus, hardware)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
