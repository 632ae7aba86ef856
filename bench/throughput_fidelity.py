"""How well does the throughput model predict real CPU trials? Predicted / measured step time per config.

For each config (tiny models, 1-4 ranks, 1K-16K tokens, technique stacks):
- predicted: the ``plan`` backend (``autotune.backends.plan.PlanBackend``: the memory oracle's fake trace of the
  trial code with ``autotune.timing.counting.StepCounter`` inside, then ``predict_step_time``) on the preset that
  a fresh ``autotune calibrate --hardware cpu`` wrote first (``--preset FILE`` reuses one);
- measured: the real trial, ``trials.trial.runner.run_trial`` -- what ``autotune.backends.local.LocalBackend`` launches
  -- under ``torchrun --nproc-per-node N`` (or one plain process), gloo, fp32, with the local backend's thread
  count per rank (``cpus // N``). Every training step is timed, and the machine's CPU use by *other* processes is
  sampled around each step (/proc/stat minus this trial's own processes): a step during which others used more
  than 10% of the CPUs is contended and not used. The measured step time is the median clean step (after the
  runner's warm-up step) -- the median, not the fastest, because this machine's speed also drifts by +-20% with
  no other process visible (a shared host), and the calibration takes medians too. If no step of a launch is
  clean, the config is launched again (up to --attempts times).
- drift: this host's speed drifts by +-25% over minutes with nothing else running, so a calibration made at one
  moment and trials timed at another disagree by that much whatever the model. Two gauges run on every rank just
  before every step, each against its own value at the calibration: ``speed_probe_s`` (a fixed ~20 ms mix of
  matmuls, elementwise ops and tiny dispatches; 'slow') and the calibration's own in-step step re-timed
  (``autotune.timing.calibration.microbench.reference_step_s``: the same model, tokens and world as
  ``in_step.wall_s``; 'drift'). The raw ratio is the verdict; 'x drift' is the ratio with the drift divided out
  (predicted / measured in the calibration's time), printed beside it. 'spread' is (max - min) / max of the
  per-pass medians: the run-to-run spread of the measurement itself. The verdict lines give, raw and x drift,
  the count inside the band, the offset (geometric mean ratio: what a calibration taken at a faster or slower
  moment moves) and the scatter (standard deviation of the log ratios: the model's error between configs).

Prints one row per config with the ratio predicted / measured, the worst ratio last, and writes the same text
to bench/results/throughput_fidelity.txt. Goal: every ratio within [0.8, 1.25], from one fresh
`autotune calibrate` (written to bench/results/calibrated-cpu.yaml). The stored pair is the calibration the shipped
``cpu`` preset carries and its fidelity run: a default run replaces both, so either ship the new calibration
(bench/ship_cpu_calibration.py) or restore the pair from git.

    .venv/bin/python bench/throughput_fidelity.py            # calibrate, then 25 configs x 2 passes (~25 min)
    .venv/bin/python bench/throughput_fidelity.py --quick --passes 1   # 4 configs
    .venv/bin/python bench/throughput_fidelity.py --preset bench/results/calibrated-cpu.yaml --only ring documents
        # the 4 ring and 4 packed-document configs on the shipped calibration, into
        # bench/results/throughput_fidelity_ring_documents.txt (the 25 configs' table stays)
    .venv/bin/python bench/throughput_fidelity.py --summarize bench/results/throughput_fidelity.txt \\
        > bench/results/throughput_fidelity_summary.txt
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# (model, seq_len, ranks, techniques). The first 13 are the configs the time model was developed against; the
# rest are deliberately unlike them and unlike the calibration's shapes (its in-step model runs 2,048
# tokens, its attention kernels 2,048 tokens at 8 heads): other lengths (1.5K-16K, not powers of two), head
# chunks, tile sizes from 512 to 4K, 4 ranks (two per core), optimizer and activation offload.
CONFIGS = [
    ("tiny-llama", 1024, 1, {}),
    ("tiny-llama", 4096, 1, {}),
    ("tiny-qwen3", 2048, 1, {"activation_checkpointing": True}),
    ("tiny-llama", 8192, 1, {"activation_checkpointing": True}),
    ("tiny-llama", 4096, 1, {"activation_checkpointing": True, "mlp_tile_tokens": 1024, "loss_tile_tokens": 1024}),
    (
        "tiny-qwen3",
        4096,
        1,
        {"fsdp": True, "optimizer_offload": True, "activation_checkpointing": True, "activation_offload_layers": 4},
    ),
    ("tiny-llama", 2048, 2, {"ulysses_degree": 2}),
    ("tiny-llama", 8192, 2, {"ulysses_degree": 2, "activation_checkpointing": True}),
    ("tiny-qwen3", 4096, 2, {"fsdp": True}),
    ("tiny-llama", 4096, 2, {"ulysses_degree": 2, "head_chunk": 1, "fsdp": True}),
    (
        "tiny-qwen3",
        2048,
        2,
        {
            "fsdp": True,
            "optimizer_offload": True,
            "ulysses_degree": 2,
            "activation_checkpointing": True,
            "activation_offload_layers": 4,
        },
    ),
    ("tiny-llama", 1024, 2, {"fsdp": True, "activation_checkpointing": True}),
    ("tiny-qwen3", 4096, 1, {"activation_checkpointing": True, "norm_tile_tokens": 1024}),
    # -- unlike the calibration's shapes --
    ("tiny-llama", 3072, 1, {"activation_checkpointing": True, "mlp_tile_tokens": 512, "loss_tile_tokens": 512}),
    ("tiny-qwen3", 6144, 1, {"activation_checkpointing": True, "activation_offload_layers": 2}),
    ("tiny-llama", 12288, 1, {"activation_checkpointing": True, "norm_tile_tokens": 2048, "loss_tile_tokens": 4096}),
    ("tiny-llama", 1536, 1, {"fsdp": True, "optimizer_offload": True}),
    ("tiny-llama", 6144, 2, {"ulysses_degree": 2, "activation_checkpointing": True}),
    (
        "tiny-llama",
        5120,
        2,
        {
            "ulysses_degree": 2,
            "head_chunk": 1,
            "fsdp": True,
            "activation_checkpointing": True,
            "mlp_tile_tokens": 2048,
            "loss_tile_tokens": 512,
        },
    ),
    ("tiny-qwen3", 6144, 2, {"ulysses_degree": 2, "head_chunk": 2, "activation_checkpointing": True}),
    (
        "tiny-qwen3",
        3072,
        2,
        {
            "fsdp": True,
            "optimizer_offload": True,
            "activation_checkpointing": True,
            "activation_offload_layers": 4,
            "mlp_tile_tokens": 1024,
        },
    ),
    (
        "tiny-llama",
        16384,
        2,
        {
            "ulysses_degree": 2,
            "head_chunk": 1,
            "activation_checkpointing": True,
            "norm_tile_tokens": 4096,
            "loss_tile_tokens": 2048,
        },
    ),
    ("tiny-llama", 2048, 4, {"ulysses_degree": 2, "fsdp": True}),
    ("tiny-qwen3", 4096, 4, {"ulysses_degree": 4, "activation_checkpointing": True}),
    ("tiny-llama", 3072, 4, {"fsdp": True, "activation_checkpointing": True}),
    # -- ring attention (issue 49): its K/V steps around the ring, on 2 and 4 ranks --
    ("tiny-llama", 4096, 2, {"ring_degree": 2}),
    ("tiny-qwen3", 6144, 2, {"ring_degree": 2, "activation_checkpointing": True}),
    ("tiny-llama", 4096, 4, {"ulysses_degree": 2, "ring_degree": 2}),
    ("tiny-llama", 4096, 2, {"ring_degree": 2, "head_chunk": 2}),
    # -- packed documents (issue 50): attention inside each document ("documents": their length, as --documents) --
    ("tiny-llama", 4096, 1, {"documents": 1024}),
    ("tiny-llama", 8192, 2, {"documents": 2048, "ulysses_degree": 2}),
    ("tiny-llama", 8192, 2, {"documents": 1024, "ulysses_degree": 2, "head_chunk": 1}),
    (
        "tiny-qwen3",
        6144,
        1,
        {"documents": 1536, "activation_checkpointing": True, "mlp_tile_tokens": 1024, "loss_tile_tokens": 1024},
    ),
]
NEW_FROM = 13  # CONFIGS[NEW_FROM:] are the ones no calibration or model change was tuned on
# the configs ``--only`` names by group: the rings and the packed documents (each measured alone, stored apart)
GROUPS = {
    "ring": [i for i, config in enumerate(CONFIGS) if config[3].get("ring_degree", 1) > 1],
    "documents": [i for i, config in enumerate(CONFIGS) if "documents" in config[3]],
}
MAIN = [c for i, c in enumerate(CONFIGS) if not any(i in group for group in GROUPS.values())]  # a default run's
RING_DOCUMENTS_TABLE = REPO / "bench" / "results" / "throughput_fidelity_ring_documents.txt"
RANGE = (0.8, 1.25)  # the goal: predicted / measured step time
QUICK = [CONFIGS[0], CONFIGS[3], CONFIGS[6], CONFIGS[8]]
CONTENDED = 0.10  # others' share of the machine's CPUs above which a step does not count


# -----------------------------------------------------------------------------------------------------------
# The measuring worker (one per rank): the trial runner, with every step timed and checked for contention
# -----------------------------------------------------------------------------------------------------------


def worker(spec_path: str, out_dir: str) -> None:
    import torch.distributed as dist

    import trials.trial.runner
    from autotune.timing.calibration import sampling
    from autotune.timing.calibration.microbench import in_step_training, reference_step_s
    from autotune.timing.calibration.sampling import cpu_snapshot, others_share, speed_probe_s
    from trials.trial.runner import run_trial
    from trials.trial.spec import TrialSpec

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    pids = [os.getpid()]
    if world > 1:
        gathered = [None] * world
        dist.all_gather_object(gathered, os.getpid())
        pids = gathered
    sampling.WORKER_PIDS[:] = pids  # this trial's own processes: what they use is not contention
    steps = []
    original = trials.trial.runner.train_step  # the step the runner calls
    reference = []  # the calibration's in-step run, built at the first step (all ranks step it together)

    def timed_step(*args, **kwargs):
        before = cpu_snapshot()
        probe = speed_probe_s()  # the host's speed right now, in the calibration's units (see measure)
        if not reference:  # (both run outside the trial's memory tracker: the reference has its own)
            reference.append(in_step_training())
        reference_s = reference_step_s(reference[0])  # the calibration's in-step step, now (see the docstring)
        start = time.perf_counter()
        result = original(*args, **kwargs)
        elapsed = time.perf_counter() - start
        others = others_share(before, cpu_snapshot())
        steps.append({"seconds": elapsed, "others": others, "probe_s": probe, "reference_s": reference_s})
        return result

    trials.trial.runner.train_step = timed_step
    try:
        record = run_trial(TrialSpec.from_dict(spec)).to_dict()
    finally:
        trials.trial.runner.train_step = original
    record["steps"] = steps
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(record))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


# -----------------------------------------------------------------------------------------------------------
# The driver
# -----------------------------------------------------------------------------------------------------------


def trial_spec(model: str, seq_len: int, techniques: dict, steps: int) -> dict:
    """The trial a config launches (``trials.trial.spec.TrialSpec`` as a dict): its knobs, its packed documents."""
    from trials.models.config import load_model_config

    knobs, documents = split_documents(techniques)
    return {
        "model_config": load_model_config(model),
        "techniques": knobs,
        "documents": list(documents.lengths),
        "seq_len": seq_len,
        "steps": steps,
        "warmup": 1,
        "capacity_bytes": None,
        "seed": 0,
    }


def measure(model: str, seq_len: int, ranks: int, techniques: dict, steps: int, attempts: int) -> dict:
    """Launch the trial (as the local backend does) until a launch has clean steps; its steps, clean and contended."""
    from autotune.timing.calibration.sampling import wait_for_idle
    from trials.core import allocator

    spec = trial_spec(model, seq_len, techniques, steps)
    clean, contended, last_error = [], [], None
    for _attempt in range(attempts):
        wait_for_idle(0.05, 120)
        with tempfile.TemporaryDirectory(prefix="autotune-fidelity-") as tmp:
            spec_path = Path(tmp) / "spec.json"
            spec_path.write_text(json.dumps(spec))
            env = dict(
                allocator.trial_environment(dict(os.environ), cpu=True),  # as the local backend launches it
                OMP_NUM_THREADS=str(max(1, (os.cpu_count() or 1) // ranks)),
                PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            )
            me = [sys.executable, str(Path(__file__).resolve()), "--worker", str(spec_path), tmp]
            if ranks > 1:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] + me[
                    1:
                ]
            else:
                cmd = me
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            path = Path(tmp) / "rank0.json"
            if not path.exists():
                last_error = (proc.stdout + proc.stderr)[-1500:]
                continue
            record = json.loads(path.read_text())
        if record.get("status") != "ok":
            last_error = record.get("error")
            break
        measured = record["steps"][1:]  # the runner's first step is its warm-up
        clean += [s for s in measured if s["others"] <= CONTENDED]
        contended += [s for s in measured if s["others"] > CONTENDED]
        if clean:
            break
    if not clean and not contended:
        return {"error": last_error or "no record"}
    return {"clean": clean, "contended": contended, "runner_mean_s": record.get("step_time_s")}


def _median_over(steps: list[dict], gauge: str, at_calibration_s: float | None) -> float:
    """The median over ``steps`` of a drift gauge's seconds over its seconds at the calibration (1 if not recorded)."""
    return statistics.median(s[gauge] / at_calibration_s if at_calibration_s else 1.0 for s in steps)


def _combine(launches: list[dict], probe_calibrated_s: float | None, reference_calibrated_s: float | None) -> dict:
    """The median clean step over all launches of a config (all steps if none was clean); ``spread``, (max - min)
    / max of the launches' own medians; ``slowdown``, the median speed probe over its time at the calibration;
    ``drift``, the median reference step over its time at the calibration (see the module docstring)."""
    measured = [m for m in launches if "error" not in m]
    clean = [t for m in measured for t in m["clean"]]
    contended = [t for m in measured for t in m["contended"]]
    if not clean and not contended:
        return next(m for m in launches if "error" in m)
    steps = clean or contended
    per_launch = [
        statistics.median(s["seconds"] for s in (m["clean"] or m["contended"]))
        for m in measured
        if m["clean"] or m["contended"]
    ]
    return {
        "step_time_s": statistics.median(s["seconds"] for s in steps),
        "spread": (max(per_launch) - min(per_launch)) / max(per_launch),
        "slowdown": _median_over(steps, "probe_s", probe_calibrated_s),
        "drift": _median_over(steps, "reference_s", reference_calibrated_s),
        "clean_steps": len(clean),
        "contended_steps": len(contended),
    }


def predict(model: str, seq_len: int, ranks: int, techniques: dict, hardware):
    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend, step_counts
    from autotune.timing.model import predict_step_time
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    cfg = load_model_config(model)
    knobs, documents = split_documents(techniques)
    tech = Techniques.from_dict(knobs, cfg["num_hidden_layers"])
    backend = PlanBackend()
    evaluation = Evaluation(cfg, tech, seq_len, ranks, hardware, documents=documents)
    record = backend.evaluate(evaluation)
    counts = step_counts(backend.last_prediction) if record.step_time_s is not None else None
    timing = (
        predict_step_time(counts, hardware.rates_for(ranks), ranks, tech, seq_len=seq_len)
        if counts is not None
        else None
    )
    return record, timing, counts


def split_documents(techniques: dict):
    """A config's knobs and its packed documents (``DocumentsSpec``): its ``documents`` entry, a length as
    ``--documents LEN`` takes it, is no knob; without it, one document per sequence."""
    from trials.kernels.documents import ONE, DocumentsSpec

    knobs = {k: v for k, v in techniques.items() if k != "documents"}
    return knobs, DocumentsSpec((techniques["documents"],)) if "documents" in techniques else ONE


def _rank_wait_note(world: dict) -> str:
    """The fitted rank wait of a world: per collective call (``collective_wait_s``), or, in calibrations before it,
    the share of compute (``rank_imbalance``)."""
    if "collective_wait_s" in world:
        return (
            f" (collective_wait {world['collective_wait_s'] * 1e3:.2f} ms x "
            f"{world.get('in_step', {}).get('collective_calls', '?')} calls)"
        )
    return f" (rank_imbalance {world.get('rank_imbalance', 0.0):.3f})"


def _self_check(calibration: dict) -> str:
    """The calibration's own check: each world's in-step training step predicted from the rates it measured, over
    that step's measured wall time. On several ranks the rank wait is then fitted to that residual, so 1 rank
    is the real check; a world far below 1 (a fast rank 0 beside a slow peer) says its rates are optimistic."""
    from autotune.timing.calibration import self_check

    parts = []
    for world, data in sorted(calibration["worlds"].items(), key=lambda item: int(item[0])):
        in_step = data.get("in_step", {})
        if in_step.get("wall_s") and in_step.get("predicted_s"):
            parts.append(
                f"{world} rank(s) {in_step['predicted_s']:.4f} s / {in_step['wall_s']:.4f} s = "
                f"{self_check(data):.2f}"
                + (_rank_wait_note(data) if int(world) > 1 else "")
                + _repeats_note(calibration.get("repeats", {}).get(world))
            )
    if not parts:
        return "# calibration self-check: not recorded (an older calibration)"
    return "# calibration self-check, its in-step step predicted / measured: " + "; ".join(parts)


def _repeats_note(repeats: dict | None) -> str:
    """Which of a world's calibration runs was kept, beside every run's self-check (a calibration that
    merged the best of each number across runs records nothing here)."""
    if not repeats:
        return ""
    return " [runs " + "/".join(f"{c:.2f}" for c in repeats["self_checks"]) + f", run {repeats['kept']} kept]"


class Row(NamedTuple):
    """One config's result as the verdict takes it."""

    ratio: float  # predicted / measured step time
    label: str
    new: bool  # one of the configs unlike the calibration's shapes
    x_drift: float | None  # ratio with the drift divided out (None: a table from before the drift gauge)
    measured_s: float
    ranks: int


def summary_lines(rows: list[Row]) -> list[str]:
    """The verdict on ``rows``: how many lie in ``RANGE``, raw and with the drift divided out, and each column's
    offset (geometric mean ratio) and scatter (standard deviation of the log ratios, ~ the relative spread).
    Offset is what a calibration taken at a faster or slower moment than the trials moves; scatter is the model's
    own error between configs (plus measurement noise). Then how the raw ratio leans with the step's length: the
    correlation of log ratio with log measured seconds, and the median ratio over the offset of short (< 1 s) and
    long (> 3 s) steps; then the ratios per world size, and on a gauged table each world's x drift and drift and the
    checkpointed configs' x drift against the plain ones'."""
    low, high = RANGE
    out = []
    for title, values, new in (
        ("raw ratios", [r.ratio for r in rows], [r.ratio for r in rows if r.new]),
        ("x drift", [r.x_drift for r in rows], [r.x_drift for r in rows if r.new]),
    ):
        if None in values:  # a table from before the drift gauge
            continue
        logs = [math.log(v) for v in values]
        scatter = statistics.stdev(logs) if len(logs) > 1 else 0.0
        out.append(
            f"# {title}: {sum(low <= v <= high for v in values)}/{len(values)} within [{low}, {high}] "
            f"({sum(low <= v <= high for v in new)}/{len(new)} of the new configs); {min(values):.2f}-"
            f"{max(values):.2f}, offset {math.exp(statistics.fmean(logs)):.2f}, scatter {scatter:.3f}"
        )
    logs = [math.log(r.ratio) for r in rows]
    lengths = [math.log(r.measured_s) for r in rows]
    if len(rows) > 2 and statistics.pstdev(lengths) and statistics.pstdev(logs):
        offset = math.exp(statistics.fmean(logs))
        short = [r.ratio / offset for r in rows if r.measured_s < 1.0]
        long_ = [r.ratio / offset for r in rows if r.measured_s > 3.0]
        out.append(
            f"# lean with length (raw): correlation of log ratio with log measured step "
            f"{statistics.correlation(lengths, logs):.2f}; ratio / offset, median of steps < 1 s "
            f"{statistics.median(short) if short else float('nan'):.2f} ({len(short)}), > 3 s "
            f"{statistics.median(long_) if long_ else float('nan'):.2f} ({len(long_)})"
        )
    # each world size is priced from its own calibrated world, so a world the calibration got wrong shows here
    worlds = sorted({r.ranks for r in rows})
    out.append(
        "# by world (raw): "
        + "; ".join(
            f"{w} rank(s) {min(v):.2f}-{max(v):.2f}, median {statistics.median(v):.2f} ({len(v)})"
            for w in worlds
            for v in [[r.ratio for r in rows if r.ranks == w]]
        )
    )
    if all(r.x_drift is not None for r in rows):  # gauged tables: where each world and kind of config sits in
        # calibration time, and how far the host had moved for it
        out.append(
            "# by world (x drift): "
            + "; ".join(
                f"{w} rank(s) median {statistics.median(r.x_drift for r in v):.2f} at drift "
                f"{min(r.x_drift / r.ratio for r in v):.2f}-{max(r.x_drift / r.ratio for r in v):.2f} "
                f"(median {statistics.median(r.x_drift / r.ratio for r in v):.2f})"
                for w in worlds
                for v in [[r for r in rows if r.ranks == w]]
            )
        )
        checkpointed = [r.x_drift for r in rows if "ckpt" in r.label.split()[-1].split("+")]
        plain = [r.x_drift for r in rows if "ckpt" not in r.label.split()[-1].split("+")]
        if checkpointed and plain:
            out.append(
                f"# checkpointed / plain (x drift): median {statistics.median(checkpointed):.2f} "
                f"({len(checkpointed)}) / {statistics.median(plain):.2f} ({len(plain)})"
            )
    worst = max(rows, key=lambda r: max(r.ratio, 1 / r.ratio))
    out.append(f"worst (raw): {worst.label}  ratio {worst.ratio:.2f}")
    return out


def read_rows(table: Path) -> list[Row]:
    """The rows of a table this bench wrote (``--summarize``), as ``summary_lines`` takes them."""
    names = [label(*config) for config in CONFIGS]
    columns, rows = [], []
    for line in table.read_text().splitlines():
        if line.startswith("config "):  # measured_s spread slow [drift] predicted_s ratio ... (older tables: no drift)
            header = line.split()[1:]
            columns = header[: header.index("ratio")]
        name = next((n for n in names if line.startswith(n + " ")), None)
        if name is None or " error: " in line:
            continue
        value = dict(zip(columns, (float(x) for x in line[len(name) :].split())))
        # the ratio again from the two times (4 decimals), where the ratio column's 2 would put 0.7955 inside as 0.80
        ratio = value["predicted_s"] / value["measured_s"]
        rows.append(
            Row(
                ratio,
                name,
                names.index(name) >= NEW_FROM,
                ratio * value["drift"] if "drift" in value else None,
                value["measured_s"],
                CONFIGS[names.index(name)][2],
            )
        )
    return rows


def label(model: str, seq_len: int, ranks: int, techniques: dict) -> str:
    return f"{model} {seq_len // 1024}K x{ranks} {describe(techniques)}"


def describe(techniques: dict) -> str:
    short = {
        "activation_checkpointing": "ckpt",
        "ulysses_degree": "sp",
        "optimizer_offload": "optoff",
        "activation_offload_layers": "actoff",
        "mlp_tile_tokens": "mlptile",
        "loss_tile_tokens": "losstile",
        "head_chunk": "chunk",
        "fsdp": "fsdp",
        "ring_degree": "ring",
        "documents": "docs",
    }
    parts = []
    for key, value in techniques.items():
        name = short.get(key, key)
        parts.append(name if value is True else f"{name}{value}")
    return "+".join(parts) or "baseline"


def selected(words: list[str] | None) -> list[int]:
    """The config indices ``--only`` names (indices or group names, in order, each once); ``ValueError`` (one
    line) for a word that is neither."""
    indices: list[int] = []
    for word in words or []:
        if word in GROUPS:
            picked = GROUPS[word]
        elif word.isdigit() and int(word) < len(CONFIGS):
            picked = [int(word)]
        else:
            raise ValueError(f"--only {word!r}: a config index 0-{len(CONFIGS) - 1} or a group ({', '.join(GROUPS)})")
        indices += [i for i in picked if i not in indices]
    return indices


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 configs")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="INDEX|GROUP",
        help="only these configs: 0-based indices into CONFIGS (e.g. to re-measure an outlier) or the groups "
        f"{' and '.join(GROUPS)} (their table goes to {RING_DOCUMENTS_TABLE.relative_to(REPO)} unless --out)",
    )
    parser.add_argument("--steps", type=int, default=5, help="measured steps per launch (after 1 warm-up)")
    parser.add_argument("--attempts", type=int, default=4, help="launches per config when every step is contended")
    parser.add_argument("--passes", type=int, default=2, help="launches per config, in separate passes")
    parser.add_argument(
        "--preset",
        default=None,
        help="a preset `autotune calibrate` wrote; default: calibrate this machine now (fresh)",
    )
    parser.add_argument(
        "--calibration-runs",
        type=int,
        default=2,
        help="calibration runs per world (`autotune calibrate --repeats`: one whole run is kept)",
    )
    parser.add_argument("--out", default=None, help="the table (default: bench/results/throughput_fidelity.txt)")
    parser.add_argument("--summarize", metavar="TABLE", help="print the verdict lines of a table this bench wrote")
    parser.add_argument("--worker", nargs=2, metavar=("SPEC", "OUT_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    try:
        only = selected(args.only)
    except ValueError as exc:
        parser.error(str(exc))
    if args.out is None:
        grouped = args.only and all(word in GROUPS for word in args.only)
        args.out = str(RING_DOCUMENTS_TABLE if grouped else REPO / "bench" / "results" / "throughput_fidelity.txt")
    if args.summarize:
        if not Path(args.summarize).is_file():
            parser.error(f"no table at {args.summarize}")
        print("\n".join(summary_lines(read_rows(Path(args.summarize)))))
        return 0

    from autotune.core.hardware import load_hardware

    started = time.time()
    # predictions and measurements side by side: one fresh `autotune calibrate`, not hours ago (this shared
    # host's speed drifts); several runs per world, the one whose rates best predict its own step kept: one run
    # can come out 1.6x (kernels) or 3x (gloo) slow
    preset = Path(args.preset) if args.preset else REPO / "bench" / "results" / "calibrated-cpu.yaml"
    if not args.preset:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "autotune.cli",
                "calibrate",
                "--hardware",
                "cpu",
                "-o",
                str(preset),
                "--repeats",
                str(args.calibration_runs),
            ],
            check=True,
            cwd=REPO,
        )
    hardware = load_hardware(str(preset))
    cal = hardware.calibration
    lines = [
        f"# throughput model fidelity on this machine ({cal['machine']['cpu']}, {cal['machine']['cpus']} CPUs, "
        f"torch {cal['machine']['torch']}); preset {preset.name} from `autotune calibrate` "
        f"{hardware.calibrated['measured_at']}",
        "# predicted: plan backend (oracle fake trace + StepCounter + predict_step_time) on that preset",
        "# measured: trials.trial.runner.run_trial under torchrun, gloo, fp32; median uncontended step over the passes;",
        "#   spread: (max - min) / max of the passes' medians; slow: the speed probe now / at the calibration;",
        "#   drift: the calibration's in-step reference step now / at the calibration, beside every step;",
        "#   ratio = predicted / measured; x drift = ratio * drift (predicted / measured in the calibration's time)",
        _self_check(cal),
        f"{'config':60s} {'measured_s':>10s} {'spread':>6s} {'slow':>5s} {'drift':>5s} {'predicted_s':>11s} "
        f"{'ratio':>6s} {'x drift':>7s}  clean  predicted breakdown",
    ]
    print("\n".join(lines), flush=True)
    rows = []
    configs = [CONFIGS[i] for i in only] if only else QUICK if args.quick else MAIN
    # every config is launched once per pass, the passes minutes apart: this machine's speed drifts over time
    passes: list[list[dict]] = [[] for _ in configs]
    for pass_index in range(args.passes):
        for index, (model, seq_len, ranks, techniques) in enumerate(configs):
            # progress on stderr: the table comes after the last pass, ~35 minutes in on the full set
            print(
                f"pass {pass_index + 1}/{args.passes}, config {index + 1}/{len(configs)}: "
                f"{label(model, seq_len, ranks, techniques)}",
                file=sys.stderr,
                flush=True,
            )
            passes[index].append(measure(model, seq_len, ranks, techniques, args.steps, args.attempts))
    for index, (model, seq_len, ranks, techniques) in enumerate(configs):
        name = label(model, seq_len, ranks, techniques)
        record, timing, _ = predict(model, seq_len, ranks, techniques, hardware)
        world = max(int(k) for k in cal["worlds"] if int(k) <= ranks)
        calibrated = cal["worlds"][str(world)]
        measured = _combine(passes[index], calibrated.get("probe_s"), calibrated.get("in_step", {}).get("wall_s"))
        if "error" in measured or record.step_time_s is None:
            line = f"{name:60s} error: {(measured.get('error') or record.error or 'no prediction')[-300:]}"
            print(line, flush=True)
            lines.append(line)
            continue
        ratio = record.step_time_s / measured["step_time_s"]
        rows.append(
            Row(
                ratio,
                name,
                CONFIGS.index(configs[index]) >= NEW_FROM,
                ratio * measured["drift"],
                measured["step_time_s"],
                ranks,
            )
        )
        parts = (
            (
                f"c {timing.compute_s:.3f} r {timing.recompute_s:.3f} comm {timing.exposed_comm_s:.3f} "
                f"(wait {timing.detail['rank_wait_s']:.3f}) "
                f"host {timing.exposed_host_s:.3f} opt {timing.optimizer_s:.3f}"
            )
            if timing
            else ""
        )
        line = (
            f"{name:60s} {measured['step_time_s']:10.4f} {measured['spread']:6.2f} {measured['slowdown']:5.2f} "
            f"{measured['drift']:5.3f} {record.step_time_s:11.4f} {ratio:6.2f} {ratio * measured['drift']:7.2f}  "
            f"{measured['clean_steps']}/{measured['clean_steps'] + measured['contended_steps']}    {parts}"
        )
        print(line, flush=True)
        lines.append(line)
    if rows:
        summary = summary_lines(rows) + [f"# took {time.time() - started:.0f} s"]
        lines += summary
        print("\n".join(summary))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
