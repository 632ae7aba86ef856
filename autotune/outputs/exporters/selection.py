"""Which front config a format exports, and what the export says about it.

``export(directory, target, exporter, allow_partial, path)``: at the search's own target, the config ``best.json``
holds (``pareto.json``'s ``best``: the fastest at exactly the target, the search's choice) where the format expresses
it in full (``Exporter.expresses_in_full``); otherwise, and at another target, the fastest front config at or above
``target`` that the format expresses in full. Where none does, ``NotExpressible`` (one line,
exit 1) names the longest length the format's expressible configs reach; with ``allow_partial`` the fastest
config at the target is exported anyway. Whenever the trainer runs anything differently from the searched config
(``Exporter.gaps``), the plan backend re-estimates what the trainer will run, and where that does not fit at the
config's length the export is for the longest length it fits (``find_max_seq``): an export never claims a length
its trainer cannot reach. Packed documents the trainer cannot mask (``Trainer.masks_documents``: it attends across
their boundaries) are re-estimated the same way, with attention over each whole window (``Trainer.documents_run``:
``--documents one``), printed beside the estimate as searched.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from autotune.core.errors import UserError
from autotune.core.record import ResultRecord
from autotune.core.sizes import format_duration
from autotune.core.trainers import TRAINERS, trainer_named
from autotune.outputs.exporters.base import Exporter, ExportJob, Gap, Rendered
from autotune.outputs.exporters.front import entry_config, entry_techniques, load_front
from trials.kernels.documents import DocumentsSpec
from trials.models.config import load_model_config
from trials.models.lora import LoraSpec
from trials.training.config_file import TrialConfig

GIB = 2**30


class NotExpressible(Exception):
    """No front config at the target can be exported in full by the format (one line; the command exits 1)."""


@dataclass
class Export:
    """What ``autotune export`` writes: the rendered format and what it says about the config."""

    exporter: Exporter
    entry: dict  # the front entry exported
    config: TrialConfig  # as the trainer runs it (its length: where that fits)
    gaps: list[Gap]  # where the trainer runs differently from the front config
    re_estimate: ResultRecord | None  # the plan backend's record of what the trainer runs (None: no gaps)
    notes: list[str]
    rendered: Rendered

    @property
    def partial(self) -> bool:
        return any(gap.needs_more_memory for gap in self.gaps)


def export_job(front_doc: dict, entry: dict, model_config: dict) -> ExportJob:
    return ExportJob(
        model=front_doc["model"],
        model_config=model_config,
        gpus=front_doc["gpus"],
        seq_len=entry["seq_len"],
        techniques=entry_techniques(entry),
        nodes=front_doc.get("nodes", 1),
        documents=DocumentsSpec.from_json(front_doc.get("documents")),
        lora=LoraSpec.from_json(front_doc.get("lora")),
    )


def _fastest(entries: list[dict]) -> dict:
    return max(entries, key=lambda f: (f["tokens_per_s"], -f["seq_len"]))


def choose(front_doc: dict, exporter: Exporter, target: int, allow_partial: bool, model_config: dict) -> dict:
    """The entry to export: ``pareto.json``'s ``best``, or a front entry (see the module docstring)."""
    best = front_doc.get("best")
    if best and target == front_doc["target"] and exporter.expresses_in_full(export_job(front_doc, best, model_config)):
        return best
    front = front_doc["front"]
    reaching = [f for f in front if f["seq_len"] >= target]
    if not reaching:
        longest = max((f["seq_len"] for f in front), default=0)
        raise UserError(f"no front config reaches {target:,} tokens; the longest reached is {longest:,}")
    in_full = [f for f in reaching if exporter.expresses_in_full(export_job(front_doc, f, model_config))]
    if in_full:
        return _fastest(in_full)
    if allow_partial:
        return _fastest(reaching)
    expressible = [f["seq_len"] for f in front if exporter.expresses_in_full(export_job(front_doc, f, model_config))]
    blocking = sorted(
        {
            gap.knob.name
            for f in reaching
            for gap in exporter.gaps(export_job(front_doc, f, model_config))
            if gap.needs_more_memory
        }
    )
    reach = (
        f"the longest its expressible configs reach is {max(expressible):,}"
        if expressible
        else "none of the front's configs is expressible"
    )
    searched_for = front_doc.get("trainer", "autotune")
    research = (  # a front searched for another trainer: a search for this one holds only what it runs
        f"; autotune search ... --trainer {exporter.trainer.name} finds the fastest it runs in full"
        if searched_for != exporter.trainer.name
        else ""
    )
    raise NotExpressible(
        f"no front config that --format {exporter.name} expresses in full reaches {target:,} tokens "
        f"({exporter.trainer.words} cannot do {', '.join(blocking)} as searched); {reach}{research}; "
        f"--allow-partial exports the fastest at {target:,} anyway, with what it will not do and a re-estimate"
    )


def search_hardware(front_doc: dict):
    """The hardware the front's records are for: the preset, at the capacity the search planned for."""
    from autotune.core.hardware import load_hardware

    hardware = load_hardware(front_doc["hardware"]).for_nodes(front_doc.get("nodes", 1))
    if front_doc.get("capacity_bytes"):
        hardware = dataclasses.replace(hardware, device_memory_bytes=int(front_doc["capacity_bytes"]))
    return hardware


def re_estimate(
    exporter: Exporter, job: ExportJob, hardware, progress: Callable[[str], None] | None = None
) -> tuple[ExportJob, ResultRecord]:
    """What the trainer runs for ``job`` (its techniques on ``job``'s documents, at ``job``'s length or, where that
    does not fit, at the longest length it fits) and the plan backend's record of it; the record is a failure where
    it fits nowhere. Lengths tried are multiples of 1024 and of what the length must divide (the Ulysses degree), not
    of the trainer's tile sizes: tiles need not divide the sequence."""
    from autotune.backends import Evaluation, make_backend
    from autotune.search.max_seq import find_trainer_max_seq, trainer_techniques_at

    say = progress or (lambda line: None)
    held = hardware.holding(
        exporter.trainer.held_bytes(job.techniques, job.model_config)
    )  # ZeRO-3's buffers count against capacity
    asked = Evaluation(
        job.model_config, job.techniques, job.seq_len, job.gpus, held, job.nodes, documents=job.documents, lora=job.lora
    )
    plan = make_backend("plan")
    trainer_job = dataclasses.replace(job, techniques=trainer_techniques_at(exporter.trainer, asked, job.seq_len))
    evaluation = dataclasses.replace(asked, techniques=trainer_job.techniques)
    say(f"re-estimating what {exporter.trainer.words} runs at {job.seq_len:,} tokens (plan backend)")
    record = plan.evaluate(evaluation)
    if record.status != "oom":
        return trainer_job, record
    say(
        f"{exporter.trainer.words}'s version does not fit at {job.seq_len:,} tokens: finding the longest length it fits"
    )
    longest = find_trainer_max_seq(
        asked, exporter.trainer, backend=plan, progress=lambda r: say(f"  {r.seq_len:,} tokens: {r.status}")
    )
    techniques = trainer_techniques_at(exporter.trainer, asked, longest.seq_len)
    return dataclasses.replace(job, seq_len=longest.seq_len, techniques=techniques), longest


def _record_line(record: dict | ResultRecord, capacity: int) -> str:
    r = record if isinstance(record, dict) else record.to_dict()
    peak = (r.get("peak_device_bytes") or 0) / GIB
    rate = f", {r['tokens_per_s']:,.0f} tokens/s" if r.get("tokens_per_s") else ""
    if r.get("step_time_s"):
        rate += f", {format_duration(r['step_time_s'])} a step"
    return (
        f"{r['status']} at {r['seq_len']:,} tokens, peak {peak:.2f} GiB of {capacity / GIB:.2f} GiB per rank"
        f"{rate} ({r['source']})"
    )


def export(
    directory: Path,
    target: int | None,
    exporter: Exporter,
    allow_partial: bool,
    path: str,
    progress: Callable[[str], None] | None = None,
) -> Export:
    """``autotune export``: the chosen front config (``choose``) in ``exporter``'s format, for ``path``."""
    front_doc = load_front(directory)
    lora = LoraSpec.from_json(front_doc.get("lora"))
    if lora.on and exporter.trainer.lora is None:  # a full-training export of it would train another workload
        takes = " and ".join(trainer.words for trainer in TRAINERS.values() if trainer.lora is not None)
        raise UserError(
            f"the search in {str(directory)!r} is for {lora.describe()}; {exporter.trainer.words} trains every weight "
            f"only ({takes} train the adapters)"
        )
    model_config = load_model_config(front_doc["model"])
    target = front_doc["target"] if target is None else target
    entry = choose(front_doc, exporter, target, allow_partial, model_config)
    return export_entry(front_doc, entry, exporter, path, model_config, progress)


def export_entry(
    front_doc: dict,
    entry: dict,
    exporter: Exporter,
    path: str,
    model_config: dict,
    progress: Callable[[str], None] | None = None,
) -> Export:
    """One front entry in ``exporter``'s format, as its trainer runs it (re-estimated where that differs;
    ``progress`` gets a line per oracle run: at millions of tokens each takes a while)."""
    searched = entry_config(front_doc, entry)
    job = export_job(front_doc, entry, model_config)
    gaps = exporter.gaps(job)
    trainer_job = dataclasses.replace(job, techniques=exporter.trainer_techniques(job))
    hardware = search_hardware(front_doc)
    record = entry["record"]
    where = f"{searched.nodes} nodes x " if searched.nodes > 1 else ""
    which = "best.json's config, trial" if entry == front_doc.get("best") else "front trial"
    packed = "" if searched.documents.one else f" ({searched.documents.describe()}, each attended alone)"
    notes = [
        f"autotune: {searched.model}, {searched.seq_len:,} tokens{packed} on {where}{searched.gpus}x "
        f"{searched.hardware}, {which} {entry['trial']}: {_record_line(record, hardware.device_memory_bytes)}"
    ]
    estimate = None
    seq_len = searched.seq_len
    # packed documents the trainer cannot mask: its attention runs over each whole window
    documents = exporter.trainer.documents_run(searched.documents, trainer_job.techniques.attention)
    unmasked = documents != searched.documents
    # memory the trainer holds that the search's records leave out (a search for another trainer): re-estimated
    searched_trainer = trainer_named(front_doc.get("trainer", "autotune"))
    held = exporter.trainer.held_bytes(trainer_job.techniques, model_config)
    unheld = held > searched_trainer.held_bytes(searched.techniques, model_config)
    if gaps or unmasked or unheld:
        trainer_job, estimate = re_estimate(exporter, dataclasses.replace(job, documents=documents), hardware, progress)
        if unheld:
            notes.append(
                f"{exporter.trainer.words} holds up to {held / GIB:.1f} GiB per rank that the search's records leave "
                "out (ZeRO-3's buffers): re-estimated with them"
            )
        if gaps:
            partial = any(gap.needs_more_memory for gap in gaps)
            notes.append(
                f"PARTIAL EXPORT (--allow-partial): {exporter.trainer.words} will not do all that trial "
                f"{entry['trial']} does:"
                if partial
                else f"{exporter.trainer.words} does some of it its own way, never with more device memory:"
            )
            notes += [f"  {gap.line(exporter.trainer.words)}" for gap in gaps]
        if unmasked:
            notes.append(exporter.trainer.packing_note(searched.documents, trainer_job.techniques.attention))
        across = " attending across the documents (--documents one)" if unmasked else ""
        notes.append(
            f"re-estimate of what {exporter.trainer.words} runs{across}: "
            f"{_record_line(estimate, hardware.device_memory_bytes)}"
        )
        if estimate.status != "ok":
            raise NotExpressible(
                f"{exporter.trainer.words}'s version of {which} {entry['trial']} runs at no length: "
                f"{_record_line(estimate, hardware.device_memory_bytes)}"
            )
        if estimate.seq_len != searched.seq_len:
            seq_len = estimate.seq_len
            notes.append(
                f"so this export is for {seq_len:,} tokens, the longest {exporter.trainer.words}'s version fits "
                f"(the searched config reached {searched.seq_len:,})"
            )
    final = estimate.to_dict() if estimate else record
    if hardware.near_capacity(final.get("peak_device_bytes")) and final.get("status") == "ok":
        notes.append(
            f"NEAR CAPACITY: the peak, {final['peak_device_bytes'] / GIB:.2f} GiB, is within the {hardware.name} "
            f"preset's {hardware.oracle_margin:.0%} uncertainty of its {hardware.device_memory_bytes / GIB:.2f} GiB: "
            "`autotune verify` it on the node, or export a shorter front point"
        )
    config = TrialConfig(
        model=searched.model,
        hardware=searched.hardware,
        gpus=searched.gpus,
        nodes=searched.nodes,
        seq_len=seq_len,
        techniques=trainer_job.techniques,
        predicted=estimate.to_dict() if estimate else searched.predicted,
        measured=None if estimate else searched.measured,
        documents=searched.documents,
        lora=searched.lora,
    )
    if config.lora.on:
        notes.append(f"{config.lora.describe()} on the frozen model: {exporter.trainer.lora}")
    packing = exporter.trainer.packing_note(searched.documents, config.techniques.attention)
    if packing and not unmasked:  # an unmasked one is said beside its re-estimate
        notes.append(packing)
    padding = exporter.trainer.ring_padding_note(searched.documents, config.techniques)
    if padding:
        notes.append(padding)
    unpredicted = exporter.trainer.prediction_note(config.techniques, model_config)
    if unpredicted:
        notes.append(unpredicted)
    notes.append(f"launch: {exporter.launch(path, config)}")
    rendered = exporter.render(config, notes, path)
    return Export(exporter, entry, config, gaps, estimate, notes, rendered)
