"""A search folder's front (``pareto.json``, ``autotune/pareto-v1``): reading it, and one entry as a config file."""

from __future__ import annotations

import json
from pathlib import Path

from autotune.core.errors import UserError
from trials.kernels.documents import DocumentsSpec
from trials.models.lora import LoraSpec
from trials.stack.techniques import Techniques
from trials.training.config_file import TrialConfig

FRONT_SCHEMA = "autotune/pareto-v1"  # what ``autotune.outputs.report`` writes


def load_front(directory: Path) -> dict:
    """A search folder's ``pareto.json`` (``autotune/pareto-v1``; files from before the schema field are v1)."""
    path = Path(directory) / "pareto.json"
    if not path.is_file():
        raise UserError(f"{str(directory)!r} has no pareto.json: is it a search output folder?")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(path)!r} is not valid JSON ({exc})") from None
    schema = doc.get("schema", FRONT_SCHEMA) if isinstance(doc, dict) else None
    if schema != FRONT_SCHEMA:
        raise UserError(f"{str(path)!r}: schema {schema!r} is not {FRONT_SCHEMA!r}")
    return doc


def entry_techniques(entry: dict) -> Techniques:
    return Techniques.from_dict(entry["techniques"])


def entry_config(front_doc: dict, entry: dict) -> TrialConfig:
    """A front entry as a config file. Entries carry ``predicted`` / ``measured`` (both sides, e.g. after
    ``autotune verify``); older ones only ``record``, which goes on its own side."""
    record = entry["record"]
    sides = {
        side: entry[side] if side in entry else (record if record["source"] == side else None)
        for side in ("predicted", "measured")
    }
    return TrialConfig(
        model=front_doc["model"],
        hardware=front_doc["hardware"],
        gpus=front_doc["gpus"],
        nodes=front_doc.get("nodes", 1),
        seq_len=entry["seq_len"],
        techniques=entry_techniques(entry),
        documents=DocumentsSpec.from_json(front_doc.get("documents")),
        lora=LoraSpec.from_json(front_doc.get("lora")),
        **sides,
    )
