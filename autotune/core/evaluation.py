"""What to evaluate: one config of one model at one sequence length on ``nodes`` nodes of ``gpus`` devices of a
hardware preset."""

from __future__ import annotations

from dataclasses import dataclass

from autotune.core.hardware import Hardware
from trials.kernels.documents import ONE, DocumentsSpec
from trials.models.lora import FULL_TRAINING, LoraSpec
from trials.stack.techniques import Techniques


@dataclass(frozen=True)
class Evaluation:
    """A model, a technique set, a sequence length, on ``nodes`` nodes of ``gpus`` devices of ``hardware`` each
    (``world_size`` ranks in all, filling the nodes in rank order)."""

    model_config: dict
    techniques: Techniques
    seq_len: int
    gpus: int  # per node
    hardware: Hardware
    nodes: int = 1
    documents: DocumentsSpec = ONE  # the documents packed into each sequence (``--documents``)
    lora: LoraSpec = FULL_TRAINING  # the adapters trained on a frozen base (``--lora-rank``); rank 0: every weight

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes
