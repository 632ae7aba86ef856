"""What to evaluate: one config of one model at one sequence length on ``gpus`` devices of a hardware preset."""

from __future__ import annotations

from dataclasses import dataclass

from trials.techniques import Techniques
from autotune.core.hardware import Hardware


@dataclass(frozen=True)
class Evaluation:
    """A model, a technique set, a sequence length, on ``gpus`` devices of ``hardware``."""

    model_config: dict
    techniques: Techniques
    seq_len: int
    gpus: int
    hardware: Hardware
