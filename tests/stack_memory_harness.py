"""Memory harness: the tracker's peak for many configurations in ONE process group launch.

    torchrun --nproc-per-node N tests/stack_memory_harness.py CASES.json OUT.json

CASES.json: {"model": preset, "seq_len": int, "cases": [{"name", "techniques": {...}}]}. Each case is one real trial
(``trials.runner.run_trial``: build, apply the stack, one training step under ``DeviceMemoryTracker``) on a shared
mesh. Rank 0 writes OUT.json: {"results": {name: {"peak_device_bytes" (max over ranks), "host_bytes",
"breakdown", "status", "error"}}}.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def main(argv: list[str]) -> int:
    import torch.distributed as dist

    from autotune.presets import load_model_config
    from trials.dist import build_mesh, init_mesh
    from trials.runner import run_trial

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
        record = run_trial({"model_config": model_config, "techniques": case["techniques"],
                            "seq_len": spec["seq_len"], "steps": 1, "warmup": 0, "capacity_bytes": None,
                            "seed": 0}, mesh=meshes[sp])
        peak = torch.tensor([record["peak_device_bytes"]], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        results[case["name"]] = {"peak_device_bytes": int(peak.item()), "host_bytes": record["host_bytes"],
                                 "breakdown": record["breakdown"], "status": record["status"],
                                 "error": record["error"], "step_time_s": record.get("step_time_s")}
        if int(os.environ.get("RANK", 0)) == 0:
            print(case["name"], json.dumps(results[case["name"]]), flush=True)
    if int(os.environ.get("RANK", 0)) == 0:
        Path(argv[1]).write_text(json.dumps({"results": results}, indent=1))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
