"""A step's memory timeline (issue 41): the oracle's snapshot peaks at exactly the oracle's peak for a config of
each knob, a CPU trial's at the tracker's measured peak, torch's viewer takes both, every allocation names its op,
module, technique and category, and bad output paths or ranks exit 2 with one line."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import run_cli

from autotune import oracle
from autotune.backends import Evaluation
from autotune.backends.local import LocalBackend
from autotune.core.hardware import load_hardware
from autotune.oracle.timeline import predicted_timeline
from trials.core.memory import DeviceMemoryTracker
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques
from trials.trial import memory_timeline
from trials.trial.memory_timeline import replay_peak, snapshots_in_html

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

K = 1024
FULL_STACK = {
    "fsdp": True,
    "optimizer_offload": True,
    "activation_checkpointing": True,
    "activation_offload_layers": 4,
    "ulysses_degree": 2,
    "head_chunk": 2,
    "mlp_tile_tokens": 512,
    "loss_tile_tokens": 512,
    "norm_tile_tokens": 512,
}
# a config of each knob: (ranks, techniques, hardware preset); flash attention runs where the preset is a GPU's
KNOB_CONFIGS = {
    "plain": (1, {}, "cpu"),
    "fsdp": (2, {"fsdp": True}, "cpu"),
    "optimizer_offload": (2, {"fsdp": True, "optimizer_offload": True}, "cpu"),
    "activation_checkpointing": (1, {"activation_checkpointing": True}, "cpu"),
    "activation_offload_layers": (1, {"activation_checkpointing": True, "activation_offload_layers": 2}, "cpu"),
    "ulysses_degree": (2, {"ulysses_degree": 2}, "cpu"),
    "head_chunk": (2, {"ulysses_degree": 2, "head_chunk": 2}, "cpu"),
    "mlp_tile_tokens": (1, {"mlp_tile_tokens": 512}, "cpu"),
    "loss_tile_tokens": (1, {"loss_tile_tokens": 512}, "cpu"),
    "norm_tile_tokens": (1, {"norm_tile_tokens": 512}, "cpu"),
    "attention": (2, {"attention": "flash", "ulysses_degree": 2}, "h100-sxm"),
    "full stack": (2, FULL_STACK, "h100-sxm"),
}


def _evaluation(techniques: dict, gpus: int, hardware: str = "cpu", layers: int | None = None, seq: int = 2 * K):
    config = dict(load_model_config("tiny-llama"))
    if layers:
        config["num_hidden_layers"] = layers
    return Evaluation(config, Techniques(**techniques), seq, gpus, load_hardware(hardware))


def _allocations(snapshot: dict) -> list[dict]:
    """Each allocation's frames as {kind: value}, with its size."""
    return [
        dict({f["filename"]: f["name"] for f in e["frames"]}, size=e["size"])
        for e in snapshot["device_traces"][0]
        if e["action"] == "alloc"
    ]


@pytest.mark.parametrize("knob", sorted(KNOB_CONFIGS))
def test_the_predicted_snapshot_peaks_at_the_oracles_peak(knob):
    gpus, techniques, hardware = KNOB_CONFIGS[knob]
    evaluation = _evaluation(techniques, gpus, hardware)
    predicted = oracle.predict(evaluation)
    timeline = predicted_timeline(evaluation)
    assert replay_peak(timeline.snapshot) == predicted.tensor_peak_bytes == timeline.tensor_peak_bytes
    assert timeline.layers == timeline.model_layers == 4 and "all 4 layers" in timeline.title


def test_the_prediction_records_its_timeline_in_its_own_trace():
    """``predict(..., timeline=recorder)`` records the first trace: the same snapshot as a trace of its own."""
    evaluation = _evaluation(FULL_STACK, 2, "h100-sxm")
    recorder = memory_timeline.TimelineRecorder()
    predicted = oracle.predict(evaluation, timeline=recorder)
    assert replay_peak(recorder.snapshot()) == predicted.tensor_peak_bytes


def test_a_reduced_depth_timeline_shows_the_traced_copy_and_says_how_deep_the_step_is():
    evaluation = _evaluation({"activation_checkpointing": True}, 1, layers=7)
    predicted = oracle.predict(evaluation)
    timeline = predicted_timeline(evaluation)
    assert timeline.layers == 3 and timeline.model_layers == 7
    assert replay_peak(timeline.snapshot) == predicted.traces[0].peak_device_bytes == timeline.tensor_peak_bytes
    assert "the 3-layer traced copy; the step extends to 7 identical layers" in timeline.title
    modules = {a["module"] for a in _allocations(timeline.snapshot)}
    assert any("layers.2" in m for m in modules) and not any("layers.3" in m for m in modules)


def test_another_rank_is_traced_as_that_rank():
    """Rank 1 of a Ulysses pair holds the second half of the sequence: same shapes, its own trace."""
    evaluation = _evaluation({"ulysses_degree": 2}, 2)
    one = predicted_timeline(evaluation, rank=1)
    assert one.rank == 1 and "rank 1 of 2" in one.title
    assert replay_peak(one.snapshot) == one.tensor_peak_bytes > 0


def test_every_allocation_names_its_op_module_technique_and_category():
    timeline = predicted_timeline(_evaluation(FULL_STACK, 2, "h100-sxm"))
    allocations = _allocations(timeline.snapshot)
    assert all({"op", "module", "technique", "category", "where"} <= set(a) for a in allocations)
    techniques = {a["technique"] for a in allocations}
    for label in (
        "UPipe head chunk (head_chunk): all-to-all buffer",
        "MLP tile (mlp_tile_tokens)",
        "loss tile (loss_tile_tokens)",
        "RMSNorm tile (norm_tile_tokens)",
        "activation offload copy (activation_offload_layers)",
        "FSDP (fsdp): all-gather buffer",
        "FSDP (fsdp): reduce-scatter buffer",
        "FSDP (fsdp): unsharded parameters",
        "checkpoint recompute (activation_checkpointing)",
    ):
        assert label in techniques, (label, sorted(techniques))
    categories = {a["category"] for a in allocations}
    assert {"params", "activations", "temporaries"} <= categories
    modules = {a["module"] for a in allocations}
    assert any(m.endswith(".mlp") for m in modules) and any(m.endswith("(backward)") for m in modules)
    # the optimizer's states live on the host with optimizer offload: none of them is on the device trace
    assert "optimizer" not in categories
    # colours by category, and the "unknown" category the viewer needs to load (see trials.trial.memory_timeline)
    events = timeline.snapshot["device_traces"][0]
    assert events[-1]["action"] == "snapshot" and events[-1]["category"] == "unknown"


def test_ulysses_buffers_are_named():
    timeline = predicted_timeline(_evaluation({"ulysses_degree": 2}, 2))
    assert "Ulysses (ulysses_degree): all-to-all buffer" in {a["technique"] for a in _allocations(timeline.snapshot)}


def test_optimizer_states_on_the_device_are_the_optimizer_step():
    timeline = predicted_timeline(_evaluation({"fsdp": True}, 2))
    states = [a for a in _allocations(timeline.snapshot) if a["category"] == "optimizer"]
    assert states and {a["technique"] for a in states} == {"optimizer step"}


def test_a_cpu_trials_snapshot_peaks_at_the_trackers_measured_peak():
    backend = LocalBackend(steps=1, warmup=1, timeline_rank=0)
    evaluation = _evaluation({"activation_checkpointing": True, "activation_offload_layers": 2}, 1)
    record = backend.evaluate(evaluation)
    assert record.status == "ok", record.error
    measured = backend.last_timeline
    assert measured is not None
    assert replay_peak(measured) == record.peak_allocated_bytes
    assert any(a["module"].startswith("lm.model.layers.1") for a in _allocations(measured))


def test_torchs_viewer_takes_both_snapshots(tmp_path):
    """``trace_plot`` (the HTML) and ``_memory_viz.trace`` (torch's text rendering, which reads every event and
    segment) accept the snapshots; the page embeds exactly the snapshot."""
    from torch.cuda import _memory_viz

    timeline = predicted_timeline(_evaluation({"activation_checkpointing": True}, 1))
    page = memory_timeline.html(timeline.snapshot, timeline.title)
    assert "Active Memory Timeline" in page and f"<title>{timeline.title}</title>" in page
    assert snapshots_in_html(page) == [timeline.snapshot]
    text = _memory_viz.trace(timeline.snapshot)
    assert "TOTAL MEM" in text
    path = tmp_path / "t.pickle"
    memory_timeline.write_pickle(timeline.snapshot, path)
    with open(path, "rb") as f:
        assert pickle.load(f) == timeline.snapshot
    both = memory_timeline.side_by_side_html([("measured", page), ("predicted", page)])
    assert snapshots_in_html(both) == [timeline.snapshot, timeline.snapshot]


def test_the_page_loads_the_viewer_of_the_installed_torch():
    """torch's page loads its viewer from pytorch's main branch, which changes under a saved page; ours is pinned to
    the installed torch's release tag (its commit for a build without one)."""
    import re

    page = memory_timeline.html(predicted_timeline(_evaluation({}, 1)).snapshot)
    base = torch.__version__.split("+")[0]
    ref = f"v{base}" if re.fullmatch(r"\d+\.\d+\.\d+", base) else torch.version.git_version
    assert f"https://cdn.jsdelivr.net/gh/pytorch/pytorch@{ref}/torch/utils/viz/MemoryViz.js" in page
    assert "@main/" not in page


def test_a_storage_moved_to_the_host_leaves_the_device_trace():
    """An offload (``mark_host``) frees the device block; a storage made on the host never enters the trace."""
    tracker = DeviceMemoryTracker()
    recorder = memory_timeline.TimelineRecorder()
    tracker.add_listener(recorder)
    with tracker:
        offloaded = torch.ones(1024)  # 4 KiB on the device, then moved
        tracker.mark_host(offloaded)
        with tracker.on_host():
            host = torch.ones(4096)  # 16 KiB on the host
        kept = torch.ones(2048)  # 8 KiB
    assert replay_peak(recorder.snapshot()) == tracker.peak_device_bytes == 8192
    assert offloaded.numel() + host.numel() + kept.numel() == 7168


def test_replay_counts_blocks_allocated_before_the_trace():
    """A CUDA snapshot's history starts mid-run: blocks live before it count from the start."""
    snapshot = {
        "segments": [
            {
                "device": 0,
                "address": 0,
                "total_size": 3072,
                "blocks": [
                    {"size": 1024, "requested_size": 1000, "state": "active_allocated"},
                    {"size": 1024, "requested_size": 1024, "state": "active_allocated"},
                    {"size": 1024, "requested_size": 0, "state": "inactive"},
                ],
            }
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": 1024, "size": 1024},
                {"action": "free_requested", "addr": 1024, "size": 1024},
                {"action": "free_completed", "addr": 1024, "size": 1024},
                {"action": "alloc", "addr": 1024, "size": 1024},
                {"action": "free_completed", "addr": 5000, "size": 512},  # allocated before, freed in the trace
            ]
        ],
    }
    assert replay_peak(snapshot) == 1000 + 512 + 1024


@pytest.mark.any_release
@pytest.mark.parametrize(
    "args, says",
    [
        (["--memory-timeline", "{dir}"], "is a directory"),
        (["--memory-timeline", "/proc/autotune-timeline.html"], "cannot write there"),
        (["--memory-snapshot", "/dev/null/t.pickle"], "cannot write there"),  # under a file
        (["--rank", "2", "--memory-timeline", "{dir}/t.html"], "--rank 2: the job has 2 ranks"),
        (["--rank", "-1", "--memory-timeline", "{dir}/t.html"], "Invalid value for '--rank': must be at least 0"),
    ],
)
@pytest.mark.parametrize("command", ["estimate", "trial"])
def test_bad_timeline_input_exits_2_with_one_line(tmp_path, command, args, says, capsys):
    # in-process (the CLI's own entry point, which the process's exit code is): bad input stops before any trial
    from autotune.cli import main

    args = [a.replace("{dir}", str(tmp_path)) for a in args]
    code = main([command, "--model", "tiny-llama", "--config", "baseline", "--gpus", "2", "--seq", "2K", *args])
    stderr = capsys.readouterr().err
    assert code == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], stderr
    assert not (tmp_path / "t.html").exists()


def test_estimate_and_trial_write_the_timelines(tmp_path, capsys):
    import json

    from autotune.cli import main

    html, snapshot = tmp_path / "new" / "t.html", tmp_path / "t.pickle"  # a missing folder is made, as export -o does
    # the estimate in-process (the CLI's own entry point); the trial below runs as a user starts it
    code = main([
        "estimate", "--model", "tiny-llama", "--config", "baseline", "--gpus", "2", "--hardware", "cpu",
        "--seq", "2K", "--memory-timeline", str(html), "--memory-snapshot", str(snapshot), "--json",
    ])  # fmt: skip
    said = capsys.readouterr()
    assert code == 0, said.err[-2000:]
    record = json.loads(said.out)
    (embedded,) = snapshots_in_html(html.read_text())
    with open(snapshot, "rb") as f:
        assert pickle.load(f) == embedded
    assert replay_peak(embedded) == record["peak_allocated_bytes"]
    assert "predicted memory timeline: tiny-llama" in said.err

    html, snapshot = tmp_path / "m.html", tmp_path / "m.pickle"
    done = run_cli(
        "trial", "--model", "tiny-llama", "--config", "baseline", "--gpus", "1", "--seq", "1K", "--steps", "1",
        "--memory-timeline", str(html), "--memory-snapshot", str(snapshot), "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(done.stdout)
    measured, predicted = snapshots_in_html(html.read_text())
    assert replay_peak(measured) == record["peak_allocated_bytes"]
    with open(tmp_path / "m-predicted.pickle", "rb") as f:
        assert pickle.load(f) == predicted
    page = html.read_text()
    assert "measured memory timeline" in page and "predicted memory timeline" in page


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_trials_snapshot_is_the_allocators_history():
    backend = LocalBackend(steps=1, warmup=1, timeline_rank=0)
    record = backend.evaluate(_evaluation({"activation_checkpointing": True}, 1, "h100-sxm"))
    assert record.status == "ok", record.error
    measured = backend.last_timeline
    assert any(trace for trace in measured["device_traces"])
    assert (
        0
        < replay_peak(measured, next(i for i, t in enumerate(measured["device_traces"]) if t))
        <= (record.peak_allocated_bytes)
    )
