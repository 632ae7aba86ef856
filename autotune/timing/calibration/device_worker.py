"""One rank of a device calibration: ``python -m autotune.timing.calibration.device_worker SETTINGS_JSON OUT_DIR``
(under ``torchrun --nproc-per-node N`` for the node's collectives). Rank 0 runs the single-device benchmarks
(``device_bench``); every rank runs the collectives; rank 0 writes ``OUT_DIR/device.json``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

from autotune.timing.calibration import device_bench as bench
from trials.core.dist import process_group_backend


def _say(rank: int, message: str) -> None:
    if rank == 0:
        print(f"progress: {message}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    settings, out_dir = json.loads(Path(argv[0]).read_text()), Path(argv[1])
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dtype = torch.bfloat16
    else:
        device, dtype = torch.device("cpu"), torch.float32
    small = settings.get("small", False)
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world,
        "dtype": str(dtype).replace("torch.", ""),
        "torch": str(torch.__version__),
    }
    if rank == 0:
        tokens = 256 if small else bench.GEMM_TOKENS
        _say(rank, f"GEMMs at {settings['model_name']}'s shapes ({tokens} tokens)")
        result["gemm"] = bench.measure_gemms(device, dtype, bench.gemm_shapes(settings["model_config"], tokens))
        lengths, heads = ((256, 1024), (1, 2)) if small else (bench.ATTENTION_LENGTHS, bench.ATTENTION_HEADS)
        _say(rank, f"attention forward/backward at {', '.join(map(str, lengths))} tokens x {heads} heads")
        result["attention"] = bench.measure_attention(
            device,
            dtype,
            settings["head_dim"],
            settings["tile_q"],
            settings["tile_kv"],
            lengths,
            heads,
            tiles=settings.get("tiles"),
        )
        _say(rank, "elementwise ops, host copies, host AdamW")
        result["elementwise"] = bench.measure_elementwise(device, dtype, 1 << 16 if small else 1 << 26)
        result["host_copies"] = bench.measure_host_copies(device, 1 << 16 if small else 1 << 28)
        result["host_optimizer"] = bench.measure_host_optimizer(settings["host_threads"], 1 << 14 if small else 1 << 24)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group(process_group_backend(device), device_id=device if device.type == "cuda" else None)
        _say(rank, f"collectives over {world} ranks")
        sizes = (1 << 8, 1 << 14, 1 << 16) if small else (1 << 10, 1 << 22, 1 << 24)
        result["collectives"] = bench.measure_collectives(device, dtype, sizes)
        dist.barrier()
        dist.destroy_process_group()
    if rank == 0:
        (out_dir / "device.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
