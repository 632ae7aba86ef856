"""Trial backends: evaluate one config at one sequence length and return a ``ResultRecord``.

Both backends share one narrow interface (``Backend.evaluate``, in ``base``) and one result type, like Optuna's
samplers: the search does not care whether a record was predicted or measured.

- ``plan``  (``autotune.backends.plan``): memory oracle + time model, no GPU needed.
- ``local`` (``autotune.backends.local``): a real trial under torchrun on this node.
"""

from __future__ import annotations

import torch

from autotune.backends.base import Backend, Evaluation
from autotune.backends.local import LocalBackend
from autotune.backends.plan import PlanBackend
from autotune.core.errors import UserError

__all__ = ["Backend", "Evaluation", "LocalBackend", "PlanBackend", "make_backend", "resolve_backend"]

BACKENDS = {"plan": PlanBackend, "local": LocalBackend}


def make_backend(name: str, **options) -> Backend:
    """``plan`` or ``local`` (``auto`` is resolved by the caller, see ``resolve_backend``)."""
    if name not in BACKENDS:
        raise UserError(f"unknown backend {name!r}: choose auto, plan or local")
    return BACKENDS[name](**options)


def resolve_backend(name: str, gpus: int) -> str:
    """``auto`` = ``local`` when this node has at least ``gpus`` CUDA devices, else ``plan``."""
    if name != "auto":
        return name
    return "local" if torch.cuda.is_available() and torch.cuda.device_count() >= gpus else "plan"
