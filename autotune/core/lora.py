"""``--lora-rank R [--lora-alpha A] [--lora-targets T] [--lora-trainable M]``: the LoRA adapters a workload trains, parsed once for every
command that takes them (``estimate``, ``trial``, ``search``). Rank 0 is full training (the default); the adapters
are the user's choice, not searched (``trials.models.lora``)."""

from __future__ import annotations

from autotune.core.errors import UserError
from trials.models.lora import ALL_LINEAR, LoraSpec

RANK_HELP = "train LoRA adapters of this rank on the frozen model (peft's LoRA; 0: every weight trains)"
ALPHA_HELP = "LoRA's alpha: the adapters' output scales by alpha / rank (default: twice the rank)"
TARGETS_HELP = f"the linear layers LoRA adapts: {ALL_LINEAR} (every one but the output head) or names, q_proj,v_proj"
TRAINABLE_HELP = (
    "modules trained whole beside the adapters, peft's modules_to_save (each module whose name ends so): "
    "embed_tokens,norm is LongLoRA's recipe for longer context"
)


def parse_lora(
    rank: int | None, alpha: float | None = None, targets: str | None = None, trainable: str | None = None
) -> LoraSpec | None:
    """The adapters the options ask for; None where no ``--lora-*`` option was given (a config file's stand).
    ``UserError`` (one line) for bad input."""
    if rank is None:
        if alpha is not None or targets is not None or trainable is not None:
            raise UserError("--lora-alpha, --lora-targets and --lora-trainable need --lora-rank")
        return None
    names = ALL_LINEAR
    if targets is not None and targets.strip() != ALL_LINEAR:
        names = _names("--lora-targets", targets, f"{ALL_LINEAR} or module names")
    whole = _names("--lora-trainable", trainable, "module names") if trainable is not None else ()
    try:
        return LoraSpec(rank=rank, alpha=alpha, targets=names, trainable=whole)
    except ValueError as exc:
        raise UserError(f"--lora-rank {rank}: {exc}") from None


def _names(option: str, value: str, allowed: str) -> tuple[str, ...]:
    names = tuple(name.strip() for name in value.split(","))
    if not all(name.isidentifier() for name in names):
        raise UserError(f"{option} {value!r} must be {allowed} separated by commas")
    return names
