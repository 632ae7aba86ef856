"""Reduced-depth real trials vs full-depth real trials: the same config measured both ways, side by side.

    .venv/bin/python bench/reduced_depth.py [--seq 4096] [--model bench/models/tiny-llama-16.json] \
        | tee bench/results/reduced_depth.txt

A reduced trial (``LocalBackend(depth="reduced")``) runs the model's 3- and 4-layer copies in one launch and
extends each segment's measured peak and the step time to the model's depth; the full trial runs the model.
Both go through the local backend exactly as a search does (torchrun for 2 ranks; CUDA when visible). Per config:
peak (reduced / full), host bytes, tokens/s, wall time. Goal: peak within +-2%, tokens/s within
+-10%, and the reduced trial's wall time <= 0.5x the full one's where compute dominates start-up. The worst
ratios are printed last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CKPT = {"activation_checkpointing": True}
CONFIGS = [
    ("plain", 1, {}),
    ("checkpointing", 1, CKPT),
    ("checkpointing + offload 6 of 16", 1, {**CKPT, "activation_offload_layers": 6}),
    (
        "fsdp + optimizer offload + tiles",
        1,
        {**CKPT, "fsdp": True, "optimizer_offload": True, "mlp_tile_tokens": 1024, "loss_tile_tokens": 1024},
    ),
    ("ulysses 2 + fsdp", 2, {**CKPT, "fsdp": True, "ulysses_degree": 2}),
    (
        "full stack x2",
        2,
        {
            **CKPT,
            "fsdp": True,
            "optimizer_offload": True,
            "ulysses_degree": 2,
            "head_chunk": 1,
            "activation_offload_layers": 16,
            "mlp_tile_tokens": 1024,
            "loss_tile_tokens": 1024,
            "norm_tile_tokens": 1024,
        },
    ),
]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "bench" / "models" / "tiny-llama-16.json"))
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--hardware", default="h100-sxm", help="preset on a GPU node (its capacity is the card's)")
    parser.add_argument("--only", default=None, help="configs whose name contains this")
    args = parser.parse_args(argv)

    import dataclasses

    import torch

    from autotune.backends import Evaluation
    from autotune.backends.local import LocalBackend, visible_devices
    from autotune.core.hardware import load_hardware
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    model_config = load_model_config(args.model)
    gpus = visible_devices()
    if gpus:
        card = torch.cuda.get_device_properties(0).total_memory
        hardware = dataclasses.replace(load_hardware(args.hardware), device_memory_bytes=card)
    else:
        hardware = load_hardware("cpu")
    rows = [
        (name, world, t)
        for name, world, t in CONFIGS
        if (not args.only or args.only in name) and (not gpus or world <= gpus)
    ]
    print(
        f"reduced_depth: {model_config.get('_name', args.model)} ({model_config['num_hidden_layers']} layers), "
        f"{args.seq:,} tokens, {'cuda x' + str(gpus) if gpus else 'cpu (gloo)'}, torch {torch.__version__}",
        flush=True,
    )
    print(
        f"{'config':<34} {'ranks':>5} {'full GiB':>9} {'peak r/f':>8} {'host r/f':>8} {'full tok/s':>10} "
        f"{'tok/s r/f':>9} {'full s':>7} {'wall r/f':>8} {'layers':>6}"
    )
    worst = {}
    for name, world, knobs in rows:
        evaluation = Evaluation(
            model_config, Techniques.from_dict(knobs, model_config["num_hidden_layers"]), args.seq, world, hardware
        )
        measured = {}
        for depth in ("reduced", "full"):
            started = time.perf_counter()
            record = LocalBackend(depth=depth, timeout_s=3600).evaluate(evaluation)
            measured[depth] = (record, time.perf_counter() - started)
        (reduced, reduced_s), (full, full_s) = measured["reduced"], measured["full"]
        if reduced.status != "ok" or full.status != "ok":
            print(
                f"{name:<34} {world:>5} reduced {reduced.status} / full {full.status}: "
                f"{(reduced.error or full.error or '')[-400:]}"
            )
            worst["failed"] = name
            continue
        ratios = {
            "peak": reduced.peak_device_bytes / full.peak_device_bytes,
            "host": reduced.host_bytes / full.host_bytes if full.host_bytes else float(reduced.host_bytes == 0),
            "tokens/s": reduced.tokens_per_s / full.tokens_per_s,
            "wall": reduced_s / full_s,
        }
        for key, ratio in ratios.items():
            if key == "wall":
                if key not in worst or ratio > worst[key][0]:
                    worst[key] = (ratio, name)
                if "wall_min" not in worst or ratio < worst["wall_min"][0]:
                    worst["wall_min"] = (ratio, name, full_s)
            elif key not in worst or abs(ratio - 1) > abs(worst[key][0] - 1):
                worst[key] = (ratio, name)
        print(
            f"{name:<34} {world:>5} {full.peak_device_bytes / 2**30:9.4f} {ratios['peak']:8.4f} {ratios['host']:8.4f} "
            f"{full.tokens_per_s:10,.0f} {ratios['tokens/s']:9.3f} {full_s:7.0f} {ratios['wall']:8.3f} "
            f"{reduced.measured_layers or 'full':>6}",
            flush=True,
        )
    print("\nr/f: reduced trial / full trial. Wall times include each launch's start-up (imports, DeepSpeed op build).")
    if "failed" in worst:
        print(f"FAILED: {worst['failed']}")
        return 1
    print(f"worst peak ratio: {worst['peak'][0]:.4f} ({worst['peak'][1]})")
    print(f"worst host ratio: {worst['host'][0]:.4f} ({worst['host'][1]})")
    print(f"worst tokens/s ratio: {worst['tokens/s'][0]:.3f} ({worst['tokens/s'][1]})")
    print(f"largest wall-time ratio: {worst['wall'][0]:.3f} ({worst['wall'][1]})")
    print(
        f"wall-time ratio where compute dominates start-up most (the longest full trial, {worst['wall_min'][2]:.0f} s): "
        f"{worst['wall_min'][0]:.3f} ({worst['wall_min'][1]})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
