"""The trial runner's CUDA path, checked on CPU with fakes where the logic does not need a GPU: segment peaks from
the caching allocator, timed steps without the tracker, copies freed before the next is measured, host memory
exhaustion told apart from the device's, and ``--memory-gib`` measured after NCCL's communicators exist."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from trials.core.dist import Mesh
from trials.core.memory import DeviceMemoryTracker, active_tracker
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques
from trials.training.step import build_training, train_step
from trials.trial import runner
from trials.trial.segments import AllocatorPeaks, SegmentPeaks
from trials.trial.spec import RankRecord, TrialSpec

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

SCRATCH = 3 << 20  # bytes a fake backward kernel allocates inside itself: the allocator sees them, the tracker not


class FakeAllocator:
    """torch.cuda's allocator statistics over a current / peak count that tests drive by hand."""

    def __init__(self):
        self.current = self.peak = self.reserved = self.peak_reserved = 0

    def allocate(self, nbytes: int, transient: bool = False) -> None:
        self.peak = max(self.peak, self.current + nbytes)
        self.peak_reserved = max(self.peak_reserved, self.peak)
        if not transient:
            self.current += nbytes

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset)

    def reset(self, device=None) -> None:  # every peak statistic back to its current value, as CUDA's does
        self.peak = self.current
        self.peak_reserved = self.current


def test_allocator_peaks_are_per_segment_and_the_runs_peaks_survive_the_resets(monkeypatch):
    fake = FakeAllocator()
    fake.install(monkeypatch)
    probe = AllocatorPeaks(torch.device("cuda"))
    fake.allocate(100)
    fake.allocate(900, transient=True)  # scratch inside an op: in the peak, freed after
    assert probe.take() == 1000
    fake.allocate(50)
    assert probe.take() == 150  # the next segment starts from what is live, not from the earlier peak
    assert probe.peaks() == (1000, 1000)  # the run's peaks, although each take reset the device's


def test_segment_peaks_take_the_allocators_peak_at_each_boundary(monkeypatch):
    fake = FakeAllocator()
    fake.install(monkeypatch)
    tracker = DeviceMemoryTracker()
    peaks = SegmentPeaks()
    tracker.add_listener(peaks)
    peaks.read_allocator(AllocatorPeaks(torch.device("cuda")), tracker)
    with tracker:
        kept = torch.zeros(1024, dtype=torch.uint8)
        fake.allocate(1024)
        with tracker.in_phase("backward"):
            grad = torch.ones(2048, dtype=torch.uint8)
            fake.allocate(2048)
            fake.allocate(SCRATCH, transient=True)  # the op's workspace: the tracker never sees it
            peaks.segment = ("backward", ("layers", "only"))
            del grad
            fake.current -= 2048
        peaks.stop_allocator()
    measured = peaks.measured()
    pre = measured[("backward", "pre")]
    assert pre.device_bytes == 1024 + 2048 + SCRATCH  # the allocator's peak between the boundaries
    assert pre.breakdown["temporaries"] == 2048 + SCRATCH and sum(pre.breakdown.values()) == pre.device_bytes
    assert measured[("setup", None)].device_bytes == 1024  # before the scratch
    assert measured[("backward", ("layers", "only"))].device_bytes == 1024 + 2048  # live when it began
    assert peaks.segments[("backward", "pre")].device_bytes == 1024 + 2048  # the tracker's own, kept apart
    del kept


class _ScratchAllocator:
    """An allocator for a CPU trial: the tracker's live bytes, plus ``SCRATCH`` inside every backward op."""

    def start(self):  # a copy's ``AllocatorPeaks``: the previous copy is freed
        self.tracker, self.peak, self.max = None, 0, 0
        return self

    def see(self, tracker) -> None:
        self.tracker = tracker
        self.peak = max(self.peak, tracker.device_bytes + (SCRATCH if tracker.phase == "backward" else 0))
        self.max = max(self.max, self.peak)

    def take(self) -> int:
        peak, self.peak = self.peak, self.tracker.device_bytes if self.tracker is not None else 0
        return peak

    def peaks(self) -> tuple[int, int]:
        return self.max, self.max


def _reduced_spec(techniques: dict, seq_len: int = 256) -> TrialSpec:
    config = load_model_config("tiny-llama")
    copies = [
        {"runs": [["layers", n]], "techniques": Techniques(**techniques).to_dict(), "timed": n == 4} for n in (3, 4)
    ]
    return TrialSpec(config, Techniques(**techniques), seq_len, steps=2, warmup=1, copies=copies)


def _run_reduced(monkeypatch, techniques: dict, allocator: bool):
    """A reduced trial (3- and 4-layer copies) on one CPU rank; ``allocator``: measured as on CUDA, by a fake
    allocator. Returns (the record, whether the tracker watched each step)."""
    watched = []

    def step(*args, **kwargs):
        watched.append(active_tracker() is not None)
        return train_step(*args, **kwargs)

    monkeypatch.setattr(runner, "train_step", step)
    if allocator:
        fake = _ScratchAllocator()

        class Tracker(DeviceMemoryTracker):
            def _check(self):
                fake.see(self)
                super()._check()

        monkeypatch.setattr(runner, "DeviceMemoryTracker", Tracker)
        monkeypatch.setattr(runner, "_allocator_peaks", lambda device: fake.start())
    record = runner.run_trial(_reduced_spec(techniques), Mesh.single("cpu"))
    assert record.status == "ok", record.error
    return record, watched


def test_on_the_allocator_path_segments_hold_what_ops_allocate_inside_and_timed_steps_run_bare(monkeypatch):
    knobs = {"activation_checkpointing": True}
    tracked, tracked_steps = _run_reduced(monkeypatch, knobs, allocator=False)
    measured, measured_steps = _run_reduced(monkeypatch, knobs, allocator=True)
    # the tracker is the CPU measurement: it watches every step; the allocator's path only the untimed ones
    # (the 3-layer copy's one step for memory, the 4-layer copy's warm-up), not the 2 it times
    assert tracked_steps == [True, True, True, True]
    assert measured_steps == [True, True, False, False]
    for plain, real in zip(tracked.copies, measured.copies):
        plain_segments = {(p, tuple(q) if isinstance(q, list) else q): (d, b) for p, q, d, b, _ in plain["segments"]}
        real_segments = {(p, tuple(q) if isinstance(q, list) else q): (d, b) for p, q, d, b, _ in real["segments"]}
        # the allocator closes every segment entered, also one in which no op ran (the tracker has none then)
        assert plain_segments.keys() <= real_segments.keys()
        extra = {key: real_segments[key][0] - plain_segments[key][0] for key in plain_segments}
        assert set(extra.values()) <= {0, SCRATCH}, extra
        assert all(extra[key] == 0 for key in extra if key[0] != "backward"), extra
        assert extra[("backward", ("layers", "middle"))] == SCRATCH  # what the layer's backward allocated inside
        for key, (device, breakdown) in real_segments.items():
            assert sum(breakdown.values()) == device, key
            if key in plain_segments:
                assert breakdown["temporaries"] - plain_segments[key][1]["temporaries"] == extra[key], key
        assert real["peak_allocated_bytes"] == plain["peak_allocated_bytes"] + SCRATCH


def test_a_copy_is_freed_before_the_next_one_is_built(monkeypatch):
    """Tiled MLP stores a bound method on each MLP (a reference cycle): only a collection frees the copy."""
    models = []
    alive_at_next = []

    def build(*args, **kwargs):
        if models:
            alive_at_next.append(models[-1]() is not None)
        model, optimizer = build_training(*args, **kwargs)
        models.append(weakref.ref(model))
        return model, optimizer

    monkeypatch.setattr(runner, "build_training", build)
    enabled = gc.isenabled()
    gc.disable()  # the cycle collector runs when it likes: off, what the runner frees itself is what is freed
    try:
        record = runner.run_trial(_reduced_spec({"mlp_tile_tokens": 128}), Mesh.single("cpu"))
    finally:
        if enabled:
            gc.enable()
    assert record.status == "ok", record.error
    assert alive_at_next == [False]


@pytest.mark.parametrize(
    "exc, status, host",
    [
        # a CUDA runtime call out of memory (C10_CUDA_CHECK): a kernel's or NCCL's device buffer as well as the
        # pinned host allocator's cudaHostAlloc, so it does not say host
        (torch.AcceleratorError("CUDA error: out of memory\nSearch for `cudaErrorMemoryAllocation'"), "oom", False),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes."), "oom", True),
        (MemoryError(), "oom", True),
        # the caching allocator's device OOM, and the tracker's simulated one
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total"), "oom", False),
        (torch.OutOfMemoryError("simulated device out of memory: 9 bytes live > capacity 8 bytes"), "oom", False),
        (ValueError("shapes do not match"), "error", False),
    ],
)
def test_host_memory_exhaustion_is_an_oom_that_says_host(monkeypatch, tiny_llama, exc, status, host):
    from autotune.backends import Evaluation
    from autotune.backends.local import merge_rank_records
    from autotune.core.hardware import load_hardware

    def failing_step(*args, **kwargs):
        raise exc

    monkeypatch.setattr(runner, "train_step", failing_step)
    spec = TrialSpec(tiny_llama, Techniques(), 128, steps=1, warmup=0)
    record = runner.run_trial(spec, Mesh.single("cpu"))
    assert record.status == status
    assert ("host out of memory" in record.error) == host, record.error
    # the launcher's merged record keeps the status and says which memory ran out
    evaluation = Evaluation(tiny_llama, Techniques(), 128, 1, load_hardware("cpu"))
    merged = merge_rank_records(evaluation, [record], 1, False, "", 60.0)
    assert merged.status == status and ("host out of memory" in merged.error) == host


def test_the_memory_limit_is_measured_after_the_communicators_are_made(monkeypatch):
    gib = 2**30
    used = {"bytes": 1 * gib}  # the CUDA context
    limit = []

    def warm(mesh):
        used["bytes"] += gib // 2  # NCCL's buffers, outside the allocator

    monkeypatch.setattr(runner, "_warm_communicators", warm)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: type("P", (), {"total_memory": 80 * gib}))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 * gib - used["bytes"], 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, device=None: limit.append(f))
    runner._limit_device_memory(Mesh.single("cuda"), 40 * gib)
    assert limit == [(40 * gib - 1.5 * gib) / (80 * gib)]  # the context and NCCL's buffers left out


def test_every_group_the_step_uses_runs_a_collective_before_the_limit(monkeypatch):
    import torch.distributed as dist

    calls = []
    world, fsdp, ulysses = object(), object(), object()
    monkeypatch.setattr(dist, "group", type("G", (), {"WORLD": world}))
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: calls.append(("all_reduce", group)))
    monkeypatch.setattr(dist, "all_to_all_single", lambda out, inp, group=None: calls.append(("all_to_all", group)))
    device_mesh = type("DM", (), {"get_group": lambda self: fsdp})()
    mesh = Mesh(
        rank=0, world_size=4, sp_degree=2, device=torch.device("cpu"), sp_group=ulysses, device_mesh=device_mesh
    )
    runner._warm_communicators(mesh)
    assert calls == [("all_reduce", world), ("all_reduce", fsdp), ("all_reduce", ulysses), ("all_to_all", ulysses)]
    calls.clear()
    runner._warm_communicators(Mesh.single("cpu"))  # one rank: no process group
    assert calls == []


def test_a_run_past_the_capacity_once_the_runtime_grew_is_oom():
    record = RankRecord(status="ok", seq_len=1, rank=0, peak_reserved_bytes=70, runtime_bytes=20)
    record.peak_device_bytes = 90
    assert "capacity 80" in runner._over_capacity(record, 80)
    assert runner._over_capacity(record, 90) is None and runner._over_capacity(record, None) is None


def test_a_cuda_runtime_call_out_of_memory_names_both_memories():
    """ "CUDA error: out of memory" comes from kernels' and NCCL's device buffers as well as from pinning: the record
    says either may have run out."""
    status, error = runner._failure(torch.AcceleratorError("CUDA error: out of memory"))
    assert status == "oom" and "CUDA runtime call" in error and "device memory" in error


@pytest.mark.parametrize("warmup, steps", [(0, 1), (1, 2), (2, 3)])
def test_the_step_that_records_the_cuda_memory_history_is_not_timed(warmup, steps):
    """A CUDA memory timeline is one extra step after the warm-up: never timed, and the run still times ``steps``."""
    plan = runner.step_plan(warmup, steps, timed=True, history=True)
    assert [history for _, history in plan].count(True) == 1
    assert not any(measured and history for measured, history in plan)
    assert [measured for measured, _ in plan].count(True) == steps
    assert plan.index((False, True)) == warmup  # where the first measured step would run: after the warm-up
    assert (
        runner.step_plan(warmup, steps, timed=True, history=False)
        == [(False, False)] * warmup + [(True, False)] * steps
    )
    assert runner.step_plan(0, 1, timed=False, history=True) == [(False, True)]


def test_the_cuda_memory_history_records_python_stacks_only(monkeypatch):
    """C++ frames cost a symbolization per allocator event; the timeline's labels need the Python ones."""
    from trials.trial import memory_timeline

    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *args, **kwargs: calls.append(kwargs))
    memory_timeline.start_cuda_history()
    assert len(calls) == 1 and calls[0].get("stacks") == "python"
