"""What every command shares: the typer app, where output goes (``OUT``: stdout; ``console``: stderr), bad input
(``fail``: exit 2) and failed outcomes (``fail_outcome``: exit 1), and the tables several commands print."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from autotune.core.errors import UserError


class CommandInterrupted(Exception):
    """A KeyboardInterrupt a command did not handle, carried past Typer (which would exit 130 without a word)."""


class _Commands(typer.core.TyperGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise CommandInterrupted from exc


app = typer.Typer(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Find the memory/throughput configuration for multi-million-token training.",
)
console = Console(stderr=True, soft_wrap=True)  # a line as written: a wrapped path or command breaks when pasted


@app.callback()
def _global_options(
    verbose: bool = typer.Option(False, "-v", "--verbose", help="show third-party libraries' banners and warnings"),
):
    from autotune.core import quiet

    quiet.configure(True if verbose else None)  # unset: $AUTOTUNE_VERBOSE, quiet by default


class _Output:
    """Where our own output goes. Libraries print to stdout (DeepSpeed's logger, its JIT build messages), but
    ``--json`` promises stdout holds exactly one JSON object, so while a command runs fd 1 and sys.stdout point
    at stderr and our output is written to the saved stdout (``autotune.cli``'s ``library_noise_to_stderr``)."""

    file = sys.stdout

    def print(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def rich(self, renderable) -> None:
        """A table or line, whole: on a terminal as wide as the terminal; piped or redirected (no width to
        fit) as wide as the renderable needs, so no column is cut to a console's default 80."""
        console = Console(file=self.file, soft_wrap=True)
        if not console.is_terminal:
            needed = Measurement.get(console, console.options.update_width(10_000), renderable).maximum
            console = Console(file=self.file, soft_wrap=True, width=max(console.width, needed))
        console.print(renderable)


OUT = _Output()

TARGET_HELP = "tokens: an integer or K/M suffix (K=1024, M=1024^2; 5M = 5,242,880)"
RDZV_HELP = (
    "HOST:PORT for real trials over --nodes nodes: run the same command on every node; the agent on HOST "
    "drives, the others follow (torchrun's c10d rendezvous)"
)
NODES_HELP = "nodes of --gpus devices each (the world is nodes x gpus)"


def fail(message: str) -> None:
    """Bad input: ``message`` as the one line on stderr, exit 2 (``autotune.cli.main``)."""
    raise UserError(message)


def fail_outcome(cause: str) -> None:
    """The command ran but its outcome is a failure: ``cause``'s root cause as the last line of stderr, exit 1."""
    from autotune.search.front import root_cause

    print(f"autotune: {root_cause(cause)}", file=sys.stderr, flush=True)
    raise typer.Exit(1)


def say(line: str) -> None:
    """One line on stderr, as written (no markup, no wrapping)."""
    console.print(line, markup=False, highlight=False, soft_wrap=True)


def note_rates(hw) -> None:
    """One line on stderr when the time model's rates were not measured on this node."""
    if hw.calibrated:
        return
    print(
        f"note: hardware {hw.name}: {hw.rate_provenance()}; `autotune calibrate --name NAME` measures this "
        f"node's, then --hardware NAME",
        file=sys.stderr,
    )


def follow(backend, what: str):
    """A follower's part of a multi-node command: run what the driver publishes; returns what came with its stop."""
    group = backend.group
    say(f"autotune: node {group.node} of {group.nodes}: following the {what} driven at {group.endpoint}")
    try:
        return backend.follow()
    except RuntimeError as exc:  # the driver's store went away before it said stop
        fail_outcome(f"the driver at {group.endpoint} went away before the end: {str(exc).splitlines()[0]}")


def best_line(target: int, trial: int, seq_len: int, tokens_per_s: float, where: str) -> str:
    """The line naming ``best.json``'s config (``autotune search``'s last, ``autotune show``'s): its trial, length
    (the target) and rate there."""
    from autotune.core.sizes import format_tokens

    return (
        f"best for {format_tokens(target)}: trial {trial} at {format_tokens(seq_len)}, {tokens_per_s:,.0f} tokens/s "
        f"-> {where}"
    )


def print_record(record: dict, as_json: bool, title: str) -> None:
    if as_json:
        OUT.print(json.dumps(record))
        return
    table = Table(title=title, show_header=False)
    for key, value in record.items():
        if key == "breakdown":
            value = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in (value or {}).items())
        elif key.endswith("_bytes") and isinstance(value, int):
            value = f"{value:,} ({value / 2**30:.2f} GiB)"
        elif key == "seq_len":
            from autotune.core.sizes import format_tokens

            value = format_tokens(value)
        elif isinstance(value, float):  # to a rate's or a time's precision, not 17 digits (--json keeps them)
            value = f"{value:,.1f}" if key.endswith("_per_s") else f"{value:.4g}"
        table.add_row(key, str(value))
    OUT.rich(table)


def print_front(front: list[dict], target: int) -> None:
    from autotune.outputs.plots import knob_label

    table = Table(title="Pareto front (sequence length vs tokens/s)", caption="* reaches the target")
    for column in ("trial", "seq_len", "tokens/s", "peak GiB", "source", "config"):
        table.add_column(column)
    for entry in front:
        record = entry["record"]
        table.add_row(
            str(entry["trial"]),
            f"{entry['seq_len']:,}" + (" *" if entry["seq_len"] >= target else ""),
            f"{entry['tokens_per_s']:,.0f}",
            f"{(record.get('peak_device_bytes') or 0) / 2**30:.2f}",
            record["source"],
            knob_label(entry["techniques"]),
        )
    OUT.rich(table)
