"""Device memory accounting: live tensor bytes by category, a capacity, and the peak.

On CUDA the allocator is the truth for the peak (``torch.cuda.max_memory_allocated``) and the card's capacity
raises OOM; the tracker runs there too (no capacity) for the breakdown by category and the host bytes (storages
on the CPU). On a CPU-only machine the "device" is simulated: ``DeviceMemoryTracker`` is a TorchDispatchMode that sees
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

from trials.core import patches

CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "other")
_PHASE_CATEGORY = {"forward": "activations", "backward": "temporaries", "optimizer": "optimizer"}
_ACTIVE_TRACKERS: list[DeviceMemoryTracker] = []


def active_tracker() -> DeviceMemoryTracker | None:
    """The innermost ``DeviceMemoryTracker`` currently entered (None outside any, e.g. on CUDA)."""
    return _ACTIVE_TRACKERS[-1] if _ACTIVE_TRACKERS else None


@dataclass
class StorageInfo:
    """One tracked storage: its bytes, its category, and whether it lives on the host."""

    nbytes: int
    category: str
    host: bool = False


class TrackerListener:
    """Hooks a ``DeviceMemoryTracker`` calls (``add_listener``); override what you need. The memory oracle's
    per-segment peaks and the throughput counter's host transfers are listeners."""

    def on_new_storage(self, tracker: DeviceMemoryTracker, info: StorageInfo, tensor: torch.Tensor) -> None:
        """A storage seen for the first time (``tracker.op`` made it)."""

    def on_change(self, tracker: DeviceMemoryTracker) -> None:
        """Live bytes may have changed; called before the capacity check (which may raise OOM)."""

    def on_phase(self, tracker: DeviceMemoryTracker, phase: str, entering: bool) -> None:
        """``in_phase(phase)`` starts (``entering``) or ends."""

    def on_moved_to_host(self, tracker: DeviceMemoryTracker, tensor: torch.Tensor, nbytes: int) -> None:
        """``mark_host`` moved a device storage of ``nbytes`` to the host (an offload)."""

    def on_free(self, tracker: DeviceMemoryTracker, info: StorageInfo) -> None:
        """A tracked storage was freed (its last reference went away; ``info`` says where it lived)."""

    def on_resize(self, tracker: DeviceMemoryTracker, info: StorageInfo, old_nbytes: int) -> None:
        """A tracked storage changed size in place (``UntypedStorage.resize_``: FSDP2's unsharded parameters)."""


class DeviceMemoryTracker(TorchDispatchMode):
    """Live tensor bytes on the (simulated) device, with an optional capacity that raises OOM."""

    def __init__(self, capacity_bytes: int | None = None, device_type: str = "cpu"):
        """``device_type``: the trial's device. "cpu" = the simulated device (every storage is device memory unless
        marked host); a real accelerator ("cuda") = storages on the CPU are host memory by where they live."""
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self.device_type = device_type
        self.phase = "other"
        self.op = None  # the op being dispatched now (what made a new storage)
        self._storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.device_bytes = 0
        self.host_bytes = 0
        self.peak_device_bytes = 0
        self.peak_host_bytes = 0
        self.peak_breakdown = dict(self.current)
        self.host_phases: set[str] = set()  # phases whose new storages live on the host
        self._on_host = 0  # > 0 inside ``on_host()``
        self._listeners: list[TrackerListener] = []
        self._patches: contextlib.ExitStack | None = None

    def add_listener(self, listener: TrackerListener) -> None:
        self._listeners.append(listener)

    def remove_listener(self, listener: TrackerListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    # -- bookkeeping ---------------------------------------------------------------------------------
    def _add(self, info: StorageInfo, sign: int) -> None:
        if info.host:
            self.host_bytes += sign * info.nbytes
            self.peak_host_bytes = max(self.peak_host_bytes, self.host_bytes)
        else:
            self.current[info.category] += sign * info.nbytes
            self.device_bytes += sign * info.nbytes

    def _on_free(self, info: StorageInfo, _ref) -> None:
        self._add(info, -1)
        for listener in self._listeners:
            listener.on_free(self, info)

    def storage_info(self, tensor: torch.Tensor) -> StorageInfo | None:
        """The tracked storage of ``tensor`` (a DTensor's local shard), or None."""
        if hasattr(tensor, "_local_tensor"):
            tensor = tensor._local_tensor
        return self._storages.get(tensor.untyped_storage())

    def live_storages(self) -> list[StorageInfo]:
        return list(self._storages.values())

    def track(self, tensor: torch.Tensor, category: str | None = None) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
            return
        if hasattr(tensor, "_local_tensor"):  # DTensor: the local shard is what lives here
            tensor = tensor._local_tensor
        storage = tensor.untyped_storage()
        info = self._storages.get(storage)
        if info is None:
            on_host = (
                self._on_host > 0
                or self.phase in self.host_phases
                or (self.device_type != "cpu" and tensor.device.type == "cpu")
            )
            info = StorageInfo(storage.nbytes(), category or _PHASE_CATEGORY.get(self.phase, "other"), host=on_host)
            self._storages[storage] = info
            weakref.finalize(storage, self._on_free, info, None)
            self._add(info, +1)
            for listener in self._listeners:
                listener.on_new_storage(self, info, tensor)
        elif category is not None and category != info.category and not info.host:
            self.current[info.category] -= info.nbytes
            self.current[category] += info.nbytes
            info.category = category

    @property
    def new_storages_on_host(self) -> bool:
        """Whether a storage made now lives on the host (inside ``on_host()``, or in a phase in ``host_phases``)."""
        return self._on_host > 0 or self.phase in self.host_phases

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
        info = self.storage_info(tensor)
        if info is not None and not info.host:
            self._add(info, -1)
            info.host = True
            self._add(info, +1)
            for listener in self._listeners:
                listener.on_moved_to_host(self, tensor, info.nbytes)

    def _check(self) -> None:
        for listener in self._listeners:
            listener.on_change(self)
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
        for listener in self._listeners:
            listener.on_phase(self, phase, True)
        try:
            yield
        finally:
            self.phase = previous
            for listener in self._listeners:
                listener.on_phase(self, phase, False)

    def reset_peak(self) -> None:
        self.peak_device_bytes = self.device_bytes
        self.peak_breakdown = dict(self.current)
        self.peak_host_bytes = self.host_bytes

    # -- the mode ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.op = func
        out = func(*args, **(kwargs or {}))
        tensors = []
        tree_map_only(torch.Tensor, tensors.append, out)
        for tensor in tensors:
            self.track(tensor)
        if tensors:  # not after a query (``prim.device``): C++ asks those where an exception aborts the process
            self._check()
        return out

    def _resized(self, storage) -> None:
        info = self._storages.get(storage)
        if info is not None and info.nbytes != storage.nbytes():
            self._add(info, -1)
            old_nbytes, info.nbytes = info.nbytes, storage.nbytes()
            if not info.host:  # storages FSDP resizes are unsharded parameters
                info.category = "params"
            self._add(info, +1)
            for listener in self._listeners:
                listener.on_resize(self, info, old_nbytes)
            self._check()

    def _shard_made(self, fsdp_param, tensor) -> None:
        """FSDP2 made a local shard: with CPU offload it lives on the host (a no-op ``.to("cpu")`` on CPU)."""
        if fsdp_param.offload_to_cpu:
            self.mark_host(tensor)

    def __enter__(self):

        self._patches = contextlib.ExitStack()
        self._patches.enter_context(patches.storage_resized(self._resized))
        self._patches.enter_context(patches.fsdp_shard_made(self._shard_made))
        _ACTIVE_TRACKERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        if self._patches is not None:
            self._patches.close()
            self._patches = None
        if self in _ACTIVE_TRACKERS:
            _ACTIVE_TRACKERS.remove(self)
        return super().__exit__(*exc)
