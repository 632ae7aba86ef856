"""The search's output folder: trials.parquet, pareto.json, pareto.png, memory.png, front-memory.html, pareto.html,
best.json.

``best.json`` is the latest search's best; the best of another target searched in the same folder is kept
beside it as ``best-<target>.json`` (the target's short form: ``best-4M.json``), so no target's best is lost.

``trials.parquet`` schema — one row per finished trial, one column per knob and per record field:
    trial (int), answered_by (str: local | plan | cache | monotone | oracle),
    one column per knob of ``trials.stack.techniques.Techniques`` (bool, int -- head_chunk null = plain Ulysses -- or
    str, from the knob's kind), seq_len (int), status, source (str), tokens_per_s, step_time_s (float),
    peak_device_bytes, peak_allocated_bytes, peak_reserved_bytes, host_bytes (int), breakdown_<category> (int, one per category of
    autotune.core.record.BREAKDOWN_CATEGORIES), loss, grad_norm (float), device, error (str), reduced_layers (int:
    the decoder layers a reduced-depth local trial ran, null otherwise): the trial's own record (what the search
    got: predicted by ``plan``, measured by ``local``);
    then what ``autotune verify`` measured for the row's config at its length (null where it was not verified):
    measured_depth (str: full | reduced), measured_status (str), measured_tokens_per_s, measured_step_time_s
    (float), measured_peak_device_bytes, measured_peak_allocated_bytes, measured_peak_reserved_bytes,
    measured_host_bytes (int), measured_breakdown_<category> (int), measured_loss, measured_grad_norm (float),
    measured_device, measured_error (str), measured_layers (int: the decoder layers a reduced-depth trial ran,
    null at full depth). Both sides derive from ``_RECORD_COLUMNS``.
``pareto.json`` carries ``"schema": "autotune/pareto-v1"``. Its front is ranked by each config's current record:
the verified measurement where there is one (a measured oom / error drops the config), else the trial's own;
each entry's ``record`` is that current record, ``predicted`` / ``measured`` the two sides (null where absent) and
``measured_depth`` the verify depth (null when not verified). ``best.json`` carries both sides the same way.
``best.json`` is the config fastest at exactly the target (``autotune.search.front.best_point``: each config that
reaches the target, at the target), its ``seq_len`` the target; ``pareto.json``'s ``best`` is that config as a
front entry is written (the trial it cites, its records at the target; null when none), and ``best_choice`` says
why it is not the fastest there, where it is not.
A predicted ``oom`` row whose trace ran in full keeps ``tokens_per_s`` / ``step_time_s`` as the rate it would have
had with the memory (a what-if); the search's objective, the front and the log count only ``ok`` rows' rates.
The search job itself (model and its config, target, gpus, the hardware the records are for) is stored as the
study's user attribute ``search_job`` (``job_attr``), so ``autotune verify`` can reopen the folder.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from autotune import search
from autotune.core.hardware import Hardware, KernelRates, Rates
from autotune.core.record import BREAKDOWN_CATEGORIES
from autotune.core.sizes import short_tokens
from autotune.outputs.exporters import FRONT_SCHEMA
from autotune.outputs.plots import knob_labels, model_title, plot_memory, plot_pareto, where_title, write_pareto_html
from autotune.outputs.timeline import FRONT_TIMELINE, write_front_timeline
from autotune.search.front import (
    AtTarget,
    Point,
    at_target,
    best_choice,
    best_point,
    front_points,
    points,
    root_cause,
    what_failed,
)
from trials.stack.techniques import BASELINE, Techniques, knob_names, knobs
from trials.training.config_file import TrialConfig

_ARROW_TYPES = {"bool": pa.bool_(), "int": pa.int64(), "tokens": pa.int64(), "choice": pa.string()}
KNOBS = knob_names()

# The result record's columns, in order: (field, arrow type, on the measured side too). ``breakdown`` expands to
# one column per category. The measured side is ``measured_<field>`` (``measured_layers`` keeps its name).
_RECORD_COLUMNS = (
    ("seq_len", pa.int64(), False),
    ("status", pa.string(), True),
    ("source", pa.string(), False),
    ("tokens_per_s", pa.float64(), True),
    ("step_time_s", pa.float64(), True),
    ("peak_device_bytes", pa.int64(), True),
    ("peak_allocated_bytes", pa.int64(), True),
    ("peak_reserved_bytes", pa.int64(), True),
    ("host_bytes", pa.int64(), True),
    ("breakdown", pa.int64(), True),
    ("loss", pa.float64(), True),
    ("grad_norm", pa.float64(), True),
    ("device", pa.string(), True),
    ("error", pa.string(), True),
)
_OWN_ONLY = (("reduced_layers", "measured_layers", pa.int64()),)  # (column, record field): a reduced local trial
_MEASURED_ONLY = (("measured_layers", pa.int64()),)  # record fields only a verify measurement fills in here


def _record_columns(record: dict | None, prefix: str, measured_side: bool) -> list[tuple[str, object, object]]:
    """(column, arrow type, value) of one record (``None``: the columns with null values)."""
    record = record or {}
    columns = []
    for name, kind, both in _RECORD_COLUMNS:
        if measured_side and not both:
            continue
        if name == "breakdown":
            breakdown = record.get("breakdown") or {}
            columns += [(f"{prefix}breakdown_{c}", kind, breakdown.get(c)) for c in BREAKDOWN_CATEGORIES]
        else:
            columns.append((f"{prefix}{name}", kind, record.get(name)))
    if measured_side:
        columns += [(name, kind, record.get(name)) for name, kind in _MEASURED_ONLY]
    else:
        columns += [(name, kind, record.get(field)) for name, field, kind in _OWN_ONLY]
    return columns


def _measured_columns(measured: dict | None) -> list[tuple[str, object, object]]:
    depth = [("measured_depth", pa.string(), measured.get("depth") if measured else None)]
    return depth + _record_columns(measured["record"] if measured else None, "measured_", True)


_SCHEMA = pa.schema(
    [("trial", pa.int64()), ("answered_by", pa.string())]
    + [(k.name, _ARROW_TYPES[k.kind]) for k in knobs()]
    + [(name, kind) for name, kind, _ in _record_columns(None, "", False)]
    + [(name, kind) for name, kind, _ in _measured_columns(None)]
)


def _row(point: Point) -> dict:
    trial = point.trial
    row = {"trial": trial.number, "answered_by": trial.user_attrs.get("answered_by")}
    row.update(
        {k: trial.user_attrs["techniques"].get(k, getattr(BASELINE, k)) for k in KNOBS}
    )  # older studies lack new knobs
    row.update({name: value for name, _, value in _record_columns(point.own, "", False)})
    row.update({name: value for name, _, value in _measured_columns(point.measured)})
    return row


def trial_rows(study) -> list[dict]:
    return [_row(p) for p in points(study)]


def plot_rows(rows: list[dict]) -> list[dict]:
    """The rows ``plot_pareto`` draws: every trial's own record, and each verified measurement beside it (a
    measured point; one per config and length)."""
    drawn, seen = list(rows), set()
    for row in rows:
        if row.get("measured_status") is None:
            continue
        key = (row["seq_len"], tuple(row[k] for k in KNOBS))
        if key in seen:
            continue
        seen.add(key)
        drawn.append(
            {
                **row,
                "source": "measured",
                "status": row["measured_status"],
                "tokens_per_s": row["measured_tokens_per_s"],
            }
        )
    return drawn


def _sides(point: Point | AtTarget) -> tuple[dict | None, dict | None]:
    """(predicted, measured) records of a point (or a config at the target): its own record on its side, a verify
    measurement on the measured side."""
    own = point.own
    predicted = own if own.get("source") == "predicted" else None
    measured = point.measured["record"] if point.measured else (own if own.get("source") == "measured" else None)
    return predicted, measured


def front_entries(study) -> list[dict]:
    entries = []
    for p in front_points(study):
        predicted, measured = _sides(p)
        entries.append(
            {
                "trial": p.number,
                "seq_len": int(p.values[0]),
                "tokens_per_s": p.values[1],
                "techniques": p.techniques,
                "record": p.record,
                "predicted": predicted,
                "measured": measured,
                "measured_depth": p.measured["depth"] if p.measured else None,
            }
        )
    return entries


def best_entry(best: AtTarget | None) -> dict | None:
    """``pareto.json``'s ``best``: the config ``best.json`` holds, at the target, as a front entry is written (the
    trial it cites; ``record`` / ``predicted`` / ``measured`` at the target)."""
    if best is None:
        return None
    predicted, measured = _sides(best)
    return {
        "trial": best.number,
        "seq_len": best.seq_len,
        "tokens_per_s": best.tokens_per_s,
        "techniques": best.techniques,
        "record": best.record,
        "predicted": predicted,
        "measured": measured,
        "measured_depth": best.measured["depth"] if best.measured else None,
    }


JOB_ATTR = "search_job"


def job_attr(job: search.SearchJob) -> dict:
    """What ``autotune verify`` needs of a search job, as JSON (the study's user attribute ``search_job``)."""
    return {
        "model": job.model,
        "model_config": job.model_config,
        "target": job.target,
        "gpus": job.gpus,
        "nodes": job.nodes,
        "hardware": dataclasses.asdict(job.hardware),
        "documents": job.documents.to_json(),
        "lora": job.lora.to_json(),
    }


def hardware_from_attr(data: dict) -> Hardware:
    """The ``Hardware`` of ``job_attr`` (JSON turned its tuples into lists)."""
    rates = dict(data["rates"])
    rates["attention_by_head_dim"] = tuple((int(d), tuple(e)) for d, e in rates.get("attention_by_head_dim") or ())
    rates["attention_kernels"] = tuple(KernelRates(**kernel) for kernel in rates.get("attention_kernels") or ())
    known = {f.name for f in dataclasses.fields(Rates)}
    values = {k: v for k, v in data.items() if k in {f.name for f in dataclasses.fields(Hardware)} and k != "rates"}
    return Hardware(rates=Rates(**{k: v for k, v in rates.items() if k in known}), **values)


def write_outputs(job: search.SearchJob, study) -> dict:
    """Write every output file; returns a summary (best trial or why there is none; ``kept``: where the best of
    the folder's previous target went, else None). Stores the job itself in the study (``job_attr``) for
    ``autotune verify``."""
    out = job.out
    previous_target = _outputs_target(out)  # the target best.json is for, read before pareto.json is rewritten
    study.set_user_attr(JOB_ATTR, job_attr(job))
    rows = trial_rows(study)
    pq.write_table(pa.Table.from_pylist(rows, schema=_SCHEMA), out / "trials.parquet")
    front = front_entries(study)
    best = best_point(study, job.target)
    choice = best_choice(study, job.target)  # why best.json is not the fastest config, where it is not
    (out / "pareto.json").write_text(
        json.dumps(
            {
                "schema": FRONT_SCHEMA,
                "model": job.model,
                "hardware": job.hardware.name,
                "gpus": job.gpus,
                "nodes": job.nodes,
                "target": job.target,
                "capacity_bytes": job.hardware.device_memory_bytes,
                "host_capacity_bytes": job.hardware.host_memory_bytes_per_device,  # per rank; 0: not checked
                "trainer": job.trainer.name,  # what every front config is: what that trainer runs
                "documents": job.documents.to_json(),  # the documents packed into each sequence
                "lora": job.lora.to_json(),  # the adapters trained on the frozen model (null: every weight)
                "best_choice": choice,
                "best": best_entry(best),  # what best.json holds, at the target
                "front": front,
            },
            indent=2,
        )
        + "\n"
    )
    plot_pareto(
        plot_rows(rows),
        front,
        job.target,
        out / "pareto.png",
        title=f"{model_title(job.model)} on {_where(job)}",
        best=best_entry(best),
    )
    write_pareto_html(study, out / "pareto.html")
    plot_front_memory(
        front,
        job.hardware.device_memory_bytes,
        out / "memory.png",
        title=f"memory per rank of the front, {model_title(job.model)} on {_where(job)}",
        host_capacity=job.hardware.host_memory_bytes_per_device,
    )
    front_timeline = _front_timeline(job, front, out)
    best_path = out / "best.json"
    kept = _keep_best_of(previous_target, job.target, out)
    summary = {
        "rows": len(rows),
        "front": front,
        "best": None,
        "best_trial": None,
        "message": None,
        "kept": kept,
        "best_choice": None,
        "front_timeline": front_timeline,
    }
    if best is None:
        longest = max((f["seq_len"] for f in front), default=0)
        failed, everyone = what_failed(study) or ("", False)  # its last line ends with the most common cause
        summary["message"] = (
            failed
            if everyone  # no trial says anything about memory: the failure is the answer
            else _none_at_target(study, job.target)
            if longest >= job.target
            else f"no config reached the target {job.target:,} tokens; the longest that fits is "
            f"{longest:,} tokens; {search.what_bound(study)}" + (f"; {failed}" if failed else "")
        )
        for stale in (best_path, target_best_path(out, job.target)):  # an earlier best of this target
            stale.unlink(missing_ok=True)
        return summary
    predicted, measured = _sides(best)
    config = TrialConfig(
        model=job.model,
        hardware=job.hardware.name,
        gpus=job.gpus,
        nodes=job.nodes,
        seq_len=best.seq_len,
        techniques=_techniques(best.techniques),
        predicted=predicted,
        measured=measured,
        trainer=None if job.trainer.name == "autotune" else job.trainer.name,
        documents=job.documents,
        lora=job.lora,
    )
    config.write(best_path)
    target_best_path(out, job.target).unlink(missing_ok=True)  # best.json holds this target's best now
    summary["best"] = config.to_dict()
    summary["best_trial"] = best.number
    summary["best_choice"] = choice
    return summary


def _none_at_target(study, target: int) -> str:
    """Why no config is best where configs reach the target: none was evaluated at exactly the target yet (a
    search cut short), or none runs there."""
    known, missing = at_target(study, target)
    if missing:
        return (
            f"{len(missing)} config(s) reach the target {target:,} tokens but were not evaluated at exactly that "
            f"length yet: run the same command again"
        )
    first = min(known, key=lambda c: c.number)
    return (
        f"no config that reaches the target {target:,} tokens runs at exactly that length; trial {first.number}'s "
        f"config there: {first.record['status']}: {root_cause(first.record.get('error'))}"
    )


def _front_timeline(job, front: list[dict], out: Path) -> str | None:
    """``front-memory.html`` (``autotune.outputs.timeline``); what went wrong instead, where its trace failed: the
    search's other outputs stand without it."""
    try:
        write_front_timeline(job, front, out)
    except Exception as exc:  # the picture's own trace; the search's results are written either way
        return f"{FRONT_TIMELINE} not written: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


def target_best_path(out: Path, target: int) -> Path:
    """Where the best for ``target`` is kept once a search for another target wrote best.json."""
    return out / f"best-{short_tokens(target)}.json"


def _outputs_target(out: Path) -> int | None:
    """The target of the outputs in ``out`` (pareto.json's, which best.json is written with), else None."""
    try:
        target = json.loads((out / "pareto.json").read_text()).get("target")
    except (OSError, ValueError, AttributeError):
        return None
    return target if isinstance(target, int) else None


def _keep_best_of(previous_target: int | None, target: int, out: Path) -> Path | None:
    """Move best.json aside as ``best-<previous target>.json`` when it is another target's; returns where."""
    best_path = out / "best.json"
    if previous_target is None or previous_target == target or not best_path.is_file():
        return None
    kept = target_best_path(out, previous_target)
    best_path.replace(kept)
    return kept


def _where(job) -> str:
    """The plots' "N x GPU" and, for adapters, what trains."""
    return where_title(job.gpus, job.hardware.name, job.nodes) + job.lora.aside


def plot_front_memory(
    front: list[dict], capacity_bytes: int, path: Path, title: str = "", host_capacity: int = 0
) -> int:
    """``memory.png``: the peak-memory breakdown of every front point against the device capacity (and the host
    memory per rank, ``host_capacity``, where it is checked); returns the number of bars drawn."""
    if not front:
        return 0
    return plot_memory(
        [f["record"] for f in front],
        capacity_bytes,
        path,
        title=title,
        host_capacity=host_capacity,
        labels=[f"{f['seq_len']:,}\n{label}" for f, label in zip(front, knob_labels([f["techniques"] for f in front]))],
    )


def _techniques(values: dict) -> Techniques:
    return Techniques.from_dict(values)
