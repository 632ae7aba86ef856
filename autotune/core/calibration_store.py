"""Where a calibration of this machine lives, and how its measurements become time-model rates.

A calibration (``autotune.timing.calibration``, run only when asked for) measures the ``cpu`` preset's rates on
this machine, per world size (CPU trial ranks share the cores). It is cached as JSON under
``$AUTOTUNE_CACHE_DIR``, ``$XDG_CACHE_HOME/autotune`` or ``~/.cache/autotune``, keyed by machine (host, CPU
model, core count, torch version, calibration version); ``autotune.core.hardware`` applies a cached
calibration of this machine to presets that simulate the device on the host. Reading it never measures.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
from pathlib import Path

VERSION = 15
CPU_ATTENTION_TILE_Q = 256  # torch's CPU flash kernel: q split 256 for q_seq_len >= 768
CPU_ATTENTION_TILE_KV = 512  # and kv split 512 (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp)


def cache_path() -> Path:
    base = os.environ.get("AUTOTUNE_CACHE_DIR")
    if base:
        return Path(base) / "cpu_calibration.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".cache"
    return root / "autotune" / "cpu_calibration.json"


def machine_key() -> dict:
    import torch

    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "version": VERSION,
        "host": socket.gethostname(),
        "cpu": model,
        "cpus": os.cpu_count() or 1,
        "torch": str(torch.__version__),
    }


def load_cached() -> dict | None:
    """This machine's cached calibration, or None (none yet, another machine's, or unreadable)."""
    path = cache_path()
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if data.get("machine") == machine_key() else None


def save(data: dict) -> Path:
    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
    return path


def rates_from_calibration(calibration: dict, world_size: int) -> dict:
    """The ``Rates`` fields of a calibration for a trial of ``world_size`` ranks on the calibrated machine."""
    per_world = calibration["worlds"]
    keys = sorted(int(k) for k in per_world)
    chosen = max((k for k in keys if k <= max(1, world_size)), default=keys[0])
    m = per_world[str(chosen)]
    in_step = m.get("in_step") or {}
    matmul = in_step.get("matmul_flops", m["matmul_flops"])  # the in-step rate is what a trial sees
    factor = in_step.get("attention_factor", 1.0)
    attention = {
        int(d): (fwd * factor / matmul, bwd * factor / matmul) for d, (fwd, bwd) in m["attention_flops"].items()
    }
    values = {
        "bf16_flops": matmul,
        "matmul_efficiency": 1.0,
        "attention_by_head_dim": tuple(sorted(attention.items())),
        "attention_efficiency": attention[max(attention)][0],
        "attention_backward_efficiency": attention[max(attention)][1],
        "attention_tile_q": CPU_ATTENTION_TILE_Q,
        "attention_tile_kv": CPU_ATTENTION_TILE_KV,
        "hbm_bytes_per_s": in_step.get("elementwise_bytes_per_s", m["elementwise_bytes_per_s"]),
        "elementwise_efficiency": 1.0,
        "elementwise_traffic_factor": 1.0,
        "host_bytes_per_s": m["memcpy_bytes_per_s"],
        "host_copy_efficiency": 1.0,
        "host_optimizer_bytes_per_s": in_step.get("optimizer_bytes_per_s", m["optimizer_bytes_per_s"]),
        "op_overhead_s": m["op_overhead_s"],
        "collective_wait_s": m.get("collective_wait_s", 0.0),
        "view_overhead_s": m["view_overhead_s"],
        "launch_overlaps_compute": False,
    }
    # gloo: measured per world of 2+ ranks; a 1-rank trial has no collectives; a world between measured ones takes
    # the nearest measured world below it
    gloo = next(
        (
            per_world[str(k)].get("gloo")
            for k in sorted(keys, reverse=True)
            if k <= max(2, chosen) and per_world[str(k)].get("gloo")
        ),
        None,
    )
    if gloo:
        link = gloo["all_to_all"]["bytes_per_s"]
        values.update(
            {
                "intra_node_bytes_per_s": link,
                "all_to_all_efficiency": 1.0,
                "all_gather_efficiency": gloo["all_gather"]["bytes_per_s"] / link,
                "reduce_scatter_efficiency": gloo["reduce_scatter"]["bytes_per_s"] / link,
                "all_reduce_efficiency": gloo["all_reduce"]["bytes_per_s"] / link,
                "collective_latency_s": statistics.median(
                    gloo[k]["latency_s"] for k in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
                ),
            }
        )
    return values
