"""Counting where a step makes the host wait for the device: every read of a tensor's value into Python (``int()``,
``float()``, ``bool()``, ``.item()``) dispatches ``aten._local_scalar_dense``, on the CPU as on CUDA, where it
blocks until the device's queue has run. A step that reads none lets the CPU queue kernels and collectives ahead."""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class HostSyncs(TorchDispatchMode):
    """Records the Python line of each value read (``where``) while active."""

    def __init__(self):
        super().__init__()
        self.where: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            frame = next(
                (f for f in reversed(traceback.extract_stack()[:-1]) if "/torch/" not in f.filename),
                None,
            )
            self.where.append(f"{frame.filename}:{frame.lineno} {frame.line}" if frame else "?")
        return func(*args, **(kwargs or {}))
