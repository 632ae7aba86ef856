"""Exports of a search's front: config-v1 JSON, DeepSpeed config, ArcticTraining recipe, torchrun command."""

from __future__ import annotations

import json
from pathlib import Path

from autotune.config import TrialConfig, Techniques
from autotune.errors import UserError
from autotune.sizes import parse_tokens

FORMATS = ("autotune", "deepspeed", "arctic", "torchrun")


def load_front(directory: Path) -> dict:
    path = Path(directory) / "pareto.json"
    if not path.is_file():
        raise UserError(f"{str(directory)!r} has no pareto.json: is it a search output folder?")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(path)!r} is not valid JSON ({exc})") from None


def choose(front_doc: dict, target: int | None) -> dict:
    """The fastest front entry at or above ``target`` (default: the search's own target)."""
    target = front_doc["target"] if target is None else target
    reaching = [f for f in front_doc["front"] if f["seq_len"] >= target]
    if not reaching:
        longest = max((f["seq_len"] for f in front_doc["front"]), default=0)
        raise UserError(f"no front config reaches {target:,} tokens; the longest reached is {longest:,}")
    return max(reaching, key=lambda f: (f["tokens_per_s"], -f["seq_len"]))


def entry_config(front_doc: dict, entry: dict) -> TrialConfig:
    record = entry["record"]
    return TrialConfig(model=front_doc["model"], hardware=front_doc["hardware"], gpus=front_doc["gpus"],
                       seq_len=entry["seq_len"], techniques=Techniques.from_dict(entry["techniques"]),
                       predicted=record if record["source"] == "predicted" else None,
                       measured=record if record["source"] == "measured" else None)


def export_config(directory: Path, target: str | None, fmt: str) -> str:
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} must be one of {', '.join(FORMATS)}")
    front_doc = load_front(directory)
    entry = choose(front_doc, parse_tokens(target, "--target") if target is not None else None)
    config = entry_config(front_doc, entry)
    if fmt == "autotune":
        return json.dumps(config.to_dict(), indent=2)
    raise UserError(f"--format {fmt} is not available yet; use --format autotune")
