"""Run one trial: build, apply the stack, train warm-up + measured steps, write this rank's record.

Launched by the local backend as ``torchrun --nproc-per-node N -m trials.trial.runner SPEC OUT_DIR`` (or plain
``python -m trials.trial.runner`` for one rank). SPEC is a ``trials.trial.spec.TrialSpec`` as JSON. Each rank writes its
``trials.trial.spec.RankRecord`` as ``OUT_DIR/rank{r}.json``: status, timings, its peak device bytes and breakdown,
and the loss / grad norm of the first step. A rank that fails writes its record and exits non-zero at once, so
torchrun tears the job down instead of leaving peers blocked in a collective.

Memory: on the CPU (the simulated device) the tracker (``trials.core.memory``) watches every step and is the
measurement. On CUDA the caching allocator is: the run's peaks, and with ``runs`` each segment's peak
(``trials.trial.segments.AllocatorPeaks``); the tracker watches only the steps that are not timed (the warm-up, or the
first step) for the breakdown by category and the host bytes, so the timed steps run without its dispatch mode.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from trials.core import allocator
from trials.core.dist import init_mesh
from trials.core.memory import DeviceMemoryTracker
from trials.kernels.documents import DocumentsSpec
from trials.models import moe
from trials.models.config import copy_for_runs
from trials.models.lora import LoraSpec
from trials.stack.rules import ring_document_unit
from trials.stack.techniques import Techniques
from trials.training.data import mesh_batch, synthetic_sample
from trials.training.step import build_training, prime_optimizer, train_step
from trials.trial import memory_timeline
from trials.trial.layer_clock import LayerClock, local_parameter_count, mean_step_times
from trials.trial.segments import AllocatorPeaks, SegmentPeaks, install_segment_hooks, segment_label
from trials.trial.spec import RankRecord, TrialSpec, timeline_path


def _allocator_peaks(device: torch.device) -> AllocatorPeaks | None:
    """What measures device memory besides the tracker: CUDA's caching allocator; None on the simulated device."""
    return AllocatorPeaks(device) if device.type == "cuda" else None


def _measured_memory(device: torch.device, tracker, record: RankRecord, cuda_peaks=None) -> None:
    """Fill the record's memory fields, the same quantities the oracle predicts (``RankRecord``'s docs)."""
    record.peak_allocated_bytes = int(tracker.peak_device_bytes)
    record.breakdown, record.host_bytes = dict(tracker.peak_breakdown), int(tracker.peak_host_bytes)
    if cuda_peaks is None:  # the simulated device: no allocator, no runtime beside the tensors
        record.peak_reserved_bytes = record.peak_device_bytes = record.peak_allocated_bytes
        return
    allocated, reserved = cuda_peaks.peaks()  # the allocator's own count
    record.peak_allocated_bytes, record.peak_reserved_bytes = int(allocated), int(reserved)
    record.runtime_bytes = _runtime_bytes(device) if device.type == "cuda" else 0
    record.peak_device_bytes = record.peak_reserved_bytes + record.runtime_bytes


def _runtime_bytes(device: torch.device) -> int:
    """Device memory this process holds outside PyTorch's allocator: CUDA context, cuBLAS workspaces, NCCL buffers
    (what the hardware presets' ``cuda_context_bytes`` + ``nccl_buffer_bytes`` stand for)."""
    free, total = torch.cuda.mem_get_info(device)
    return max(0, total - free - torch.cuda.memory_reserved(device))


def _limit_device_memory(mesh, capacity_bytes: int | None) -> None:
    """``--memory-gib`` on a GPU: the caching allocator refuses to reserve beyond the capacity less what the
    runtime already holds, so a trial OOMs where a card of that size would.

    NCCL makes a group's communicator, and its buffers outside the allocator, at the group's first collective:
    each group the step uses runs one tiny collective first (``_warm_communicators``), so the runtime measured
    holds them. What the runtime takes later still counts: ``_over_capacity`` after the run."""
    device = mesh.device
    if capacity_bytes is None or device.type != "cuda":
        return
    torch.cuda.init()
    _warm_communicators(mesh)
    torch.cuda.synchronize(device)
    total = torch.cuda.get_device_properties(device).total_memory
    runtime = _runtime_bytes(device)
    usable = capacity_bytes - runtime
    if usable <= 0 or capacity_bytes > total:
        raise ValueError(
            f"capacity {capacity_bytes:,} bytes does not fit this device: it has {total:,} bytes, "
            f"{runtime:,} of them held by the CUDA runtime"
        )
    torch.cuda.set_per_process_memory_fraction(usable / total, device)


def _warm_communicators(mesh) -> None:
    """One tiny collective on each process group the step uses: the FSDP mesh's (the default group's, with the
    gradient norm's and the loss's all-reduce) and the Ulysses group's, whose all-to-alls connect its peers too.
    With ``NCCL_RUNTIME_CONNECT=0`` (``main``) a communicator connects its collective channels when it is made."""
    if not mesh.distributed:
        return
    import torch.distributed as dist

    groups = [dist.group.WORLD]
    if mesh.device_mesh is not None:
        groups.append(mesh.device_mesh.get_group())
    seen = []
    for group in groups:
        if not any(group is other for other in seen):
            seen.append(group)
            dist.all_reduce(torch.zeros(1, device=mesh.device), group=group)
    if mesh.sp_group is not None and mesh.sp_degree > 1:
        dist.all_reduce(torch.zeros(1, device=mesh.device), group=mesh.sp_group)
        dist.all_to_all_single(
            torch.empty(mesh.sp_degree, device=mesh.device),
            torch.zeros(mesh.sp_degree, device=mesh.device),
            group=mesh.sp_group,
        )


def _over_capacity(record: RankRecord, capacity_bytes: int | None) -> str | None:
    """Why a CUDA run that fit the allocator's limit is still out of memory: the runtime grew after the limit was
    set (NCCL connecting peers on first use, library handles), so reserved + runtime passed the capacity."""
    if capacity_bytes is None or not record.runtime_bytes or record.peak_device_bytes <= capacity_bytes:
        return None
    return (
        f"peak {record.peak_device_bytes:,} bytes (reserved {record.peak_reserved_bytes:,} + runtime "
        f"{record.runtime_bytes:,}) > capacity {capacity_bytes:,} bytes"
    )


# Out of memory, by which memory ran out. The caching allocator turns its own device failures into
# ``torch.OutOfMemoryError`` ("CUDA out of memory. Tried to allocate ..."). A CUDA runtime call that failed for memory
# raises "CUDA error: out of memory" (``torch.AcceleratorError``, from ``C10_CUDA_CHECK``) whichever memory it asked
# for: a kernel's or NCCL's device buffers outside the allocator as well as the pinned host allocator's
# ``cudaHostAlloc``, so it names neither. The host is named where the failure says so: activation offload's own
# pinning and mapping (``HostOutOfMemoryError``), malloc ("DefaultCPUAllocator: can't allocate memory"), Python's
# ``MemoryError``.
_HOST_OUT_OF_MEMORY = ("DefaultCPUAllocator: can't allocate memory",)
_RUNTIME_OUT_OF_MEMORY = "CUDA error: out of memory"


def _failure(exc: BaseException) -> tuple[str, str]:
    """(status, error) of a run that raised ``exc``. Out of memory is ``oom`` whether the device or the host ran
    out, as the memory oracle's verdict is (offloading past the node's RAM does not fit either); the error says
    which memory ran out where the failure tells, so a host wall is not read as the device's, nor the reverse."""
    text = str(exc)
    first = (text.splitlines() or [type(exc).__name__])[0][:500]
    if isinstance(exc, torch.OutOfMemoryError):
        return "oom", first
    if isinstance(exc, MemoryError) or any(marker in text for marker in _HOST_OUT_OF_MEMORY):
        return "oom", f"host out of memory (pinned or pageable host memory exhausted, not the device's): {first}"
    if _RUNTIME_OUT_OF_MEMORY in text:
        return "oom", (
            "out of memory in a CUDA runtime call (device memory outside the caching allocator, as kernels' and "
            f"NCCL's buffers, or pinned host memory): {first}"
        )
    if "out of memory" in text.lower():
        return "oom", first
    return "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}"


def run_trial(spec: TrialSpec, mesh=None, out_dir: Path | None = None) -> RankRecord:
    """Run the trial on this rank and return its record: the model itself, or (``spec.copies``) each shallower
    copy in turn, in this one launch, with its per-segment peaks (``RankRecord.copies``) for the launcher to
    extend to full depth. On ``spec.timeline_rank`` it writes the memory timeline of the model (or of the first
    copy) into ``out_dir``."""
    mesh = mesh or init_mesh(
        spec.techniques.ulysses_degree, timeout_s=spec.collective_timeout_s, ring_degree=spec.techniques.ring_degree
    )
    timeline = timeline_path(out_dir, mesh.rank) if out_dir is not None and spec.timeline_rank == mesh.rank else None
    if not spec.copies:
        return _run_model(spec, mesh, spec.model_config, spec.techniques, timeline=timeline)
    record = RankRecord(status="ok", seq_len=spec.seq_len, rank=mesh.rank, device=_describe(mesh.device, mesh))
    for index, copy in enumerate(spec.copies):
        runs = [tuple(run) for run in copy["runs"]]
        config = copy_for_runs(spec.model_config, runs)
        techniques = Techniques.from_dict(copy["techniques"])
        result = _run_model(
            spec,
            mesh,
            config,
            techniques,
            runs,
            f"copy {index + 1}/{len(spec.copies)} ({config['num_hidden_layers']} layers)",
            timed=copy.get("timed", True),
            timeline=timeline if index == 0 else None,
        )
        record.copies.append(result.to_dict())
        if result.status != "ok":  # a shallower copy that fails: so would the model
            record.status, record.error = result.status, result.error
            break
        # the stack's patches leave reference cycles (bound methods and wrappers stored on modules, FSDP's hook
        # state): the copy's model and optimizer are freed only by a collection, before the next copy is measured
        gc.collect()
        if mesh.device.type == "cuda":
            torch.cuda.empty_cache()
    return record


def _run_model(
    spec: TrialSpec,
    mesh,
    model_config: dict,
    techniques,
    runs=None,
    label: str = "",
    timed: bool = True,
    timeline: Path | None = None,
) -> RankRecord:
    """Build ``model_config`` with ``techniques``, run warm-up + measured steps, record memory and time.

    With ``runs`` (a shallower copy of the model, its decoder layers as runs, ``trials.trial.segments.layer_runs``): the
    optimizer states are primed first (as the oracle traces) and each segment's peak is recorded; ``timed``
    also splits the measured steps along the layers (``trials.trial.layer_clock``), else one step runs, for memory.
    ``timeline``: write this run's memory timeline there (``trials.trial.memory_timeline``), whatever its outcome: on the
    CPU the tracker's every allocation and free from the model's build to the last step (its peak is the tracker's
    measured peak), on CUDA the allocator's history of an untimed step after the warm-up (``step_plan``)."""
    seq_len, steps, warmup, seed = spec.seq_len, spec.steps, spec.warmup, spec.seed
    device = mesh.device
    # the tracker runs on CUDA too (no capacity there: the card raises OOM): the breakdown and the host bytes
    tracker = DeviceMemoryTracker(spec.capacity_bytes if device.type != "cuda" else None, device_type=device.type)
    peaks = None
    cuda_peaks = None
    if runs is not None:
        peaks = SegmentPeaks()
        tracker.add_listener(peaks)
    recorder = None
    if timeline is not None and device.type != "cuda":
        recorder = memory_timeline.TimelineRecorder(
            where=(lambda: segment_label(peaks.segment)) if peaks is not None else None
        )
        tracker.add_listener(recorder)
    cuda_history = None  # CUDA: the allocator's snapshot of the step that records it (``step_plan``)
    recording = False  # CUDA: the allocator's history is being recorded
    record = RankRecord(
        status="ok",
        seq_len=seq_len,
        rank=mesh.rank,
        device=_describe(device, mesh),
        layers=model_config["num_hidden_layers"],
    )
    step_times = []
    say = _progress(mesh.rank, label)
    moe.reset_routing_stats()
    try:
        _limit_device_memory(mesh, spec.capacity_bytes)
        cuda_peaks = _allocator_peaks(device)
        if peaks is not None and cuda_peaks is not None:
            peaks.read_allocator(cuda_peaks, tracker)
        with tracker:
            model, optimizer = build_training(
                model_config,
                techniques,
                mesh,
                seed,
                tracker,
                compute_dtype=_compute_dtype(spec.compute_dtype),
                lora=LoraSpec.from_json(spec.lora),
            )
            clock = None
            if recorder is not None:
                recorder.watch(model)
            if peaks is not None:
                install_segment_hooks(model, tracker, peaks, runs)
                prime_optimizer(model, optimizer, tracker)
                peaks.segment = ("setup", None)
                record.parameters = local_parameter_count(model)
                if timed:
                    clock = LayerClock(model, tracker, device)
                else:
                    warmup, steps = 0, 1
            tokens = synthetic_sample(mesh.dp_rank, seq_len, model.config.vocab_size, seed)
            packed = DocumentsSpec(tuple(spec.documents))  # padded for a ring, as autotune's trainer pads them
            documents = packed.for_length(seq_len, ring_document_unit(spec.techniques.ring_degree))
            batch = mesh_batch(tokens, mesh, device, documents)
        splits = []
        plan = step_plan(warmup, steps, timed, history=timeline is not None and device.type == "cuda")
        for index, (measured, history) in enumerate(plan):
            # where the allocator measures memory, a timed step (and the allocator's history) runs without the
            # tracker's dispatch mode (it would slow the step it times); the steps before it (at least one) give the
            # breakdown
            bare = cuda_peaks is not None and (measured or history) and index > 0
            if bare and peaks is not None:
                peaks.stop_allocator()
            _inject_fault(mesh.rank)
            if clock is not None and measured:
                clock.start_step()
            if history:
                memory_timeline.start_cuda_history()
                recording = True
            start = time.perf_counter()
            with contextlib.nullcontext() if bare else tracker:
                result = train_step(model, optimizer, batch, mesh, tracker)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            elapsed = time.perf_counter() - start
            if history:
                cuda_history, recording = memory_timeline.stop_cuda_history(), False
            if clock is not None and measured:
                splits.append(clock.finish_step())
            say(
                f"step {index + 1}/{len(plan)} took {elapsed:.2f} s"
                + (" (warm-up)" if index < warmup else " (memory timeline)" if history and timed else "")
                + ("" if timed else " (memory only)")
            )
            if index == 0:
                record.loss, record.grad_norm = result.loss, result.grad_norm
                if peaks is not None:  # segments are the first step's, the one the oracle traces (after priming):
                    peaks.stop_allocator()  # later steps begin with state the first one left (the offload
                    tracker.remove_listener(peaks)  # arena's host buffers), which the extension would count twice
            if measured:
                step_times.append(elapsed)
        if splits:
            split = mean_step_times(splits)
            record.layer_times_s, record.tail_time_s = split.layer_s, split.tail_s
    except Exception as exc:  # recorded, classified by the launcher
        record.status, record.error = _failure(exc)
        if recording:  # the step that failed (an out-of-memory step's history shows where it ran out)
            cuda_history = memory_timeline.stop_cuda_history()
    if timeline is not None:
        _write_timeline(timeline, recorder, cuda_history)
    routing = moe.routing_stats()  # MoE models: how far the router's load was from balanced
    if routing is not None:
        record.moe_routing = routing
    if peaks is not None:
        peaks.stop_allocator()
    _measured_memory(device, tracker, record, cuda_peaks)
    if record.status == "ok":
        over = _over_capacity(record, spec.capacity_bytes)
        if over is not None:
            record.status, record.error = "oom", over
    if peaks is not None:
        record.segments = [
            [phase, position, seg.device_bytes, dict(seg.breakdown), seg.host_bytes]
            for (phase, position), seg in peaks.measured().items()
        ]
    if step_times:
        record.step_time_s = sum(step_times) / len(step_times)
        record.tokens_per_s = seq_len * mesh.dp_size / record.step_time_s
    return record


def step_plan(warmup: int, steps: int, timed: bool, history: bool) -> list[tuple[bool, bool]]:
    """(measured, history) of each step a run takes. Timed: ``warmup`` steps, then ``steps`` measured ones; with
    ``history`` (a CUDA memory timeline) one more step records the allocator's history where the first measured
    step would run, after the warm-up, and is not timed (recording every allocation slows it). Not timed (memory
    only): one step per ``warmup + steps``, the first recording the history."""
    if not timed:
        return [(False, history and index == 0) for index in range(warmup + steps)]
    return [(False, False)] * warmup + [(False, True)] * history + [(True, False)] * steps


def _write_timeline(path: Path, recorder, cuda_history: dict | None) -> None:
    """The run's memory timeline at ``path``: the tracker's recorded events (CPU) or the allocator's history (CUDA;
    none when the run failed before its measured step)."""
    if recorder is not None:
        recorder.unwatch()
        memory_timeline.write_pickle(recorder.snapshot(), path)
    elif cuda_history is not None:
        memory_timeline.write_pickle(cuda_history, path)


def _progress(rank: int, label: str):
    """Progress lines on rank 0's output (the launcher shows the latest while a long trial runs)."""
    started = time.perf_counter()

    def say(message: str) -> None:
        if rank == 0:
            print(
                f"progress: {label + ': ' if label else ''}{message}, {time.perf_counter() - started:.0f} s in",
                flush=True,
            )

    return say


def _compute_dtype(name: str | None) -> torch.dtype | None:
    """Spec key ``compute_dtype``: ``bf16`` / ``fp32``, or absent = the device's default (bf16 on CUDA,
    fp32 on CPU). bf16 on CPU lets the oracle's GPU precision model be checked against real CPU trials."""
    if name is None:
        return None
    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32}[name]


_TEARDOWN_FAULTS = ("teardown-hang", "exit-abort")


def _inject_fault(rank: int, at: str = "step") -> None:
    """Test hook: ``AUTOTUNE_TEST_FAULT=kind:rank`` makes that rank crash, hang or die by a signal in a step, or,
    after writing its record, hang (``teardown-hang``) or abort in the interpreter's exit (``exit-abort``: as a C++
    static destructor can), so the launcher's failure classification can be tested with trials built to fail each
    way."""
    fault = os.environ.get("AUTOTUNE_TEST_FAULT")
    if not fault:
        return
    kind, _, fault_rank = fault.partition(":")
    if int(fault_rank or 0) != rank or (kind in _TEARDOWN_FAULTS) != (at == "teardown"):
        return
    if kind == "teardown-hang":
        time.sleep(10**6)
    if kind == "exit-abort":
        import atexit

        atexit.register(os.abort)
    if kind == "crash":
        print(f"injected failure on rank {rank}", file=sys.stderr, flush=True)
        raise RuntimeError(f"injected crash on rank {rank}")
    if kind == "hang":
        time.sleep(10**6)
    if kind == "signal":
        os.kill(os.getpid(), 9)


def _describe(device: torch.device, mesh) -> str:
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)} x{mesh.world_size}"
    return f"cpu (gloo) x{mesh.world_size}"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    spec_path, out_dir = Path(argv[0]), Path(argv[1])
    allocator.configure()
    # NCCL connects a communicator's peers when it is made, not at their first use in a step: its buffers are then
    # part of the runtime ``_limit_device_memory`` measures (a user's own setting stands)
    os.environ.setdefault("NCCL_RUNTIME_CONNECT", "0")
    rank = int(os.environ.get("RANK", 0))
    seq_len = None
    try:
        spec = TrialSpec.read(spec_path)
        seq_len = spec.seq_len
        record = run_trial(spec, out_dir=out_dir)
    except Exception as exc:  # failure before the trial could even start (spec, groups, imports)
        record = RankRecord(
            status="error",
            seq_len=seq_len,
            rank=rank,
            error=f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-2000:]}",
        )
    record.finished_at = time.time()  # the launcher reports the earliest failure as the root cause
    record.write(out_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    _inject_fault(rank, at="teardown")
    if record.status != "ok":
        os._exit(1)  # let torchrun stop the peers now
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.barrier()  # every rank done before any tears its group down
            dist.destroy_process_group()
    except Exception as exc:  # the records are written: a failing teardown says nothing about the trial
        print(f"teardown: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without the interpreter's exit and C++ static destructors, as trials.train does: one of them can abort
    # a finished rank ("terminate called without an active exception"), turning a trial whose every record is
    # written into an error. An exception from main() still exits the usual way, with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
