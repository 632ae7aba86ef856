"""The config file ``autotune/config-v1``: which techniques, for which model, nodes and sequence length
(``gpus`` per node, ``nodes`` of them: 1 when absent), and (``trainer``, optional) the trainer it was searched for;
``documents`` (optional; absent: "one") the documents packed into each sequence
(``trials.kernels.documents.DocumentsSpec``: "one", a length, or a list of lengths); ``lora`` (optional; absent:
full training) the LoRA adapters trained on the frozen model (``trials.models.lora.LoraSpec``: rank, alpha, targets).

The hand-off from the tuner to training: ``best.json`` of a search, the input of ``autotune estimate/trial``
and of ``python -m trials.train``. Unknown keys and values of the wrong type are refused (``ConfigError``) with
the reason, before anything runs. ``predicted`` / ``measured`` are result records (DESIGN.md), kept as given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trials.core.errors import ConfigError
from trials.kernels.documents import ONE, DocumentsSpec
from trials.models.config import load_model_config
from trials.models.lora import FULL_TRAINING, LoraSpec
from trials.stack.techniques import Techniques

SCHEMA = "autotune/config-v1"
_KEYS = {
    "schema",
    "model",
    "hardware",
    "gpus",
    "nodes",
    "seq_len",
    "techniques",
    "predicted",
    "measured",
    "trainer",
    "documents",
    "lora",
}


@dataclass
class TrialConfig:
    """One ``autotune/config-v1`` file."""

    model: str
    techniques: Techniques
    hardware: str = "h100-sxm"
    gpus: int = 8  # per node
    seq_len: int | None = None
    predicted: dict | None = None
    measured: dict | None = None
    schema: str = SCHEMA
    nodes: int = 1  # the world is nodes x gpus
    trainer: str | None = None  # the trainer the config was searched for (absent: autotune's own, every knob)
    documents: DocumentsSpec = ONE  # the documents packed into each sequence (absent: one per sequence)
    lora: LoraSpec = FULL_TRAINING  # the adapters trained on the frozen model (absent: every weight trains)

    def to_dict(self) -> dict[str, Any]:
        nodes = {"nodes": self.nodes} if self.nodes != 1 else {}  # one node: no ``nodes`` key (absent means 1)
        return {
            "schema": self.schema,
            "model": self.model,
            "hardware": self.hardware,
            "gpus": self.gpus,
            **nodes,
            "seq_len": self.seq_len,
            "techniques": self.techniques.to_dict(),
            "predicted": self.predicted,
            "measured": self.measured,
            **({"trainer": self.trainer} if self.trainer else {}),
            **({"documents": self.documents.to_json()} if not self.documents.one else {}),
            **({"lora": self.lora.to_json()} if self.lora.on else {}),
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def parse_config(data: Any, source: str = "config") -> TrialConfig:
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: a config file must be a JSON object")
    unknown = sorted(set(data) - _KEYS)
    if unknown:
        raise ConfigError(f"{source}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_KEYS))}")
    if data.get("schema") != SCHEMA:
        raise ConfigError(f"{source}: schema {data.get('schema')!r} is not {SCHEMA!r}")
    model = data.get("model")
    if not isinstance(model, str):
        raise ConfigError(f"{source}: model must be a preset name or a config.json path")
    layers = load_model_config(model)["num_hidden_layers"]
    gpus = data.get("gpus", 8)
    if isinstance(gpus, bool) or not isinstance(gpus, int):
        raise ConfigError(f"{source}: gpus must be an integer, got {gpus!r}")
    nodes = data.get("nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ConfigError(f"{source}: nodes must be a positive integer, got {nodes!r}")
    seq_len = data.get("seq_len")
    if seq_len is not None and (isinstance(seq_len, bool) or not isinstance(seq_len, int)):
        raise ConfigError(f"{source}: seq_len must be an integer, got {seq_len!r}")
    trainer = data.get("trainer")
    if trainer is not None and not isinstance(trainer, str):
        raise ConfigError(f"{source}: trainer must be a trainer's name, got {trainer!r}")
    try:
        documents = DocumentsSpec.from_json(data.get("documents"))
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    try:
        lora = LoraSpec.from_json(data.get("lora"))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return TrialConfig(
        model=model,
        techniques=Techniques.from_dict(data.get("techniques", {}), layers),
        hardware=data.get("hardware", "h100-sxm"),
        gpus=gpus,
        nodes=nodes,
        seq_len=seq_len,
        predicted=data.get("predicted"),
        measured=data.get("measured"),
        trainer=trainer,
        documents=documents,
        lora=lora,
    )


def load_config_file(path: str | Path) -> TrialConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid JSON ({exc})") from None
    return parse_config(data, source=str(path))
