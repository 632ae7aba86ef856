"""The technique stack: each knob declared once (``knobs``, ``techniques``: ``Techniques``), the structural rules of
a technique set (``rules``), one module per technique with its ``apply_*`` (``fsdp``, ``ulysses``, ``ring``, ``upipe``,
``tiling``, ``checkpointing``, ``offload``), and ``recipe``, the one place they are composed, in order:
``trials.stack.apply(model, techniques, mesh)``.

A new technique is a module here and a line in ``recipe``; a new knob a field of ``Techniques``. May import
``trials.core``, ``trials.kernels`` and ``trials.models``; never the step, the trial or the trainer.
Importing this package stays light (no torch): ``apply`` is imported from ``recipe`` when first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trials.stack.recipe import apply

__all__ = ["apply"]


def __getattr__(name: str):
    if name == "apply":
        from trials.stack.recipe import apply

        return apply
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
