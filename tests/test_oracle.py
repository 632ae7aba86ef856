"""The memory oracle (issue 4): fake trace == real trial, depth extrapolation == full depth, reentrancy,
the plan backend's records, --max-seq, the GPU kernels' footprints, the plot."""

from __future__ import annotations

import sys
from dataclasses import replace

import pytest
import torch
from conftest import ROOT

from autotune import oracle
from autotune.backends import Evaluation
from autotune.backends.plan import PlanBackend
from autotune.core.hardware import load_hardware
from autotune.oracle.fake_world import FakeFlashAttn
from autotune.outputs.plots import plot_memory
from autotune.search.max_seq import find_max_seq
from trials.models.config import load_model_config
from trials.stack.rules import length_unit
from trials.stack.techniques import Techniques

sys.path.insert(0, str(ROOT / "bench"))
from oracle_fidelity import Config, predict_config, run_real  # noqa: E402

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

K = 1024


def model(name="tiny-llama", layers=None):
    config = dict(load_model_config(name))
    if layers:
        config["num_hidden_layers"] = layers
    return config


def evaluation(config, seq=2 * K, gpus=1, hardware="cpu", memory_gib=None, **techniques):
    return Evaluation(config, Techniques(**techniques), seq, gpus, load_hardware(hardware).with_memory_gib(memory_gib))


# -- oracle == real trial ----------------------------------------------------------------------------------

# The oracle is exact to the byte on CPU (peak and host bytes): each config's allowed peak difference is 0 bytes
# unless it names its own measured bound.
FSDP_OPTOFF_BYTES = 4  # fsdp + optimizer_offload: the real step's ``other`` holds 4 bytes the trace does not see


def _compare(configs):
    measured = run_real([config for config, _ in configs])
    for (config, allowed), real in zip(configs, measured):
        assert real["status"] == "ok", (config.name, real["error"])
        predicted = predict_config(config)
        diff = predicted.peak_device_bytes - real["peak_device_bytes"]
        assert abs(diff) <= allowed, (config.name, diff, predicted.breakdown, real["breakdown"])
        assert predicted.host_bytes == real["host_bytes"], (config.name, predicted.host_bytes, real["host_bytes"])


def test_oracle_matches_real_trials_one_rank():
    _compare(
        [
            (Config("tiny-llama", 1, 2 * K, {"activation_checkpointing": True}), 0),
            (
                Config(
                    "tiny-qwen3",
                    1,
                    4 * K,
                    {"activation_checkpointing": True, "activation_offload_layers": 2, "mlp_tile_tokens": 1024},
                    layers=6,
                ),
                0,
            ),  # extrapolated, partial offload
            (
                Config(
                    "tiny-llama",
                    1,
                    2 * K,
                    {"fsdp": True, "optimizer_offload": True, "loss_tile_tokens": 512},
                    compute_dtype="bf16",
                ),
                FSDP_OPTOFF_BYTES,
            ),
            # LoRA adapters on a frozen base: no base gradients or states, the stack's backward passes skip them
            (Config("tiny-llama", 1, 2 * K, {"head_chunk": 2, "activation_checkpointing": True}, lora={"rank": 16}), 0),
        ]
    )


@pytest.mark.slow
def test_oracle_matches_real_trials_two_ranks():
    _compare(
        [
            (Config("tiny-llama", 2, 4 * K, {"fsdp": True, "ulysses_degree": 2, "activation_checkpointing": True}), 0),
            (
                Config(
                    "tiny-llama",
                    2,
                    4 * K,
                    {
                        "fsdp": True,
                        "ulysses_degree": 2,
                        "head_chunk": 1,
                        "activation_checkpointing": True,
                        "activation_offload_layers": 6,
                        "mlp_tile_tokens": 512,
                        "loss_tile_tokens": 1024,
                    },
                    layers=6,
                ),
                0,
            ),
            (Config("tiny-qwen3", 2, 2 * K, {"ulysses_degree": 2}, compute_dtype="bf16"), 0),
            (
                Config(
                    "tiny-qwen3",
                    2,
                    4 * K,
                    {"fsdp": True, "ulysses_degree": 2, "head_chunk": 1, "mlp_tile_tokens": 1024},
                    compute_dtype="bf16",
                    lora={"rank": 16, "trainable": ["embed_tokens", "norm"]},  # q/k norms in the chunked attention
                ),
                0,
            ),
        ]
    )


# -- extrapolation == full depth ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "gpus, techniques",
    [
        (1, {}),
        (1, {"activation_checkpointing": True, "activation_offload_layers": 3}),
        (
            2,
            {
                "fsdp": True,
                "ulysses_degree": 2,
                "head_chunk": 2,
                "activation_checkpointing": True,
                "mlp_tile_tokens": 512,
                "loss_tile_tokens": 512,
            },
        ),
        (
            2,
            {"fsdp": True, "optimizer_offload": True, "activation_checkpointing": True, "activation_offload_layers": 8},
        ),
    ],
)
def test_depth_extrapolation_is_exact(gpus, techniques):
    ev = evaluation(model(layers=8), seq=2 * K, gpus=gpus, **techniques)
    fast = oracle.predict(ev)
    full = oracle.predict(ev, full_depth=True)
    assert len(fast.traces) >= 2 and len(full.traces) == 1
    assert fast.peak_device_bytes == full.peak_device_bytes
    assert fast.breakdown == full.breakdown
    assert fast.host_bytes == full.host_bytes


@pytest.mark.slow
def test_depth_extrapolation_is_exact_for_llama3_8b_on_h100():
    ev = evaluation(
        load_model_config("llama3-8b"),
        seq=64 * K,
        gpus=8,
        hardware="h100-sxm",
        fsdp=True,
        ulysses_degree=8,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers=12,
        mlp_tile_tokens=16 * K,
        loss_tile_tokens=4 * K,
        attention="flash",
    )
    fast, full = oracle.predict(ev), oracle.predict(ev, full_depth=True)
    assert (fast.peak_device_bytes, fast.breakdown, fast.host_bytes) == (
        full.peak_device_bytes,
        full.breakdown,
        full.host_bytes,
    )


def test_priming_the_optimizer_equals_a_second_step():
    """Priming makes the optimizer's states as a first step does, on zero gradients where the step's would be: with
    optimizer offload those are on the host. Counted on the device, the setup would hold a copy of every layer's
    parameters, which no step holds: with the full stack, whose step holds little else, the peak at depth."""
    config = model()
    offloaded = {"activation_checkpointing": True, "activation_offload_layers": config["num_hidden_layers"]}
    for techniques in (
        {},
        {"fsdp": True, "activation_checkpointing": True},
        {"fsdp": True, "optimizer_offload": True, **offloaded},
    ):
        primed = oracle.trace(config, Techniques(**techniques), 2 * K, 2)
        two_steps = oracle.trace(config, Techniques(**techniques), 2 * K, 2, prime_optimizer=False, steps=2)
        assert primed.peak_device_bytes == two_steps.peak_device_bytes, techniques
        assert primed.breakdown == two_steps.breakdown, techniques
        assert primed.peak_host_bytes == two_steps.peak_host_bytes, techniques
    # the full stack's setup (where the priming runs) holds as much at 3 layers as at 4: nothing per layer
    full_stack = Techniques(fsdp=True, optimizer_offload=True, **offloaded)
    setups = [
        oracle.trace(config, full_stack, 2 * K, 1, runs=[("layers", n)]).segments[("setup", None)].device_bytes
        for n in (3, 4)
    ]
    assert setups[0] == setups[1], setups


# -- one process, many evaluations -------------------------------------------------------------------------


def test_repeated_evaluations_in_one_process_leave_no_process_group():
    import torch.distributed as dist

    config = model()
    first = oracle.predict(evaluation(config, gpus=4, fsdp=True, ulysses_degree=4))
    for gpus in (2, 1, 8, 4):
        oracle.predict(evaluation(config, gpus=gpus, fsdp=gpus > 1))
        assert not dist.is_initialized()
    again = oracle.predict(evaluation(config, gpus=4, fsdp=True, ulysses_degree=4))
    assert again.peak_device_bytes == first.peak_device_bytes


# -- the plan backend --------------------------------------------------------------------------------------


def test_plan_backend_records_status_against_capacity():
    backend = PlanBackend(throughput=False)
    ev = evaluation(model(), seq=2 * K, gpus=2, fsdp=True)
    fits = backend.evaluate(replace(ev, hardware=ev.hardware.with_memory_gib(1.0)))
    assert fits.status == "ok" and fits.source == "predicted" and fits.seq_len == 2 * K
    assert fits.peak_device_bytes == sum(fits.breakdown.values())
    tight = backend.evaluate(replace(ev, hardware=ev.hardware.with_memory_gib(fits.peak_device_bytes / 2**30 * 0.99)))
    assert tight.status == "oom" and "capacity" in tight.error
    bad = backend.evaluate(evaluation(model(), gpus=2, ulysses_degree=3))
    assert bad.status == "error"


def test_a_stopped_trace_gives_the_same_verdict_and_a_lower_bound():
    """The search's plan backend stops a trace at the first allocation over capacity: same ok/oom verdict as
    the full trace, and an OOM's peak is then a lower bound at least the capacity (and at most the full peak)."""
    config = model(layers=6)  # deeper than the traced copies: the 3-layer copy is where it stops
    full, stopping = PlanBackend(throughput=False), PlanBackend(throughput=False, stop_above=1.0)
    for techniques in ({}, {"activation_checkpointing": True}):
        ev = evaluation(config, seq=4 * K, **techniques)
        whole = full.evaluate(ev).peak_device_bytes
        for fraction in (0.6, 0.97, 1.02):
            hw = ev.hardware.with_memory_gib(whole * fraction / 2**30)
            a, b = full.evaluate(replace(ev, hardware=hw)), stopping.evaluate(replace(ev, hardware=hw))
            assert a.status == b.status == ("ok" if fraction > 1 else "oom")
            if b.status == "oom":
                assert hw.device_memory_bytes < b.peak_device_bytes <= a.peak_device_bytes
                if fraction < 0.9:  # far over: the shallow copy itself crosses, the trace stops
                    assert "trace stopped" in b.error
            else:
                assert b.peak_device_bytes == a.peak_device_bytes


def test_a_sharded_model_is_never_whole_on_the_device():
    """FSDP builds on the meta device and materialises shards only: at setup each of 4 ranks holds about a
    quarter of the weights, not the whole model first (which no 70B run could survive); with optimizer offload,
    none on the device."""
    from trials.models.model import build_model

    config = model()
    whole = sum(p.numel() * 4 for p in build_model(config).parameters())
    for offload in (False, True):
        t = oracle.trace(config, Techniques(fsdp=True, optimizer_offload=offload), 1 * K, 4, prime_optimizer=False)
        setup = t.segments[("setup", None)]
        if offload:
            assert setup.device_bytes < whole / 40 and setup.host_bytes >= whole / 4
        else:
            assert whole / 4 <= setup.device_bytes < whole / 4 * 1.1


def test_host_memory_is_a_capacity_too():
    """Offloaded optimizer states must fit the node's host RAM share: over it, the record is an OOM saying so."""
    ev = evaluation(model(), seq=2 * K, gpus=2, memory_gib=1.0, fsdp=True, optimizer_offload=True)
    roomy = PlanBackend(throughput=False).evaluate(ev)
    assert roomy.status == "ok" and roomy.host_bytes > 0
    tight = replace(ev.hardware, host_memory_bytes_per_device=roomy.host_bytes - 1)
    record = PlanBackend(throughput=False).evaluate(replace(ev, hardware=tight))
    assert record.status == "oom" and "host out of memory" in record.error
    assert record.peak_device_bytes == roomy.peak_device_bytes


def test_gpu_presets_add_runtime_overheads_as_other():
    ev = evaluation(model(), seq=2 * K, gpus=2, hardware="h100-sxm", fsdp=True)
    record = PlanBackend(throughput=False).evaluate(ev)
    prediction = oracle.predict(ev)
    hw = ev.hardware
    extra = hw.cuda_context_bytes + hw.nccl_buffer_bytes
    assert prediction.overhead_bytes >= extra
    assert record.peak_device_bytes == prediction.tensor_peak_bytes + prediction.overhead_bytes
    assert record.breakdown["other"] >= extra


def test_gpu_precision_is_bf16_compute_with_fp32_master_weights():
    config = model()
    params = sum(p for p in [config["vocab_size"] * config["hidden_size"] * 2])  # embed + lm_head (untied)
    gpu = oracle.predict(evaluation(config, seq=2 * K, hardware="h100-sxm"))
    cpu = oracle.predict(evaluation(config, seq=2 * K))
    # unsharded: fp32 params and AdamW states on both; activations in bf16 on the GPU preset
    assert gpu.breakdown["params"] == cpu.breakdown["params"] >= 4 * params
    assert gpu.breakdown["optimizer"] >= 8 * params
    assert gpu.tensor_peak_bytes < cpu.tensor_peak_bytes


def test_flash_attention_has_no_kv_repeat():
    config = model("llama3-8b", layers=2)
    kwargs = dict(seq=64 * K, gpus=8, hardware="h100-sxm", fsdp=True, ulysses_degree=8)
    flash = oracle.predict(evaluation(config, attention="flash", **kwargs)).traces[0].segments
    sdpa = oracle.predict(evaluation(config, attention="sdpa", **kwargs)).traces[0].segments
    # 8 kv heads over 8 ranks: one kv head per rank, repeated to the 4 query heads on the sdpa path and saved
    # for backward by the kernel instead of the one head flash saves: 3 extra heads for k and for v
    key = ("forward", "post")
    saved = sdpa[key].breakdown["activations"] - flash[key].breakdown["activations"]
    assert saved == 2 * 2 * (64 * K * 3 * 128 * 2)  # 2 layers x (k, v) x [64K tokens, 3 heads, 128] bf16


def test_fake_flash_op_footprint():
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trials.core.memory import DeviceMemoryTracker

    b, s, hq, hkv, d = 1, 4096, 8, 2, 64
    with FakeTensorMode():
        tracker = DeviceMemoryTracker()
        with tracker:
            q = torch.empty(b, s, hq, d, dtype=torch.bfloat16, requires_grad=True)
            k = torch.empty(b, s, hkv, d, dtype=torch.bfloat16, requires_grad=True)
            v = torch.empty(b, s, hkv, d, dtype=torch.bfloat16, requires_grad=True)
            inputs = tracker.device_bytes
            out = FakeFlashAttn.apply(q, k, v)
            assert tracker.device_bytes - inputs == b * s * hq * d * 2 + b * hq * s * 4  # out + fp32 lse
            before = tracker.device_bytes
            out.backward(torch.empty_like(out))
            # dq/dk/dv, dout, fp32 dq_accum + softmax_d, dk/dv expanded to the query heads
            scratch = b * s * hq * d * 4 + b * hq * s * 4 + 2 * b * s * hq * d * 2
            grads = (b * s * hq * d + 2 * b * s * hkv * d) * 2 + b * s * hq * d * 2
            assert tracker.peak_device_bytes >= before + scratch + grads - b * s * hq * d * 2


# -- explain, --max-seq, plot ------------------------------------------------------------------------------


def test_explain_names_the_peak():
    text = oracle.explain(evaluation(model(layers=5), seq=2 * K, activation_checkpointing=True))
    assert "<- peak" in text and "largest live tensors" in text


def test_find_max_seq_returns_the_longest_fitting_grid_point():
    backend = PlanBackend(throughput=False)
    ev = evaluation(
        model(),
        seq=0,
        gpus=2,
        memory_gib=0.15,
        fsdp=True,
        ulysses_degree=2,
        activation_checkpointing=True,
        loss_tile_tokens=2 * K,
    )
    best = find_max_seq(ev, backend=backend)
    unit = length_unit(ev.techniques)
    assert unit == 2 * K and best.status == "ok" and best.seq_len % unit == 0
    over = backend.evaluate(replace(ev, seq_len=best.seq_len + unit))
    assert over.status == "oom"


def test_find_max_seq_reports_oom_when_nothing_fits():
    ev = evaluation(model(), seq=4 * K, memory_gib=0.001)
    record = find_max_seq(ev, backend=PlanBackend(throughput=False))
    assert record.status == "oom" and record.seq_len == 1024


def test_plot_memory_writes_a_png(tmp_path):
    backend = PlanBackend(throughput=False)
    records = [backend.evaluate(evaluation(model(), seq=s * K, gpus=2, fsdp=True)) for s in (1, 2)]
    path = tmp_path / "memory.png"
    plot_memory(records, 2**30, path)
    assert path.stat().st_size > 5000 and path.read_bytes()[:4] == b"\x89PNG"


# -- speed -------------------------------------------------------------------------------------------------


def test_a_trace_stopped_inside_a_custom_function_ends_in_oom_not_an_abort():
    """C++ asks queries (``prim.device``) of the tracker's mode inside ``autograd.Function.apply`` (tiled MLP,
    RMSNorm and loss are custom Functions), where an exception aborts the whole process: the capacity is checked
    only after ops that make tensors. Here the capacity is crossed by the Function's own multiply, and the queries
    C++ asks around it (fake tensors, as the oracle traces) must not be where the OOM is raised."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trials.core.memory import DeviceMemoryTracker

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(x)
            return x * w

        @staticmethod
        def backward(ctx, grad):
            return grad, grad

    checked = []
    with FakeTensorMode():
        x, w = torch.ones(8, 4, requires_grad=True), torch.ones(4, requires_grad=True)
        with DeviceMemoryTracker(capacity_bytes=0) as tracker:
            check = tracker._check
            tracker._check = lambda: (checked.append(str(tracker.op)), check())
            with pytest.raises(torch.OutOfMemoryError):
                Scale.apply(x, w)
    assert checked == ["aten.mul.Tensor"]
