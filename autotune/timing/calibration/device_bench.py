"""Microbenchmarks of an accelerator node for ``autotune calibrate`` on GPU presets (CUDA; the same code runs on
CPU tensors, which is how the tests check it).

Each measurement is in the units the time model (``autotune.timing.model``) divides by, so a rate turns into a
preset's efficiency by one division (``device_rates``):

- GEMMs at the model's shapes (a tile of tokens times each projection, forward and the two backward GEMMs):
  FLOP/s per shape and in total -> ``matmul_efficiency`` = total FLOPs / total time / ``bf16_flops``;
- fused causal attention, forward and backward, across lengths and head counts, through the calls the trials
  make (``trials.kernels.attention``): every flash-attn kernel of ``trials.kernels.registry`` this device runs (FlashAttention-2,
  -3, -4: installed, built for its generation), torch's SDPA as a whole layer runs it, and the SDPA kernel
  head-chunked attention runs: the FLOPs of the tiles each kernel computes (``tiled_pairs`` at the kernel's own
  tiles) per second -> each kernel's forward / backward efficiency at the longest length (what millions of
  tokens run at; the preset's ``attention_kernels``), the whole table kept beside them;
- elementwise ops on large tensors: output bytes/s -> ``elementwise_efficiency`` = rate * traffic factor / HBM;
- pinned host<->device copies, each direction -> ``host_bytes_per_s`` (the slower direction);
- torch AdamW on the host (what optimizer offload runs), with the threads one rank of the node gets ->
  ``host_optimizer_bytes_per_s`` (output bytes, as ``StepCounter`` counts them);
- all-to-all / all-gather / reduce-scatter / all-reduce at the node's world size (``measure_collectives``,
  wire bytes as ``StepCounter`` counts them) -> each kind's efficiency against ``intra_node_bytes_per_s``, and
  ``collective_latency_s``. Every rank issues the same collectives the same number of times (rank 0 decides
  the repetitions): NCCL on GPUs, gloo on CPU tensors.

Every timing is the median of several samples; ``spread`` is (max - min) / median of those samples.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

from autotune.core.hardware import KernelRates
from autotune.timing.attention_cost import tiled_pairs
from autotune.timing.calibration.sampling import relative_spread
from trials.kernels.attention import (
    attention_backward,
    attention_forward,
    causal_attention,
    flash_available,
    head_layout,
)
from trials.kernels.registry import FLASH_KERNELS, KERNELS

ATTENTION_LENGTHS = (4096, 16384, 65536)
ATTENTION_HEADS = (1, 4, 16)
GEMM_TOKENS = 8192


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def agreed(value: int, device: torch.device) -> int:
    """Rank 0's ``value`` on every rank of the default process group (broadcast as a tensor on ``device``, which
    NCCL needs); ``value`` itself without a process group."""
    if not dist.is_initialized():
        return int(value)
    flag = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.broadcast(flag, 0)
    return int(flag.item())


def timed(fn, device: torch.device, samples: int = 5, min_seconds: float = 0.05, collective: bool = False) -> dict:
    """{"s": median seconds per call, "spread": (max - min) / median} over ``samples`` samples, each repeating
    ``fn`` enough to last ``min_seconds`` (the device synchronized around each sample).

    ``collective``: ``fn`` is a collective every rank times together. Each rank's first call lasts differently (the
    last rank to arrive waits least), so the repetitions are rank 0's on every rank: ranks that issued different
    numbers of collectives would wait on each other until the process group's timeout."""
    fn()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    reps = max(1, int(min_seconds / max(time.perf_counter() - start, 1e-7)))
    if collective:
        reps = agreed(reps, device)
    times = []
    for _ in range(samples):
        _sync(device)
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        times.append((time.perf_counter() - start) / reps)
    return {"s": statistics.median(times), "spread": relative_spread(times)}


def gemm_shapes(model_config: dict, tokens: int = GEMM_TOKENS) -> list[tuple[int, int, int]]:
    """(m, k, n) of one decoder layer's GEMMs on ``tokens`` tokens: each projection forward, and its two backward
    GEMMs (input gradient, weight gradient)."""
    hidden = model_config["hidden_size"]
    head_dim = model_config.get("head_dim") or hidden // model_config["num_attention_heads"]
    projections = [
        (hidden, model_config["num_attention_heads"] * head_dim),  # q
        (hidden, model_config["num_key_value_heads"] * head_dim),  # k, v
        (model_config["num_attention_heads"] * head_dim, hidden),  # o
        (hidden, model_config["intermediate_size"]),  # gate, up
        (model_config["intermediate_size"], hidden),
    ]  # down
    shapes = []
    for k, n in projections:
        shapes += [(tokens, k, n), (tokens, n, k), (k, tokens, n)]
    return list(dict.fromkeys(shapes))


def measure_gemms(device: torch.device, dtype: torch.dtype, shapes) -> dict:
    points, flops, seconds = [], 0.0, 0.0
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        t = timed(lambda: torch.mm(a, b), device)
        points.append({"m": m, "k": k, "n": n, "flops_per_s": 2.0 * m * k * n / t["s"], "spread": t["spread"]})
        flops += 2.0 * m * k * n
        seconds += t["s"]
    return {"flops_per_s": flops / seconds, "points": points, "spread": max(p["spread"] for p in points)}


def _sdpa_backend(q, k, v) -> str:
    """The backend ``F.scaled_dot_product_attention`` picks for causal ``q``/``k``/``v`` ([b, h, s, d]): on CUDA it
    depends on the device, dtype, head dim and the cuDNN version, so the table records it."""
    choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True)
    return next((b.name for b in SDPBackend.__members__.values() if int(b.value) == choice), str(choice))


class AttentionKernel(NamedTuple):
    """One attention call the trials make. q/k/v are in ``layout`` ("bshd" [b, s, h, d] or "bhsd" [b, h, s, d]);
    ``forward(q, k, v) -> (out, residuals)``; ``backward(q, k, v, out, residuals, grad_out)`` computes the q/k/v
    gradients (through autograd when ``autograd``, q/k/v then requiring grad)."""

    layout: str
    op: str | None  # what it runs; None: the backend F.scaled_dot_product_attention picks for the inputs
    autograd: bool
    forward: Callable
    backward: Callable


def flash_kernels_here(device: torch.device) -> list[str]:
    """The flash-attn kernels (``trials.kernels.registry.FLASH_KERNELS``) the trials run on ``device``: FlashAttention-2
    where ``trials.kernels.attention`` can call it (installed, or its stand-ins), the others where their package imports,
    the device's generation runs them and ``trials.kernels.attention`` lays their inputs out as they take them."""
    if device.type != "cuda":
        return [name for name in FLASH_KERNELS if name == "flash" and flash_available(device)]
    major = torch.cuda.get_device_capability(device)[0]
    found = []
    for name in FLASH_KERNELS:
        kernel = KERNELS[name]
        if name == "flash":
            usable = flash_available(device) and kernel.runs_on(major)
        else:
            usable = kernel.runs_on(major) and head_layout(name) == kernel.layout and kernel.installed()
        if usable:
            found.append(name)
    return found


def _attention_kernels(device: torch.device) -> dict[str, AttentionKernel]:
    """The attention calls the trials make, by name:

    - ``flash``, ``flash3``, ``flash4``: each flash-attn kernel this device runs (``flash_kernels_here``), through
      ``causal_attention(kernel=...)`` (head-chunked attention calls the same kernel);
    - ``sdpa``: ``F.scaled_dot_product_attention`` on the [b, h, s, d] transpose of [b, s, h, d] projections, as a
      whole layer calls it (``causal_attention``), with autograd;
    - ``sdpa_chunked``: the kernel head-chunked attention and UPipe call for ``attention="sdpa"``
      (``attention_forward`` / ``attention_backward``: on CUDA the memory-efficient kernel, which need not be the
      backend ``F.scaled_dot_product_attention`` picks; on CPU the CPU flash kernel, the one SDPA picks there)."""

    def whole_layer(kernel: str, op: str | None) -> AttentionKernel:
        def forward(q, k, v):
            return causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), kernel=kernel), ()

        def backward(q, k, v, out, residuals, grad):
            torch.autograd.grad(out, (q, k, v), grad)

        return AttentionKernel("bshd", op, True, forward, backward)

    def chunked_forward(q, k, v):
        return attention_forward(q, k, v, q.shape[-1] ** -0.5, "sdpa")

    def chunked_backward(q, k, v, out, residuals, grad):
        attention_backward(grad, q, k, v, out, residuals, q.shape[-1] ** -0.5, "sdpa")

    kernels = {name: whole_layer(name, KERNELS[name].module) for name in flash_kernels_here(device)}
    kernels["sdpa"] = whole_layer("sdpa", None)
    chunked_op = "flash_attention_for_cpu" if device.type == "cpu" else "efficient_attention"
    kernels["sdpa_chunked"] = AttentionKernel(
        head_layout("sdpa"), f"aten._scaled_dot_product_{chunked_op}", False, chunked_forward, chunked_backward
    )
    return kernels


def measure_attention(
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int,
    tile_q: int,
    tile_kv: int,
    lengths=ATTENTION_LENGTHS,
    heads=ATTENTION_HEADS,
    max_elements: int = 1 << 30,
    tiles: dict | None = None,
) -> dict:
    """Computed-FLOP rates of each attention kernel the trials call, forward and backward, per (length, heads);
    each point names the kernel it timed (for ``sdpa``, the backend SDPA picked for its inputs). The computed
    tiles are ``tiles[name]`` (``[tile_q, tile_kv]``: the preset's for that kernel) or ``tile_q`` x ``tile_kv``."""
    result = {}
    for name, kernel in _attention_kernels(device).items():
        kernel_q, kernel_kv = (tiles or {}).get(name.removesuffix("_chunked"), (tile_q, tile_kv))
        points = []
        for seq in lengths:
            for h in heads:
                if seq * h * head_dim > max_elements:
                    continue
                shape = (1, seq, h, head_dim) if kernel.layout == "bshd" else (1, h, seq, head_dim)
                q, k, v = (
                    torch.randn(*shape, device=device, dtype=dtype, requires_grad=kernel.autograd) for _ in range(3)
                )
                op = kernel.op or _sdpa_backend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                grad = torch.randn_like(kernel.forward(q, k, v)[0])

                def both():
                    kernel.backward(q, k, v, *kernel.forward(q, k, v), grad)

                forward = timed(lambda: kernel.forward(q, k, v), device, samples=3)
                forward_backward = timed(both, device, samples=3)
                backward_s = max(forward_backward["s"] - forward["s"], 1e-9)
                pairs = h * tiled_pairs(seq, seq, True, kernel_q, kernel_kv)
                points.append(
                    {
                        "seq": seq,
                        "heads": h,
                        "kernel": op,
                        "fwd_flops_per_s": pairs * 4 * head_dim / forward["s"],
                        "bwd_flops_per_s": pairs * 10 * head_dim / backward_s,
                        "spread": max(forward["spread"], forward_backward["spread"]),
                    }
                )
        result[name] = points
    return result


def measure_elementwise(device: torch.device, dtype: torch.dtype, numel: int = 1 << 26) -> dict:
    """Output bytes per second of memory-bound ops (add, mul, silu, copy) on large tensors."""
    x, y = torch.randn(numel, device=device, dtype=dtype), torch.randn(numel, device=device, dtype=dtype)

    def mix():
        x + y, x * y, F.silu(x), x.clone()

    t = timed(mix, device)
    return {"bytes_per_s": 4 * numel * x.element_size() / t["s"], "spread": t["spread"]}


def measure_host_copies(device: torch.device, numel: int = 1 << 28) -> dict:
    """Bytes per second of pinned host -> device and device -> host copies (fp16 buffers of 512 MiB)."""
    pin = device.type == "cuda"
    host = torch.empty(numel, dtype=torch.float16, pin_memory=pin)
    dev = torch.empty(numel, dtype=torch.float16, device=device)
    h2d = timed(lambda: dev.copy_(host, non_blocking=True), device)
    d2h = timed(lambda: host.copy_(dev, non_blocking=True), device)
    nbytes = numel * 2
    return {
        "h2d_bytes_per_s": nbytes / h2d["s"],
        "d2h_bytes_per_s": nbytes / d2h["s"],
        "spread": max(h2d["spread"], d2h["spread"]),
    }


def measure_host_optimizer(threads: int, numel: int = 1 << 24) -> dict:
    """torch AdamW (``foreach=False``, as offloaded shards step) on the host with ``threads`` threads: output
    bytes per second as ``StepCounter`` counts an optimizer step (parameters, two states: 3 fp32 outputs)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        params = [torch.nn.Parameter(torch.randn(numel // 4)) for _ in range(4)]
        for p in params:
            p.grad = torch.randn_like(p)
        optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=False)
        t = timed(optimizer.step, torch.device("cpu"), samples=3)
    finally:
        torch.set_num_threads(previous)
    return {"bytes_per_s": 3 * 4 * numel / t["s"], "spread": t["spread"]}


def measure_collectives(
    device: torch.device, dtype: torch.dtype = torch.float32, sizes=(1 << 10, 1 << 22, 1 << 24)
) -> dict:
    """Per collective kind over the default process group: ``latency + wire_bytes / bandwidth`` -- latency from
    the smallest message, bandwidth from the large ones (wire bytes as ``StepCounter`` counts them). Every rank
    calls it with the same arguments; each size is rounded up to a multiple of the world size (an all-to-all
    splits its tensor evenly across the ranks)."""
    world = dist.get_world_size()
    factor = (world - 1) / world
    size = torch.tensor([], dtype=dtype).element_size()

    def op(kind, numel):
        numel = -(-numel // world) * world
        x = torch.randn(numel, device=device, dtype=dtype)
        if kind == "all_to_all":
            out = torch.empty_like(x)
            return (lambda: dist.all_to_all_single(out, x)), numel * size * factor
        if kind == "all_gather":
            out = torch.empty(numel * world, device=device, dtype=dtype)
            return (lambda: dist.all_gather_into_tensor(out, x)), numel * world * size * factor
        if kind == "reduce_scatter":
            big = torch.randn(numel * world, device=device, dtype=dtype)
            return (lambda: dist.reduce_scatter_tensor(x, big)), numel * world * size * factor
        return (lambda: dist.all_reduce(x)), numel * size * 2 * factor

    result = {}
    for kind in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce"):
        points = []
        for numel in sizes:
            fn, wire = op(kind, numel)
            dist.barrier()
            t = timed(fn, device, samples=3, min_seconds=0.02, collective=True)
            points.append((wire, t["s"]))
        latency = max(points[0][1], 1e-7)
        big = points[1:]
        bandwidth = sum(w for w, _ in big) / max(sum(t - latency for _, t in big), 1e-9)
        result[kind] = {"latency_s": latency, "bytes_per_s": bandwidth, "points": points}
    return result


def _at_longest(points: list[dict], rates) -> tuple[float, float]:
    """(forward, backward) efficiency of a kernel's points at their longest length: the median over head counts,
    a fraction of ``bf16_flops``."""
    longest = max(p["seq"] for p in points)
    at_longest = [p for p in points if p["seq"] == longest]
    return (
        statistics.median(p["fwd_flops_per_s"] for p in at_longest) / rates.bf16_flops,
        statistics.median(p["bwd_flops_per_s"] for p in at_longest) / rates.bf16_flops,
    )


def kernel_tiles(base, name: str) -> tuple[int, int]:
    """The (query, key) tiles kernel ``name`` computes whole on the causal diagonal, as the base preset prices it:
    the tiles its FLOPs are counted at when measured."""
    rates = base.rates.for_kernel(name, None)
    return rates.attention_tile_q, rates.attention_tile_kv


def kernel_table(measured: dict, base) -> tuple[KernelRates, ...]:
    """The preset's ``attention_kernels`` after a calibration: each kernel measured here at its measured
    efficiencies (not assumed any more), the base's others as they were (still assumed); a kernel measured here
    that the base does not list joins at the end."""
    rates, attention = base.rates, measured["attention"]
    device = measured.get("device", "this node")
    listed = {kernel.name: kernel for kernel in rates.attention_kernels}
    for name in base.kernels:  # a base without a list: what it priced, at its one attention rate
        listed.setdefault(name, KernelRates(name))
    for name in (*listed, *(n for n in attention if n in KERNELS and n not in listed)):
        points = [p for p in attention.get(name) or [] if p.get("fwd_flops_per_s")]
        if not points:
            continue
        forward, backward = _at_longest(points, rates)
        tiles = kernel_tiles(base, name)
        listed[name] = KernelRates(
            name,
            forward_efficiency=forward,
            backward_efficiency=backward,
            tile_q=tiles[0],
            tile_kv=tiles[1],
            source=f"measured by autotune calibrate on {device}: {DEVICE_ATTENTION_HOW}",
            assumed=False,
        )
    return tuple(listed.values())


DEVICE_ATTENTION_HOW = "causal forward/backward at the longest length measured, computed tiles / peak"


def device_rates(measured: dict, base) -> dict:
    """The preset keys a device calibration sets, from ``measured`` (what the worker wrote) and the base preset
    (``Hardware``: its peaks stay, the efficiencies become measured). ``attention_kernels`` is the kernel table
    (``kernel_table``); ``attention_efficiency`` / ``attention_backward_efficiency`` are the reference kernel's
    as measured (FlashAttention-2 where it ran, else SDPA)."""
    rates = base.rates
    values = {"matmul_efficiency": measured["gemm"]["flops_per_s"] / rates.bf16_flops}
    attention = measured["attention"]
    kernel = "flash" if attention.get("flash") else "sdpa"
    if attention.get(kernel):
        values["attention_efficiency"], values["attention_backward_efficiency"] = _at_longest(attention[kernel], rates)
    values["attention_kernels"] = kernel_table(measured, base)
    chunked = [p for p in attention.get("sdpa_chunked") or [] if p.get("fwd_flops_per_s")]
    whole = (attention.get("sdpa") or [{}])[0].get("kernel")
    if chunked and chunked[0].get("kernel") != whole:  # another kernel than a whole layer's SDPA: its own rate
        values["chunked_sdpa_efficiency"], values["chunked_sdpa_backward_efficiency"] = _at_longest(chunked, rates)
    values["elementwise_efficiency"] = (
        measured["elementwise"]["bytes_per_s"] * rates.elementwise_traffic_factor / rates.hbm_bytes_per_s
    )
    copies = measured["host_copies"]
    values["host_bytes_per_s"] = min(copies["h2d_bytes_per_s"], copies["d2h_bytes_per_s"])
    values["host_copy_efficiency"] = 1.0
    values["host_optimizer_bytes_per_s"] = measured["host_optimizer"]["bytes_per_s"]
    collectives = measured.get("collectives")
    if collectives:
        for kind in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce"):
            values[f"{kind}_efficiency"] = collectives[kind]["bytes_per_s"] / rates.intra_node_bytes_per_s
        values["collective_latency_s"] = statistics.median(c["latency_s"] for c in collectives.values())
    return values
