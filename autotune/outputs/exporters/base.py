"""The one narrow base of export formats: ``Exporter`` (one subclass per ``--format``, like Optuna's samplers).

A format names the trainer that reads it (``Exporter.trainer``, a ``autotune.core.trainers.Trainer``: what
that trainer expresses, declared once for the search, the export and the re-estimate) and renders a config its
trainer runs (``Exporter.render``). Everything else derives from the trainer's declaration: which knob values it
will actually run (``trainer_techniques``), where that differs from the searched config (``gaps``), whether a
front config can be exported in full (``expresses_in_full``), the comment block of a partial export and the
re-estimate of what the trainer runs (``autotune.outputs.exporters.selection``).

Contract of a subclass:

    name        the ``--format`` word
    trainer     the ``Trainer`` that reads the export (``autotune.core.trainers.TRAINERS``); its ``expresses``
                says, for every knob, how the trainer is told and which value it runs
    default_file the file name the export is meant for when it goes to stdout
    render(config, notes, path) -> Rendered
                the export for ``config``, whose techniques are already what the trainer runs
                (``trainer_techniques``): render writes them, it never decides what is expressible. ``notes``
                (lines: where the config comes from, what the format will not do, the re-estimate, the launch
                command) go into the export as comments where the trainer ignores them, or into a companion
                file when the main text cannot carry comments (JSON). ``path`` is where the main text is written
                (``default_file`` for stdout); companions go to ``beside(path, suffix)``, which is how the main
                text refers to them (e.g. an Accelerate config to its DeepSpeed JSON).
    launch(path, config)
                the command that trains with the export of ``config`` written at ``path``
"""

from __future__ import annotations

import abc
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from autotune.core.trainers import (  # noqa: F401 -- the exporters' vocabulary, declared in core
    ExportJob,
    Expression,
    Gap,
    Trainer,
    exactly,
    not_expressed,
    runs_as,
)
from trials.kernels.registry import KERNELS
from trials.stack.techniques import Techniques
from trials.training.config_file import TrialConfig


@dataclass
class Rendered:
    """An export: its main text, and companion files as ``{suffix: text}`` (written beside it)."""

    text: str
    companions: dict[str, str] = field(default_factory=dict)


class Exporter(abc.ABC):
    """One export format (see the module docstring for the contract)."""

    name: ClassVar[str]
    trainer: ClassVar[Trainer]
    default_file: ClassVar[str]

    @property
    def expresses(self) -> Mapping[str, Expression]:
        return self.trainer.expresses

    def trainer_techniques(self, job: ExportJob) -> Techniques:
        """The techniques the trainer runs when handed ``job``'s config."""
        return self.trainer.runs(job)

    def gaps(self, job: ExportJob) -> list[Gap]:
        """Every knob the trainer runs differently from ``job``'s config."""
        return self.trainer.gaps(job)

    def expresses_in_full(self, job: ExportJob) -> bool:
        """The trainer runs the config (``Trainer.expresses_in_full``)."""
        return self.trainer.expresses_in_full(job)

    @abc.abstractmethod
    def render(self, config: TrialConfig, notes: list[str], path: str) -> Rendered: ...

    @abc.abstractmethod
    def launch(self, path: str, config: TrialConfig) -> str: ...


def beside(path: str, suffix: str) -> str:
    """The path of a companion file: ``path`` with its suffix replaced (``ds.json`` + ``.alst.py`` = ``ds.alst.py``)."""
    return str(Path(path).with_suffix(suffix))


def comment_block(notes: list[str], prefix: str = "# ") -> str:
    return "\n".join(f"{prefix}{line}".rstrip() for line in notes)


def hf_attention(techniques: Techniques) -> str:
    """The Hugging Face ``attn_implementation`` of the config's attention kernel (its ``trials.kernels.registry``
    declaration's ``hf_implementation``: ``flash_attention_2``, ``flash_attention_3``, ``flash_attention_4``,
    ``sdpa``)."""
    return KERNELS[techniques.attention].hf_implementation


def adamw() -> dict:
    """AdamW's settings as ``autotune run`` trains by default (``trials.train``'s options): ``lr``, ``betas``,
    ``weight_decay`` and ``max_grad_norm`` (None: no clipping), for the exports that write an optimizer."""
    from trials.train import TrainOptions

    defaults = TrainOptions(config="")
    return {
        "lr": defaults.lr,
        "betas": [defaults.beta1, defaults.beta2],
        "weight_decay": defaults.weight_decay,
        "max_grad_norm": defaults.max_grad_norm,
    }


MODEL_PLACEHOLDER = "REPLACE-WITH-YOUR-MODEL"
HUB_SOURCE = re.compile(r"https://huggingface\.co/([^/\s]+/[^/\s]+)/")  # a preset's ``_source``: its hub repo


def hf_model_name(model: str) -> str:
    """What a trainer's ``from_pretrained`` takes for autotune's ``--model``: a preset's hub id (from the config it
    copies, its ``_source``), the folder of a config.json path, a model folder itself, or a placeholder the user
    replaces (the tiny test presets are no released model)."""
    from trials.models.config import load_model_config, model_names

    if model in model_names():
        match = HUB_SOURCE.match(load_model_config(model).get("_source", ""))
        return match.group(1) if match else MODEL_PLACEHOLDER
    path = Path(model)
    if path.name == "config.json" or path.suffix == ".json":
        return str(path.parent)
    if (path / "config.json").is_file():  # a model folder, as --model takes it
        return str(path)
    return MODEL_PLACEHOLDER
