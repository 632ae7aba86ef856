"""Attention kernels priced per kernel (issue 39): each GPU preset lists the kernels its device runs (FlashAttention-2
and -3 on Hopper, FlashAttention-4 on Blackwell, SDPA), each with its own efficiencies, tiles and source; the time
model prices a config at its kernel's rates; a search weighs the kernels of its hardware; an export names each
kernel as its trainer knows it, or says where the trainer runs another one."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import yaml
from conftest import ROOT

from autotune.core.errors import UserError
from autotune.core.hardware import hardware_names, is_shipped, load_hardware, shipped_dir
from autotune.core.trainers import TRAINERS, ExportJob
from autotune.search.request import search_kernels
from autotune.search.space import load_space
from autotune.timing.counts import StepCounts, attention_key
from autotune.timing.model import attention_time, predict_step_time
from trials.kernels.registry import KERNEL_NAMES, KERNELS
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques, knobs
from trials.training.config_file import TrialConfig

M = 1 << 20


@pytest.fixture
def every_kernel(monkeypatch):
    """The ``attention`` knob taking every kernel ``trials.kernels.registry`` declares (nothing to do once the knob's choices
    derive from the declarations)."""
    import autotune.search.space as space
    import trials.stack.rules

    if set(KERNEL_NAMES) <= set(trials.stack.rules.ATTENTION_KERNELS):
        return
    table = tuple(replace(k, choices=KERNEL_NAMES) if k.name == "attention" else k for k in knobs())
    monkeypatch.setattr(trials.stack.rules, "ATTENTION_KERNELS", KERNEL_NAMES)
    monkeypatch.setattr(Techniques, "_knob_table", table)
    monkeypatch.setitem(space._TABLE, "attention", next(k for k in table if k.name == "attention"))


# -- the presets ----------------------------------------------------------------------------------------------


def test_every_gpu_preset_lists_the_kernels_its_device_runs_each_with_its_rates_and_source():
    gpu_presets = [n for n in hardware_names() if is_shipped(n) and not load_hardware(n).device_is_host]
    assert {"a100-80g", "h100-sxm", "h200", "b200"} <= set(gpu_presets)
    for name in gpu_presets:
        hw = load_hardware(name)
        assert hw.compute_capability and hw.rates.attention_kernels, name
        for kernel in hw.rates.attention_kernels:
            assert KERNELS[kernel.name].runs_on(hw.compute_capability), (name, kernel.name)
            assert 0 < kernel.backward_efficiency <= kernel.forward_efficiency < 1, (name, kernel)
            assert kernel.tile_q > 0 and kernel.tile_kv > 0 and kernel.assumed, (name, kernel)
            assert "arXiv" in kernel.source or "pytorch#" in kernel.source, (name, kernel.source)
        # each figure with its source in a comment, as every other figure of a preset
        text = (shipped_dir() / f"{name}.yaml").read_text().splitlines()
        figures = [line for line in text if line.strip().startswith(("forward_efficiency", "backward_efficiency"))]
        assert figures and all("#" in line for line in figures), name
    assert load_hardware("h100-sxm").kernels == load_hardware("h200").kernels == ("flash", "flash3", "sdpa")
    assert load_hardware("a100-80g").kernels == ("flash", "sdpa")
    assert load_hardware("cpu").kernels == ("sdpa",)


def test_every_figure_of_a_gpu_preset_says_where_it_comes_from():
    """Each top-level figure of a shipped GPU preset carries a comment: its published measurement or datasheet, or
    that it is assumed (and why); a figure added bare is refused."""
    for name in [n for n in hardware_names() if is_shipped(n) and not load_hardware(n).device_is_host]:
        text = (shipped_dir() / f"{name}.yaml").read_text()
        figures = [line for line in text.splitlines() if line[:1].isalpha() and not line.endswith(":")]
        bare = [line for line in figures if "#" not in line and not line.startswith(("name:", "description:"))]
        assert figures and not bare, (name, bare)


def test_b200_carries_its_own_figures_and_runs_flash4_not_fa2_or_fa3():
    b200 = load_hardware("b200")
    assert b200.kernels == ("flash4", "sdpa") and b200.compute_capability == 10
    assert b200.device_memory_bytes == 183_359 * 2**20  # what the card reports, not the 192 GB of its HBM stacks
    assert b200.bf16_flops == 2.25e15 and b200.rates.intra_node_bytes_per_s == 900e9
    assert b200.gpus_per_node == 8 and b200.host_memory_bytes_per_device == 250e9
    assert b200.rates.inter_node_bytes_per_s == 50e9  # one 400 Gb/s ConnectX-7 per GPU
    flash4 = b200.rates.for_kernel("flash4", None)
    assert (flash4.attention_tile_q, flash4.attention_tile_kv) == (256, 128)  # two 128-row query tiles per CTA
    assert flash4.attention_efficiency > b200.rates.for_kernel("sdpa", None).attention_efficiency
    listed = subprocess.run(
        [sys.executable, "-m", "autotune.cli", "hardware"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "COLUMNS": "250", "PATH": "/usr/bin:/bin"},
        timeout=300,
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "b200" in listed.stdout and "flash4 0.67/0.58" in listed.stdout
    assert "b200 flash4 (assumed): FlashAttention-4 paper (arXiv 2603.05451)" in listed.stdout


def _preset(tmp_path, name: str, edit) -> str:
    data = yaml.safe_load((shipped_dir() / f"{name}.yaml").read_text())
    edit(data)
    path = tmp_path / f"edited-{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_a_preset_listing_a_kernel_its_gpu_cannot_run_or_an_unknown_one_is_refused(tmp_path):
    fa3 = load_hardware("h100-sxm").rates.kernel("flash3")
    fa3_entry = {"forward_efficiency": fa3.forward_efficiency, "backward_efficiency": fa3.backward_efficiency}
    with pytest.raises(UserError, match="'flash3' does not run on compute capability 10"):
        load_hardware(_preset(tmp_path, "b200", lambda d: d["attention_kernels"].update(flash3=fa3_entry)))
    with pytest.raises(UserError, match="'flash' does not run on a host device"):
        load_hardware(_preset(tmp_path, "cpu", lambda d: d.update(attention_kernels=["sdpa", "flash"])))
    with pytest.raises(UserError, match="'flash5' is not one of"):
        load_hardware(_preset(tmp_path, "h100-sxm", lambda d: d["attention_kernels"].update(flash5=fa3_entry)))


def test_a_preset_without_a_kernel_list_still_loads_and_prices_every_kernel_at_its_one_rate(tmp_path):
    def old_format(data):  # a preset written before per-kernel rates (a calibrated one, say)
        data.pop("attention_kernels")
        data.pop("compute_capability")
        data.update(attention_efficiency=0.4, attention_backward_efficiency=0.3, attention_tile_q=64)

    old = load_hardware(_preset(tmp_path, "h100-sxm", old_format))
    assert old.kernels == ("flash", "sdpa")
    for kernel in KERNEL_NAMES:
        r = old.rates.for_kernel(kernel, None)
        assert (r.attention_efficiency, r.attention_backward_efficiency, r.attention_tile_q) == (0.4, 0.3, 64), kernel


def test_calibrate_times_each_flash_kernel_the_node_runs_and_stores_it_per_kernel(tmp_path, monkeypatch):
    """A device calibration on a Hopper node with FA2 and FA3 installed: each kernel timed becomes measured in the
    written preset, at its own efficiencies and tiles; a kernel not timed keeps the base's assumed figures."""
    import torch

    from autotune.timing.calibration import preset as preset_mod
    from autotune.timing.calibration.device_bench import flash_kernels_here

    base = load_hardware("h100-sxm")
    peak = base.bf16_flops

    def points(forward, backward):
        rates = {"fwd_flops_per_s": forward * peak, "bwd_flops_per_s": backward * peak, "spread": 0.0}
        return [{"seq": 65536, "heads": heads, **rates} for heads in (1, 16)]

    measured = {
        "device": "NVIDIA H100 80GB HBM3",
        "world_size": 1,
        "gemm": {"flops_per_s": 0.7 * peak, "spread": 0.0},
        "attention": {"flash": points(0.35, 0.3), "flash3": points(0.6, 0.5)},
        "elementwise": {"bytes_per_s": 2e12, "spread": 0.0},
        "host_copies": {"h2d_bytes_per_s": 5e10, "d2h_bytes_per_s": 5e10, "spread": 0.0},
        "host_optimizer": {"bytes_per_s": 1e10, "spread": 0.0},
    }
    monkeypatch.setattr(preset_mod, "measure_device", lambda *args, **kwargs: measured)
    data = preset_mod.calibrate_preset("h100-sxm", "my-h100", 1, load_model_config("tiny-llama"), "tiny-llama")
    written = load_hardware(str(preset_mod.write_preset(data, tmp_path / "my-h100.yaml")))
    assert written.kernels == ("flash", "flash3", "sdpa")
    fa2, fa3, sdpa = (written.rates.kernel(k) for k in written.kernels)
    assert (fa3.forward_efficiency, fa3.backward_efficiency, fa3.assumed) == (0.6, 0.5, False)
    assert (fa3.tile_q, fa3.tile_kv) == (128, 128) and "measured by autotune calibrate" in fa3.source
    assert (fa2.forward_efficiency, fa2.assumed) == (0.35, False)
    assert sdpa == base.rates.kernel("sdpa")  # not timed: the base's figures, still assumed
    assert written.rates.for_kernel("flash3", None).attention_efficiency == 0.6
    assert flash_kernels_here(torch.device("cpu")) == []  # no flash-attn kernel times CPU tensors


# -- the time model -------------------------------------------------------------------------------------------


def _one_layer_at(seq: int, heads: int = 4, head_dim: int = 128) -> StepCounts:
    """One rank's causal attention calls at ``seq`` tokens (Llama-3-8B under Ulysses 8: 4 query heads of 128)."""
    counts = StepCounts(seq_len=seq)
    for phase, backward in (("forward", False), ("backward", True)):
        counts.attention_calls[attention_key(phase, backward, seq, seq, head_dim, head_dim, True, None)] = heads
    return counts


def test_fa3_attention_at_1m_tokens_on_h100_takes_fa2s_time_times_their_efficiency_ratio():
    rates = load_hardware("h100-sxm").rates
    counts = _one_layer_at(M)
    fa2, fa3 = rates.for_kernel("flash", None), rates.for_kernel("flash3", None)
    assert (fa2.attention_tile_q, fa2.attention_tile_kv) == (fa3.attention_tile_q, fa3.attention_tile_kv)
    for phase, figure in (("forward", "forward_efficiency"), ("backward", "backward_efficiency")):
        fa2_s, fa3_s = attention_time(counts, (phase,), fa2), attention_time(counts, (phase,), fa3)
        ratio = getattr(rates.kernel("flash"), figure) / getattr(rates.kernel("flash3"), figure)  # the preset's
        assert fa3_s == pytest.approx(fa2_s * ratio, rel=1e-12)
        assert fa3_s < 0.6 * fa2_s  # FA3 runs 1.7-1.8x FA2's rate on H100 (the FA3 paper)
    # the step the time model predicts takes exactly that attention time less
    steps = {
        kernel: predict_step_time(counts, rates, 8, Techniques(attention=kernel, ulysses_degree=8)).step_time_s
        for kernel in ("flash", "flash3", "sdpa")
    }
    saved = attention_time(counts, ("forward", "backward"), fa2) - attention_time(counts, ("forward", "backward"), fa3)
    assert steps["flash"] - steps["flash3"] == pytest.approx(saved, rel=1e-9)
    # SDPA runs cuDNN's attention on Hopper: priced between FA2 and FA3, by the same difference of attention times
    cudnn = rates.for_kernel("sdpa", None)
    saved = attention_time(counts, ("forward", "backward"), fa2) - attention_time(
        counts, ("forward", "backward"), cudnn
    )
    assert steps["flash"] - steps["sdpa"] == pytest.approx(saved, rel=1e-9)
    assert steps["flash3"] < steps["sdpa"] < 0.7 * steps["flash"]  # cuDNN 1.6x FA2's rate, below FA3's (FA3 paper)


def test_an_estimate_prices_flash3_on_h100_and_flash4_on_b200(every_kernel, tmp_path, capsys):
    """``autotune estimate --model llama3-8b --seq 5M --gpus 8 --hardware H --config C`` (in process, the knob taking
    every kernel): the full stack with each GPU's own kernel, against the one it replaces."""
    import json

    from autotune.cli import main

    stack = dict(
        fsdp=True,
        optimizer_offload=True,
        ulysses_degree=8,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers="all",
        mlp_tile_tokens=64 * 1024,
        loss_tile_tokens=8 * 1024,
        norm_tile_tokens=64 * 1024,
    )
    rate = {}
    for hardware, kernel in (("h100-sxm", "flash"), ("h100-sxm", "flash3"), ("b200", "flash4"), ("b200", "sdpa")):
        config = tmp_path / f"{kernel}.json"
        doc = {"schema": "autotune/config-v1", "model": "llama3-8b", "hardware": hardware, "gpus": 8}
        config.write_text(json.dumps({**doc, "techniques": {**stack, "attention": kernel}}))
        argv = ["estimate", "--model", "llama3-8b", "--seq", "5M", "--gpus", "8", "--hardware", hardware]
        assert main([*argv, "--config", str(config), "--json"]) == 0, capsys.readouterr().err
        record = json.loads(capsys.readouterr().out)
        assert record["status"] == "ok" and record["peak_device_bytes"] < load_hardware(hardware).device_memory_bytes
        rate[kernel] = record["tokens_per_s"]
    assert rate["flash3"] > 1.5 * rate["flash"]  # attention is most of a 5M-token step
    assert rate["flash4"] > 1.2 * rate["sdpa"] and rate["flash4"] > 2 * rate["flash3"]


# -- the search -----------------------------------------------------------------------------------------------


def test_a_search_weighs_the_kernels_of_its_hardware(every_kernel, tmp_path):
    llama = load_model_config("llama3-8b")

    def attention(backend: str, hardware: str) -> list[str]:
        kernels = search_kernels(backend, load_hardware(hardware))
        return load_space(None, llama, 8, 5 * M, kernels=kernels, on_gpu=hardware != "cpu").choices["attention"]

    assert attention("plan", "h100-sxm") == ["flash", "flash3", "sdpa"]  # FA2 against FA3
    assert attention("plan", "b200") == ["flash4", "sdpa"]
    assert attention("plan", "cpu") == ["sdpa"]
    assert attention("local", "cpu") == ["sdpa"]  # CPU trials: what this node runs
    # a space naming kernels keeps those the hardware runs
    named = tmp_path / "named.yaml"
    named.write_text("knobs:\n  attention: [flash, flash3, sdpa]\n")
    b200 = load_hardware("b200").kernels
    assert load_space(named, llama, 8, 5 * M, kernels=b200).choices["attention"] == ["sdpa"]
    assert load_space(named, llama, 8, 5 * M, kernels=["sdpa"]).choices["attention"] == ["sdpa"]  # CPU trials


def test_a_config_label_names_its_kernel():
    """``autotune show`` and the front's plots label configs by their knobs: FA2 and FA3 must not look alike."""
    from autotune.outputs.plots import knob_label

    assert knob_label(Techniques(attention="flash3", fsdp=True).to_dict()) == "fsdp flash3"
    assert knob_label(Techniques(attention="flash").to_dict()) == "flash"
    assert knob_label(Techniques().to_dict()) == "baseline"  # sdpa, the default


# -- the exports ----------------------------------------------------------------------------------------------


def _job(attention: str, degree: int) -> ExportJob:
    techniques = Techniques(attention=attention, ulysses_degree=degree, fsdp=True, activation_checkpointing=True)
    return ExportJob("llama3-8b", load_model_config("llama3-8b"), 8, M, techniques)


def _attention_gaps(trainer, job: ExportJob) -> list:
    return [gap for gap in trainer.gaps(job) if gap.knob.name == "attention"]


def _export(fmt: str, attention: str, degree: int) -> str:
    from autotune.outputs.exporters import make_exporter

    exporter, job = make_exporter(fmt), _job(attention, degree)
    config = TrialConfig(model="llama3-8b", techniques=exporter.trainer_techniques(job), gpus=8, seq_len=M)
    rendered = exporter.render(config, [], f"out.{fmt}")
    return rendered.text + "".join(rendered.companions.values())


def test_each_trainer_names_each_kernel_by_its_transformers_name():
    from autotune.outputs.exporters.base import hf_attention

    names = {k: hf_attention(Techniques(attention=k)) for k in KERNEL_NAMES}
    assert names == {
        "sdpa": "sdpa",
        "flash": "flash_attention_2",
        "flash3": "flash_attention_3",
        "flash4": "flash_attention_4",
    }
    assert "ATTENTION = 'flash_attention_3'" in _export("deepspeed", "flash3", 8)
    assert "ATTENTION = 'flash_attention_4'" in _export("deepspeed", "flash4", 8)  # any transformers attention
    assert "attn_implementation: flash_attention_3" in _export("arctic", "flash3", 8)
    assert "attn_implementation: flash_attention_4" in _export("arctic", "flash4", 8)
    accelerate = _export("accelerate-deepspeed", "flash3", 8)
    assert "parallelism_config_sp_attn_implementation: flash_attention_3" in accelerate
    assert "attn_implementation='flash_attention_3'" in accelerate
    for trainer in TRAINERS.values():  # every trainer runs FA2 and FA3 as asked, with or without Ulysses
        for kernel in ("flash", "flash3"):
            assert not _attention_gaps(trainer, _job(kernel, 8)), (trainer.name, kernel)


def test_accelerates_sequence_parallelism_runs_fa2_for_flash4_and_the_export_says_so():
    """Accelerate's own ``DeepSpeedSequenceParallelConfig`` judges: it takes flash_attention_3, refuses
    flash_attention_4; under its sequence parallelism FA2 stands in (flash-attn 2 builds for every generation FA4
    runs on, ``trials.kernels.registry``); without sequence parallelism the model's own attn_implementation runs FA4."""
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="flash_attention_3")
    with pytest.raises(ValueError, match="flash_attention_4"):
        DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="flash_attention_4")
    trainer = TRAINERS["accelerate-deepspeed"]
    [gap] = _attention_gaps(trainer, _job("flash4", 8))
    assert (gap.asked, gap.runs) == ("flash4", "flash")
    assert "not flash_attention_4" in gap.line(trainer.name)
    exported = _export("accelerate-deepspeed", "flash4", 8)
    assert "parallelism_config_sp_attn_implementation: flash_attention_2" in exported
    assert "flash_attention_4" not in exported
    assert not _attention_gaps(trainer, _job("flash4", 1))  # no sequence parallelism: from_pretrained takes FA4
    assert "attn_implementation='flash_attention_4'" in _export("accelerate-deepspeed", "flash4", 1)


def test_arctic_trainings_own_config_takes_flash_attention_4_and_wants_flash_attn_for_fa3():
    """ArcticTraining's ``ModelConfig`` (its recipe loader) is a free string for ``attn_implementation``, checked only
    for FA2/FA3, which it makes import ``flash_attn`` (FlashAttention-2's package): what docs/trainers.md says."""
    judged = subprocess.run(
        [
            sys.executable,
            "-c",
            "from arctic_training.config.model import ModelConfig\n"
            "print(ModelConfig(name_or_path='m', attn_implementation='flash_attention_4').attn_implementation)\n"
            "try:\n"
            "    import flash_attn\n"
            "except ImportError:\n"
            "    try:\n"
            "        ModelConfig(name_or_path='m', attn_implementation='flash_attention_3')\n"
            "    except ValueError as error:\n"
            "        print('refused:', 'flash_attn package' in str(error))\n",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert judged.returncode == 0, judged.stderr[-2000:]
    lines = [line for line in judged.stdout.splitlines() if not line.startswith("[")]  # DeepSpeed's log lines
    assert lines[0] == "flash_attention_4" and lines[1:] in ([], ["refused: True"])
