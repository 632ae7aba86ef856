"""The one interface of trial backends: evaluate one config at one sequence length, return a ``ResultRecord``."""

from __future__ import annotations

import abc

from autotune.core.evaluation import Evaluation
from autotune.core.record import ResultRecord

__all__ = ["Backend", "Evaluation"]


class Backend(abc.ABC):
    """Evaluate configs. Implementations must never raise for a config that merely fails: they return a
    record with status ``oom`` / ``error`` / ``timeout`` instead (with the reason in ``error``)."""

    name: str = "backend"

    @abc.abstractmethod
    def evaluate(self, evaluation: Evaluation) -> ResultRecord: ...
