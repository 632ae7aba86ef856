"""Trial backends: evaluate one config at one sequence length and return a ``ResultRecord``.

Both backends share one narrow interface (``Backend.evaluate``) and one result type, like Optuna's
samplers: the search does not care whether a record was predicted or measured.

- ``plan``  (``autotune.backends.plan``): memory oracle + throughput model, no GPU needed.
- ``local`` (``autotune.backends.local``): a real trial under torchrun on this node.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

from autotune.config import Techniques
from autotune.presets import Hardware
from autotune.record import ResultRecord


@dataclass(frozen=True)
class Evaluation:
    """What to evaluate: a model, a technique set, a sequence length, on ``gpus`` devices of ``hardware``."""

    model_config: dict
    techniques: Techniques
    seq_len: int
    gpus: int
    hardware: Hardware


class Backend(abc.ABC):
    """Evaluate configs. Implementations must never raise for a config that merely fails: they return a
    record with status ``oom`` / ``error`` / ``timeout`` instead."""

    name: str = "backend"

    @abc.abstractmethod
    def evaluate(self, evaluation: Evaluation) -> ResultRecord:
        ...


def make_backend(name: str, **options) -> Backend:
    """``plan`` or ``local`` (``auto`` is resolved by the caller, see ``resolve_backend``)."""
    if name == "plan":
        from autotune.backends.plan import PlanBackend

        return PlanBackend(**options)
    if name == "local":
        from autotune.backends.local import LocalBackend

        return LocalBackend(**options)
    from autotune.errors import UserError

    raise UserError(f"unknown backend {name!r}: choose auto, plan or local")


def resolve_backend(name: str, gpus: int) -> str:
    """``auto`` = ``local`` when this node has at least ``gpus`` CUDA devices, else ``plan``."""
    if name != "auto":
        return name
    import torch

    return "local" if torch.cuda.is_available() and torch.cuda.device_count() >= gpus else "plan"
