"""Attention kernels: one declaration per kernel the ``attention`` knob can name.

Each ``AttentionKernel`` says what a kernel is as far as trials, the oracle, the search and the exports care: the
GPU generations it runs on, where its Python entry points live, its tensor layout, the PyPI distribution that
installs it, and the name each trainer knows it by. Everything else (whether it is installed here, which kernels a
hardware preset offers, what an export writes) derives from these declarations.

Nothing here imports torch or a kernel package: detection imports lazily.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class AttentionKernel:
    name: str  # the ``attention`` knob's value
    description: str
    layout: str  # "bshd" (flash-attn's [batch, seq, heads, dim]) | "bhsd" (torch SDPA's)
    module: str | None  # the Python module of its entry points (None: torch itself)
    package: str | None  # what installs it (``bin/setup-gpu``); None: ships with torch
    compute_capabilities: tuple[int, ...]  # CUDA compute-capability majors it runs on; () = any device, CPU too
    hf_implementation: str  # transformers' ``attn_implementation`` (what DeepSpeed/Accelerate/ArcticTraining pass)

    def installed(self) -> bool:
        """Whether its entry points import in this process (torch's SDPA always does)."""
        if self.module is None:
            return True
        try:
            importlib.import_module(self.module)
        except Exception:  # absent, or present but broken (an ABI mismatch): not usable either way
            return False
        return True

    def runs_on(self, compute_capability_major: int | None) -> bool:
        """Whether it runs on a GPU of this generation (None: a CPU)."""
        if not self.compute_capabilities:
            return True
        return compute_capability_major in self.compute_capabilities


KERNELS: dict[str, AttentionKernel] = {
    kernel.name: kernel
    for kernel in (
        AttentionKernel(
            "sdpa",
            "torch's scaled_dot_product_attention (its CPU flash kernel; memory-efficient or flash on CUDA)",
            layout="bhsd",
            module=None,
            package=None,
            compute_capabilities=(),
            hf_implementation="sdpa",
        ),
        AttentionKernel(
            "flash",
            "FlashAttention-2 (flash-attn)",
            layout="bshd",
            module="flash_attn",
            package="flash-attn",
            compute_capabilities=(8, 9),
            hf_implementation="flash_attention_2",
        ),
        AttentionKernel(
            "flash3",
            "FlashAttention-3 (Hopper; flash-attention's hopper/ package, flash_attn_interface)",
            layout="bshd",
            module="flash_attn_interface",
            package="flash-attn-3",
            compute_capabilities=(9,),
            hf_implementation="flash_attention_3",
        ),
        AttentionKernel(
            "flash4",
            "FlashAttention-4 (CuTe DSL; flash-attn-4, flash_attn.cute)",
            layout="bshd",
            module="flash_attn.cute",
            package="flash-attn-4",
            compute_capabilities=(10,),
            hf_implementation="flash_attention_4",
        ),
    )
}
KERNEL_NAMES = tuple(KERNELS)
FLASH_KERNELS = tuple(name for name, kernel in KERNELS.items() if kernel.layout == "bshd")
