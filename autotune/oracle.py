"""The memory oracle: peak device memory per rank of one training step, predicted without a GPU.

It runs the *same* trial code as a real trial (``trials.step.build_training`` -> ``trials.stack.apply``,
AdamW, ``trials.data.make_batch``, ``trials.step.train_step``) under ``FakeTensorMode`` with a fake process
group of the node's world size, and accounts every tensor with the trial's own tracker
(``trials.memory.DeviceMemoryTracker``): the same categories, the same rules, the same code path as a real
CPU trial, so oracle == real CPU trial by construction and the checks in bench/oracle_fidelity.py measure
the remaining differences.

What a fake trace needs that a real trial does not:
- a CPU-only torch cannot fake ``cuda`` training, so the fake device is ``cpu``; the GPU run's precision is
  modelled by running the same mixed-precision scheme (``trials.model.set_compute_dtype``): bf16 compute with
  fp32 master weights on GPU presets, fp32 on the ``cpu`` preset (what CPU trials run);
- GPU kernels whose memory differs from the CPU kernels are modelled (``gpu_kernels``):
  ``attention='flash'`` runs a fake flash-attn op with flash-attn 2's footprint (saves q, k, v, out and the
  fp32 logsumexp; no kv-head repeat for GQA; backward allocates dq/dk/dv plus its fp32 ``dq_accum``,
  ``softmax_d`` and, for GQA, ``dk``/``dv`` expanded to the query heads); ``attention='sdpa'`` keeps the trial's
  kv repeat and adds the CUDA flash backward's fp32 ``dq_accum`` + ``softmax_d`` to the CPU kernel's;
- ``.item()`` / ``float(t)`` on a fake tensor (the step's loss and grad norm) return a constant;
- the optimizer states are created up front by one optimizer step on zero gradients ("priming"), so one
  traced step shows what a real trial's second step shows (states live through forward and backward)
  without tracing two steps.

Runtime overheads that no tensor shows come from the hardware preset: ``cuda_context_bytes``,
``nccl_buffer_bytes`` and ``allocator_fragmentation`` (a fraction of the tensor peak). They are added to
``peak_device_bytes`` (the OOM decision) and listed in the breakdown under ``other``; ``tensor_peak_bytes``
keeps the bare tensor peak. They are 0 on the ``cpu`` preset, so it predicts exactly what a CPU trial's
tracker measures.

Depth extrapolation (speed). Decoder layers are identical, so a model of ``L`` layers is traced with 3 and 4
layers and extended exactly. The trace is cut into segments: ``setup`` (building the model -- trial code
materialises the whole model on the device before FSDP shards it -- and the batch), then (phase, position)
with position ``pre`` / ``first`` / ``middle`` / ``last`` / ``post`` relative to the decoder layers (forward:
layer pre-hooks; backward: gradient hooks on each layer's output and on the first layer's input; optimizer;
the gaps between phases). With a partial activation offload the layers form two runs (offloaded, on the
device) and positions are relative to each run; each run of 3+ layers is traced at 3 and at 4.
Inside one segment every op's live bytes are ``a + b*i + c*L`` (``i`` the layer index: saved activations of
earlier layers, gradients of later ones, per-layer states), so each segment's peak -- the max over its
ops and, for ``middle``, over layers 1..L-2, reached at an end of that range -- is linear in ``L`` for
``L >= 3``; it is extrapolated from the 3- and 4-layer traces per category, and the model's peak is the
largest extrapolated segment peak. Models of up to 4 layers are traced at full depth. ``tests/test_oracle.py``
checks the extrapolation against full-depth traces.

Reentrancy: each trace creates its fake process group and destroys it afterwards, so one process can run
any number of traces (the search calls it hundreds of times); it refuses to run inside a process that
already has a (real) default process group.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import torch

from autotune.record import BREAKDOWN_CATEGORIES, ResultRecord

EXTRAPOLATE_FROM = (3, 4)  # traced depths when a model is deeper than the larger one


# ---------------------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Segment:
    """The peak of one segment of the step: total device bytes, by category, and the host bytes then."""

    device_bytes: int
    breakdown: dict[str, int]
    host_bytes: int = 0
    at_op: str | None = None             # explain mode: the op right before the peak
    live: list | None = None             # explain mode: the largest live storages at the peak


@dataclass
class Trace:
    """What one fake trace (or an extrapolation of two) says about rank 0 of one config."""

    layers: int
    peak_device_bytes: int               # tensor bytes only
    breakdown: dict[str, int]            # by category at the peak
    peak_host_bytes: int
    peak_segment: tuple | None = None    # where the peak is: (phase, position)
    segments: dict[tuple, Segment] = field(default_factory=dict)
    elapsed_s: float = 0.0
    extras: list = field(default_factory=list)  # what ``modes`` returned, per traced depth (see ``trace``)
    runs: list = field(default_factory=list)    # the traced decoder layers as runs (``layer_runs``)
    stopped: bool = False                # ``stop_above_bytes`` crossed: the step was cut short there


@dataclass
class Prediction:
    """The oracle's answer for one evaluation (rank 0 = the most loaded rank)."""

    tensor_peak_bytes: int               # peak of live tensor bytes
    peak_device_bytes: int               # tensor peak + runtime overheads (what the OOM decision uses)
    breakdown: dict[str, int]            # categories at the peak; ``other`` includes the overheads
    host_bytes: int
    overhead_bytes: int
    peak_segment: tuple | None
    traces: list[Trace]                  # [base] or [base, one per extended run]
    elapsed_s: float
    extension: list[int] = field(default_factory=list)  # per extended run: layers beyond the base trace
    stopped: bool = False                # cut short at a crossing of ``stop_above_bytes``: peak is a lower bound


# ---------------------------------------------------------------------------------------------------------
# The fake world: process group, dispatch stubs, GPU kernels
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_process_group(world_size: int, needed: bool | None = None):
    """A fake default process group of ``world_size`` ranks (this process is rank 0); destroyed on exit.

    ``needed``: default ``world_size > 1``; one rank needs one too when FSDP runs there."""
    import torch.distributed as dist

    if not (world_size > 1 if needed is None else needed):
        yield
        return
    if dist.is_initialized():
        raise RuntimeError("the memory oracle cannot run in a process that already has a process group; "
                           "run it in a separate process")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _make_oracle_mode(gpu_kernels: bool):
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    sdpa_cpu_bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    class OracleMode(TorchDispatchMode):
        """Top of the mode stack: constants for data-dependent scalars, GPU-kernel temporaries."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is aten._local_scalar_dense.default:
                dtype = args[0].dtype
                return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
            if gpu_kernels and func is sdpa_cpu_bwd:
                # CUDA flash backward (torch's vendored FA2): fp32 dq accumulator + softmax_d while it runs
                query = args[1]
                b, h, s, d = query.shape
                scratch = (torch.empty((b, s, h, d), dtype=torch.float32, device=query.device),
                           torch.empty((b, h, s), dtype=torch.float32, device=query.device))
                out = func(*args, **kwargs)
                del scratch
                return out
            return func(*args, **kwargs)

    return OracleMode()


class _FakeFlashAttn(torch.autograd.Function):
    """flash-attn 2's ``flash_attn_func`` as far as memory goes (fake tensors only: nothing is computed).

    q [b, s, hq, d], k/v [b, s, hkv, d] -> out [b, s, hq, d]; saves q, k, v, out, softmax_lse [b, hq, s] fp32.
    Backward (``mha_bwd``): dq/dk/dv like q/k/v; while it runs, fp32 ``dq_accum`` [b, s, hq, d], fp32
    ``softmax_d`` [b, hq, s] and, when hkv < hq, ``dk``/``dv`` expanded to hq heads (summed down at the end).
    """

    @staticmethod
    def forward(ctx, q, k, v):
        b, s, h, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        _record_attention(q, k, v, backward=False)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, s, h, d = q.shape
        _record_attention(q, k, v, backward=True)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        scratch = [torch.empty((b, s, h, d), dtype=torch.float32, device=q.device),
                   torch.empty((b, h, s), dtype=torch.float32, device=q.device)]
        if k.shape[2] != h:
            scratch += [torch.empty((b, k.shape[1], h, d), dtype=k.dtype, device=k.device),
                        torch.empty((b, v.shape[1], h, d), dtype=v.dtype, device=v.device)]
            # summed down to the kv heads into dk/dv (an op while the scratch buffers are live)
            groups = h // k.shape[2]
            torch.sum(scratch[2].unflatten(2, (k.shape[2], groups)), 3, out=dk)
            torch.sum(scratch[3].unflatten(2, (v.shape[2], groups)), 3, out=dv)
        else:
            dq.zero_()  # an op while the scratch buffers are live
        del scratch
        return dq, dk, dv


def _record_attention(q, k, v, backward: bool, causal: bool = True) -> None:
    """Tell the throughput counter (``autotune.throughput.StepCounter``) about the fake kernel's FLOPs."""
    try:
        from autotune.throughput import record_attention
    except ImportError:  # memory-only predictions
        return
    record_attention(q, k, v, causal=causal, backward=backward, layout="bshd")


def _fake_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    return _FakeFlashAttn.apply(q, k, v)


def _fake_wrapped_flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left=-1,
                                     window_size_right=-1, softcap=0.0, alibi_slopes=None, return_softmax=False):
    """flash-attn >= 2.7 ``_wrapped_flash_attn_forward``: (out, softmax_lse fp32 [b, h, s], S_dmask, rng_state)."""
    b, s, h, d = q.shape
    _record_attention(q, k, v, backward=False, causal=causal)
    out = torch.empty_like(q)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
    return out, lse, None, rng_state


def _fake_wrapped_flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                      window_size_left=-1, window_size_right=-1, softcap=0.0, alibi_slopes=None,
                                      deterministic=False, rng_state=None):
    """flash-attn's ``mha_bwd`` into dq/dk/dv, with its scratch (see ``_FakeFlashAttn``); returns softmax_d."""
    b, s, h, d = q.shape
    _record_attention(q, k, v, backward=True, causal=causal)
    softmax_d = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    scratch = [torch.empty((b, s, h, d), dtype=torch.float32, device=q.device)]
    if k.shape[2] != h:
        groups = h // k.shape[2]
        scratch += [torch.empty((b, k.shape[1], h, d), dtype=k.dtype, device=k.device),
                    torch.empty((b, v.shape[1], h, d), dtype=v.dtype, device=v.device)]
        torch.sum(scratch[1].unflatten(2, (k.shape[2], groups)), 3, out=dk)
        torch.sum(scratch[2].unflatten(2, (v.shape[2], groups)), 3, out=dv)
    else:
        dq.zero_()
    del scratch
    return softmax_d


@contextlib.contextmanager
def _fake_flash_kernel(enabled: bool):
    """Make ``trials.attention`` (and ``flash_attn`` imports inside trial code) use fake flash-attn ops with
    flash-attn 2's memory footprint, on the (fake) cpu device."""
    if not enabled:
        yield
        return
    import sys
    import types

    from trials import attention

    import importlib.machinery

    package = types.ModuleType("flash_attn")
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    package.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    interface.__spec__ = importlib.machinery.ModuleSpec("flash_attn.flash_attn_interface", None)
    package.flash_attn_func = interface.flash_attn_func = _fake_flash_attn_func
    interface._wrapped_flash_attn_forward = _fake_wrapped_flash_attn_forward
    interface._wrapped_flash_attn_backward = _fake_wrapped_flash_attn_backward
    package.flash_attn_interface = interface
    saved_modules = {name: sys.modules.get(name) for name in ("flash_attn", "flash_attn.flash_attn_interface")}
    saved = attention.flash_attn_func, attention.flash_available
    sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = package, interface
    attention.flash_attn_func = _fake_flash_attn_func
    attention.flash_available = lambda device: True
    try:
        yield
    finally:
        attention.flash_attn_func, attention.flash_available = saved
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


# ---------------------------------------------------------------------------------------------------------
# The tracker with segments
# ---------------------------------------------------------------------------------------------------------


def _segment_tracker_class():
    from trials.memory import DeviceMemoryTracker

    class SegmentTracker(DeviceMemoryTracker):
        """``DeviceMemoryTracker`` that also keeps the peak of each segment of the step (see module doc)."""

        def __init__(self, explain: bool = False):
            super().__init__(None)
            self.segment: tuple = ("setup", None)
            self.segments: dict[tuple, Segment] = {}
            self.explain = explain
            self._op = None
            self._origin: dict[int, tuple] = {}  # explain: id(storage info) -> (op, shape, dtype, segment)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self._op = func
            return super().__torch_dispatch__(func, types, args, kwargs)

        def track(self, tensor, category=None):
            if self.explain and isinstance(tensor, torch.Tensor) and tensor.device.type != "meta":
                local = getattr(tensor, "_local_tensor", tensor)
                known = self._storages.get(local.untyped_storage())
                super().track(tensor, category)
                info = self._storages.get(local.untyped_storage())
                if known is None and info is not None:
                    self._origin[id(info)] = (str(self._op).replace("aten.", ""), tuple(local.shape),
                                              str(local.dtype).replace("torch.", ""), self.segment)
                return
            super().track(tensor, category)

        def _live(self, top: int = 12) -> list[dict]:
            """The largest live device storages now, with the op that made them (explain mode)."""
            live = []
            for info in list(self._storages.values()):
                if info.host or not info.nbytes:
                    continue
                op, shape, dtype, seg = self._origin.get(id(info), ("?", (), "?", None))
                live.append({"bytes": info.nbytes, "category": info.category, "op": op, "shape": shape,
                             "dtype": dtype, "made_in": seg})
            live.sort(key=lambda e: -e["bytes"])
            return live[:top]

        def _check(self) -> None:
            self._segment_check()
            super()._check()  # last: it raises at a stop_above_bytes crossing, which must be in the segment

        def _segment_check(self) -> None:
            seg = self.segments.get(self.segment)
            if seg is None:
                seg = self.segments[self.segment] = Segment(self.device_bytes, dict(self.current), self.host_bytes)
                if self.explain:
                    seg.at_op, seg.live = str(self._op), self._live()
            else:
                if self.device_bytes > seg.device_bytes:
                    seg.device_bytes = self.device_bytes
                    seg.breakdown = dict(self.current)
                    if self.explain:
                        seg.at_op, seg.live = str(self._op), self._live()
                if self.host_bytes > seg.host_bytes:
                    seg.host_bytes = self.host_bytes

        @contextlib.contextmanager
        def in_phase(self, phase: str):
            with super().in_phase(phase):
                self.segment = (phase, "pre")
                try:
                    yield
                finally:
                    self.segment = (phase, "end")

    return SegmentTracker


def _positions(runs: list[tuple[str, int]]) -> list[tuple[str, str]]:
    """Each layer's segment label: (run kind, first | middle | last | only) -- its place inside its run."""
    labels = []
    for kind, count in runs:
        for j in range(count):
            pos = "only" if count == 1 else "first" if j == 0 else "last" if j == count - 1 else "middle"
            labels.append((kind, pos))
    return labels


def _install_segment_hooks(model, tracker, runs) -> list:
    """Forward pre-hooks and gradient hooks that move ``tracker.segment`` along the decoder layers."""
    layers = list(model.layers)
    count = len(layers)
    labels = _positions(runs)
    if len(labels) != count:
        raise ValueError(f"runs {runs} do not cover the model's {count} layers")
    handles = []

    def set_segment(key):
        def hook(grad):
            tracker.segment = key
        return hook

    def first_tensor(value):
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
            return value[0]
        return None

    for index, layer in enumerate(layers):
        def pre(module, args, kwargs, index=index):
            if tracker.phase != "forward":
                return
            tracker.segment = ("forward", labels[index])
            if index == 0:
                hidden = first_tensor(args[0] if args else kwargs.get("hidden_states"))
                if hidden is not None and hidden.requires_grad:
                    hidden.register_hook(set_segment(("backward", "post")))

        def post(module, args, kwargs, output, index=index):
            if tracker.phase != "forward":
                return
            if index == count - 1:
                tracker.segment = ("forward", "post")
            hidden = first_tensor(output)
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(set_segment(("backward", labels[index])))

        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post, with_kwargs=True))
    return handles


# ---------------------------------------------------------------------------------------------------------
# One fake trace
# ---------------------------------------------------------------------------------------------------------


def compute_dtype_for(hardware) -> torch.dtype:
    """The precision a real trial on ``hardware`` computes in: fp32 on ``cpu``, bf16 on GPUs."""
    name = hardware if isinstance(hardware, str) else hardware.name
    return torch.float32 if name == "cpu" else torch.bfloat16


def layer_runs(techniques, num_layers: int) -> list[tuple[str, int]]:
    """The model's decoder layers as runs of identical layers: ``[(kind, count), ...]`` in model order.

    All layers are alike except with a partial activation offload (the first N layers' inputs live on the
    host, ``trials.checkpointing``): then an ``offload`` run and a ``device`` run.
    """
    offload = techniques.activation_offload_layers
    if 0 < offload < num_layers:
        return [("offload", offload), ("device", num_layers - offload)]
    return [("layers", num_layers)]


def _techniques_for_runs(techniques, runs: list[tuple[str, int]]):
    """``techniques`` for a model whose decoder layers are ``runs`` (a shallower copy of the real one)."""
    if techniques.activation_offload_layers:
        offloaded = sum(n for kind, n in runs if kind in ("offload", "layers"))
        return replace(techniques, activation_offload_layers=offloaded)
    return techniques


def trace(model_config: dict, techniques, seq_len: int, world_size: int, *,
          compute_dtype: torch.dtype = torch.float32, gpu_kernels: bool = False, layers: int | None = None,
          runs: list[tuple[str, int]] | None = None, modes: Callable[[Any], Iterable] | None = None,
          prime_optimizer: bool = True, steps: int = 1, seed: int = 0, explain: bool = False,
          stop_above_bytes: int | None = None) -> Trace:
    """Run ``steps`` training steps of the trial under FakeTensorMode on rank 0 of a fake world and return
    the tracked peak.

    ``layers``: trace a copy of the model with this many decoder layers (default: the model's own), all alike
    (``activation_offload_layers`` must be 0 or all); ``runs``: the layers as runs of identical layers
    (``layer_runs``) for a copy of the model, e.g. ``[("offload", 3), ("device", 4)]``.
    ``modes(tracker)``: extra ``TorchDispatchMode``s (e.g. ``autotune.throughput.StepCounter``) entered
    inside the tracker around the traced steps only (not the priming); they are returned in ``extras``.
    ``prime_optimizer``: create the AdamW states before the traced step (see module doc); with False, trace
    ``steps`` >= 2 to see them. ``explain``: keep, per segment, the op at its peak and the largest live
    storages then (with the op, shape and dtype that made each) -- slower; see ``explain``.
    ``stop_above_bytes``: stop the step at the first allocation that takes live tensor bytes above this (like
    a real trial's OOM); the returned trace is then ``stopped`` and its peak is where it stopped.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trials.data import make_batch
    from trials.dist import Mesh, build_mesh, ensure_device_mesh
    from trials.step import build_training, train_step

    started = time.perf_counter()
    num_layers = model_config["num_hidden_layers"]
    if runs is None:
        if layers is None or layers == num_layers:
            runs = layer_runs(techniques, num_layers)
        elif techniques.activation_offload_layers not in (0, num_layers):
            raise ValueError("a partial activation offload needs ``runs`` to trace a shallower copy")
        else:
            runs = [("layers", layers)]
    layers = sum(n for _, n in runs)
    config = dict(model_config, num_hidden_layers=layers)
    techniques = _techniques_for_runs(techniques, runs)
    device = torch.device("cpu")
    tracker = _segment_tracker_class()(explain)
    tracker.capacity_bytes = stop_above_bytes
    extras: list = []
    stopped = False
    with fake_process_group(world_size, world_size > 1 or techniques.fsdp):
        # groups and the device mesh hold small real tensors: build them before faking
        mesh = build_mesh(techniques.ulysses_degree, device) if world_size > 1 else Mesh.single(device)
        if world_size > 1 and not mesh.distributed:
            raise RuntimeError("fake process group did not take")
        if techniques.fsdp and mesh.device_mesh is None:
            ensure_device_mesh(mesh)  # one rank with FSDP: a 1-rank (fake) group, as trials.stack.apply makes
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode, tracker, _make_oracle_mode(gpu_kernels):
            model, optimizer = build_training(config, techniques, mesh, seed, tracker, compute_dtype=compute_dtype)
            _install_segment_hooks(model, tracker, runs)
            tokens = torch.zeros(seq_len + 1, dtype=torch.long)
            batch = make_batch(tokens, mesh.sp_rank, mesh.sp_degree, device)
            if prime_optimizer:
                _prime_optimizer(model, optimizer, tracker)
            extra_modes = list(modes(tracker)) if modes is not None else []
            try:
                with contextlib.ExitStack() as stack:
                    # only around the step: transformers probes for flash_attn while it imports model code
                    stack.enter_context(_fake_flash_kernel(gpu_kernels and techniques.attention == "flash"))
                    stack.enter_context(_fsdp_gather_outputs_are_params(tracker))
                    for mode in extra_modes:
                        stack.enter_context(mode)
                    for _ in range(steps):
                        train_step(model, optimizer, batch, mesh, tracker)
            except torch.OutOfMemoryError:
                if stop_above_bytes is None:
                    raise
                stopped = True
            extras = extra_modes
            del model, optimizer, batch, tokens
    # ("setup", None) is building the model and the batch: trial code builds the whole model on the device
    # before FSDP shards it, so that can be the peak (a real trial measures it too); it scales with depth
    # like any other segment
    segments = dict(tracker.segments)
    peak_key = max(segments, key=lambda k: segments[k].device_bytes) if segments else None
    peak = segments[peak_key] if peak_key else Segment(0, dict.fromkeys(BREAKDOWN_CATEGORIES, 0))
    return Trace(layers=layers, peak_device_bytes=int(peak.device_bytes), breakdown=_full(peak.breakdown),
                 peak_host_bytes=int(tracker.peak_host_bytes), peak_segment=peak_key, segments=segments,
                 elapsed_s=time.perf_counter() - started, extras=[extras], runs=list(runs), stopped=stopped)


@contextlib.contextmanager
def _fsdp_gather_outputs_are_params(tracker):
    """FSDP2 allocates each unsharded-parameter buffer with ``torch.empty`` at its first all-gather and only
    resizes it afterwards; the tracker labels resized storages ``params`` but a first-ever buffer by phase
    (``activations``). A real trial's measured peak comes from a later step, where they are ``params``; the
    primed oracle traces one step, so label them ``params`` from the start (labels only, not bytes)."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # pragma: no cover
        yield
        return
    original = FSDPParam.init_all_gather_outputs

    def init_all_gather_outputs(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        tracker.retag(self.all_gather_outputs, "params")
        return result

    FSDPParam.init_all_gather_outputs = init_all_gather_outputs
    try:
        yield
    finally:
        FSDPParam.init_all_gather_outputs = original


def _prime_optimizer(model, optimizer, tracker) -> None:
    """Create the optimizer states as a real first step does: one step on zero gradients."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    with tracker.in_phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    tracker.segment = ("setup", None)


def _full(breakdown: dict) -> dict[str, int]:
    return {c: int(breakdown.get(c, 0)) for c in BREAKDOWN_CATEGORIES}


# ---------------------------------------------------------------------------------------------------------
# Depth extrapolation
# ---------------------------------------------------------------------------------------------------------


def plan_traces(runs: list[tuple[str, int]]) -> tuple[list[tuple[str, int]], list[tuple[int, list]]]:
    """Which shallow copies to trace for a model of ``runs``: a base (each run of 3+ layers cut to 3, shorter
    runs as they are) and, per cut run, the base with that run at 4 layers. Returns (base, [(run index,
    runs), ...]); no cut runs (all shorter than 3) means: trace the model itself."""
    short, long = EXTRAPOLATE_FROM
    base = [(kind, min(n, short)) for kind, n in runs]
    varied = []
    for index, (kind, n) in enumerate(runs):
        if n > short:
            longer = list(base)
            longer[index] = (kind, long)
            varied.append((index, longer))
    return base, varied


def extrapolate(base: Trace, varied: list[tuple[int, Trace]], runs: list[tuple[str, int]]) -> Trace:
    """Extend the traces of ``plan_traces`` to the model of ``runs``: each segment's peak (and each category
    in it, and the host bytes then) is ``base + sum over cut runs of (trace_run - base) * (length - 3)``."""
    short = EXTRAPOLATE_FROM[0]
    steps = [(trace, runs[index][1] - short) for index, trace in varied]
    segments: dict[tuple, Segment] = {}
    for key, a in base.segments.items():
        device, host = a.device_bytes, a.host_bytes
        breakdown = {c: a.breakdown.get(c, 0) for c in BREAKDOWN_CATEGORIES}
        for trace, n in steps:
            b = trace.segments.get(key)
            if b is None:
                raise RuntimeError(f"segment {key} is missing from the {trace.layers}-layer trace")
            device += (b.device_bytes - a.device_bytes) * n
            host += (b.host_bytes - a.host_bytes) * n
            for c in BREAKDOWN_CATEGORIES:
                breakdown[c] += (b.breakdown.get(c, 0) - a.breakdown.get(c, 0)) * n
        segments[key] = Segment(int(device), {c: int(v) for c, v in breakdown.items()}, int(host))
    peak_key = max(segments, key=lambda k: segments[k].device_bytes)
    peak = segments[peak_key]
    host = base.peak_host_bytes + sum((t.peak_host_bytes - base.peak_host_bytes) * n for t, n in steps)
    host = max(host, max(s.host_bytes for s in segments.values()))
    traces = [base] + [t for _, t in varied]
    return Trace(layers=sum(n for _, n in runs), peak_device_bytes=peak.device_bytes,
                 breakdown=_full(peak.breakdown), peak_host_bytes=int(host), peak_segment=peak_key,
                 segments=segments, elapsed_s=sum(t.elapsed_s for t in traces),
                 extras=[e for t in traces for e in t.extras], runs=list(runs))


def extend_value(base, others: list[tuple[Any, int]]):
    """Linear extension of any numeric structure (numbers, dicts, lists, dataclasses) the way ``extrapolate``
    extends segment peaks: ``base + sum of (other - base) * n`` over ``others = [(other, n), ...]`` -- e.g. a
    throughput counter's counts of the traces in ``Prediction.traces`` with ``Prediction.extension``."""
    import dataclasses

    if isinstance(base, bool) or base is None:
        return base if not others else others[-1][0]
    if isinstance(base, (int, float)):
        value = base + sum((other - base) * n for other, n in others)
        return int(value) if isinstance(base, int) and all(isinstance(o, int) for o, _ in others) else value
    if isinstance(base, dict):
        keys = list(base) + [k for other, _ in others for k in other if k not in base]
        keys = list(dict.fromkeys(keys))
        return {k: extend_value(base[k] if k in base else _zero_like(next(o[k] for o, _ in others if k in o)),
                                [(o[k] if k in o else _zero_like(base[k]), n) for o, n in others]) for k in keys}
    if isinstance(base, (list, tuple)) and all(isinstance(o, (list, tuple)) and len(o) == len(base)
                                               for o, _ in others):
        return type(base)(extend_value(v, [(o[i], n) for o, n in others]) for i, v in enumerate(base))
    if dataclasses.is_dataclass(base) and not isinstance(base, type):
        return type(base)(**{f.name: extend_value(getattr(base, f.name), [(getattr(o, f.name), n) for o, n in others])
                             for f in dataclasses.fields(base) if f.init})
    return base if not others else others[-1][0]


def _zero_like(value):
    import dataclasses

    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return type(value)(0)
    if isinstance(value, dict):
        return {k: _zero_like(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return type(value)(**{f.name: _zero_like(getattr(value, f.name)) for f in dataclasses.fields(value)})
    return value


# ---------------------------------------------------------------------------------------------------------
# Predictions for an Evaluation
# ---------------------------------------------------------------------------------------------------------


def overheads(hardware, tensor_peak: int) -> int:
    """Device bytes no tensor shows (hardware preset): CUDA context, NCCL buffers, allocator fragmentation."""
    return int(hardware.cuda_context_bytes + hardware.nccl_buffer_bytes
               + math.ceil(hardware.allocator_fragmentation * tensor_peak))


def predict(evaluation, modes: Callable[[Any], Iterable] | None = None, full_depth: bool = False,
            compute_dtype: torch.dtype | None = None, gpu_kernels: bool | None = None,
            stop_above_bytes: int | None = None) -> Prediction:
    """The oracle's prediction for ``evaluation`` (an ``autotune.backends.Evaluation``).

    ``compute_dtype`` / ``gpu_kernels`` default from the hardware preset (fp32 and CPU kernels on ``cpu``,
    bf16 and GPU kernels otherwise); overriding them models e.g. a bf16 CPU trial.

    ``stop_above_bytes`` (device bytes, overheads included): the search only needs to know that a config is
    out of memory, not by how much, so a trace stops as soon as it crosses this -- a shallow copy that does
    not fit means the full model, which holds at least as much, does not either. The prediction is then
    ``stopped`` and its peak is a lower bound (the bytes at the crossing).
    """
    started = time.perf_counter()
    hardware = evaluation.hardware
    kwargs = dict(compute_dtype=compute_dtype or compute_dtype_for(hardware),
                  gpu_kernels=hardware.name != "cpu" if gpu_kernels is None else gpu_kernels, modes=modes)
    layers = evaluation.model_config["num_hidden_layers"]
    args = (evaluation.model_config, evaluation.techniques, evaluation.seq_len, evaluation.gpus)
    runs = layer_runs(evaluation.techniques, layers)
    base, varied = plan_traces(runs)
    if stop_above_bytes is not None:  # tensor bytes t with t + overheads(t) above the limit
        fixed = hardware.cuda_context_bytes + hardware.nccl_buffer_bytes
        kwargs["stop_above_bytes"] = max(0, int((stop_above_bytes - fixed) / (1 + hardware.allocator_fragmentation)))
    extension: list[int] = []
    if full_depth or not varied or layers <= EXTRAPOLATE_FROM[1]:
        result = trace(*args, runs=runs, **kwargs)
        traces = [result]
    else:
        traces = [trace(*args, runs=base, **kwargs)]
        varied_traces = []
        for index, longer in varied:
            if traces[-1].stopped:
                break
            varied_traces.append((index, trace(*args, runs=longer, **kwargs)))
            traces.append(varied_traces[-1][1])
        if traces[-1].stopped:
            result = traces[-1]
        else:
            result = extrapolate(traces[0], varied_traces, runs)
            extension = [runs[index][1] - EXTRAPOLATE_FROM[0] for index, _ in varied]
    extra = overheads(hardware, result.peak_device_bytes)
    breakdown = dict(result.breakdown)
    breakdown["other"] = breakdown.get("other", 0) + extra
    return Prediction(tensor_peak_bytes=result.peak_device_bytes, peak_device_bytes=result.peak_device_bytes + extra,
                      breakdown=breakdown, host_bytes=result.peak_host_bytes, overhead_bytes=extra,
                      peak_segment=result.peak_segment, traces=traces, elapsed_s=time.perf_counter() - started,
                      extension=extension, stopped=result.stopped)


def explain(evaluation, top: int = 12) -> str:
    """A readable account of where ``evaluation``'s peak comes from: every segment's extrapolated peak by
    category, then, for the peak segment, the op at its peak and the largest tensors alive then (from the
    traced shallow copy: per-layer tensors are shown once, the full-depth sums are in the table)."""
    hardware = evaluation.hardware
    layers = evaluation.model_config["num_hidden_layers"]
    runs = layer_runs(evaluation.techniques, layers)
    base, varied = plan_traces(runs)
    kwargs = dict(compute_dtype=compute_dtype_for(hardware), gpu_kernels=hardware.name != "cpu", explain=True)
    args = (evaluation.model_config, evaluation.techniques, evaluation.seq_len, evaluation.gpus)
    if not varied or layers <= EXTRAPOLATE_FROM[1]:
        result = first = trace(*args, runs=runs, **kwargs)
    else:
        first = trace(*args, runs=base, **kwargs)
        result = extrapolate(first, [(i, trace(*args, runs=r, **kwargs)) for i, r in varied], runs)
    gib = 2.0**30
    lines = [f"{'segment':<40} {'GiB':>8}  " + " ".join(f"{c[:6]:>7}" for c in BREAKDOWN_CATEGORIES) + "   host"]
    for key, seg in result.segments.items():
        mark = " <- peak" if key == result.peak_segment else ""
        lines.append(f"{str(key):<40} {seg.device_bytes / gib:8.2f}  "
                     + " ".join(f"{seg.breakdown.get(c, 0) / gib:7.2f}" for c in BREAKDOWN_CATEGORIES)
                     + f" {seg.host_bytes / gib:6.1f}{mark}")
    extra = overheads(hardware, result.peak_device_bytes)
    lines.append(f"tensor peak {result.peak_device_bytes / gib:.2f} GiB + runtime overheads {extra / gib:.2f} GiB "
                 f"= {(result.peak_device_bytes + extra) / gib:.2f} GiB vs capacity "
                 f"{hardware.device_memory_bytes / gib:.2f} GiB")
    seg = first.segments.get(result.peak_segment)
    if seg is not None and seg.live:
        lines.append(f"at the peak of {result.peak_segment} in the {first.layers}-layer trace, right after "
                     f"{seg.at_op}, the largest live tensors:")
        for entry in seg.live[:top]:
            lines.append(f"  {entry['bytes'] / gib:8.3f} GiB {entry['category']:<12} {entry['dtype']:<9} "
                         f"{str(list(entry['shape'])):<28} from {entry['op']} in {entry['made_in']}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# The longest sequence that fits
# ---------------------------------------------------------------------------------------------------------


def seq_grid_unit(techniques) -> int:
    """Sequence lengths searched are multiples of lcm(1024, ulysses degree, tile sizes in use)."""
    unit = 1024
    for value in (techniques.ulysses_degree, techniques.mlp_tile_tokens, techniques.loss_tile_tokens,
                  techniques.norm_tile_tokens):
        if value:
            unit = math.lcm(unit, int(value))
    return unit


def find_max_seq(evaluation, backend=None, max_tokens: int = 1024**3, progress: Callable | None = None):
    """The longest sequence that fits ``evaluation``'s config (its ``seq_len``, if > 0, is the first guess):
    the record (``ResultRecord``) at that length, status ``ok``; or, when not even one grid step fits, the
    ``oom`` (or ``error``) record of the shortest length.

    Peak memory grows with the sequence (nearly affinely: every activation is linear in it), so the search
    brackets the capacity crossing and then steps to where the line through the two nearest points meets
    the capacity (bisecting when that makes no progress); ~5-10 evaluations on a grid of
    ``seq_grid_unit`` multiples. ``backend``: a ``PlanBackend`` (default: a new one; its cache is reused).
    """
    from dataclasses import replace as dc_replace

    if backend is None:
        from autotune.backends.plan import PlanBackend

        backend = PlanBackend()
    unit = seq_grid_unit(evaluation.techniques)
    top = max(1, max_tokens // unit)
    capacity = evaluation.hardware.device_memory_bytes
    seen: dict[int, Any] = {}

    def run(m: int):
        if m not in seen:
            record = backend.evaluate(dc_replace(evaluation, seq_len=m * unit))
            seen[m] = record
            if progress is not None:
                progress(record)
        return seen[m]

    def fits(record) -> bool:
        return record.status == "ok"

    first = min(top, max(1, (evaluation.seq_len or 128 * 1024) // unit))
    record = run(first)
    if record.status not in ("ok", "oom"):
        return record
    lo, hi = (first, None) if fits(record) else (None, first)
    # bracket: jump along the line through the last two points (at most x16, at least x2 per jump)
    while lo is None or hi is None:
        points = sorted(seen)
        if lo is None:
            if hi == 1:
                return run(1)
            guess = max(1, min(hi // 2, _crossing(seen, points, capacity, default=hi // 4)))
        else:
            if lo >= top:
                return run(lo)
            guess = min(top, max(lo * 2, min(lo * 16, _crossing(seen, points, capacity, default=lo * 4))))
        record = run(guess)
        if record.status not in ("ok", "oom"):
            return record
        if fits(record):
            lo = max(lo or 0, guess)
        else:
            hi = guess if hi is None else min(hi, guess)
    # narrow: secant steps inside (lo, hi), bisection as the fallback
    while hi - lo > 1:
        guess = _crossing(seen, [lo, hi], capacity, default=(lo + hi) // 2)
        if not lo < guess < hi:
            guess = (lo + hi) // 2
        # keep the guess just inside the side the line points to, so a good line closes the bracket quickly
        record = run(guess)
        if record.status not in ("ok", "oom"):
            return record
        if fits(record):
            lo = guess
            if hi - lo > 1 and guess + 1 < hi:  # probe one step above: the line is usually right to the step
                above = run(guess + 1)
                if fits(above):
                    lo = guess + 1
                else:
                    hi = guess + 1
        else:
            hi = guess
            if hi - lo > 1 and guess - 1 > lo:
                below = run(guess - 1)
                if fits(below):
                    lo = guess - 1
                else:
                    hi = guess - 1
    return run(lo)


def _crossing(seen: dict, points: list[int], capacity: int, default: int) -> int:
    """Grid index where the line through the peaks at the last two ``points`` reaches ``capacity``."""
    usable = [m for m in points if seen[m].peak_device_bytes]
    if len(usable) < 2:
        return default
    a, b = usable[-2], usable[-1]
    pa, pb = seen[a].peak_device_bytes, seen[b].peak_device_bytes
    if pb == pa:
        return default
    slope = (pb - pa) / (b - a)
    if slope <= 0:
        return default
    return int(math.floor(a + (capacity - pa) / slope))


# ---------------------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------------------


_COLORS = {"params": "tab:blue", "grads": "tab:orange", "optimizer": "tab:green", "activations": "tab:red",
           "temporaries": "tab:purple", "other": "tab:gray"}


def plot_memory(records, capacity: int, path, labels: list[str] | None = None, title: str = "") -> int:
    """Stacked bars of peak device memory per rank by category (one bar per record; ``ResultRecord`` or
    dict), the device capacity as a line; host bytes noted above each bar. Matplotlib, Agg backend.
    Returns the number of bars (stacks) drawn, counted from the figure's bar containers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from autotune.sizes import format_tokens

    rows = [r.to_dict() if hasattr(r, "to_dict") else dict(r) for r in records]
    names = labels or [format_tokens(r["seq_len"]) + f" ({r['status']})" for r in rows]
    gib = 2.0**30
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(rows) + 3.5), 5), dpi=110)
    bottoms = [0.0] * len(rows)
    for category in BREAKDOWN_CATEGORIES:
        values = [(r.get("breakdown") or {}).get(category, 0) / gib for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottoms, color=_COLORS[category], label=category, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    for index, row in enumerate(rows):
        total = (row.get("peak_device_bytes") or 0) / gib
        note = f"{total:.1f} GiB"
        if row.get("host_bytes"):
            note += f"\nhost {row['host_bytes'] / gib:.1f}"
        ax.annotate(note, (index, max(total, bottoms[index])), ha="center", va="bottom", fontsize=7,
                    textcoords="offset points", xytext=(0, 3))
    ax.axhline(capacity / gib, color="black", linestyle="--", label=f"capacity {capacity / gib:.0f} GiB")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(names, rotation=20 if len(rows) > 3 else 0, ha="right" if len(rows) > 3 else "center",
                       fontsize=8)
    ax.set_ylabel("peak device memory per rank (GiB)")
    ax.set_title(title or "predicted peak device memory by category")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.set_ylim(0, max(max(bottoms, default=0), capacity / gib) * 1.18)
    fig.tight_layout()
    fig.savefig(path)
    stacks = len({round(bar.get_x(), 6) for container in ax.containers for bar in container})
    plt.close(fig)
    return stacks
