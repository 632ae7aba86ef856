"""The attention kernels: one declaration per kernel the ``attention`` knob can name (``registry``: the GPUs it runs
on, its entry points, its package, each trainer's name for it, what a model's attention needs of it), and the
attention op that calls them (``attention``: the causal and windowed attention of a layer or a head chunk, the
``attn_implementation`` registered with ``transformers``).

A new kernel is a declaration in ``registry`` and its calling convention in ``attention``. May import
``trials.core`` only.
"""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    """``trials.kernels.KERNELS`` and the other declarations, as the flat module of earlier releases held them."""
    if name.startswith("__"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    registry = importlib.import_module("trials.kernels.registry")
    try:
        return getattr(registry, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
