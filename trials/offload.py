"""Activation offload: the checkpointed input of the first N decoder layers lives on the host between forward and
backward.

With activation checkpointing, a layer keeps exactly one tensor across the step: its input ``[b, s_l, h]``
(torch's non-reentrant checkpoint saves the checkpointed function's positional inputs through autograd, in
``_NoopSaveInputs``, before it starts its own recompute hooks). ``offloading_checkpoint`` wraps that checkpoint
call in ``torch.autograd.graph.saved_tensors_hooks`` whose pack hook sees exactly those inputs:

    forward,  layer i < N:  pack(hidden_i)  -> copy to a host buffer (CUDA: pinned memory, on a side stream,
                            non-blocking; the device tensor is kept alive by ``record_stream`` until the copy
                            ends); returns a handle, so autograd no longer references the device tensor and
                            it is freed when the model's loop moves on to the next layer.
    backward, layer i:      unpack(handle_i) -> the device copy of hidden_i (already prefetched by layer i+1, or
                            copied now), and start prefetching hidden_{i-1} (side stream, H2D) so that copy
                            overlaps layer i's recompute + backward: "one layer ahead".
    layers >= N:            pack keeps the tensor on the device; the handle of layer N still prefetches layer N-1.

On a CPU-only machine the "device" is simulated (``trials.memory.DeviceMemoryTracker``): the host copy is a real,
separate tensor that is ``mark_host``-ed, so the tracker sees the layer inputs' bytes leave the device and come
back one layer ahead in backward. Nothing here depends on tensor values (runs under FakeTensorMode), and the copies
are exact, so losses and gradients are unchanged.

Composes with FSDP2 (``fully_shard`` of the wrapped layer): FSDP's pre-forward hook hands the checkpoint an alias
of the input; that alias is what the pack hook receives and what is copied.
"""

from __future__ import annotations

import torch
from torch.autograd.graph import saved_tensors_hooks

from trials.memory import active_tracker


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class _SavedInput:
    """One checkpointed layer input, on the device or (offloaded) on the host."""

    __slots__ = ("device_tensor", "host_tensor", "event", "previous", "stream", "device")

    def __init__(self, tensor: torch.Tensor, offload: bool, previous: _SavedInput | None, stream):
        self.previous = previous  # the input of the layer before this one (same forward), to prefetch
        self.stream = stream
        self.event = None
        self.host_tensor = None
        self.device_tensor = tensor
        if offload:
            self._to_host(tensor)

    def _to_host(self, tensor: torch.Tensor) -> None:
        if self.stream is not None:  # CUDA: pinned buffer, side stream, the device memory lives until the copy ends
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self.stream):
                host.copy_(tensor, non_blocking=True)
                tensor.record_stream(self.stream)
        else:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            host.copy_(tensor)
            tracker = active_tracker()
            if tracker is not None:
                tracker.mark_host(host)
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
        host = self.host_tensor
        if self.stream is not None:
            current = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(current)
            with torch.cuda.stream(self.stream):
                device_tensor = torch.empty(host.shape, dtype=host.dtype, device=self.device)
                device_tensor.copy_(host, non_blocking=True)
                self.event = self.stream.record_event()
            device_tensor.record_stream(current)
        else:
            device_tensor = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            device_tensor.copy_(host)
        self.device_tensor = device_tensor

    def get(self) -> torch.Tensor:
        self.prefetch()
        if self.event is not None:
            torch.cuda.current_stream(self.device).wait_event(self.event)
            self.event = None
        if self.previous is not None:
            self.previous.prefetch()  # the next layer backward needs: overlap its copy with this layer
            self.previous = None
        tensor = self.device_tensor
        if self.offloaded:
            # the recompute owns the device copy now; the host copy stays (until autograd frees this handle)
            # in case the graph is unpacked again (retain_graph)
            self.device_tensor = None
        return tensor


class ActivationOffload:
    """Per-model state: which layers offload, the copy stream, the last saved input of the running forward."""

    def __init__(self, offload_layers: int):
        self.offload_layers = offload_layers
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
                saved = _SavedInput(tensor, offload, self._last, self.stream_for(tensor))
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
