"""CUDA acceptance (``pytest -m cuda``): one GPU, in this process -- activation offload's side-stream copies and
the layer clock's CUDA events, checked through what a trial reports: losses, gradients, memory, layer times.

Skipped, never passed, without CUDA. Run on a GPU node by ``bench/gpu_check.py`` before its table."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.torch_release,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

SEQ = 16384


def _config(layers: int) -> dict:
    """tiny-llama with the given depth: small layers, so the host copies are long beside the compute (a copy that
    is read before it ends shows)."""
    from trials.models.config import load_model_config

    return dict(load_model_config("tiny-llama"), num_hidden_layers=layers)


def _grads(techniques: dict, layers: int = 6) -> tuple[float, dict[str, torch.Tensor]]:
    """One forward + backward of the seeded model on cuda:0 in bf16: (loss, fp32 gradients by parameter name)."""
    from trials.core.dist import Mesh
    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import build_training, forward_backward, global_loss

    mesh = Mesh.single(torch.device("cuda", 0))
    model, _ = build_training(_config(layers), Techniques.from_dict(techniques, layers), mesh, seed=0)
    batch = make_batch(synthetic_sample(0, SEQ, model.config.vocab_size, 0), 0, 1, mesh.device)
    loss = global_loss(forward_backward(model, batch, mesh), mesh)
    torch.cuda.synchronize()
    grads = {
        name.replace("_checkpoint_wrapped_module.", ""): p.grad.detach().float().cpu()
        for name, p in model.named_parameters()
        if p.grad is not None
    }
    return loss, grads


def _trial(techniques: dict, layers: int = 6, **spec):
    from trials.core.dist import Mesh
    from trials.stack.techniques import Techniques
    from trials.trial.runner import run_trial
    from trials.trial.spec import TrialSpec

    trial = TrialSpec(
        model_config=_config(layers),
        techniques=Techniques.from_dict(techniques, layers),
        seq_len=SEQ,
        steps=2,
        warmup=1,
        **spec,
    )
    record = run_trial(trial, Mesh.single(torch.device("cuda", 0)))
    assert record.status == "ok", record.error
    return record


def test_offloaded_layer_inputs_come_back_exact_from_the_side_stream():
    # the copies are exact: offloading every checkpointed input changes no gradient (a copy read before its
    # side-stream event, or a device buffer reused before the copy ended, gives another layer's input)
    ckpt = {"activation_checkpointing": True}
    loss, grads = _grads(ckpt)
    offload_loss, offload_grads = _grads({**ckpt, "activation_offload_layers": "all"})
    assert offload_loss == pytest.approx(loss, rel=1e-6)
    assert set(offload_grads) == set(grads)
    worst = max(float((offload_grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in grads.items())
    # Two runs of the same bf16 step differ without any offload: SDPA's CUDA backward (and the embedding's) sums
    # with atomics, in an order that changes from run to run, so a bf16 dq may round one ulp (2^-8, 3.9e-3 relative)
    # apart, and that spreads through the earlier layers' backward. 1e-2 holds that; an input read before its copy
    # ended, or another layer's input, moves a layer's gradients by tens of percent.
    assert worst < 1e-2, worst


def test_offload_moves_the_layer_inputs_to_pinned_host_memory():
    ckpt = {"activation_checkpointing": True}
    kept = _trial(ckpt)
    offloaded = _trial({**ckpt, "activation_offload_layers": "all"})
    hidden = _config(6)["hidden_size"]
    layer_input = SEQ * hidden * 2  # one layer's input [s, h] in bf16: at least this much leaves the device
    assert offloaded.host_bytes - kept.host_bytes >= 5 * layer_input, (offloaded.host_bytes, kept.host_bytes)
    assert offloaded.peak_allocated_bytes < kept.peak_allocated_bytes
    assert offloaded.loss == pytest.approx(kept.loss, rel=1e-6)  # the forward is deterministic
    # the backward is not (SDPA's CUDA backward sums with atomics: bf16 gradients a rounding apart from run to
    # run); the norm over every parameter averages that out to well under 1e-3
    assert offloaded.grad_norm == pytest.approx(kept.grad_norm, rel=1e-3)


def test_the_layer_clock_splits_a_cuda_step_along_its_layers():
    from trials.core.dist import Mesh
    from trials.core.memory import DeviceMemoryTracker
    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import build_training, train_step
    from trials.trial.layer_clock import LayerClock

    layers, device = 6, torch.device("cuda", 0)
    mesh = Mesh.single(device)
    tracker = DeviceMemoryTracker(device_type="cuda")
    with tracker:
        techniques = Techniques.from_dict({"activation_checkpointing": True}, layers)
        model, optimizer = build_training(_config(layers), techniques, mesh, 0, tracker)
        clock = LayerClock(model, tracker, device)
        batch = make_batch(synthetic_sample(0, SEQ, model.config.vocab_size, 0), 0, 1, device)
        train_step(model, optimizer, batch, mesh, tracker)  # warm-up: kernels chosen, the allocator's pool built
        torch.cuda.synchronize()
        splits, walls = [], []
        for _ in range(3):
            start = time.perf_counter()
            clock.start_step()
            train_step(model, optimizer, batch, mesh, tracker)
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - start)
            splits.append(clock.finish_step())
    for split, wall in zip(splits, walls):
        assert len(split.layer_s) == layers and all(t > 0 for t in split.layer_s) and split.tail_s > 0
        assert sum(split.layer_s) + split.tail_s < split.step_s
        # events on the step's stream span the GPU's work: the step they measure is the wall time's, not the
        # host's enqueue time (which is far shorter when the host runs ahead of the GPU)
        assert 0.7 * wall < split.step_s <= wall * 1.05, (split.step_s, wall)
    # identical middle layers take about the same time
    middle = [sum(s.layer_s[i] for s in splits) / len(splits) for i in range(1, layers - 1)]
    assert max(middle) < 2 * min(middle), middle


def test_optimizer_offload_pins_its_gradients_once_where_pinned_blocks_are_cached():
    """Review item 4 on the GPU: from torch 2.14 pinned host blocks are cached (``trials.core.allocator``), so FSDP2's
    offloaded gradient shards (tiny-llama's embedding and head: 2 MiB each) are pinned in the first step and reused
    after it; with the pre-2.14 limit each step would pin and unpin them again."""
    from trials.core import allocator
    from trials.core.dist import Mesh
    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import build_training, train_step

    if allocator.torch_release(torch.__version__) < allocator.UNCHECKED_REUSE_BEFORE:
        pytest.skip(f"torch {torch.__version__} does not cache pinned blocks above 1 MiB (trials.core.allocator)")
    allocator.configure()
    mesh = Mesh.single(torch.device("cuda", 0))
    techniques = Techniques.from_dict({"fsdp": True, "optimizer_offload": True}, 2)
    model, optimizer = build_training(_config(2), techniques, mesh, seed=0)
    batch = make_batch(synthetic_sample(0, 2048, model.config.vocab_size, 0), 0, 1, mesh.device)
    pinned_blocks_made = []
    for _ in range(3):
        train_step(model, optimizer, batch, mesh)
        torch.cuda.synchronize()
        pinned_blocks_made.append(torch.cuda.host_memory_stats()["num_host_alloc"])
    assert pinned_blocks_made[0] > 0 and pinned_blocks_made[2] == pinned_blocks_made[1], pinned_blocks_made
