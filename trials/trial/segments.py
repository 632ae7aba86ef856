"""Per-segment peaks of a step: a listener on the trials' memory tracker, and the hooks that move it along the
decoder layers. The memory oracle's fake traces and reduced-depth real trials both use it (see
``autotune.oracle`` for what the segments are and how their peaks extend to full depth).

On CUDA the tracker sees the tensors each op returns, not what the op allocates inside it (flash-attn backward's
fp32 ``dq_accum`` and GQA-expanded dk/dv, SDPA's scratch, cuBLAS workspaces). There ``SegmentPeaks`` also reads
the caching allocator at every segment boundary (``AllocatorPeaks``): each segment's device bytes are the
allocator's peak between its boundaries, and what it held beyond the tracker's tensors is ``temporaries``."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from trials.core.memory import DeviceMemoryTracker, TrackerListener


@dataclass
class Segment:
    """The peak of one segment of the step: total device bytes, by category, and the host bytes then."""

    device_bytes: int
    breakdown: dict[str, int]
    host_bytes: int = 0
    at_op: str | None = None  # explain mode: the op right before the peak
    live: list | None = None  # explain mode: the largest live storages at the peak


def segment_label(segment: tuple | None) -> str:
    """A segment key as one word: ("backward", ("layers", "middle")) -> "backward/layers/middle"."""
    parts: list[str] = []

    def flatten(value):
        if isinstance(value, (tuple, list)):
            for item in value:
                flatten(item)
        elif value is not None:
            parts.append(str(value))

    flatten(segment)
    return "/".join(parts)


def layer_runs(techniques, num_layers: int, layer_kinds: list[str] | None = None) -> list[tuple[str, int]]:
    """The model's decoder layers as runs of identical layers: ``[(kind, count), ...]``.

    Layers differ with a partial activation offload (the first N layers' inputs live on the host,
    ``trials.stack.checkpointing``): an ``offload`` run and a ``device`` run; and by their attention (``layer_kinds``, one
    per layer, e.g. Gemma's ``sliding_attention`` and ``full_attention``): within each of those runs, the layers of
    one kind form one run, ``"offload/sliding_attention"``, kinds in order of first appearance. A copy of the model
    orders its layers that way (``trials.models.config.copy_for_runs``): a layer's cost does not depend on its place.
    """
    offload = techniques.activation_offload_layers
    parts = [("offload", 0, offload), ("device", offload, num_layers)] if 0 < offload < num_layers else None
    parts = parts or [("layers", 0, num_layers)]
    if not layer_kinds or len(set(layer_kinds)) == 1:
        return [(name, hi - lo) for name, lo, hi in parts]
    runs = []
    for name, lo, hi in parts:
        kinds = layer_kinds[lo:hi]
        runs += [(f"{name}/{kind}", kinds.count(kind)) for kind in dict.fromkeys(kinds)]
    return runs


def model_runs(techniques, model_config: dict) -> list[tuple[str, int]]:
    """``layer_runs`` of the model ``model_config`` describes (its layers' attention kinds included)."""
    from trials.models.config import layer_kinds

    return layer_runs(techniques, model_config["num_hidden_layers"], layer_kinds(model_config))


def techniques_for_runs(techniques, runs: list[tuple[str, int]]):
    """``techniques`` for a model whose decoder layers are ``runs`` (a shallower copy of the real one)."""
    if techniques.activation_offload_layers:
        offloaded = sum(n for kind, n in runs if kind.split("/")[0] in ("offload", "layers"))
        return replace(techniques, activation_offload_layers=offloaded)
    return techniques


class AllocatorPeaks:
    """The CUDA caching allocator's peak allocated bytes per segment: ``take`` returns the peak since the last
    ``take`` (``torch.cuda.max_memory_allocated``) and starts the next segment (``reset_peak_memory_stats``).

    The reset clears every peak statistic of the device, the reserved bytes' too, so the whole run's peaks are
    kept here across the resets: ``peaks()``."""

    def __init__(self, device: torch.device):
        self.device = device
        self.max_allocated = 0
        self.max_reserved = 0
        torch.cuda.reset_peak_memory_stats(device)

    def take(self) -> int:
        allocated = torch.cuda.max_memory_allocated(self.device)
        self.max_allocated = max(self.max_allocated, allocated)
        self.max_reserved = max(self.max_reserved, torch.cuda.max_memory_reserved(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        return allocated

    def peaks(self) -> tuple[int, int]:
        """(peak allocated, peak reserved) bytes since this object was made."""
        return (
            max(self.max_allocated, torch.cuda.max_memory_allocated(self.device)),
            max(self.max_reserved, torch.cuda.max_memory_reserved(self.device)),
        )


class SegmentPeaks(TrackerListener):
    """Keeps, on a ``DeviceMemoryTracker``, the peak of each segment of the step (see ``autotune.oracle``).

    ``segment`` is the current (phase, position); ``install_segment_hooks`` moves it along the decoder layers and
    ``in_phase`` sets (phase, "pre") / (phase, "end"). With ``explain``, each segment also keeps the op at its peak
    and the largest live storages then, each with the op, shape and dtype that made it.

    ``read_allocator`` (CUDA): every change of ``segment`` also closes the segment it leaves with the allocator's
    peak in it (``AllocatorPeaks.take``), until ``stop_allocator``; ``measured()`` puts both together."""

    def __init__(self, explain: bool = False):
        self._segment: tuple = ("setup", None)
        self.segments: dict[tuple, Segment] = {}
        self.explain = explain
        self._origin: dict[int, tuple] = {}  # explain: id(storage info) -> (op, shape, dtype, segment)
        self.allocator = None  # an ``AllocatorPeaks`` (or anything with ``take()``) while it is read
        self._tracker: DeviceMemoryTracker | None = None
        self.allocated: dict[tuple, int] = {}  # segment -> the allocator's peak bytes in it

    @property
    def segment(self) -> tuple:
        return self._segment

    @segment.setter
    def segment(self, key: tuple) -> None:
        if self.allocator is not None:
            self._close()
        self._segment = key

    def read_allocator(self, allocator, tracker: DeviceMemoryTracker) -> None:
        """From now on each segment's device bytes are ``allocator``'s peak in it too (the current one's since the
        allocator's last reset); ``tracker`` gives the categories of a segment in which it saw no op."""
        self.allocator, self._tracker = allocator, tracker

    def stop_allocator(self) -> None:
        """Close the current segment with the allocator's peak and stop reading it."""
        if self.allocator is not None:
            self._close()
        self.allocator = None

    def _close(self) -> None:
        peak = int(self.allocator.take())
        key = self._segment
        self.allocated[key] = max(self.allocated.get(key, 0), peak)
        if key not in self.segments and self._tracker is not None:
            tracker = self._tracker
            self.segments[key] = Segment(tracker.device_bytes, dict(tracker.current), tracker.host_bytes)

    def measured(self) -> dict[tuple, Segment]:
        """Each segment's peak: the tracker's, or where the allocator was read, the allocator's (at least the
        tracker's), with the bytes beyond the tracker's tensors (scratch inside ops, rounding) in ``temporaries``
        -- where the memory oracle counts the GPU kernels' scratch it models."""
        result = {}
        for key, seg in self.segments.items():
            allocated = self.allocated.get(key)
            if allocated is None:
                result[key] = seg
                continue
            device = max(allocated, seg.device_bytes)
            breakdown = dict(seg.breakdown)
            breakdown["temporaries"] = breakdown.get("temporaries", 0) + device - sum(breakdown.values())
            result[key] = Segment(device, breakdown, seg.host_bytes)
        return result

    def on_new_storage(self, tracker: DeviceMemoryTracker, info, tensor: torch.Tensor) -> None:
        if self.explain:
            self._origin[id(info)] = (
                str(tracker.op).replace("aten.", ""),
                tuple(tensor.shape),
                str(tensor.dtype).replace("torch.", ""),
                self.segment,
            )

    def on_phase(self, tracker: DeviceMemoryTracker, phase: str, entering: bool) -> None:
        self.segment = (phase, "pre" if entering else "end")

    def on_change(self, tracker: DeviceMemoryTracker) -> None:
        seg = self.segments.get(self.segment)
        if seg is None:
            seg = self.segments[self.segment] = Segment(tracker.device_bytes, dict(tracker.current), tracker.host_bytes)
            if self.explain:
                seg.at_op, seg.live = str(tracker.op), self._live(tracker)
        else:
            if tracker.device_bytes > seg.device_bytes:
                seg.device_bytes = tracker.device_bytes
                seg.breakdown = dict(tracker.current)
                if self.explain:
                    seg.at_op, seg.live = str(tracker.op), self._live(tracker)
            if tracker.host_bytes > seg.host_bytes:
                seg.host_bytes = tracker.host_bytes

    def _live(self, tracker: DeviceMemoryTracker, top: int = 12) -> list[dict]:
        """The largest live device storages now, with the op that made them (explain mode)."""
        live = []
        for info in tracker.live_storages():
            if info.host or not info.nbytes:
                continue
            op, shape, dtype, seg = self._origin.get(id(info), ("?", (), "?", None))
            live.append(
                {
                    "bytes": info.nbytes,
                    "category": info.category,
                    "op": op,
                    "shape": shape,
                    "dtype": dtype,
                    "made_in": seg,
                }
            )
        live.sort(key=lambda e: -e["bytes"])
        return live[:top]


def layer_positions(runs: list[tuple[str, int]]) -> list[tuple[str, str]]:
    """Each layer's segment label: (run kind, first | middle | last | only) -- its place inside its run."""
    labels = []
    for kind, count in runs:
        for j in range(count):
            pos = "only" if count == 1 else "first" if j == 0 else "last" if j == count - 1 else "middle"
            labels.append((kind, pos))
    return labels


def hidden_of(value):
    """The hidden states in a decoder layer's output (a tensor, or a tuple led by it)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def layer_input(args, kwargs):
    """The hidden states a decoder layer was called with (positional or ``hidden_states=``)."""
    return hidden_of(args[0] if args else kwargs.get("hidden_states"))


def install_segment_hooks(model, tracker: DeviceMemoryTracker, peaks: SegmentPeaks, runs) -> list:
    """Forward pre-hooks and gradient hooks that move ``peaks.segment`` along the decoder layers."""
    layers = list(model.layers)
    count = len(layers)
    labels = layer_positions(runs)
    if len(labels) != count:
        raise ValueError(f"runs {runs} do not cover the model's {count} layers")
    handles = []

    def set_segment(key):
        def hook(grad):
            peaks.segment = key

        return hook

    for index, layer in enumerate(layers):

        def pre(module, args, kwargs, index=index):
            if tracker.phase != "forward":
                return
            peaks.segment = ("forward", labels[index])
            if index == 0:
                hidden = layer_input(args, kwargs)
                if hidden is not None and hidden.requires_grad:
                    hidden.register_hook(set_segment(("backward", "post")))

        def post(module, args, kwargs, output, index=index):
            if tracker.phase != "forward":
                return
            if index == count - 1:
                peaks.segment = ("forward", "post")
            hidden = hidden_of(output)
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(set_segment(("backward", labels[index])))

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    return handles
