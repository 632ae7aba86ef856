"""MoE experts (``trials.models.moe``): HF's eager values, static shapes under FakeTensorMode whatever the routing,
one weight gradient per projection, the routing a trial saw, the step counter's FLOPs, tiling."""

from __future__ import annotations

import pytest
import torch

from trials.models import moe
from trials.models.model import build_model

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

QWEN3_MOE = {
    "model_type": "qwen3_moe",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,  # routing and gradients well away from zero
}
MIXTRAL = {
    "model_type": "mixtral",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 32,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "initializer_range": 0.2,
}
SEQ = 64


def _batch(seq: int = SEQ):
    tokens = torch.randint(0, 256, (1, seq + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], torch.arange(seq)[None], tokens[:, 1:]


def _loss_and_grads(model, seq: int = SEQ):
    model.zero_grad(set_to_none=True)
    loss = model(*_batch(seq))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_same(expected, actual):
    (loss_a, grads_a), (loss_b, grads_b) = expected, actual
    assert abs(loss_b - loss_a) <= 1e-5 * abs(loss_a), (float(loss_a), float(loss_b))
    assert grads_a.keys() == grads_b.keys()
    for name, grad in grads_a.items():
        rel = (grads_b[name] - grad).norm() / grad.norm()
        assert grad.norm() > 0 and rel < 1e-4, (name, float(rel))


@pytest.mark.parametrize("config", [QWEN3_MOE, MIXTRAL], ids=["qwen3_moe", "mixtral"])
def test_autotune_experts_equal_hf_eager(config):
    """Same weights, same batch: loss and every parameter gradient as HF's eager experts (router included)."""
    model = build_model(config)
    assert model.config._experts_implementation == "autotune"
    moe.reset_routing_stats()
    ours = _loss_and_grads(model)
    assert moe.routing_stats() is not None  # the autotune implementation ran
    model.lm.set_experts_implementation("eager")
    _assert_same(_loss_and_grads(model), ours)


def test_other_expert_layouts_equal_hf_and_expert_parallel_is_refused():
    """GPT-OSS's experts (transposed, biased, interleaved gate/up with its own ``_apply_gate``) against HF's
    batched implementation, which honours the same flags; expert parallelism is refused."""
    from transformers import GptOssConfig
    from transformers.integrations.moe import batched_mm_experts_forward
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    torch.manual_seed(0)
    experts = GptOssExperts(GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4))
    assert experts.is_transposed and experts.has_bias and not experts.is_concatenated
    for param in experts.parameters():
        param.data.normal_(0.0, 0.3)
    hidden = torch.randn(12, 16, requires_grad=True)
    index = torch.randint(0, 4, (12, 2))
    weights = torch.rand(12, 2)
    results = []
    for forward in (batched_mm_experts_forward, moe.experts_forward):
        experts.zero_grad(set_to_none=True)
        hidden.grad = None
        out = forward(experts, hidden, index, weights)
        out.square().sum().backward()
        results.append((out.detach(), hidden.grad.clone(), [p.grad.clone() for p in experts.parameters()]))
    (out_a, d_hidden_a, d_params_a), (out_b, d_hidden_b, d_params_b) = results
    torch.testing.assert_close(out_b, out_a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_hidden_b, d_hidden_a, rtol=1e-4, atol=1e-6)
    for grad_b, grad_a in zip(d_params_b, d_params_a):
        torch.testing.assert_close(grad_b, grad_a, rtol=1e-4, atol=1e-6)
    experts._is_expert_parallel = True
    with pytest.raises(ValueError, match="expert parallelism"):
        moe.experts_forward(experts, hidden, index, weights)


def test_expert_and_router_weights_are_the_same_whole_or_sharded(monkeypatch):
    """``init_weights`` on a rank holding experts 3..5 (a dim-0 shard) gives the whole model's values there, with
    init blocks that cut across experts; experts and router ~ N(0, initializer_range)."""
    import trials.models.model as model_module

    monkeypatch.setattr(model_module, "INIT_BLOCK_ROWS", 40)
    whole = build_model(QWEN3_MOE)
    sharded = build_model(QWEN3_MOE)
    for param in sharded.parameters():
        param.data.zero_()
    monkeypatch.setattr(model_module, "_local_rows", lambda param: (param.data[3:6], 3))
    model_module.init_weights(sharded)
    for (name, expected), actual in zip(whole.named_parameters(), sharded.parameters()):
        assert torch.equal(actual[3:6], expected[3:6]), name
        if "experts" in name or "gate.weight" in name:
            assert abs(float(expected.detach().std()) - 0.2) < 0.02, name


def _fake_peak(config, route) -> int:
    """Peak live bytes of a forward + backward under FakeTensorMode with the routers' top-k replaced by ``route``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from trials.core.memory import DeviceMemoryTracker

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(config)
        for layer in model.layers:
            layer.mlp.gate.register_forward_hook(route)
        tracker = DeviceMemoryTracker(None)
        with tracker:
            batch = (
                torch.zeros(1, SEQ, dtype=torch.long),
                torch.arange(SEQ)[None],
                torch.zeros(1, SEQ, dtype=torch.long),
            )
            model(*batch).backward()
        assert all(p.grad is not None and p.grad.shape == p.shape for p in model.parameters())
    return tracker.peak_device_bytes


def test_a_fake_step_runs_and_its_memory_does_not_depend_on_the_routing():
    """Under FakeTensorMode HF's eager experts fail on ``nonzero``; ours run (static shapes), and every expert on
    one expert or spread evenly gives the same peak: memory is the routing's whatever it is."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(QWEN3_MOE)
        model.lm.set_experts_implementation("eager")
        batch = (torch.zeros(1, SEQ, dtype=torch.long), torch.arange(SEQ)[None], torch.zeros(1, SEQ, dtype=torch.long))
        with pytest.raises(DynamicOutputShapeException):
            model(*batch)

    def one_expert(module, args, out):
        return out[0], out[1], torch.zeros_like(out[2])

    def spread(module, args, out):
        slots = torch.arange(out[2].numel(), device=out[2].device).view_as(out[2])
        return out[0], out[1], slots % 8

    assert _fake_peak(QWEN3_MOE, one_expert) == _fake_peak(QWEN3_MOE, spread) > 0


def test_backward_keeps_one_weight_gradient_per_projection():
    """The experts' weight gradients are written into one [E, ...] tensor per projection, not built as a full-size
    tensor per expert (eager's per-expert indexing: E full copies in backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    model = build_model(QWEN3_MOE)
    experts = model.layers[0].mlp.experts
    full_size = experts.gate_up_proj.numel()
    made = []

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t.numel() == full_size:
                    made.append(str(func))
            return out

    loss = model(*_batch())
    with Sizes():
        loss.backward()
    per_layer = len(made) / len(model.layers)
    assert per_layer <= 3, made  # the gradient, its accumulation: nowhere near one per expert (8)


def test_routing_stats_report_the_real_max_tokens_per_expert():
    model = build_model(QWEN3_MOE)
    seen = []  # the router's indices of every MoE call
    for layer in model.layers:
        layer.mlp.gate.register_forward_hook(lambda module, args, out: seen.append(out[2].detach()))
    moe.reset_routing_stats()
    assert moe.routing_stats() is None  # no MoE call yet
    with torch.no_grad():
        model(*_batch())
    expected = max(int(torch.bincount(index.flatten(), minlength=8).max()) for index in seen)
    assert len(seen) == 2 and expected > SEQ * 2 // 8  # a real, unbalanced routing
    assert moe.routing_stats() == {
        "max_tokens_per_expert": expected,
        "balanced_tokens_per_expert": SEQ * 2 / 8,
        "experts": 8,
        "top_k": 2,
    }


def test_trial_record_carries_the_routing():
    """A one-rank CPU trial of the MoE model: its rank record holds ``moe_routing``."""
    from trials.core.dist import Mesh
    from trials.stack.techniques import Techniques
    from trials.trial.runner import run_trial
    from trials.trial.spec import RankRecord, TrialSpec

    record = run_trial(TrialSpec(QWEN3_MOE, Techniques(), SEQ, steps=1, warmup=0), Mesh.single("cpu"))
    assert record.status == "ok", record.error
    routing = RankRecord.from_dict(record.to_dict()).moe_routing
    assert routing["experts"] == 8 and routing["top_k"] == 2 and routing["balanced_tokens_per_expert"] == 16.0
    assert 16 <= routing["max_tokens_per_expert"] <= SEQ


def test_the_step_counter_counts_the_grouped_gemms_of_the_active_experts():
    """The time model's FLOPs of an MoE step: tokens x top-k rows through each projection, forward and backward."""
    from autotune.oracle.tracing import trace
    from autotune.timing.counting import StepCounter
    from trials.stack.techniques import Techniques

    counters = []

    def modes(tracker):
        counters.append(StepCounter(tracker, seq_len=SEQ, world_size=1))
        return counters[-1:]

    trace(QWEN3_MOE, Techniques(), SEQ, 1, modes=modes)
    counts = counters[0].counts
    tokens, h, heads, kv, inter, experts, vocab, layers = SEQ, 64, 4 * 16, 2 * 16, 32, 8, 256, 2
    slots = tokens * 2  # top-2
    attention = 2 * tokens * h * (heads + 2 * kv) + 2 * tokens * heads * h  # q, k, v, o projections
    router = 2 * tokens * h * experts
    expert_gemms = 2 * slots * h * 2 * inter + 2 * slots * inter * h  # gate_up [S, h] x [h, 2I], down [S, I] x [I, h]
    forward = layers * (attention + router + expert_gemms) + 2 * tokens * h * vocab  # + lm_head
    assert counts.phases["forward"].matmul_flops == forward
    assert counts.phases["backward"].matmul_flops == 2 * forward  # input and weight gradients of every GEMM


def test_mlp_tiling_of_moe_layers_keeps_loss_and_gradients():
    from trials.stack.tiling import apply_mlp_tiling

    model = build_model(QWEN3_MOE)
    untiled = _loss_and_grads(model)
    apply_mlp_tiling(model, 16)  # 4 tiles of the 64 tokens
    tiles = []
    for layer in model.layers:
        layer.mlp.gate.register_forward_hook(lambda module, args, out: tiles.append(args[0].shape[0]))
    _assert_same(untiled, _loss_and_grads(model))
    assert set(tiles) == {16}  # the router (hence the experts) saw tiles only


def test_experts_read_no_value_from_the_device_in_forward_or_backward():
    """An MoE layer's experts read nothing back to the host, forward or backward (no ``int()`` of the routing per
    layer: on CUDA each is a sync that stops the CPU queueing ahead); the routing is read once, when asked for."""
    from host_syncs import HostSyncs

    experts = build_model(QWEN3_MOE).layers[0].mlp.experts
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(SEQ, QWEN3_MOE["hidden_size"], generator=generator, requires_grad=True)
    chosen = torch.randint(0, 8, (SEQ, 2), generator=generator)
    weights = torch.rand(SEQ, 2, generator=generator, requires_grad=True)
    moe.reset_routing_stats()
    with HostSyncs() as syncs:
        moe.experts_forward(experts, hidden, chosen, weights).square().sum().backward()
    assert syncs.where == []
    assert moe.routing_stats()["max_tokens_per_expert"] == int(torch.bincount(chosen.flatten(), minlength=8).max())


class _BlackwellGroupedMM(torch.autograd.Function):
    """``F.grouped_mm`` as pytorch#172439 reports it on B200: right outputs, and a weight gradient that is garbage
    (here NaN) for the groups without rows. Computed by transformers' per-expert fallback, which runs on the CPU."""

    @staticmethod
    def forward(ctx, rows, weight, offs):
        ctx.save_for_backward(rows, weight, offs)
        return torch.ops.transformers.grouped_mm_fallback(rows, weight, offs)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, offs = ctx.saved_tensors
        with torch.enable_grad():
            r, w = rows.detach().requires_grad_(), weight.detach().requires_grad_()
            torch.ops.transformers.grouped_mm_fallback(r, w, offs).backward(grad)
        empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
        return r.grad, w.grad.masked_fill(empty[:, None, None], float("nan")), None


def test_experts_without_tokens_get_a_zero_weight_gradient_from_a_grouped_mm_that_leaves_garbage(monkeypatch):
    """Every expert's weight gradient is the per-expert reference's, and exactly zero for experts no token chose,
    even from a grouped GEMM whose backward leaves those groups' gradients unwritten (pytorch#172439)."""
    experts = build_model(QWEN3_MOE).layers[0].mlp.experts.to(torch.bfloat16)
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(SEQ, QWEN3_MOE["hidden_size"], generator=generator, dtype=torch.bfloat16)
    chosen = torch.randint(0, 4, (SEQ, 2), generator=generator)  # experts 4-7 get no token
    weights = torch.rand(SEQ, 2, generator=generator, dtype=torch.bfloat16)

    def gradients():
        experts.zero_grad(set_to_none=True)
        moe.experts_forward(experts, hidden, chosen, weights).float().square().sum().backward()
        return {name: p.grad.clone() for name, p in experts.named_parameters()}

    monkeypatch.setattr(
        moe, "_grouped_mm", lambda rows, w, offs: torch.ops.transformers.grouped_mm_fallback(rows, w, offs)
    )
    reference = gradients()
    monkeypatch.undo()
    monkeypatch.setattr(moe.F, "grouped_mm", lambda rows, w, offs: _BlackwellGroupedMM.apply(rows, w, offs))
    guarded = gradients()
    for name, grad in guarded.items():
        assert torch.equal(grad[4:], torch.zeros_like(grad[4:])), name
        assert torch.equal(grad, reference[name]), name
