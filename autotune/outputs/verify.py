"""``autotune verify DIR``: re-measure a finished search's front with real trials on this node.

The node owner's workflow: plan in minutes without GPUs (``autotune search --backend plan``), verify the few configs
that matter here (the ``local`` backend: CUDA+NCCL on a GPU node, CPU+gloo with a tracked capacity elsewhere), then
export a config whose numbers were measured.

What is verified: the search's own front (from the trials' own records, i.e. what the plan predicted), all of it or
the ``top`` configs with the highest predicted tokens/s; then the config ``best.json`` names at the target (the
fastest there, each config that reaches the target at exactly the target, ranked by measured records where there
are), until that one is measured at the target too -- a measured OOM moves the best to another config, which is
then measured in turn. Configs that reach the target and were never evaluated at it (a folder whose search was cut
short) are predicted there first (``select``'s ``predictor``).

Each measurement is stored as soon as its trial ends, as the study's user attribute ``measured:<trial number>``
(``measured:<trial number>@<target>`` for a config at the target that has no trial there; ``autotune.search.front``:
Optuna refuses to change a finished trial), beside the trial's own ``record``, which stays
untouched. So a killed verify loses nothing, and running it again skips every config already measured at that depth
(a full-depth measurement also answers a reduced one; an ``error`` / ``timeout`` is tried again) unless ``force``.
At the end the folder's outputs are rewritten (``report.write_outputs``): trials.parquet gains the ``measured_*``
columns, the front and best.json are ranked by measured records where they exist.

The search job (model, target, gpus, the hardware the predictions are for, the documents) comes from the study's
``search_job`` attribute, which ``report.write_outputs`` stores; a folder written before it existed is refused with
the remedy. Verifying for other documents than the search's (``verify_for_documents``) predicts each chosen config
anew for them beside its measurement and stores nothing: the folder's records are for its own documents.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import optuna

from autotune.backends import Backend, Evaluation
from autotune.backends.local import visible_devices
from autotune.core.errors import UserError
from autotune.core.hardware import HOST_PRESET, Hardware, load_hardware
from autotune.core.record import ResultRecord
from autotune.core.sizes import format_tokens
from autotune.core.trainers import trainer_named
from autotune.outputs import report
from autotune.outputs.exporters import load_front
from autotune.outputs.plots import knob_label
from autotune.search.at_target import evaluate_at_target
from autotune.search.front import (
    AtTarget,
    Point,
    at_target,
    best_point,
    config_key,
    front_points,
    measured_attr,
    points,
)
from autotune.search.job import SearchJob
from autotune.search.study import open_storage
from trials.kernels.documents import DocumentsSpec
from trials.models.lora import LoraSpec
from trials.stack.techniques import Techniques

RESULTS = ("ok", "oom")  # what a verified trial may end with and still count as a measurement (not a failure)


@dataclass
class Folder:
    """An opened search folder: its study, and the search job its records are for (``job.hardware``: the hardware
    the predictions were made for, not this node's)."""

    directory: Path
    study: optuna.Study
    job: SearchJob
    trainer: str = "autotune"  # the trainer the search was for (pareto.json's): what its configs run


def open_folder(directory: Path, storage: str | None = None, study_name: str | None = None) -> Folder:
    """The search folder ``directory``: its study (``study.db`` there, else ``storage``/``study_name``) and job."""
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"{str(directory)!r} is not a folder: give the --out folder of a search")
    front_doc = load_front(directory)  # a search output folder has a pareto.json (one clear line when not)
    if storage is None and not (directory / "study.db").is_file():
        raise UserError(
            f"{str(directory)!r} has no study.db: the study lives in the search's --storage; "
            f"pass the same --storage (and --study)"
        )
    opened = open_storage(storage, directory)
    try:
        names = optuna.get_all_study_names(storage=opened)
    except Exception as exc:  # a database that is not an Optuna one
        raise UserError(f"cannot read the study of {str(directory)!r}: {str(exc).splitlines()[0]}") from None
    if study_name is None:
        if len(names) != 1:
            raise UserError(
                f"{len(names)} studies in the storage of {str(directory)!r}: pick one with --study "
                f"({', '.join(names) or 'none'})"
            )
        study_name = names[0]
    elif study_name not in names:
        raise UserError(
            f"no study {study_name!r} in the storage of {str(directory)!r} (it holds {', '.join(names) or 'none'})"
        )
    study = optuna.load_study(study_name=study_name, storage=opened)
    data = study.user_attrs.get(report.JOB_ATTR)
    if not isinstance(data, dict):
        raise UserError(
            f"{str(directory)!r} was written by an older autotune (its study does not record the search "
            f"job): run the same search command once more to refresh its outputs, then verify"
        )
    try:
        hardware = report.hardware_from_attr(data["hardware"])
        job = SearchJob(
            model=data["model"],
            model_config=data["model_config"],
            target=int(data["target"]),
            gpus=int(data["gpus"]),
            hardware=hardware,
            space=None,
            backend=None,
            out=directory,
            trials=len(study.trials),
            storage=storage,
            study_name=study_name,
            nodes=int(data.get("nodes", 1)),
            documents=DocumentsSpec.from_json(data.get("documents")),
            lora=LoraSpec.from_json(data.get("lora")),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"the search job stored in {str(directory)!r} is unreadable ({exc!r})") from None
    return Folder(directory, study, job, front_doc.get("trainer", "autotune"))


def node_memory_gib(folder: Folder, memory_gib: float | None) -> float | None:
    """Per-rank capacity of the real trials: ``memory_gib`` if given; on CPU the capacity the search planned for
    (CPU trials need one); on a GPU the card's own, unless the search planned for less (``--memory-gib``)."""
    if memory_gib is not None:
        return memory_gib
    planned = folder.job.hardware.device_memory_bytes
    if not visible_devices():
        return planned / 1024**3
    import torch

    card = torch.cuda.get_device_properties(0).total_memory
    return planned / 1024**3 if planned < card else None


def local_hardware(search_hardware: Hardware, memory_gib: float | None) -> Hardware:
    """This node as a preset (``cli._hardware_for`` of the local backend): the ``cpu`` preset on a machine without
    CUDA, else the search's hardware with this card's capacity; ``memory_gib`` per rank over either."""
    if not visible_devices():
        return load_hardware(HOST_PRESET).with_memory_gib(memory_gib)
    import torch

    card = torch.cuda.get_device_properties(0).total_memory
    return dataclasses.replace(search_hardware, device_memory_bytes=card).with_memory_gib(memory_gib)


def own_depth(record: dict) -> str:
    """The depth a measured record was taken at (``measured_layers`` is set by a reduced-depth trial)."""
    return "reduced" if record.get("measured_layers") else "full"


def measured_at(point: Point, depth: str) -> bool:
    """Whether the point's config already has a measurement (by verify, or by a real search trial) that answers
    ``depth``: ok or oom, at that depth or at full depth."""
    if point.measured is not None:
        taken, record = point.measured.get("depth", "full"), point.measured["record"]
    elif point.own.get("source") == "measured":
        taken, record = own_depth(point.own), point.own
    else:
        return False
    return record.get("status") in RESULTS and taken in (depth, "full")


def select(folder: Folder, top: int | None, predictor: Backend | None = None) -> list[Point | AtTarget]:
    """The search's own front (predicted), the ``top`` with the highest predicted tokens/s (all when None), then
    the current best for the target, at the target, when it is not among them. ``predictor`` (the plan backend)
    first predicts at the target each config that reaches it and was never evaluated there."""
    if top is not None and top < 1:
        raise UserError(f"--top must be at least 1, got {top}")
    if predictor is not None:
        evaluate_at_target(folder.job, folder.study, backend=predictor, trainer=trainer_named(folder.trainer))
    front = sorted(
        front_points(folder.study, verified=False), key=lambda p: (-(p.own.get("tokens_per_s") or 0.0), p.number)
    )
    chosen = front[:top] if top is not None else front
    best = best_point(folder.study, folder.job.target)
    keys = {_key(p) for p in chosen}
    if best is not None and _key(best) not in keys:
        chosen.append(best)
    return chosen


def check_node(folder: Folder, chosen: list[Point]) -> None:
    """What the real trials need of this node before any starts: enough visible GPUs, flash-attn where used."""
    gpus, visible = folder.job.gpus, visible_devices()
    if visible and gpus > visible:
        raise UserError(
            f"the search is for {gpus} GPUs but this node shows {visible} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES limits them)"
        )
    refused = [p for p in chosen if _kernel_refusal(p)]
    if refused:
        raise UserError(f"trial(s) {', '.join(str(p.number) for p in refused)}: {_kernel_refusal(refused[0])}")


def _kernel_refusal(point: Point) -> str | None:
    """Why the point's attention kernel cannot run on this node (``trials.kernels.registry.refusal``), or None."""
    from trials.kernels.registry import refusal, this_node_compute_capability

    return refusal(point.techniques.get("attention", "sdpa"), this_node_compute_capability())


@dataclass
class Outcome:
    """One verified config: the search's record and the measurement (``ran``: measured in this run)."""

    trial: int
    seq_len: int
    techniques: dict
    predicted: dict
    measured: dict | None
    depth: str | None
    ran: bool
    why: str = "front"  # "front": chosen from the search's front; "best": the best config once others were measured

    @property
    def label(self) -> str:
        return f"trial {self.trial} {format_tokens(self.seq_len)} {knob_label(self.techniques)}"

    @property
    def failed(self) -> bool:
        return self.measured is not None and self.measured["status"] not in RESULTS

    def ratio(self, field_name: str) -> float | None:
        """measured / predicted of a record field (None where either is missing or the config does not fit)."""
        if self.measured is None or self.measured["status"] != "ok" or self.predicted.get("status") != "ok":
            return None
        a, b = self.measured.get(field_name), self.predicted.get(field_name)
        return a / b if a and b else None

    def to_dict(self) -> dict:
        return {
            "trial": self.trial,
            "seq_len": self.seq_len,
            "config": knob_label(self.techniques),
            "techniques": self.techniques,
            "why": self.why,
            "depth": self.depth,
            "ran": self.ran,
            "predicted": self.predicted,
            "measured": self.measured,
            "tokens_per_s_ratio": self.ratio("tokens_per_s"),
            "peak_ratio": self.ratio("peak_device_bytes"),
        }


@dataclass
class Verification:
    outcomes: list[Outcome] = field(default_factory=list)
    summary: dict | None = None  # ``report.write_outputs``'s: rows, front, best, message
    interrupted: bool = False
    notes: list[str] = field(default_factory=list)  # why the search's best config was left unverified

    @property
    def failed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.ran and o.failed]


def _key(point: Point | AtTarget) -> str:
    return config_key(point.techniques, point.own["seq_len"])


def _outcome(point: Point, ran: bool, why: str) -> Outcome:
    if point.measured is not None:
        measured, depth = point.measured["record"], point.measured.get("depth")
    elif point.own.get("source") == "measured":
        measured, depth = point.own, own_depth(point.own)
    else:
        measured, depth = None, None
    return Outcome(point.number, int(point.own["seq_len"]), point.techniques, point.own, measured, depth, ran, why)


def _current(folder: Folder, key: str) -> Point | AtTarget:
    """The point of ``key`` as the study holds it now: a trial's, else a config's at the target."""
    found = [p for p in points(folder.study) if _key(p) == key]
    return found[0] if found else next(c for c in at_target(folder.study, folder.job.target)[0] if _key(c) == key)


def measure(folder: Folder, point: Point | AtTarget, backend: Backend, hardware: Hardware, depth: str) -> ResultRecord:
    """One real trial of ``point``'s config at its length on this node (``hardware``), stored in the study as it
    ends (a config at the target under its own attribute: its trial's at the trial's length may be measured too)."""
    techniques = Techniques.from_dict(point.techniques, folder.job.model_config["num_hidden_layers"])
    seq_len = int(point.own["seq_len"])
    job = folder.job
    evaluation = Evaluation(
        job.model_config, techniques, seq_len, job.gpus, hardware, job.nodes, job.documents, job.lora
    )
    record = backend.evaluate(evaluation)
    elsewhere = seq_len != int(point.trial.user_attrs["record"]["seq_len"])
    folder.study.set_user_attr(
        measured_attr(point.number, seq_len if elsewhere else None),
        {
            "trial": point.number,
            "techniques": point.techniques,
            "seq_len": seq_len,
            "depth": depth,
            "record": record.to_dict(),
            "at": datetime.datetime.now().isoformat(timespec="seconds"),
        },
    )
    return record


def verify(
    folder: Folder,
    chosen: list[Point],
    backend: Backend,
    hardware: Hardware,
    depth: str = "full",
    force: bool = False,
    on_outcome: Callable[[Outcome, int, int | None], None] | None = None,
    interruptible: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Verification:
    """Measure ``chosen`` (``select``) on this node, then the best config until it is measured; rewrite the
    folder's outputs. ``on_outcome(outcome, index, total)`` as each config is done (``total`` None for the best
    config followed after the chosen ones). Ctrl-C / SIGTERM (as KeyboardInterrupt) stops after saving what was
    measured; ``interruptible()`` wraps the measuring alone (the CLI defers an interrupt while the outputs are
    written)."""
    result = Verification()
    try:
        with interruptible():
            _measure_chosen(folder, chosen, backend, hardware, depth, force, on_outcome, result)
    except KeyboardInterrupt:
        result.interrupted = True
    result.summary = report.write_outputs(folder.job, folder.study)
    return result


def _measure_chosen(folder, chosen, backend, hardware, depth, force, on_outcome, result) -> None:
    """The chosen configs, then the best until it is measured (``verify``); outcomes into ``result``."""
    queue = [(p, "front") for p in chosen]
    seen: set[str] = set()
    while True:
        while queue:
            wanted, why = queue.pop(0)
            point = _current(folder, _key(wanted))
            if _key(point) in seen:
                continue
            seen.add(_key(point))
            ran = force or not measured_at(point, depth)
            if ran:
                measure(folder, point, backend, hardware, depth)
                point = _current(folder, _key(point))
            outcome = _outcome(point, ran, why)
            result.outcomes.append(outcome)
            if on_outcome is not None:
                on_outcome(outcome, len(result.outcomes), len(chosen) if why == "front" else None)
        best = best_point(folder.study, folder.job.target)  # a measured OOM may have moved the best
        if best is None or _key(best) in seen:
            break
        if result.failed:  # a failing node would fail every config: stop at the first failure
            result.notes.append(f"the best config now (trial {best.number}) was not verified: a trial failed")
            break
        if _kernel_refusal(best):
            result.notes.append(f"the best config now (trial {best.number}) was not verified: {_kernel_refusal(best)}")
            break
        queue.append((best, "best"))


def verify_for_documents(
    folder: Folder,
    chosen: list[Point],
    documents: DocumentsSpec,
    backend: Backend,
    predictor: Backend,
    hardware: Hardware,
    depth: str = "full",
    on_outcome: Callable[[Outcome, int, int | None], None] | None = None,
    interruptible: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Verification:
    """Measure ``chosen`` on this node training on ``documents``, not the documents the search was for: each config
    is predicted anew for them (``predictor``, on the search's hardware) beside its measurement. Nothing is stored:
    the folder's records, front and best are the search's, for its own documents."""
    result = Verification(summary={"best": None, "message": None})
    layers = folder.job.model_config["num_hidden_layers"]
    try:
        with interruptible():
            for point in chosen:
                techniques = Techniques.from_dict(point.techniques, layers)
                seq_len, job = int(point.own["seq_len"]), folder.job
                planned = dataclasses.replace(job.evaluation(techniques, seq_len), documents=documents)
                predicted = predictor.evaluate(planned).to_dict()
                measured = backend.evaluate(dataclasses.replace(planned, hardware=hardware)).to_dict()
                outcome = Outcome(point.number, seq_len, point.techniques, predicted, measured, depth, True)
                result.outcomes.append(outcome)
                if on_outcome is not None:
                    on_outcome(outcome, len(result.outcomes), len(chosen))
    except KeyboardInterrupt:
        result.interrupted = True
    return result


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _rate(record: dict | None) -> str:
    if not record or record.get("status") != "ok" or not record.get("tokens_per_s"):
        return "-"
    return f"{record['tokens_per_s']:,.0f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def progress_line(outcome: Outcome, index: int, total: int | None) -> str:
    """One line per verified config as it finishes: predicted -> measured."""
    p, m = outcome.predicted, outcome.measured or {}
    where = f"[{index}/{total}]" if total else f"[{index}] the best config now:"
    how = "" if outcome.ran else f" (already measured, {outcome.depth} depth)"
    line = (
        f"{where} {outcome.label}{how}: {p.get('status')} -> {m.get('status', '-')}, "
        f"peak {_gib(p.get('peak_device_bytes'))} -> {_gib(m.get('peak_device_bytes'))} GiB, "
        f"host {_gib(p.get('host_bytes'))} -> {_gib(m.get('host_bytes'))} GiB, "
        f"tokens/s {_rate(p)} -> {_rate(m)} (x{_ratio(outcome.ratio('tokens_per_s'))})"
    )
    if outcome.failed:
        line += f"\n    {(m.get('error') or '').strip().splitlines()[0] if m.get('error') else 'no cause recorded'}"
    return line


TABLE_COLUMNS = ("trial", "seq_len", "config", "status", "peak GiB", "host GiB", "tokens/s", "ratio")


def table_rows(result: Verification) -> list[tuple[str, ...]]:
    """The side-by-side table: each cell ``predicted / measured``; ratio = measured / predicted tokens/s."""
    rows = []
    for o in result.outcomes:
        p, m = o.predicted, o.measured or {}
        rows.append(
            (
                str(o.trial),
                format_tokens(o.seq_len),
                knob_label(o.techniques),
                f"{p.get('status')} / {m.get('status', '-')}",
                f"{_gib(p.get('peak_device_bytes'))} / {_gib(m.get('peak_device_bytes'))}",
                f"{_gib(p.get('host_bytes'))} / {_gib(m.get('host_bytes'))}",
                f"{_rate(p)} / {_rate(m)}",
                _ratio(o.ratio("tokens_per_s")),
            )
        )
    return rows


def to_json(
    folder: Folder, result: Verification, depth: str, hardware: Hardware, documents: DocumentsSpec | None = None
) -> dict:
    """``--json``'s object; ``documents``: what the trials trained on (default: the search's documents)."""
    summary = result.summary or {}
    return {
        "dir": str(folder.directory),
        "depth": depth,
        "documents": (documents or folder.job.documents).to_json(),
        "node": hardware.name,
        "gpus": folder.job.gpus,
        "nodes": folder.job.nodes,
        "capacity_bytes": hardware.device_memory_bytes,
        "verified": [o.to_dict() for o in result.outcomes],
        "failed": [o.trial for o in result.failed],
        "best": summary.get("best"),
        "message": summary.get("message"),
        "notes": result.notes,
        "interrupted": result.interrupted,
    }
