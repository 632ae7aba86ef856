"""Do the fidelity bench's drift gauges disturb the step they measure? The same trials timed with and without them.

``bench/throughput_fidelity.py`` runs two gauges on every rank just before every timed step (the speed probe and
the calibration's own in-step step re-timed): both allocate, compute and free, so they could leave caches and the
allocator cold for the trial step right after, and inflate short steps most -- which would look like the model
under-predicting short configs. This bench launches a few fidelity configs (the shortest steps, and one long one)
as that bench measures them, alternately with the gauges (``measure(..., gauges=True)``) and without, in rounds,
and prints each config's median step with / without: 1.00 means the gauges cost the step nothing.

    .venv/bin/python bench/gauge_interference.py --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import throughput_fidelity as fidelity  # noqa: E402  (the sibling bench whose measurement this checks)

CONFIGS = [("tiny-llama", 1024, 1, {}),
           ("tiny-llama", 1024, 2, {"fsdp": True, "activation_checkpointing": True}),
           ("tiny-llama", 2048, 2, {"ulysses_degree": 2}),
           ("tiny-llama", 8192, 1, {"activation_checkpointing": True})]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="launches per config and mode")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    started = time.time()
    medians: dict[tuple, list[float]] = {}
    for round_index in range(args.rounds):
        for config in CONFIGS:
            for gauges in (True, False):
                measured = fidelity.measure(*config, steps=args.steps, attempts=3, gauges=gauges)
                if "error" in measured:
                    print(f"{fidelity.label(*config)}: {measured['error']}", file=sys.stderr)
                    return 1
                seconds = [s["seconds"] for s in measured["clean"] or measured["contended"]]
                medians.setdefault((fidelity.label(*config), gauges), []).append(statistics.median(seconds))
                print(f"round {round_index + 1}/{args.rounds} {fidelity.label(*config)} "
                      f"{'with' if gauges else 'without'} gauges: {' '.join(f'{s:.3f}' for s in seconds)}",
                      file=sys.stderr, flush=True)
    print(f"# median step (s) per launch, with and without the drift gauges before each step; {args.rounds} rounds")
    ratios = []
    for config in CONFIGS:
        name = fidelity.label(*config)
        with_, without = medians[(name, True)], medians[(name, False)]
        ratio = statistics.median(with_) / statistics.median(without)
        ratios.append(ratio)
        print(f"{name:32s} with {' '.join(f'{s:.3f}' for s in with_)}   without {' '.join(f'{s:.3f}' for s in without)}"
              f"   with/without {ratio:.2f}")
    print(f"# took {time.time() - started:.0f} s")
    print(f"with/without gauges: {min(ratios):.2f}-{max(ratios):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
