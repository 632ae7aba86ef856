"""Margins that hold on the node: what a trainer holds beside the traced tensors (DeepSpeed ZeRO-3's buffers) counts
against capacity wherever a config is predicted for it -- the search for that trainer, an export to it, estimate of
its config -- and a peak within the preset's uncertainty of capacity is marked in ``show`` and the export header."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from autotune.backends.plan import PlanBackend
from autotune.cli import main
from autotune.core.evaluation import Evaluation
from autotune.core.hardware import load_hardware
from autotune.core.trainers import TRAINERS, ZERO3_BUFFER_ELEMENTS
from autotune.search.job import SearchJob
from autotune.search.space import load_space
from trials.models.config import load_model_config, parameter_count
from trials.stack.techniques import Techniques

SHARDED = Techniques(fsdp=True, ulysses_degree=2, activation_checkpointing=True)


def test_zero3_holds_its_buffers_up_to_the_models_parameters_and_fsdp2_nothing():
    llama, tiny = load_model_config("llama3-8b"), load_model_config("tiny-llama")
    deepspeed = TRAINERS["deepspeed"]
    assert deepspeed.held_bytes(SHARDED, llama) == 2 * sum(ZERO3_BUFFER_ELEMENTS.values())  # 8B: every buffer full
    assert deepspeed.held_bytes(SHARDED, tiny) == 2 * 3 * parameter_count(tiny)  # each at most the parameters
    assert deepspeed.held_bytes(replace(SHARDED, fsdp=False), llama) == 0  # no ZeRO-3
    assert TRAINERS["autotune"].held_bytes(SHARDED, llama) == 0
    assert "counted in the predicted peak" in deepspeed.prediction_note(SHARDED, llama)


def test_what_a_trainer_holds_is_in_the_predicted_peak_of_its_searchs_evaluations(tmp_path):
    config = load_model_config("tiny-llama")
    hardware = load_hardware("cpu").with_memory_gib(0.5)
    held = TRAINERS["deepspeed"].held_bytes(SHARDED, config)
    space = load_space(None, config, 2, 2048, trainer=TRAINERS["deepspeed"])
    job = SearchJob("tiny-llama", config, 2048, 2, hardware, space, PlanBackend(stop_above=1.0), tmp_path, 1)
    evaluation = job.evaluation(SHARDED, 2048)
    assert evaluation.hardware.trainer_held_bytes == held > 0
    plain = PlanBackend().evaluate(Evaluation(config, SHARDED, 2048, 2, hardware))
    holding = PlanBackend().evaluate(evaluation)
    assert holding.peak_device_bytes - plain.peak_device_bytes == held  # exactly the buffers, as runtime overhead
    assert holding.breakdown["other"] - plain.breakdown["other"] == held


def _front_folder(tmp_path, peak_gib: float, capacity_gib: float = 1.0):
    techniques = {"fsdp": True, "activation_checkpointing": True, "ulysses_degree": 2}
    record = {"status": "ok", "source": "predicted", "seq_len": 2048, "peak_device_bytes": int(peak_gib * 2**30)}
    front = [{"trial": 3, "seq_len": 2048, "tokens_per_s": 5000.0, "techniques": techniques, "record": record}]
    doc = {"model": "tiny-llama", "hardware": "cpu", "gpus": 2, "target": 2048, "front": front}
    doc["capacity_bytes"] = int(capacity_gib * 2**30)
    (tmp_path / "pareto.json").write_text(json.dumps(doc))
    return tmp_path


@pytest.mark.parametrize("peak_gib, marked", [(0.996, True), (0.5, False)])  # the cpu preset: a 1% band
def test_show_marks_a_peak_within_the_presets_uncertainty_of_capacity(tmp_path, capsys, peak_gib, marked):
    assert main(["show", str(_front_folder(tmp_path, peak_gib))]) == 0
    out = capsys.readouterr().out
    assert (" ! " in out) == marked and ("! within the cpu preset's 1% uncertainty of its 1.00 GiB" in out) == marked


def test_an_export_to_zero3_re_estimates_with_its_buffers_and_marks_a_peak_near_capacity(tmp_path, capsys):
    from autotune.outputs.exporters import make_exporter
    from autotune.outputs.exporters.selection import export

    config, hardware = load_model_config("tiny-llama"), load_hardware("cpu")
    held = TRAINERS["deepspeed"].held_bytes(SHARDED, config)
    done = export(_front_folder(tmp_path, 0.2), None, make_exporter("deepspeed"), False, str(tmp_path / "ds.json"))
    plain = PlanBackend().evaluate(Evaluation(config, done.config.techniques, 2048, 2, hardware))
    assert done.re_estimate.peak_device_bytes - plain.peak_device_bytes == held  # re-estimated with the buffers
    assert any(
        f"holds up to {held / 2**30:.1f} GiB per rank that the search's records leave out" in n for n in done.notes
    )
    assert not any("NEAR CAPACITY" in note for note in done.notes)
    # at a capacity the re-estimate nearly fills, the header says so (the CLI writes it, exit 0)
    near = _front_folder(tmp_path, 0.2, capacity_gib=done.re_estimate.peak_device_bytes / 2**30 / 0.995)
    assert main(["export", str(near), "--format", "deepspeed", "-o", str(tmp_path / "near.json")]) == 0
    capsys.readouterr()
    assert "# NEAR CAPACITY: the peak" in (tmp_path / "near.alst.py").read_text()


def test_what_binds_is_the_memory_nearest_its_capacity_and_the_host_is_per_gpu(monkeypatch):
    """A length's answer names what a longer sequence runs out of: the main job's longest point holds 68 of 79.65
    GiB on the device and 231 of 232.8 GiB of host per GPU -- the host binds, and the table says so."""
    import io

    from autotune.cli import common
    from autotune.cli.common import print_front, print_record

    out = io.StringIO()
    monkeypatch.setattr(common.OUT, "file", out)

    h100 = load_hardware("h100-sxm")
    gib = 2**30
    host_near = {"status": "ok", "seq_len": 7 * 2**20, "peak_device_bytes": 68 * gib, "host_bytes": 231 * gib}
    assert h100.binding_memory(68 * gib, 231 * gib)[0] == "host"
    assert h100.binding_memory(79 * gib, 100 * gib)[0] == "device"
    assert replace(h100, host_memory_bytes_per_device=0).binding_memory(68 * gib, 231 * gib)[0] == "device"
    print_record({**host_near, "step_time_s": 7951.0}, False, "t", h100)
    table = out.getvalue()
    capacity = f"{h100.host_memory_bytes_per_device / gib:.2f}"
    assert f"host memory: {231 * gib / h100.host_memory_bytes_per_device:.0%} of its {capacity} GiB per GPU" in table
    assert f"(231.00 of {capacity} GiB per GPU)" in table and "(68.00 of 79.65 GiB)" in table
    assert "7,951 (2.2 h a step)" in table
    entry = {"trial": 1, "seq_len": host_near["seq_len"], "tokens_per_s": 490.0, "techniques": {}, "record": host_near}
    print_front([{**entry, "record": {**host_near, "source": "predicted"}}], 5 * 2**20, h100)
    assert "host 99%" in out.getvalue()[len(table) :]


def test_the_front_table_marks_the_points_of_best_jsons_config(monkeypatch):
    import io

    from autotune.cli import common
    from autotune.cli.common import print_front

    out = io.StringIO()
    monkeypatch.setattr(common.OUT, "file", out)
    record = {"peak_device_bytes": 2**30, "source": "predicted"}
    front = [
        {"trial": 4, "seq_len": 8192, "tokens_per_s": 900.0, "record": record, "techniques": {"fsdp": True}},
        {"trial": 7, "seq_len": 4096, "tokens_per_s": 1900.0, "record": record, "techniques": {"fsdp": False}},
    ]
    print_front(front, 4096, None, {"trial": 9, "techniques": {"fsdp": False}})
    rows = [line for line in out.getvalue().splitlines() if line.startswith("│")]
    assert "│ 7 =" in rows[1] and "=" not in rows[0].split("│")[1], rows
    assert "= best.json's config" in out.getvalue()
