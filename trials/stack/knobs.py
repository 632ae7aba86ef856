"""What a knob declaration holds (``Knob``) and how ``trials.stack.techniques.Techniques`` declares one (``knob``).

See ``trials.stack.techniques`` for the meaning of each field; this module only defines the shapes, so that
``trials.stack.rules`` can read any declared table without importing the technique set itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from trials.core.errors import ConfigError
from trials.kernels.registry import KERNEL_NAMES

ATTENTION_KERNELS = KERNEL_NAMES  # sdpa first (the default), then the flash kernels
ALL_LAYERS = "all"  # the word for "every decoder layer" (resolved with the model's layer count)


@dataclass(frozen=True)
class Knob:
    """Everything about one knob (see the module docstring); ``knobs()`` lists them in declaration order."""

    name: str
    kind: str
    default: Any
    doc: str
    label: str | None = None
    nullable: bool = False
    minimum: int | None = None
    choices: tuple | None = None
    requires: tuple[str, str] | None = None
    sampled_when: tuple[str, Callable[[Any], bool]] | None = None
    split_by: tuple[str, str, Callable[[Any, Any, dict], str | None]] | None = None
    words: dict = field(default_factory=dict)
    less_memory: str | None = None
    speed_either_way: bool = False
    alst: Any = None
    length_unit: str | None = None

    @property
    def parent(self) -> str | None:
        """The knob this one depends on (its ``requires`` or ``sampled_when``), if any."""
        if self.requires:
            return self.requires[0]
        return self.sampled_when[0] if self.sampled_when else None

    def is_off(self, value) -> bool:
        """Off = the plain model's value (0, None, False, or the default)."""
        return value in (None, 0, False) or value == self.default

    def parse(self, value, num_layers: int | None = None):
        """A config value of this knob (words resolved, type checked); raises ``ConfigError``."""
        if isinstance(value, str) and value in self.words or (value is None and "none" in self.words):
            resolved = self.words[value if value is not None else "none"]
            if resolved == ALL_LAYERS:
                if num_layers is None:
                    raise ConfigError(f"{self.name} {value!r} needs the model's layer count")
                return num_layers
            return resolved
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise ConfigError(f"{self.name} must be true or false, got {value!r}")
        elif self.kind in ("int", "tokens"):
            if value is None and self.nullable:
                return None
            if isinstance(value, bool) or not isinstance(value, int):
                suffix = " or null" if self.nullable else ""
                raise ConfigError(f"{self.name} must be an integer{suffix}, got {value!r}")
        return value


def knob(default, kind: str, doc: str, **metadata):
    """A ``Techniques`` field declaring one knob (see ``Knob``)."""
    return field(default=default, metadata={"knob": dict(kind=kind, default=default, doc=doc, **metadata)})


def declared_knobs(cls) -> tuple[Knob, ...]:
    """The knobs a dataclass declares with ``knob(...)``, in field order."""
    cached = cls.__dict__.get("_knob_table")
    if cached is not None:
        return cached
    table = []
    for f in fields(cls):
        spec = f.metadata.get("knob")
        if spec is None or f.default is MISSING:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with knob(...)")
        table.append(Knob(name=f.name, **spec))
    table = tuple(table)
    cls._knob_table = table
    return table
