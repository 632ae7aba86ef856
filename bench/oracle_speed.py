"""How long one plan evaluation takes (issue 4 goal: llama3-8b at 5M tokens, 8 ranks, full stack, <= 15 s on a
2-core machine; a config without tiling must not get slower with the sequence length).

    .venv/bin/python bench/oracle_speed.py          # last line: the full-stack time at 5M
"""

import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from autotune import oracle  # noqa: E402
from autotune.backends import Evaluation  # noqa: E402
from trials.techniques import Techniques  # noqa: E402
from autotune.core.hardware import load_hardware
from trials.model_config import load_model_config  # noqa: E402

K = 1024
FULL = Techniques(fsdp=True, optimizer_offload=True, ulysses_degree=8, head_chunk=1, activation_checkpointing=True,
                  activation_offload_layers=32, mlp_tile_tokens=64 * K, loss_tile_tokens=4 * K, attention="flash")


def timed(evaluation) -> float:
    started = time.perf_counter()
    oracle.predict(evaluation)
    return time.perf_counter() - started


def main() -> int:
    ev = Evaluation(load_model_config("llama3-8b"), FULL, 5 * K * K, 8, load_hardware("h100-sxm"))
    oracle.predict(replace(ev, seq_len=64 * K))  # warm imports and caches, as a search process would be
    plain = Techniques(fsdp=True, ulysses_degree=8, activation_checkpointing=True, attention="flash")
    for seq in (128 * K, 5 * K * K):
        print(f"no tiling at {seq:>9,} tokens: {timed(replace(ev, techniques=plain, seq_len=seq)):.1f} s")
    print(f"full stack at 5,242,880 tokens: {timed(ev):.1f} s (goal <= 15 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
