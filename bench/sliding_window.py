"""A sliding window's price: the same model predicted with its window and without, at one length.

    .venv/bin/python bench/sliding_window.py [--model mistral-7b] [--seq 1M] [--hardware h100-sxm] [--gpus 8]
        | tee bench/results/sliding_window.txt

Both rows are the plan backend's prediction (memory oracle + time model) for one config of the full stack with
flash-attn; the second row is the model with ``sliding_window: null``. The attention kernels' work is priced by the
(query, key) pairs they compute: a window ``W`` leaves about ``s * W`` of the causal triangle's ``s^2 / 2``. The last
lines set the predicted attention time's ratio beside the ratio of pairs the band implies, and the step's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

K = 1024
TECHNIQUES = {
    "attention": "flash",
    "fsdp": True,
    "optimizer_offload": True,
    "ulysses_degree": 8,
    "head_chunk": 1,
    "activation_checkpointing": True,
    "activation_offload_layers": "all",
    "mlp_tile_tokens": 16 * K,
    "loss_tile_tokens": 4 * K,
    "norm_tile_tokens": 64 * K,
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="mistral-7b")
    parser.add_argument("--seq", default="1M")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--gpus", type=int, default=8)
    args = parser.parse_args(argv)

    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend, step_counts, step_time
    from autotune.core.hardware import load_hardware
    from autotune.core.sizes import parse_tokens
    from autotune.timing.attention_cost import causal_pairs
    from autotune.timing.model import attention_time
    from trials.models.config import layer_windows, load_model_config
    from trials.stack.techniques import Techniques

    windowed = load_model_config(args.model)
    window = next((w for w in layer_windows(windowed) if w), None)
    if window is None:
        print(f"{args.model} has no sliding window", file=sys.stderr)
        return 2
    full = {**windowed, "sliding_window": None}
    seq = parse_tokens(args.seq)
    hardware = load_hardware(args.hardware)
    techniques = Techniques.from_dict(TECHNIQUES, windowed["num_hidden_layers"])
    print(f"{args.model} at {seq:,} tokens on {args.gpus}x {hardware.name}, predicted (plan backend); {TECHNIQUES}\n")
    print(f"{'model':<34} {'status':>6} {'step s':>9} {'attention s':>12} {'tokens/s':>10} {'peak GiB':>9}")
    rows = {}
    for label, config in ((f"window {window:,}", windowed), ("window removed (full causal)", full)):
        backend = PlanBackend()
        evaluation = Evaluation(config, techniques, seq, args.gpus, hardware)
        record = backend.evaluate(evaluation)
        breakdown = step_time(evaluation, backend.last_prediction)
        counts = step_counts(backend.last_prediction)
        attention_s = attention_time(counts, set(counts.phases), hardware.rates_for(args.gpus))
        rows[label] = (breakdown.step_time_s, attention_s)
        print(
            f"{label:<34} {record.status:>6} {breakdown.step_time_s:9.2f} {attention_s:12.2f} "
            f"{breakdown.tokens_per_s or 0:10,.0f} {(record.peak_device_bytes or 0) / 2**30:9.1f}"
        )
    (w_step, w_attn), (f_step, f_attn) = rows.values()
    band = causal_pairs(seq, seq, True) / causal_pairs(seq, seq, True, window)
    print(f"\npairs the band implies: full causal / window = {band:.1f}x")
    print(f"predicted attention time: full causal / window = {f_attn / w_attn:.1f}x")
    print(f"predicted step time: full causal / window = {f_step / w_step:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
