"""The CUDA path's defects (issue 15), each caught on CPU where it can be: flash-attn's input dtypes without FSDP,
the gradient norm's collectives, trial deadlines from the predicted step time, the allocator settings, fp32
accumulation across loss tiles and head chunks, and the measured record's allocated / reserved / host bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from trials.core.dist import Mesh
from trials.kernels import attention
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too


def _flash_stand_in(seen: list):
    """flash-attn's ``flash_attn_func`` contract on CPU: q/k/v [b, s, h, d] in ONE 16-bit dtype (what mha_fwd
    checks), computed with torch's SDPA so a step runs for real."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, **kwargs):
        seen.append((q.dtype, k.dtype, v.dtype))
        assert q.dtype == k.dtype == v.dtype and q.dtype in (torch.float16, torch.bfloat16), seen[-1]
        groups = q.shape[2] // k.shape[2]
        k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal, scale=softmax_scale
        )
        return out.transpose(1, 2)

    return flash_attn_func


def _one_step(techniques: Techniques, compute_dtype=torch.bfloat16) -> float:
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import build_training, train_step

    mesh = Mesh.single("cpu")
    model, optimizer = build_training(
        load_model_config("tiny-llama"), techniques, mesh, seed=0, compute_dtype=compute_dtype
    )
    batch = make_batch(synthetic_sample(0, 256, model.config.vocab_size, 0), 0, 1, mesh.device)
    return train_step(model, optimizer, batch, mesh).loss


def test_flash_without_fsdp_gets_one_16bit_dtype():
    # under bf16 autocast HF's rotary step turns q/k fp32 (bf16 x fp32 cos/sin) while v stays bf16
    seen: list = []
    with attention.flash_kernels(_flash_stand_in(seen), None, None):
        flash = _one_step(Techniques(attention="flash"))
    assert seen and all(dtypes == (torch.bfloat16,) * 3 for dtypes in seen), seen
    sdpa = _one_step(Techniques(attention="sdpa"))
    assert abs(flash - sdpa) <= 2e-2 * abs(sdpa), (flash, sdpa)  # the same model, bf16 rounding apart


def test_flash_refuses_fp32_compute_with_the_reason():
    seen: list = []
    with attention.flash_kernels(_flash_stand_in(seen), None, None):
        try:
            _one_step(Techniques(attention="flash"), compute_dtype=torch.float32)
        except RuntimeError as exc:
            assert "fp16/bf16" in str(exc) and "sdpa" in str(exc)
        else:
            raise AssertionError("flash with fp32 compute ran")
    assert not seen


def test_the_oracle_refuses_what_flash_attn_refuses():
    from autotune.oracle.fake_world import FakeFlashAttn

    q = torch.empty(1, 16, 4, 8)
    k = v = torch.empty(1, 16, 2, 8, dtype=torch.bfloat16)
    try:
        FakeFlashAttn.apply(q, k, v)
    except RuntimeError as exc:
        assert "fp16 and bf16" in str(exc)
    else:
        raise AssertionError("the fake flash kernel took fp32 q with bf16 k/v")


def test_flash_configs_without_fsdp_get_a_prediction_on_a_gpu_preset():
    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend
    from autotune.core.hardware import load_hardware

    config = load_model_config("tiny-llama")
    for knobs in ({}, {"ulysses_degree": 2}, {"ulysses_degree": 2, "head_chunk": 1}):
        techniques = Techniques(attention="flash", **knobs)
        record = PlanBackend(throughput=False).evaluate(
            Evaluation(config, techniques, 2048, techniques.ulysses_degree, load_hardware("h100-sxm"))
        )
        assert record.status == "ok", (knobs, record.error)


def test_loss_tiles_accumulate_the_lm_head_gradient_in_fp32():
    # bf16 lm_head (FSDP's unsharded parameter) over 128 tiles: one rounding, not one per tile
    from trials.stack.tiling import tiled_loss

    torch.manual_seed(0)
    tokens, hidden_size, vocab = 4096, 64, 256
    head = torch.nn.Linear(hidden_size, vocab, bias=False).to(torch.bfloat16)
    hidden = torch.randn(1, tokens, hidden_size, dtype=torch.bfloat16)
    labels = torch.randint(0, vocab, (1, tokens))
    tiled_loss(32)(hidden, head, labels, 1.0 / tokens).backward()
    reference = head.weight.detach().float().requires_grad_(True)
    logits = hidden[0].float() @ reference.t()
    (F.cross_entropy(logits, labels[0], reduction="sum") / tokens).backward()
    error = float((head.weight.grad.float() - reference.grad).norm() / reference.grad.norm())
    assert head.weight.grad.dtype == torch.bfloat16
    assert error < 4e-3, error  # bf16 accumulation over the 128 tiles gives ~1e-2


# -- allocator settings, deadlines, the measured record ------------------------------------------------------


def test_allocator_settings_are_merged_into_the_trial_environment_and_known_to_torch():
    from trials.core.allocator import SETTINGS, configure, supported_settings, torch_release, trial_environment

    ours = ",".join(f"{key}:{value}" for key, value in supported_settings().items())
    env = trial_environment({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128,expandable_segments:False", "X": "1"})
    assert "PYTORCH_CUDA_ALLOC_CONF" not in env and env["X"] == "1"
    assert env["PYTORCH_ALLOC_CONF"] == f"max_split_size_mb:128,{ours}"
    # torch parses each key we pass on (a bad value is refused), and takes ours
    for key in supported_settings():
        try:
            torch._C._accelerator_setAllocatorSettings(f"{key}:not-a-value")
        except (ValueError, RuntimeError):
            pass
        else:
            raise AssertionError(f"torch {torch.__version__} does not know the allocator setting {key!r}")
    assert configure().endswith(ours)
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)  # torch 2.11 has no getter
    if getter is not None:
        assert all(f"{key}:{value}" in getter() for key, value in supported_settings().items())
    # what the releases at the ends of pyproject's range know (as measured): 2.11 no pinned_max_* key, 2.13 to 2.15
    # both; from 2.14 the host allocator's blocks are cached (no cache limit)
    release = torch_release(torch.__version__)[:2]
    if release == (2, 11):
        assert supported_settings() == {"expandable_segments": "True"}
    elif release == (2, 13):
        assert supported_settings() == {**SETTINGS, "pinned_max_cached_size_mb": "1"}
    elif release >= (2, 14):
        assert supported_settings() == SETTINGS


def test_pinned_host_blocks_are_cached_on_a_torch_whose_host_allocator_compares_their_sizes():
    """Review item 4: where the host allocator cannot hand a request a smaller block (2.14 on), FSDP2's offloaded
    gradients are pinned once and reused, not pinned and unpinned every step; before 2.14 a block above 1 MiB is
    never cached, so never handed to a larger request."""
    from trials.core.allocator import settings_for, torch_release, trial_environment

    assert torch_release("2.15.0+cu132") == (2, 15, 0) and torch_release("2.14.0") == (2, 14, 0)
    for version in ("2.11.0", "2.12.1", "2.13.0+cpu"):
        assert settings_for(torch_release(version))["pinned_max_cached_size_mb"] == "1", version
    for version in ("2.14.0", "2.14.1+cu130", "2.15.0+cu132"):
        settings = settings_for(torch_release(version))
        assert "pinned_max_cached_size_mb" not in settings and settings["pinned_max_round_threshold_mb"] == "1"
    if torch_release(torch.__version__) >= (2, 14):  # the running torch's trials: the user's own limit is kept
        env = trial_environment({"PYTORCH_ALLOC_CONF": "pinned_max_cached_size_mb:64"})["PYTORCH_ALLOC_CONF"]
        assert "pinned_max_cached_size_mb:64" in env and "pinned_max_round_threshold_mb:1" in env


def _cached_pinned_blocks(requests, frees, steps=4):
    """Bytes torch's caching host allocator (2.14 on, ``CachingHostAllocator.h``) holds after each step, for blocks
    above 1 MiB at exact sizes: a free puts its block at the back of its ``Log2_64_Ceil`` bucket (events are
    processed oldest first), a request takes the last block of its bucket at least its size, or pins a new one."""
    buckets, held, history = {}, 0, []
    for _ in range(steps):
        live = {}
        for key, nbytes in requests:
            bucket = buckets.setdefault(math.ceil(math.log2(nbytes)), [])
            found = next((i for i in range(len(bucket) - 1, -1, -1) if bucket[i] >= nbytes), None)
            live[key] = bucket.pop(found) if found is not None else nbytes
            held += 0 if found is not None else nbytes
        history.append(held)
        for key in frees:
            if key in live:
                block = live.pop(key)
                buckets[math.ceil(math.log2(block))].append(block)
    return history


def test_fsdp2s_offloaded_gradients_find_their_own_pinned_blocks_every_step_for_every_shipped_model():
    """With pinned blocks cached (torch 2.14 on) the host allocator holds what FSDP2's offloaded gradient shards
    need, and nothing more, for every shipped model at 1 to 64 ranks: the host peak the oracle counts (the optimizer
    step, every gradient live) is what the process pins. A bucket with shards of two sizes (phi3-mini's, qwen3-30b-a3b's)
    could otherwise leave a block a smaller gradient took and pin another for the larger."""
    from trials.models.config import load_model_config, model_names
    from trials.models.model import build_model

    for name in model_names():
        model = build_model(load_model_config(name), device="meta")
        layer_params = [list(layer.parameters()) for layer in model.layers]
        in_layers = {id(param) for params in layer_params for param in params}
        root_params = [param for param in model.parameters() if id(param) not in in_layers]
        # FSDP2's reduce-scatters in backward: the last layer's group first, the root's last; frees: zero_grad
        order = [param for params in reversed(layer_params) for param in params] + root_params
        for ranks in (1, 2, 4, 8, 16, 32, 64):
            sizes = {id(p): -(-p.shape[0] // ranks) * (p.numel() // p.shape[0]) * 4 for p in model.parameters()}
            requests = [(id(p), sizes[id(p)]) for p in order if sizes[id(p)] > 1 << 20]
            held = _cached_pinned_blocks(requests, [id(p) for p in model.parameters()])
            assert held == [sum(nbytes for _, nbytes in requests)] * len(held), (name, ranks, held)


def test_trial_deadlines_follow_the_predicted_step_time():
    from autotune.backends.local import LocalBackend, trial_deadlines
    from autotune.core.record import ResultRecord

    # README's 5M prediction is ~14,000 s a step: 1 warm-up + 2 steps must fit, and a collective may wait a step
    deadline, collective = trial_deadlines(14_068.0, steps=2, warmup=1)
    assert deadline > 3 * 14_068 and collective > 14_068
    assert trial_deadlines(0.5, steps=2, warmup=1)[1] == 600.0  # never below the NCCL default

    class Predictor:
        def evaluate(self, evaluation):
            return ResultRecord(status="ok", source="predicted", seq_len=evaluation.seq_len, step_time_s=1000.0)

    assert LocalBackend(predictor=Predictor()).deadlines(_evaluation()) == trial_deadlines(1000.0, 2, 1)
    assert LocalBackend(timeout_s=50.0, predictor=Predictor()).deadlines(_evaluation())[0] == 50.0


def _evaluation(**knobs):
    from autotune.backends import Evaluation
    from autotune.core.hardware import load_hardware

    return Evaluation(load_model_config("tiny-llama"), Techniques(**knobs), 256, 1, load_hardware("cpu"))


def test_the_tracker_counts_host_storages_as_host_on_a_real_accelerator():
    from trials.core.memory import DeviceMemoryTracker

    with DeviceMemoryTracker(device_type="cuda") as tracker:
        host = torch.empty(1000, dtype=torch.float32)  # a CPU storage beside a GPU step: host memory
        assert tracker.host_bytes == 4000 and tracker.device_bytes == 0
    with DeviceMemoryTracker() as tracker:  # the simulated device: CPU storages are the device's
        simulated = torch.empty(1000, dtype=torch.float32)
        assert tracker.device_bytes == 4000 and tracker.host_bytes == 0
    del host, simulated


def test_a_measured_record_has_the_predicted_quantities():
    from trials.trial.runner import run_trial
    from trials.trial.spec import TrialSpec

    spec = TrialSpec(
        model_config=load_model_config("tiny-llama"),
        techniques=Techniques(activation_checkpointing=True, activation_offload_layers=1),
        seq_len=256,
        steps=1,
        warmup=0,
    )
    record = run_trial(spec, Mesh.single("cpu"))
    assert record.status == "ok", record.error
    # the simulated device has no allocator and no runtime: all three peaks are the tracker's
    assert record.peak_device_bytes == record.peak_allocated_bytes == record.peak_reserved_bytes > 0
    assert record.host_bytes > 0 and sum(record.breakdown.values()) == record.peak_allocated_bytes


# -- bench/gpu_check.py's launches ---------------------------------------------------------------------------


def _gpu_check():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_reports_a_rank_that_fails_beside_a_peer_in_a_collective(monkeypatch):
    """Rank 1 fails in its step while rank 0 goes on into the step's all-to-all: the failing rank exits without
    another collective, so the launch ends now with that rank's record, not at the deadline (or never)."""
    import time

    gpu_check = _gpu_check()
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", "crash:1")
    config = dict(load_model_config("tiny-llama"), num_hidden_layers=2)
    rows = gpu_check.configs(2, "cpu", 256, 2)
    rows = [row for row in rows if row["world"] == 2][:1]
    started = time.monotonic()
    [result] = gpu_check.run_real(rows, config, 256, "cpu", 1, "fp32", trial_deadline_s=120)
    elapsed = time.monotonic() - started
    assert result["status"] == "error" and "injected crash on rank 1" in result["error"], result
    assert elapsed < gpu_check.STARTUP_S, f"{elapsed:.0f} s: the launch ran into its deadline"
