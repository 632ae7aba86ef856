"""The memory oracle: peak device memory per rank of one training step, predicted without a GPU.

It runs the *same* trial code as a real trial (``trials.training.step.build_training`` -> ``trials.stack.apply``,
AdamW, ``trials.training.data.make_batch``, ``trials.training.step.train_step``) under ``FakeTensorMode`` with a fake process
group of the node's world size, and accounts every tensor with the trial's own tracker
(``trials.core.memory.DeviceMemoryTracker``): the same categories, the same rules, the same code path as a real
CPU trial, so oracle == real CPU trial by construction and the checks in bench/oracle_fidelity.py measure
the remaining differences.

What a fake trace needs that a real trial does not:
- a CPU-only torch cannot fake ``cuda`` training, so the fake device is ``cpu``; the GPU run's precision is
  modelled by running the same mixed-precision scheme (``trials.models.model.set_compute_dtype``): bf16 compute with
  fp32 master weights on GPU presets, fp32 on the ``cpu`` preset (what CPU trials run);
- GPU kernels whose memory differs from the CPU kernels are modelled (``gpu_kernels``):
  ``attention='flash'`` runs a fake flash-attn op with flash-attn 2's footprint (saves q, k, v, out and the
  fp32 logsumexp; no kv-head repeat for GQA; backward allocates dq/dk/dv plus its fp32 ``dq_accum``,
  ``softmax_d`` and, for GQA, ``dk``/``dv`` expanded to the query heads); ``flash3`` / ``flash4`` run fakes with
  FA3's / FA4's footprints (the same saved tensors; backward's fp32 ``dq_accum``, ``softmax_d`` / ``dpsum`` and
  ``lse_log2`` over seqlen rounded to the kernel's block, and for GQA fp32 ``dk``/``dv`` accumulators at the kv
  heads: ``autotune.oracle.fake_world``); ``attention='sdpa'`` keeps the trial's
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

import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from autotune.core.evaluation import Evaluation
from autotune.core.record import BREAKDOWN_CATEGORIES
from autotune.oracle.extrapolation import extend_value, extension_limits, extrapolate, plan_traces
from autotune.oracle.repeats import KNOWN_KINDS
from autotune.oracle.results import EXTRAPOLATE_FROM, Prediction, Segment, Trace
from autotune.oracle.tracing import compute_dtype_for, trace
from trials.trial.segments import layer_runs, model_runs

__all__ = [
    "EXTRAPOLATE_FROM",
    "Prediction",
    "Segment",
    "Trace",
    "compute_dtype_for",
    "explain",
    "extend_value",
    "full_depth_trace",
    "layer_runs",
    "model_runs",
    "predict",
    "stop_tensor_bytes",
    "trace",
]


def stop_tensor_bytes(hardware, stop_above_bytes: int) -> int:
    """The live tensor bytes above which a trace is stopped for a device limit of ``stop_above_bytes`` (overheads
    included): any ``t`` above it has ``t + hardware.overhead_bytes(t) > stop_above_bytes``."""
    return max(0, int((stop_above_bytes - hardware.runtime_overhead_bytes) / (1 + hardware.allocator_fragmentation)))


def _trace_to_full_depth(
    evaluation: Evaluation,
    full_depth: bool = False,
    stop_above_bytes: int | None = None,
    stop_host_bytes: int | None = None,
    timeline=None,
    **kwargs,
) -> tuple[Trace, list[Trace], list[int]]:
    """Trace the model, or (deeper than ``EXTRAPOLATE_FROM``) its 3-layer copy and one 4-layer copy per run of
    layers, extended exactly to full depth. ``stop_above_bytes`` (tensor bytes) / ``stop_host_bytes``: a copy
    that crosses them stops (a shallower copy that does not fit means the model does not either); with one run
    of layers, the 4-layer copy also stops as soon as its extension is known to cross them
    (``extension_limits``), and the result is then the extension of what it reached, a lower bound. Returns
    (the full-depth trace, the traces run, layers added per extended run). ``timeline``: a
    ``trials.trial.memory_timeline.TimelineRecorder`` for the first trace (the model, or its base copy)."""
    args = (evaluation.model_config, evaluation.techniques, evaluation.seq_len, evaluation.world_size)
    kwargs.setdefault("documents", evaluation.documents)
    kwargs.setdefault("lora", evaluation.lora)
    kwargs.setdefault("known_kinds", KNOWN_KINDS)  # what per-document loops taught any trace of this process
    runs = model_runs(evaluation.techniques, evaluation.model_config)
    base, varied = plan_traces(runs)
    stops = dict(
        stop_above_bytes=stop_above_bytes, host_limit=stop_host_bytes if stop_above_bytes is not None else None
    )
    if full_depth or not varied:
        result = trace(*args, runs=runs, **stops, timeline=timeline, **kwargs)
        return result, [result], []
    traces = [trace(*args, runs=base, **stops, timeline=timeline, **kwargs)]
    varied_traces = []
    extension = [runs[index][1] - EXTRAPOLATE_FROM[0] for index, _ in varied]
    for (index, longer), added in zip(varied, extension):
        if traces[-1].stopped:
            break
        deeper = dict(stops)
        if stop_above_bytes is not None and len(varied) == 1:
            deeper["segment_limits"], deeper["host_limit"] = extension_limits(
                traces[0], added, stop_above_bytes, stops["host_limit"]
            )
        varied_traces.append((index, trace(*args, runs=longer, **deeper, **kwargs)))
        traces.append(varied_traces[-1][1])
    if traces[-1].stopped:
        if len(varied) == 1 and len(traces) == 2:
            return extrapolate(traces[0], varied_traces, runs, partial=True), traces, extension
        return traces[-1], traces, []
    return extrapolate(traces[0], varied_traces, runs), traces, extension


def predict(
    evaluation: Evaluation,
    modes: Callable[[Any], Iterable] | None = None,
    full_depth: bool = False,
    compute_dtype: torch.dtype | None = None,
    gpu_kernels: bool | None = None,
    stop_above_bytes: int | None = None,
    stop_host_bytes: int | None = None,
    timeline=None,
) -> Prediction:
    """The oracle's prediction for ``evaluation``.

    ``compute_dtype`` / ``gpu_kernels`` default from the hardware preset (fp32 and CPU kernels on ``cpu``,
    bf16 and GPU kernels otherwise); overriding them models e.g. a bf16 CPU trial.

    ``stop_above_bytes`` (device bytes, overheads included): the search only needs to know that a config is
    out of memory, not by how much, so a trace stops as soon as it crosses this -- a shallow copy that does
    not fit means the full model, which holds at least as much, does not either. The prediction is then
    ``stopped`` and its peak is a lower bound (the bytes at the crossing, extended to full depth where the
    4-layer copy was stopped). ``stop_host_bytes`` (with ``stop_above_bytes``): the same for host bytes per rank
    (``stop_reason`` "host": ``host_bytes`` is then the lower bound).

    ``timeline``: a ``trials.trial.memory_timeline.TimelineRecorder`` that records the first trace (``traces[0]``: the
    model, or its base copy) at no extra trace (``autotune.oracle.timeline``).
    """
    started = time.perf_counter()
    hardware = evaluation.hardware
    kwargs = dict(
        compute_dtype=compute_dtype or compute_dtype_for(hardware),
        gpu_kernels=not hardware.device_is_host if gpu_kernels is None else gpu_kernels,
        modes=modes,
    )
    if stop_above_bytes is not None:  # tensor bytes t with t + overheads(t) above the limit
        kwargs["stop_above_bytes"] = stop_tensor_bytes(hardware, stop_above_bytes)
        kwargs["stop_host_bytes"] = stop_host_bytes
    result, traces, extension = _trace_to_full_depth(evaluation, full_depth, timeline=timeline, **kwargs)
    return with_overheads(
        result,
        hardware,
        traces=traces,
        elapsed_s=time.perf_counter() - started,
        extension=extension,
        stopped=result.stopped,
        stop_reason=result.stop_reason,
    )


def with_overheads(result, hardware, traces: list, elapsed_s: float, **fields) -> Prediction:
    """The prediction of a traced (or extended) ``result``: its tensor peak plus the hardware's runtime
    overheads, which join the breakdown's ``other``; ``fields``: the rest of ``Prediction``'s."""
    extra = hardware.overhead_bytes(result.peak_device_bytes)
    breakdown = dict(result.breakdown)
    breakdown["other"] = breakdown.get("other", 0) + extra
    return Prediction(
        tensor_peak_bytes=result.peak_device_bytes,
        peak_device_bytes=result.peak_device_bytes + extra,
        breakdown=breakdown,
        host_bytes=result.peak_host_bytes,
        overhead_bytes=extra,
        peak_segment=result.peak_segment,
        traces=traces,
        elapsed_s=elapsed_s,
        reached_tensor_bytes=max([result.peak_device_bytes] + [t.peak_device_bytes for t in traces]),
        **fields,
    )


def full_depth_trace(evaluation: Evaluation) -> Trace:
    """Every segment's peak of ``evaluation`` at full depth (the memory of ``predict``, its tensor bytes without the
    runtime overheads, no time counter): what ``autotune.oracle.lengths.LengthModel`` is built from."""
    hardware = evaluation.hardware
    result, _, _ = _trace_to_full_depth(
        evaluation, compute_dtype=compute_dtype_for(hardware), gpu_kernels=not hardware.device_is_host
    )
    return result


def explain(evaluation: Evaluation, top: int = 12) -> str:
    """A readable account of where ``evaluation``'s peak comes from: every segment's extrapolated peak by
    category, then, for the peak segment, the op at its peak and the largest tensors alive then (from the
    traced shallow copy: per-layer tensors are shown once, the full-depth sums are in the table)."""
    hardware = evaluation.hardware
    result, traces, _ = _trace_to_full_depth(
        evaluation, compute_dtype=compute_dtype_for(hardware), gpu_kernels=not hardware.device_is_host, explain=True
    )
    first = traces[0]
    gib = 2.0**30
    lines = [f"{'segment':<40} {'GiB':>8}  " + " ".join(f"{c[:6]:>7}" for c in BREAKDOWN_CATEGORIES) + "   host"]
    for key, seg in result.segments.items():
        mark = " <- peak" if key == result.peak_segment else ""
        lines.append(
            f"{str(key):<40} {seg.device_bytes / gib:8.2f}  "
            + " ".join(f"{seg.breakdown.get(c, 0) / gib:7.2f}" for c in BREAKDOWN_CATEGORIES)
            + f" {seg.host_bytes / gib:6.1f}{mark}"
        )
    extra = hardware.overhead_bytes(result.peak_device_bytes)
    lines.append(
        f"tensor peak {result.peak_device_bytes / gib:.2f} GiB + runtime overheads {extra / gib:.2f} GiB "
        f"= {(result.peak_device_bytes + extra) / gib:.2f} GiB vs capacity "
        f"{hardware.device_memory_bytes / gib:.2f} GiB"
    )
    seg = first.segments.get(result.peak_segment)
    if seg is not None and seg.live:
        lines.append(
            f"at the peak of {result.peak_segment} in the {first.layers}-layer trace, right after "
            f"{seg.at_op}, the largest live tensors:"
        )
        for entry in seg.live[:top]:
            lines.append(
                f"  {entry['bytes'] / gib:8.3f} GiB {entry['category']:<12} {entry['dtype']:<9} "
                f"{str(list(entry['shape'])):<28} from {entry['op']} in {entry['made_in']}"
            )
    return "\n".join(lines)
