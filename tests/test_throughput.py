"""The throughput model: what ``StepCounter`` counts, and how ``predict_step_time`` behaves.

Counts are checked exactly against analytic formulas on the tiny models (real tensors in one process, and
the memory oracle's fake trace on a fake 2-rank world); the time model is checked for monotonicity and for
its bookkeeping, on presets and on a synthetic cpu calibration (no microbenchmark runs here).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.core import calibration_store as calibrate
from autotune.core.hardware import load_hardware
from autotune.timing.attention_cost import attention_flops, causal_pairs, tiled_pairs
from autotune.timing.counting import StepCounter, record_attention
from autotune.timing.counts import PhaseCounts, StepCounts
from autotune.timing.harness import count_real_step
from autotune.timing.model import predict_step_time
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too


def rates(name: str, world_size: int = 1):
    """A preset's time-model rates for a job of ``world_size`` ranks."""
    return load_hardware(name).rates_for(world_size)


def matmul_params(cfg: dict) -> int:
    """Weights that multiply every token: q/k/v/o and the MLP per layer, plus the lm_head."""
    h, d = cfg["hidden_size"], cfg["head_dim"]
    per_layer = (
        h * d * (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"])
        + cfg["num_attention_heads"] * d * h
        + 3 * h * cfg["intermediate_size"]
    )
    return cfg["num_hidden_layers"] * per_layer + h * cfg["vocab_size"]


@pytest.fixture(scope="module")
def llama():
    return load_model_config("tiny-llama")


@pytest.fixture(scope="module")
def baseline_counts(llama):
    return count_real_step(llama, Techniques(), 128)


@pytest.fixture
def fake_calibration(tmp_path, monkeypatch):
    """A cpu calibration file with round numbers, so nothing is measured during tests."""
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path))
    world = {
        "matmul_flops": 1e11,
        "attention_flops": {"16": [4e10, 4e10], "128": [8e10, 8e10]},
        "elementwise_bytes_per_s": 1e10,
        "memcpy_bytes_per_s": 5e9,
        "op_overhead_s": 2e-5,
        "view_overhead_s": 1e-5,
        "optimizer_bytes_per_s": 1e10,
    }
    gloo = {
        k: {"latency_s": 1e-4, "bytes_per_s": 1e9} for k in ("all_to_all", "all_gather", "reduce_scatter", "all_reduce")
    }
    data = {"machine": calibrate.machine_key(), "worlds": {"1": dict(world), "2": dict(world, gloo=gloo)}}
    calibrate.cache_path().write_text(json.dumps(data))
    return data


# -- counting ------------------------------------------------------------------------------------------------


def test_matmul_flops_are_exactly_6n_per_token(llama, baseline_counts):
    seq = 128
    n = matmul_params(llama)
    forward = baseline_counts.phases["forward"].matmul_flops
    backward = baseline_counts.phases["backward"].matmul_flops
    assert forward == 2 * n * seq
    assert backward == 4 * n * seq
    assert baseline_counts.phases["recompute"].matmul_flops == 0
    assert baseline_counts.optimizer_params == sum(p.numel() for p in _params(llama))


def _params(cfg):
    from trials.models.model import build_model

    return list(build_model(cfg).parameters())


def test_checkpointing_recompute_is_counted_separately(llama, baseline_counts):
    counts = count_real_step(llama, Techniques(activation_checkpointing=True), 128)
    for phase in ("forward", "backward"):
        assert counts.phases[phase].matmul_flops == baseline_counts.phases[phase].matmul_flops
    # non-reentrant checkpoint recomputes each layer's forward up to the last tensor backward needs: every
    # projection except down_proj (its output is not saved), i.e. 2 * (layer matmul params - down) per token
    h, i = llama["hidden_size"], llama["intermediate_size"]
    layer = (matmul_params(llama) - h * llama["vocab_size"]) // llama["num_hidden_layers"]
    assert counts.phases["recompute"].matmul_flops == 2 * 128 * llama["num_hidden_layers"] * (layer - h * i)
    assert counts.phases["recompute"].attention_flops == baseline_counts.phases["forward"].attention_flops


def test_attention_flops_causal_is_about_half():
    b, h, s, d = 1, 4, 256, 16
    q, k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(3))
    results = {}
    for causal in (True, False):
        counter = StepCounter()
        with counter:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).sum().backward()
        results[causal] = counter.counts
    causal, dense = results[True], results[False]
    fwd = causal.phases["forward"].attention_flops
    assert fwd == 4 * b * h * d * s * (s + 1) // 2
    assert dense.phases["forward"].attention_flops == 4 * b * h * d * s * s
    assert causal.phases["backward"].attention_bwd_flops == pytest.approx(2.5 * fwd)
    assert fwd / dense.phases["forward"].attention_flops == pytest.approx(0.5, abs=0.01)
    assert causal.phases["forward"].attention_dense_flops == dense.phases["forward"].attention_flops
    assert causal.phases["forward"].matmul_flops == 0  # the fused kernel is not double counted


def test_attention_helpers():
    assert causal_pairs(4, 4, True) == 10
    assert causal_pairs(4, 4, False) == 16
    fwd, bwd, dense = attention_flops(1, 2, 8, 8, 16, causal=True)
    assert bwd == 2.5 * fwd and dense == 1 * 2 * 64 * (8 * 16 + 6 * 16)
    # CPU flash tiles (256 x 512) over 1024 tokens: query tiles see 512, 512, 1024, 1024 keys
    assert tiled_pairs(1024, 1024, True, 256, 512) == 256 * (512 + 512 + 1024 + 1024)
    assert tiled_pairs(1024, 1024, True, 1, 1) == causal_pairs(1024, 1024, True)
    assert tiled_pairs(100, 100, False, 64, 64) == 100 * 100


def test_record_attention_for_stand_in_kernels():
    counter = StepCounter()
    q = torch.empty(1, 64, 4, 16)  # [b, s, h, d] like flash-attn
    with counter:
        record_attention(q, q, q, causal=True, backward=False)
    record_attention(q, q, q)  # no active counter: no-op
    assert counter.counts.phases["forward"].attention_flops == 4 * 4 * 16 * 64 * 65 // 2


def test_ulysses_all_to_all_bytes_match_the_analytic_volume(llama):
    """Oracle path: fake tensors on a fake 2-rank world; bytes per rank as DeepSpeed-Ulysses sends them."""
    from autotune.oracle import trace

    seq, degree = 1024, 2
    counters = []

    def modes(tracker):
        counters.append(StepCounter(tracker, seq_len=seq, world_size=degree))
        return counters[-1:]

    trace(llama, Techniques(ulysses_degree=degree), seq, degree, modes=modes)
    counts = counters[0].counts
    assert counters[0].failures == {}
    local = seq // degree
    d, hq, hkv, layers = (
        llama["head_dim"],
        llama["num_attention_heads"],
        llama["num_key_value_heads"],
        llama["num_hidden_layers"],
    )
    kv = max(hkv, degree)  # kv heads are replicated up to the degree when fewer
    # per layer and direction: q, k, v in (sequence shard, all heads) and the output back, fp32
    per_layer = 4 * local * d * (hq + 2 * kv + hq)
    forward = counts.collective("all_to_all", phase="forward")
    assert forward.calls == 4 * layers
    assert forward.bytes == per_layer * layers
    assert forward.wire_bytes == per_layer * layers * (degree - 1) / degree
    assert counts.collective("all_to_all", phase="backward").bytes == per_layer * layers
    assert counts.collective("all_to_all", fsdp=True).calls == 0
    # each rank computes its own tokens: a third of the 6N FLOPs per token at half the tokens
    n = matmul_params(llama)
    assert counts.phases["forward"].matmul_flops == 2 * n * local
    # attention runs over the whole sequence for hq / degree heads
    assert counts.phases["forward"].attention_flops == layers * 4 * (hq // degree) * d * seq * (seq + 1) // 2


def test_fsdp_collectives_are_side_stream_and_sized(llama):
    from autotune.oracle import trace

    counters = []

    def modes(tracker):
        counters.append(StepCounter(tracker, seq_len=256, world_size=2))
        return counters[-1:]

    trace(llama, Techniques(fsdp=True, optimizer_offload=True), 256, 2, modes=modes)
    counts = counters[0].counts
    params = sum(p.numel() for p in _params(llama))
    gather = counts.collective("all_gather", phase="forward", fsdp=True)
    scatter = counts.collective("reduce_scatter", fsdp=True)
    assert gather.calls == llama["num_hidden_layers"] + 1
    # every parameter is gathered once in forward (fp32 on the cpu preset, padded to the world size)
    assert params * 4 <= gather.bytes <= params * 4 * 1.01
    assert params * 4 <= scatter.bytes <= params * 4 * 1.01
    assert counts.collective(fsdp=False).bytes < 1024  # only the loss all-reduce stalls
    assert counts.optimizer_params == pytest.approx(params / 2, rel=0.01)
    # optimizer offload on the cpu path: sharded gradients go to the host (FSDP marks them)
    assert counts.phases["backward"].d2h_bytes == pytest.approx(params * 4 / 2, rel=0.01)
    assert counts.fsdp_d2h_bytes["backward"] == counts.phases["backward"].d2h_bytes
    # on a GPU the shards really travel: fp32 shards up before each all-gather, gradients down
    timing = predict_step_time(counts, rates("h100-sxm", 2), 2, Techniques(fsdp=True, optimizer_offload=True))
    assert timing.detail["host_h2d_bytes"] == pytest.approx(sum(counts.fsdp_all_gather_input_numel.values()) * 4)
    assert timing.detail["host_d2h_bytes"] == counts.phases["backward"].d2h_bytes
    assert timing.optimizer_s > 0


def test_cpu_device_has_no_fsdp_offload_copies(fake_calibration, llama):
    """On the cpu preset the device is host memory: FSDP2's offload copies are no-ops, activation offload's are not."""
    from autotune.oracle import trace

    counters = []

    def modes(tracker):
        counters.append(StepCounter(tracker, seq_len=256, world_size=2))
        return counters[-1:]

    tech = Techniques(fsdp=True, optimizer_offload=True, activation_checkpointing=True, activation_offload_layers=2)
    trace(llama, tech, 256, 2, modes=modes)
    counts = counters[0].counts
    layer_input = 256 * llama["hidden_size"] * 4
    assert counts.phases["forward"].d2h_bytes == 2 * layer_input
    # back in backward, each once the layer after it is done: waited for by its own layer's recompute
    assert counts.total("waited_h2d_bytes") == 2 * layer_input
    assert counts.total("h2d_bytes") == 0
    timing = predict_step_time(counts, rates("cpu", 2), 2, tech)
    assert timing.detail["host_d2h_bytes"] == 2 * layer_input
    assert timing.detail["host_h2d_bytes"] == timing.detail["host_waited_h2d_bytes"] == 2 * layer_input
    # on a GPU the copies out hide behind forward, those back are waited for
    h100 = rates("h100-sxm", 2)
    gpu = predict_step_time(counts, h100, 2, tech)
    assert gpu.exposed_host_s == pytest.approx(2 * layer_input / (h100.host_bytes_per_s * h100.host_copy_efficiency))


def test_counts_scale_and_roundtrip(baseline_counts):
    doubled = StepCounts.from_dict(baseline_counts.to_dict())
    assert doubled.to_dict() == baseline_counts.to_dict()
    half = baseline_counts.scaled(2)
    assert half.phases["forward"].matmul_flops == baseline_counts.phases["forward"].matmul_flops / 2


# -- the time model ------------------------------------------------------------------------------------------


def _no_launch_floor(name: str):
    """A GPU preset without its per-op host overhead: a tiny model at 128 tokens is launch-bound on a GPU
    (the overhead floor makes every such step take the same time), which would hide the compute terms."""
    return replace(rates(name), op_overhead_s=0.0, view_overhead_s=0.0)


def test_more_tokens_take_more_time(llama, baseline_counts):
    longer = count_real_step(llama, Techniques(), 256)
    for hardware in ("h100-sxm", "a100-80g"):
        for preset_rates in (_no_launch_floor(hardware), rates(hardware)):
            short = predict_step_time(baseline_counts, preset_rates, 1, Techniques())
            long = predict_step_time(longer, preset_rates, 1, Techniques())
            assert long.step_time_s >= short.step_time_s
        short = predict_step_time(baseline_counts, _no_launch_floor(hardware), 1, Techniques())
        long = predict_step_time(longer, _no_launch_floor(hardware), 1, Techniques())
        assert long.step_time_s > short.step_time_s and long.compute_s > short.compute_s


def test_faster_hardware_takes_less_time(baseline_counts):
    h100 = _no_launch_floor("h100-sxm")
    base = predict_step_time(baseline_counts, h100, 1, Techniques()).step_time_s
    assert predict_step_time(baseline_counts, _no_launch_floor("a100-80g"), 1, Techniques()).step_time_s > base
    assert (
        predict_step_time(baseline_counts, rates("a100-80g", 1), 1, Techniques()).step_time_s
        >= predict_step_time(baseline_counts, rates("h100-sxm", 1), 1, Techniques()).step_time_s
    )
    for field, factor in (("bf16_flops", 2.0), ("hbm_bytes_per_s", 2.0), ("matmul_efficiency", 1.2)):
        faster = replace(h100, **{field: getattr(h100, field) * factor})
        assert predict_step_time(baseline_counts, faster, 1, Techniques()).step_time_s < base


def _round_rates(world_size: int = 8, **changes):
    """The h100-sxm preset's rates for ``world_size`` ranks with round numbers, so a test works out the seconds by
    hand: 1e12 FLOP/s at full efficiency, no per-op overhead, plus ``changes``."""
    round_numbers = {"bf16_flops": 1e12, "matmul_efficiency": 1.0, "op_overhead_s": 0.0, "view_overhead_s": 0.0}
    return replace(rates("h100-sxm", world_size), **{**round_numbers, **changes})


def test_tokens_per_s_counts_data_parallel_replicas():
    from autotune.timing.counts import CollectiveCounts

    counts = StepCounts(seq_len=1000)
    counts.phases["forward"] = PhaseCounts(matmul_flops=2e12)  # 2e12 / 1e12 FLOP/s = 2 s
    counts.phases["backward"] = PhaseCounts(matmul_flops=4e12)  # 4 s: a 6 s step
    # 8 ranks: Ulysses 2 leaves 4 replicas, 4 x 1,000 tokens / 6 s = 666.67 tokens/s; Ulysses 8 one replica,
    # 1,000 / 6 = 166.67; no Ulysses 8 replicas, 8,000 / 6 = 1,333.33
    for degree, tokens_per_s in ((2, 666.667), (8, 166.667), (1, 1333.333)):
        timing = predict_step_time(counts, _round_rates(), 8, Techniques(ulysses_degree=degree), seq_len=1000)
        assert timing.step_time_s == pytest.approx(6.0)
        assert timing.tokens_per_s == pytest.approx(tokens_per_s, rel=1e-5)
    # every part of the step, each worked out by hand
    counts.phases["forward"].d2h_bytes = 3e11  # 3 s of copies at 1e11 B/s
    counts.phases["recompute"] = PhaseCounts(matmul_flops=1e12)  # 1 s
    counts.phases["optimizer"] = PhaseCounts(elementwise_bytes=5e9)
    counts.collectives = {"all_to_all/forward/sync/2": CollectiveCounts(calls=2, bytes=1e11, wire_bytes=5e10)}
    r = _round_rates(
        intra_node_bytes_per_s=1e11,
        all_to_all_efficiency=1.0,
        collective_latency_s=1e-3,
        collective_wait_s=1e-2,
        host_bytes_per_s=1e11,
        host_copy_efficiency=1.0,
        side_stream_overlap=1.0,
        host_optimizer_bytes_per_s=1e10,
    )
    timing = predict_step_time(counts, r, 8, Techniques(ulysses_degree=2, optimizer_offload=True), seq_len=1000)
    # compute 2 + 4 = 6 s; recompute 1 s; the all-to-all stalls: 5e10 B / 1e11 B/s = 0.5 s + 2 calls x 1 ms latency
    # + 2 calls x 10 ms waiting for the other rank = 0.522 s; the forward's 3 s of copies hide behind its 2 s of
    # compute: 1 s exposed; the offloaded optimizer 5e9 B / 1e10 B/s = 0.5 s. Step 6 + 1 + 0.522 + 1 + 0.5 = 9.022 s,
    # 4 replicas x 1,000 tokens / 9.022 s = 443.36 tokens/s
    parts = (timing.compute_s, timing.recompute_s, timing.exposed_comm_s, timing.exposed_host_s, timing.optimizer_s)
    assert parts == pytest.approx((6.0, 1.0, 0.522, 1.0, 0.5))
    assert timing.step_time_s == pytest.approx(9.022)
    assert timing.tokens_per_s == pytest.approx(443.36, rel=1e-4)


def test_ranks_wait_for_each_other_per_collective_call_not_per_compute_second(baseline_counts):
    """On several ranks each collective call over a group of several ranks costs ``collective_wait_s`` on top of
    its transfer (waiting for the slower rank); a call within one rank's own group, or a one-rank job, none."""
    from autotune.timing.counts import CollectiveCounts

    counts = StepCounts.from_dict(baseline_counts.to_dict())
    counts.collectives = {
        "all_to_all/forward/sync/2": CollectiveCounts(calls=16, bytes=1e6, wire_bytes=5e5),
        "all_gather/forward/fsdp/2": CollectiveCounts(calls=4, bytes=1e6, wire_bytes=5e5),
        "all_reduce/backward/sync/1": CollectiveCounts(calls=3, bytes=1e3, wire_bytes=0.0),
    }
    assert counts.collective_calls() == 20
    base = replace(rates("cpu", 2), collective_wait_s=0.0)
    waiting = replace(base, collective_wait_s=1e-3)
    plain = predict_step_time(counts, base, 2, Techniques(ulysses_degree=2))
    waited = predict_step_time(counts, waiting, 2, Techniques(ulysses_degree=2))
    assert waited.detail["rank_wait_s"] == pytest.approx(20e-3)
    assert waited.step_time_s - plain.step_time_s == pytest.approx(20e-3)
    # the same calls with twice the compute wait the same
    heavier = StepCounts.from_dict(counts.to_dict())
    heavier.phases["forward"].matmul_flops *= 2
    assert predict_step_time(heavier, waiting, 2, Techniques(ulysses_degree=2)).detail["rank_wait_s"] == pytest.approx(
        20e-3
    )
    assert predict_step_time(counts, waiting, 1, Techniques()).detail["rank_wait_s"] == 0.0


def test_overlap_rules():
    """Ulysses all-to-all stalls; FSDP collectives and offload copies hide behind compute up to its length."""
    from autotune.timing.counts import CollectiveCounts

    counts = StepCounts(seq_len=1)
    counts.phases["forward"] = PhaseCounts(matmul_flops=0.7 * 989e12 * 1.0)  # one second of forward matmul
    r = rates("h100-sxm")
    wire = 450e9 * 0.8 * 0.5  # half a second of link time
    counts.collectives["all_to_all/forward/sync"] = CollectiveCounts(calls=1, bytes=2 * wire, wire_bytes=wire)
    stalled = predict_step_time(counts, r, 2, Techniques())
    assert stalled.exposed_comm_s == pytest.approx(0.5, rel=1e-3)
    counts.collectives = {"all_gather/forward/fsdp": CollectiveCounts(calls=1, bytes=2 * wire, wire_bytes=wire)}
    hidden = predict_step_time(counts, r, 2, Techniques())
    assert hidden.exposed_comm_s == pytest.approx(0.0, abs=1e-3)
    counts.phases["forward"].d2h_bytes = 55e9 * 3  # three seconds of copies behind one second of compute
    offload = predict_step_time(counts, r, 2, Techniques())
    assert offload.exposed_host_s == pytest.approx(2.0, rel=1e-3)


def test_optimizer_offload_runs_on_the_host():
    counts = StepCounts(seq_len=128)
    counts.phases["optimizer"] = PhaseCounts(elementwise_bytes=4e9, ops=1000, views=500)
    r = _round_rates(
        1,
        hbm_bytes_per_s=2e12,
        elementwise_efficiency=1.0,
        elementwise_traffic_factor=1.0,
        host_optimizer_bytes_per_s=2e9,
        op_overhead_s=1e-4,
        view_overhead_s=2e-4,
        launch_overlaps_compute=True,
    )
    on_device = predict_step_time(counts, r, 1, Techniques())
    on_host = predict_step_time(counts, r, 1, Techniques(optimizer_offload=True))
    # on the host: 4e9 B / 2e9 B/s = 2 s, plus its dispatches 1,000 x 0.1 ms + 500 x 0.2 ms = 0.2 s: 2.2 s
    assert on_host.optimizer_s == pytest.approx(2.2)
    # on the device: 4e9 B / 2e12 B/s = 2 ms of kernels queued behind 0.2 s of launches: 0.2 s
    assert on_device.optimizer_s == pytest.approx(0.2)


def test_cpu_preset_uses_the_calibration(fake_calibration):
    one = rates("cpu", 1)
    assert one.bf16_flops == 1e11 and one.matmul_efficiency == 1.0 and not one.launch_overlaps_compute
    assert one.attention_eff(16, False) == pytest.approx(0.4)
    assert one.attention_eff(128, True) == pytest.approx(0.8)
    assert 0.4 < one.attention_eff(64, False) < 0.8
    two = rates("cpu", 2)
    assert two.intra_node_bytes_per_s == 1e9 and two.collective_latency_s == 1e-4
    counts = StepCounts(seq_len=1000)
    counts.phases["forward"] = PhaseCounts(matmul_flops=2e11, elementwise_bytes=1e10, ops=1000, views=2000)
    counts.phases["backward"] = PhaseCounts(matmul_flops=4e11, ops=2000)
    counts.phases["recompute"] = PhaseCounts(ops=500)
    counts.phases["optimizer"] = PhaseCounts(elementwise_bytes=2e9, ops=100)
    timing = predict_step_time(counts, rates("cpu"), 1, Techniques())
    # the calibration's rates, each op's overhead added to its work (a CPU runs ops synchronously):
    # forward 2e11 / 1e11 FLOP/s = 2 s + 1e10 B / 1e10 B/s = 1 s + 1,000 ops x 20 us + 2,000 views x 10 us = 3.04 s;
    # backward 4e11 / 1e11 = 4 s + 2,000 x 20 us = 4.04 s; recompute 500 x 20 us = 0.01 s;
    # the optimizer on the host: 2e9 B / 1e10 B/s = 0.2 s + 100 x 20 us = 0.202 s. Step 7.08 + 0.01 + 0.202 s
    assert (timing.compute_s, timing.recompute_s, timing.optimizer_s) == pytest.approx((7.08, 0.01, 0.202))
    assert timing.step_time_s == pytest.approx(7.292)


def test_plan_backend_fills_in_step_time(fake_calibration, llama):
    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend

    record = PlanBackend().evaluate(Evaluation(llama, Techniques(), 256, 1, load_hardware("cpu")))
    assert record.status == "ok" and record.step_time_s > 0
    assert record.tokens_per_s == pytest.approx(256 / record.step_time_s)


class Counting(TorchDispatchMode):
    """Counts the ops dispatched under it: code meant to run outside the caller's dispatch modes leaves it at 0."""

    calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Counting.calls += 1
        return func(*args, **(kwargs or {}))


def test_speed_probe_runs_outside_the_trials_dispatch_modes():
    """The drift probe of bench/throughput_fidelity.py runs inside a trial step, under the memory tracker (a Python
    dispatch mode); it must time the bare kernels, not the tracker, or every step looks ~1.8x slower."""
    from autotune.timing.calibration.sampling import speed_probe_s

    Counting.calls = 0
    with Counting():
        seconds = speed_probe_s(samples=1)
    assert seconds > 0 and Counting.calls == 0


def test_reference_step_times_the_calibrations_in_step_run_outside_the_trials_dispatch_modes():
    """bench/throughput_fidelity.py re-times the calibration's in-step step (its drift gauge) inside a trial step,
    under the trial's memory tracker: the reference must build and step its own run under its own tracker, or the
    trial's tracker would count (and slow) it."""
    from autotune.timing.calibration.microbench import IN_STEP_TOKENS, in_step_training, reference_step_s

    Counting.calls = 0
    with Counting():
        training = in_step_training()
        seconds = reference_step_s(training, steps=1)
    _, _, batch, mesh, tracker = training
    assert Counting.calls == 0 and seconds > 0
    assert batch.input_ids.shape == (1, IN_STEP_TOKENS) and mesh.sp_degree == 1  # one process: the 1-rank run
    assert tracker.peak_device_bytes > 0  # its own tracker saw the step


def test_the_fidelity_bench_measures_and_prices_its_packed_configs_packed():
    """bench/throughput_fidelity.py's ``--only documents`` configs launch their trials with the documents packed and
    price them so (attention inside each document: a faster step than the same config on whole windows);
    ``--only ring`` picks the rings, and a word that is neither is refused."""
    import sys

    from conftest import ROOT

    from trials.kernels.documents import DocumentsSpec
    from trials.trial.spec import TrialSpec

    sys.path.insert(0, str(ROOT / "bench"))
    import throughput_fidelity as bench

    assert [bench.CONFIGS[i][3]["ring_degree"] for i in bench.selected(["ring"])] == [2, 2, 2, 2]
    assert bench.selected(["0", "ring"])[0] == 0 and len(bench.MAIN) == 25
    with pytest.raises(ValueError, match="a config index"):
        bench.selected(["rings"])
    hardware = load_hardware(str(ROOT / "bench" / "results" / "calibrated-cpu.yaml"))
    model, seq_len, ranks, techniques = bench.CONFIGS[bench.selected(["documents"])[0]]
    spec = TrialSpec.from_dict(bench.trial_spec(model, seq_len, techniques, steps=1))
    assert DocumentsSpec(tuple(spec.documents)) == DocumentsSpec((techniques["documents"],))
    assert spec.techniques == Techniques(**bench.split_documents(techniques)[0])
    packed, _, _ = bench.predict(model, seq_len, ranks, techniques, hardware)
    whole, _, _ = bench.predict(model, seq_len, ranks, bench.split_documents(techniques)[0], hardware)
    assert packed.status == whole.status == "ok" and packed.step_time_s < whole.step_time_s
