"""The presets: ``autotune models`` and ``autotune hardware`` list them, ``autotune calibrate`` measures this
node's rates into a hardware preset (``autotune.timing.calibration``) or re-checks one."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.table import Table

from autotune.cli.common import OUT, app, fail, fail_outcome, significant
from autotune.cli.options import ranged_option


@app.command()
def models():
    """List model presets."""
    from autotune.core.sizes import format_count
    from trials.models.config import load_model_config, model_names, parameter_count

    table = Table(title="model presets (or pass a path to a Hugging Face config.json)")
    for column in ("name", "type", "layers", "hidden", "heads", "kv heads", "vocab", "params", "window", "source"):
        table.add_column(column, overflow="fold")
    for name in model_names():
        c = load_model_config(name)
        table.add_row(
            name,
            c["model_type"],
            str(c["num_hidden_layers"]),
            str(c["hidden_size"]),
            str(c["num_attention_heads"]),
            str(c["num_key_value_heads"]),
            str(c["vocab_size"]),
            format_count(parameter_count(c)),
            _windows(c),
            c.get("_source", ""),
        )
    OUT.rich(table)


def _windows(model_config: dict) -> str:
    """The sliding windows of a preset's layers, e.g. ``4096`` or ``1024 (5 of 6)``; empty for full attention."""
    from trials.models.config import layer_windows

    windows = layer_windows(model_config)
    sizes = sorted({w for w in windows if w})
    if not sizes:
        return ""
    count = sum(1 for w in windows if w)
    share = "" if count == len(windows) else f" ({count} of {len(windows)} layers)"
    return ", ".join(f"{w:,}" for w in sizes) + share


@app.command()
def hardware():
    """List hardware presets: the shipped ones and yours (``autotune calibrate --name NAME``), each with the
    attention kernels its device runs at their forward/backward efficiency, and where each kernel's figures come
    from."""
    from autotune.core.hardware import hardware_names, load_hardware, shipped_dir, user_preset_dir

    table = Table(title="hardware presets")
    for column in (
        "name",
        "from",
        "GiB",
        "host GiB/GPU",
        "TFLOP/s",
        "HBM TB/s",
        "link GB/s",
        "host GB/s",
        "attention fwd/bwd",
        "rates",
    ):
        table.add_column(column, no_wrap=column in ("name", "rates"))
    sources = []
    for name in hardware_names():
        hw = load_hardware(name)
        rates = hw.rates_for(1)  # what the time model uses (a calibrated preset's measured rates)
        table.add_row(
            name,
            hw.source,
            f"{hw.device_memory_bytes / 2**30:.2f}",  # what the oracle compares peaks with, as the preset says it
            f"{hw.host_memory_bytes_per_device / 2**30:.1f}" if hw.host_memory_bytes_per_device else "-",
            significant(rates.bf16_flops / 1e12, 3),
            f"{rates.hbm_bytes_per_s / 1e12:.2f}",
            f"{rates.intra_node_bytes_per_s / 1e9:.0f}",
            f"{rates.host_bytes_per_s / 1e9:.0f}",
            ", ".join(_kernel_rates(rates, kernel) for kernel in hw.kernels),
            _rates_origin(hw),
        )
        for kernel in rates.attention_kernels:
            if kernel.source:
                sources.append(
                    f"  {name} {kernel.name} ({'assumed' if kernel.assumed else 'measured'}): {kernel.source}"
                )
    OUT.rich(table)
    if sources:
        OUT.print("attention kernels (fractions of the bf16 peak at causal attention, head dim 128), from:")
        OUT.print("\n".join(sources))
    OUT.print(f"every other figure's source is the comment beside it in the preset's YAML ({shipped_dir()}/NAME.yaml)")
    OUT.print(
        f"user presets: {user_preset_dir()} (autotune calibrate --name NAME writes one; "
        f"autotune calibrate --check --hardware NAME says whether it still holds)"
    )


def _kernel_rates(rates, kernel: str) -> str:
    """``flash3 0.61/0.47``: a kernel and the forward/backward efficiency the time model prices it at (head dim 128)."""
    priced = rates.for_kernel(kernel, None)
    return f"{kernel} {priced.attention_eff(128, False):.2f}/{priced.attention_eff(128, True):.2f}"


def _rates_origin(hw) -> str:
    if hw.calibrated:
        return f"measured {hw.calibrated.get('measured_at', '')[:10]}"
    if hw.calibration:
        return "typical CPU's"
    return "assumed"


@app.command()
def calibrate(
    hardware: str | None = typer.Option(
        None,
        help="base preset whose memory facts the new preset keeps "
        "(default: the one matching this node's devices; cpu without CUDA)",
    ),
    gpus: int | None = ranged_option(
        "--gpus",
        None,
        "devices to measure the collectives over (default: all visible; cpu: trial world sizes 1, 2, 4 up to this)",
    ),
    name: str | None = typer.Option(None, help="save as a user preset, usable as --hardware NAME everywhere"),
    output: Path | None = typer.Option(None, "-o", "--output", help="write the preset YAML to this file instead"),
    model: str = typer.Option("llama3-8b", help="model whose GEMM shapes and head dim to measure (GPU presets)"),
    repeats: int = ranged_option(
        "--repeats",
        2,
        "CPU: calibration runs per world; the whole run whose own training "
        "step its rates predict best is kept, spread recorded",
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="measure nothing new: re-time the reference workload of the "
        "preset --hardware names and say how far this machine moved "
        "since it was calibrated (seconds)",
    ),
):
    """Measure this node's rates (GEMMs, attention, elementwise, host copies, host AdamW, collectives, per-op
    overheads) and write a hardware preset with them; a few minutes, with progress. With --check, only say
    whether an existing preset still describes this machine."""
    import torch

    from autotune.backends.local import visible_devices
    from autotune.core.hardware import load_hardware
    from autotune.timing.calibration import preset as preset_mod
    from trials.models.config import load_model_config

    if check:
        _check_preset(hardware, name, output)
        return
    preset_name, path = preset_mod.output_path(name, output)
    base = hardware or preset_mod.default_base()
    base_hw = load_hardware(base)
    visible = visible_devices()
    if not base_hw.device_is_host and not visible:
        fail(
            f"--hardware {base} is a GPU preset, but this machine shows no CUDA device: calibrate it on the node "
            f"(here: --hardware cpu)"
        )
    world = gpus or (visible if visible else 4)  # CPU: world sizes 1, 2 and 4 up to --gpus
    if visible and world > visible:
        fail(f"--gpus {world} but this node shows {visible} CUDA device(s)")
    model_config = load_model_config(model)
    print(
        f"calibrating {preset_name} on {torch.cuda.get_device_name(0) + f' x{world}' if visible else 'this CPU'} "
        f"(base preset {base}); a few minutes",
        file=sys.stderr,
        flush=True,
    )
    data = preset_mod.calibrate_preset(base, preset_name, world, model_config, model, repeats=repeats)
    written = preset_mod.write_preset(data, path)
    hw = load_hardware(str(written))
    rates = hw.rates_for(world)
    OUT.print(f"wrote {written}")
    OUT.print(
        f"  matmul {significant(rates.matmul_flops_per_s / 1e12)} TFLOP/s, attention fwd/bwd efficiency "
        f"{rates.attention_eff(128, False):.3f}/{rates.attention_eff(128, True):.3f}, elementwise "
        f"{significant(rates.hbm_bytes_per_s * rates.elementwise_efficiency / 1e9)} GB/s, host link "
        f"{significant(rates.host_bytes_per_s / 1e9, 3)} GB/s, host AdamW {significant(rates.host_optimizer_bytes_per_s / 1e9, 3)} GB/s"
    )
    spread = data["calibrated"].get("spread")
    if spread:
        OUT.print(f"  spread (max-min)/max between runs or samples: {json.dumps(spread)}")
    use = preset_name if name else written
    OUT.print(
        f"use it: --hardware {use}; later, `autotune calibrate --check --hardware {use}` says in seconds "
        f"whether it still describes this node"
    )


def _check_preset(hardware: str | None, name: str | None, output: Path | None) -> None:
    """``calibrate --check``: re-time --hardware's reference workload here (autotune.timing.calibration.check)."""
    from autotune.core.hardware import load_hardware
    from autotune.timing.calibration import preset as preset_mod
    from autotune.timing.calibration.check import check_preset

    if name is not None or output is not None:
        fail("--check writes nothing: give the preset to check as --hardware NAME|FILE, without --name / -o")
    hw = load_hardware(hardware or preset_mod.default_base())
    result = check_preset(
        hw,
        announce=lambda workload: print(f"checking {hw.name}: re-timing {workload} ...", file=sys.stderr, flush=True),
    )
    measured, verdict = result.lines(hw.name)
    OUT.print(measured)
    if result.contended:  # a check that could not measure: a failed run, not a verdict
        fail_outcome(verdict)
    OUT.print(verdict)
