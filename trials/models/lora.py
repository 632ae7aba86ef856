"""LoRA adapters: the workload trains low-rank adapters on a frozen base model instead of every weight.

    spec = LoraSpec(rank=16, alpha=32, targets="all-linear")
    apply_lora(model, spec)          # model: trials.models.model.TrainingModel, before trials.stack.apply

The adapters are ``peft``'s own (``peft.inject_adapter_in_model`` with a ``LoraConfig``): each targeted ``nn.Linear``
becomes peft's LoRA layer, ``y = base(x) + lora_B(lora_A(x)) * alpha / rank``, its base weight frozen. So a model
trained here loads into ``peft`` as it is, and the stack's exactness is held against peft's forward and backward.
What the rest of the stack sees: frozen parameters (no gradient, no optimizer state, no weight-gradient GEMM in
backward) and small trainable ones. Every knob composes with it: the modules that run a projection themselves
(head-chunked attention, ``trials.stack.upipe``) read the adapter through ``adapter_of``.

Like the documents packed into a sequence, the adapter is part of the workload (the user's choice, not searched).
``LoraSpec()`` (rank 0) is full training. Dropout is 0 (the adapters are exact against peft only without it, and
long-context recipes train without it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

ALL_LINEAR = "all-linear"  # peft's word: every linear layer but the output head
ADAPTER_NAME = "default"  # peft's adapter name


@dataclass(frozen=True)
class LoraSpec:
    """The adapter a workload trains (rank 0: none, full training).

    ``targets``: ``"all-linear"`` or the names of the linear modules to adapt (peft's ``target_modules``:
    ``q_proj``, ``v_proj``, ...). ``alpha``: the scaling numerator (peft's ``lora_alpha``; None = twice the rank).
    ``init_lora_weights``: True draws A from N(0, 1/rank) and starts B at zero (peft's ``"gaussian"``: the adapted
    model is the base model); False draws B from the model's initializer too (peft's False: the adapters change the
    model from the first step, which exactness tests want).
    """

    rank: int = 0
    alpha: float | None = None
    targets: str | tuple[str, ...] = ALL_LINEAR
    init_lora_weights: bool = True

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"the LoRA rank must be a non-negative integer, got {self.rank!r}")
        if self.alpha is not None and (isinstance(self.alpha, bool) or not self.alpha > 0):
            raise ValueError(f"the LoRA alpha must be positive, got {self.alpha!r}")
        targets = self.targets
        if isinstance(targets, (list, tuple)):
            if not targets or not all(isinstance(t, str) and t for t in targets):
                raise ValueError(f"LoRA targets must be module names, got {list(targets)!r}")
            object.__setattr__(self, "targets", tuple(targets))
        elif targets != ALL_LINEAR:
            raise ValueError(f'LoRA targets must be "{ALL_LINEAR}" or a list of module names, got {targets!r}')

    @property
    def on(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return (self.alpha if self.alpha is not None else 2 * self.rank) / self.rank

    def peft_config(self, model=None):
        """The ``peft.LoraConfig`` of these adapters (dropout 0, no bias). ``"all-linear"`` is resolved to the names
        of ``model``'s linear modules (``linear_module_names``) when it is given."""
        targets = list(self.targets) if self.targets != ALL_LINEAR else ALL_LINEAR
        if targets == ALL_LINEAR and model is not None:
            targets = linear_module_names(model)
        return _peft().LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha if self.alpha is not None else 2 * self.rank,
            target_modules=targets,
            lora_dropout=0.0,
            bias="none",
            init_lora_weights="gaussian" if self.init_lora_weights else False,
        )

    @classmethod
    def of(cls, value) -> LoraSpec:
        """``value`` as a ``LoraSpec``: itself, or a ``peft.LoraConfig`` (what a TRL script passes as ``peft_config``),
        read back; ``ValueError`` (one line) for what the stack cannot run exactly (dropout, a trained bias, DoRA,
        rsLoRA, modules saved whole, a regular expression for the targets)."""
        if isinstance(value, LoraSpec):
            return value
        if type(value).__name__ != "LoraConfig":
            raise ValueError(f"lora: a LoraSpec or a peft.LoraConfig, not {type(value).__name__}")
        refused = [
            (value.lora_dropout, "lora_dropout must be 0"),
            (value.bias != "none", 'bias must be "none"'),
            (getattr(value, "use_dora", False), "use_dora is not supported"),
            (getattr(value, "use_rslora", False), "use_rslora is not supported"),
            (value.modules_to_save, "modules_to_save is not supported (the stack trains adapters only)"),
            (getattr(value, "target_parameters", None), "target_parameters is not supported"),
            (isinstance(value.target_modules, str) and value.target_modules != ALL_LINEAR, "target_modules: names"),
        ]
        for failed, why in refused:
            if failed:
                raise ValueError(f"peft_config: {why}")
        targets = value.target_modules
        return cls(
            rank=value.r,
            alpha=float(value.lora_alpha),
            targets=targets if isinstance(targets, str) else tuple(sorted(targets)),
            init_lora_weights=value.init_lora_weights is not False,
        )

    def to_json(self) -> dict[str, Any] | None:
        """The config file's form: None for full training, else a mapping."""
        if not self.on:
            return None
        data = asdict(self)
        data["targets"] = self.targets if self.targets == ALL_LINEAR else list(self.targets)
        return data

    @classmethod
    def from_json(cls, value) -> LoraSpec:
        """Read ``to_json``'s form back (ValueError with the reason)."""
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"lora must be a mapping (rank, alpha, targets), got {str(value)[:60]}")
        known = {"rank", "alpha", "targets", "init_lora_weights"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown lora key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**value)

    def describe(self) -> str:
        if not self.on:
            return "full training"
        targets = "all linear layers" if self.targets == ALL_LINEAR else ", ".join(self.targets)
        return f"LoRA rank {self.rank} (alpha {self.rank * self.scaling:g}) on {targets}"

    @property
    def aside(self) -> str:
        """``describe()`` as a title's aside (``", LoRA rank 16 ..."``); empty for full training, which titles leave
        unsaid."""
        return f", {self.describe()}" if self.on else ""


FULL_TRAINING = LoraSpec()


def _peft():
    """peft, imported outside any dispatch mode: its first import makes a few module-level tensors (its LoHa layers'),
    which are no part of a training step; under a trial's memory tracker or the oracle's fake tensors they would count
    once per process."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        import peft
    return peft


def apply_lora(model, spec, peft_config=None):
    """Give ``model`` (a ``TrainingModel``, on meta or materialised) peft's LoRA adapters on ``spec.targets``; every
    other parameter is frozen. Records ``spec`` as ``model.lora`` (``init_weights`` draws the adapters by it) and the
    ``peft.LoraConfig`` injected as ``model.lora_config``.
    ``spec``: a ``LoraSpec`` or a ``peft.LoraConfig`` (``LoraSpec.of``), which is then the config peft injects (its
    own initialisation on a materialised model, as ``get_peft_model`` draws it)."""
    if not isinstance(spec, LoraSpec):
        spec, peft_config = LoraSpec.of(spec), spec
    if not spec.on:
        return model
    # the adapters are made where the base weights are (meta before materialising): made elsewhere, peft moves them
    # there by a tensor swap, which the memory oracle's fake tensors refuse
    with torch.device(next(model.parameters()).device):
        config = peft_config or spec.peft_config(model.lm)
        _peft().inject_adapter_in_model(config, model.lm, adapter_name=ADAPTER_NAME)
    for name, param in model.named_parameters():
        param.requires_grad_(adapter_role(name) is not None)
    model.lora = spec
    model.lora_config = config  # what was injected: an export's adapter_config.json
    return model


def linear_module_names(lm) -> list[str]:
    """The names (last component) of the ``nn.Linear`` modules of a causal LM but its output head: what
    ``"all-linear"`` adapts. Named here rather than left to peft's word, which on mixture-of-experts models of
    transformers 5 also adapts the experts' fused weights and the router (``target_parameters``): they stay frozen."""
    output = lm.get_output_embeddings()
    names = {
        name.rpartition(".")[2]
        for name, module in lm.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not output
    }
    return sorted(names)


def adapter_role(name: str) -> str | None:
    """``"A"`` or ``"B"`` for an adapter's parameter (or module) name, None for any other."""
    parts = name.split(".")
    if "lora_A" in parts:
        return "A"
    if "lora_B" in parts:
        return "B"
    return None


def adapter_of(module):
    """(A weight [r, in], B weight [out, r], scaling) of a linear module that carries an active LoRA adapter, else
    None. Dropout must be off (``LoraSpec`` sets 0): the callers run ``B(A(x)) * scaling`` themselves."""
    lora_a = getattr(module, "lora_A", None)
    if lora_a is None or ADAPTER_NAME not in lora_a or getattr(module, "disable_adapters", False):
        return None
    if getattr(module, "merged", False):
        raise ValueError("merged LoRA adapters cannot be trained")
    dropout = module.lora_dropout[ADAPTER_NAME]
    if not isinstance(dropout, torch.nn.Identity):
        raise ValueError("LoRA dropout must be 0 for the stack's exact adapters")
    return lora_a[ADAPTER_NAME].weight, module.lora_B[ADAPTER_NAME].weight, module.scaling[ADAPTER_NAME]
