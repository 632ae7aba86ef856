"""The one narrow base of export formats: ``Exporter`` (one subclass per ``--format``, like Optuna's samplers).

A format declares, once, what its trainer can express (``Exporter.expresses``) and renders a config its trainer
runs (``Exporter.render``). Everything else derives from the declaration: which knob values the trainer will
actually run (``trainer_techniques``), where that differs from the searched config (``gaps``), whether a front
config can be exported in full (``expresses_in_full``), the comment block of a partial export and the
re-estimate of what the trainer runs (``autotune.outputs.exporters.selection``).

Contract of a subclass:

    name        the ``--format`` word
    trainer     the trainer that reads the export, in words ("ArcticTraining 0.8")
    expresses   ``{knob name: Expression}`` for every knob of ``trials.techniques.Techniques``, each exactly once
                (checked when the class is defined, so a new knob makes every format say what it does with it):
                ``Expression.how`` says how the trainer is told (its keys or calls, or why it cannot be),
                ``Expression.runs(value, job)`` which value the trainer then runs (default: the value asked)
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
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from trials.config_file import TrialConfig
from trials.knobs import Knob
from trials.techniques import Techniques, knobs


@dataclass(frozen=True)
class ExportJob:
    """One front config as a trainer would run it: the model, the node's GPU count, the length, the techniques."""

    model: str
    model_config: dict
    gpus: int
    seq_len: int
    techniques: Techniques
    nodes: int = 1  # nodes of ``gpus`` each

    @property
    def layers(self) -> int:
        return self.model_config["num_hidden_layers"]

    @property
    def hidden_size(self) -> int:
        return self.model_config["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.model_config["vocab_size"]

    @property
    def local_tokens(self) -> int:
        """Tokens per rank: Ulysses splits the sequence over its degree."""
        return self.seq_len // self.techniques.ulysses_degree


def _as_asked(value, job: ExportJob):
    return value


@dataclass(frozen=True)
class Expression:
    """How a format writes one knob (``how``: the trainer's keys or calls, in its words) and which value the
    trainer runs when the config asks for ``value`` (``runs(value, job)``; default: the value itself)."""

    how: str
    runs: Callable[[Any, ExportJob], Any] = _as_asked
    off: bool = False  # the trainer has no such technique: it runs the knob's default, whatever is asked


def exactly(how: str) -> Expression:
    """The trainer runs the value asked."""
    return Expression(how)


def runs_as(how: str, runs: Callable[[Any, ExportJob], Any]) -> Expression:
    """The trainer runs its own value (``runs``) for the value asked."""
    return Expression(how, runs)


def not_expressed(why: str) -> Expression:
    """The trainer has no such technique: it runs the knob off (its default), whatever the config asks."""
    return Expression(f"not expressible: {why}", off=True)


def _memory_rank(knob: Knob, value) -> float:
    """Orders a knob's values by the memory they save (larger = saves more), from the knob's ``less_memory``."""
    if knob.less_memory == "on":
        return 1.0 if value else 0.0
    if knob.less_memory == "larger":
        return float(value or 0)
    if knob.less_memory == "smaller":  # a tile or a chunk: off counts as the largest
        return -math.inf if knob.is_off(value) else -float(value)
    raise ValueError(f"{knob.name} has no memory order")


@dataclass(frozen=True)
class Gap:
    """A knob whose value the trainer runs differs from the one the config asks for."""

    knob: Knob
    asked: Any
    runs: Any
    how: str

    @property
    def needs_more_memory(self) -> bool:
        """The trainer does less of a memory-saving technique than asked (or the knob has no memory order, so
        it cannot be told): the config's length is no longer guaranteed, only a re-estimate can say."""
        if self.knob.less_memory is None:
            return True
        return _memory_rank(self.knob, self.runs) < _memory_rank(self.knob, self.asked)

    def line(self, trainer: str) -> str:
        kind = "will not do" if self.needs_more_memory else "does its own way (never more device memory)"
        return f"{self.knob.name}: asked {_word(self.asked)}, {trainer} runs {_word(self.runs)} -- {kind}; {self.how}"


def _word(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


@dataclass
class Rendered:
    """An export: its main text, and companion files as ``{suffix: text}`` (written beside it)."""

    text: str
    companions: dict[str, str] = field(default_factory=dict)


class Exporter(abc.ABC):
    """One export format (see the module docstring for the contract)."""

    name: ClassVar[str]
    trainer: ClassVar[str]
    expresses: ClassVar[Mapping[str, Expression]]
    default_file: ClassVar[str]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        declared = set(cls.expresses)
        every = {k.name for k in knobs()}
        if declared != every:
            missing, unknown = sorted(every - declared), sorted(declared - every)
            raise TypeError(
                f"{cls.__name__}.expresses must declare every knob exactly once (missing {missing}, unknown {unknown})"
            )

    def trainer_techniques(self, job: ExportJob) -> Techniques:
        """The techniques the trainer runs when handed ``job``'s config."""
        values = {}
        for knob in knobs():
            expression = self.expresses[knob.name]
            asked = getattr(job.techniques, knob.name)
            values[knob.name] = knob.default if expression.off else expression.runs(asked, job)
        return Techniques(**values)

    def gaps(self, job: ExportJob) -> list[Gap]:
        """Every knob the trainer runs differently from ``job``'s config."""
        runs = self.trainer_techniques(job)
        return [
            Gap(knob, getattr(job.techniques, knob.name), getattr(runs, knob.name), self.expresses[knob.name].how)
            for knob in knobs()
            if getattr(runs, knob.name) != getattr(job.techniques, knob.name)
        ]

    def expresses_in_full(self, job: ExportJob) -> bool:
        """The trainer runs everything the config asks for, or differs only where that never needs more device
        memory (the re-estimate still checks the host memory, which offloading more layers takes)."""
        return not any(gap.needs_more_memory for gap in self.gaps(job))

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
    """The Hugging Face ``attn_implementation`` of an ``attention`` knob value."""
    return "flash_attention_2" if techniques.attention == "flash" else "sdpa"


# Hugging Face hub ids of the model presets that are released models (their config.json is the preset's).
HF_MODEL_IDS = {
    "llama3-8b": "meta-llama/Meta-Llama-3-8B",
    "llama3-70b": "meta-llama/Meta-Llama-3-70B",
    "qwen3-32b": "Qwen/Qwen3-32B",
}
MODEL_PLACEHOLDER = "REPLACE-WITH-YOUR-MODEL"


def hf_model_name(model: str) -> str:
    """What a trainer's ``from_pretrained`` takes for autotune's ``--model``: a preset's hub id, the folder of a
    config.json path, or a placeholder the user replaces (the tiny test presets are no released model)."""
    if model in HF_MODEL_IDS:
        return HF_MODEL_IDS[model]
    path = Path(model)
    if path.name == "config.json" or path.suffix == ".json":
        return str(path.parent)
    return MODEL_PLACEHOLDER
