"""Make a calibration the shipped ``cpu`` preset's typical-machine one: replaces the ``calibration:`` block at the
end of autotune/core/hardware_presets/cpu.yaml by a copy of a calibrated preset's, trimmed to the numbers the time
model (``autotune.core.calibration_store.rates_from_calibration``) and ``autotune calibrate --check`` read, at six
significant digits. The comment above the block says which calibration it is; update it by hand.

    .venv/bin/python bench/ship_cpu_calibration.py bench/results/calibrated-cpu-DATE.yaml
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "autotune/core/hardware_presets/cpu.yaml"
PER_WORLD = (
    "matmul_flops",
    "attention_flops",
    "elementwise_bytes_per_s",
    "memcpy_bytes_per_s",
    "optimizer_bytes_per_s",
    "op_overhead_s",
    "view_overhead_s",
    "collective_wait_s",
    "probe_s",
    "threads",
    "in_step",
    "gloo",
)
IN_STEP = (
    "matmul_flops",
    "attention_factor",
    "elementwise_bytes_per_s",
    "optimizer_bytes_per_s",
    "wall_s",
    "predicted_s",
    "collective_calls",
)


def _short(x: float) -> float:
    return float(f"{x:.6g}")


def _trimmed_world(measured: dict) -> dict:
    out = {}
    for key in (k for k in PER_WORLD if k in measured):
        value = measured[key]
        if key == "attention_flops":
            value = {d: [_short(fwd), _short(bwd)] for d, (fwd, bwd) in value.items()}
        elif key == "in_step":
            value = {k: value[k] if isinstance(value[k], int) else _short(value[k]) for k in IN_STEP if k in value}
        elif key == "gloo":
            value = {
                kind: {"latency_s": _short(x["latency_s"]), "bytes_per_s": _short(x["bytes_per_s"])}
                for kind, x in value.items()
            }
        elif key == "threads":
            value = int(value)
        else:
            value = _short(value)
        out[key] = value
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    calibration = yaml.safe_load(Path(argv[0]).read_text())["calibration"]
    block = {
        "machine": calibration["machine"],
        "measured_at": calibration["measured_at"],
        "worlds": {w: _trimmed_world(m) for w, m in calibration["worlds"].items()},
        "repeats": calibration["repeats"],
    }
    text = PRESET.read_text()
    head = text[: text.index("\ncalibration:\n") + 1]
    PRESET.write_text(
        head + yaml.safe_dump({"calibration": block}, sort_keys=False, default_flow_style=None, width=140)
    )
    print(f"{PRESET.relative_to(REPO)}: calibration of {calibration['measured_at']} from {argv[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
