"""Predicted throughput of Llama-3-8B on one 8x H100 SXM node, 128K to 5M tokens, full technique stack, with
FlashAttention-2 and FlashAttention-3 side by side.

The same path as ``autotune estimate`` / the ``plan`` backend: the memory oracle traces the trial code under
FakeTensorMode on a fake 8-rank world (bf16 compute, GPU kernel footprints), ``autotune.timing.counting.StepCounter``
counts the traced step (3- and 4-layer copies, extended to 32 layers like the memory), and ``predict_step_time``
turns the counts into time with the ``h100-sxm`` preset's rates (docs/predictions.md says what they assume).

Each length is traced once, with flash-attn 2's footprint (the oracle's stand-in flash-attn kernels), and priced at
each attention kernel's rates: the kernels compute the same attention in the same [batch, seq, heads, dim] layout,
so only their rates differ (the preset's ``attention_kernels``; the header prints them with their sources). The
peak is FA2's footprint.

Config: the full stack of bench/ablation.py -- fsdp + optimizer_offload, Ulysses 8 with head_chunk 1 (UPipe),
activation checkpointing with every layer's input offloaded, tiled MLP (64K), tiled loss (8K: a 64K tile of
128K-vocab fp32 logits alone would be ~32 GiB), tiled RMSNorm (64K).

    .venv/bin/python bench/throughput_h100.py [--hardware h100-sxm] [--kernels flash,flash3] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
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
    parser.add_argument(
        "--kernels",
        default=None,
        help="attention kernels to price, comma-separated (default: the preset's flash-attn ones)",
    )
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "throughput_h100.txt"))
    args = parser.parse_args(argv)

    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend, step_counts
    from autotune.core.hardware import load_hardware
    from autotune.timing.model import predict_step_time
    from trials.kernels.registry import FLASH_KERNELS
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    cfg = load_model_config(args.model)
    hardware = load_hardware(args.hardware)
    rates = hardware.rates_for(args.gpus)
    kernels = args.kernels.split(",") if args.kernels else [k for k in hardware.kernels if k in FLASH_KERNELS]
    unknown = [k for k in kernels if k not in hardware.kernels]
    if unknown:
        parser.error(f"{args.hardware} does not list attention kernel(s) {', '.join(unknown)}: {hardware.kernels}")
    traced = Techniques.from_dict(dict(TECHNIQUES, attention="flash"), cfg["num_hidden_layers"])
    priced = {kernel: replace(traced, attention=kernel) for kernel in kernels}
    peak = rates.bf16_flops
    lines = [
        f"# {args.model} on {args.gpus}x {hardware.name}, predicted by the plan backend "
        f"(oracle fake trace + StepCounter + predict_step_time)",
        f"# techniques: { ({k: v for k, v in traced.to_dict().items() if k != 'attention'}) }",
        f"# attention kernels, priced on one trace per length (flash-attn 2's footprint): fractions of the "
        f"{peak / 1e12:.0f} TFLOP/s bf16 peak at causal attention, head dim 128",
    ]
    for kernel in kernels:
        entry, k = rates.kernel(kernel), rates.for_kernel(kernel, None)
        lines.append(
            f"#   {kernel:<6s} fwd {k.attention_efficiency:.2f} / bwd {k.attention_backward_efficiency:.2f} "
            f"({peak * k.attention_efficiency / 1e12:.0f}/{peak * k.attention_backward_efficiency / 1e12:.0f} TFLOP/s), "
            f"tiles {k.attention_tile_q}x{k.attention_tile_kv}, {'assumed' if entry is None or entry.assumed else 'measured'}: "
            f"{entry.source if entry is not None else 'the preset reference kernel'}"
        )
    lines += [
        f"# rates: matmul {rates.bf16_flops * rates.matmul_efficiency / 1e12:.0f} TFLOP/s, NVLink "
        f"{rates.intra_node_bytes_per_s / 1e9:.0f} GB/s/dir, host link {rates.host_bytes_per_s / 1e9:.0f} GB/s/dir, "
        f"host AdamW {rates.host_optimizer_bytes_per_s / 1e9:.0f} GB/s/rank",
        f"{'seq':>9s} {'status':6s} {'peak GiB':>8s} "
        + " ".join(f"{kernel + ' step s':>13s} {'tokens/s':>9s} {'MFU':>5s}" for kernel in kernels)
        + f" {'comm':>7s} {'host':>7s} {'optim':>7s} {'a2a s':>7s} {'trace s':>7s}",
    ]
    print("\n".join(lines), flush=True)
    backend = PlanBackend()
    last = None
    for seq in SEQS:
        started = time.perf_counter()
        record = backend.evaluate(Evaluation(cfg, traced, seq, args.gpus, hardware))
        elapsed = time.perf_counter() - started
        prediction = backend.last_prediction
        if prediction is None or record.step_time_s is None:
            line = f"{seq:9d} {record.status:6s} no timing: {(record.error or '')[-200:]}"
            print(line, flush=True)
            lines.append(line)
            continue
        counts = step_counts(prediction)
        note = (
            "  (attention not counted: the oracle's fake flash kernel does not call autotune.timing.counting.record_attention)"
            if counts.attention_flops == 0
            else ""
        )
        timings = {kernel: predict_step_time(counts, rates, args.gpus, t, seq_len=seq) for kernel, t in priced.items()}
        mfus = {
            kernel: model_flops_per_token(cfg, seq) * seq / (timing.step_time_s * args.gpus * rates.bf16_flops)
            for kernel, timing in timings.items()
        }
        any_timing = next(iter(timings.values()))  # comm, host and optimizer do not depend on the kernel
        line = (
            f"{seq:9d} {record.status:6s} {record.peak_device_bytes / 2**30:8.1f} "
            + " ".join(
                f"{timing.step_time_s:13.2f} {timing.tokens_per_s:9.0f} {mfus[kernel]:5.1%}"
                for kernel, timing in timings.items()
            )
            + f" {any_timing.exposed_comm_s:7.2f} {any_timing.exposed_host_s:7.2f} {any_timing.optimizer_s:7.2f} "
            f"{any_timing.detail.get('all_to_all_sync_s', 0):7.2f} {elapsed:7.1f}{note}"
        )
        print(line, flush=True)
        lines.append(line)
        last = (seq, record.status, timings, mfus)
    lines.append(
        "# step s = compute (fwd+bwd) + recompute + exposed comm + exposed host transfer + optimizer; "
        "a2a s = Ulysses all-to-all time (always exposed, part of comm); MFU counts 6N + causal attention "
        "FLOPs per token, no recompute"
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if last is not None:  # the figure: the longest length's prediction, per kernel
        seq, status, timings, mfus = last
        lines.append(
            f"predicted at {seq:,} tokens ({status}): "
            + "; ".join(
                f"{kernel} {timing.tokens_per_s:,.0f} tokens/s, step {timing.step_time_s / 3600:.2f} h, "
                f"MFU {mfus[kernel]:.1%}"
                for kernel, timing in timings.items()
            )
        )
        if len(timings) > 1:
            first, *others = timings
            lines.append(
                f"tokens/s against {first} at {seq:,} tokens: "
                + ", ".join(f"{k} {timings[k].tokens_per_s / timings[first].tokens_per_s:.2f}x" for k in others)
            )
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines[-3:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
