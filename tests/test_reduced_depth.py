"""Reduced-depth real trials (issue 16): the copies a reduced trial runs, and its extended record against the full
trial's on CPU (the tracker's bytes are exact, so the extended peak equals the full peak to the byte)."""

from __future__ import annotations

import pytest

from autotune.backends import Evaluation
from autotune.backends.local import LocalBackend, extend_step_time
from autotune.core.hardware import load_hardware
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too


def _evaluation(layers: int, seq: int = 512, gpus: int = 1, **knobs) -> Evaluation:
    config = dict(load_model_config("tiny-llama"), num_hidden_layers=layers)
    return Evaluation(config, Techniques.from_dict(knobs, layers), seq, gpus, load_hardware("cpu"))


def test_a_reduced_trial_runs_the_oracles_copies():
    reduced = LocalBackend(depth="reduced")
    assert reduced.copies(_evaluation(4))[1] == []  # shallow models run whole
    assert LocalBackend().copies(_evaluation(16))[1] == []  # depth full
    runs, copies = reduced.copies(_evaluation(16, activation_checkpointing=True))
    assert runs == [("layers", 16)] and [c["runs"] for c in copies] == [[["layers", 3]], [["layers", 4]]]
    runs, copies = reduced.copies(_evaluation(16, activation_checkpointing=True, activation_offload_layers=6))
    # a partial offload: an offloaded run and a device run, each cut to 3 and varied to 4
    assert [c["runs"] for c in copies] == [
        [["offload", 3], ["device", 3]],
        [["offload", 4], ["device", 3]],
        [["offload", 3], ["device", 4]],
    ]
    assert [c["techniques"]["activation_offload_layers"] for c in copies] == [3, 4, 3]


def test_only_the_deepest_copy_is_timed():
    _, copies = LocalBackend(depth="reduced").copies(_evaluation(16, activation_offload_layers=6))
    assert [c["timed"] for c in copies] == [False, False, True]


def test_the_step_time_extends_by_middle_layers_and_the_tail_by_parameters():
    # a 4-layer copy: layers 0.1 (first), 0.2, 0.3 (middle), 0.9 (last); tail 0.5 for 1,000 parameters
    timed = {"step_time_s": 3.0, "layer_times_s": [0.1, 0.2, 0.3, 0.9], "tail_time_s": 0.5, "parameters": 1000}
    # 10 layers: 6 more middle layers at their mean 0.25; 2,500 parameters: the tail 1.5x longer
    assert extend_step_time(timed, [("layers", 4)], [("layers", 10)], 2500) == pytest.approx(3.0 + 6 * 0.25 + 0.75)
    # two runs: only the run longer than the copy's extends, by its own middle layer
    timed = dict(timed, layer_times_s=[0.1, 0.2, 0.3, 1.0, 2.0, 3.0])
    assert extend_step_time(
        timed, [("offload", 3), ("device", 3)], [("offload", 3), ("device", 8)], 1000
    ) == pytest.approx(3.0 + 5 * 2.0)


def test_the_layer_clock_splits_a_real_step():
    import torch

    from trials.core.dist import Mesh
    from trials.core.memory import DeviceMemoryTracker
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import build_training, train_step
    from trials.trial.layer_clock import LayerClock

    config = dict(load_model_config("tiny-llama"), num_hidden_layers=3)
    mesh = Mesh.single(torch.device("cpu"))
    tracker = DeviceMemoryTracker()
    with tracker:
        model, optimizer = build_training(
            config, Techniques.from_dict({"activation_checkpointing": True}, 3), mesh, 0, tracker
        )
        clock = LayerClock(model, tracker, mesh.device)
        batch = make_batch(synthetic_sample(0, 256, model.config.vocab_size, 0), 0, 1, mesh.device)
        clock.start_step()
        train_step(model, optimizer, batch, mesh, tracker)
        split = clock.finish_step()
    assert len(split.layer_s) == 3 and all(t > 0 for t in split.layer_s) and split.tail_s > 0
    assert sum(split.layer_s) + split.tail_s < split.step_s  # the head (embedding, loss) is the rest
    with pytest.raises(RuntimeError, match="no mark"):  # a step the clock did not see is not split
        clock.start_step()
        clock.finish_step()


@pytest.mark.slow
@pytest.mark.alone
def test_reduced_trial_equals_the_full_trial_on_cpu():
    evaluation = _evaluation(
        8, seq=1024, activation_checkpointing=True, activation_offload_layers=5, loss_tile_tokens=256
    )
    reduced = LocalBackend(depth="reduced", timeout_s=600).evaluate(evaluation)
    full = LocalBackend(timeout_s=600).evaluate(evaluation)
    assert reduced.status == full.status == "ok", (reduced.error, full.error)
    assert reduced.measured_layers == 7 and full.measured_layers is None  # offload 3+1, device 3 (+1 in a copy)
    assert reduced.peak_device_bytes == full.peak_device_bytes
    assert reduced.host_bytes == full.host_bytes and reduced.breakdown == full.breakdown
    # timing: within 2x -- the test runs alone (marked), but the host's speed drifts between the two trials;
    # bench/reduced_depth.py measures it side by side (+-10%). An extension that prices the missing layers 3x off
    # lands outside.
    assert 0.5 < reduced.tokens_per_s / full.tokens_per_s < 2.0, (reduced.tokens_per_s, full.tokens_per_s)


@pytest.mark.slow
def test_a_reduced_trial_past_its_capacity_is_oom_not_timeout():
    # the 3/4-layer copies fit in the capacity, the extended 32-layer model does not: oom from the extension
    evaluation = _evaluation(32, seq=1024, activation_checkpointing=True)
    fits = LocalBackend(depth="reduced", timeout_s=600).evaluate(evaluation)
    assert fits.status == "ok", fits.error
    capacity_gib = (fits.peak_device_bytes - 1) / 2**30
    record = LocalBackend(depth="reduced", timeout_s=600, memory_gib=capacity_gib).evaluate(evaluation)
    assert record.status == "oom" and "extended" in record.error, record


@pytest.mark.slow
def test_a_local_search_runs_long_lengths_reduced_within_a_deadline_full_depth_would_miss(tmp_path):
    import json
    import math

    import pyarrow.parquet as pq
    from conftest import run_cli

    from autotune.backends import make_backend

    # deep enough that the cpu preset (the rates the search's plan backend uses on this machine) predicts the
    # full-depth trial at the longest length (warm-up + 2 steps) at twice the deadline: the depth follows from the
    # predicted step time, which is affine in the depth
    deadline_s, longest = 100, 4096

    def full_depth_s(layers: int) -> float:
        evaluation = _evaluation(layers, seq=longest, activation_checkpointing=True)
        return 3 * make_backend("plan").evaluate(evaluation).step_time_s

    at_8, at_16 = full_depth_s(8), full_depth_s(16)
    layers = 16 + math.ceil((2 * deadline_s - at_16) / ((at_16 - at_8) / 8))
    predicted_s = full_depth_s(layers)
    assert predicted_s >= 2 * deadline_s, (layers, predicted_s)
    model = tmp_path / f"tiny-llama-{layers}.json"
    model.write_text(json.dumps(dict(load_model_config("tiny-llama"), num_hidden_layers=layers)))
    space = tmp_path / "space.yaml"
    space.write_text(
        "schema: autotune/space-v1\nseq_len: {min_fraction: 0.5, max_fraction: 1.0, "
        "points_per_doubling: 1, multiple_of: 1024}\nknobs:\n  fsdp: [false]\n  ulysses_degree: [1]\n"
        "  activation_checkpointing: [true]\n  activation_offload_layers: [0]\n  mlp_tile_tokens: [0]\n"
        "  loss_tile_tokens: [0]\n  attention: [sdpa]\n"
    )
    out = tmp_path / "out"
    result = run_cli(
        "search",
        "--model",
        str(model),
        "--target",
        "4K",
        "--gpus",
        "1",
        "--backend",
        "local",
        "--hardware",
        "cpu",
        "--space",
        str(space),
        "--trials",
        "2",
        "--no-prefilter",
        "--depth",
        "reduced",
        "--trial-timeout",
        str(deadline_s),
        "--out",
        str(out),
        timeout=900,
    )
    assert (out / "trials.parquet").is_file(), result.stderr[-3000:]
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    local = [r for r in rows if r["answered_by"] == "local"]
    assert {r["seq_len"] for r in local} == {2048, 4096}, [(r["seq_len"], r["status"]) for r in rows]
    assert all(r["status"] in ("ok", "oom") and r["reduced_layers"] == 4 for r in local), [
        (r["seq_len"], r["status"], r["error"]) for r in local
    ] + [result.stderr[-2000:]]
