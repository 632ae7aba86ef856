"""The throughput half of the ``plan`` backend: count what a training step does, then predict its time.

Two pieces, used in this order:

1. ``StepCounter`` -- a ``TorchDispatchMode`` that watches one training step (real tensors in a CPU trial, or
   fake tensors in the memory oracle's trace) and counts, per phase (forward, backward, recompute, optimizer,
   other):

   - matmul FLOPs (``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``linear``, ...; 2*m*n*k each);
   - attention FLOPs of fused attention kernels (SDPA's flash / efficient / cuDNN / CPU-flash ops and their
     backward, flash-attn's custom ops), counting only the unmasked (query, key) pairs: causal attention over
     ``s`` tokens does ``s*(s+1)/2`` pairs, about half of the dense ``s*s``, and a sliding window ``W`` (flash-attn's
     ``window_size_left + 1``) about ``s*W``; backward = 2.5x forward (recompute QK^T, dV, dP, dQ, dK);
   - elementwise / memory-bound bytes: the output bytes of every other op that makes or writes data (views
     and metadata ops excluded);
   - kernel count (ops that do work), for the per-op host overhead;
   - collectives: the bytes of each call and the bytes this rank puts on the wire, with the algorithmic
     factor ``(P-1)/P`` (all-to-all, all-gather, reduce-scatter) or ``2(P-1)/P`` (all-reduce). Collectives
     issued inside FSDP's ``record_function("FSDP::...")`` regions run on FSDP's side streams and can overlap
     compute; all others (Ulysses all-to-all, gradient all-reduce, the loss all-reduce) stall the step. Each is
     kept by the size of its process group (a Ulysses group, or every rank), which tells the time model whether
     it spans nodes;
   - host<->device bytes: copies between device types (``_to_copy`` / ``copy_`` cuda<->cpu), and on the CPU
     path, where everything is ``cpu``, tensors the memory tracker is told live on the host (``mark_host``)
     and copies out of such tensors;
   - the optimizer step's bytes (output bytes of its ops) and parameters (elements ``addcdiv`` touches).

   Phases: the memory tracker's ``phase`` attribute (``trials.core.memory.DeviceMemoryTracker``) when one is given,
   refined by autograd state: an op inside a backward graph task with grad mode on (or under
   ``torch.utils.checkpoint``'s recomputation hook) is *recompute* (activation checkpointing, tiled MLP
   recompute); an op in a graph task with grad off is *backward*, even when it runs during the tracker's
   forward phase (the tiled loss runs its backward inside forward); ``Optimizer.step`` is recognised by its
   ``record_function`` too, so the counter works without a tracker.

The time model (``autotune.timing.model``) turns the counts into seconds.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.timing.attention_cost import attention_flops
from autotune.timing.counts import PHASES, CollectiveCounts, PhaseCounts, StepCounts, attention_key
from trials.core.memory import TrackerListener
from trials.stack.offload import PREFETCH_SCOPE
from trials.stack.ring import WAITED_SCOPE

_DEBUG = bool(os.environ.get("AUTOTUNE_COUNTER_DEBUG"))


_aten = torch.ops.aten

# ops that only make views / metadata / scalars: no kernel, no bytes
NO_WORK_OPS = {
    "detach",
    "t",
    "view",
    "_unsafe_view",
    "expand",
    "transpose",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "as_strided",
    "permute",
    "split",
    "split_with_sizes",
    "chunk",
    "unbind",
    "alias",
    "lift_fresh",
    "_local_scalar_dense",
    "_reshape_alias",
    "reshape",
    "unfold",
    "diagonal",
    "narrow",
    "expand_as",
    "view_as",
    "numpy_T",
    "real",
    "imag",
    "_neg_view",
    "_conj",
    "is_same_size",
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "size",
    "stride",
    "dim",
    "is_contiguous",
    "empty",
    "empty_like",
    "empty_strided",
    "set_",
    "resize_",
    "_record_function_enter_new",
    "_record_function_exit",
    "record_stream",
    "_to_copy_noop",
    "new_empty",
    "new_empty_strided",
    "item",
    "equal",
    "is_nonzero",
    "_has_compatible_shallow_copy_type",
    "lift_fresh_copy",
    "_foreach_empty",
}
# grouped GEMMs of mixture-of-experts layers (``trials.models.moe``): one GEMM per expert over its block of rows
GROUPED_MATMUL_OPS = {
    ("aten", "_grouped_mm"),
    ("transformers", "grouped_mm_fallback"),
    ("transformers", "grouped_mm_fallback_backward"),
}


def grouped_matmul_flops(name: str, args) -> float:
    """FLOPs of a grouped GEMM: 2 * rows * K * N over all groups, whatever the split. ``_grouped_mm`` takes
    a [S, K] x b [E, K, N] (forward, input gradient) or a [K, S] x b [S, N] (the weight gradient, out [E, K, N]);
    ``grouped_mm_fallback_backward`` computes both gradients of a [S, K] x b [E, K, N]."""
    a, b = args[0], args[1]
    if name == "grouped_mm_fallback_backward":
        return 4.0 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.dim() == 2 and b.dim() == 3:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[2]
    if a.dim() == 2 and b.dim() == 2:
        return 2.0 * a.shape[0] * a.shape[1] * b.shape[1]
    raise ValueError(f"no FLOP formula for grouped GEMM {name} of {tuple(a.shape)} x {tuple(b.shape)}")


MATMUL_OPS = {
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "matmul",
    "linear",
    "mv",
    "addmv",
    "dot",
    "_scaled_mm",
    "_addmm_activation",
    "_int_mm",
}
_COPY = {"_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "clone", "to", "contiguous"}
_ADAM_PARAM_OPS = {"addcdiv_", "_foreach_addcdiv_", "_fused_adam_", "_fused_adamw_"}


def op_name(func) -> tuple[str, str]:
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


def flash_window(left) -> int | None:
    """The window ``W`` of flash-attn's ``window_size_left`` (its left extent leaves out the query's own key:
    ``W = left + 1``); None when unlimited (-1) or absent."""
    return int(left) + 1 if left is not None and int(left) >= 0 else None


def _flash_window_args(bound: dict[str, Any]) -> tuple[int | None, int | None]:
    """(window_size_left, window_size_right) of a flash-attn op's bound args (separate ints, or a
    ``window_size`` pair); None where absent."""
    left, right = bound.get("window_size_left"), bound.get("window_size_right")
    size = bound.get("window_size")
    if isinstance(size, (tuple, list)) and len(size) == 2:
        left, right = size
    return left, right


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


def _bytes_of(bound: dict[str, Any], names: tuple[str, ...], default) -> int:
    """Bytes of the first of ``names`` a collective was called with (a tensor or a list of them), else of
    ``default``."""
    for name in names:
        if name in bound:
            return sum(_nbytes(t) for t in _tensors(bound[name]))
    return sum(_nbytes(t) for t in _tensors(default))


def _group_size(bound: dict[str, Any], fallback: int) -> int:
    """Size of a collective's process group (c10d ProcessGroup object, or a functional op's group name)."""
    if isinstance(bound.get("group_size"), int):
        return bound["group_size"]
    group = bound.get("process_group")
    if group is not None:
        if isinstance(group, torch.ScriptObject):  # c10d ops carry the group boxed
            group = dist.ProcessGroup.unbox(group)
        return int(group.size())
    name = bound.get("group_name")
    if isinstance(name, str):
        return int(_resolve_process_group(name).size())
    return fallback


class StepCounter(TorchDispatchMode):
    """Count FLOPs, bytes and collectives of what runs under it (see module docstring).

        counter = StepCounter(tracker)           # tracker: trials.core.memory.DeviceMemoryTracker or None
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
        self._recordings: list[_Recording] = []  # open ``recording`` blocks: attention calls are logged to them
        self.world_size = world_size
        self._scopes: list[tuple[Any, str]] = []  # open record_function regions (handle, name)
        # ops the counter could not count, {op: the first error}: counts then miss work, so whoever predicts a
        # time from them must not (the plan backend turns them into an error record)
        self.failures: dict[str, str] = {}
        self._listener = _HostTransfers(self)

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

    def current_phase(self) -> str:
        """The phase an op dispatched now is counted in."""
        return self._phase()

    @staticmethod
    def _recomputing() -> bool:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
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
        if self.tracker is not None and device_type == "cpu":
            info = self.tracker.storage_info(t)
            return bool(info is not None and info.host)
        return False

    def __enter__(self):
        if self.tracker is not None:
            self.tracker.add_listener(self._listener)
        _ACTIVE_COUNTERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        if self.tracker is not None:
            self.tracker.remove_listener(self._listener)
        if self in _ACTIVE_COUNTERS:
            _ACTIVE_COUNTERS.remove(self)
        return super().__exit__(*exc)

    # -- recording and repeating (the oracle's identical tiles: ``autotune.oracle.repeats``) ---------------------
    @contextlib.contextmanager
    def recording(self):
        """Record, in order, every increment the counter makes to a phase's counts and to the attention calls inside
        the block; the log's ``other_changes`` says whether anything else in the counts changed (collectives,
        optimizer elements)."""
        log = _Recording()
        phases = self.counts.phases
        others = _others(self.counts)
        self.counts.phases = {name: _RecordingPhase(counts, name, log) for name, counts in phases.items()}
        self._recordings.append(log)
        try:
            yield log
        finally:
            self._recordings.remove(log)
            self.counts.phases = phases
            log.other_changes = _others(self.counts) != others

    @contextlib.contextmanager
    def paused(self):
        """Count nothing inside the block (what it runs is no op of the step)."""
        counts = self.counts
        self.counts = StepCounts(seq_len=counts.seq_len)
        try:
            yield
        finally:
            self.counts = counts

    @staticmethod
    def moved_to_phase(increments, learnt: str, phase: str):
        """A recording's ``increments`` made in phase ``learnt`` as the same ops would make them in ``phase`` (the
        counts' and the attention calls' phase changed, nothing else), or None where not every increment is of
        phase ``learnt``: the counts of the same ops do not depend on the phase they run in."""
        moved = []
        for (where, name), value in increments:
            if where == _CALLS:
                called_in, _, rest = name.partition("|")
                if called_in != learnt:
                    return None
                moved.append(((_CALLS, f"{phase}|{rest}"), value))
            elif where == learnt:
                moved.append(((phase, name), value))
            else:
                return None
        return tuple(moved)

    def replay(self, increments, times: int) -> None:
        """Add ``increments`` (a recording's, in its order) ``times`` more times: the counts the recorded ops would
        leave had they run ``times`` more times, to the bit."""
        phases, calls = self.counts.phases, self.counts.attention_calls
        for _ in range(times):
            for (phase, name), value in increments:
                if phase == _CALLS:
                    calls[name] = calls.get(name, 0) + value
                else:
                    counts = phases[phase]
                    setattr(counts, name, getattr(counts, name) + value)

    # -- the mode ------------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._count(func, args, kwargs, out)
        except Exception as exc:  # never break the step it watches: recorded, and the prediction refused
            if _DEBUG:
                raise
            self.failures.setdefault(str(func), f"{type(exc).__name__}: {exc}")
        return out

    def _count(self, func, args, kwargs, out) -> None:
        namespace, name = op_name(func)
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
            namespace == "deepspeed" and "all_to_all" in name
        ):
            self._count_collective(namespace, name, func, args, kwargs, out, phase)
            return
        if namespace == "_c10d_functional" or name in ("wait_tensor",):
            return
        if name in NO_WORK_OPS:
            pc.views += 1
            return
        if namespace == "aten" and name in MATMUL_OPS:
            pc.matmul_flops += self._matmul_flops(name, args, out)
            pc.ops += 1
            return
        if (namespace, name) in GROUPED_MATMUL_OPS:
            pc.matmul_flops += grouped_matmul_flops(name, args)
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
        except (AttributeError, IndexError, TypeError) as exc:
            raise ValueError(f"cannot size matmul {name} from its arguments ({exc})") from None
        raise ValueError(f"no FLOP formula for matmul op {name}")

    @staticmethod
    def _is_attention(namespace: str, name: str) -> bool:
        if namespace == "flash_attn" or "flash_attn" in name:
            return True
        return "attention" in name and (
            "flash" in name
            or "efficient" in name
            or "cudnn" in name
            or "scaled_dot_product" in name
            or namespace not in ("aten",)
        )

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
        window = None  # aten's SDPA ops have none: a masked call without is_causal computes every pair
        if namespace != "aten":
            left, right = _flash_window_args(bound)
            window = flash_window(left)
            causal = causal or right == 0  # flash-attn masks keys right of the diagonal when right is 0
        # layout: SDPA-level ops are [b, h, s, d]; flash-attn and aten's inner flash/efficient ops [b, s, h, d]
        bshd = namespace != "aten" or name.startswith(("_flash_attention", "_efficient_attention"))
        if bshd:
            b, sq, hq, d = q.shape
            sk = k.shape[1]
        else:
            b, hq, sq, d = q.shape
            sk = k.shape[2]
        dv = v.shape[-1] if isinstance(v, torch.Tensor) else d
        backward = "backward" in name or name.endswith("_bwd")
        self._add_attention(b, hq, sq, sk, d, dv, causal, backward, pc, phase, window)
        return True

    def _add_attention(self, b, hq, sq, sk, d, dv, causal, backward, pc: PhaseCounts, phase: str, window=None):
        fwd, bwd, dense = attention_flops(b, hq, sq, sk, d, dv, causal, window)
        key = attention_key(phase, backward, sq, sk, d, dv, causal, window)
        self.counts.attention_calls[key] = self.counts.attention_calls.get(key, 0) + b * hq
        for log in self._recordings:
            log.increments.append(((_CALLS, key), b * hq))
        if backward:
            pc.attention_bwd_flops += bwd
            pc.attention_dense_flops += dense * (6 * d + 4 * dv) / (8 * d + 6 * dv)
        else:
            pc.attention_flops += fwd
            pc.attention_dense_flops += dense * (2 * d + 2 * dv) / (8 * d + 6 * dv)

    def record_attention(
        self, q, k, v, causal: bool = True, backward: bool = False, layout: str = "bshd", window: int | None = None
    ) -> None:
        phase = self._phase()
        pc = self.counts.phases[phase]
        if layout == "bshd":
            b, sq, hq, d = q.shape
            sk = k.shape[1]
        else:
            b, hq, sq, d = q.shape
            sk = k.shape[2]
        self._add_attention(b, hq, sq, sk, d, v.shape[-1], causal, backward, pc, phase, window)
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
                if self._in_scope(PREFETCH_SCOPE):
                    pc.waited_h2d_bytes += nbytes
                else:
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
                if self._in_scope(PREFETCH_SCOPE):
                    pc.waited_h2d_bytes += nbytes
                else:
                    pc.h2d_bytes += nbytes
            elif name == "copy_" and self._is_host(dst, "cpu") and not self._is_host(src, "cpu"):
                pc.d2h_bytes += nbytes

    def _count_collective(self, namespace, name, func, args, kwargs, out, phase: str) -> None:
        bound = _bound_args(func, args, kwargs)
        if namespace == "deepspeed" or "alltoall" in name or "all_to_all" in name:
            kind = "all_to_all"
            tensor = bound.get("input", args[0] if args else None)
            nbytes = _nbytes(tensor)
            fallback = (
                tensor.shape[0] if namespace == "deepspeed" and isinstance(tensor, torch.Tensor) else self.world_size
            )
            size = fallback if namespace == "deepspeed" else _group_size(bound, fallback)
            factor = (size - 1) / size
        elif "allgather" in name or "all_gather" in name:
            kind = "all_gather"
            nbytes = _bytes_of(bound, ("output_tensors", "output_tensor"), out)
            size = _group_size(bound, self.world_size)
            factor = (size - 1) / size
        elif "reduce_scatter" in name:
            kind = "reduce_scatter"
            nbytes = _bytes_of(bound, ("input_tensors", "input_tensor"), bound.get("input", args[0] if args else None))
            size = _group_size(bound, self.world_size)
            factor = (size - 1) / size
        elif "allreduce" in name or "all_reduce" in name:
            kind = "all_reduce"
            nbytes = sum(
                _nbytes(t) for t in _tensors(bound.get("tensors", bound.get("input", args[0] if args else None)))
            )
            size = _group_size(bound, self.world_size)
            factor = 2 * (size - 1) / size
        elif name in ("wait_tensor",):
            return
        elif name in ("send", "recv_", "recv_any_source_"):
            # ring attention's point-to-point K/V (and dK/dV) to the next ring rank (trials.stack.ring): priced by
            # its sends, each received once; those waited at once (its ``WAITED_SCOPE``) are "p2p_waited"
            self.counts.phases[phase].ops += 1
            if name != "send":
                return
            kind = "p2p_waited" if self._in_scope(WAITED_SCOPE) else "p2p"
            nbytes = sum(_nbytes(t) for t in _tensors(args))
            size = _group_size(bound, self.world_size)
            factor = 1.0
        else:
            kind = "other"
            nbytes = sum(_nbytes(t) for t in _tensors(args))
            size = _group_size(bound, self.world_size)
            factor = 1.0
        fsdp = self._in_scope("FSDP::")
        wire = nbytes * factor
        # the group size too: the time model prices a group spanning nodes on the inter-node fabric
        key = f"{kind}/{phase}/{'fsdp' if fsdp else 'sync'}/{int(size)}"
        self.counts.phases[phase].ops += 1  # its dispatch costs host time like any op
        c = self.counts.collectives.setdefault(key, CollectiveCounts())
        c.calls += 1
        c.bytes += nbytes
        c.wire_bytes += wire
        c.max_wire_bytes = max(c.max_wire_bytes, wire)
        if fsdp and kind == "all_gather":
            shard = bound.get("input_tensor", bound.get("input"))
            numel = shard.numel() if isinstance(shard, torch.Tensor) else 0
            self.counts.fsdp_all_gather_input_numel[phase] = (
                self.counts.fsdp_all_gather_input_numel.get(phase, 0) + numel
            )
            if not self.counts.first_fsdp_all_gather_wire_bytes:
                self.counts.first_fsdp_all_gather_wire_bytes = wire
        if fsdp and kind == "reduce_scatter":
            output = bound.get("output_tensor")
            out_bytes = _nbytes(output) if isinstance(output, torch.Tensor) else int(nbytes / max(size, 1))
            self.counts.fsdp_reduce_scatter_output_bytes[phase] = (
                self.counts.fsdp_reduce_scatter_output_bytes.get(phase, 0) + out_bytes
            )
            self.counts.last_fsdp_reduce_scatter_wire_bytes = wire


_ACTIVE_COUNTERS: list[StepCounter] = []


class _Recording:
    """What ``StepCounter.recording`` saw, in order: ((phase, field), value) per increment of a phase's counts,
    (("attention_calls", key), b * hq) per attention call."""

    def __init__(self):
        self.increments: list[tuple[tuple[str, str], Any]] = []
        self.other_changes = False


class _Addend:
    """A phase's count read through ``_RecordingPhase``: adding to it logs the addend and gives the plain sum."""

    __slots__ = ("value", "key", "log")

    def __init__(self, value, key, log: _Recording):
        self.value, self.key, self.log = value, key, log

    def __add__(self, other):
        self.log.increments.append((self.key, other))
        return self.value + other


class _RecordingPhase:
    """Stands in for a ``PhaseCounts`` while recording: ``counts.field += value`` logs ``value`` and updates the
    real counts."""

    def __init__(self, counts: PhaseCounts, phase: str, log: _Recording):
        object.__setattr__(self, "_target", (counts, phase, log))

    def __getattr__(self, name):
        counts, phase, log = object.__getattribute__(self, "_target")
        return _Addend(getattr(counts, name), (phase, name), log)

    def __setattr__(self, name, value):
        setattr(object.__getattribute__(self, "_target")[0], name, value)


_CALLS = "attention_calls"  # a recording's increments to ``StepCounts.attention_calls``: ((_CALLS, key), b * hq)


def _others(counts: StepCounts) -> str:
    """Everything in ``counts`` but what a recording logs (the phases' counts, the attention calls), comparable."""
    return repr({k: v for k, v in vars(counts).items() if k not in ("phases", _CALLS)})


class _HostTransfers(TrackerListener):
    """On the CPU path the copy to the "host" looks like an ordinary clone; the tracker being told the result
    lives on the host (``mark_host``) is what makes it a device-to-host transfer."""

    def __init__(self, counter: StepCounter):
        self.counter = counter

    def on_moved_to_host(self, tracker, tensor, nbytes: int) -> None:
        counter = self.counter
        phase = counter._phase()
        counter.counts.phases[phase].d2h_bytes += nbytes
        if counter._in_scope("FSDP::"):
            fsdp = counter.counts.fsdp_d2h_bytes
            fsdp[phase] = fsdp.get(phase, 0.0) + nbytes


def record_attention(
    q, k, v, causal: bool = True, backward: bool = False, layout: str = "bshd", window: int | None = None
) -> None:
    """Tell the active ``StepCounter``s about a fused attention kernel they cannot see as one op.

    For stand-ins that are not dispatcher ops, e.g. the memory oracle's fake flash-attn (an autograd Function
    that only allocates): call it from its forward (``backward=False``) and backward (``backward=True``) with
    the kernel's q, k, v (``layout`` "bshd" as flash-attn, or "bhsd" as SDPA) and its sliding ``window`` (W keys
    per query, its own included; None: none). No-op when no counter is active.
    """
    for counter in list(_ACTIVE_COUNTERS):
        counter.record_attention(q, k, v, causal, backward, layout, window)
