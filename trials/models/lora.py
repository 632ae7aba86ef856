"""LoRA adapters: the workload trains low-rank adapters on a frozen base model instead of every weight.

    spec = LoraSpec(rank=16, alpha=32, targets="all-linear")
    apply_lora(model, spec)          # model: trials.models.model.TrainingModel, before trials.stack.apply

The adapters are ``peft``'s own (``peft.inject_adapter_in_model`` with a ``LoraConfig``): each targeted ``nn.Linear``
becomes peft's LoRA layer, ``y = base(x) + lora_B(lora_A(x)) * alpha / rank``, its base weight frozen. So a model
trained here loads into ``peft`` as it is, and the stack's exactness is held against peft's forward and backward.
What the rest of the stack sees: frozen parameters (no gradient, no optimizer state, no weight-gradient GEMM in
backward) and small trainable ones. Every knob composes with it: the modules that run a projection themselves
(head-chunked attention, ``trials.stack.upipe``) read the adapter through ``adapter_of``.

Modules may also train whole beside the adapters (``LoraSpec.trainable``: peft's ``modules_to_save``; LongLoRA's
recipe for context extension trains ``embed_tokens`` and every ``norm`` so): their own weights train in place, where
peft trains a copy of each, so an export is what peft saves for them and the step is peft's step.

Like the documents packed into a sequence, the adapter is part of the workload (the user's choice, not searched).
``LoraSpec()`` (rank 0) is full training. Dropout is 0 (the adapters are exact against peft only without it, and
long-context recipes train without it).
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from typing import Any

import torch

ALL_LINEAR = "all-linear"  # peft's word: every linear layer but the output head
ADAPTER_NAME = "default"  # peft's adapter name
TRAINED_COPY = f".modules_to_save.{ADAPTER_NAME}."  # in the name of peft's copy of a module it trains whole


@dataclass(frozen=True)
class LoraSpec:
    """The adapter a workload trains (rank 0: none, full training).

    ``targets``: ``"all-linear"`` or the names of the linear modules to adapt (peft's ``target_modules``:
    ``q_proj``, ``v_proj``, ...). ``alpha``: the scaling numerator (peft's ``lora_alpha``; None = twice the rank).
    ``init_lora_weights``: True draws A from N(0, 1/rank) and starts B at zero (peft's ``"gaussian"``: the adapted
    model is the base model); False draws B from the model's initializer too (peft's False: the adapters change the
    model from the first step, which exactness tests want).
    ``trainable``: modules trained whole beside the adapters, by peft's rule for ``modules_to_save`` (every module
    whose name ends with one of them: ``norm`` is every RMSNorm, ``embed_tokens`` the input embedding).
    """

    rank: int = 0
    alpha: float | None = None
    targets: str | tuple[str, ...] = ALL_LINEAR
    init_lora_weights: bool = True
    trainable: tuple[str, ...] = ()

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
        trainable = self.trainable
        if not isinstance(trainable, (list, tuple)) or not all(isinstance(t, str) and t for t in trainable):
            raise ValueError(f"LoRA's trainable modules must be module names, got {trainable!r}")
        if trainable and not self.on:
            raise ValueError("trainable modules beside the adapters need a LoRA rank (full training trains them all)")
        object.__setattr__(self, "trainable", tuple(trainable))

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
            modules_to_save=list(self.trainable) or None,
        )

    @classmethod
    def of(cls, value) -> LoraSpec:
        """``value`` as a ``LoraSpec``: itself, or a ``peft.LoraConfig`` (what a TRL script passes as ``peft_config``),
        read back; ``ValueError`` (one line) for what the stack cannot run exactly (dropout, a trained bias, DoRA,
        rsLoRA, a regular expression for the targets)."""
        if isinstance(value, LoraSpec):
            return value
        if type(value).__name__ != "LoraConfig":
            raise ValueError(f"lora: a LoraSpec or a peft.LoraConfig, not {type(value).__name__}")
        refused = [
            (value.lora_dropout, "lora_dropout must be 0"),
            (value.bias != "none", 'bias must be "none"'),
            (getattr(value, "use_dora", False), "use_dora is not supported"),
            (getattr(value, "use_rslora", False), "use_rslora is not supported"),
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
            trainable=tuple(sorted(value.modules_to_save or ())),
        )

    def to_json(self) -> dict[str, Any] | None:
        """The config file's form: None for full training, else a mapping."""
        if not self.on:
            return None
        data = asdict(self)
        data["targets"] = self.targets if self.targets == ALL_LINEAR else list(self.targets)
        if self.trainable:
            data["trainable"] = list(self.trainable)
        else:  # adapters alone: no key (from_json reads its absence so)
            del data["trainable"]
        return data

    @classmethod
    def from_json(cls, value) -> LoraSpec:
        """Read ``to_json``'s form back (ValueError with the reason)."""
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"lora must be a mapping (rank, alpha, targets, trainable), got {str(value)[:60]}")
        known = {"rank", "alpha", "targets", "init_lora_weights", "trainable"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown lora key {unknown[0]!r}; known: {', '.join(sorted(known))}")
        return cls(**value)

    def describe(self) -> str:
        if not self.on:
            return "full training"
        targets = "all linear layers" if self.targets == ALL_LINEAR else ", ".join(self.targets)
        whole = f", {' and '.join(self.trainable)} trained whole" if self.trainable else ""
        return f"LoRA rank {self.rank} (alpha {self.rank * self.scaling:g}) on {targets}{whole}"

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
    own initialisation on a materialised model, as ``get_peft_model`` draws it).
    ``spec.trainable``'s modules train in place: peft's ``modules_to_save`` is left out of the config injected (it
    would wrap each in a trained copy beside the frozen original) and kept in ``model.lora_config``.
    ``ValueError`` (one line) when a trainable name matches no module, a module LoRA adapts, or an input embedding
    the output head shares."""
    if not isinstance(spec, LoraSpec):
        spec, peft_config = LoraSpec.of(spec), spec
    if not spec.on:
        return model
    config = peft_config or spec.peft_config(model.lm)
    injected = copy.copy(config)
    injected.modules_to_save = None
    # the adapters are made where the base weights are (meta before materialising): made elsewhere, peft moves them
    # there by a tensor swap, which the memory oracle's fake tensors refuse
    with torch.device(next(model.parameters()).device):
        _peft().inject_adapter_in_model(injected, model.lm, adapter_name=ADAPTER_NAME)
    config.target_modules = injected.target_modules  # peft's "all-linear" resolved to names, as peft does in place
    whole = {id(param) for module in _trained_whole(model.lm, spec.trainable) for param in module.parameters()}
    for name, param in model.named_parameters():
        param.requires_grad_(adapter_role(name) is not None or id(param) in whole)
    model.lora = spec
    model.lora_config = config  # modules_to_save included: an export's adapter_config.json
    return model


def _trained_whole(lm, names: tuple[str, ...]) -> list[torch.nn.Module]:
    """The modules of ``lm`` (its adapters in) that ``names`` train whole, by peft's rule for ``modules_to_save`` (a
    module whose name ends with one of them); ``ValueError`` for a name that matches none or an adapted module, or an
    input embedding whose weight the output head shares (peft would train a copy of one, the stack the shared
    weight)."""
    matched = {target: [module for key, module in lm.named_modules() if key.endswith(target)] for target in names}
    missing = [target for target, modules in matched.items() if not modules]
    if missing:
        raise ValueError(f"lora: no module of the model is named {missing[0]!r} (trainable beside the adapters)")
    modules = [module for found in matched.values() for module in found]
    if any(adapter_role(name) for module in modules for name, _ in module.named_modules()):
        raise ValueError(f"lora: a module LoRA adapts cannot also train whole ({', '.join(names)})")
    output = lm.get_output_embeddings()
    if output is not None and any(output.weight is param for m in modules for param in m.parameters()):
        raise ValueError("lora: the input embedding shares its weight with the output head: it cannot train whole")
    return list({id(module): module for module in modules}.values())


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
