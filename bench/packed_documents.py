"""Packed documents' price: the main job's best config at 5M tokens with one document per sequence and with 64K-token
documents packed into it, beside one 64K document alone.

    .venv/bin/python bench/packed_documents.py [--seq 5M] [--documents 64K] | tee bench/results/packed_documents.txt
    .venv/bin/python bench/packed_documents.py --ring 2 | grep -v WARNING | tee bench/results/packed_documents_ring.txt

The config is the main job's best at 5M (``bench/results/main_job.txt``: the front's point at exactly 5,242,880
tokens). Every row is the plan backend's prediction (memory oracle + time model) on 8x h100-sxm; the packed row's
fake step runs each document's attention as the real step does, and the time model prices each document's causal
pairs per kernel tile. The last lines check the issue's goals: the packed attention time within 5% of one
document's x the documents per sequence, and the packed step at least 10x faster than one document per sequence.

``--ring R``: the same config with its context-parallel world split into Ulysses (degree / R) x ring R; the ring
splits each packed document into 2R chunks (the per-document zigzag), so every row runs each document's own ring
blocks, and the packed attention is again the documents per sequence x one document's, each on the same ring.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAIN_JOB = ROOT / "bench" / "results" / "main_job.txt"


def main_job_best(seq: int) -> dict:
    """The techniques of the main job's front point at exactly ``seq`` tokens."""
    for line in MAIN_JOB.read_text().splitlines():
        match = re.match(r"\s*trial\s+\d+\s+([\d,]+) tokens .*?(\{.*\})\s*$", line)
        if match and int(match.group(1).replace(",", "")) == seq:
            return json.loads(match.group(2))
    raise SystemExit(f"{MAIN_JOB} has no front point at {seq:,} tokens")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--seq", default="5M")
    parser.add_argument("--documents", default="64K")
    parser.add_argument("--hardware", default="h100-sxm")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ring", type=int, default=1, help="ring degree: Ulysses degree / RING x ring RING")
    args = parser.parse_args(argv)

    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend, step_counts, step_time
    from autotune.core.documents import parse_documents
    from autotune.core.hardware import load_hardware
    from autotune.core.sizes import parse_tokens
    from autotune.timing.model import attention_time
    from trials.kernels.documents import ONE
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    config = load_model_config(args.model)
    seq = parse_tokens(args.seq)
    packed = parse_documents(args.documents)
    (length,) = packed.lengths
    hardware = load_hardware(args.hardware)
    knobs = main_job_best(seq)
    if args.ring > 1:  # the same context-parallel world, split into Ulysses x ring
        knobs = {**knobs, "ulysses_degree": knobs["ulysses_degree"] // args.ring, "ring_degree": args.ring}
    techniques = Techniques.from_dict(knobs, config["num_hidden_layers"])
    rates = hardware.rates_for(args.gpus).for_kernel(techniques.attention, techniques.head_chunk)
    changed = f", with ring_degree {args.ring}" if args.ring > 1 else ""
    print(
        f"{args.model} on {args.gpus}x {hardware.name}, predicted (plan backend); the main job's best at {seq:,}"
        f"{changed}:"
    )
    print(f"{json.dumps(knobs, sort_keys=True)}\n")
    print(f"{'workload':<40} {'status':>6} {'step s':>10} {'attention s':>12} {'tokens/s':>10} {'peak GiB':>9}")
    rows = {}
    cases = (
        (f"{seq:,} tokens, one document", seq, ONE),
        (f"{seq:,} tokens, {args.documents} documents", seq, packed),
        (f"{length:,} tokens, one document", length, ONE),
    )
    for label, tokens, documents in cases:
        backend = PlanBackend()
        evaluation = Evaluation(config, techniques, tokens, args.gpus, hardware, documents=documents)
        record = backend.evaluate(evaluation)
        if backend.last_prediction is None or record.status == "error":
            print(f"{label:<40} {record.status:>6}  {record.error}")
            return 1
        breakdown = step_time(evaluation, backend.last_prediction)
        attention_s = attention_time(
            step_counts(backend.last_prediction), set(step_counts(backend.last_prediction).phases), rates
        )
        rows[label] = (breakdown.step_time_s, attention_s)
        print(
            f"{label:<40} {record.status:>6} {breakdown.step_time_s:10.2f} {attention_s:12.2f} "
            f"{breakdown.tokens_per_s or 0:10,.0f} {(record.peak_device_bytes or 0) / 2**30:9.1f}"
        )
    (one_step, _), (packed_step, packed_attn), (_, alone_attn) = rows.values()
    per_sequence = len(packed.for_length(seq).lengths)
    ratio = packed_attn / (alone_attn * per_sequence)
    print(f"\ndocuments per sequence: {per_sequence}")
    print(
        f"packed attention / ({per_sequence} x one {args.documents} document's) = {ratio:.4f} "
        f"(the time model against itself; goal within 5%: {'met' if abs(ratio - 1) <= 0.05 else 'missed'})"
    )
    speedup = one_step / packed_step
    print(f"step time: one document / packed = {speedup:.1f}x (goal >= 10x: {'met' if speedup >= 10 else 'missed'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
