"""The technique set: every knob declared once, in ``Techniques``' fields, with everything about it.

A knob is a field of ``Techniques`` whose metadata (``knob(...)``) says what the rest of the code derives:

    kind            bool | int | tokens (K/M suffixes in YAML) | choice (one of ``choices``)
    default         the value with the technique off (the plain model)
    nullable        ``None`` is a value (``head_chunk``: null = plain Ulysses)
    minimum         the smallest value allowed (checked by ``trials.stack.rules``)
    requires        (knob, why): this one may be set (not its default) only with that one on
    sampled_when    (knob, predicate): a search samples it only when the other knob's value passes
    split_by        (knob, tag, rule): its choices depend on that knob's value: ``rule(choice, value,
                    model_config, world)`` (``trials.stack.rules``) says why a choice cannot run with it (None: it can), and
                    each value has its own search parameter ``{name}_{tag}{value}`` (Optuna learns each branch)
    words           YAML/CLI words for values: ``{"none": 0, "all": ALL_LAYERS}``
    less_memory     which change needs less memory: ``on`` (True), ``larger`` (the next larger choice),
                    ``smaller`` (the next smaller choice, off -- 0 or None -- counting as the largest)
    speed_either_way  the memory-saving change may run faster or slower (how work and state spread over the
                    ranks: FSDP, the Ulysses and ring degrees); without it the knob trades speed for memory, so
                    only its more-memory neighbour can run faster (``autotune.search.polish``)
    alst            the value ALST's stack uses (a value, or ``"max"`` for the largest choice), for search seeds
    length_unit     ``required``: the sequence length must be a multiple of the value; ``grid``: lengths
                    searched are multiples of it (tiles divide the sequence evenly)
    label           short plot label (``{}`` = the value), shown when the value is not the default; a knob
                    with a ``requires`` / ``sampled_when`` parent joins its parent's part of the label
    doc             one line: what it does

``trials.stack.rules`` holds the structural rules (divisibility by heads and ranks, ranges, requirements) as pure
functions that config validation, the search space's filter and ``trials.stack.apply`` all call.
Adding a knob = one field here + its technique module (``trials.stack``) + tests.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from trials.core.errors import ConfigError
from trials.kernels.registry import attention_kernel_problem
from trials.stack.knobs import ALL_LAYERS, ATTENTION_KERNELS, Knob, declared_knobs, knob
from trials.stack.rules import (
    head_chunk_split_problem,
    problems,
    ring_degree_problem,
    ring_split_problem,
)

__all__ = ["ALL_LAYERS", "ATTENTION_KERNELS", "BASELINE", "Knob", "Techniques", "knob_names", "knobs"]


def _degree_above_one(degree) -> bool:
    return degree > 1


@dataclass(frozen=True)
class Techniques:
    """The memory techniques of one training configuration (DESIGN.md's table); defaults = the plain model."""

    fsdp: bool = knob(
        False,
        "bool",
        "shard params, grads and optimizer states over all ranks (FSDP2, ZeRO-3)",
        label="fsdp",
        less_memory="on",
        speed_either_way=True,
        alst=True,
    )
    optimizer_offload: bool = knob(
        False,
        "bool",
        "sharded params, grads and Adam states on the host; the step runs there",
        label="+optoff",
        requires=("fsdp", "the host keeps the sharded optimizer states"),
        less_memory="on",
        alst=True,
    )
    ulysses_degree: int = knob(
        1,
        "int",
        "DeepSpeed-Ulysses sequence parallelism over this many ranks",
        label="sp{}",
        minimum=1,
        less_memory="larger",
        speed_either_way=True,
        alst="max",
        length_unit="required",
    )
    ring_degree: int = knob(
        1,
        "int",
        "ring attention over this many ranks (zigzag split, K/V passed around); x ulysses_degree = the "
        "context-parallel world",
        label="r{}",
        minimum=1,
        split_by=("ulysses_degree", "u", ring_split_problem),
        less_memory="larger",
        speed_either_way=True,
        alst=1,
    )
    head_chunk: int | None = knob(
        None,
        "int",
        "untied Ulysses (UPipe): attention over this many local heads at a time (null = all)",
        label="/hc{}",
        nullable=True,
        minimum=1,
        sampled_when=("ulysses_degree", _degree_above_one),
        split_by=("ulysses_degree", "u", head_chunk_split_problem),
        less_memory="smaller",
        alst=None,
    )
    activation_checkpointing: bool = knob(
        False,
        "bool",
        "keep only each decoder layer's input, recompute the layer in backward",
        label="ac",
        less_memory="on",
        alst=True,
    )
    activation_offload_layers: int = knob(
        0,
        "int",
        "the first N layers' checkpointed inputs live on the host",
        label="+off{}",
        minimum=0,
        requires=("activation_checkpointing", "it offloads checkpointed inputs"),
        words={"none": 0, "all": ALL_LAYERS},
        less_memory="larger",
        alst="all",
    )
    mlp_tile_tokens: int = knob(
        0,
        "tokens",
        "tiled MLP over sequence tiles of this many tokens (0 = off)",
        label="tiled",
        minimum=0,
        less_memory="smaller",
        alst="max",
        length_unit="grid",
    )
    loss_tile_tokens: int = knob(
        0,
        "tokens",
        "tiled logits + cross-entropy over tiles of this many tokens",
        label="tiled",
        minimum=0,
        less_memory="smaller",
        alst="max",
        length_unit="grid",
    )
    norm_tile_tokens: int = knob(
        0,
        "tokens",
        "tiled RMSNorm: fp32 math one tile of this many tokens at a time",
        label="tiled",
        minimum=0,
        less_memory="smaller",
        alst="max",
        length_unit="grid",
    )
    attention: str = knob(
        "sdpa",
        "choice",
        "attention kernel: sdpa (torch), or flash / flash3 / flash4 (FlashAttention 2 / 3 / 4, CUDA)",
        label="{}",  # the kernel by name in config labels (plots, `autotune show`): flash and flash3 differ in speed
        choices=ATTENTION_KERNELS,
        alst="flash",
    )

    @classmethod
    def from_dict(cls, data: dict[str, Any], num_layers: int | None = None) -> Techniques:
        """Parse a config's ``techniques`` mapping: unknown keys and values of the wrong type are refused
        (``ConfigError``); words (``all`` / ``none``) are resolved, ``all`` with ``num_layers``."""
        if not isinstance(data, dict):
            raise ConfigError(f"techniques must be a mapping, got {type(data).__name__}")
        table = {k.name: k for k in knobs()}
        unknown = sorted(set(data) - set(table))
        if unknown:
            raise ConfigError(f"unknown technique key {unknown[0]!r}; known: {', '.join(sorted(table))}")
        return cls(**{name: table[name].parse(value, num_layers) for name, value in data.items()})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def validate(
        self,
        model_config: dict,
        gpus: int,
        seq_len: int | None = None,
        on_gpu: bool | None = None,
        compute_capability_major: int | None = None,
    ) -> Techniques:
        """Refuse (``ConfigError``, the first reason) what cannot run on ``gpus`` ranks; returns self. With
        ``on_gpu`` (the devices are GPUs, or the CPU), also an attention kernel that cannot run the model's
        attention there (``trials.kernels.registry.attention_kernel_problem``), by the limits the kernel declares
        for GPUs of ``compute_capability_major`` when it is known. A ring also refuses a model with sliding
        windows (``trials.stack.rules.ring_degree_problem``); packed documents it runs padded
        (``trials.stack.rules.ring_document_unit``)."""
        found = problems(self, model_config, gpus, seq_len)
        if self.ring_degree > 1 or on_gpu is not None:
            from trials.models.config import attention_features

            features = attention_features(model_config)
        if self.ring_degree > 1:
            ring = ring_degree_problem(
                self.ring_degree, max(1, self.ulysses_degree), gpus, windowed="window" in features
            )
            found += [ring] if ring and ring not in found else []
        if on_gpu is not None:
            kernel = attention_kernel_problem(self.attention, features, on_gpu, compute_capability_major)
            found += [kernel] if kernel else []
        if found:
            raise ConfigError(found[0])
        return self


def knobs() -> tuple[Knob, ...]:
    """Every knob, in declaration order."""
    return declared_knobs(Techniques)


def knob_names() -> tuple[str, ...]:
    return tuple(k.name for k in knobs())


BASELINE = Techniques()
