"""Where a training step's time goes along the decoder layers: what reduced-depth trials extend to full depth.

A step of a model of L identical layers takes ``head + L * layer + tail``: the head (embedding, the loss and the
LM head, forward and backward) does not depend on depth; each layer's forward and backward (recompute, offload
copies and Ulysses all-to-alls included) is one layer's share; the tail (from the gradient reaching the
embedding through the gradient reduction, the norm and the optimizer step) scales with the parameter count.
``LayerClock`` marks the layer boundaries inside a real step, so one shallow copy of the model yields the time of
a middle layer averaged over its middle layers and steps -- not the difference of two noisy step times.

Marks, in step order (i = layer index, n = layers)::

    start | fwd 0 | fwd 1 | ... | fwd n-1 | fwd end | bwd n-1 | ... | bwd 0 | bwd end | step end
            `----- layer i forward = fwd i+1 - fwd i ---'   `-- layer i backward = bwd i-1 - bwd i --'
                                                             (bwd i: the gradient of layer i's output arrives)

CPU: ``time.perf_counter``; CUDA: events on the current stream, resolved once the step has synchronized.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from trials.core.memory import DeviceMemoryTracker
from trials.trial.segments import hidden_of, layer_input


@dataclass
class StepTimes:
    """One step split along the layers: seconds per decoder layer (forward + backward) and the tail."""

    layer_s: list[float]
    tail_s: float
    step_s: float


class LayerClock:
    """Marks the decoder layers' boundaries during the steps between ``start_step`` and ``finish_step``.

    Installs forward hooks on ``model.layers`` and gradient hooks on their outputs (forward phase only, so a
    checkpoint's recompute does not mark again: the tracker's phase tells a forward from a recompute)."""

    def __init__(self, model, tracker: DeviceMemoryTracker, device: torch.device):
        self.layers = len(model.layers)
        self.cuda = device.type == "cuda"
        self.tracker = tracker
        self._marks: dict[tuple, object] = {}
        self._handles = []
        self._timing = False
        for index, layer in enumerate(model.layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre(index), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._post(index), with_kwargs=True))

    def _stamp(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _mark(self, key: tuple) -> None:
        if self._timing and key not in self._marks:
            self._marks[key] = self._stamp()

    def _pre(self, index: int):
        def hook(module, args, kwargs):
            if self.tracker.phase != "forward":
                return
            self._mark(("fwd", index))
            if index == 0:
                hidden = layer_input(args, kwargs)
                if hidden is not None and hidden.requires_grad:
                    hidden.register_hook(self._grad_mark(("bwd end",)))

        return hook

    def _post(self, index: int):
        def hook(module, args, kwargs, output):
            if self.tracker.phase != "forward":
                return
            if index == self.layers - 1:
                self._mark(("fwd end",))
            hidden = hidden_of(output)
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(self._grad_mark(("bwd", index)))

        return hook

    def _grad_mark(self, key: tuple):
        def hook(grad):
            self._mark(key)

        return hook

    def start_step(self) -> None:
        self._marks = {("start",): self._stamp()}
        self._timing = True

    def finish_step(self) -> StepTimes:
        """Call after the step (and, on CUDA, after synchronizing): its split."""
        self._marks[("step end",)] = self._stamp()
        self._timing = False
        missing = [key for key in self._order() if key not in self._marks]
        if missing:
            raise RuntimeError(f"layer clock: no mark for {missing[:3]} (the layers' hooks did not fire)")
        if self.cuda:
            # elapsed_time needs both events completed: "step end" is recorded here, after the caller's
            # synchronize, and a gradient hook may record on another stream than the one synchronized
            for event in self._marks.values():
                event.synchronize()
            start = self._marks[("start",)]
            at = {key: start.elapsed_time(event) / 1e3 for key, event in self._marks.items()}
        else:
            at = dict(self._marks)
        n = self.layers
        forward = [at[("fwd", i + 1) if i + 1 < n else ("fwd end",)] - at[("fwd", i)] for i in range(n)]
        backward = [at[("bwd", i - 1) if i > 0 else ("bwd end",)] - at[("bwd", i)] for i in range(n)]
        return StepTimes(
            layer_s=[f + b for f, b in zip(forward, backward)],
            tail_s=at[("step end",)] - at[("bwd end",)],
            step_s=at[("step end",)] - at[("start",)],
        )

    def _order(self) -> list[tuple]:
        n = self.layers
        return (
            [("fwd", i) for i in range(n)] + [("fwd end",)] + [("bwd", i) for i in reversed(range(n))] + [("bwd end",)]
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def mean_step_times(steps: list[StepTimes]) -> StepTimes:
    """The mean of several steps' splits, layer by layer."""
    count = len(steps)
    return StepTimes(
        layer_s=[sum(s.layer_s[i] for s in steps) / count for i in range(len(steps[0].layer_s))],
        tail_s=sum(s.tail_s for s in steps) / count,
        step_s=sum(s.step_s for s in steps) / count,
    )


def local_parameter_count(model) -> int:
    """Parameters this rank holds (its FSDP shards), what the tail of a step scales with."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
