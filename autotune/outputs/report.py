"""The search's output folder: trials.parquet, pareto.json, pareto.png, memory.png, pareto.html, best.json.

``trials.parquet`` schema — one row per finished trial, one column per knob and per record field:
    trial (int), answered_by (str: local | plan | cache | monotone | oracle),
    one column per knob of ``trials.techniques.Techniques`` (bool, int -- head_chunk null = plain Ulysses -- or
    str, from the knob's kind), seq_len (int), status, source (str), tokens_per_s, step_time_s (float),
    peak_device_bytes, peak_allocated_bytes, peak_reserved_bytes, host_bytes (int), breakdown_<category> (int, one per category of
    autotune.core.record.BREAKDOWN_CATEGORIES), loss, grad_norm (float), device, error (str).
``pareto.json`` carries ``"schema": "autotune/pareto-v1"``.
A predicted ``oom`` row whose trace ran in full keeps ``tokens_per_s`` / ``step_time_s`` as the rate it would have
had with the memory (a what-if); the search's objective, the front and the log count only ``ok`` rows' rates.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from trials.config_file import TrialConfig
from trials.techniques import BASELINE, Techniques, knob_names, knobs
from autotune import search
from autotune.core.record import BREAKDOWN_CATEGORIES, ResultRecord
from autotune.outputs.exporters import FRONT_SCHEMA
from autotune.outputs.plots import knob_label, plot_memory, plot_pareto, write_pareto_html

_ARROW_TYPES = {"bool": pa.bool_(), "int": pa.int64(), "tokens": pa.int64(), "choice": pa.string()}
KNOBS = knob_names()

_SCHEMA = pa.schema(
    [("trial", pa.int64()), ("answered_by", pa.string())]
    + [(k.name, _ARROW_TYPES[k.kind]) for k in knobs()]
    + [("seq_len", pa.int64()), ("status", pa.string()), ("source", pa.string()),
       ("tokens_per_s", pa.float64()), ("step_time_s", pa.float64()), ("peak_device_bytes", pa.int64()),
       ("peak_allocated_bytes", pa.int64()), ("peak_reserved_bytes", pa.int64()), ("host_bytes", pa.int64())]
    + [(f"breakdown_{c}", pa.int64()) for c in BREAKDOWN_CATEGORIES]
    + [("loss", pa.float64()), ("grad_norm", pa.float64()), ("device", pa.string()), ("error", pa.string())]
)


def trial_rows(study) -> list[dict]:
    rows = []
    for trial in search.finished_trials(study):
        record = trial.user_attrs["record"]
        row = {"trial": trial.number, "answered_by": trial.user_attrs.get("answered_by")}
        row.update({k: trial.user_attrs["techniques"].get(k, getattr(BASELINE, k)) for k in KNOBS})  # older studies lack new knobs
        row.update({k: record.get(k) for k in ("seq_len", "status", "source", "tokens_per_s", "step_time_s",
                                                "peak_device_bytes", "peak_allocated_bytes",
                                                "peak_reserved_bytes", "host_bytes", "loss", "grad_norm",
                                                "device", "error")})
        breakdown = record.get("breakdown") or {}
        row.update({f"breakdown_{c}": breakdown.get(c) for c in BREAKDOWN_CATEGORIES})
        rows.append(row)
    return rows


def write_parquet(study, path: Path) -> int:
    rows = trial_rows(study)
    table = pa.Table.from_pylist(rows, schema=_SCHEMA)
    pq.write_table(table, path)
    return table.num_rows


def front_entries(study) -> list[dict]:
    return [{"trial": t.number, "seq_len": int(t.values[0]), "tokens_per_s": t.values[1],
             "techniques": t.user_attrs["techniques"], "record": t.user_attrs["record"]}
            for t in search.pareto_front(study)]


def write_outputs(job: "search.SearchJob", study) -> dict:
    """Write every output file; returns a summary (best trial or why there is none)."""
    out = job.out
    rows = write_parquet(study, out / "trials.parquet")
    front = front_entries(study)
    (out / "pareto.json").write_text(json.dumps(
        {"schema": FRONT_SCHEMA, "model": job.model, "hardware": job.hardware.name, "gpus": job.gpus, "target": job.target,
         "capacity_bytes": job.hardware.device_memory_bytes, "front": front}, indent=2) + "\n")
    plot_pareto(trial_rows(study), front, job.target, out / "pareto.png",
                title=f"{job.model} on {job.gpus}x {job.hardware.name}")
    write_pareto_html(study, out / "pareto.html")
    plot_front_memory(front, job.hardware.device_memory_bytes, out / "memory.png",
                      title=f"memory per rank of the front, {job.model} on {job.gpus}x {job.hardware.name}")
    best = search.best_for_target(study, job.target)
    summary = {"rows": rows, "front": front, "best": None, "message": None}
    best_path = out / "best.json"
    if best is None:
        longest = max((f["seq_len"] for f in front), default=0)
        summary["message"] = (f"no config reached the target {job.target:,} tokens; the longest that fits is "
                              f"{longest:,} tokens; {search.what_bound(study)}")
        if best_path.exists():  # a stale best from another target must not survive
            best_path.unlink()
        return summary
    record = ResultRecord.from_dict(best.user_attrs["record"])
    config = TrialConfig(
        model=job.model, hardware=job.hardware.name, gpus=job.gpus, seq_len=int(best.values[0]),
        techniques=_techniques(best.user_attrs["techniques"]),
        predicted=record.to_dict() if record.source == "predicted" else None,
        measured=record.to_dict() if record.source == "measured" else None,
    )
    config.write(best_path)
    summary["best"] = config.to_dict()
    return summary


def plot_front_memory(front: list[dict], capacity_bytes: int, path: Path, title: str = "") -> int:
    """``memory.png``: the peak-memory breakdown of every front point against the capacity (issue 7); returns
    the number of bars drawn."""
    if not front:
        return 0
    return plot_memory([f["record"] for f in front], capacity_bytes, path, title=title,
                       labels=[f"{f['seq_len']:,}\n{knob_label(f['techniques'])}" for f in front])


def _techniques(values: dict) -> Techniques:
    return Techniques.from_dict(values)
