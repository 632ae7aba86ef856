"""Does the host time per dispatched op, outside the kernels, depend on the step's size? Paired, in rounds.

The time model charges a step's host time outside its kernels as ``dispatches x op_overhead_s``, and the
calibration measures ``op_overhead_s`` on a 2-layer model at 16 tokens (``microbench.measure_dispatch_overhead``),
where the kernels are negligible. Short fidelity steps read ~5-10% under-predicted
(bench/results/throughput_fidelity_summary.txt, the "lean" lines). This bench measures the same quantity the
calibration's way -- one plain step's wall time minus the kernels of a step timed by the calibration's own
``_kernel_timer``, over ``StepCounter``'s dispatches, median of 9 pairs -- for models of other depths and token
counts, vocabularies and widths, in rounds (so the host's drift moves every case alike), and prints each case's median per dispatch and
its ratio to the calibration's case measured in the same rounds.

``--set checkpointing`` instead runs tiny-llama with and without activation checkpointing at 16 and 1,024 tokens:
the calibration times a step without it, while in a checkpointed step the first forward runs without autograd
and the recompute is counted as dispatches like any other (the two newest fidelity runs read checkpointed configs
~10% over-predicted in calibration time, plain ones ~1.0; README's calibrate section).

    .venv/bin/python bench/dispatch_overhead.py --rounds 3
    .venv/bin/python bench/dispatch_overhead.py --rounds 5 --set checkpointing
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_dispatch_s(model_config: dict, tokens: int, techniques: dict | None = None,
                   pairs: int = 9) -> tuple[float, int]:
    """(host seconds per dispatch outside the kernels, dispatches) of one step of ``model_config`` at ``tokens``
    with ``techniques`` (``Techniques.from_dict``'s keys; none by default)."""
    from trials.data import make_batch, synthetic_sample
    from trials.dist import Mesh
    from trials.memory import DeviceMemoryTracker
    from trials.step import build_training, train_step
    from trials.techniques import Techniques
    from autotune.timing.calibration.microbench import _kernel_timer, _wall_and_kernels
    from autotune.timing.counting import StepCounter

    tracker, mesh = DeviceMemoryTracker(None), Mesh.single()
    with tracker:
        tech = Techniques.from_dict(techniques or {}, model_config["num_hidden_layers"])
        model, optimizer = build_training(model_config, tech, mesh, 0, tracker)
        batch = make_batch(synthetic_sample(0, tokens, model_config["vocab_size"]), 0, 1, "cpu")
        train_step(model, optimizer, batch, mesh, tracker)
        counter = StepCounter(tracker, seq_len=tokens, world_size=1)
        with counter:
            train_step(model, optimizer, batch, mesh, tracker)
    counts = counter.counts
    dispatches = sum(counts.phases[p].ops + counts.phases[p].views for p in counts.phases)
    timer = _kernel_timer(tracker)
    timed = [_wall_and_kernels(model, optimizer, batch, mesh, tracker, timer) for _ in range(pairs)]
    kernels_s = statistics.median(sum(kernels.values()) for kernels, _ in timed)
    wall_s = statistics.median(wall for _, wall in timed)
    return (wall_s - kernels_s) / dispatches, dispatches


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--set", choices=("size", "checkpointing"), default="size",
                        help="size: depth, tokens, vocabulary, width (default); checkpointing: with and without it")
    args = parser.parse_args(argv)

    import torch

    from trials.model_config import load_model_config
    from autotune.timing.calibration.microbench import CALIBRATION_MODEL

    tiny = load_model_config("tiny-llama")
    ckpt = {"activation_checkpointing": True}
    cases = [("calibration model, 2 layers, 16 tokens (the calibration's case)", CALIBRATION_MODEL, 16, None)]
    if args.set == "size":
        cases += [("calibration model, 8 layers, 16 tokens", dict(CALIBRATION_MODEL, num_hidden_layers=8), 16, None),
                  (f"tiny-llama, {tiny['num_hidden_layers']} layers, 16 tokens", tiny, 16, None),
                  (f"tiny-llama, {tiny['num_hidden_layers']} layers, 256 tokens", tiny, 256, None),
                  (f"tiny-llama, {tiny['num_hidden_layers']} layers, 1024 tokens", tiny, 1024, None),
                  ("tiny-llama, 2 layers, 1024 tokens", dict(tiny, num_hidden_layers=2), 1024, None),
                  ("tiny-llama, vocabulary 256, 1024 tokens", dict(tiny, vocab_size=256), 1024, None),
                  ("tiny-llama, vocabulary 256, hidden 2x, 1024 tokens",
                   dict(tiny, vocab_size=256, hidden_size=2 * tiny["hidden_size"],
                        intermediate_size=2 * tiny["intermediate_size"]), 1024, None)]
    else:
        cases += [(f"tiny-llama, {tokens} tokens{', checkpointing' if tech else ''}", tiny, tokens, tech)
                  for tokens in (16, 1024) for tech in (None, ckpt)]
    started = time.time()
    values: dict[str, list[float]] = {name: [] for name, _, _, _ in cases}
    dispatches: dict[str, int] = {}
    for round_index in range(args.rounds):
        for name, config, tokens, tech in cases:
            seconds, dispatches[name] = per_dispatch_s(config, tokens, tech)
            values[name].append(seconds)
        print(f"round {round_index + 1}/{args.rounds} ({time.time() - started:.0f} s)", file=sys.stderr, flush=True)
    base = values[cases[0][0]]
    print(f"# host seconds per dispatch outside the kernels (wall - kernels) / dispatches, 1 rank x "
          f"{torch.get_num_threads()} threads; per round, then the median and its ratio to the calibration's case "
          f"in the same rounds")
    for name, _, _, _ in cases:
        ratios = [v / b for v, b in zip(values[name], base)]
        print(f"{name:62s} {dispatches[name]:5d} dispatches  "
              f"{' '.join(f'{v * 1e6:5.1f}' for v in values[name])} us  median {statistics.median(values[name]) * 1e6:5.1f} us"
              f"  x{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})")
    print(f"# took {time.time() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
