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
"""

from __future__ import annotations

import argparse
import gc
import json
import os
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


def run_cuda_tests(deadline_s: float) -> tuple[list[str], bool]:
    """(the summary's lines, whether none failed): ``pytest -m cuda`` over ``tests/test_cuda_*.py`` in a
    subprocess killed at ``deadline_s``, its outcomes read from pytest's JUnit XML."""
    import glob
    import xml.etree.ElementTree as ET

    files = sorted(os.path.relpath(f, ROOT) for f in glob.glob(str(ROOT / CUDA_TESTS)))
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-check-tests-") as work:
        report = Path(work, "junit.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "cuda", "-rs"]
        command += [f"--junitxml={report}", *files]
        returncode, output = run_with_deadline(
            command, deadline_s, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT))
        )
        seconds = time.perf_counter() - started
        if returncode is None or not report.exists():
            tail = "\n".join(output.splitlines()[-20:])
            why = f"past its deadline of {deadline_s:.0f} s" if returncode is None else f"exit {returncode}, no report"
            return [f"cuda tests (pytest -m cuda {CUDA_TESTS}): FAILED to finish ({why}); last output:", tail], False
        outcomes: dict[str, list[str]] = {"passed": [], "failed": [], "skipped": []}
        for case in ET.parse(report).getroot().iter("testcase"):
            name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            failed = case.find("failure") if case.find("failure") is not None else case.find("error")
            skipped = case.find("skipped")
            if failed is not None:
                message = ((failed.get("message") or "").strip().splitlines() or [failed.tag])[0]
                outcomes["failed"].append(f"{name}: {message[:200]}")
            elif skipped is not None:
                outcomes["skipped"].append(f"{name} ({(skipped.get('message') or '').strip()[:200]})")
            else:
                outcomes["passed"].append(name)
    # pytest exits 5 when the marker selects nothing: no acceptance tests is a failed check too
    ok = returncode == 0 and not outcomes["failed"] and any(outcomes.values())
    lines = [
        f"cuda tests (pytest -m cuda {CUDA_TESTS}, {seconds:.0f} s): "
        + ", ".join(f"{len(names)} {outcome}" for outcome, names in outcomes.items())
    ]
    for outcome, names in outcomes.items():
        lines += [f"  {outcome}: {name}" for name in names]
    if returncode != 0 and not outcomes["failed"]:
        lines.append(f"  pytest exited {returncode}: " + " | ".join(output.strip().splitlines()[-3:]))
    return lines, ok


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("SPECS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda when visible")
    parser.add_argument("--hardware", default="h100-sxm", help="the GPU's preset (its capacity is the card's own)")
    parser.add_argument("--model", default=None)
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (a shallow copy of the model)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--gpus", type=int, default=None, help="ranks for the multi-rank configs (default: visible)")
    parser.add_argument("--steps", type=int, default=2, help="measured steps after one warm-up")
    parser.add_argument(
        "--dtype", choices=("bf16", "fp32"), default=None, help="compute dtype (default: bf16 on cuda, fp32 on cpu)"
    )
    parser.add_argument(
        "--tests-deadline", type=float, default=3600.0, help="seconds the CUDA acceptance tests may take in all"
    )
    parser.add_argument("--trial-deadline", type=float, default=1800.0, help="seconds one config's trial may take")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(*args.worker)

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
        where = f"{card.name} x{torch.cuda.device_count()} ({card.total_memory / 2**30:.2f} GiB each), preset {hardware.name}"
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
    tests, tests_ok = run_cuda_tests(args.tests_deadline)
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
    worst: dict[str, tuple] = {}
    reference = None
    for row, real in zip(rows, measured):
        if real.get("status") != "ok":
            print(f"{row['name']:<34} {real.get('status', '?'):<6} {str(real.get('error'))[-400:]}")
            worst["failed"] = (worst.get("failed", (0,))[0] + 1, row["name"])
            continue
        try:
            predicted = predict_row(row, model_config, seq, hardware, dtype)
        except Exception as exc:  # a config the oracle cannot trace is a finding, not a crash of the check
            print(f"{row['name']:<34} ok     oracle failed: {type(exc).__name__}: {exc}")
            worst["failed"] = (worst.get("failed", (0,))[0] + 1, row["name"])
            continue
        reference = reference or real
        ratios = {
            key: _ratio(predicted[key], real[key])
            for key in ("peak_allocated_bytes", "peak_reserved_bytes", "host_bytes", "step_time_s")
        }
        ratios["loss"] = 1 + abs(real["loss"] - reference["loss"]) / abs(reference["loss"])
        ratios["grad_norm"] = 1 + abs(real["grad_norm"] - reference["grad_norm"]) / abs(reference["grad_norm"])
        for key, ratio in ratios.items():
            if ratio is not None and (key not in worst or abs(ratio - 1) > abs(worst[key][0] - 1)):
                worst[key] = (ratio, row["name"])
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
    labels = {
        "peak_allocated_bytes": "allocated peak (predicted / measured)",
        "peak_reserved_bytes": "reserved peak (predicted / measured)",
        "host_bytes": "host bytes (predicted / measured)",
        "step_time_s": "step time (predicted / measured)",
        "loss": "loss (1 + relative spread)",
        "grad_norm": "grad norm (1 + relative spread)",
    }
    for key, label in labels.items():
        if key in worst:
            print(f"worst {label}: {worst[key][0]:.4f} ({worst[key][1]})")
    if "failed" in worst:
        print(f"FAILED: {worst['failed'][0]} config(s), e.g. {worst['failed'][1]}")
    if not tests_ok:
        print("FAILED: the cuda tests (their summary is above the table)")
    return 1 if "failed" in worst or not tests_ok else 0


if __name__ == "__main__":
    sys.exit(main())
