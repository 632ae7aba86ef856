"""Calibrate the ``cpu`` hardware preset on this machine: measured rates for the time model.

CPU trials (``trials.runner`` on gloo, fp32) run ``world_size`` processes that share this machine's cores,
each with ``cpus // world_size`` threads (what the local backend sets). So the calibration is per world size:
for each world size ``w`` (1 and, when there are at least two cores, 2), ``w`` worker processes run the same
microbenchmarks at the same time, with the same thread count a trial rank gets, and rank 0's numbers are kept:

- ``bf16_flops``: fp32 matmul FLOP/s over a handful of transformer-like GEMM shapes (total FLOPs / total time);
- ``attention_by_head_dim``: the CPU flash-attention kernel's computed-FLOP rate, forward and backward, at head
  dims 16/64/128, as a fraction of the matmul rate (computed = the tiles the kernel really runs: query tiles of
  256 and key tiles of 512, ``aten/src/ATen/native/cpu/FlashAttentionKernel.cpp``);
- ``hbm_bytes_per_s``: output bytes per second of a mix of elementwise ops (``elementwise_traffic_factor`` 1);
- ``host_bytes_per_s``: memcpy bandwidth (``clone`` of 64 MiB) -- the CPU path's "host" copies are memcpys;
- ``host_optimizer_bytes_per_s``: ``torch.optim.AdamW(foreach=False)`` output bytes per second (as counted by
  ``StepCounter``) with the per-op overhead taken out;
- ``op_overhead_s`` / ``view_overhead_s``: host seconds per dispatched op of an eager training step (Python
  module code, autograd, the optimizer's loop, and the trials' memory tracker -- a Python dispatch mode every
  CPU trial runs under): one step of a small Llama that is none of the presets, at 16 tokens;
- ``intra_node_bytes_per_s`` (all-to-all), ``all_gather_efficiency`` / ``reduce_scatter_efficiency`` /
  ``all_reduce_efficiency`` (relative to it), ``collective_latency_s`` (w > 1): gloo collectives over loopback
  at several sizes, as ``latency + wire_bytes / bandwidth``.

The result is cached as JSON under the user cache dir (``$AUTOTUNE_CACHE_DIR`` or
``$XDG_CACHE_HOME/autotune`` or ``~/.cache/autotune``) keyed by machine, and re-measured when the machine,
torch version or calibration version changes. ``python -m autotune.calibrate [--force]`` prints it.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VERSION = 14
CPU_ATTENTION_TILE_Q = 256   # torch's CPU flash kernel: q split 256 for q_seq_len >= 768
CPU_ATTENTION_TILE_KV = 512  # and kv split 512
HEAD_DIMS = (16, 64, 128)
MATMUL_SHAPES = ((4096, 128, 352), (4096, 352, 128), (128, 4096, 352), (4096, 256, 1024), (1024, 4096, 256),
                 (4096, 128, 1024))


def cache_path() -> Path:
    base = os.environ.get("AUTOTUNE_CACHE_DIR")
    if base:
        return Path(base) / "cpu_calibration.json"
    xdg = os.environ.get("XDG_CACHE_HOME")
    root = Path(xdg) if xdg else Path.home() / ".cache"
    return root / "autotune" / "cpu_calibration.json"


def machine_key() -> dict:
    import torch

    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"version": VERSION, "host": socket.gethostname(), "cpu": model, "cpus": os.cpu_count() or 1,
            "torch": torch.__version__}


def world_sizes() -> list[int]:
    cpus = os.cpu_count() or 1
    return [1, 2] if cpus >= 2 else [1]


def load_or_calibrate(force: bool = False, quiet: bool = True, repeats: int = 1) -> dict:
    """The cached calibration of this machine, measuring it first when missing or stale (~1.5 min per repeat;
    see ``calibrate`` for ``repeats``)."""
    path = cache_path()
    key = machine_key()
    if not force and path.exists():
        try:
            data = json.loads(path.read_text())
            if data.get("machine") == key:
                return data
        except (OSError, json.JSONDecodeError):
            pass
    data = calibrate(quiet=quiet, repeats=repeats)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        pass
    return data


def rates_for(calibration: dict, world_size: int) -> dict:
    """The ``Rates`` fields of the calibration for a trial of ``world_size`` ranks on this machine."""
    per_world = calibration["worlds"]
    keys = sorted(int(k) for k in per_world)
    chosen = max((k for k in keys if k <= max(1, world_size)), default=keys[0])
    m = per_world[str(chosen)]
    in_step = m.get("in_step") or {}
    matmul = in_step.get("matmul_flops", m["matmul_flops"])  # the in-step rate is what a trial sees
    factor = in_step.get("attention_factor", 1.0)
    attention = {int(d): (fwd * factor / matmul, bwd * factor / matmul) for d, (fwd, bwd) in m["attention_flops"].items()}
    values = {
        "bf16_flops": matmul,
        "matmul_efficiency": 1.0,
        "attention_by_head_dim": tuple(sorted(attention.items())),
        "attention_efficiency": attention[max(attention)][0],
        "attention_backward_efficiency": attention[max(attention)][1],
        "attention_tile_q": CPU_ATTENTION_TILE_Q,
        "attention_tile_kv": CPU_ATTENTION_TILE_KV,
        "hbm_bytes_per_s": in_step.get("elementwise_bytes_per_s", m["elementwise_bytes_per_s"]),
        "elementwise_efficiency": 1.0,
        "elementwise_traffic_factor": 1.0,
        "host_bytes_per_s": m["memcpy_bytes_per_s"],
        "host_copy_efficiency": 1.0,
        "host_optimizer_bytes_per_s": in_step.get("optimizer_bytes_per_s", m["optimizer_bytes_per_s"]),
        "op_overhead_s": m["op_overhead_s"],
        "rank_imbalance": m.get("rank_imbalance", 0.0),
        "view_overhead_s": m["view_overhead_s"],
        "launch_overlaps_compute": False,
    }
    # gloo: measured with 2 ranks; a 1-rank trial has no collectives, larger worlds reuse the 2-rank numbers
    gloo = next((per_world[str(k)].get("gloo") for k in sorted(keys, reverse=True) if per_world[str(k)].get("gloo")),
                None)
    if gloo:
        link = gloo["all_to_all"]["bytes_per_s"]
        values.update({
            "intra_node_bytes_per_s": link,
            "all_to_all_efficiency": 1.0,
            "all_gather_efficiency": gloo["all_gather"]["bytes_per_s"] / link,
            "reduce_scatter_efficiency": gloo["reduce_scatter"]["bytes_per_s"] / link,
            "all_reduce_efficiency": gloo["all_reduce"]["bytes_per_s"] / link,
            "collective_latency_s": statistics.median(gloo[k]["latency_s"] for k in
                                                      ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")),
        })
    return values


# ---------------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------------


def calibrate(quiet: bool = True, repeats: int = 1) -> dict:
    """Measure every world size (``repeats`` times, keeping the best of each number: other processes only ever
    make a measurement slower). Each timing already discards samples taken while other processes were busy
    (see ``_sample``); benchmarks that never got a quiet sample are listed under ``contended``."""
    result = {"machine": machine_key(), "measured_at": time.strftime("%Y-%m-%d %H:%M:%S"), "worlds": {}}
    cpus = os.cpu_count() or 1
    for world in world_sizes():
        threads = max(1, cpus // world)
        runs = []
        for index in range(repeats):
            busy = wait_for_idle(timeout_s=20.0)
            if not quiet:
                print(f"calibrating {world} rank(s) x {threads} thread(s), run {index + 1}/{repeats} "
                      f"(others busy {busy:.0%}) ...", file=sys.stderr, flush=True)
            runs.append(_run_workers(world, threads))
        result["worlds"][str(world)] = _best_of(runs)
    return result


_LOWER_IS_BETTER = ("op_overhead_s", "view_overhead_s", "latency_s", "probe_s", "rank_imbalance", "wall_s",
                    "predicted_s")


def _best_of(runs: list):
    """Merge measurements: max of rates, min of overheads and latencies, recursively."""
    first = runs[0]
    if isinstance(first, dict):
        out = {}
        for key in first:
            values = [r[key] for r in runs if key in r]
            if key.startswith("points") or key in ("threads", "world_size", "contended", "kernel_seconds", "counts",
                                                              "probes_s"):
                out[key] = values[0]
            elif key in _LOWER_IS_BETTER:
                out[key] = min(values)
            else:
                out[key] = _best_of(values)
        return out
    if isinstance(first, (list, tuple)):
        return [_best_of([r[i] for r in runs]) for i in range(len(first))]
    return max(runs)


def cpu_busy_fraction(interval: float = 0.5) -> float:
    """Fraction of this machine's CPU time used (by anyone) over ``interval`` seconds, from /proc/stat."""
    def read():
        with open("/proc/stat") as f:
            parts = [float(x) for x in f.readline().split()[1:]]
        idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
        return idle, sum(parts)

    try:
        idle0, total0 = read()
        time.sleep(interval)
        idle1, total1 = read()
    except OSError:
        return 0.0
    total = total1 - total0
    return 1.0 - (idle1 - idle0) / total if total > 0 else 0.0


def wait_for_idle(threshold: float = 0.12, timeout_s: float = 60.0) -> float:
    """Wait (up to ``timeout_s``) until other processes use less than ``threshold`` of the CPUs; returns the last
    busy fraction seen. Timings on a shared machine are only meaningful when it is quiet."""
    deadline = time.monotonic() + timeout_s
    busy = cpu_busy_fraction()
    while busy > threshold and time.monotonic() < deadline:
        busy = cpu_busy_fraction()
    return busy


def _run_workers(world: int, threads: int) -> dict:
    """``world`` concurrent worker processes (gloo group when world > 1); rank 0's measurements."""
    with tempfile.TemporaryDirectory(prefix="autotune-calibrate-") as tmp:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world))
        repo_root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = repo_root + os.pathsep + env.get("PYTHONPATH", "")
        procs = []
        for rank in range(world):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "autotune.calibrate", "--worker", str(rank), str(world), str(threads), tmp],
                env=dict(env, RANK=str(rank)), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
        errors = []
        for proc in procs:
            _, err = proc.communicate(timeout=1800)
            if proc.returncode:
                errors.append(err.decode(errors="replace")[-2000:])
        if errors:
            raise RuntimeError("cpu calibration worker failed:\n" + errors[0])
        return json.loads((Path(tmp) / "rank0.json").read_text())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- contention-aware timing ---------------------------------------------------------------------------------
# This machine may be shared. Every timed sample also measures how much CPU *other* processes used meanwhile
# (/proc/stat minus the calibration workers' own jiffies); a sample during which others used more than
# CONTENDED of the CPUs is discarded, and sampling goes on (up to a time budget) until enough clean ones exist.
# All workers take the same number of samples (rank 0 decides), so they keep loading the machine together.

CONTENDED = 0.10
_PIDS: list[int] = []          # the calibration workers' process ids (set by the worker)
_CONTENDED_BENCHMARKS: list[str] = []


def _stat_busy() -> tuple[float, float]:
    with open("/proc/stat") as f:
        parts = [float(x) for x in f.readline().split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0.0)
    return sum(parts) - idle, sum(parts)


def _own_jiffies() -> float:
    total = 0.0
    for pid in _PIDS or [os.getpid()]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += float(fields[11]) + float(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return total


def others_share(before, after) -> float:
    """Share of all CPUs used by other processes between two ``_snapshot()``s."""
    (busy0, total0, own0), (busy1, total1, own1) = before, after
    total = total1 - total0
    if total <= 0:
        return 0.0
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / total


def _snapshot():
    try:
        busy, total = _stat_busy()
    except OSError:
        return 0.0, 0.0, 0.0
    return busy, total, _own_jiffies()


def _agree(value: int) -> int:
    """Rank 0's value, for every worker (all take the same number of samples and repetitions, which matters
    when the timed function is itself a collective)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return int(value)
    import torch

    flag = torch.tensor([int(value)])
    dist.broadcast(flag, 0)
    return int(flag.item())


def _sample(fn, name: str, samples: int = 5, min_seconds: float = 0.15, budget_s: float = 20.0,
            returns_times: bool = False):
    """Clean timings of ``fn`` (its wall time, or with ``returns_times`` the tuple of seconds it returns), at
    least ``samples`` of them or whatever the time budget allowed; all samples if none was clean."""
    fn()  # warm-up
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    reps = _agree(1 if returns_times else max(1, int(min_seconds / max(once, 1e-6))))
    clean, dirty = [], []
    deadline = time.monotonic() + budget_s
    while True:
        before = _snapshot()
        start = time.perf_counter()
        for _ in range(reps):
            value = fn()
        seconds = (time.perf_counter() - start) / reps
        share = others_share(before, _snapshot())
        value = value if returns_times else seconds
        (clean if share <= CONTENDED else dirty).append(value)
        done = len(clean) >= samples or time.monotonic() > deadline
        if _agree(done):
            break
        if os.environ.get("AUTOTUNE_CALIBRATE_VERBOSE"):
            print(f"{name}: sample {seconds:.4g}s, others {share:.0%}", file=sys.stderr, flush=True)
        if share > CONTENDED:
            time.sleep(0.5)
    if not clean:
        _CONTENDED_BENCHMARKS.append(name)
    return clean or dirty


def _best(fn, name: str = "", samples: int = 5) -> float:
    """The median of the clean samples. Not the minimum: this machine's speed also varies by +-20% with no
    other process visible (a shared host), and a trial's multi-second step averages over that, so the typical
    sample is the one that predicts it."""
    return statistics.median(_sample(fn, name, samples))


def _barrier():
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def speed_probe_s(samples: int = 5) -> float:
    """Seconds of a fixed small workload (matmuls, memory-bound elementwise ops, many tiny dispatched ops: the mix
    of a CPU training step), median of ``samples``. This host's speed drifts by +-25% over minutes with no other
    process visible (a shared machine); the calibration records the probe beside its measurements
    (``probe_s``), so a later measurement that runs the probe beside itself can be put in the calibration's
    units: ``seconds * probe_s / probe_now`` (``bench/throughput_fidelity.py`` does). Not contention-filtered:
    callers check contention around it as around everything else."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # a trial's memory tracker (a Python dispatch mode) must not time itself here
        return _speed_probe_s(torch, samples)


def _speed_probe_s(torch, samples: int) -> float:
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    x, small = torch.randn(1 << 19), torch.randn(64)

    def work():  # ~20 ms on a 2-core VM
        for _ in range(16):
            torch.mm(a, b)
        for _ in range(32):
            x.mul_(1.0001).add_(1e-4)
        for _ in range(600):
            small.add_(1e-4)

    work()
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        work()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_matmul() -> float:
    import torch

    flops = seconds = 0.0
    for m, k, n in MATMUL_SHAPES:
        a, b = torch.randn(m, k), torch.randn(k, n)
        seconds += _best(lambda: torch.mm(a, b), f"matmul {m}x{k}x{n}")
        flops += 2.0 * m * k * n
    return flops / seconds


def measure_attention(head_dim: int, seq: int = 2048, heads: int = 8) -> tuple[float, float]:
    """(forward, backward) computed FLOP/s of the CPU flash-attention kernel, causal, fp32."""
    import torch

    from autotune.throughput import tiled_pairs

    q, k, v = (torch.randn(1, heads, seq, head_dim) for _ in range(3))
    fwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    out, lse = fwd_op(q, k, v, 0.0, True)
    grad = torch.randn_like(out)
    t_fwd = _best(lambda: fwd_op(q, k, v, 0.0, True), f"attention fwd d{head_dim}")
    t_bwd = _best(lambda: bwd_op(grad, q, k, v, out, lse, 0.0, True), f"attention bwd d{head_dim}")
    pairs = heads * tiled_pairs(seq, seq, True, CPU_ATTENTION_TILE_Q, CPU_ATTENTION_TILE_KV)
    return pairs * 4 * head_dim / t_fwd, pairs * 10 * head_dim / t_bwd


def measure_elementwise() -> float:
    """Output bytes per second of a mix of memory-bound ops on 1-8 MiB tensors (what a step's are)."""
    import torch
    import torch.nn.functional as F

    total_bytes = seconds = 0.0
    for numel in (1 << 18, 1 << 20, 1 << 21):
        x, y = torch.randn(numel), torch.randn(numel)

        def mix():
            x + y, x * y, F.silu(x), x.clone(), x.mul_(1.0), torch.rsqrt(y), x.pow(2)

        seconds += _best(mix, "elementwise")
        total_bytes += 7 * numel * 4
    return total_bytes / seconds


def measure_memcpy() -> float:
    """Bytes per second of a copy into a fresh buffer (what an offload does: allocate the host copy, copy),
    over 1-16 MiB tensors."""
    import torch

    xs = [torch.randn(numel) for numel in (1 << 18, 1 << 20, 1 << 22)]

    def copies():
        for x in xs:
            torch.empty_like(x).copy_(x)

    return sum(x.numel() * 4 for x in xs) / _best(copies, "memcpy")


CALIBRATION_MODEL = {  # a small Llama that is none of the presets: compute is negligible at 16 tokens
    "model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False,
}


def measure_dispatch_overhead(partial_rates: dict) -> tuple[float, float]:
    """Host seconds per dispatched op of an eager training step as a trial runs it: Python module code, autograd,
    the optimizer's per-parameter loop, the trials' memory tracker, and -- on several ranks -- whatever the
    process group adds (gradient all-reduce calls, waiting on the slower rank).

    ``trials.step.train_step`` of ``CALIBRATION_MODEL`` at 16 tokens per rank on this worker's world (data
    parallel over the gloo group when there are several workers), median of samples; counted by ``StepCounter``;
    the time ``predict_step_time`` gives it without any per-op overhead is taken out, the rest is divided by the
    dispatches. Returns (per op, per view): both pass through the same Python dispatch, so they are one number.
    """
    import torch.distributed as dist

    from autotune.config import Techniques
    from autotune.throughput import Rates, StepCounter, predict_step_time
    from trials.data import make_batch, synthetic_sample
    from trials.dist import Mesh, build_mesh
    from trials.memory import DeviceMemoryTracker
    from trials.step import build_training, train_step

    import torch

    world = dist.get_world_size() if dist.is_initialized() else 1
    mesh = build_mesh(1, torch.device("cpu")) if world > 1 else Mesh.single()
    tracker = DeviceMemoryTracker(None)
    tokens = 16
    with tracker:
        model, optimizer = build_training(CALIBRATION_MODEL, Techniques(), mesh, 0, tracker)
        batch = make_batch(synthetic_sample(mesh.dp_rank, tokens, CALIBRATION_MODEL["vocab_size"]), 0, 1, "cpu")
        train_step(model, optimizer, batch, mesh, tracker)

        def steps():  # one sample: the median of 8 steps
            times = []
            for _ in range(8):
                start = time.perf_counter()
                train_step(model, optimizer, batch, mesh, tracker)
                times.append(time.perf_counter() - start)
            return (statistics.median(times),)

        measured = statistics.median(s[0] for s in _sample(steps, "step overhead", samples=5, returns_times=True))
        counter = StepCounter(tracker, seq_len=tokens, world_size=world)
        with counter:
            train_step(model, optimizer, batch, mesh, tracker)
    rates = Rates(name="cpu", **dict(partial_rates, op_overhead_s=0.0, view_overhead_s=0.0))
    predicted = predict_step_time(counter.counts, rates, world, Techniques()).step_time_s
    counts = counter.counts
    dispatches = sum(counts.phases[p].ops + counts.phases[p].views for p in counts.phases)
    per_dispatch = max(measured - predicted, 0.0) / max(dispatches, 1)
    return per_dispatch, per_dispatch


IN_STEP_MODEL = dict(CALIBRATION_MODEL, hidden_size=96, intermediate_size=256, num_attention_heads=6,
                     num_key_value_heads=2, vocab_size=2048)  # also none of the presets
IN_STEP_TOKENS = 2048


def _kernel_timer():
    """A dispatch mode that times each op's kernel, by kind (matmul / attention / other work), per tracker phase.
    Entered *below* the memory tracker, it times the kernel alone, not the Python dispatch above it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.throughput import _MATMUL, _NO_WORK, _op_name

    class KernelTimer(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.tracker = None
            self.seconds: dict = {}
            self.on = False

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            if self.on:
                elapsed = time.perf_counter() - start
                namespace, name = _op_name(func)
                kind = ("none" if name in _NO_WORK or namespace in ("profiler", "prim", "c10d", "deepspeed",
                                                                     "_c10d_functional") else
                        "matmul" if name in _MATMUL else "attention" if "attention" in name else "elementwise")
                key = (self.tracker.phase, kind)
                self.seconds[key] = self.seconds.get(key, 0.0) + elapsed
            return out

    return KernelTimer()


def measure_in_step(partial_rates: dict) -> dict:
    """Kernel rates *inside* a training step: matmul FLOP/s, elementwise output bytes/s (forward/backward and the
    optimizer's), and how much slower attention runs than in ``measure_attention``.

    Microbenchmarks reuse hot operands; a training step's kernels see cold caches, transposed weights, mixed
    shapes and small tensors with fixed per-kernel costs. So one step of ``IN_STEP_MODEL`` (a small Llama that is
    none of the presets) at ``IN_STEP_TOKENS`` tokens runs under the trials' memory tracker with every kernel
    timed (``_kernel_timer``), and ``StepCounter``'s counts of the same step are divided by those times.
    """
    import torch

    from autotune.config import Techniques
    from autotune.throughput import Rates, StepCounter, _attention_time
    from trials.data import make_batch, synthetic_sample
    from trials.dist import Mesh, build_mesh
    from trials.memory import DeviceMemoryTracker
    from trials.step import build_training, train_step

    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    # several workers: Ulysses over the gloo group, so the step synchronises the ranks at every layer (and the
    # residual the model misses is the waiting for the slower rank there, ``rank_imbalance``)
    degree = 2 if world == 2 else 1
    techniques = Techniques(ulysses_degree=degree)
    mesh = build_mesh(degree, torch.device("cpu")) if world > 1 else Mesh.single()
    timer = _kernel_timer()
    tracker = DeviceMemoryTracker(None)
    timer.tracker = tracker
    kinds = [(p, k) for p in ("forward", "backward", "optimizer") for k in ("matmul", "attention", "elementwise")]
    with timer, tracker:
        model, optimizer = build_training(IN_STEP_MODEL, techniques, mesh, 0, tracker)
        batch = make_batch(synthetic_sample(mesh.dp_rank, IN_STEP_TOKENS, IN_STEP_MODEL["vocab_size"]), mesh.sp_rank,
                           mesh.sp_degree, "cpu")
        train_step(model, optimizer, batch, mesh, tracker)

        def kernels_then_wall():
            """One step with every kernel timed, then one plain step's wall time: pairs taken together, so the
            host's speed drift (+-20% over minutes) moves both alike and the residual (rank_imbalance) sees none."""
            timer.seconds, timer.on = {}, True
            train_step(model, optimizer, batch, mesh, tracker)
            timer.on = False
            kernel_seconds = tuple(timer.seconds.get(key, 0.0) for key in kinds)
            start = time.perf_counter()
            train_step(model, optimizer, batch, mesh, tracker)
            return kernel_seconds + (time.perf_counter() - start,)

        pairs = _sample(kernels_then_wall, "in-step kernels and wall", samples=7, returns_times=True)
        samples, walls = [p[:-1] for p in pairs], [p[-1:] for p in pairs]
        counter = StepCounter(tracker, seq_len=IN_STEP_TOKENS, world_size=world)
        with counter:
            train_step(model, optimizer, batch, mesh, tracker)
    best = {key: statistics.median(sample[i] for sample in samples) for i, key in enumerate(kinds)}
    counts = counter.counts
    phases = ("forward", "backward")
    matmul_s = sum(best[(p, "matmul")] for p in phases)
    elementwise_s = sum(best[(p, "elementwise")] for p in phases)
    attention_s = sum(best[(p, "attention")] for p in phases)
    rates = Rates(name="cpu", **partial_rates)
    predicted_attention = _attention_time(counts, phases, rates) or 0.0
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
    import torch

    from autotune.throughput import StepCounter
    from trials.memory import DeviceMemoryTracker

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
        seconds = _best(lambda: optimizer.step(), "optimizer")
    pc = counter.counts.phases["optimizer"]
    net = seconds - pc.ops * op_overhead_s - pc.views * view_overhead_s
    return pc.elementwise_bytes / max(net, seconds * 0.05)


def measure_gloo() -> dict:
    """Per collective kind, ``latency + wire_bytes / bandwidth``: latency from the smallest message, bandwidth
    from the large ones (wire bytes as ``StepCounter`` counts them)."""
    import torch
    import torch.distributed as dist

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
            _barrier()
            points.append((wire, _best(fn, f"gloo {kind}")))
        latency = max(points[0][1] - points[0][0] / 1e9, 1e-6)
        big = [(w, t) for w, t in points if w >= (1 << 20)]
        bandwidth = sum(w for w, _ in big) / max(sum(t - latency for _, t in big), 1e-9)
        result[kind] = {"latency_s": latency, "bytes_per_s": bandwidth, "points": points}
    return result


def _worker(rank: int, world: int, threads: int, out_dir: str) -> None:
    import torch

    torch.set_num_threads(threads)
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo", rank=rank, world_size=world)
    result = {"threads": threads, "world_size": world}
    _PIDS[:] = [os.getpid()]
    if world > 1:
        import torch.distributed as dist

        pids = [None] * world
        dist.all_gather_object(pids, os.getpid())
        _PIDS[:] = pids
    from autotune.config import Techniques

    probes = []  # the speed probe beside each group of measurements (see speed_probe_s)
    _barrier()
    probes.append(speed_probe_s())
    result["matmul_flops"] = measure_matmul()
    _barrier()
    result["attention_flops"] = {str(d): measure_attention(d) for d in HEAD_DIMS}
    _barrier()
    result["elementwise_bytes_per_s"] = measure_elementwise()
    result["memcpy_bytes_per_s"] = measure_memcpy()
    _barrier()
    partial = {"bf16_flops": result["matmul_flops"], "hbm_bytes_per_s": result["elementwise_bytes_per_s"],
               "intra_node_bytes_per_s": 1e9, "host_bytes_per_s": result["memcpy_bytes_per_s"],
               "matmul_efficiency": 1.0, "elementwise_efficiency": 1.0, "elementwise_traffic_factor": 1.0,
               "attention_by_head_dim": tuple(sorted((int(d), (f / result["matmul_flops"], b / result["matmul_flops"]))
                                                     for d, (f, b) in result["attention_flops"].items()))}
    _barrier()
    probes.append(speed_probe_s())
    result["in_step"] = measure_in_step(partial)
    _barrier()
    probes.append(speed_probe_s())
    if world > 1:
        result["gloo"] = measure_gloo()
        _barrier()
    # everything but the per-op overhead, as the time model will use it, then the overhead on top
    result.update(op_overhead_s=0.0, view_overhead_s=0.0, optimizer_bytes_per_s=result["in_step"]["optimizer_bytes_per_s"])
    from autotune.throughput import Rates, load_rates

    yaml_rates = load_rates("cpu", world, calibration={"worlds": {str(world): result}})
    partial = {f: getattr(yaml_rates, f) for f in Rates.__dataclass_fields__ if f != "name"}
    op, view = measure_dispatch_overhead(partial)
    result["op_overhead_s"], result["view_overhead_s"] = op, view
    _barrier()
    probes.append(speed_probe_s())
    # the rates the time model uses come from the in-step run and the dispatch overhead: the probes around those
    result["probe_s"] = statistics.median(probes[1:])
    result["probes_s"] = probes
    # what the model still misses on the in-step run: on several ranks, waiting for the slower one
    from autotune.throughput import StepCounts, predict_step_time

    in_step = result["in_step"]
    timing = predict_step_time(StepCounts.from_dict(in_step.pop("counts")),
                               Rates(name="cpu", **dict(partial, op_overhead_s=op, view_overhead_s=view)), world,
                               Techniques(ulysses_degree=in_step["ulysses_degree"]))
    busy = timing.compute_s + timing.recompute_s
    in_step["predicted_s"] = timing.step_time_s
    result["rank_imbalance"] = max(0.0, in_step["wall_s"] - timing.step_time_s) / busy if world > 1 else 0.0
    result["optimizer_microbench_bytes_per_s"] = measure_optimizer(op, view)
    result["contended"] = sorted(set(_CONTENDED_BENCHMARKS))
    if world > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        _worker(int(argv[1]), int(argv[2]), int(argv[3]), argv[4])
        return 0
    data = load_or_calibrate(force="--force" in argv, quiet=False)
    print(json.dumps(data, indent=2))
    print(f"cached at {cache_path()}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
