"""A step's memory timeline: every device allocation and free the memory tracker sees, in order, as a snapshot in
the format of torch's CUDA memory snapshots (``torch.cuda.memory._snapshot()``), which torch's own viewer draws
(``torch.cuda._memory_viz.trace_plot``; pytorch.org/memory_viz opens the pickle).

``TimelineRecorder`` is a ``TrackerListener`` (``trials.core.memory``). Per device storage it records an ``alloc`` when
the tracker first sees it (or when a resize grows it from nothing) and a free when it is freed, moved to the host
(an offload) or resized (then a new ``alloc`` at the new size). Each allocation carries, as its stack (innermost
first, the way torch lists a block's frames), what made it:

    op:0:aten.mm.default                      the op whose output it is
    module:0:lm.model.layers.2.mlp            the module running it (a decoder layer's backward: "... (backward)")
    technique:0:MLP tile (mlp_tile_tokens)    the technique whose code made it, from the Python stack
    category:0:activations                    the tracker's category (its last: FSDP's buffers become params)
    where:0:backward/layers/middle            a caller's label of the moment (the oracle's segment)

and the event's ``category`` key colours it by category in the viewer. Host storages (offloaded activations,
offloaded shards and optimizer states) are not device memory and stay out of the trace, so the trace's largest
sum of live sizes (``replay_peak``) is the tracker's device peak over the time it recorded.

The contract: ``snapshot()`` is a dict with ``segments`` and ``device_traces`` (one trace, device 0) that
``trace_plot`` and ``torch.cuda._memory_viz.trace`` accept; ``replay_peak(snapshot)`` is its peak; ``write_html``
and ``write_pickle`` write what the viewer opens.
"""

from __future__ import annotations

import pickle
import re
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from trials.core.memory import DeviceMemoryTracker, StorageInfo, TrackerListener

ALIGNMENT = 512  # the CUDA caching allocator's block rounding: addresses are laid out on it
# The viewer lists the categories it sees and, when "unknown" is not among them, adds it through a misspelt
# attribute (``snapshot.categores``) that throws. A last ``snapshot`` event (an action the timeline does not draw,
# as in torch's own traces) carries the category "unknown" so the viewer loads any snapshot.
UNKNOWN_CATEGORY = "unknown"

# Which technique's code made a storage: (a path fragment of the code's file, a prefix of its qualified name or
# "", the label), the innermost matching frame of the Python stack wins; a frame whose label is "" (helpers shared
# by several of a technique's steps) passes on to its callers.
FSDP_COLLECTIVES = "distributed/fsdp/_fully_shard/_fsdp_collectives.py"
FSDP_PARAM = "distributed/fsdp/_fully_shard/_fsdp_param.py"
TECHNIQUE_CODE = (
    (FSDP_COLLECTIVES, "foreach_all_gather_copy_out", "FSDP (fsdp): unsharded parameters"),
    (FSDP_COLLECTIVES, "foreach_all_gather", "FSDP (fsdp): all-gather buffer"),
    (FSDP_COLLECTIVES, "foreach_reduce", "FSDP (fsdp): reduce-scatter buffer"),
    (FSDP_COLLECTIVES, "", ""),
    (FSDP_PARAM, "alloc_storage", ""),
    (FSDP_PARAM, "FSDPParam.init_all_gather_outputs", "FSDP (fsdp): unsharded parameters"),
    (FSDP_PARAM, "FSDPParam.alloc_all_gather_outputs", "FSDP (fsdp): unsharded parameters"),
    (FSDP_PARAM, "FSDPParam.init_unsharded_param", "FSDP (fsdp): unsharded parameters"),
    ("trials/stack/tiling.py", "TiledLogitsLoss", "loss tile (loss_tile_tokens)"),
    ("trials/stack/tiling.py", "tiled_loss", "loss tile (loss_tile_tokens)"),
    ("trials/stack/tiling.py", "TiledRMSNorm", "RMSNorm tile (norm_tile_tokens)"),
    ("trials/stack/tiling.py", "_norm_body", "RMSNorm tile (norm_tile_tokens)"),
    ("trials/stack/tiling.py", "_tiled_norm", "RMSNorm tile (norm_tile_tokens)"),
    ("trials/stack/tiling.py", "_mlp_body", "MLP tile (mlp_tile_tokens)"),
    ("trials/stack/tiling.py", "_tiled_mlp", "MLP tile (mlp_tile_tokens)"),
    ("trials/stack/tiling.py", "TiledMLP", "MLP tile (mlp_tile_tokens)"),
    ("trials/stack/upipe.py", "", "UPipe head chunk (head_chunk)"),
    ("sequence_parallel/ulysses_sp.py", "", "Ulysses (ulysses_degree)"),
    ("deepspeed/sequence/", "", "Ulysses (ulysses_degree)"),
    ("trials/stack/offload.py", "", "activation offload copy (activation_offload_layers)"),
    ("torch/distributed/fsdp/", "", "FSDP (fsdp)"),
    ("torch/optim/", "", "optimizer step"),
    ("torch/utils/checkpoint.py", "", "checkpoint recompute (activation_checkpointing)"),
    ("trials/kernels/attention.py", "", "attention kernel"),
)
# Collectives by the op's name: their outputs are the technique's communication buffers.
COLLECTIVES = (
    ("all_to_all", "all-to-all buffer"),
    ("all_gather", "all-gather buffer"),
    ("reduce_scatter", "reduce-scatter buffer"),
    ("all_reduce", "all-reduce buffer"),
)
_STACK_DEPTH = 96  # frames looked at per allocation: the technique's code is never deeper than that


class TimelineRecorder(TrackerListener):
    """Records the device allocations and frees of a ``DeviceMemoryTracker`` (see the module doc).

    ``where``: a label of the current moment for each allocation (the oracle's segment); ``watch(model)`` names
    the module running each op. Add it with ``tracker.add_listener`` before the tracker sees the first storage
    the timeline should hold."""

    def __init__(self, where: Callable[[], str] | None = None):
        self.where = where
        self.events: list[tuple] = []  # ("alloc", addr, size, info, frames) | ("free", addr, size, info)
        self._live: dict[int, tuple[int, int, StorageInfo]] = {}  # id(info) -> (addr, size, info)
        self._next_addr = 0
        self._modules: list[str] = []  # the module stack of the forward (and recompute) running now
        self._backward_module: str | None = None  # the decoder layer whose backward runs now
        self._handles: list = []
        self._code_labels: dict = {}  # code object -> technique label or None
        self.host_peak_bytes = 0

    # -- the tracker's hooks -------------------------------------------------------------------------
    def on_new_storage(self, tracker: DeviceMemoryTracker, info: StorageInfo, tensor: torch.Tensor) -> None:
        if not info.host and info.nbytes > 0:
            self._alloc(info, info.nbytes, tracker)

    def on_free(self, tracker: DeviceMemoryTracker, info: StorageInfo) -> None:
        self._free(info)

    def on_moved_to_host(self, tracker: DeviceMemoryTracker, tensor: torch.Tensor, nbytes: int) -> None:
        info = tracker.storage_info(tensor)
        if info is not None:
            self._free(info)

    def on_resize(self, tracker: DeviceMemoryTracker, info: StorageInfo, old_nbytes: int) -> None:
        self._free(info)
        if not info.host and info.nbytes > 0:
            self._alloc(info, info.nbytes, tracker, op="UntypedStorage.resize_")

    # -- events --------------------------------------------------------------------------------------
    def _alloc(self, info: StorageInfo, size: int, tracker: DeviceMemoryTracker, op: str | None = None) -> None:
        addr = self._next_addr
        self._next_addr += -(-size // ALIGNMENT) * ALIGNMENT
        self._live[id(info)] = (addr, size, info)
        self.events.append(("alloc", addr, size, info, self._context(tracker, op)))

    def _free(self, info: StorageInfo) -> None:
        live = self._live.pop(id(info), None)
        if live is not None:
            addr, size, _ = live
            self.events.append(("free", addr, size, info))

    def _context(self, tracker: DeviceMemoryTracker, op: str | None = None) -> tuple[str, str, str, str]:
        """(op, module, technique, where) of an allocation now (``op``: what made it, where no dispatched op did)."""
        if op is None:
            op = str(tracker.op) if tracker.op is not None else "(no op: made outside an op)"
        if self._modules:
            module = self._modules[-1]
        elif tracker.phase == "backward" and self._backward_module:
            module = f"{self._backward_module} (backward)"
        else:
            module = f"({tracker.phase})"
        technique = self._technique(op)
        return op, module, technique, self.where() if self.where is not None else tracker.phase

    def _technique(self, op: str) -> str:
        """The technique whose code made the op's output: the innermost matching frame of the Python stack, and the
        kind of buffer where the op is a collective."""
        label = None
        frame = sys._getframe(3)
        for _ in range(_STACK_DEPTH):
            if frame is None:
                break
            code = frame.f_code
            label = self._code_labels.get(code, False)
            if label is False:
                label = self._code_labels[code] = _code_label(code)
            if label:
                break
            frame = frame.f_back
        for fragment, kind in COLLECTIVES:
            if fragment in op and not (label and label.endswith("buffer")):
                return f"{label or 'collective'}: {kind}"
        return label or "(none: the model's own op)"

    # -- module names --------------------------------------------------------------------------------
    def watch(self, model: torch.nn.Module, layers=None) -> None:
        """Name the module running each op: forward pre/post hooks on every named module of ``model`` (they run in a
        checkpoint's recompute too), and gradient hooks on ``layers``' outputs (default ``model.layers``) that name
        the decoder layer whose backward runs."""
        for name, module in model.named_modules():
            name = name or "model"  # the root: the loss and what runs around the decoder layers
            self._handles.append(module.register_forward_pre_hook(self._enter(name)))
            self._handles.append(module.register_forward_hook(self._leave(name), always_call=True))
        named = {id(m): n for n, m in model.named_modules()}
        for layer in list(layers if layers is not None else getattr(model, "layers", [])):
            self._handles.append(layer.register_forward_hook(self._on_layer_output(named.get(id(layer), "layer"))))

    def unwatch(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _enter(self, name: str):
        def hook(module, args):
            self._modules.append(name)

        return hook

    def _leave(self, name: str):
        def hook(module, args, output):
            if self._modules and self._modules[-1] == name:
                self._modules.pop()

        return hook

    def _on_layer_output(self, name: str):
        def set_backward(grad):
            self._backward_module = name

        def hook(module, args, output):
            hidden = output if isinstance(output, torch.Tensor) else output[0] if isinstance(output, tuple) else None
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad and torch.is_grad_enabled():
                hidden.register_hook(set_backward)

        return hook

    # -- the snapshot --------------------------------------------------------------------------------
    def snapshot(self, title: str = "") -> dict:
        """The recorded events as a torch memory snapshot (see the module doc); ``title`` goes into the last event's
        stack, where the viewer shows it."""
        trace = []
        for event in self.events:
            if event[0] == "alloc":
                _, addr, size, info, (op, module, technique, where) = event
                frames = [
                    _frame("op", op),
                    _frame("module", module),
                    _frame("technique", technique),
                    _frame("category", info.category),
                    _frame("where", where),
                ]
                trace.append(_event("alloc", addr, size, frames, info.category))
            else:
                _, addr, size, info = event
                trace.append(_event("free_requested", addr, size, [], info.category))
                trace.append(_event("free_completed", addr, size, [], info.category))
        trace.append(_event("snapshot", 0, 0, [_frame("title", title)] if title else [], UNKNOWN_CATEGORY))
        return {"segments": self._segments(), "device_traces": [trace]}

    def _segments(self) -> list[dict]:
        """One segment spanning every address, with the blocks live at the end (as torch's snapshot lists them)."""
        if not self._next_addr:
            return []
        blocks, cursor = [], 0
        for addr, size, _ in sorted(self._live.values(), key=lambda live: live[0]):
            if addr > cursor:
                blocks.append({"size": addr - cursor, "requested_size": 0, "state": "inactive", "frames": []})
            rounded = -(-size // ALIGNMENT) * ALIGNMENT
            blocks.append({"size": rounded, "requested_size": size, "state": "active_allocated", "frames": []})
            cursor = addr + rounded
        if cursor < self._next_addr:
            blocks.append({"size": self._next_addr - cursor, "requested_size": 0, "state": "inactive", "frames": []})
        active = sum(size for _, size, _ in self._live.values())
        return [
            {
                "device": 0,
                "address": 0,
                "total_size": self._next_addr,
                "allocated_size": active,
                "active_size": active,
                "requested_size": active,
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": blocks,
            }
        ]


def _code_label(code) -> str | None:
    filename = code.co_filename.replace("\\", "/")
    qualname = getattr(code, "co_qualname", code.co_name)
    for fragment, prefix, label in TECHNIQUE_CODE:
        if fragment in filename and qualname.startswith(prefix):
            return label
    return None


def _frame(kind: str, value: str) -> dict:
    return {"filename": kind, "line": 0, "name": value}


def _event(action: str, addr: int, size: int, frames: list, category: str) -> dict:
    return {
        "action": action,
        "addr": addr,
        "size": size,
        "stream": 0,
        "time_us": 0,
        "frames": frames,
        "category": category,
    }


def replay_peak(snapshot: dict, device: int = 0) -> int:
    """The largest sum of live allocation sizes over ``snapshot``'s trace of ``device`` (blocks allocated before the
    trace began, listed in its segments, count from the start), as the viewer's timeline draws it."""
    trace = snapshot["device_traces"][device]
    allocated_in_trace = {e["addr"] for e in trace if e["action"] == "alloc"}
    freed_first = set()
    seen = set()
    for e in trace:  # a free before any alloc of its address: allocated before the trace began
        if e["action"] == "alloc":
            seen.add(e["addr"])
        elif e["action"] == "free_completed" and e["addr"] not in seen:
            freed_first.add(e["addr"])
    live = 0
    for segment in snapshot.get("segments", []):
        if segment.get("device", 0) != device:
            continue
        addr = segment["address"]
        for block in segment["blocks"]:
            if block["state"] == "active_allocated" and addr not in allocated_in_trace:
                live += block.get("requested_size", block["size"])
            addr += block["size"]
    live += sum(e["size"] for e in trace if e["action"] == "free_completed" and e["addr"] in freed_first)
    peak = live
    for e in trace:
        if e["action"] == "alloc":
            live += e["size"]
            peak = max(peak, live)
        elif e["action"] == "free_completed":
            live -= e["size"]
    return peak


def titled(snapshot: dict, title: str) -> dict:
    """``snapshot`` with ``title`` as the first frame of its last ``snapshot`` event (added where it has none)."""
    trace = snapshot["device_traces"][0] if snapshot["device_traces"] else []
    if not trace or trace[-1]["action"] != "snapshot":
        trace.append(_event("snapshot", 0, 0, [], UNKNOWN_CATEGORY))
    trace[-1]["frames"] = [_frame("title", title)] + [f for f in trace[-1]["frames"] if f["filename"] != "title"]
    return snapshot


# torch's page loads its viewer from pytorch's repository at a git ref; the torch wheel does not ship the viewer
# (torch/utils/viz/MemoryViz.js), so the page needs the CDN, at the ref of the installed torch
VIEWER_URL = "https://cdn.jsdelivr.net/gh/pytorch/pytorch@{ref}/torch/utils/viz/MemoryViz.js"


def viewer_ref() -> str:
    """The pytorch git ref whose viewer is the installed torch's: its release tag (``v2.13.0``), else the commit it
    was built from (a nightly or a source build)."""
    release = re.fullmatch(r"(\d+\.\d+\.\d+)(\+.*)?", torch.__version__)
    if release:
        return f"v{release.group(1)}"
    commit = torch.version.git_version
    return commit if commit and commit != "Unknown" else "main"


def html(snapshot: dict, title: str = "") -> str:
    """The viewer's "Active Memory Timeline" of ``snapshot``: torch's own ``trace_plot`` page, its viewer pinned to
    the installed torch (``viewer_ref``: torch's page loads pytorch's main branch, which changes under a saved
    page), with ``title`` as the page's title and a line above the viewer."""
    import html as html_lib

    from torch.cuda._memory_viz import trace_plot

    page = trace_plot(snapshot).replace(VIEWER_URL.format(ref="main"), VIEWER_URL.format(ref=viewer_ref()), 1)
    if title:
        text = html_lib.escape(title)
        page = page.replace("<head>", f"<head>\n<meta charset='utf-8'><title>{text}</title>", 1)
        page = page.replace("<body>", f'<body>\n<div style="font-family:helvetica;font-size:13px">{text}</div>', 1)
    return page


def side_by_side_html(pages: list[tuple[str, str]]) -> str:
    """One page holding several viewer pages (``(label, html)``) side by side, each under its label."""
    import html as html_lib

    columns = "".join(
        f'<div style="flex:1;display:flex;flex-direction:column;min-width:0">'
        f'<h3 style="font-family:helvetica;margin:4px">{html_lib.escape(label)}</h3>'
        f'<iframe style="flex:1;border:1px solid #ccc" srcdoc="{html_lib.escape(page, quote=True)}"></iframe></div>'
        for label, page in pages
    )
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'><title>memory timelines</title></head>"
        f'<body style="margin:0;height:100vh;display:flex;gap:8px">{columns}</body></html>\n'
    )


def write_pickle(snapshot: dict, path: str | Path) -> None:
    """The snapshot as pytorch.org/memory_viz opens it (what ``torch.cuda.memory._dump_snapshot`` writes)."""
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


CUDA_HISTORY_ENTRIES = 1_000_000  # allocator events kept: a step at millions of tokens makes tens of thousands


def start_cuda_history() -> None:
    """Start recording the CUDA caching allocator's history: every alloc and free with its Python stack. Python
    frames only (``stacks="python"``): C++ frames cost a symbolization per event, and the viewer's labels (op,
    module, technique) come from the Python ones."""
    torch.cuda.memory._record_memory_history(max_entries=CUDA_HISTORY_ENTRIES, stacks="python")


def stop_cuda_history() -> dict:
    """The allocator's snapshot with the history recorded since ``start_cuda_history``; recording stops."""
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    return snapshot


def snapshots_in_html(page: str) -> list[dict]:
    """The snapshots a viewer page embeds (``html``, or each side of ``side_by_side_html``), in order."""
    import base64
    import html as html_lib

    text = html_lib.unescape(page)
    return [pickle.loads(base64.b64decode(match)) for match in re.findall(r'"base64": "([A-Za-z0-9+/=]+)"', text)]
