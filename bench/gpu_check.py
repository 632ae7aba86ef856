"""The GPU check: real trials vs the memory oracle and the time model on this machine's devices.

    python bench/gpu_check.py                 # the visible GPUs (1 is enough; more add multi-rank configs)
    python bench/gpu_check.py --device cpu    # the same table on CPU (gloo, the simulated device)

The first thing to run on a GPU node. For each config (>= 8, across the knobs, bf16 compute on a GPU, ``flash``
and ``sdpa``): one real trial through ``trials.trial.runner.run_trial`` (the local backend's code, with the allocator
settings the local backend gives its trials) and the plan backend's prediction of the same config, side by side:
allocated peak (live tensors), reserved peak (the caching allocator's segments), host bytes, step time; and the
loss / grad norm of the first step, which every config of one model must share (the same model, data and seed:
every config runs with data-parallel size 1). The worst ratios are printed last.

First it runs the CUDA acceptance tests (``pytest -m cuda tests/test_cuda_*.py``: offload copies, the layer
clock's events, the device calibration, flash-attn through Ulysses and head chunks, reduced-depth trials, an OOM on
one rank of two) in a subprocess with a deadline (``--tests-deadline``), and prints their summary: passed, failed
and skipped, each test by name. Without CUDA they are all skipped, and the summary says so.

On CPU ``flash`` configs run with ``sdpa`` (flash-attn is CUDA-only; the rows say so), as they do on a GPU node
where flash-attn cannot be imported (bin/setup-gpu's fallback); allocated = reserved (no allocator), compute is
fp32 by default (the CPU's own precision, what the ``cpu`` preset's calibrated time model describes; bf16 matmuls
are emulated there and run far slower: ``--dtype bf16`` checks the bf16 memory).

Every launch has a deadline (``--trial-deadline`` per config, plus start-up); a launch past it is killed with all
its ranks. One-rank configs share one process; each multi-rank config has a launch of its own, and a rank whose
trial fails writes its record and exits at once (no collective after a failure: its peers may sit in one), so
torchrun stops the launch and only that config is reported failed.

``--scale 8b-reduced`` is the acceptance at a scale that matters on one GPU: Llama-3-8B's real layer shapes
(and one MoE row: Qwen3-30B-A3B's experts as grouped GEMMs) measured as reduced-depth trials
(``LocalBackend(depth="reduced")``: the 3- and 4-layer copies run, each segment's peak and the step time extended
to the model's 32 layers, 48 for the MoE) at 32K-256K tokens, against the plan backend's prediction of the whole model: oracle
allocated / reserved peak vs ``max_memory_allocated`` / ``max_memory_reserved``, host bytes, predicted vs measured
step time, one row per config (checkpointing, activation offload, the three tiles, optimizer offload, head chunks,
SDPA and every flash kernel installed here). After the configs: the device calibration (``autotune calibrate``'s
measurements, each kernel's measured efficiency vs the preset's assumed one), the trainer (``autotune run`` on
tiny-llama, 5 steps saving at 3 and 5, then resumed from 3 to 5: the resumed losses vs the uninterrupted ones) and
the memory timeline
(its replayed peak vs the measured one). On CPU (``--device cpu``) the same runs on a stand-in: the models' widths,
heads and vocabularies divided by 16 (head dim and depth kept), lengths divided by 64, fp32; memory is the
tracker's (``trials.core.memory``), time the ``cpu`` preset's (or ``--hardware FILE``). That rehearses the GPU run.

``--budget SECONDS`` gives the CUDA tests their share (``TESTS_SHARE``: the tests it does not reach are listed as
not run, those that ended keep their outcome), keeps a share for the checks after the configs (``CHECKS_S``), stops
adding configs when the rest of the time left would not hold another one (the longest so far, and at least
``MIN_CONFIG_S``), gives each only that rest as its deadline, and still prints the table; the configs and checks not
run are listed, not failed. ``--simulate-tests-s S`` (``--device cpu``) has a process of S seconds stand in for the
CUDA tests: the CPU rehearsal of a GPU run's budget. Nothing is installed: before anything else, when a package it
uses beyond torch is missing, one line names them all and what each missing one costs (a required one missing:
exit 2); on a GPU, a flash kernel its generation runs that is not installed is named there too, and fails the check.

The exit code is 1 when a config or check failed, the CUDA tests failed, a flash kernel is missing, or a
predicted / measured ratio falls outside its band (``BANDS``: memory within [0.85, 1.15], step time within
[0.8, 1.25] on a GPU).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from autotune.backends.local import PEER_LOST  # noqa: E402

# (name, techniques); "{world}" = the world size as the Ulysses degree; "{tile}" = a quarter of the sequence
STACK = {
    "activation_checkpointing": True,
    "mlp_tile_tokens": "{tile}",
    "loss_tile_tokens": "{tile}",
    "norm_tile_tokens": "{tile}",
}
ONE_RANK = [
    ("plain sdpa", {"attention": "sdpa"}),
    ("plain flash", {"attention": "flash"}),
    ("fsdp", {"attention": "flash", "fsdp": True}),
    ("fsdp + optimizer offload", {"attention": "flash", "fsdp": True, "optimizer_offload": True}),
    ("checkpointing", {"attention": "flash", "activation_checkpointing": True}),
    (
        "checkpointing + offload all",
        {"attention": "flash", "activation_checkpointing": True, "activation_offload_layers": "all"},
    ),
    ("tiles (mlp, loss, norm)", {"attention": "sdpa", **STACK}),
    ("head chunks", {"attention": "flash", "head_chunk": 1}),
    (
        "full stack",
        {
            "attention": "flash",
            "fsdp": True,
            "optimizer_offload": True,
            "head_chunk": 1,
            "activation_offload_layers": "all",
            **STACK,
        },
    ),
]
MULTI_RANK = [
    ("ulysses", {"attention": "flash", "ulysses_degree": "{world}"}),
    ("ulysses sdpa + fsdp", {"attention": "sdpa", "fsdp": True, "ulysses_degree": "{world}"}),
    (
        "full stack",
        {
            "attention": "flash",
            "fsdp": True,
            "optimizer_offload": True,
            "ulysses_degree": "{world}",
            "head_chunk": 1,
            "activation_offload_layers": "all",
            **STACK,
        },
    ),
]
DEFAULTS = {
    "cuda": {"model": "llama3-8b", "layers": 2, "seq": 16384},
    "cpu": {"model": "tiny-llama", "layers": 2, "seq": 2048},
}


# -- the 8b-reduced scale: real layer shapes, reduced depth, one GPU ------------------------------------------

K = 1024
SCALES = ("small", "8b-reduced")
TILE = 8 * K  # every tile's tokens (a 64K-token loss tile of Llama-3's vocabulary alone is 32 GiB in fp32)
CHECKPOINTED = {"activation_checkpointing": True, "loss_tile_tokens": TILE}
TILES = {"mlp_tile_tokens": TILE, "loss_tile_tokens": TILE, "norm_tile_tokens": TILE}
OPTIMIZER_OFFLOAD = {"fsdp": True, "optimizer_offload": True}
# (name, model, tokens on a GPU, techniques), cheapest first (the budget drops the last ones). "{flash}": the first
# flash kernel installed here (else sdpa); "{kernel}": one row per attention kernel that runs here; "{chunk}": a
# quarter of the model's query heads. Sized with the oracle so each 4-layer copy fits an 80 GB card in bf16.
REAL_SCALE = [
    ("checkpointing, {kernel}", "llama3-8b", 64 * K, {"attention": "{kernel}", **CHECKPOINTED}),
    (
        "no checkpointing + optimizer offload",
        "llama3-8b",
        32 * K,
        {"attention": "{flash}", "loss_tile_tokens": TILE, **OPTIMIZER_OFFLOAD},
    ),
    ("head chunks", "llama3-8b", 64 * K, {"attention": "{flash}", **CHECKPOINTED, "head_chunk": "{chunk}"}),
    (
        "moe grouped gemms + optimizer offload",
        "qwen3-30b-a3b",
        32 * K,
        {"attention": "{flash}", **CHECKPOINTED, **OPTIMIZER_OFFLOAD},
    ),
    (
        "checkpointing + offload 16 of 32",
        "llama3-8b",
        64 * K,
        {"attention": "{flash}", **CHECKPOINTED, "activation_offload_layers": 16},
    ),
    (
        "checkpointing + offload all",
        "llama3-8b",
        128 * K,
        {"attention": "{flash}", **CHECKPOINTED, "activation_offload_layers": "all"},
    ),
    ("tiles (mlp, loss, norm)", "llama3-8b", 128 * K, {"attention": "sdpa", "activation_checkpointing": True, **TILES}),
    (
        "full stack",
        "llama3-8b",
        256 * K,
        {
            "attention": "{flash}",
            "activation_checkpointing": True,
            "activation_offload_layers": "all",
            **TILES,
            **OPTIMIZER_OFFLOAD,
        },
    ),
]
STAND_IN_WIDTH = 16  # the CPU's stand-in: widths, heads and vocabulary / 16 (head dim, depth, experts kept)
STAND_IN_LENGTH = 64  # the CPU's stand-in: tokens (lengths and tiles) / 64
TOKEN_KNOBS = ("mlp_tile_tokens", "loss_tile_tokens", "norm_tile_tokens")
WIDTHS = ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "vocab_size")
# of --budget, kept for the checks after the configs (calibration, trainer, memory timeline): the CPU's are slower
CHECKS_S = {"cuda": 180.0, "cpu": 120.0}
# of --budget, the CUDA acceptance tests' share (their deadline; the tests not reached by it are listed as not run,
# the configs after them keep the rest). Their estimated duration on one GPU, by their sizes, is about 210 s: 33
# tests, 17 of them skipped there (two or four GPUs, a hub build not installed); each a process that initialises
# CUDA (~5-10 s); the calibration's and the full-size benches' timed GEMMs, attention calls and copies (~20-40 s
# each); 8- and 4-layer tiny-model trials at 16K-64K tokens through the local backend (~20-30 s each, start-up
# included); flash and packed-document comparisons at 8K tokens (~5-8 s per kernel); non-causal block checks (~2 s)
TESTS_SHARE = 0.35
# the shortest deadline a config starts with: a reduced-depth trial's start-up, its 3- and 4-layer copies' steps
# and the oracle's trace of the whole model (on CPU the stand-in's)
MIN_CONFIG_S = {"cuda": 60.0, "cpu": 15.0}
# the bands a run's predicted / measured ratios must fall in (the exit code), as docs/validation.md states them for
# published runs; step time only on a GPU (the CPU stand-in's time is the cpu preset's, not the GPU's)
BANDS = {
    "peak_allocated_bytes": (0.85, 1.15),
    "peak_reserved_bytes": (0.85, 1.15),
    "host_bytes": (0.85, 1.15),
    "step_time_s": (0.8, 1.25),
    "timeline": (0.85, 1.15),
}
TRAINER_STEPS, TRAINER_SAVED = 5, 3  # autotune run: 5 steps saving at 3 and 5, then resumed from 3 to 5


def stand_in(model_config: dict) -> dict:
    """The CPU's stand-in for ``model_config``: widths, heads (query and key/value, at least 1) and vocabulary
    divided by ``STAND_IN_WIDTH``; head dim, depth, experts and their top-k as the model's."""
    config = dict(model_config)
    for key in (*WIDTHS, "num_key_value_heads"):
        if key in config:
            config[key] = max(1, config[key] // STAND_IN_WIDTH)
    config["_name"] = f"{model_config.get('_name', 'model')} / {STAND_IN_WIDTH} (cpu stand-in)"
    return config


def needs_deepspeed(techniques: dict) -> bool:
    """Whether a config runs DeepSpeed's code: its Ulysses attention, for a degree > 1 (the tiles are
    ``trials.stack.tiling``'s own)."""
    return techniques.get("ulysses_degree", 1) > 1


def scale_rows(device: str, kernels: list[str]) -> list[dict]:
    """The 8b-reduced rows for ``device`` with the attention ``kernels`` that run here (sdpa first): each a name,
    the model config (the stand-in on CPU), its length and its techniques (validated for the whole model)."""
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    flash = next((k for k in kernels if k != "sdpa"), "sdpa")
    divide = STAND_IN_LENGTH if device == "cpu" else 1
    rows = []
    for name, model, tokens, knobs in REAL_SCALE:
        config = load_model_config(model)
        config.setdefault("_name", model)
        if device == "cpu":
            config = stand_in(config)
        for kernel in kernels if "{kernel}" in knobs.values() else [None]:
            values = {"{kernel}": kernel, "{flash}": flash, "{chunk}": max(1, config["num_attention_heads"] // 4)}
            t = {k: values.get(v, v) if isinstance(v, str) else v for k, v in knobs.items()}
            t.update({k: t[k] // divide for k in TOKEN_KNOBS if t.get(k)})
            label = name.replace("{kernel}", kernel or "")
            if kernel is None and t.get("attention") != "sdpa" and t.get("attention") != knobs.get("attention"):
                label += f" ({t['attention']})"
            layers = config["num_hidden_layers"]
            techniques = Techniques.from_dict(t, layers)
            techniques.validate(config, 1, tokens // divide, on_gpu=device == "cuda")
            rows.append(
                {
                    "name": label,
                    "world": 1,
                    "model_config": config,
                    "seq": tokens // divide,
                    "techniques": techniques.to_dict(),
                }
            )
    return rows


class Budget:
    """``--budget SECONDS`` from its start: a config starts only while the time left, less ``reserve_s`` kept for the
    checks after the configs, is more than the longest config so far took and at least ``minimum_s`` (a config
    given less could not finish: it is reported not run, not failed), and its deadline is that time left less the
    reserve. None: no limit."""

    def __init__(self, seconds: float | None, reserve_s: float = 0.0, clock=time.monotonic, minimum_s: float = 0.0):
        self.seconds, self.reserve_s, self.clock, self.minimum_s = seconds, reserve_s, clock, minimum_s
        self.started = clock()
        self.longest = 0.0

    def left(self) -> float:
        return float("inf") if self.seconds is None else self.seconds - (self.clock() - self.started)

    def admits(self) -> bool:
        room = self.left() - self.reserve_s
        return room > max(self.longest, 0.0) and room >= self.minimum_s

    def took(self, seconds: float) -> None:
        self.longest = max(self.longest, seconds)


def run_rows(rows: list[dict], run_row, budget: Budget) -> list[dict | None]:
    """Each row's result from ``run_row(row, deadline_s)`` (the budget's time left less its reserve) while
    ``budget`` admits another; None: not run."""
    results: list[dict | None] = []
    for row in rows:
        if not budget.admits():
            results.append(None)
            continue
        started = budget.clock()
        results.append(run_row(row, budget.left() - budget.reserve_s))
        budget.took(budget.clock() - started)
    return results


def reduced_trial(row: dict, hardware, steps: int, deadline_s: float) -> dict:
    """One row as a reduced-depth real trial through the local backend: its measured record extended to the
    model's depth, as a dict (``ResultRecord``); ``extended_over``: the extension passed the card's capacity."""
    from autotune.backends import Evaluation
    from autotune.backends.local import LocalBackend
    from trials.stack.techniques import Techniques

    config = row["model_config"]
    evaluation = Evaluation(
        config, Techniques.from_dict(row["techniques"], config["num_hidden_layers"]), row["seq"], 1, hardware
    )
    backend = LocalBackend(steps=steps, warmup=1, timeout_s=max(1.0, deadline_s), depth="reduced")
    record = backend.evaluate(evaluation).to_dict()
    # a 32-layer model past the card: the copies ran, the extension says it does not fit (compared all the same)
    record["extended_over"] = record["status"] == "oom" and (record.get("error") or "").startswith("measured at")
    if record["extended_over"]:
        record["status"] = "ok"
    return record


def calibration_lines(device: str, base_name: str, model_config: dict) -> list[str]:
    """``autotune calibrate``'s device measurements here (``calibrate_preset`` on the GPU base preset; small sizes on
    CPU) at ``model_config``'s shapes, and each rate it sets beside the base preset's assumed one: measured /
    assumed. Kernels it could not time here keep the assumed rates and are named, not compared."""
    from autotune.core.hardware import load_hardware
    from autotune.timing.calibration.preset import calibrate_preset

    base = load_hardware(base_name)
    name = model_config.get("_name", "the model")
    started = time.perf_counter()
    data = calibrate_preset(base_name, "gpu-check", 1, model_config, name, repeats=1, small=device == "cpu")
    lines = [
        f"calibration ({time.perf_counter() - started:.0f} s; autotune calibrate --hardware {base_name} at "
        f"{name}'s shapes{', small sizes' if device == 'cpu' else ''}): measured, assumed, measured / assumed"
    ]
    for key in ("matmul_efficiency", "elementwise_efficiency", "host_bytes_per_s", "host_optimizer_bytes_per_s"):
        was = getattr(base.rates, key)
        lines.append(f"  {key:<36} {data[key]:11.4g} {was:11.4g} {data[key] / was:11.4g}")
    assumed = {kernel.name: kernel.to_yaml() for kernel in base.rates.attention_kernels}
    kept = []
    for kernel, entry in data["attention_kernels"].items():
        if entry.get("assumed", True):
            kept.append(kernel)
            continue
        for direction in ("forward", "backward"):
            value = entry.get(f"{direction}_efficiency")
            was = assumed.get(kernel, {}).get(f"{direction}_efficiency")
            ratio = f"{value / was:11.4g}" if value and was else f"{'none assumed':>11}"
            label = f"attention {kernel} {direction} efficiency"
            lines.append(f"  {label:<36} {value or float('nan'):11.4g} {was or float('nan'):11.4g} {ratio}")
    if kept:
        lines.append(f"  not timed here (the preset's assumed rates kept): {', '.join(kept)}")
    return lines


def calibration_check(device: str, base_name: str, model_config: dict, deadline_s: float) -> list[str]:
    """``calibration_lines`` in a process of its own, killed with its workers at ``deadline_s``; a failure is one
    line that starts "calibration: FAILED" and says why."""
    with tempfile.TemporaryDirectory(prefix="gpu-check-calibration-") as work:
        shapes, out = Path(work, "shapes.json"), Path(work, "lines.txt")
        shapes.write_text(json.dumps(model_config))
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--calibration",
            device,
            base_name,
            str(shapes),
            str(out),
        ]
        returncode, output = run_with_deadline(
            command, max(1.0, deadline_s), env=dict(os.environ, PYTHONPATH=str(ROOT))
        )
        if returncode == 0 and out.exists():
            return out.read_text().splitlines()
        why = f"past its deadline of {deadline_s:.0f} s" if returncode is None else f"exit {returncode}"
        tail = " | ".join(output.strip().splitlines()[-3:])
        return [f"calibration: FAILED ({why}): {tail[-600:]}"]


def trainer_check(device: str, hardware_name: str, deadline_s: float) -> tuple[list[str], float | None]:
    """``autotune run`` on tiny-llama: 5 steps saving at 3 and 5; then the step-5 checkpoint removed and the run
    resumed from step 3 to 5. (the section's lines, the largest relative difference between the resumed run's
    losses and the uninterrupted run's; None: a run failed)."""
    import shutil

    from trials.training.checkpoint import step_folder

    with tempfile.TemporaryDirectory(prefix="gpu-check-run-") as work:
        config = Path(work, "config.json")
        config.write_text(
            json.dumps(
                {
                    "schema": "autotune/config-v1",
                    "model": "tiny-llama",
                    "hardware": "cpu" if device == "cpu" else hardware_name,
                    "gpus": 1,
                    "seq_len": 1024,
                    "techniques": {"fsdp": True, "activation_checkpointing": True, "attention": "sdpa"},
                }
            )
        )
        cli = [sys.executable, "-c", "import sys; from autotune.cli import main; sys.exit(main())", "run"]
        common = ["--config", str(config), "--lr", "1e-3", "--steps", str(TRAINER_STEPS), "--save", "ck"]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        started = time.perf_counter()
        runs = [
            ("uninterrupted", ["--save-every", str(TRAINER_SAVED), "--log-file", "full.jsonl"]),
            ("resumed", ["--resume", "--log-file", "resumed.jsonl"]),
        ]
        for name, extra in runs:
            left = deadline_s - (time.perf_counter() - started)
            returncode, output = run_with_deadline([*cli, *common, *extra], max(1.0, left), cwd=work, env=env)
            if returncode != 0:
                why = "past its deadline" if returncode is None else f"exit {returncode}"
                tail = " | ".join(output.strip().splitlines()[-3:])
                return [f"trainer (autotune run): the {name} run FAILED ({why}): {tail[-600:]}"], None
            # the resumed run starts from the checkpoint of step 3: the one of step 5 goes
            shutil.rmtree(step_folder(Path(work, "ck"), TRAINER_STEPS), ignore_errors=True)
        full = [json.loads(line) for line in Path(work, "full.jsonl").read_text().splitlines()]
        resumed = [json.loads(line) for line in Path(work, "resumed.jsonl").read_text().splitlines()]
    uninterrupted = {entry["step"]: entry["loss"] for entry in full}
    after = {entry["step"]: entry["loss"] for entry in resumed}
    if sorted(after) != list(range(TRAINER_SAVED + 1, TRAINER_STEPS + 1)):
        return [f"trainer (autotune run): the resumed run logged steps {sorted(after)}, not those after step 3"], None
    spread = max(abs(after[step] - uninterrupted[step]) / abs(uninterrupted[step]) for step in after)
    losses = ", ".join(f"{uninterrupted[s]:.5f}/{after[s]:.5f}" for s in sorted(after))
    return [
        f"trainer (autotune run, tiny-llama, {time.perf_counter() - started:.0f} s): {TRAINER_STEPS} steps saved at "
        f"{TRAINER_SAVED} and {TRAINER_STEPS}; resumed from {TRAINER_SAVED} to {TRAINER_STEPS}: steps "
        f"{TRAINER_SAVED + 1}-{TRAINER_STEPS} uninterrupted/resumed loss {losses} (largest relative difference "
        f"{spread:.2e})"
    ], spread


def timeline_check(row: dict, hardware, deadline_s: float) -> tuple[list[str], float | None]:
    """The memory timeline of ``row``'s model at 4 layers, one whole-model trial: its replayed peak over the trial's
    allocated peak (CPU: the tracker's every event, exactly its peak; CUDA: the allocator's history of the first
    measured step)."""
    from autotune.backends import Evaluation
    from autotune.backends.local import LocalBackend
    from trials.models.config import with_layers
    from trials.stack.techniques import Techniques
    from trials.trial.memory_timeline import replay_peak

    config = with_layers(row["model_config"], 4)
    evaluation = Evaluation(config, Techniques.from_dict(row["techniques"], 4), row["seq"], 1, hardware)
    backend = LocalBackend(steps=1, warmup=1, timeout_s=max(1.0, deadline_s), timeline_rank=0)
    started = time.perf_counter()
    record = backend.evaluate(evaluation)
    seconds = time.perf_counter() - started
    what = f"memory timeline ({row['name']}, 4 layers, {row['seq']:,} tokens, {seconds:.0f} s)"
    if record.status != "ok" or backend.last_timeline is None:
        return [f"{what}: FAILED: {record.status}, {'no timeline' if record.status == 'ok' else record.error}"], None
    replayed = replay_peak(backend.last_timeline)
    ratio = replayed / record.peak_allocated_bytes
    return [
        f"{what}: replayed peak {replayed:,} bytes, measured allocated peak {record.peak_allocated_bytes:,} "
        f"bytes: {ratio:.4f}"
    ], ratio


STARTUP_S = 300.0  # one launch's start-up: imports, process group, DeepSpeed's op build
CUDA_TESTS = "tests/test_cuda_*.py"


def configs(world: int, device: str, seq: int, layers: int, flash: bool | None = None) -> list[dict]:
    """The rows to run; ``flash``: whether flash-attn runs here (default: on CUDA only), else ``flash`` rows run
    ``sdpa`` and say so."""
    from trials.stack.techniques import Techniques

    flash = device == "cuda" if flash is None else flash

    rows = [{"name": name, "world": 1, "techniques": t} for name, t in ONE_RANK]
    if world > 1:
        rows += [{"name": f"{name} x{world}", "world": world, "techniques": t} for name, t in MULTI_RANK]
    for row in rows:
        values = {"{world}": row["world"], "{tile}": seq // 4}
        t = {k: values.get(v, v) if isinstance(v, str) else v for k, v in row["techniques"].items()}
        if not flash and t.get("attention") == "flash":
            t["attention"] = "sdpa"
            row["name"] += " (flash->sdpa)"
        row["techniques"] = Techniques.from_dict(t, layers).to_dict()
    return rows


# -- real trials: one launch per world size ----------------------------------------------------------------


def _worker(specs_path: str, out_dir: str) -> int:
    import torch
    import torch.distributed as dist

    from trials.core import allocator
    from trials.core.dist import Mesh, build_mesh, default_device, process_group_backend
    from trials.trial.runner import run_trial
    from trials.trial.spec import TrialSpec

    allocator.configure()
    specs = json.loads(Path(specs_path).read_text())
    world = int(os.environ.get("WORLD_SIZE", 1))
    device = default_device() if specs[0].pop("device") == "cuda" else torch.device("cpu")
    for spec in specs[1:]:
        spec.pop("device")
    if world > 1:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(process_group_backend(device))
    rank = dist.get_rank() if world > 1 else 0
    for index, spec in enumerate(specs):
        degree = spec["techniques"].get("ulysses_degree", 1)
        mesh = build_mesh(degree, device) if world > 1 else Mesh.single(device)
        record = run_trial(TrialSpec.from_dict(spec), mesh).to_dict()
        Path(out_dir, f"{index}_rank{rank}.json").write_text(json.dumps(record))
        if world > 1 and record["status"] != "ok":
            # its peers may sit in a collective of the failed step: no barrier, no destroy; torchrun stops them
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        # the previous model's tensors are garbage only once collected (reference cycles): then the cache frees
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if world > 1:
            dist.barrier()
    if world > 1:
        dist.destroy_process_group()
    return 0


def _kill_tree(proc: subprocess.Popen) -> None:
    """Kill a launch and every process under it: torchrun starts each rank in a session of its own, so its
    process group alone would leave them running."""
    try:
        import psutil

        children = psutil.Process(proc.pid).children(recursive=True)
    except Exception:  # psutil absent or the launcher gone: its group is what is left to kill
        children = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in children:
        try:
            child.kill()
        except Exception:
            pass
    proc.wait()


def run_with_deadline(command: list[str], deadline_s: float, **kwargs) -> tuple[int | None, str]:
    """(exit code, or None past ``deadline_s``; stdout and stderr together): ``command`` in a session of its own,
    killed with its whole process tree at the deadline."""
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True, **kwargs
        )
        try:
            returncode = proc.wait(timeout=deadline_s)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            _kill_tree(proc)
        log.seek(0)
        return returncode, log.read()


def launches(rows: list[dict]) -> list[tuple[int, list[int]]]:
    """(world size, row indices) of each launch: every one-rank row in one, each multi-rank row in its own."""
    single = [index for index, row in enumerate(rows) if row["world"] == 1]
    groups = [(1, single)] if single else []
    return groups + [(row["world"], [index]) for index, row in enumerate(rows) if row["world"] > 1]


def run_real(
    rows: list[dict],
    model_config: dict,
    seq: int,
    device: str,
    steps: int,
    dtype: str,
    trial_deadline_s: float = 1800.0,
) -> list[dict]:
    from trials.core import allocator

    results: list[dict] = [{}] * len(rows)
    env = allocator.trial_environment(dict(os.environ, PYTHONPATH=str(ROOT)), cpu=device == "cpu")
    for world, indices in launches(rows):
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
            specs = [
                {
                    "model_config": model_config,
                    "techniques": rows[i]["techniques"],
                    "seq_len": seq,
                    "steps": steps,
                    "warmup": 1,
                    "seed": 0,
                    "compute_dtype": dtype,
                    "device": device,
                }
                for i in indices
            ]
            Path(work, "specs.json").write_text(json.dumps(specs))
            script = [str(Path(__file__).resolve()), "--worker", str(Path(work, "specs.json")), work]
            command = (
                [sys.executable, *script]
                if world == 1
                else [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={world}",
                    *script,
                ]
            )
            deadline_s = STARTUP_S + trial_deadline_s * len(indices)
            returncode, output = run_with_deadline(command, deadline_s, env=env)
            for local, index in enumerate(indices):
                ranks = [json.loads(p.read_text()) for p in sorted(Path(work).glob(f"{local}_rank*.json"))]
                # a failing rank's record is the finding (a peer's "connection closed" is only its symptom);
                # its peers, stopped by torchrun, wrote none
                failed = [r for r in ranks if r["status"] != "ok"]
                bad = min(
                    failed,
                    key=lambda r: (bool(PEER_LOST.search(r.get("error") or "")), r.get("finished_at") or 0),
                    default=None,
                )
                if bad is None and len(ranks) < world:
                    tail = "\n".join(output.splitlines()[-12:])
                    why = f"past its deadline of {deadline_s:.0f} s" if returncode is None else f"exit {returncode}"
                    results[index] = {"status": "error", "error": f"rank records missing ({why}); last output:\n{tail}"}
                    continue
                first = next((r for r in ranks if r["rank"] == 0), ranks[0])
                results[index] = dict(
                    first,
                    status=bad["status"] if bad else "ok",
                    error=bad["error"] if bad else None,
                    **{
                        key: max(r[key] or 0 for r in ranks)
                        for key in ("peak_allocated_bytes", "peak_reserved_bytes", "peak_device_bytes", "host_bytes")
                    },
                )
    return results


# -- the CUDA acceptance tests ---------------------------------------------------------------------------------


# pytest -v's line for each test as it ends, a skip's reason beside it
TEST_OUTCOME = re.compile(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \((.*)\))?")


def run_cuda_tests(deadline_s: float, simulate_s: float | None = None) -> tuple[list[str], str]:
    """(the summary's lines, "ok" / "failed" / "not run"): ``pytest -m cuda -v`` over ``tests/test_cuda_*.py`` in a
    subprocess killed at ``deadline_s``, each test's outcome read from its own line as it ends, so the tests a
    deadline stops are listed as not run and the finished ones keep their outcome. ``simulate_s`` (the CPU
    rehearsal): a process that takes that long stands in for the tests, under the same deadline."""
    started = time.perf_counter()
    if simulate_s is not None:
        returncode, _ = run_with_deadline([sys.executable, "-c", f"import time; time.sleep({simulate_s})"], deadline_s)
        seconds = time.perf_counter() - started
        if returncode is None:
            return [
                f"cuda tests (simulated: {simulate_s:.0f} s stands in for them): stopped at their share of the "
                f"budget ({deadline_s:.0f} s): not run (budget)"
            ], "not run"
        return [f"cuda tests (simulated: {simulate_s:.0f} s stands in for them, {seconds:.0f} s)"], "ok"
    import glob

    files = sorted(os.path.relpath(f, ROOT) for f in glob.glob(str(ROOT / CUDA_TESTS)))
    command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "cuda", *files]
    # wide lines: pytest -v drops a skip's reason that does not fit the terminal's width
    env = dict(os.environ, PYTHONPATH=str(ROOT), COLUMNS="500")
    returncode, output = run_with_deadline(command, deadline_s, cwd=ROOT, env=env)
    seconds = time.perf_counter() - started
    outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
    kind = {"PASSED": "passed", "XPASS": "passed", "FAILED": "failed", "ERROR": "failed"}
    for line in output.splitlines():
        found = TEST_OUTCOME.match(line)
        if found:
            name, outcome, reason = found.groups()
            outcomes[kind.get(outcome, "skipped")].append(f"{name} ({reason[:200]})" if reason else name)
    head = f"cuda tests (pytest -m cuda {CUDA_TESTS}, {seconds:.0f} s): " + ", ".join(
        f"{len(names)} {outcome}" for outcome, names in outcomes.items()
    )
    lines = []
    if returncode is None:
        head += f"; stopped at their share of the budget ({deadline_s:.0f} s): the rest not run (budget)"
    for outcome, names in outcomes.items():
        lines += [f"  {outcome}: {name}" for name in names]
    if outcomes["failed"]:
        status = "failed"
    elif returncode is None:
        status = "not run"
    elif returncode != 0 or not any(outcomes.values()):  # exit 5: the marker selected nothing, a failed check too
        status = "failed"
        lines.append(f"  pytest exited {returncode}: " + " | ".join(output.strip().splitlines()[-3:]))
    else:
        status = "ok"
    return [head, *lines], status


def missing_kernels(device: str) -> list[str]:
    """The flash kernels this GPU's generation runs (``AttentionKernel.runs_on``: what its preset prices and
    ``bin/setup-gpu`` installs) that are not installed here, one line each; none on CPU."""
    if device != "cuda":
        return []
    import torch

    from autotune.timing.calibration.device_bench import flash_kernels_here
    from trials.kernels.registry import FLASH_KERNELS, KERNELS

    major = torch.cuda.get_device_capability(0)[0]
    here = flash_kernels_here(torch.device("cuda", 0))
    return [
        f"{name}: runs on compute capability {major}.x and is not installed here (bin/setup-gpu installs it)"
        for name in FLASH_KERNELS
        if KERNELS[name].runs_on(major) and name not in here
    ]


def note_ratio(worst: dict, key: str, ratio: float | None, name: str, device: str) -> None:
    """Keeps ``key``'s worst ratio in ``worst`` and lists a ratio outside its band (``BANDS``) in
    ``worst["out of band"]``."""
    if ratio is None:
        return
    if key not in worst or abs(ratio - 1) > abs(worst[key][0] - 1):
        worst[key] = (ratio, name)
    band = BANDS.get(key)
    if band and (key != "step_time_s" or device == "cuda") and not band[0] <= ratio <= band[1]:
        worst.setdefault("out of band", []).append(f"{LABELS[key]} {ratio:.3f} outside [{band[0]}, {band[1]}] ({name})")


# -- predictions -------------------------------------------------------------------------------------------


def predict_row(row: dict, model_config: dict, seq: int, hardware, dtype: str) -> dict:
    import torch

    from autotune.backends import Evaluation
    from autotune.backends.plan import counter_modes, step_time
    from autotune.oracle import predict
    from trials.stack.techniques import Techniques

    techniques = Techniques.from_dict(row["techniques"], model_config["num_hidden_layers"])
    evaluation = Evaluation(model_config, techniques, seq, row["world"], hardware)
    # the plan backend's prediction, with the compute dtype of the real trials (bf16 on CPU needs saying)
    prediction = predict(
        evaluation,
        modes=counter_modes(evaluation),
        compute_dtype={"bf16": torch.bfloat16, "fp32": torch.float32}[dtype],
    )
    tensor_peak = prediction.tensor_peak_bytes
    return {
        "peak_allocated_bytes": tensor_peak,
        "peak_reserved_bytes": tensor_peak + hardware.fragmentation_bytes(tensor_peak),
        "peak_device_bytes": prediction.peak_device_bytes,
        "host_bytes": prediction.host_bytes,
        "step_time_s": step_time(evaluation, prediction).step_time_s,
    }


def _ratio(predicted, measured) -> float | None:
    if not measured:
        return None if predicted else 1.0  # nothing measured, nothing predicted: agree
    return predicted / measured


# (import name, package, what it serves, required): what the check uses beyond torch; checked before anything runs
PACKAGES = [
    ("transformers", "transformers", "every model", True),
    ("yaml", "pyyaml", "the hardware presets", True),
    ("typer", "typer", "autotune run (the trainer check)", False),
    ("rich", "rich", "autotune run (the trainer check)", False),
    ("pyarrow", "pyarrow", "autotune run (the trainer check)", False),
    ("deepspeed", "deepspeed", "Ulysses: those configs", False),
    ("pytest", "pytest", "the CUDA acceptance tests", True),
    ("psutil", "psutil", "the CUDA acceptance tests (tests/test_cuda_trials.py), killing a timed-out launch", True),
]


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that does not import
        return False


def missing_packages(importable=None) -> tuple[str | None, set[str], bool]:
    """(one line naming every package the check uses beyond torch and, when any is missing, those missing and
    what each costs, else None; the missing import names; whether a required one is missing). The flash kernels
    are each optional (their rows run where installed)."""
    from trials.kernels.registry import FLASH_KERNELS, KERNELS

    importable = importable or _importable
    packages = list(PACKAGES) + [
        (KERNELS[name].module, KERNELS[name].package, f"the {name} rows", False) for name in FLASH_KERNELS
    ]
    missing = [
        (module, package, what, required) for module, package, what, required in packages if not importable(module)
    ]
    if not missing:
        return None, set(), False
    names = ", ".join(dict.fromkeys(package for _, package, _, _ in packages))
    lost = "; ".join(f"{package} ({'required: ' if required else ''}{what})" for _, package, what, required in missing)
    line = f"gpu_check uses beyond torch: {names}. Missing here: {lost}"
    return line, {module for module, *_ in missing}, any(required for *_, required in missing)


def _options_problem(args) -> str | None:
    """Why the options cannot run (one line), or None."""
    for name in ("steps", "budget", "trial_deadline", "tests_deadline", "layers", "seq", "gpus", "simulate_tests_s"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            return f"--{name.replace('_', '-')} must be positive, got {value:g}"
    if args.simulate_tests_s is not None and (args.device != "cpu" or args.scale != "8b-reduced"):
        return "--simulate-tests-s rehearses --scale 8b-reduced on --device cpu only"
    if args.scale == "8b-reduced":
        given = [f"--{name}" for name in ("model", "layers", "seq", "gpus", "dtype") if getattr(args, name) is not None]
        if given:
            return f"--scale 8b-reduced sets its own models, lengths, one GPU and dtype: drop {', '.join(given)}"
    elif args.budget is not None:
        return "--budget applies to --scale 8b-reduced (the small scale runs its one-rank configs in one launch)"
    return None


def real_scale(args, missing: set[str]) -> int:
    """``--scale 8b-reduced``: the checks around the table, then the table's configs while the budget lasts."""
    import dataclasses

    import torch

    from autotune.core.hardware import load_hardware
    from autotune.timing.calibration.device_bench import flash_kernels_here
    from autotune.timing.calibration.preset import default_base
    from trials.models.config import load_model_config

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    budget = Budget(
        args.budget,
        reserve_s=CHECKS_S[device] if args.budget is not None else 0.0,
        minimum_s=MIN_CONFIG_S[device] if args.budget is not None else 0.0,
    )
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    dtype = "bf16" if device == "cuda" else "fp32"
    if device == "cuda":
        hardware_name = args.hardware or default_base()
        card = torch.cuda.get_device_properties(0)
        hardware = dataclasses.replace(load_hardware(hardware_name), device_memory_bytes=card.total_memory)
        kernels = ["sdpa", *flash_kernels_here(torch.device("cuda"))]
        from trials.kernels.sdpa_backend import here

        where = f"{card.name} ({card.total_memory / 2**30:.2f} GiB; SDPA runs {here()}), preset {hardware.name}"
    else:
        hardware_name = args.hardware or "cpu"
        hardware = load_hardware(hardware_name)
        kernels = ["sdpa"]
        where = (
            f"cpu (the simulated device) standing in for one GPU: widths / {STAND_IN_WIDTH}, "
            f"lengths / {STAND_IN_LENGTH}; preset {hardware.name}"
        )
    rows = scale_rows(device, kernels)
    steps = args.steps or 1
    limit = (
        "none"
        if args.budget is None
        else f"{args.budget:.0f} s: at most {TESTS_SHARE * args.budget:.0f} s for the CUDA tests, "
        f"{budget.reserve_s:.0f} s for the checks after the configs"
    )
    print(
        f"gpu_check --scale 8b-reduced: {where}; {dtype} compute; torch {torch.__version__}; kernels "
        f"{', '.join(kernels)}; {len(rows)} configs, reduced depth (3- and 4-layer copies, extended to the model's); "
        f"budget {limit}",
        flush=True,
    )
    worst: dict = {}
    say_missing_kernels(device, worst)  # named before anything runs: the node's set-up left them out
    share = TESTS_SHARE * args.budget if args.budget is not None else float("inf")
    tests, tests_status = run_cuda_tests(
        max(1.0, min(args.tests_deadline, share, budget.left() - budget.reserve_s)), args.simulate_tests_s
    )
    print("\n".join(tests), flush=True)
    if tests_status == "not run":
        worst["not run"] = (worst.get("not run", (0,))[0] + 1, "the cuda tests")

    def run_row(row: dict, left_s: float) -> dict:
        if "deepspeed" in missing and needs_deepspeed(row["techniques"]):
            return {"status": "skipped", "error": "needs deepspeed (its Ulysses attention), not installed here"}
        started = time.perf_counter()
        real = reduced_trial(row, hardware, steps, min(args.trial_deadline, left_s))
        trial_s = time.perf_counter() - started
        if real["status"] == "ok":
            try:
                real["predicted"] = predict_row(row, row["model_config"], row["seq"], hardware, dtype)
            except Exception as exc:  # a config the oracle cannot trace is a finding, not a crash of the check
                real["status"], real["error"] = "error", f"oracle failed: {type(exc).__name__}: {exc}"
        real["wall_s"] = time.perf_counter() - started
        say = (
            f"{real['status']}, {real['wall_s']:.0f} s (trial {trial_s:.0f} s, oracle {real['wall_s'] - trial_s:.0f} s), "
            f"{budget.left():.0f} s of the budget left"
        )
        print(f"  {row['name']} at {row['seq']:,} tokens: {say}", flush=True)
        return real

    print("configs:", flush=True)
    measured = run_rows(rows, run_row, budget)

    def failed(what: str) -> None:
        failed_check(worst, what)

    def not_run(what: str) -> None:
        count, first = worst.get("not run", (0, what))
        worst["not run"] = (count + 1, first)

    def out_of_time(what: str) -> bool:
        if budget.left() > 0:
            return False
        print(f"{what}: not run, the budget ran out", flush=True)
        not_run(what)
        return True

    def settle(what: str, ok: bool) -> None:
        """A check that failed as the budget ran out was stopped by it (its deadline is the time left)."""
        if ok:
            return
        if budget.left() <= 1:
            print(f"{what}: stopped at the budget's end", flush=True)
            not_run(what)
        else:
            failed(what)

    def deadline() -> float:
        return min(args.trial_deadline, budget.left())

    shapes = load_model_config("llama3-8b")
    shapes.setdefault("_name", "llama3-8b")
    base = hardware_name if device == "cuda" else args.calibration_base
    if not out_of_time("calibration"):
        lines = calibration_check(device, base, stand_in(shapes) if device == "cpu" else shapes, deadline())
        print("\n".join(lines), flush=True)
        settle("calibration", not lines[0].startswith("calibration: FAILED"))
    lacking = sorted({"typer", "rich", "pyarrow"} & missing)
    if lacking:
        print(f"trainer (autotune run): skipped, {', '.join(lacking)} missing", flush=True)
    elif not out_of_time("trainer (autotune run)"):
        lines, spread = trainer_check(device, hardware_name, deadline())
        print("\n".join(lines), flush=True)
        settle("trainer", spread is not None)
        if spread is not None:
            note_ratio(worst, "trainer", 1 + spread, f"steps {TRAINER_SAVED + 1}-{TRAINER_STEPS}", device)
    if not out_of_time("memory timeline"):
        lines, ratio = timeline_check(rows[0], hardware, deadline())
        print("\n".join(lines), flush=True)
        settle("memory timeline", ratio is not None)
        if ratio is not None:
            note_ratio(worst, "timeline", ratio, rows[0]["name"], device)

    print_real_scale(rows, measured, hardware, worst, device)
    print(
        "\n'pred' columns: predicted / measured, at the model's whole depth (the reduced trial's copies extended"
        + (
            "). The CPU stands in for the GPU: a rehearsal, not a GPU result."
            if device == "cpu"
            else f"; 'over': the whole model does not fit the card's {hardware.device_memory_bytes / 2**30:.0f} GiB, "
            "compared all the same)."
        )
        + f" Wall time {time.perf_counter() - budget_start(budget):.0f} s."
    )
    return print_worst(worst, tests_status != "failed")


def failed_check(worst: dict, what: str) -> None:
    """One more config or check failed, ``what`` the example the summary names."""
    worst["failed"] = (worst.get("failed", (0,))[0] + 1, what)


def say_missing_kernels(device: str, worst: dict) -> None:
    """Each flash kernel this GPU runs that is not installed (``missing_kernels``), one line each, a failed check."""
    for line in missing_kernels(device):
        print(f"kernel missing: {line}", flush=True)
        failed_check(worst, line.split(":")[0] + " not installed")


def budget_start(budget: Budget) -> float:
    """The budget's start on ``time.perf_counter``'s clock."""
    return time.perf_counter() - (budget.clock() - budget.started)


def print_real_scale(rows: list[dict], measured: list[dict | None], hardware, worst: dict, device: str) -> None:
    """The 8b-reduced table; each compared row's ratios into ``worst``."""
    gib = 2**30
    print(
        f"\n{'config':<44} {'tokens':>8} {'status':<7} {'alloc GiB':>9} {'pred':>6} {'resv GiB':>9} {'pred':>6} "
        f"{'host GiB':>8} {'pred':>6} {'step s':>8} {'pred':>7} {'layers':>6}"
    )
    for row, real in zip(rows, measured):
        head = f"{row['name']:<44} {row['seq']:>8,}"
        if real is None:
            print(f"{head} budget  not run: the budget ran out")
            count, first = worst.get("not run", (0, row["name"]))
            worst["not run"] = (count + 1, first)
            continue
        if real["status"] == "skipped":
            print(f"{head} skipped {real['error']}")
            continue
        if real["status"] != "ok":
            print(f"{head} {real['status']:<7} {str(real.get('error'))[-400:]}")
            failed_check(worst, row["name"])
            continue
        predicted = real["predicted"]
        ratios = {
            key: _ratio(predicted[key], real[key])
            for key in ("peak_allocated_bytes", "peak_reserved_bytes", "host_bytes", "step_time_s")
        }
        for key, ratio in ratios.items():
            note_ratio(worst, key, ratio, row["name"], device)
        status = "over" if real["extended_over"] else "ok"
        print(
            f"{head} {status:<7} {real['peak_allocated_bytes'] / gib:9.3f} {ratios['peak_allocated_bytes']:6.3f} "
            f"{real['peak_reserved_bytes'] / gib:9.3f} {ratios['peak_reserved_bytes']:6.3f} "
            f"{real['host_bytes'] / gib:8.3f} {ratios['host_bytes'] or float('nan'):6.3f} "
            f"{real['step_time_s']:8.3f} {ratios['step_time_s']:7.3f} {real['measured_layers']:>3}->"
            f"{row['model_config']['num_hidden_layers']}",
            flush=True,
        )


LABELS = {
    "peak_allocated_bytes": "allocated peak (predicted / measured)",
    "peak_reserved_bytes": "reserved peak (predicted / measured)",
    "host_bytes": "host bytes (predicted / measured)",
    "step_time_s": "step time (predicted / measured)",
    "loss": "loss (1 + relative spread)",
    "grad_norm": "grad norm (1 + relative spread)",
    "trainer": "resumed training's loss (1 + relative difference from uninterrupted)",
    "timeline": "memory timeline's replayed peak / measured allocated peak",
}


def print_worst(worst: dict, tests_ok: bool) -> int:
    """The worst ratios, last; the exit code: 1 when a config or a check failed."""
    for key, label in LABELS.items():
        if key in worst:
            print(f"worst {label}: {worst[key][0]:.4f} ({worst[key][1]})")
    if "not run" in worst:
        print(f"not run: {worst['not run'][0]} config(s) or check(s) past the budget, e.g. {worst['not run'][1]}")
    for line in worst.get("out of band", []):
        print(f"OUT OF BAND: {line}")
    if "failed" in worst:
        print(f"FAILED: {worst['failed'][0]} config(s) or check(s), e.g. {worst['failed'][1]}")
    if not tests_ok:
        print("FAILED: the cuda tests (their summary is above the table)")
    return 1 if "failed" in worst or "out of band" in worst or not tests_ok else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("SPECS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--calibration", nargs=4, metavar=("DEVICE", "BASE", "SHAPES", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when visible")
    parser.add_argument(
        "--hardware",
        default=None,
        help="the preset predictions use (default: h100-sxm on cuda, its capacity the card's own; cpu on cpu)",
    )
    parser.add_argument("--scale", choices=SCALES, default="small", help="small (tiny model) or 8b-reduced")
    parser.add_argument("--model", default=None)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (a shallow copy of the model)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--gpus", type=int, default=None, help="ranks for the multi-rank configs (default: visible)")
    parser.add_argument(
        "--steps", type=int, default=None, help="measured steps after one warm-up (default: 2; 8b-reduced: 1)"
    )
    parser.add_argument(
        "--dtype", choices=("bf16", "fp32"), default=None, help="compute dtype (default: bf16 on cuda, fp32 on cpu)"
    )
    parser.add_argument(
        "--tests-deadline", type=float, default=3600.0, help="seconds the CUDA acceptance tests may take in all"
    )
    parser.add_argument("--trial-deadline", type=float, default=1800.0, help="seconds one config's trial may take")
    parser.add_argument(
        "--budget", type=float, default=None, help="8b-reduced: seconds in all; no config starts past them"
    )
    parser.add_argument(
        "--simulate-tests-s",
        type=float,
        default=None,
        help="--device cpu: a process of this many seconds stands in for the CUDA acceptance tests (the rehearsal "
        "of a GPU run's budget)",
    )
    parser.add_argument(
        "--calibration-base",
        default="h100-sxm",
        help="8b-reduced on cpu: the GPU preset whose assumed rates the CPU's measurements stand beside",
    )
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(*args.worker)
    if args.calibration:
        device, base, shapes, out = args.calibration
        lines = calibration_lines(device, base, json.loads(Path(shapes).read_text()))
        Path(out).write_text("\n".join(lines) + "\n")
        return 0
    problem = _options_problem(args)
    if problem:
        print(f"gpu_check: {problem}", file=sys.stderr)
        return 2
    line, missing, fatal = missing_packages()
    if fatal:
        print(line, file=sys.stderr)
        return 2
    if line:
        print(line, flush=True)
    if args.scale == "8b-reduced":
        return real_scale(args, missing)
    args.steps = args.steps or 2
    args.hardware = args.hardware or "h100-sxm"

    import dataclasses

    import torch

    from autotune.core.hardware import load_hardware
    from trials.models.config import load_model_config

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    defaults = DEFAULTS[device]
    model_name, layers, seq = (
        args.model or defaults["model"],
        args.layers or defaults["layers"],
        args.seq or defaults["seq"],
    )
    model_config = dict(load_model_config(model_name), num_hidden_layers=layers)
    if device == "cuda":
        world = args.gpus or torch.cuda.device_count()
        card = torch.cuda.get_device_properties(0)
        hardware = dataclasses.replace(load_hardware(args.hardware), device_memory_bytes=card.total_memory)
        from trials.kernels.sdpa_backend import here

        where = (
            f"{card.name} x{torch.cuda.device_count()} ({card.total_memory / 2**30:.2f} GiB each; SDPA runs {here()}), "
            f"preset {hardware.name}"
        )
    else:
        world = args.gpus or 2
        hardware = load_hardware("cpu")
        where = f"cpu (gloo, simulated device) x{world}, preset cpu"
    from trials.kernels.attention import flash_available, flash_problem

    flash = device == "cuda" and flash_available(torch.device("cuda"))
    rows = configs(world, device, seq, layers, flash)
    dtype = args.dtype or ("bf16" if device == "cuda" else "fp32")
    print(
        f"gpu_check: {model_name} with {layers} layers, {seq:,} tokens, {dtype} compute; {where}; "
        f"torch {torch.__version__}",
        flush=True,
    )
    if device == "cuda" and not flash:
        print(f"gpu_check: flash configs run sdpa: {flash_problem()}", flush=True)
    worst: dict = {}
    say_missing_kernels(device, worst)
    tests, tests_status = run_cuda_tests(args.tests_deadline)
    tests_ok = tests_status == "ok"
    print("\n".join(tests), flush=True)
    started = time.perf_counter()
    measured = run_real(rows, model_config, seq, device, args.steps, dtype, args.trial_deadline)
    print(f"real trials: {time.perf_counter() - started:.0f} s", flush=True)

    gib = 2**30
    header = (
        f"{'config':<34} {'status':<6} {'alloc GiB':>9} {'pred':>6} {'resv GiB':>9} {'pred':>6} "
        f"{'host GiB':>8} {'pred':>6} {'step s':>8} {'pred':>8} {'loss':>9} {'grad norm':>9}"
    )
    print(header)
    reference = None
    for row, real in zip(rows, measured):
        if real.get("status") != "ok":
            print(f"{row['name']:<34} {real.get('status', '?'):<6} {str(real.get('error'))[-400:]}")
            failed_check(worst, row["name"])
            continue
        try:
            predicted = predict_row(row, model_config, seq, hardware, dtype)
        except Exception as exc:  # a config the oracle cannot trace is a finding, not a crash of the check
            print(f"{row['name']:<34} ok     oracle failed: {type(exc).__name__}: {exc}")
            failed_check(worst, row["name"])
            continue
        reference = reference or real
        ratios = {
            key: _ratio(predicted[key], real[key])
            for key in ("peak_allocated_bytes", "peak_reserved_bytes", "host_bytes", "step_time_s")
        }
        ratios["loss"] = 1 + abs(real["loss"] - reference["loss"]) / abs(reference["loss"])
        ratios["grad_norm"] = 1 + abs(real["grad_norm"] - reference["grad_norm"]) / abs(reference["grad_norm"])
        for key, ratio in ratios.items():
            note_ratio(worst, key, ratio, row["name"], device)
        print(
            f"{row['name']:<34} ok     {real['peak_allocated_bytes'] / gib:9.3f} {ratios['peak_allocated_bytes']:6.3f} "
            f"{real['peak_reserved_bytes'] / gib:9.3f} {ratios['peak_reserved_bytes']:6.3f} "
            f"{real['host_bytes'] / gib:8.3f} {ratios['host_bytes'] or float('nan'):6.3f} "
            f"{real['step_time_s']:8.3f} {ratios['step_time_s']:8.3f} {real['loss']:9.5f} {real['grad_norm']:9.4f}",
            flush=True,
        )
    print(
        f"\n'pred' columns: predicted / measured. loss and grad norm: every config trains the same model on the same "
        f"data, so they agree with the first config to {dtype} rounding."
    )
    return print_worst(worst, tests_ok)


if __name__ == "__main__":
    sys.exit(main())
