"""Device memory accounting: live tensor bytes by category, a capacity, and the peak.

On CUDA the allocator is the truth (``torch.cuda.max_memory_allocated``) and the card's capacity raises OOM.
On a CPU-only machine the "device" is simulated: ``DeviceMemoryTracker`` is a TorchDispatchMode that sees
every tensor an op produces, counts each distinct storage once (views share storage), subtracts it when the
storage is freed (weakref finalizer), and follows ``UntypedStorage.resize_`` (FSDP2 frees and re-allocates
unsharded parameters that way, invisibly to dispatch). When the live total crosses ``capacity_bytes`` it
raises ``torch.OutOfMemoryError`` right after the op that allocated it, so OOM, early abort and pruning are
real on CPU too. Tensors explicitly moved to the host (activation offload) are ``mark_host``-ed: they leave
the device count and are summed as host bytes. Code that moves tensors to the host finds the tracker with
``active_tracker()`` (the innermost one entered, or None). With optimizer offload, ``host_phases`` holds
"optimizer": every storage created while stepping the optimizer is host memory (states, temporaries), as on a
GPU node where the step runs on the CPU.

Categories (DESIGN.md breakdown): params, grads, optimizer, activations, temporaries, other. A new storage
is categorised by the phase it appears in (forward -> activations, backward -> temporaries, optimizer step
-> optimizer, otherwise other); ``retag`` re-labels known tensors (parameters, gradients), and storages
that FSDP resizes are unsharded parameters.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only
from torch.utils.weak import WeakIdKeyDictionary

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "other")
_PHASE_CATEGORY = {"forward": "activations", "backward": "temporaries", "optimizer": "optimizer"}
_ACTIVE_TRACKERS: list["DeviceMemoryTracker"] = []


def active_tracker() -> "DeviceMemoryTracker | None":
    """The innermost ``DeviceMemoryTracker`` currently entered (None outside any, e.g. on CUDA)."""
    return _ACTIVE_TRACKERS[-1] if _ACTIVE_TRACKERS else None


@dataclass
class _StorageInfo:
    nbytes: int
    category: str
    host: bool = False


class DeviceMemoryTracker(TorchDispatchMode):
    """Live tensor bytes on the (simulated) device, with an optional capacity that raises OOM."""

    def __init__(self, capacity_bytes: int | None = None):
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.phase = "other"
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._refs: list = []
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_device_bytes = 0
        self.peak_host_bytes = 0
        self.peak_breakdown = dict(self.current)
        self.host_phases: set[str] = set()  # phases whose new storages live on the host
        self._on_host = 0  # > 0 inside ``on_host()``
        self._orig_resize = None

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _add(self, info: _StorageInfo, sign: int) -> None:
        if info.host:
            self.host_bytes += sign * info.nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        else:
            self.current[info.category] += sign * info.nbytes
            self.device_bytes += sign * info.nbytes

    def _on_free(self, info: _StorageInfo, _ref) -> None:
        self._add(info, -1)

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if hasattr(tensor, "_local_tensor"):  # DTensor: the local shard is what lives here
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        info = self._storages.get(storage)
        if info is None:
            info = _StorageInfo(storage.nbytes(), category or _PHASE_CATEGORY.get(self.phase, "other"),
                                host=self._on_host > 0 or self.phase in self.host_phases)
            self._storages[storage] = info
            weakref.finalize(storage, self._on_free, info, None)
            self._add(info, +1)
        elif category is not None and category != info.category and not info.host:
            self.current[info.category] -= info.nbytes
            self.current[category] += info.nbytes
            info.category = category

    def retag(self, tensors, category: str) -> None:
        for tensor in tensors:
            if tensor is not None:
                self.track(tensor, category)

    @contextlib.contextmanager
    def on_host(self):
        """Storages made inside live on the host (e.g. weights drawn on the host before a shard is copied)."""
        self._on_host += 1
        try:
            yield
        finally:
            self._on_host -= 1

    def mark_host(self, tensor: torch.Tensor) -> None:
        """``tensor`` lives in host memory (offloaded): count it as host bytes, not device bytes."""
        self.track(tensor)
        info = self._storages.get(tensor.untyped_storage())
        if info is not None and not info.host:
            self._add(info, -1)
            info.host = True
            self._add(info, +1)

    def _check(self) -> None:
        if self.device_bytes > self.peak_device_bytes:
            self.peak_device_bytes = self.device_bytes
            self.peak_breakdown = dict(self.current)
        if self.capacity_bytes is not None and self.device_bytes > self.capacity_bytes:
            raise torch.OutOfMemoryError(
                f"simulated device out of memory: {self.device_bytes:,} bytes live > capacity "
                f"{self.capacity_bytes:,} bytes (phase {self.phase})"
            )

    @contextlib.contextmanager
    def in_phase(self, phase: str):
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def reset_peak(self) -> None:
        self.peak_device_bytes = self.device_bytes
        self.peak_breakdown = dict(self.current)
        self.peak_host_bytes = self.host_bytes

    # -- the mode ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self.track, out)
        self._check()
        return out

    def __enter__(self):
        tracker = self
        self._orig_resize = orig = torch.UntypedStorage.resize_

        def resize_(storage, size):
            result = orig(storage, size)
            info = tracker._storages.get(storage)
            if info is not None and info.nbytes != storage.nbytes():
                tracker._add(info, -1)
                info.nbytes = storage.nbytes()
                if not info.host:  # storages FSDP resizes are unsharded parameters
                    info.category = "params"
                tracker._add(info, +1)
                tracker._check()
            return result

        torch.UntypedStorage.resize_ = resize_
        _ACTIVE_TRACKERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        if self in _ACTIVE_TRACKERS:
            _ACTIVE_TRACKERS.remove(self)
        return super().__exit__(*exc)
