"""What the commands that run trials check and choose before the first one starts: the hardware a local trial
runs on, this node's devices and attention kernels, the agents of several nodes, a depth, a node's GPU count.
Each refusal is a ``UserError`` (bad input: one line, exit 2)."""

from __future__ import annotations

import dataclasses

import torch

from autotune.backends.local import DEPTHS, visible_devices
from autotune.core.errors import UserError
from autotune.core.hardware import HOST_PRESET, Hardware, load_hardware


def trial_hardware(backend_name: str, hardware: str, memory_gib: float | None) -> Hardware:
    """The preset the records are for. Local trials on a CPU-only machine run on the ``cpu`` preset with
    ``memory_gib`` per rank; on a GPU node the preset's capacity is the card's own (an H100 80GB has 79.65 GiB,
    not the 80 its name says)."""
    preset = load_hardware(hardware)
    if backend_name == "local" and not torch.cuda.is_available():
        preset = load_hardware(HOST_PRESET)
    elif backend_name == "local":
        card = torch.cuda.get_device_properties(0).total_memory
        preset = dataclasses.replace(preset, device_memory_bytes=card)
    return preset.with_memory_gib(memory_gib)


def check_depth(depth: str) -> str:
    if depth not in DEPTHS:
        raise UserError(f"--depth must be one of {', '.join(DEPTHS)}, got {depth!r}")
    return depth


def check_local_node(gpus: int, attention: str | None = None) -> None:
    """What a real trial on this node needs before it starts: enough visible devices, and its ``attention`` kernel
    installed and built for this node's GPU generation (``trials.kernels.registry``; torch's SDPA runs anywhere)."""
    visible = visible_devices()
    if visible and gpus > visible:
        raise UserError(
            f"--gpus {gpus} but this node shows {visible} CUDA device(s) (CUDA_VISIBLE_DEVICES limits them)"
        )
    if attention:
        from trials.kernels.registry import refusal, this_node_compute_capability

        line = refusal(attention, this_node_compute_capability() if visible else None)
        if line:
            raise UserError(line)


def check_node_size(hw: Hardware, gpus: int, nodes: int) -> None:
    """``--gpus`` counts one node's devices: more than a node of this preset has is several nodes."""
    if hw.gpus_per_node and gpus > hw.gpus_per_node:
        per, world = hw.gpus_per_node, gpus * nodes
        hint = f" (for {world} GPUs: --nodes {world // per} --gpus {per})" if world % per == 0 else ""
        raise UserError(f"--gpus {gpus}: a {hw.name} node has {per} GPUs, and --gpus counts one node's{hint}")


def open_node_group(nodes: int, rdzv_endpoint: str | None, backend_name: str = "local"):
    """The agents of a command running real trials over several nodes (``autotune.backends.nodes``), or None."""
    if rdzv_endpoint is not None and (nodes < 2 or backend_name != "local"):
        raise UserError(
            "--rdzv-endpoint is for real trials over several nodes: give it with --nodes 2 or more (local backend)"
        )
    if backend_name != "local" or nodes < 2:
        return None
    if rdzv_endpoint is None:
        raise UserError(
            f"--nodes {nodes} runs real trials on every node: give --rdzv-endpoint HOST:PORT, the same on every node"
        )
    from autotune.backends.nodes import NodeGroup

    return NodeGroup.open(rdzv_endpoint, nodes)


def broken_flash_warning() -> str | None:
    """flash-attn installed but not importable (an ABI mismatch with torch, a missing CUDA library) makes
    ``flash`` vanish from a search on a GPU node: the warning that says so, with the import error; else None."""
    from trials.kernels.registry import broken_import

    error = broken_import("flash")
    if error:
        return (
            f"flash-attn is installed but cannot be imported ({error}); attention 'flash' is left out of this search "
            "(reinstall it with bin/setup-gpu)"
        )
    return None
