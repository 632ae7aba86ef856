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
layers and extended exactly. The trace is cut into segments: (phase, position) with position ``pre`` /
``first`` / ``middle`` / ``last`` / ``post`` relative to the decoder layers (forward: layer pre-hooks; backward:
gradient hooks on each layer's output and on the first layer's input; optimizer; the gaps between phases).
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


@dataclass
class Prediction:
    """The oracle's answer for one evaluation (rank 0 = the most loaded rank)."""

    tensor_peak_bytes: int               # peak of live tensor bytes
    peak_device_bytes: int               # tensor peak + runtime overheads (what the OOM decision uses)
    breakdown: dict[str, int]            # categories at the peak; ``other`` includes the overheads
    host_bytes: int
    overhead_bytes: int
    peak_segment: tuple | None
    traces: list[Trace]
    elapsed_s: float


# ---------------------------------------------------------------------------------------------------------
# The fake world: process group, dispatch stubs, GPU kernels
# ---------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def fake_process_group(world_size: int):
    """A fake default process group of ``world_size`` ranks (this process is rank 0); destroyed on exit."""
    import torch.distributed as dist

    if world_size <= 1:
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


class _OracleMode:
    """Created lazily (TorchDispatchMode import); see ``_make_oracle_mode``."""


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
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, s, h, d = q.shape
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


def _fake_flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
    return _FakeFlashAttn.apply(q, k, v)


@contextlib.contextmanager
def _fake_flash_kernel(enabled: bool):
    """Make ``trials.attention`` use the fake flash-attn op on the (fake) cpu device."""
    if not enabled:
        yield
        return
    from trials import attention

    saved = attention.flash_attn_func, attention.flash_available
    attention.flash_attn_func = _fake_flash_attn_func
    attention.flash_available = lambda device: True
    try:
        yield
    finally:
        attention.flash_attn_func, attention.flash_available = saved


# ---------------------------------------------------------------------------------------------------------
# The tracker with segments
# ---------------------------------------------------------------------------------------------------------


def _segment_tracker_class():
    from trials.memory import DeviceMemoryTracker

    class SegmentTracker(DeviceMemoryTracker):
        """``DeviceMemoryTracker`` that also keeps the peak of each segment of the step (see module doc)."""

        def __init__(self):
            super().__init__(None)
            self.segment: tuple = ("setup", None)
            self.segments: dict[tuple, Segment] = {}

        def _check(self) -> None:
            super()._check()
            seg = self.segments.get(self.segment)
            if seg is None:
                self.segments[self.segment] = Segment(self.device_bytes, dict(self.current), self.host_bytes)
            else:
                if self.device_bytes > seg.device_bytes:
                    seg.device_bytes = self.device_bytes
                    seg.breakdown = dict(self.current)
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


def _position(index: int, layers: int) -> str:
    if index == 0:
        return "first"
    return "last" if index == layers - 1 else "middle"


def _install_segment_hooks(model, tracker) -> list:
    """Forward pre-hooks and gradient hooks that move ``tracker.segment`` along the decoder layers."""
    layers = list(model.layers)
    count = len(layers)
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
            tracker.segment = ("forward", _position(index, count))
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
                hidden.register_hook(set_segment(("backward", _position(index, count))))

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


def scaled_techniques(techniques, layers: int, num_layers: int):
    """``techniques`` for a ``layers``-deep copy of a ``num_layers``-deep model."""
    offload = techniques.activation_offload_layers
    if offload in (0, num_layers):
        return replace(techniques, activation_offload_layers=offload and layers)
    raise NotImplementedError("partial activation offload needs the layer-kind extrapolation")


def trace(model_config: dict, techniques, seq_len: int, world_size: int, *,
          compute_dtype: torch.dtype = torch.float32, gpu_kernels: bool = False, layers: int | None = None,
          modes: Callable[[Any], Iterable] | None = None, prime_optimizer: bool = True, steps: int = 1,
          seed: int = 0) -> Trace:
    """Run ``steps`` training steps of the trial under FakeTensorMode on rank 0 of a fake world and return
    the tracked peak.

    ``layers``: trace a copy of the model with this many decoder layers (default: the model's own).
    ``modes(tracker)``: extra ``TorchDispatchMode``s (e.g. ``autotune.throughput.StepCounter``) entered
    inside the tracker around the traced steps only (not the priming); they are returned in ``extras``.
    ``prime_optimizer``: create the AdamW states before the traced step (see module doc); with False, trace
    ``steps`` >= 2 to see them.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trials.data import make_batch
    from trials.dist import Mesh, build_mesh
    from trials.step import build_training, train_step

    started = time.perf_counter()
    num_layers = model_config["num_hidden_layers"]
    layers = layers or num_layers
    config = dict(model_config, num_hidden_layers=layers)
    techniques = scaled_techniques(techniques, layers, num_layers)
    device = torch.device("cpu")
    tracker = _segment_tracker_class()()
    extras: list = []
    with fake_process_group(world_size), _fake_flash_kernel(gpu_kernels and techniques.attention == "flash"):
        # groups and the device mesh hold small real tensors: build them before faking
        mesh = build_mesh(techniques.ulysses_degree, device) if world_size > 1 else Mesh.single(device)
        if world_size > 1 and not mesh.distributed:
            raise RuntimeError("fake process group did not take")
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        with fake_mode, tracker, _make_oracle_mode(gpu_kernels):
            model, optimizer = build_training(config, techniques, mesh, seed, tracker, compute_dtype=compute_dtype)
            _install_segment_hooks(model, tracker)
            tokens = torch.zeros(seq_len + 1, dtype=torch.long)
            batch = make_batch(tokens, mesh.sp_rank, mesh.sp_degree, device)
            if prime_optimizer:
                _prime_optimizer(model, optimizer, tracker)
            extra_modes = list(modes(tracker)) if modes is not None else []
            with contextlib.ExitStack() as stack:
                for mode in extra_modes:
                    stack.enter_context(mode)
                for _ in range(steps):
                    train_step(model, optimizer, batch, mesh, tracker)
            extras = extra_modes
            del model, optimizer, batch, tokens
    segments = {k: v for k, v in tracker.segments.items() if k[0] != "setup"}
    peak_key = max(segments, key=lambda k: segments[k].device_bytes) if segments else None
    peak = segments[peak_key] if peak_key else Segment(0, dict.fromkeys(BREAKDOWN_CATEGORIES, 0))
    # the setup (model build, priming) never exceeds the traced step's optimizer phase; keep it honest anyway
    setup = tracker.segments.get(("setup", None))
    if setup is not None and setup.device_bytes > peak.device_bytes:
        peak_key, peak = ("setup", None), setup
        segments[peak_key] = setup
    return Trace(layers=layers, peak_device_bytes=int(peak.device_bytes), breakdown=_full(peak.breakdown),
                 peak_host_bytes=int(tracker.peak_host_bytes), peak_segment=peak_key, segments=segments,
                 elapsed_s=time.perf_counter() - started, extras=[extras])


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


def extrapolate(short: Trace, long: Trace, layers: int) -> Trace:
    """Extend two traces of depths ``d`` and ``d + 1`` (both >= 3) to ``layers`` (see module doc)."""
    if long.layers != short.layers + 1 or short.layers < 3:
        raise ValueError("extrapolate needs traces of depths d >= 3 and d + 1")
    steps = layers - short.layers
    segments: dict[tuple, Segment] = {}
    for key in set(short.segments) | set(long.segments):
        a, b = short.segments.get(key), long.segments.get(key)
        if a is None or b is None:  # a segment only one depth has: keep the one we saw (no slope known)
            seg = a or b
            segments[key] = Segment(seg.device_bytes, dict(seg.breakdown), seg.host_bytes)
            continue
        breakdown = {c: a.breakdown.get(c, 0) + (b.breakdown.get(c, 0) - a.breakdown.get(c, 0)) * steps
                     for c in BREAKDOWN_CATEGORIES}
        device = a.device_bytes + (b.device_bytes - a.device_bytes) * steps
        host = a.host_bytes + (b.host_bytes - a.host_bytes) * steps
        segments[key] = Segment(int(device), {c: int(v) for c, v in breakdown.items()}, int(host))
    peak_key = max(segments, key=lambda k: segments[k].device_bytes)
    peak = segments[peak_key]
    host = short.peak_host_bytes + (long.peak_host_bytes - short.peak_host_bytes) * steps
    return Trace(layers=layers, peak_device_bytes=peak.device_bytes, breakdown=_full(peak.breakdown),
                 peak_host_bytes=int(host), peak_segment=peak_key, segments=segments,
                 elapsed_s=short.elapsed_s + long.elapsed_s, extras=short.extras + long.extras)


def extrapolate_value(short, long, steps: int):
    """Linear extension of any numeric structure (numbers, dicts, lists, dataclasses) traced at depths
    ``d`` and ``d + 1`` to depth ``d + steps`` -- e.g. a throughput counter's counts."""
    import dataclasses

    if isinstance(short, bool) or short is None:
        return long
    if isinstance(short, (int, float)):
        value = short + (long - short) * steps
        return type(short)(value) if isinstance(short, int) and isinstance(long, int) else value
    if isinstance(short, dict):
        keys = list(short) + [k for k in long if k not in short]
        return {k: extrapolate_value(short.get(k, _zero_like(long.get(k))), long.get(k, _zero_like(short.get(k))),
                                     steps) for k in keys}
    if isinstance(short, (list, tuple)) and len(short) == len(long):
        return type(short)(extrapolate_value(a, b, steps) for a, b in zip(short, long))
    if dataclasses.is_dataclass(short) and not isinstance(short, type):
        values = {f.name: extrapolate_value(getattr(short, f.name), getattr(long, f.name), steps)
                  for f in dataclasses.fields(short)}
        return type(short)(**values)
    return long


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
            compute_dtype: torch.dtype | None = None, gpu_kernels: bool | None = None) -> Prediction:
    """The oracle's prediction for ``evaluation`` (an ``autotune.backends.Evaluation``).

    ``compute_dtype`` / ``gpu_kernels`` default from the hardware preset (fp32 and CPU kernels on ``cpu``,
    bf16 and GPU kernels otherwise); overriding them models e.g. a bf16 CPU trial.
    """
    started = time.perf_counter()
    hardware = evaluation.hardware
    kwargs = dict(compute_dtype=compute_dtype or compute_dtype_for(hardware),
                  gpu_kernels=hardware.name != "cpu" if gpu_kernels is None else gpu_kernels, modes=modes)
    layers = evaluation.model_config["num_hidden_layers"]
    args = (evaluation.model_config, evaluation.techniques, evaluation.seq_len, evaluation.gpus)
    short_depth, long_depth = EXTRAPOLATE_FROM
    if full_depth or layers <= long_depth:
        result = trace(*args, **kwargs)
        traces = [result]
    else:
        short = trace(*args, layers=short_depth, **kwargs)
        long = trace(*args, layers=long_depth, **kwargs)
        result = extrapolate(short, long, layers)
        traces = [short, long]
    extra = overheads(hardware, result.peak_device_bytes)
    breakdown = dict(result.breakdown)
    breakdown["other"] = breakdown.get("other", 0) + extra
    return Prediction(tensor_peak_bytes=result.peak_device_bytes, peak_device_bytes=result.peak_device_bytes + extra,
                      breakdown=breakdown, host_bytes=result.peak_host_bytes, overhead_bytes=extra,
                      peak_segment=result.peak_segment, traces=traces, elapsed_s=time.perf_counter() - started)
