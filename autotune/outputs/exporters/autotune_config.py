"""``--format autotune``: the config file itself (``autotune/config-v1``), for ``trials`` in your own loop,
``autotune estimate`` / ``trial`` / ``run``. It expresses every knob: autotune's own stack runs all of them."""

from __future__ import annotations

import json

from autotune.core.trainers import AUTOTUNE
from autotune.outputs.exporters.base import Exporter, Rendered
from trials.training.config_file import TrialConfig


class AutotuneConfigExporter(Exporter):
    name = "autotune"
    default_file = "autotune-config.json"
    trainer = AUTOTUNE

    def render(self, config: TrialConfig, notes: list[str], path: str) -> Rendered:
        return Rendered(json.dumps(config.to_dict(), indent=2))  # JSON carries no comments: notes go to stderr

    def launch(self, path: str, config: TrialConfig) -> str:
        return f"autotune run --config {path} --steps 100"
