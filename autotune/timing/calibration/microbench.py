"""The microbenchmarks of a calibration (see the package docstring for what each measures and why)."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from autotune.core.calibration_store import CPU_ATTENTION_TILE_KV, CPU_ATTENTION_TILE_Q
from autotune.core.hardware import Rates
from autotune.timing.attention_cost import tiled_pairs
from autotune.timing.calibration.sampling import barrier, median_time, sample
from autotune.timing.counting import MATMUL_OPS, NO_WORK_OPS, StepCounter, op_name
from autotune.timing.model import attention_time, predict_step_time
from trials.core.dist import Mesh, build_mesh
from trials.core.memory import DeviceMemoryTracker
from trials.stack.techniques import Techniques
from trials.training.data import make_batch, synthetic_sample
from trials.training.step import build_training, train_step

HEAD_DIMS = (16, 64, 128)
MATMUL_SHAPES = (
    (4096, 128, 352),
    (4096, 352, 128),
    (128, 4096, 352),
    (4096, 256, 1024),
    (1024, 4096, 256),
    (4096, 128, 1024),
)


def measure_matmul() -> float:

    flops = seconds = 0.0
    for m, k, n in MATMUL_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds += median_time(lambda: torch.mm(a, b), f"matmul {m}x{k}x{n}")
        flops += 2.0 * m * k * n
    return flops / seconds


def measure_attention(head_dim: int, seq: int = 2048, heads: int = 8) -> tuple[float, float]:
    """(forward, backward) computed FLOP/s of the CPU flash-attention kernel, causal, fp32."""

    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    fwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    out, lse = fwd_op(q, k, v, 0.0, True)
    grad = torch.randn_like(out)
    t_fwd = median_time(lambda: fwd_op(q, k, v, 0.0, True), f"attention fwd d{head_dim}")
    t_bwd = median_time(lambda: bwd_op(grad, q, k, v, out, lse, 0.0, True), f"attention bwd d{head_dim}")
    pairs = heads * tiled_pairs(seq, seq, True, CPU_ATTENTION_TILE_Q, CPU_ATTENTION_TILE_KV)
    return pairs * 4 * head_dim / t_fwd, pairs * 10 * head_dim / t_bwd


def measure_elementwise() -> float:
    """Output bytes per second of a mix of memory-bound ops on 1-8 MiB tensors (what a step's are)."""

    total_bytes = seconds = 0.0
    for numel in (1 << 18, 1 << 20, 1 << 21):
        x, y = torch.randn(numel), torch.randn(numel)

        def mix():
            x + y, x * y, F.silu(x), x.clone(), x.mul_(1.0), torch.rsqrt(y), x.pow(2)

        seconds += median_time(mix, "elementwise")
        total_bytes += 7 * numel * 4
    return total_bytes / seconds


def measure_memcpy() -> float:
    """Bytes per second of a copy into a fresh buffer (what an offload does: allocate the host copy, copy),
    over 1-16 MiB tensors."""

    xs = [torch.randn(numel) for numel in (1 << 18, 1 << 20, 1 << 22)]

    def copies():
        for x in xs:
            torch.empty_like(x).copy_(x)

    return sum(x.numel() * 4 for x in xs) / median_time(copies, "memcpy")


CALIBRATION_MODEL = {  # a small Llama that is none of the presets: compute is negligible at 16 tokens
    "model_type": "llama",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
}


def measure_dispatch_overhead(partial_rates: dict) -> tuple[float, float]:
    """Host seconds per dispatched op of an eager training step as a trial runs it, *outside* the kernels: Python
    module code, autograd, the optimizer's per-parameter loop and the trials' memory tracker.

    ``trials.training.step.train_step`` of ``CALIBRATION_MODEL`` at 16 tokens per rank on this worker's world (data
    parallel over the gloo group when there are several workers): a plain step's wall time minus the kernels'
    own seconds in a step timed by ``_kernel_timer`` (``_wall_and_kernels``) minus what ``predict_step_time``
    gives the collectives, divided by the dispatches ``StepCounter`` counts. The kernels' time is measured, not
    predicted from the rates: at 16 tokens it is their fixed per-call cost, which the in-step rates (fitted on
    timed kernels of a 2,048-token step) already carry, so counting it here as overhead too would count it
    twice. Returns (per op, per view): both pass through the same Python dispatch, so they are one number.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = build_mesh(1, torch.device("cpu")) if world > 1 else Mesh.single()
    tracker = DeviceMemoryTracker(None)
    timer = _kernel_timer(tracker)
    tokens = 16
    with tracker:
        model, optimizer = build_training(CALIBRATION_MODEL, Techniques(), mesh, 0, tracker)
        batch = make_batch(synthetic_sample(mesh.dp_rank, tokens, CALIBRATION_MODEL["vocab_size"]), 0, 1, "cpu")
        train_step(model, optimizer, batch, mesh, tracker)

    def steps():  # one sample: the median of 8 (kernel seconds, wall) pairs
        pairs = [_wall_and_kernels(model, optimizer, batch, mesh, tracker, timer) for _ in range(8)]
        return (
            statistics.median(sum(kernels.values()) for kernels, _ in pairs),
            statistics.median(wall for _, wall in pairs),
        )

    samples = sample(steps, "step overhead", samples=5, returns_times=True)
    kernel_s = statistics.median(s[0] for s in samples)
    wall_s = statistics.median(s[1] for s in samples)
    with tracker:
        counter = StepCounter(tracker, seq_len=tokens, world_size=world)
        with counter:
            train_step(model, optimizer, batch, mesh, tracker)
    counts = counter.counts
    rates = Rates(name="cpu", **dict(partial_rates, op_overhead_s=0.0, view_overhead_s=0.0))
    timing = predict_step_time(counts, rates, world, Techniques())
    collectives_s = timing.exposed_comm_s  # the gradient all-reduce over gloo (world > 1), priced by the model
    dispatches = sum(counts.phases[p].ops + counts.phases[p].views for p in counts.phases)
    per_dispatch = max(wall_s - kernel_s - collectives_s, 0.0) / max(dispatches, 1)
    return per_dispatch, per_dispatch


IN_STEP_MODEL = dict(
    CALIBRATION_MODEL,
    hidden_size=96,
    intermediate_size=256,
    num_attention_heads=6,
    num_key_value_heads=2,
    vocab_size=2048,
)  # also none of the presets
IN_STEP_TOKENS = 2048
_KINDS = [(p, k) for p in ("forward", "backward", "optimizer") for k in ("matmul", "attention", "elementwise")]


def _kernel_timer(tracker: DeviceMemoryTracker):
    """A dispatch mode that times each op's kernel, by kind (matmul / attention / other work), per ``tracker``
    phase. Entered *below* the memory tracker, it times the kernel alone, not the Python dispatch above it.
    Collectives, views and no-work ops are not kernels: their time is left to the step's wall time."""

    class KernelTimer(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seconds: dict = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            elapsed = time.perf_counter() - start
            namespace, name = op_name(func)
            if not (name in NO_WORK_OPS or namespace in ("profiler", "prim", "c10d", "deepspeed", "_c10d_functional")):
                kind = "matmul" if name in MATMUL_OPS else "attention" if "attention" in name else "elementwise"
                key = (tracker.phase, kind)
                self.seconds[key] = self.seconds.get(key, 0.0) + elapsed
            return out

    return KernelTimer()


def _wall_and_kernels(model, optimizer, batch, mesh, tracker, timer) -> tuple[dict, float]:
    """One step with every kernel timed (seconds by (phase, kind)), then one plain step's wall time under the
    tracker alone, as a trial runs it (the timer's own dispatch costs a few microseconds per op). Taken together,
    so the host's speed drift over minutes moves both alike."""
    timer.seconds = {}
    with timer, tracker:  # timer first: below the tracker
        train_step(model, optimizer, batch, mesh, tracker)
    kernels = timer.seconds  # a fresh dict per call (above)
    return kernels, _plain_step_s(model, optimizer, batch, mesh, tracker)


def _plain_step_s(model, optimizer, batch, mesh, tracker) -> float:
    """Wall seconds of one training step under ``tracker`` alone, as a trial runs it; outside any dispatch mode
    the caller is in (a trial's memory tracker, when the bench re-times the reference step inside a trial)."""
    with _disable_current_modes(), tracker:
        start = time.perf_counter()
        train_step(model, optimizer, batch, mesh, tracker)
        return time.perf_counter() - start


def in_step_training() -> tuple:
    """The in-step run on this worker's world, built and warmed up by one step: (model, optimizer, batch, mesh,
    tracker). On several workers, Ulysses over the gloo group when there are two (so the step synchronises the
    ranks at every layer, and the residual the model misses is the waiting for the slower rank there,
    ``collective_wait_s`` per call), data parallel otherwise. Every worker of the world must call it (and step it) together.
    Built outside any dispatch mode the caller is in (a trial's memory tracker): the run has its own tracker."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    degree = 2 if world == 2 else 1
    mesh = build_mesh(degree, torch.device("cpu")) if world > 1 else Mesh.single()
    tracker = DeviceMemoryTracker(None)
    with _disable_current_modes(), tracker:
        model, optimizer = build_training(IN_STEP_MODEL, Techniques(ulysses_degree=degree), mesh, 0, tracker)
        batch = make_batch(
            synthetic_sample(mesh.dp_rank, IN_STEP_TOKENS, IN_STEP_MODEL["vocab_size"]),
            mesh.sp_rank,
            mesh.sp_degree,
            "cpu",
        )
        train_step(model, optimizer, batch, mesh, tracker)
    return model, optimizer, batch, mesh, tracker


def reference_step_s(training: tuple, steps: int = 3) -> float:
    """Median wall seconds of ``steps`` plain steps of ``in_step_training()``'s run, as the calibration timed it
    (``in_step.wall_s``): measured again later, its ratio to ``wall_s`` is how much slower this host runs a
    training step now than when it was calibrated -- the drift gauge ``bench/throughput_fidelity.py`` prints.
    Timed as ``_wall_and_kernels`` times ``wall_s`` (``_plain_step_s``). Not contention-filtered: callers check
    contention around it."""
    return statistics.median(_plain_step_s(*training) for _ in range(steps))


def measure_in_step(partial_rates: dict) -> dict:
    """Kernel rates *inside* a training step: matmul FLOP/s, elementwise output bytes/s (forward/backward and the
    optimizer's), and how much slower attention runs than in ``measure_attention``.

    Microbenchmarks reuse hot operands; a training step's kernels see cold caches, transposed weights, mixed
    shapes and small tensors with fixed per-kernel costs. So one step of ``IN_STEP_MODEL`` (a small Llama that is
    none of the presets) at ``IN_STEP_TOKENS`` tokens runs under the trials' memory tracker with every kernel
    timed (``_kernel_timer``), and ``StepCounter``'s counts of the same step are divided by those times.
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    model, optimizer, batch, mesh, tracker = in_step_training()
    degree = mesh.sp_degree
    timer = _kernel_timer(tracker)

    def kernels_then_wall():
        kernels, wall = _wall_and_kernels(model, optimizer, batch, mesh, tracker, timer)
        return tuple(kernels.get(key, 0.0) for key in _KINDS) + (wall,)

    pairs = sample(kernels_then_wall, "in-step kernels and wall", samples=7, returns_times=True)
    samples, walls = [p[:-1] for p in pairs], [p[-1:] for p in pairs]
    with tracker:
        counter = StepCounter(tracker, seq_len=IN_STEP_TOKENS, world_size=world)
        with counter:
            train_step(model, optimizer, batch, mesh, tracker)
    best = {key: statistics.median(sample[i] for sample in samples) for i, key in enumerate(_KINDS)}
    counts = counter.counts
    phases = ("forward", "backward")
    matmul_s = sum(best[(p, "matmul")] for p in phases)
    elementwise_s = sum(best[(p, "elementwise")] for p in phases)
    attention_s = sum(best[(p, "attention")] for p in phases)
    rates = Rates(name="cpu", **partial_rates)
    predicted_attention = attention_time(counts, phases, rates) or 0.0
    opt = counts.phases["optimizer"]
    return {
        "matmul_flops": sum(counts.phases[p].matmul_flops for p in phases) / matmul_s,
        "elementwise_bytes_per_s": sum(counts.phases[p].elementwise_bytes for p in phases) / elementwise_s,
        "attention_factor": predicted_attention / attention_s if attention_s else 1.0,
        "optimizer_bytes_per_s": opt.elementwise_bytes / best[("optimizer", "elementwise")],
        "kernel_seconds": {f"{p}/{k}": v for (p, k), v in best.items()},
        "wall_s": statistics.median(w[0] for w in walls),
        "ulysses_degree": degree,
        "counts": counts.to_dict(),
    }


def measure_optimizer(op_overhead_s: float, view_overhead_s: float) -> float:
    """AdamW(foreach=False) output bytes per second on the host, per-op overhead (as counted) taken out."""

    params = [torch.nn.Parameter(torch.randn(n)) for n in [1 << 20] * 6 + [1 << 16] * 8]
    for p in params:
        p.grad = torch.randn_like(p)
    optimizer = torch.optim.AdamW(params, lr=1e-5, foreach=False)
    tracker = DeviceMemoryTracker(None)
    with tracker:
        optimizer.step()
        counter = StepCounter(tracker)
        with counter, tracker.in_phase("optimizer"):
            optimizer.step()
        seconds = median_time(lambda: optimizer.step(), "optimizer")
    pc = counter.counts.phases["optimizer"]
    net = seconds - pc.ops * op_overhead_s - pc.views * view_overhead_s
    return pc.elementwise_bytes / max(net, seconds * 0.05)


def measure_gloo() -> dict:
    """Per collective kind, ``latency + wire_bytes / bandwidth``: latency from the smallest message, bandwidth
    from the large ones (wire bytes as ``StepCounter`` counts them)."""

    world = dist.get_world_size()
    factor = (world - 1) / world
    sizes = [1 << 10, 1 << 18, 1 << 20, 1 << 21]  # fp32 elements per rank: 4 KiB .. 8 MiB

    def run(kind, numel):
        x = torch.randn(numel)
        if kind == "all_to_all":
            out = torch.empty_like(x)
            return (lambda: dist.all_to_all_single(out, x)), numel * 4 * factor
        if kind == "all_gather":
            out = torch.empty(numel * world)
            return (lambda: dist.all_gather_into_tensor(out, x)), numel * world * 4 * factor
        if kind == "reduce_scatter":
            big = torch.randn(numel * world)
            return (lambda: dist.reduce_scatter_tensor(x, big)), numel * world * 4 * factor
        return (lambda: dist.all_reduce(x)), numel * 4 * 2 * factor

    result = {}
    for kind in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce"):
        points = []
        for numel in sizes:
            fn, wire = run(kind, numel)
            barrier()
            points.append((wire, median_time(fn, f"gloo {kind}")))
        latency = max(points[0][1] - points[0][0] / 1e9, 1e-6)
        big = [(w, t) for w, t in points if w >= (1 << 20)]
        bandwidth = sum(w for w, _ in big) / max(sum(t - latency for _, t in big), 1e-9)
        result[kind] = {"latency_s": latency, "bytes_per_s": bandwidth, "points": points}
    return result
