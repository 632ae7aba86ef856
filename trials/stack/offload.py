"""Activation offload: the checkpointed input of the first N decoder layers lives on the host between forward and
backward.

With activation checkpointing, a layer keeps exactly one tensor across the step: its input ``[b, s_l, h]``
(torch's non-reentrant checkpoint saves the checkpointed function's positional inputs through autograd, in
``_NoopSaveInputs``, before it starts its own recompute hooks). ``offloading_checkpoint`` wraps that checkpoint
call in ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook sees exactly those inputs:

    forward,  layer i < N:  pack(hidden_i)  -> copy into layer i's host buffer (CUDA: on a side stream,
                            non-blocking; the device tensor is kept alive by ``record_stream`` until the copy
                            ends); returns a handle, so autograd no longer references the device tensor and
                            it is freed when the model's loop moves on to the next layer.
    backward, layer i:      unpack(handle_i) -> the device copy of hidden_i (prefetched when layer i+1's backward
                            ended, or copied now); when layer i's backward ends (the gradient of hidden_i is
                            computed: a hook on it), start copying hidden_{i-1} back (side stream, H2D), so the
                            copy runs while FSDP moves from layer i to layer i-1 and never adds to layer i's peak,
                            where the backward's largest temporaries live. Layer i-1's recompute waits for it: the
                            copy's bytes are ``PREFETCH_SCOPE``'s, which the time model prices exposed.
    layers >= N:            pack keeps the tensor on the device; the hook of layer N still prefetches layer N-1.

Host buffers (``HostArena``): one per offloaded layer, allocated at its first forward and reused by every later
step, so the host memory activation offload holds is exactly the offloaded inputs' bytes, allocated once. On CUDA
a buffer is an anonymous ``mmap`` page-locked with ``cudaHostRegister`` (unregistered when its storage is freed),
not a block of torch's caching host allocator (``torch.empty(pin_memory=True)``), whose block sizes and reuse
follow its settings and, in torch 2.13, can hand a request a smaller cached block (``trials.core.allocator``). Both copies of a buffer
(D2H in forward, H2D in backward) run on the one side stream, so the next step's write into it starts after this
step's read. A buffer holds the input of the latest forward: that forward's backward must run before the next
forward of the model (as in a training step); a backward of an older graph raises instead of reading the newer
input.

On a CPU-only machine the "device" is simulated (``trials.core.memory.DeviceMemoryTracker``): the host buffers are
made inside ``tracker.on_host()``, so the tracker counts them as host bytes once, from their allocation on, and
sees the layer inputs' bytes leave the device and come back one layer ahead in backward. The memory oracle traces
this same code on fake tensors, so its host bytes are the arena's. Nothing here depends on tensor values (runs
under FakeTensorMode), and the copies are exact, so losses and gradients are unchanged.

Composes with FSDP2 (``fully_shard`` of the wrapped layer): FSDP's pre-forward hook hands the checkpoint an alias
of the input; that alias is what the pack hook receives and what is copied.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

from trials.core.errors import HostOutOfMemoryError
from trials.core.memory import active_tracker

PREFETCH_SCOPE = "activation_offload::prefetch"  # the ``record_function`` region of the copies back to the device
_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, as torch's own pinning
_CUDA_ERROR_MEMORY_ALLOCATION = 2  # cudaErrorMemoryAllocation: the host cannot page-lock that much


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def pinned_bytes(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory as a uint8 tensor, outside torch's caching host allocator: an anonymous
    mapping (page-aligned, its own pages) registered with CUDA. The tensor's storage keeps the mapping alive; the
    registration ends when the storage is freed (before the mapping goes). The host running out (the mapping
    refused, ENOMEM; the registration refused, cudaErrorMemoryAllocation) raises ``HostOutOfMemoryError``."""
    try:
        mapping = mmap.mmap(-1, nbytes)
    except OSError as exc:
        if exc.errno != errno.ENOMEM:
            raise
        raise HostOutOfMemoryError(f"mapping {nbytes:,} bytes of host memory failed: {exc}") from exc
    buffer = torch.frombuffer(mapping, dtype=torch.uint8)
    ptr = buffer.data_ptr()
    error = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    if error == _CUDA_ERROR_MEMORY_ALLOCATION:
        raise HostOutOfMemoryError(
            f"cudaHostRegister of {nbytes:,} bytes of host memory failed: cudaError {error} (out of memory)"
        )
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes:,} bytes of host memory failed: cudaError {error}")
    finalizer = weakref.finalize(buffer.untyped_storage(), _unregister, ptr)
    finalizer.atexit = False  # at interpreter exit the CUDA context may be gone; the process's pages go with it
    return buffer


class _Slot:
    """One layer's host buffer (flat bytes) and the saved input whose copy it holds now."""

    __slots__ = ("flat", "owner")

    def __init__(self, flat: torch.Tensor):
        self.flat = flat
        self.owner: _SavedInput | None = None


class HostArena:
    """The offloaded layers' host buffers: one per layer, allocated at its first forward, reused every step.

    A buffer grows (is replaced by a larger one) only if a later input is larger; a smaller one uses its first
    bytes. ``pinned``: page-locked memory outside torch's caching host allocator (``pinned_bytes``, CUDA);
    otherwise a CPU tensor (fake under FakeTensorMode), counted by the active tracker as host memory."""

    def __init__(self):
        self._slots: dict[int, _Slot] = {}

    def slot(self, layer_index: int, like: torch.Tensor, pinned: bool) -> _Slot:
        nbytes = like.numel() * like.element_size()
        slot = self._slots.get(layer_index)
        if slot is None or slot.flat.numel() < nbytes:
            slot = self._slots[layer_index] = _Slot(self._allocate(nbytes, pinned))
        return slot

    @staticmethod
    def _allocate(nbytes: int, pinned: bool) -> torch.Tensor:
        tracker = active_tracker()
        with tracker.on_host() if tracker is not None else contextlib.nullcontext():
            flat = pinned_bytes(nbytes) if pinned else torch.empty(nbytes, dtype=torch.uint8, device="cpu")
            if tracker is not None:
                tracker.track(flat)  # made outside dispatch (pinned): the tracker learns of it here
        return flat

    def buffers(self) -> dict[int, torch.Tensor]:
        """{layer index: its flat host buffer}."""
        return {index: slot.flat for index, slot in sorted(self._slots.items())}

    @property
    def nbytes(self) -> int:
        return sum(slot.flat.numel() for slot in self._slots.values())


def _host_view(slot: _Slot, like: torch.Tensor) -> torch.Tensor:
    """The first bytes of ``slot``'s buffer as a contiguous tensor of ``like``'s shape and dtype."""
    nbytes = like.numel() * like.element_size()
    return slot.flat[:nbytes].view(like.dtype).view(like.shape)


class _SavedInput:
    """One checkpointed layer input, on the device or (offloaded) in its layer's host buffer."""

    __slots__ = ("device_tensor", "host_tensor", "slot", "layer_index", "event", "previous", "stream", "device")

    def __init__(
        self, tensor: torch.Tensor, slot: _Slot | None, layer_index: int, previous: _SavedInput | None, stream
    ):
        self.previous = previous  # the input of the layer before this one (same forward), to prefetch
        self.stream = stream
        self.event = None
        self.host_tensor = None
        self.slot = slot
        self.layer_index = layer_index
        self.device_tensor = tensor
        if slot is not None:
            self._to_host(tensor, slot)

    def _to_host(self, tensor: torch.Tensor, slot: _Slot) -> None:
        host = _host_view(slot, tensor)
        slot.owner = self
        if self.stream is not None:  # CUDA: side stream, the device memory lives until the copy ends
            self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self.stream)
        else:
            host.copy_(tensor)
        self.host_tensor = host
        self.device = tensor.device
        self.device_tensor = None

    @property
    def offloaded(self) -> bool:
        return self.host_tensor is not None

    def prefetch(self) -> None:
        """Start the host -> device copy (no-op if already on the device)."""
        if self.device_tensor is not None or self.host_tensor is None:
            return
        if self.slot.owner is not self:
            raise RuntimeError(
                f"activation offload: layer {self.layer_index}'s host buffer holds the input of a later forward; "
                "a backward must run before the model's next forward"
            )
        host = self.host_tensor
        # allocated on the consuming (current) stream, so its block returns to that stream's pool when freed;
        # record_stream keeps the block from reuse until the side stream's copy into it is done
        device_tensor = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        with torch.profiler.record_function(PREFETCH_SCOPE):
            if self.stream is not None:
                self.stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.stream):
                    device_tensor.copy_(host, non_blocking=True)
                    self.event = self.stream.record_event()
                device_tensor.record_stream(self.stream)
            else:
                device_tensor.copy_(host)
        self.device_tensor = device_tensor

    def get(self) -> torch.Tensor:
        self.prefetch()
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.event = None
        if self.previous is not None:  # no hook on this layer's input (it needs no gradient): start it now
            self.previous.prefetch()
            self.previous = None
        tensor = self.device_tensor
        if self.offloaded:
            # the recompute owns the device copy now; the host copy stays (until the next forward overwrites it)
            # in case the graph is unpacked again (retain_graph)
            self.device_tensor = None
        return tensor


def _prefetch_when_done(previous: _SavedInput):
    """A gradient hook on layer i's input: its gradient is layer i's backward done, so layer i-1's input comes back
    now. It holds the earlier layer's entry only (a host copy), never the tensor it hooks."""

    def hook(grad):
        previous.prefetch()

    return hook


class ActivationOffload:
    """Per-model state: which layers offload, their host buffers, the copy stream, the last saved input of the
    running forward."""

    def __init__(self, offload_layers: int):
        self.offload_layers = offload_layers
        self.arena = HostArena()
        self._last: _SavedInput | None = None
        self._stream = None

    def stream_for(self, tensor: torch.Tensor):
        if tensor.device.type != "cuda" or _is_fake(tensor) or not torch.cuda.is_available():
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(tensor.device)
        return self._stream

    def checkpoint_fn(self, layer_index: int):
        """A ``checkpoint_wrapper`` ``checkpoint_fn`` for decoder layer ``layer_index``."""
        from torch.utils.checkpoint import checkpoint

        offload = layer_index < self.offload_layers

        def offloading_checkpoint(function, *args, **kwargs):
            if layer_index == 0:
                self._last = None  # a new forward starts: no previous layer to prefetch
            # autograd keeps the pack hook alive as long as the saved tensor: it must not hold the input itself,
            # hence a list that is emptied once the checkpoint has saved it
            target = [args[0]]
            entry: list[_SavedInput] = []

            def pack(tensor):
                if not target or tensor is not target[0]:
                    return tensor
                target.clear()
                stream = self.stream_for(tensor)
                slot = self.arena.slot(layer_index, tensor, pinned=stream is not None) if offload else None
                saved = _SavedInput(tensor, slot, layer_index, self._last, stream)
                if saved.previous is not None and tensor.requires_grad:
                    tensor.register_hook(_prefetch_when_done(saved.previous))
                    saved.previous = None
                entry.append(saved)
                return saved

            def unpack(saved):
                return saved.get() if isinstance(saved, _SavedInput) else saved

            with saved_tensors_hooks(pack, unpack):
                out = checkpoint(function, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)
            target.clear()
            # only offloaded inputs are worth prefetching; layers >= N keep theirs on the device
            self._last = entry[0] if entry and entry[0].offloaded else None
            entry.clear()
            return out

        return offloading_checkpoint
