"""``autotune calibrate``: measure this node and write a hardware preset that every command accepts.

The written preset is the base preset's memory facts (capacity, runtime overheads, host memory, the oracle's
margin) with the time model's rates measured here:

- a base whose device is the host (``cpu``): the per-world-size CPU calibration (``calibrate``) under
  ``calibration:``, exactly what the shipped ``cpu`` preset carries for a typical machine;
- a GPU base (``h100-sxm``, ...): ``device_bench`` on this node's CUDA devices (``device_worker`` under torchrun
  for the collectives); the base's peaks stay and its efficiencies become the measured ones.

Either way ``calibrated:`` records when, on what, how each rate was measured, and the run-to-run spread.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from autotune.core.errors import UserError
from autotune.core.hardware import Hardware, is_shipped, load_hardware, preset_path, user_preset_dir
from trials.kernels.registry import KERNELS

CPU_HOW = {
    "bf16_flops": "fp32 GEMMs inside one training step of a small Llama, per world size (in_step.matmul_flops)",
    "attention_by_head_dim": "torch's CPU flash kernel forward/backward at head dims 16/64/128, computed tiles",
    "hbm_bytes_per_s": "output bytes/s of the elementwise ops inside one training step",
    "host_bytes_per_s": "memcpy of 1-16 MiB tensors into fresh buffers",
    "host_optimizer_bytes_per_s": "torch AdamW(foreach=False) inside one training step",
    "op_overhead_s": (
        "host seconds per dispatched op of a 16-token training step under the memory tracker, "
        "outside its kernels (wall time minus the timed kernels and the collectives)"
    ),
    "gloo": "all-to-all/all-gather/reduce-scatter/all-reduce over 2 ranks, latency + bytes/bandwidth",
}
DEVICE_HOW = {
    "matmul_efficiency": "GEMMs at the model's projection shapes (8K tokens), forward and backward: FLOP/s / peak",
    "attention_efficiency": "fused causal attention forward at the longest length measured, computed tiles / peak",
    "attention_backward_efficiency": "the same, backward (forward+backward minus forward)",
    "attention_kernels": (
        "each attention kernel the trials run here (flash-attn 2/3/4 where installed and built for this GPU, SDPA), "
        "timed the same way at its own tiles; kernels not timed keep the base preset's assumed rates"
    ),
    "elementwise_efficiency": "add/mul/silu/copy on 64M-element tensors: output bytes/s x traffic factor / HBM",
    "host_bytes_per_s": "pinned 512 MiB copies, the slower of host->device and device->host",
    "host_optimizer_bytes_per_s": "torch AdamW(foreach=False) on the host with one rank's share of the cores",
    "collective_efficiency": "NCCL collectives over the node's GPUs (4 KiB..64 MiB): bytes/s / link, latency",
}


def default_base() -> str:
    """The preset matching this node's devices: ``cpu`` without CUDA, else by the device's name."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    name = torch.cuda.get_device_name(0).lower()
    for key, preset in (("b200", "b200"), ("h200", "h200"), ("h100", "h100-sxm"), ("a100", "a100-80g")):
        if key in name:
            return preset
    raise UserError(
        f"no shipped preset matches {torch.cuda.get_device_name(0)!r}: pass --hardware BASE "
        f"(the preset whose memory facts to keep)"
    )


def calibrate_preset(
    base_name: str, name: str, gpus: int, model_config: dict, model_name: str, repeats: int = 2, small: bool = False
) -> dict:
    """The preset mapping for ``name``: ``base_name``'s facts with this node's measured rates."""
    base = load_hardware(base_name)
    path, _ = preset_path(base_name)
    data = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k not in ("calibration", "calibrated")}
    data["name"] = name
    when = time.strftime("%Y-%m-%d %H:%M:%S")
    command = "autotune " + " ".join(sys.argv[1:]) if sys.argv[1:] else "autotune calibrate"
    if base.device_is_host:
        from autotune.timing.calibration import calibrate

        measured = calibrate(quiet=False, repeats=repeats, max_world=gpus)  # trials of up to --gpus ranks
        machine = measured["machine"]
        device = f"{machine['cpu']} ({machine['cpus']} cores, torch {machine['torch']})"
        data["description"] = f"{device}, calibrated {when} (base: {base_name})"
        data["calibration"] = measured
        data["calibrated"] = {
            "device": device,
            "measured_at": when,
            "base": base_name,
            "command": command,
            "how": CPU_HOW,
            "spread": measured.get("spread", {}),
        }
        return data
    measured = measure_device(gpus, model_config, model_name, base, small=small)
    from autotune.timing.calibration.device_bench import device_rates

    rates = device_rates(measured, base)
    data.update({key: value for key, value in rates.items() if key != "attention_kernels"})
    data["attention_kernels"] = {kernel.name: kernel.to_yaml() for kernel in rates["attention_kernels"]}
    device = f"{measured['device']} x{measured['world_size']}"
    data["description"] = f"{device}, calibrated {when} (base: {base_name})"
    data["calibrated"] = {
        "device": device,
        "measured_at": when,
        "base": base_name,
        "command": command,
        "model_shapes": model_name,
        "how": DEVICE_HOW,
        "assumed": ["op_overhead_s", "view_overhead_s", "side_stream_overlap"],
        "spread": _spreads(measured),
        "measurements": measured,
    }
    return data


def measure_device(gpus: int, model_config: dict, model_name: str, base: Hardware, small: bool = False) -> dict:
    """Run ``device_worker`` on ``gpus`` ranks (torchrun when several) and return rank 0's measurements."""
    from autotune.timing.calibration.device_bench import kernel_tiles

    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]
    settings = {
        "model_config": model_config,
        "model_name": model_name,
        "head_dim": head_dim,
        "tile_q": base.rates.attention_tile_q,
        "tile_kv": base.rates.attention_tile_kv,
        "tiles": {name: kernel_tiles(base, name) for name in KERNELS},  # each kernel's, as the base prices it
        "host_threads": max(1, (os.cpu_count() or 1) // max(1, gpus)),
        "small": small,
    }
    with tempfile.TemporaryDirectory(prefix="autotune-calibrate-") as tmp:
        settings_path = Path(tmp) / "settings.json"
        settings_path.write_text(json.dumps(settings))
        module = ["-m", "autotune.timing.calibration.device_worker", str(settings_path), tmp]
        command = (
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *module]
            if gpus > 1
            else [sys.executable, *module]
        )
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("progress: "):
                print(f"calibrating: {line[len('progress: ') :].strip()}", file=sys.stderr, flush=True)
        if proc.wait():
            raise RuntimeError("device calibration failed:\n" + "".join(lines[-30:]))
        return json.loads((Path(tmp) / "device.json").read_text())


def _spreads(measured: dict) -> dict:
    """The largest sample spread of each measurement group."""
    spreads = {}
    for key in ("gemm", "elementwise", "host_copies", "host_optimizer"):
        if key in measured:
            spreads[key] = round(measured[key]["spread"], 4)
    for kernel, points in measured.get("attention", {}).items():
        if points:
            spreads[f"attention_{kernel}"] = round(max(p["spread"] for p in points), 4)
    return spreads


def output_path(name: str | None, output: Path | None) -> tuple[str, Path]:
    """(the preset's name, where to write it): exactly one of ``--name`` (the user preset directory) and ``-o``."""
    if (name is None) == (output is None):
        raise UserError("give exactly one of --name NAME (a user preset) and -o FILE")
    if output is not None:
        return Path(output).stem, Path(output)
    if not name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise UserError(f"--name {name!r}: use letters, digits, '-', '_' and '.' only")
    if is_shipped(name):
        raise UserError(f"--name {name!r} is a shipped preset: choose another name")
    return name, user_preset_dir() / f"{name}.yaml"


def write_preset(data: dict, path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Hardware preset written by `autotune calibrate` ({data['calibrated']['measured_at']}).\n"
        f"# Memory facts from the base preset {data['calibrated']['base']!r}; rates measured on this node\n"
        f"# (calibrated.how says how each was measured). Use: --hardware {data['name']} (or this file).\n"
    )
    tmp = path.with_suffix(".tmp")
    tmp.write_text(header + yaml.safe_dump(data, sort_keys=False, width=120))
    tmp.replace(path)
    load_hardware(str(path))  # what was written must load
    return path
