"""Run one trial: build, apply the stack, train warm-up + measured steps, write this rank's record.

Launched by the local backend as ``torchrun --nproc-per-node N -m trials.runner SPEC OUT_DIR`` (or plain
``python -m trials.runner`` for one rank). SPEC is a JSON file:
    {"model_config": {...}, "techniques": {...}, "seq_len": int, "steps": int, "warmup": int,
     "capacity_bytes": int | null, "seed": int, "compute_dtype": "bf16" | "fp32" (optional)}
Each rank writes ``OUT_DIR/rank{r}.json``: status, timings, its peak device bytes and breakdown, and the
loss / grad norm of the first step. A rank that fails writes its record and exits non-zero at once, so
torchrun tears the job down instead of leaving peers blocked in a collective.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch


def _device_peak(device: torch.device, tracker) -> tuple[int, dict, int]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), {}, 0
    return tracker.peak_device_bytes, dict(tracker.peak_breakdown), tracker.peak_host_bytes


def run_trial(spec: dict, mesh=None) -> dict:
    """Run the trial on this rank and return its record (a dict, DESIGN.md's result record fields)."""
    from autotune.config import Techniques
    from trials.data import make_batch, synthetic_sample
    from trials.dist import init_mesh
    from trials.memory import DeviceMemoryTracker
    from trials.step import build_training, train_step

    techniques = Techniques.from_dict(spec["techniques"])
    seq_len, steps, warmup = spec["seq_len"], spec.get("steps", 2), spec.get("warmup", 1)
    seed = spec.get("seed", 0)
    mesh = mesh or init_mesh(techniques.ulysses_degree)
    device = mesh.device
    use_tracker = device.type != "cuda"
    tracker = DeviceMemoryTracker(spec.get("capacity_bytes")) if use_tracker else None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    record = {"status": "ok", "source": "measured", "seq_len": seq_len, "device": _describe(device, mesh),
              "rank": mesh.rank, "loss": None, "grad_norm": None, "error": None}
    step_times = []
    try:
        with tracker if tracker is not None else contextlib.nullcontext():
            model, optimizer = build_training(spec["model_config"], techniques, mesh, seed, tracker,
                                              compute_dtype=_compute_dtype(spec.get("compute_dtype")))
            tokens = synthetic_sample(mesh.dp_rank, seq_len, model.config.vocab_size, seed)
            batch = make_batch(tokens, mesh.sp_rank, mesh.sp_degree, device)
            for index in range(warmup + steps):
                _inject_fault(mesh.rank)
                start = time.perf_counter()
                result = train_step(model, optimizer, batch, mesh, tracker)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - start
                if index == 0:
                    record["loss"], record["grad_norm"] = result.loss, result.grad_norm
                if index >= warmup:
                    step_times.append(elapsed)
    except torch.OutOfMemoryError as exc:
        record.update(status="oom", error=str(exc).splitlines()[0][:500])
    except Exception as exc:  # recorded, classified by the launcher
        if "out of memory" in str(exc).lower():
            record.update(status="oom", error=str(exc).splitlines()[0][:500])
        else:
            record.update(status="error", error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}")
    peak, breakdown, host = _device_peak(device, tracker)
    record.update(peak_device_bytes=int(peak), breakdown=breakdown, host_bytes=int(host))
    if step_times:
        step_time = sum(step_times) / len(step_times)
        record.update(step_time_s=step_time, tokens_per_s=seq_len * mesh.dp_size / step_time)
    return record


def _compute_dtype(name: str | None) -> torch.dtype | None:
    """Spec key ``compute_dtype``: ``bf16`` / ``fp32``, or absent = the device's default (bf16 on CUDA,
    fp32 on CPU). bf16 on CPU lets the oracle's GPU precision model be checked against real CPU trials."""
    if name is None:
        return None
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
            "float32": torch.float32}[name]


def _inject_fault(rank: int) -> None:
    """Test hook: ``AUTOTUNE_TEST_FAULT=kind:rank`` makes that rank crash, hang or die by a signal, so the
    launcher's failure classification can be tested with trials built to fail each way."""
    fault = os.environ.get("AUTOTUNE_TEST_FAULT")
    if not fault:
        return
    kind, _, fault_rank = fault.partition(":")
    if int(fault_rank or 0) != rank:
        return
    if kind == "crash":
        print(f"injected failure on rank {rank}", file=sys.stderr, flush=True)
        raise RuntimeError(f"injected crash on rank {rank}")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "signal":
        os.kill(os.getpid(), 9)


def _describe(device: torch.device, mesh) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x{mesh.world_size}"
    return f"cpu (gloo) x{mesh.world_size}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec_path, out_dir = Path(argv[0]), Path(argv[1])
    spec = json.loads(spec_path.read_text())
    rank = int(os.environ.get("RANK", 0))
    try:
        record = run_trial(spec)
    except Exception as exc:  # failure before the trial could even start (groups, imports)
        record = {"status": "error", "source": "measured", "seq_len": spec.get("seq_len"), "rank": rank,
                  "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"}
    record["finished_at"] = time.time()  # the launcher reports the earliest failure as the root cause
    path = out_dir / f"rank{record.get('rank', rank)}.json"
    path.write_text(json.dumps(record))
    sys.stdout.flush()
    sys.stderr.flush()
    if record["status"] != "ok":
        os._exit(1)  # let torchrun stop the peers now
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
