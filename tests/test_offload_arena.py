"""Activation offload's host arena (``trials.stack.offload.HostArena``): one buffer per offloaded layer, allocated once and
reused every step, counted once as host bytes, and what the memory oracle predicts; its CUDA pinning outside
torch's caching host allocator. Also the CUDA-path details of the trial's groups and layer clock that a CPU run can
check: the Ulysses groups' collective timeout, the clock's events synchronized before they are read."""

from __future__ import annotations

import errno
import gc
import mmap
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from autotune import oracle
from autotune.backends import Evaluation
from autotune.core.hardware import load_hardware
from trials.core.dist import Mesh, init_mesh
from trials.core.memory import DeviceMemoryTracker
from trials.models.config import load_model_config
from trials.stack.offload import HostArena, pinned_bytes
from trials.stack.techniques import Techniques
from trials.training.data import make_batch
from trials.training.step import build_training, forward_backward, train_step

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

SEQ = 256


def _offload(layers: int) -> Techniques:
    return Techniques(activation_checkpointing=True, activation_offload_layers=layers)


def _config(layers: int) -> dict:
    config = dict(load_model_config("tiny-llama"))
    config["num_hidden_layers"] = layers
    return config


def _training(config: dict, techniques: Techniques, tracker: DeviceMemoryTracker, seq: int = SEQ):
    mesh = Mesh.single("cpu")
    model, optimizer = build_training(config, techniques, mesh, tracker=tracker)
    batch = make_batch(torch.arange(seq + 1) % config["vocab_size"], mesh.sp_rank, mesh.sp_degree, mesh.device)
    return model, optimizer, batch, mesh


def test_the_arena_holds_one_buffer_per_offloaded_layer_allocated_once():
    config = _config(4)
    layer_input = SEQ * config["hidden_size"] * 4  # [1, s, h] fp32
    with DeviceMemoryTracker() as tracker:
        model, optimizer, batch, mesh = _training(config, _offload(2), tracker)
        arena = model.activation_offload.arena
        storages = None
        for _ in range(5):
            train_step(model, optimizer, batch, mesh, tracker)
            buffers = arena.buffers()
            assert {i: b.numel() for i, b in buffers.items()} == dict.fromkeys(range(2), layer_input)
            if storages is None:
                storages = {i: b.untyped_storage() for i, b in buffers.items()}
                tracker.reset_peak()  # from here on nothing may grow
            # the same storages every step, counted once, as host bytes, and nothing else on the host
            assert all(buffers[i].untyped_storage() is storage for i, storage in storages.items())
            assert arena.nbytes == tracker.host_bytes == tracker.peak_host_bytes == 2 * layer_input


def test_the_oracle_predicts_the_arena_bytes():
    # 4 of 5 layers offloaded, 768 KiB each: even the oracle's 4-layer copy (3 offloaded) holds more on the host
    # than building the model does, so the arena is each trace's host peak
    config, seq = _config(5), 1536
    prediction = oracle.predict(Evaluation(config, _offload(4), seq, 1, load_hardware("cpu")))
    assert prediction.extension == [1]  # the 4-layer copy and the 5-layer one, extended to full depth
    with DeviceMemoryTracker() as tracker:
        model, optimizer, batch, mesh = _training(config, _offload(4), tracker, seq)
        train_step(model, optimizer, batch, mesh, tracker)
        arena_bytes = model.activation_offload.arena.nbytes
    assert arena_bytes == 4 * seq * config["hidden_size"] * 4
    assert prediction.host_bytes == tracker.peak_host_bytes == arena_bytes


def test_a_backward_after_a_later_forward_refuses_the_overwritten_input():
    config = _config(4)
    with DeviceMemoryTracker() as tracker:
        model, _, batch, mesh = _training(config, _offload(2), tracker)
        first = model(batch.input_ids, batch.position_ids, batch.labels, scale=1.0)
        forward_backward(model, batch, mesh, tracker)  # a whole step in between: the buffers now hold its inputs
        with pytest.raises(RuntimeError, match="holds the input of a later forward"):
            first.backward()


class _FakeCudart:
    """Stands in for ``torch.cuda.cudart()``: records registrations."""

    def __init__(self):
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.registered.append((ptr, size, flags))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.unregistered.append(ptr)
        return 0


def test_pinned_buffers_are_registered_page_aligned_and_unregistered_when_freed(monkeypatch):
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    like = torch.zeros(3, 1000)
    with DeviceMemoryTracker(device_type="cuda") as tracker:  # as in a CUDA trial: host by where it lives
        arena = HostArena()
        flat = arena.slot(0, like, pinned=True).flat
        assert tracker.host_bytes == flat.numel() == 12000 and tracker.device_bytes == 0
        assert arena.slot(0, like, pinned=True).flat is flat  # reused, not registered again
    ptr = flat.data_ptr()
    assert cudart.registered == [(ptr, 12000, 1)] and ptr % mmap.PAGESIZE == 0
    flat.copy_(torch.arange(12000) % 251)  # the mapping is ordinary writable memory
    assert int(flat[1000]) == 1000 % 251
    assert cudart.unregistered == []
    del flat, arena
    gc.collect()
    assert cudart.unregistered == [ptr]
    other = pinned_bytes(5)
    assert cudart.registered[-1][1] == 5 and other.numel() == 5


def test_ulysses_groups_get_the_trials_collective_timeout(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=777))
    try:
        mesh = init_mesh(1, torch.device("cpu"), timeout_s=777)
        backend = mesh.sp_group._get_backend(torch.device("cpu"))
        assert backend.options._timeout == timedelta(seconds=777)
    finally:
        dist.destroy_process_group()


class _FakeEvent:
    """A CUDA event on a clock of its own: ``elapsed_time`` fails unless both ends were synchronized, as
    ``cudaEventElapsedTime`` does (cudaErrorNotReady) for an event that has not completed."""

    now = 0.0

    def __init__(self, enable_timing: bool = False):
        self.at, self.done = None, False

    def record(self):
        _FakeEvent.now += 1.0
        self.at = _FakeEvent.now

    def synchronize(self):
        self.done = True

    def elapsed_time(self, end) -> float:
        if not (self.done and end.done):
            raise RuntimeError("CUDA error: device not ready")
        return end.at - self.at


def test_layer_clock_synchronizes_its_events_before_reading_them(monkeypatch):
    from trials.trial.layer_clock import LayerClock

    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    layers = torch.nn.Module()
    layers.layers = torch.nn.ModuleList([torch.nn.Identity() for _ in range(3)])
    clock = LayerClock(layers, DeviceMemoryTracker(), torch.device("cpu"))
    clock.cuda = True
    clock.start_step()
    for key in clock._order():
        clock._mark(key)
    times = clock.finish_step()
    assert times.layer_s == pytest.approx([2e-3] * 3)  # per layer: one interval forward, one backward, 1 ms each
    assert times.step_s == pytest.approx(9e-3)  # start .. step end: 10 marks


class _FullHostCudart(_FakeCudart):
    """``torch.cuda.cudart()`` on a host that cannot page-lock more: cudaErrorMemoryAllocation."""

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        return 2


def _no_mapping(*args, **kwargs):
    raise OSError(errno.ENOMEM, "Cannot allocate memory")


@pytest.mark.parametrize("exhausted", ["page-locking", "mapping"])
def test_the_host_running_out_under_activation_offload_is_a_host_oom(monkeypatch, exhausted):
    """Pinning or mapping an offloaded layer's buffer past the host's memory makes the trial ``oom`` naming the host
    (``max_seq`` brackets on it), not an ``error``; another CUDA failure to register stays an error."""
    from trials.trial import runner
    from trials.trial.spec import TrialSpec

    monkeypatch.setattr(torch.cuda, "cudart", _FullHostCudart)
    if exhausted == "mapping":
        monkeypatch.setattr(mmap, "mmap", _no_mapping)
    monkeypatch.setattr(runner, "train_step", lambda *args, **kwargs: pinned_bytes(1 << 20))
    spec = TrialSpec(_config(2), _offload(1), SEQ, steps=1, warmup=0)
    record = runner.run_trial(spec, Mesh.single("cpu"))
    assert record.status == "oom", record.error
    assert "host out of memory" in record.error and "1,048,576 bytes" in record.error


def test_a_registration_failing_for_another_reason_is_an_error(monkeypatch):
    class InvalidValue(_FakeCudart):
        def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
            return 1  # cudaErrorInvalidValue

    monkeypatch.setattr(torch.cuda, "cudart", InvalidValue)
    with pytest.raises(RuntimeError, match="cudaError 1") as raised:
        pinned_bytes(4096)
    assert not isinstance(raised.value, MemoryError)


def test_a_layers_input_comes_back_once_the_layer_after_it_is_done(monkeypatch):
    """Layer i-1's input is copied back to the device after every gradient of layer i (so it never adds to layer i's
    backward peak) and before any of layer i-1's."""
    from trials.stack import offload

    config = _config(4)
    events = []
    prefetch = offload._SavedInput.prefetch

    def recorded(self):
        if self.device_tensor is None and self.host_tensor is not None:
            events.append(("back", self.layer_index))
        prefetch(self)

    monkeypatch.setattr(offload._SavedInput, "prefetch", recorded)
    with DeviceMemoryTracker() as tracker:
        model, optimizer, batch, mesh = _training(config, _offload(4), tracker)
        for index, layer in enumerate(model.layers):
            for param in layer.parameters():
                param.register_hook(lambda grad, index=index: events.append(("grad", index)))
        forward_backward(model, batch, mesh, tracker)
    backs = [i for kind, i in events if kind == "back"]
    assert sorted(backs) == [0, 1, 2, 3]
    for i in range(1, 4):  # layer i-1's input: after layer i's last gradient, before layer i-1's first
        at = events.index(("back", i - 1))
        assert max(n for n, e in enumerate(events) if e == ("grad", i)) < at
        assert at < min(n for n, e in enumerate(events) if e == ("grad", i - 1))
