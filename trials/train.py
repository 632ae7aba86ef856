"""Train with a tuned config: the same model, stack and step as a trial, for as many steps as you like.

    torchrun --standalone --nproc-per-node=N -m trials.train --config best.json [--steps S] [--data tokens.parquet]

(``python -m trials.train ...`` for one rank.) Rank 0 prints one line per step (loss, tokens/s, peak device
memory) and a final JSON summary line. Data: synthetic tokens by default (the same seeded stream as trials,
so step 1 matches the trial's loss), or token ids from a Parquet/Arrow file: a column ``input_ids``
(list of ints per row) or ``tokens`` (ints), read as one stream; replica r at step k takes the
(k * dp + r)-th window of seq_len + 1 tokens, wrapping around.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from trials import allocator
from trials.config_file import load_config_file
from trials.data import make_batch, synthetic_sample
from trials.dist import init_mesh
from trials.memory import DeviceMemoryTracker
from trials.model_config import load_model_config
from trials.step import build_training, train_step


class TokenSource:
    """Windows of seq_len + 1 tokens, from the synthetic stream or a Parquet/Arrow file."""

    def __init__(self, seq_len: int, vocab_size: int, seed: int = 0, path: str | None = None):
        self.seq_len, self.vocab_size, self.seed = seq_len, vocab_size, seed
        self.stream = read_token_file(path, vocab_size) if path else None

    def window(self, index: int) -> torch.Tensor:

        if self.stream is None:
            return synthetic_sample(index, self.seq_len, self.vocab_size, self.seed)
        width = self.seq_len + 1
        start = (index * width) % self.stream.numel()
        picked = torch.arange(start, start + width) % self.stream.numel()
        return self.stream[picked]


def read_token_file(path: str, vocab_size: int) -> torch.Tensor:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    file = Path(path)
    if file.suffix in (".arrow", ".feather", ".ipc"):
        table = pa.ipc.open_file(file).read_all()
    else:
        table = pq.read_table(file)
    if "input_ids" in table.column_names:
        column = pc.list_flatten(table.column("input_ids"))
    elif "tokens" in table.column_names:
        column = table.column("tokens")
    else:
        raise ValueError(f"{path}: needs a column 'input_ids' (lists of token ids) or 'tokens' (token ids)")
    if not pa.types.is_integer(column.type):  # floats would be truncated to ids, strings cannot be ids
        raise ValueError(f"{path}: the token column holds {column.type} values, not integer token ids")
    stream = torch.tensor(column.to_numpy(zero_copy_only=False), dtype=torch.long)
    if stream.numel() < 2:
        raise ValueError(f"{path}: holds fewer than 2 tokens")
    if int(stream.min()) < 0 or int(stream.max()) >= vocab_size:
        raise ValueError(f"{path}: token ids must lie in [0, {vocab_size})")
    return stream


def train(config_path: str, steps: int, data: str | None = None, seed: int = 0, print_fn=print) -> dict:

    config = load_config_file(config_path)
    model_config = load_model_config(config.model)
    techniques = config.techniques
    seq_len = config.seq_len
    mesh = init_mesh(techniques.ulysses_degree)
    tracker = DeviceMemoryTracker() if mesh.device.type != "cuda" else None
    talk = print_fn if mesh.rank == 0 else (lambda *a, **k: None)
    losses, rates, peak = [], [], 0
    with tracker if tracker is not None else contextlib.nullcontext():
        model, optimizer = build_training(model_config, techniques, mesh, seed, tracker)
        source = TokenSource(seq_len, model.config.vocab_size, seed, data)
        for step in range(steps):
            batch = make_batch(
                source.window(step * mesh.dp_size + mesh.dp_rank), mesh.sp_rank, mesh.sp_degree, mesh.device
            )
            start = time.perf_counter()
            result = train_step(model, optimizer, batch, mesh, tracker)
            elapsed = time.perf_counter() - start
            peak = torch.cuda.max_memory_allocated(mesh.device) if tracker is None else tracker.peak_device_bytes
            losses.append(result.loss)
            rates.append(seq_len * mesh.dp_size / elapsed)
            talk(
                f"step {step + 1}/{steps}  loss {result.loss:.6f}  grad_norm {result.grad_norm:.4f}  "
                f"{rates[-1]:,.0f} tokens/s  peak {peak / 2**30:.3f} GiB",
                flush=True,
            )
    summary = {
        "steps": steps,
        "seq_len": seq_len,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "tokens_per_s": sum(rates[1:] or rates) / len(rates[1:] or rates),
        "peak_device_bytes": int(peak),
        "world_size": mesh.world_size,
    }
    talk("summary " + json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trials.train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="autotune/config-v1 JSON (best.json)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--data", default=None, help="Parquet/Arrow file of token ids")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    allocator.configure()  # before CUDA starts: the allocator settings the trials measured under
    train(args.config, args.steps, args.data, args.seed)
    import torch.distributed as dist

    if dist.is_initialized():
        # every rank done before any tears its group down: a rank that finishes first and destroys the group
        # while a peer still talks can abort ("terminate called without an active exception", after the last
        # step), failing the job
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without running C++ static destructors: on multi-node runs one of them can find a thread still
    # joinable and abort the finished rank ("terminate called without an active exception" after the interpreter
    # has no Python frame left), failing a job whose steps were all done. An exception from main() still exits
    # the usual way, with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
