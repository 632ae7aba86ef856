"""A search's inputs: what to search, on what, with which backend, into which folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from autotune.backends import Backend
from autotune.core.evaluation import Evaluation
from autotune.core.hardware import Hardware
from autotune.core.trainers import AUTOTUNE, Trainer
from autotune.search.space import SearchSpace
from trials.kernels.documents import ONE, DocumentsSpec
from trials.models.lora import FULL_TRAINING, LoraSpec


@dataclass
class SearchJob:
    model: str
    model_config: dict
    target: int
    gpus: int  # per node
    hardware: Hardware
    space: SearchSpace
    backend: Backend
    out: Path
    trials: int
    timeout_s: float | None = None
    storage: str | None = None
    study_name: str | None = None
    seed: int = 0
    prefilter: Backend | None = None  # the plan backend in front of real trials
    follow_ups: bool = True  # climb front configs and step down in memory at their walls (see follow_ups)
    avoided: dict = field(default_factory=lambda: {"cache": 0, "monotone": 0, "oracle": 0})
    workers: int | None = None  # plan backend: processes evaluating trials (None: one per core; see parallel.py)
    stats: dict = field(default_factory=dict)  # plan backend with workers: what the pool did (PooledBackend.stats)
    nodes: int = 1  # nodes of ``gpus`` devices each
    documents: DocumentsSpec = ONE  # the documents packed into each sequence: the front and best are for them
    lora: LoraSpec = FULL_TRAINING  # the adapters trained on the frozen model: the front and best are for them

    @property
    def world_size(self) -> int:
        return self.gpus * self.nodes

    @property
    def trainer(self) -> Trainer:
        """The trainer the search is for (its space's)."""
        return self.space.trainer if self.space is not None else AUTOTUNE

    def validate(self, techniques, seq_len: int) -> None:
        """``ConfigError`` (one line) where ``techniques`` cannot run ``seq_len`` on this job's model, world and
        device (``Techniques.validate``)."""
        techniques.validate(
            self.model_config,
            self.world_size,
            seq_len,
            on_gpu=not self.hardware.device_is_host,
            compute_capability_major=self.hardware.compute_capability or None,
        )

    def evaluation(self, techniques, seq_len: int, trainer: Trainer | None = None) -> Evaluation:
        """What a trial of ``techniques`` (as the search's trainer, or ``trainer``, runs them) at ``seq_len``
        evaluates: the documents its attention runs over (``Trainer.documents_run``), on the device as the trainer
        holds it (``Hardware.holding`` what ``Trainer.held_bytes`` says: ZeRO-3's buffers count against capacity)."""
        trainer = trainer or self.trainer
        hardware = self.hardware.holding(trainer.held_bytes(techniques, self.model_config))
        documents = trainer.documents_run(self.documents, techniques.attention)
        return Evaluation(self.model_config, techniques, seq_len, self.gpus, hardware, self.nodes, documents, self.lora)

    def documents_for(self, techniques) -> DocumentsSpec:
        """The documents a config's attention runs over when the search's trainer runs it: the packed ones where
        the trainer masks them with that kernel, else one per sequence (``Trainer.documents_run``: it attends
        across their boundaries, so it pays for, and reaches what, whole-window attention does)."""
        return self.trainer.documents_run(self.documents, techniques.attention)
