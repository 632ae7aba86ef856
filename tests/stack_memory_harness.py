"""Memory harness: the tracker's peak for many configurations in ONE process group launch.

    torchrun --nproc-per-node N tests/stack_memory_harness.py CASES.json OUT.json

CASES.json: {"model": preset, "seq_len": int, "cases": [{"name", "techniques": {...}}]}. Each case: a fresh model
with the techniques applied on a shared mesh, one training step (forward, backward, AdamW step) under
``DeviceMemoryTracker``. Rank 0 writes OUT.json: {"results": {name: {"peak_device_bytes", "forward_device_bytes"
(live device bytes right after the forward, before backward), "forward_host_bytes", "host_bytes" (peak),
"breakdown" (at the peak)}}}, each the max over ranks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def one_step(model_config: dict, techniques: dict, seq_len: int, mesh) -> dict:
    from trials.core.memory import DeviceMemoryTracker
    from trials.models.model import build_model
    from trials.stack import apply
    from trials.stack.fsdp import allreduce_grads
    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import loss_scale

    with DeviceMemoryTracker() as tracker:
        model = build_model(model_config)
        apply(model, Techniques.from_dict(techniques), mesh)
        tracker.retag(model.parameters(), "params")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
        batch = make_batch(
            synthetic_sample(mesh.dp_rank, seq_len, model.config.vocab_size, 0),
            mesh.sp_rank,
            mesh.sp_degree,
            mesh.device,
        )
        tracker.reset_peak()
        with tracker.in_phase("forward"):
            loss = model(batch.input_ids, batch.position_ids, batch.labels, scale=loss_scale(batch, mesh))
        forward_device, forward_host = tracker.device_bytes, tracker.host_bytes
        with tracker.in_phase("backward"):
            loss.backward()
            allreduce_grads(model, mesh)
        tracker.retag((p.grad for p in model.parameters()), "grads")
        with tracker.in_phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {
        "peak_device_bytes": tracker.peak_device_bytes,
        "forward_device_bytes": forward_device,
        "forward_host_bytes": forward_host,
        "host_bytes": tracker.peak_host_bytes,
        "breakdown": dict(tracker.peak_breakdown),
    }


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from trials.core.dist import build_mesh, init_mesh
    from trials.models.config import load_model_config

    spec = json.loads(Path(argv[0]).read_text())
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        torch.set_num_threads(1)
    model_config = load_model_config(spec["model"])
    meshes, results = {}, {}
    for case in spec["cases"]:
        sp = case["techniques"].get("ulysses_degree", 1)
        if sp not in meshes:
            meshes[sp] = build_mesh(sp, torch.device("cpu")) if dist.is_initialized() else init_mesh(sp)
        result = one_step(model_config, case["techniques"], spec["seq_len"], meshes[sp])
        if dist.is_initialized():
            keys = ["peak_device_bytes", "forward_device_bytes", "forward_host_bytes", "host_bytes"]
            values = torch.tensor([float(result[k]) for k in keys], dtype=torch.float64)
            dist.all_reduce(values, op=dist.ReduceOp.MAX)
            result.update({k: int(v) for k, v in zip(keys, values.tolist())})
        results[case["name"]] = result
        if int(os.environ.get("RANK", 0)) == 0:
            print(case["name"], json.dumps(result), flush=True)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(argv[1]).write_text(json.dumps({"results": results}, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
