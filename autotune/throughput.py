"""The throughput half of the ``plan`` backend: count what a training step does, then predict its time.

Two pieces, used in this order:

1. ``StepCounter`` -- a ``TorchDispatchMode`` that watches one training step (real tensors in a CPU trial, or
   fake tensors in the memory oracle's trace) and counts, per phase (forward, backward, recompute, optimizer,
   other):

   - matmul FLOPs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``linear``, ...; 2*m*n*k each);
   - attention FLOPs of fused attention kernels (SDPA's flash / efficient / cuDNN / CPU-flash ops and their
     backward, flash-attn's custom ops), counting only the unmasked (query, key) pairs: causal attention over
     ``s`` tokens does ``s*(s+1)/2`` pairs, about half of the dense ``s*s``; backward = 2.5x forward
     (recompute QK^T, dV, dP, dQ, dK);
   - elementwise / memory-bound bytes: the output bytes of every other op that makes or writes data (views
     and metadata ops excluded);
   - kernel count (ops that do work), for the per-op host overhead;
   - collectives: the bytes of each call and the bytes this rank puts on the wire, with the algorithmic
     factor ``(P-1)/P`` (all-to-all, all-gather, reduce-scatter) or ``2(P-1)/P`` (all-reduce). Collectives
     issued inside FSDP's ``record_function("FSDP::...")`` regions run on FSDP's side streams and can overlap
     compute; all others (Ulysses all-to-all, gradient all-reduce, the loss all-reduce) stall the step;
   - host<->device bytes: copies between device types (``_to_copy`` / ``copy_`` cuda<->cpu), and on the CPU
     path, where everything is ``cpu``, tensors the memory tracker is told live on the host (``mark_host``)
     and copies out of such tensors;
   - the optimizer step's bytes (output bytes of its ops) and parameters (elements ``addcdiv`` touches).

   Phases: the memory tracker's ``phase`` attribute (``trials.memory.DeviceMemoryTracker``) when one is given,
   refined by autograd state: an op inside a backward graph task with grad mode on (or under
   ``torch.utils.checkpoint``'s recomputation hook) is *recompute* (activation checkpointing, tiled MLP
   recompute); an op in a graph task with grad off is *backward*, even when it runs during the tracker's
   forward phase (the tiled loss runs its backward inside forward); ``Optimizer.step`` is recognised by its
   ``record_function`` too, so the counter works without a tracker.

2. ``predict_step_time(counts, hardware, world_size, techniques)`` -- a small roofline-style model, every
   rate and efficiency a named field of the hardware YAML (``Rates``), documented in docs/throughput.md:

       t_phase  = matmul_flops / (peak * matmul_efficiency)
                + attention_fwd_flops / (peak * attention_efficiency)
                + attention_bwd_flops / (peak * attention_backward_efficiency)
                + elementwise_bytes * elementwise_traffic_factor / (hbm * elementwise_efficiency)
                (+ ops * op_overhead_s, added -- or as a floor, when launches overlap compute: GPUs)
       stalled comm   = sum over non-FSDP collectives (wire bytes / (link * eff) + latency)     -> exposed
       FSDP comm      = same for FSDP's; hidden behind compute up to the compute time (side streams) except
                        the first all-gather and the last reduce-scatter
       host transfers = (d2h, h2d) / host link per direction, per phase; hidden behind that phase's compute
       optimizer      = optimizer bytes / host_optimizer_bytes_per_s (offloaded) or as elementwise (device)
       step_time      = compute + recompute + exposed comm + exposed host + optimizer

   ``tokens_per_s = seq_len * dp_size / step_time`` with ``dp_size = world_size / ulysses_degree``.

The ``cpu`` preset's rates are measured on this machine by ``autotune.calibrate`` (cached under the user
cache dir) so predictions can be checked against real CPU trials (bench/throughput_fidelity.py).
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_DEBUG = bool(os.environ.get("AUTOTUNE_COUNTER_DEBUG"))
PHASES = ("forward", "backward", "recompute", "optimizer", "other")
COMPUTE_PHASES = ("forward", "backward", "recompute", "other")

# ---------------------------------------------------------------------------------------------------------
# What the counter saw
# ---------------------------------------------------------------------------------------------------------


@dataclass
class PhaseCounts:
    """Work of one phase of the step."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0            # forward attention kernels (unmasked pairs only)
    attention_bwd_flops: float = 0.0        # backward attention kernels
    attention_dense_flops: float = 0.0      # what forward + backward would cost without the causal saving
    elementwise_bytes: float = 0.0          # output bytes of memory-bound ops
    ops: int = 0                            # ops that do work (kernel launches)
    views: int = 0                          # dispatched ops that do no work (views, detach, metadata)
    d2h_bytes: float = 0.0                  # device -> host copies (activation offload, grad offload)
    h2d_bytes: float = 0.0                  # host -> device copies (prefetch, param offload)

    def add(self, other: "PhaseCounts") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class CollectiveCounts:
    """All calls of one kind of collective in one phase."""

    calls: int = 0
    bytes: float = 0.0        # tensor bytes of the call (input for all-to-all/reduce-scatter/all-reduce, output for all-gather)
    wire_bytes: float = 0.0   # bytes this rank sends over its link (algorithmic factor applied)
    max_wire_bytes: float = 0.0


@dataclass
class StepCounts:
    """Everything ``StepCounter`` counted over one step on one rank."""

    phases: dict[str, PhaseCounts] = field(default_factory=lambda: {p: PhaseCounts() for p in PHASES})
    # key: "<kind>/<phase>/<fsdp|sync>", kind in all_to_all, all_gather, reduce_scatter, all_reduce, other
    collectives: dict[str, CollectiveCounts] = field(default_factory=dict)
    optimizer_params: int = 0              # elements stepped by the optimizer on this rank
    optimizer_param_bytes: int = 0         # their bytes (master dtype)
    fsdp_all_gather_input_numel: dict[str, int] = field(default_factory=dict)  # per phase: the sharded params
    fsdp_reduce_scatter_output_bytes: dict[str, int] = field(default_factory=dict)  # per phase: sharded grads
    fsdp_h2d_bytes: float = 0.0            # host->device copies seen inside FSDP (offloaded shards; CUDA only)
    fsdp_d2h_bytes: dict[str, float] = field(default_factory=dict)  # per phase: FSDP's offloaded gradients
    first_fsdp_all_gather_wire_bytes: float = 0.0
    last_fsdp_reduce_scatter_wire_bytes: float = 0.0
    # fused attention calls grouped by shape: "phase|fwd or bwd|sq|sk|d|dv|causal" -> batch*heads summed
    attention_calls: dict[str, float] = field(default_factory=dict)
    seq_len: int | None = None
    steps: int = 1

    # -- totals --------------------------------------------------------------------------------------------
    def total(self, name: str, phases=PHASES) -> float:
        return sum(getattr(self.phases[p], name) for p in phases)

    @property
    def matmul_flops(self) -> float:
        return self.total("matmul_flops")

    @property
    def attention_flops(self) -> float:
        return self.total("attention_flops") + self.total("attention_bwd_flops")

    def collective(self, kind: str | None = None, phase: str | None = None, fsdp: bool | None = None) -> CollectiveCounts:
        out = CollectiveCounts()
        for key, c in self.collectives.items():
            k, p, f = key.split("/")
            if (kind is None or k == kind) and (phase is None or p == phase) and (fsdp is None or (f == "fsdp") == fsdp):
                out.calls += c.calls
                out.bytes += c.bytes
                out.wire_bytes += c.wire_bytes
                out.max_wire_bytes = max(out.max_wire_bytes, c.max_wire_bytes)
        return out

    def scaled(self, factor: float) -> "StepCounts":
        """Counts divided by ``factor`` (e.g. the number of steps traced)."""
        import copy

        out = copy.deepcopy(self)
        for pc in out.phases.values():
            for f in fields(pc):
                setattr(pc, f.name, type(getattr(pc, f.name))(getattr(pc, f.name) / factor))
        for c in out.collectives.values():
            c.calls = int(round(c.calls / factor))
            c.bytes /= factor
            c.wire_bytes /= factor
        out.attention_calls = {k: v / factor for k, v in out.attention_calls.items()}
        out.optimizer_params = int(out.optimizer_params / factor)
        out.optimizer_param_bytes = int(out.optimizer_param_bytes / factor)
        out.fsdp_all_gather_input_numel = {k: int(v / factor) for k, v in out.fsdp_all_gather_input_numel.items()}
        out.fsdp_reduce_scatter_output_bytes = {k: int(v / factor) for k, v in out.fsdp_reduce_scatter_output_bytes.items()}
        out.steps = 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "StepCounts":
        data = dict(data)
        data["phases"] = {p: PhaseCounts(**v) for p, v in data.get("phases", {}).items()}
        for p in PHASES:
            data["phases"].setdefault(p, PhaseCounts())
        data["collectives"] = {k: CollectiveCounts(**v) for k, v in data.get("collectives", {}).items()}
        return cls(**data)

    def summary(self) -> str:
        lines = []
        for p in PHASES:
            c = self.phases[p]
            lines.append(f"{p:9s} matmul {c.matmul_flops / 1e9:10.3f} GF  attn {c.attention_flops / 1e9:9.3f}+"
                         f"{c.attention_bwd_flops / 1e9:9.3f} GF  elementwise {c.elementwise_bytes / 1e6:10.2f} MB"
                         f"  ops {c.ops:6d}  d2h {c.d2h_bytes / 1e6:8.2f} MB  h2d {c.h2d_bytes / 1e6:8.2f} MB")
        for key, c in sorted(self.collectives.items()):
            lines.append(f"{key:32s} calls {c.calls:5d}  bytes {c.bytes / 1e6:10.3f} MB  wire {c.wire_bytes / 1e6:10.3f} MB")
        lines.append(f"optimizer params {self.optimizer_params:,} ({self.optimizer_param_bytes:,} bytes)")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The counter
# ---------------------------------------------------------------------------------------------------------

_aten = torch.ops.aten

# ops that only make views / metadata / scalars: no kernel, no bytes
_NO_WORK = {
    "detach", "t", "view", "_unsafe_view", "expand", "transpose", "unsqueeze", "squeeze", "slice", "select",
    "as_strided", "permute", "split", "split_with_sizes", "chunk", "unbind", "alias", "lift_fresh",
    "_local_scalar_dense", "_reshape_alias", "reshape", "unfold", "diagonal", "narrow", "expand_as", "view_as",
    "numpy_T", "real", "imag", "_neg_view", "_conj", "is_same_size", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "size", "stride", "dim", "is_contiguous", "empty", "empty_like", "empty_strided",
    "set_", "resize_", "_record_function_enter_new", "_record_function_exit", "record_stream", "_to_copy_noop",
    "new_empty", "new_empty_strided", "item", "equal", "is_nonzero", "_has_compatible_shallow_copy_type",
    "lift_fresh_copy", "_foreach_empty",
}
_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "dot", "_scaled_mm",
           "_addmm_activation", "_int_mm"}
_COPY = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "clone", "to", "contiguous"}
_ADAM_PARAM_OPS = {"addcdiv_", "_foreach_addcdiv_", "_fused_adam_", "_fused_adamw_"}


def _op_name(func) -> tuple[str, str]:
    """(namespace, op name without overload) of an OpOverload, e.g. ('aten', 'mm')."""
    namespace = getattr(func, "namespace", None)
    packet = getattr(func, "_overloadpacket", None)
    name = getattr(packet, "__name__", None) if packet is not None else None
    if namespace is None or name is None:
        text = str(func)
        parts = text.split(".")
        return (parts[0], parts[1] if len(parts) > 1 else text)
    # OpOverloadPacket.__name__ may be "ns.op" on some versions
    return namespace, name.split(".")[-1] if "." in name else name


def _bound_args(func, args, kwargs) -> dict[str, Any]:
    out = {}
    try:
        schema_args = func._schema.arguments
    except AttributeError:
        return dict(kwargs or {})
    for index, arg in enumerate(schema_args):
        if index < len(args):
            out[arg.name] = args[index]
        elif kwargs and arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
    return out


def _nbytes(t) -> int:
    if isinstance(t, torch.Tensor):
        if hasattr(t, "_local_tensor"):  # DTensor: the local shard
            t = t._local_tensor
        return t.numel() * t.element_size()
    return 0


def _tensors(tree) -> list[torch.Tensor]:
    out = []
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (list, tuple)):
        for item in tree:
            out.extend(_tensors(item))
    elif isinstance(tree, dict):
        for item in tree.values():
            out.extend(_tensors(item))
    return out


def _group_size(bound: dict[str, Any], fallback: int) -> int:
    """Size of a collective's process group (c10d ProcessGroup object, or a functional op's group name)."""
    if isinstance(bound.get("group_size"), int):
        return bound["group_size"]
    group = bound.get("process_group")
    if group is not None:
        for attr in ("size",):
            try:
                return int(getattr(group, attr)())
            except Exception:
                pass
    name = bound.get("group_name")
    if isinstance(name, str):
        try:
            from torch.distributed.distributed_c10d import _resolve_process_group

            return int(_resolve_process_group(name).size())
        except Exception:
            pass
    return fallback


def causal_pairs(sq: int, sk: int, causal: bool) -> int:
    """Unmasked (query, key) pairs: ``sq*sk`` dense; causal (top-left aligned) ``sum_i min(i+1, sk)``."""
    if not causal:
        return sq * sk
    if sq <= sk:
        return sq * (sq + 1) // 2
    return sk * (sk + 1) // 2 + (sq - sk) * sk


def attention_flops(batch: int, q_heads: int, sq: int, sk: int, head_dim: int, v_head_dim: int | None = None,
                    causal: bool = True) -> tuple[float, float, float]:
    """(forward, backward, dense forward+backward) FLOPs of one fused attention call.

    Forward: QK^T and PV, ``2*d + 2*dv`` FLOPs per unmasked pair per head. Backward recomputes QK^T and does
    dV, dP, dQ, dK: ``6*d + 4*dv`` per pair (2.5x the forward when ``d == dv``).
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    pairs = causal_pairs(sq, sk, causal)
    fwd = batch * q_heads * pairs * (2 * head_dim + 2 * dv)
    bwd = batch * q_heads * pairs * (6 * head_dim + 4 * dv)
    dense = batch * q_heads * sq * sk * (8 * head_dim + 6 * dv)
    return float(fwd), float(bwd), float(dense)


class StepCounter(TorchDispatchMode):
    """Count FLOPs, bytes and collectives of what runs under it (see module docstring).

        counter = StepCounter(tracker)           # tracker: trials.memory.DeviceMemoryTracker or None
        with tracker, counter:
            train_step(...)
        counts = counter.counts                  # StepCounts

    Works on real and on fake tensors (it only reads shapes, dtypes and devices). Enter it *inside* the
    memory tracker (and inside FakeTensorMode), so it sees each op once. ``tracker`` gives the phase and
    host-ness (``mark_host``); without one the phase comes from autograd state and ``record_function``.
    """

    def __init__(self, tracker=None, seq_len: int | None = None, world_size: int = 1):
        super().__init__()
        self.tracker = tracker
        self.counts = StepCounts(seq_len=seq_len)
        self.world_size = world_size
        self._scopes: list[tuple[Any, str]] = []   # open record_function regions (handle, name)
        self.errors = 0                             # ops the counter failed to understand (skipped)
        self._orig_mark_host = None
        self._host_storages = None

    # -- phase ---------------------------------------------------------------------------------------------
    def _in_scope(self, prefix: str) -> bool:
        return any(name.startswith(prefix) for _, name in self._scopes)

    def _phase(self) -> str:
        tracker_phase = getattr(self.tracker, "phase", None)
        if tracker_phase == "optimizer" or self._in_scope("Optimizer."):
            return "optimizer"
        if torch._C._current_graph_task_id() >= 0:
            if torch.is_grad_enabled() or self._recomputing():
                return "recompute"
            return "backward"
        if tracker_phase is not None:
            # outside a graph task in the tracker's backward phase: gradient all-reduce, FSDP's final callbacks
            return tracker_phase if tracker_phase in PHASES else "other"
        return "forward" if torch.is_grad_enabled() else "other"

    @staticmethod
    def _recomputing() -> bool:
        try:
            hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        except Exception:
            return False
        if not hooks:
            return False
        pack = hooks[0]
        return "_recomputation_hook" in getattr(pack, "__qualname__", "")

    # -- host-ness -----------------------------------------------------------------------------------------
    def _is_host(self, t: torch.Tensor, device_type: str) -> bool:
        """Does ``t`` live on the host? A cpu tensor when the compute device is not cpu, or a storage the
        tracker was told about (``mark_host``) on the CPU path."""
        if not isinstance(t, torch.Tensor):
            return False
        if t.device.type == "cpu" and device_type not in ("cpu", "meta"):
            return True
        storages = getattr(self.tracker, "_storages", None)
        if storages is not None and device_type == "cpu":
            try:
                info = storages.get(t.untyped_storage())
            except Exception:
                info = None
            return bool(info is not None and getattr(info, "host", False))
        return False

    def __enter__(self):
        tracker = self.tracker
        if tracker is not None and hasattr(tracker, "mark_host"):
            counter = self
            orig = tracker.mark_host
            self._orig_mark_host = orig

            def mark_host(tensor, *args, **kwargs):
                # On the CPU path the copy to the "host" looks like an ordinary clone; the tracker being told the
                # result lives on the host is what makes it a d2h transfer.
                was_host = counter._is_host(tensor, "cpu") if tensor.device.type == "cpu" else True
                result = orig(tensor, *args, **kwargs)
                if not was_host:  # the tracker moves the whole storage to the host
                    try:
                        nbytes = tensor.untyped_storage().nbytes()
                    except Exception:
                        nbytes = _nbytes(tensor)
                    phase = counter._phase()
                    counter.counts.phases[phase].d2h_bytes += nbytes
                    if counter._in_scope("FSDP::"):
                        fsdp = counter.counts.fsdp_d2h_bytes
                        fsdp[phase] = fsdp.get(phase, 0.0) + nbytes
                return result

            tracker.mark_host = mark_host
        _ACTIVE_COUNTERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        if self._orig_mark_host is not None:
            try:
                del self.tracker.mark_host  # drop the instance attribute: the class method shows again
            except AttributeError:
                pass
            self._orig_mark_host = None
        if self in _ACTIVE_COUNTERS:
            _ACTIVE_COUNTERS.remove(self)
        return super().__exit__(*exc)

    # -- the mode ------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._count(func, args, kwargs, out)
        except Exception:  # counting must never break the step it watches
            if _DEBUG:
                raise
            self.errors += 1
        return out

    def _count(self, func, args, kwargs, out) -> None:
        namespace, name = _op_name(func)
        if namespace == "prim":  # prim.device etc.: fake tensors' metadata queries, not ops of the step
            return
        if namespace == "profiler":
            if name == "_record_function_enter_new":
                self._scopes.append((out, str(args[0]) if args else ""))
            elif name == "_record_function_exit" and self._scopes:
                handle = args[0] if args else None
                for index in range(len(self._scopes) - 1, -1, -1):
                    if self._scopes[index][0] is handle:
                        del self._scopes[index]
                        break
                else:  # record_function regions nest: the innermost one ends
                    self._scopes.pop()
            return
        phase = self._phase()
        pc = self.counts.phases[phase]

        if namespace in ("c10d", "_c10d_functional", "c10d_functional") or (
                namespace == "deepspeed" and "all_to_all" in name):
            self._count_collective(namespace, name, func, args, kwargs, out, phase)
            return
        if namespace == "_c10d_functional" or name in ("wait_tensor",):
            return
        if name in _NO_WORK:
            pc.views += 1
            return
        if namespace == "aten" and name in _MATMUL:
            pc.matmul_flops += self._matmul_flops(name, args, out)
            pc.ops += 1
            return
        if self._is_attention(namespace, name):
            if self._count_attention(namespace, name, func, args, kwargs, pc, phase):
                pc.ops += 1
                return
        outputs = _tensors(out)
        if not outputs and name.endswith("_") and args:  # in-place ops returning nothing (_foreach_*_)
            outputs = _tensors(args[0])
        pc.ops += 1 if outputs else 0
        out_bytes = sum(_nbytes(t) for t in outputs)
        if namespace == "aten" and name in _COPY:
            self._count_copy(name, args, kwargs, outputs, pc)
        if phase == "optimizer" and name in _ADAM_PARAM_OPS:
            first = args[0] if args else None
            params = first if isinstance(first, (list, tuple)) else [first]
            for p in params:
                if isinstance(p, torch.Tensor):
                    local = getattr(p, "_local_tensor", p)  # DTensor: this rank's shard
                    self.counts.optimizer_params += local.numel()
                    self.counts.optimizer_param_bytes += _nbytes(local)
        pc.elementwise_bytes += out_bytes

    # -- pieces --------------------------------------------------------------------------------------------
    @staticmethod
    def _matmul_flops(name: str, args, out) -> float:
        try:
            if name in ("mm", "_scaled_mm", "_int_mm"):
                a, b = args[0], args[1]
                return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            if name in ("addmm", "_addmm_activation"):
                a, b = args[1], args[2]
                return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
            if name == "bmm":
                a, b = args[0], args[1]
                return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
            if name in ("baddbmm", "addbmm"):
                a, b = args[1], args[2]
                return 2.0 * a.shape[0] * a.shape[1] * a.shape[2] * b.shape[2]
            if name == "linear":
                x, w = args[0], args[1]
                return 2.0 * (x.numel() // x.shape[-1]) * x.shape[-1] * w.shape[0]
            if name in ("mv", "addmv"):
                m = args[0] if name == "mv" else args[1]
                return 2.0 * m.shape[0] * m.shape[1]
            if name == "dot":
                return 2.0 * args[0].numel()
            if name == "matmul":
                a, b = args[0], args[1]
                k = a.shape[-1]
                return 2.0 * (out.numel()) * k
        except Exception:
            pass
        return 0.0

    @staticmethod
    def _is_attention(namespace: str, name: str) -> bool:
        if namespace == "flash_attn" or "flash_attn" in name:
            return True
        return "attention" in name and ("flash" in name or "efficient" in name or "cudnn" in name
                                         or "scaled_dot_product" in name or namespace not in ("aten",))

    def _count_attention(self, namespace, name, func, args, kwargs, pc: PhaseCounts, phase: str) -> bool:
        bound = _bound_args(func, args, kwargs)
        q = bound.get("query", bound.get("q"))
        k = bound.get("key", bound.get("k"))
        v = bound.get("value", bound.get("v"))
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)) or q.dim() != 4:
            return False
        causal = bool(bound.get("is_causal", bound.get("causal", False)))
        if namespace == "aten" and name.startswith(("_efficient_attention", "_flash_attention")):
            causal = causal or bool(bound.get("custom_mask_type", 0))
        # layout: SDPA-level ops are [b, h, s, d]; flash-attn and aten's inner flash/efficient ops [b, s, h, d]
        bshd = namespace != "aten" or name.startswith(("_flash_attention", "_efficient_attention"))
        if bshd:
            b, sq, hq, d = q.shape
            sk = k.shape[1]
        else:
            b, hq, sq, d = q.shape
            sk = k.shape[2]
        dv = v.shape[-1] if isinstance(v, torch.Tensor) else d
        self._add_attention(b, hq, sq, sk, d, dv, causal, "backward" in name or name.endswith("_bwd"), pc, phase)
        return True

    def _add_attention(self, b, hq, sq, sk, d, dv, causal, backward, pc: PhaseCounts, phase: str) -> None:
        fwd, bwd, dense = attention_flops(b, hq, sq, sk, d, dv, causal)
        key = f"{phase}|{'bwd' if backward else 'fwd'}|{sq}|{sk}|{d}|{dv}|{int(causal)}"
        self.counts.attention_calls[key] = self.counts.attention_calls.get(key, 0) + b * hq
        if backward:
            pc.attention_bwd_flops += bwd
            pc.attention_dense_flops += dense * (6 * d + 4 * dv) / (8 * d + 6 * dv)
        else:
            pc.attention_flops += fwd
            pc.attention_dense_flops += dense * (2 * d + 2 * dv) / (8 * d + 6 * dv)

    def record_attention(self, q, k, v, causal: bool = True, backward: bool = False, layout: str = "bshd") -> None:
        phase = self._phase()
        pc = self.counts.phases[phase]
        if layout == "bshd":
            b, sq, hq, d = q.shape
            sk = k.shape[1]
        else:
            b, hq, sq, d = q.shape
            sk = k.shape[2]
        self._add_attention(b, hq, sq, sk, d, v.shape[-1], causal, backward, pc, phase)
        pc.ops += 1


    def _count_copy(self, name, args, kwargs, outputs, pc: PhaseCounts) -> None:
        if name == "copy_" and len(args) >= 2:
            dst, src = args[0], args[1]
        elif args and isinstance(args[0], torch.Tensor) and outputs:
            src, dst = args[0], outputs[0]
        else:
            return
        if not isinstance(src, torch.Tensor) or not isinstance(dst, torch.Tensor):
            return
        src_type, dst_type = src.device.type, dst.device.type
        nbytes = _nbytes(dst)
        if src_type != dst_type:
            if src_type == "cpu" and dst_type != "meta":
                pc.h2d_bytes += nbytes
                if self._in_scope("FSDP::"):
                    self.counts.fsdp_h2d_bytes += nbytes
            elif dst_type == "cpu" and src_type != "meta":
                pc.d2h_bytes += nbytes
                if self._in_scope("FSDP::"):
                    phase = self._phase()
                    self.counts.fsdp_d2h_bytes[phase] = self.counts.fsdp_d2h_bytes.get(phase, 0.0) + nbytes
            return
        if src_type == "cpu" and self.tracker is not None:
            # CPU path: a copy out of an offloaded (host-marked) tensor into a device one is the prefetch
            if self._is_host(src, "cpu") and not self._is_host(dst, "cpu"):
                pc.h2d_bytes += nbytes
            elif name == "copy_" and self._is_host(dst, "cpu") and not self._is_host(src, "cpu"):
                pc.d2h_bytes += nbytes

    def _count_collective(self, namespace, name, func, args, kwargs, out, phase: str) -> None:
        bound = _bound_args(func, args, kwargs)
        if namespace == "deepspeed" or "alltoall" in name or "all_to_all" in name:
            kind = "all_to_all"
            tensor = bound.get("input", args[0] if args else None)
            nbytes = _nbytes(tensor)
            fallback = tensor.shape[0] if namespace == "deepspeed" and isinstance(tensor, torch.Tensor) else self.world_size
            size = fallback if namespace == "deepspeed" else _group_size(bound, fallback)
            factor = (size - 1) / size
        elif "allgather" in name or "all_gather" in name:
            kind = "all_gather"
            if "output_tensors" in bound:
                nbytes = sum(_nbytes(t) for t in _tensors(bound["output_tensors"]))
            elif "output_tensor" in bound:
                nbytes = _nbytes(bound["output_tensor"])
            else:
                nbytes = sum(_nbytes(t) for t in _tensors(out))
            size = _group_size(bound, self.world_size)
            factor = (size - 1) / size
        elif "reduce_scatter" in name:
            kind = "reduce_scatter"
            if "input_tensors" in bound:
                nbytes = sum(_nbytes(t) for t in _tensors(bound["input_tensors"]))
            elif "input_tensor" in bound:
                nbytes = _nbytes(bound["input_tensor"])
            else:
                nbytes = _nbytes(bound.get("input", args[0] if args else None))
            size = _group_size(bound, self.world_size)
            factor = (size - 1) / size
        elif "allreduce" in name or "all_reduce" in name:
            kind = "all_reduce"
            nbytes = sum(_nbytes(t) for t in _tensors(bound.get("tensors", bound.get("input", args[0] if args else None))))
            size = _group_size(bound, self.world_size)
            factor = 2 * (size - 1) / size
        elif name in ("wait_tensor",):
            return
        else:
            kind = "other"
            nbytes = sum(_nbytes(t) for t in _tensors(args))
            size = _group_size(bound, self.world_size)
            factor = 1.0
        fsdp = self._in_scope("FSDP::")
        wire = nbytes * factor
        key = f"{kind}/{phase}/{'fsdp' if fsdp else 'sync'}"
        self.counts.phases[phase].ops += 1  # its dispatch costs host time like any op
        c = self.counts.collectives.setdefault(key, CollectiveCounts())
        c.calls += 1
        c.bytes += nbytes
        c.wire_bytes += wire
        c.max_wire_bytes = max(c.max_wire_bytes, wire)
        if fsdp and kind == "all_gather":
            shard = bound.get("input_tensor", bound.get("input"))
            numel = shard.numel() if isinstance(shard, torch.Tensor) else 0
            self.counts.fsdp_all_gather_input_numel[phase] = self.counts.fsdp_all_gather_input_numel.get(phase, 0) + numel
            if not self.counts.first_fsdp_all_gather_wire_bytes:
                self.counts.first_fsdp_all_gather_wire_bytes = wire
        if fsdp and kind == "reduce_scatter":
            output = bound.get("output_tensor")
            out_bytes = _nbytes(output) if isinstance(output, torch.Tensor) else int(nbytes / max(size, 1))
            self.counts.fsdp_reduce_scatter_output_bytes[phase] = (
                self.counts.fsdp_reduce_scatter_output_bytes.get(phase, 0) + out_bytes)
            self.counts.last_fsdp_reduce_scatter_wire_bytes = wire


_ACTIVE_COUNTERS: list[StepCounter] = []


def record_attention(q, k, v, causal: bool = True, backward: bool = False, layout: str = "bshd") -> None:
    """Tell the active ``StepCounter``s about a fused attention kernel they cannot see as one op.

    For stand-ins that are not dispatcher ops, e.g. the memory oracle's fake flash-attn (an autograd Function
    that only allocates): call it from its forward (``backward=False``) and backward (``backward=True``) with
    the kernel's q, k, v (``layout`` "bshd" as flash-attn, or "bhsd" as SDPA). No-op when no counter is active.
    """
    for counter in list(_ACTIVE_COUNTERS):
        try:
            counter.record_attention(q, k, v, causal, backward, layout)
        except Exception:
            pass

# ---------------------------------------------------------------------------------------------------------
# Rates: the hardware YAML's throughput fields
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rates:
    """Per-device rates and efficiencies of the time model; each is a named field of the hardware YAML.

    Rates are per device (per rank), and per direction for links. Defaults are the H100-class values of
    docs/throughput.md; presets override them.
    """

    name: str
    bf16_flops: float                       # matmul peak of the training dtype (bf16 on GPUs, fp32 for cpu)
    hbm_bytes_per_s: float                  # device memory bandwidth
    intra_node_bytes_per_s: float           # device-device link, per direction (NVLink / gloo loopback)
    host_bytes_per_s: float                 # host link, per direction (PCIe / memcpy)
    matmul_efficiency: float = 0.7          # achieved fraction of bf16_flops for the step's GEMMs
    attention_efficiency: float = 0.35      # achieved fraction of bf16_flops, attention forward (computed FLOPs)
    attention_backward_efficiency: float = 0.3
    attention_tile_q: int = 128             # the kernel's query / key tile: causal blocks on the diagonal are
    attention_tile_kv: int = 128            # computed whole, so computed pairs exceed s*(s+1)/2 by ~s*tile/2
    elementwise_efficiency: float = 0.7     # achieved fraction of hbm_bytes_per_s for memory-bound ops
    elementwise_traffic_factor: float = 3.0  # bytes moved per output byte counted (read ~2 operands, write 1)
    all_to_all_efficiency: float = 0.75     # achieved fraction of the link for all-to-all
    all_gather_efficiency: float = 0.8      # achieved fraction of the link for all-gather (FSDP unshard)
    reduce_scatter_efficiency: float = 0.8  # ... reduce-scatter (FSDP gradient reduction)
    all_reduce_efficiency: float = 0.8      # ... all-reduce (replicated gradients, loss)
    collective_latency_s: float = 20e-6     # fixed cost per collective call
    host_copy_efficiency: float = 1.0       # achieved fraction of host_bytes_per_s
    host_optimizer_bytes_per_s: float = 50e9  # optimizer-step output bytes per second on the host, per rank
    op_overhead_s: float = 0.0              # host time per dispatched op that does work (python + launch)
    view_overhead_s: float = 0.0            # host time per dispatched view / metadata op
    launch_overlaps_compute: bool = True    # GPUs queue kernels: overhead is a floor, not an addition
    side_stream_overlap: float = 1.0        # fraction of compute time FSDP collectives / offload copies can hide behind
    rank_imbalance: float = 0.0             # share of compute time lost waiting for the slowest rank at the step's
                                            # synchronising collectives (several ranks only)
    device_is_host: bool = False            # cpu preset: the "device" is host memory, so FSDP2's offload copies
                                            # (shards to the device, gradients to the host) are no-ops
    # measured attention efficiency per head dim (cpu calibration), {head_dim: (fwd, bwd)}; overrides the scalars
    attention_by_head_dim: tuple = ()

    @property
    def matmul_flops_per_s(self) -> float:
        return self.bf16_flops * self.matmul_efficiency

    def attention_eff(self, head_dim: int, backward: bool) -> float:
        if not self.attention_by_head_dim:
            return self.attention_backward_efficiency if backward else self.attention_efficiency
        table = sorted(self.attention_by_head_dim)
        index = 1 if backward else 0
        if head_dim <= table[0][0]:
            return table[0][1][index]
        if head_dim >= table[-1][0]:
            return table[-1][1][index]
        for (d0, e0), (d1, e1) in zip(table, table[1:]):
            if d0 <= head_dim <= d1:  # linear in log(head_dim)
                w = (math.log(head_dim) - math.log(d0)) / (math.log(d1) - math.log(d0))
                return e0[index] * (1 - w) + e1[index] * w
        return table[-1][1][index]


_INT_FIELDS = {"attention_tile_q", "attention_tile_kv"}
_BOOL_FIELDS = {"launch_overlaps_compute", "device_is_host"}


def _preset_path(name: str) -> Path:
    from autotune.presets import _preset_dir

    return _preset_dir("hardware") / f"{name}.yaml"


def load_rates(hardware, world_size: int = 1, calibration: dict | None = None) -> Rates:
    """The time model's rates for a hardware preset (a ``Hardware``, its name, or a ``Rates``).

    For ``cpu``, the measured calibration of this machine (``autotune.calibrate``) replaces the YAML's rough
    numbers; it is per world size (ranks share the machine's cores: the local backend gives each rank
    ``cpus // world_size`` threads).
    """
    if isinstance(hardware, Rates):
        return hardware
    import yaml

    name = hardware if isinstance(hardware, str) else hardware.name
    path = _preset_path(name)
    data = yaml.safe_load(path.read_text()) if path.exists() else {}
    if not isinstance(hardware, str):  # a Hardware object: its (possibly overridden) core rates
        for key in ("bf16_flops", "hbm_bytes_per_s", "intra_node_bytes_per_s", "host_bytes_per_s"):
            data.setdefault(key, getattr(hardware, key))
    values: dict[str, Any] = {"name": name}
    for f in fields(Rates):
        if f.name in data and f.name not in ("name", "attention_by_head_dim"):
            raw = data[f.name]
            if f.name in _BOOL_FIELDS:
                values[f.name] = bool(raw)
            elif f.name in _INT_FIELDS:
                values[f.name] = int(float(raw))
            else:
                values[f.name] = float(raw)  # YAML 1.1 reads 1.0e12 without a sign as a string
    if name == "cpu":
        from autotune import calibrate

        cal = calibration if calibration is not None else calibrate.load_or_calibrate()
        values.update(calibrate.rates_for(cal, world_size))
    return Rates(**values)


# ---------------------------------------------------------------------------------------------------------
# The time model
# ---------------------------------------------------------------------------------------------------------


@dataclass
class TimeBreakdown:
    """Predicted step time and where it goes (seconds per step, one rank; ranks run in lockstep)."""

    step_time_s: float
    tokens_per_s: float | None
    compute_s: float            # forward + backward (+ small "other" work), incl. per-op overhead
    recompute_s: float          # activation checkpointing / tiling recompute
    exposed_comm_s: float       # collectives not hidden behind compute
    exposed_host_s: float       # host<->device copies not hidden behind compute
    optimizer_s: float          # the optimizer step (host or device)
    detail: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        rows = [("step", self.step_time_s), ("compute", self.compute_s), ("recompute", self.recompute_s),
                ("exposed comm", self.exposed_comm_s), ("exposed host", self.exposed_host_s),
                ("optimizer", self.optimizer_s)]
        return "  ".join(f"{k} {v:.4g}s" for k, v in rows)


def tiled_pairs(sq: int, sk: int, causal: bool, tile_q: int, tile_kv: int) -> float:
    """(query, key) pairs a tiled kernel computes: for each query tile, every key tile up to its last unmasked
    key, whole (torch's CPU flash kernel and flash-attn both skip fully masked tiles only)."""
    if not causal:
        return float(sq * sk)
    tile_q, tile_kv = max(1, tile_q), max(1, tile_kv)
    blocks = -(-sq // tile_q)
    if blocks > 200_000:  # closed form for huge sequences: the excess is about half a tile per query row
        return min(float(sq) * sk, causal_pairs(sq, sk, True) + sq * tile_kv / 2.0 + sq * tile_q / 2.0)
    total = 0
    for index in range(blocks):
        start = index * tile_q
        rows = min(tile_q, sq - start)
        keys = min(start + rows, sk)
        total += rows * min(-(-keys // tile_kv) * tile_kv, sk)
    return float(total)


def _attention_time(counts: StepCounts, phases, r: Rates) -> float | None:
    """Seconds of the fused attention calls in ``phases``, from their shapes; None when no shapes were kept."""
    if not counts.attention_calls:
        return None
    total = 0.0
    for key, bh in counts.attention_calls.items():
        phase, direction, sq, sk, d, dv, causal = key.split("|")
        if phase not in phases:
            continue
        sq, sk, d, dv, causal = int(sq), int(sk), int(d), int(dv), bool(int(causal))
        backward = direction == "bwd"
        per_pair = (6 * d + 4 * dv) if backward else (2 * d + 2 * dv)
        flops = bh * tiled_pairs(sq, sk, causal, r.attention_tile_q, r.attention_tile_kv) * per_pair
        total += flops / (r.bf16_flops * r.attention_eff(d, backward))
    return total


def _phase_time(pc: PhaseCounts, r: Rates, attention_s: float | None = None) -> tuple[float, float]:
    """(device work seconds, host overhead seconds) of one phase."""
    work = 0.0
    if pc.matmul_flops:
        work += pc.matmul_flops / (r.bf16_flops * r.matmul_efficiency)
    if attention_s is not None:
        work += attention_s
    else:
        if pc.attention_flops:
            work += pc.attention_flops / (r.bf16_flops * r.attention_efficiency)
        if pc.attention_bwd_flops:
            work += pc.attention_bwd_flops / (r.bf16_flops * r.attention_backward_efficiency)
    if pc.elementwise_bytes:
        work += pc.elementwise_bytes * r.elementwise_traffic_factor / (r.hbm_bytes_per_s * r.elementwise_efficiency)
    return work, pc.ops * r.op_overhead_s + pc.views * r.view_overhead_s


def _combine(work: float, overhead: float, r: Rates) -> float:
    return max(work, overhead) if r.launch_overlaps_compute else work + overhead


def _collective_time(c: CollectiveCounts, kind: str, r: Rates) -> float:
    if not c.calls:
        return 0.0
    eff = {"all_to_all": r.all_to_all_efficiency, "all_gather": r.all_gather_efficiency,
           "reduce_scatter": r.reduce_scatter_efficiency}.get(kind, r.all_reduce_efficiency)
    return c.wire_bytes / (r.intra_node_bytes_per_s * eff) + c.calls * r.collective_latency_s


def predict_step_time(counts: StepCounts, hardware, world_size: int, techniques=None,
                      seq_len: int | None = None, calibration: dict | None = None) -> TimeBreakdown:
    """Predicted time of one training step from ``counts`` (one rank's ``StepCounts``) on ``hardware``.

    ``hardware``: a ``Hardware``, a preset name or ``Rates``. ``techniques``: ``autotune.config.Techniques``
    (or a dict) -- used for the Ulysses degree (tokens/s) and for where the optimizer runs. See the module
    docstring and docs/throughput.md for the model and its assumptions.
    """
    r = load_rates(hardware, world_size, calibration)
    tech = _techniques_dict(techniques)
    degree = int(tech.get("ulysses_degree", 1) or 1)
    offload_optimizer = bool(tech.get("optimizer_offload", False))
    seq_len = seq_len if seq_len is not None else counts.seq_len

    phase_t = {}
    detail: dict[str, float] = {}
    for p in COMPUTE_PHASES:
        work, overhead = _phase_time(counts.phases[p], r, _attention_time(counts, (p,), r))
        phase_t[p] = _combine(work, overhead, r)
        detail[f"{p}_work_s"] = work
        detail[f"{p}_overhead_s"] = overhead
    compute = phase_t["forward"] + phase_t["backward"] + phase_t["other"]
    recompute = phase_t["recompute"]
    busy = compute + recompute

    # collectives: FSDP's overlap compute on side streams, the rest stall
    sync = 0.0
    kinds = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "other")
    for kind in kinds:
        t = _collective_time(counts.collective(kind, fsdp=False), kind, r)
        detail[f"{kind}_sync_s"] = t
        sync += t
    fsdp_total = 0.0
    for kind in kinds:
        t = _collective_time(counts.collective(kind, fsdp=True), kind, r)
        detail[f"{kind}_fsdp_s"] = t
        fsdp_total += t
    first_last = 0.0
    if fsdp_total:
        # the first all-gather of forward and the last reduce-scatter of backward have nothing to hide behind
        first_last = (counts.first_fsdp_all_gather_wire_bytes / (r.intra_node_bytes_per_s * r.all_gather_efficiency)
                      + counts.last_fsdp_reduce_scatter_wire_bytes
                      / (r.intra_node_bytes_per_s * r.reduce_scatter_efficiency) + 2 * r.collective_latency_s)
        first_last = min(first_last, fsdp_total)
    hideable = max(0.0, fsdp_total - first_last)
    fsdp_exposed = first_last + max(0.0, hideable - r.side_stream_overlap * busy)
    waiting = 0.0
    if world_size > 1 and (sync or fsdp_total):
        waiting = r.rank_imbalance * busy
    exposed_comm = sync + fsdp_exposed + waiting
    detail["fsdp_total_s"] = fsdp_total
    detail["rank_wait_s"] = waiting

    # host <-> device copies, per phase, each direction on its own; hidden behind the same phase's compute
    host_bw = r.host_bytes_per_s * r.host_copy_efficiency
    d2h = {p: counts.phases[p].d2h_bytes for p in COMPUTE_PHASES}
    h2d = {p: counts.phases[p].h2d_bytes for p in COMPUTE_PHASES}
    if r.device_is_host:
        # FSDP marks its offloaded gradients as host memory, but on a CPU device no copy happens
        for p, nbytes in counts.fsdp_d2h_bytes.items():
            d2h[_compute_phase(p)] = max(0.0, d2h.get(_compute_phase(p), 0) - nbytes)
    elif offload_optimizer and not counts.fsdp_h2d_bytes:
        # CPU path (everything is "cpu"): FSDP2's host->device copy of each offloaded shard before its
        # all-gather is a no-op ``.to(device)``, invisible. It copies the master (fp32) shard: all-gather input
        # elements x master itemsize. (The sharded gradients going to the host are seen: FSDP marks them.)
        itemsize = (counts.optimizer_param_bytes / counts.optimizer_params) if counts.optimizer_params else 4
        for p, numel in counts.fsdp_all_gather_input_numel.items():
            h2d[_compute_phase(p)] = h2d.get(_compute_phase(p), 0) + numel * itemsize
    host_total = 0.0
    exposed_host = 0.0
    fwd_busy = phase_t["forward"] + phase_t["other"]
    bwd_busy = phase_t["backward"] + phase_t["recompute"]
    for group, busy_t in ((("forward", "other"), fwd_busy), (("backward", "recompute"), bwd_busy)):
        t = max(sum(d2h.get(p, 0) for p in group), sum(h2d.get(p, 0) for p in group)) / host_bw
        host_total += t
        exposed_host += max(0.0, t - r.side_stream_overlap * busy_t)
    detail["host_transfer_s"] = host_total
    detail["host_d2h_bytes"] = float(sum(d2h.values()))
    detail["host_h2d_bytes"] = float(sum(h2d.values()))

    # the optimizer step
    opt = counts.phases["optimizer"]
    if offload_optimizer or r.device_is_host:
        optimizer = (opt.elementwise_bytes / r.host_optimizer_bytes_per_s
                     + opt.ops * r.op_overhead_s + opt.views * r.view_overhead_s)
    else:
        work, overhead = _phase_time(opt, r, 0.0)
        optimizer = _combine(work, overhead, r)

    step = compute + recompute + exposed_comm + exposed_host + optimizer
    dp = max(1, world_size // degree)
    tokens_per_s = seq_len * dp / step if seq_len and step > 0 else None
    return TimeBreakdown(step_time_s=step, tokens_per_s=tokens_per_s, compute_s=compute, recompute_s=recompute,
                         exposed_comm_s=exposed_comm, exposed_host_s=exposed_host, optimizer_s=optimizer,
                         detail=detail)


def _compute_phase(phase: str) -> str:
    return phase if phase in COMPUTE_PHASES else "other"


def _techniques_dict(techniques) -> dict:
    if techniques is None:
        return {}
    if isinstance(techniques, dict):
        return techniques
    if hasattr(techniques, "to_dict"):
        return techniques.to_dict()
    return dict(vars(techniques))


# ---------------------------------------------------------------------------------------------------------
# Counting a real step in this process (world 1 or a fake process group), the CPU path
# ---------------------------------------------------------------------------------------------------------


def count_real_step(model_config: dict, techniques, seq_len: int, mesh=None, steps: int = 1,
                    seed: int = 0) -> StepCounts:
    """Build the trial's model, apply the stack and count ``steps`` training steps (after one uncounted
    warm-up step, as the trial runner does) with real tensors in this process. ``mesh``: a ``trials.dist.Mesh``
    (default: one rank)."""
    from autotune.config import Techniques
    from trials.data import make_batch, synthetic_sample
    from trials.dist import Mesh
    from trials.memory import DeviceMemoryTracker
    from trials.model import build_model
    from trials.stack import apply
    from trials.step import train_step

    if not isinstance(techniques, Techniques):
        techniques = Techniques.from_dict(dict(techniques))
    mesh = mesh or Mesh.single()
    tracker = DeviceMemoryTracker(None)
    with tracker:
        model = build_model(model_config, seed=seed, device=mesh.device)
        apply(model, techniques, mesh)
        tracker.retag(model.parameters(), "params")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
        tokens = synthetic_sample(mesh.dp_rank, seq_len, model.config.vocab_size, seed)
        batch = make_batch(tokens, mesh.sp_rank, mesh.sp_degree, mesh.device)
        train_step(model, optimizer, batch, mesh, tracker)  # warm-up: optimizer states appear here
        counter = StepCounter(tracker, seq_len=seq_len, world_size=mesh.world_size)
        with counter:
            for _ in range(steps):
                train_step(model, optimizer, batch, mesh, tracker)
    counts = counter.counts
    counts.seq_len = seq_len
    return counts.scaled(steps) if steps > 1 else counts
