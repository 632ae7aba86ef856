"""Every numeric command-line option's range, declared once.

``RANGES`` is the table (a flag means the same thing, with the same range, in every command that takes it);
``ranged_option`` builds a command's typer option from it: the range is appended to the option's help, and a
callback refuses a value outside it while the command line is parsed, before the command does anything. A
refusal is typer's ``BadParameter``, which ``autotune.cli.main`` prints as one line and exits 2 for, e.g.
``autotune: error: Invalid value for '--trials': must be at least 1, got 0``.

Lengths (``--target``, ``--seq``) are not here: they take K/M suffixes and ``autotune.core.sizes.parse_tokens``
checks them."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import typer


@dataclass(frozen=True)
class Range:
    """The values an option takes: from ``minimum`` (excluded when ``above_minimum``) up to ``maximum``
    (included; None: no upper bound). NaN and infinities are never in a range."""

    minimum: float
    above_minimum: bool = False
    maximum: float | None = None
    unit: str = ""

    def describe(self) -> str:
        bounds = [f"{'above' if self.above_minimum else 'at least'} {_number(self.minimum)}"]
        if self.maximum is not None:
            bounds.append(f"at most {_number(self.maximum)}")
        return " and ".join(bounds) + (f" {self.unit}" if self.unit else "")

    def contains(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        above = value > self.minimum if self.above_minimum else value >= self.minimum
        return above and (self.maximum is None or value <= self.maximum)


SECONDS = Range(0, above_minimum=True, unit="seconds")

RANGES: dict[str, Range] = {
    "--gpus": Range(1),
    "--nodes": Range(1),
    "--trials": Range(1),
    "--steps": Range(1),
    "--top": Range(1),
    "--repeats": Range(1, maximum=10),
    # Optuna's TPE sampler seeds NumPy's RandomState, which takes 32 bits; trials seed torch with the same value
    "--seed": Range(0, maximum=2**32 - 1),
    "--timeout": SECONDS,
    "--trial-timeout": SECONDS,
    "--memory-gib": Range(0, above_minimum=True, maximum=1e6, unit="GiB"),
    "--rank": Range(0),  # and below the job's world size, which the command checks once it knows it
    "--lora-rank": Range(0),
    "--lora-alpha": Range(0, above_minimum=True),
}


def ranged_option(flag: str, default: Any, help: str) -> Any:
    """The typer option ``flag`` (a key of ``RANGES``) with ``default``: its range shown in ``--help`` and checked
    as the command line is parsed (None, an optional option left out, is not checked)."""

    def refuse_outside_range(value):
        check_range(flag, value)
        return value

    return typer.Option(default, flag, help=ranged_help(flag, help), callback=refuse_outside_range)


def ranged_help(flag: str, help: str) -> str:
    """``help`` with the range of ``flag`` (a key of ``RANGES``) appended."""
    return f"{help} ({RANGES[flag].describe()})"


def check_range(flag: str, value) -> None:
    """Refuse a ``value`` of ``flag`` (a key of ``RANGES``) outside its range, as typer's ``BadParameter`` (None, an
    optional option left out, is not checked)."""
    allowed = RANGES[flag]
    if value is not None and not allowed.contains(value):
        raise typer.BadParameter(f"must be {allowed.describe()}, got {_number(value)}", param_hint=f"'{flag}'")


def _number(value: float) -> str:
    if isinstance(value, int) or (math.isfinite(value) and value == int(value) and abs(value) < 1e15):
        return f"{int(value):,}"
    return f"{value:g}"
