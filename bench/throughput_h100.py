"""Predicted throughput of Llama-3-8B on one 8x H100 SXM node, 128K to 5M tokens, full technique stack.

The same path as ``autotune estimate`` / the ``plan`` backend: the memory oracle traces the trial code under
FakeTensorMode on a fake 8-rank world (bf16 compute, GPU kernel footprints), ``autotune.timing.counting.StepCounter``
counts the traced step (3- and 4-layer copies, extended to 32 layers like the memory), and ``predict_step_time``
turns the counts into time with the ``h100-sxm`` preset's rates (docs/predictions.md says what they assume).

Config: the full stack of bench/ablation.py -- fsdp + optimizer_offload, Ulysses 8 with head_chunk 1 (UPipe),
activation checkpointing with every layer's input offloaded, tiled MLP (64K), tiled loss (8K: a 64K tile of
128K-vocab fp32 logits alone would be ~32 GiB), tiled RMSNorm (64K).

    .venv/bin/python bench/throughput_h100.py [--hardware h100-sxm] [--attention flash|sdpa] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

SEQS = [131072, 262144, 524288, 1048576, 2097152, 3145728, 4194304, 5242880]
TECHNIQUES = {
    "fsdp": True,
    "optimizer_offload": True,
    "ulysses_degree": 8,
    "head_chunk": 1,
    "activation_checkpointing": True,
    "activation_offload_layers": "all",
    "mlp_tile_tokens": 65536,
    "loss_tile_tokens": 8192,
    "norm_tile_tokens": 65536,
}


def model_flops_per_token(cfg: dict, seq_len: int) -> float:
    """Training FLOPs per token without recompute: 6 x matmul params + causal attention (fwd 2 + bwd 5 matmuls
    over s/2 keys on average): the usual MFU numerator."""
    h, d, layers = cfg["hidden_size"], cfg["head_dim"], cfg["num_hidden_layers"]
    hq, hkv, inter, vocab = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
    )
    matmul = layers * (h * d * (hq + 2 * hkv) + hq * d * h + 3 * h * inter) + h * vocab
    attention = layers * hq * d * (seq_len + 1) / 2 * (4 + 10)
    return 6 * matmul + attention


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--attention", default="flash", choices=("flash", "sdpa"))
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "throughput_h100.txt"))
    args = parser.parse_args(argv)

    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend, step_counts
    from autotune.core.hardware import load_hardware
    from autotune.timing.model import predict_step_time
    from trials.model_config import load_model_config
    from trials.techniques import Techniques

    cfg = load_model_config(args.model)
    hardware = load_hardware(args.hardware)
    rates = hardware.rates_for(args.gpus)
    tech = Techniques.from_dict(dict(TECHNIQUES, attention=args.attention), cfg["num_hidden_layers"])
    lines = [
        f"# {args.model} on {args.gpus}x {hardware.name}, predicted by the plan backend "
        f"(oracle fake trace + StepCounter + predict_step_time)",
        f"# techniques: {tech.to_dict()}",
        f"# rates: matmul {rates.bf16_flops * rates.matmul_efficiency / 1e12:.0f} TFLOP/s, attention "
        f"{rates.bf16_flops * rates.attention_efficiency / 1e12:.0f}/{rates.bf16_flops * rates.attention_backward_efficiency / 1e12:.0f} "
        f"TFLOP/s fwd/bwd, NVLink {rates.intra_node_bytes_per_s / 1e9:.0f} GB/s/dir, host link "
        f"{rates.host_bytes_per_s / 1e9:.0f} GB/s/dir, host AdamW {rates.host_optimizer_bytes_per_s / 1e9:.0f} GB/s/rank",
        f"{'seq':>9s} {'status':6s} {'peak GiB':>8s} {'step s':>9s} {'tokens/s':>9s} {'compute':>8s} "
        f"{'recomp':>8s} {'comm':>7s} {'host':>7s} {'optim':>7s} {'a2a s':>7s} {'MFU':>5s} {'trace s':>7s}",
    ]
    print("\n".join(lines), flush=True)
    backend = PlanBackend()
    last = None
    for seq in SEQS:
        started = time.perf_counter()
        record = backend.evaluate(Evaluation(cfg, tech, seq, args.gpus, hardware))
        elapsed = time.perf_counter() - started
        prediction = backend.last_prediction
        if prediction is None or record.step_time_s is None:
            line = f"{seq:9d} {record.status:6s} no timing: {(record.error or '')[-200:]}"
            print(line, flush=True)
            lines.append(line)
            continue
        counts = step_counts(prediction)
        if args.attention == "flash" and counts.attention_flops == 0:
            note = "  (attention not counted: the oracle's fake flash kernel does not call autotune.timing.counting.record_attention)"
        else:
            note = ""
        timing = predict_step_time(counts, rates, args.gpus, tech, seq_len=seq)
        mfu = model_flops_per_token(cfg, seq) * seq / (timing.step_time_s * args.gpus * rates.bf16_flops)
        line = (
            f"{seq:9d} {record.status:6s} {record.peak_device_bytes / 2**30:8.1f} {timing.step_time_s:9.2f} "
            f"{timing.tokens_per_s:9.0f} {timing.compute_s:8.2f} {timing.recompute_s:8.2f} "
            f"{timing.exposed_comm_s:7.2f} {timing.exposed_host_s:7.2f} {timing.optimizer_s:7.2f} "
            f"{timing.detail.get('all_to_all_sync_s', 0):7.2f} {mfu:5.1%} {elapsed:7.1f}{note}"
        )
        print(line, flush=True)
        lines.append(line)
        last = (seq, record.status, timing.tokens_per_s, timing.step_time_s, mfu)
    lines.append(
        "# step s = compute (fwd+bwd) + recompute + exposed comm + exposed host transfer + optimizer; "
        "a2a s = Ulysses all-to-all time (always exposed, part of comm); MFU counts 6N + causal attention "
        "FLOPs per token, no recompute"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if last is not None:  # the figure: the longest length's prediction
        seq, status, rate, step_s, mfu = last
        lines.append(
            f"predicted at {seq:,} tokens ({status}): {rate:,.0f} tokens/s, step {step_s / 3600:.2f} h, MFU {mfu:.1%}"
        )
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-2:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
