"""What every command shares: the typer app, where output goes (``OUT``: stdout; ``console``: stderr), bad input
(``fail``: exit 2) and failed outcomes (``fail_outcome``: exit 1), and the tables several commands print."""

from __future__ import annotations

import json
import math
import sys

import typer
from rich.console import Console
from rich.measure import Measurement
from rich.table import Table

from autotune.core.errors import UserError


class CommandInterrupted(Exception):
    """A KeyboardInterrupt a command did not handle, carried past Typer (which would exit 130 without a word)."""


def _flags_take_no_value(params: list) -> list:
    """``params`` with no value type shown for a flag in ``--help`` (typer would show ``<bool>``)."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


class Command(typer.core.TyperCommand):
    """Every command's class (``app.command`` gives it): its help shows a flag as a flag."""

    def get_params(self, ctx):
        return _flags_take_no_value(super().get_params(ctx))


class _Commands(typer.core.TyperGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise CommandInterrupted from exc

    def get_params(self, ctx):
        return _flags_take_no_value(super().get_params(ctx))


class _App(typer.Typer):
    def command(self, *args, cls: type[typer.core.TyperCommand] = Command, **kwargs):
        return super().command(*args, cls=cls, **kwargs)


app = _App(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # a docstring's `code` renders as code, its lines are one paragraph
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


def best_line(
    target: int, trial: int, seq_len: int, tokens_per_s: float, where: str, step_time_s: float | None = None
) -> str:
    """The line naming ``best.json``'s config (``autotune search``'s last, ``autotune show``'s): its trial, length
    (the target), rate and step time there."""
    from autotune.core.sizes import format_duration, format_tokens

    step = f", {format_duration(step_time_s)} a step" if step_time_s else ""
    return (
        f"best for {format_tokens(target)}: trial {trial} at {format_tokens(seq_len)}, {tokens_per_s:,.0f} tokens/s"
        f"{step} -> {where}"
    )


def print_record(record: dict, as_json: bool, title: str, hardware=None) -> None:
    """A record as one JSON object, or as a table of what it holds (a field without a value, such as a prediction's
    loss, is left out of the table; ``--json`` keeps it as null). With ``hardware``, the device peak and the host
    bytes beside their capacities (the host's per accelerator) and a ``binds`` row: the memory nearest its capacity
    (``Hardware.binding_memory``), what a longer sequence runs out of."""
    if as_json:
        OUT.print(json.dumps(record))
        return
    from autotune.core.sizes import format_duration

    capacities = {}
    if hardware is not None:
        capacities = {"peak_device_bytes": (hardware.device_memory_bytes, "")}
        if hardware.host_memory_bytes_per_device:
            capacities["host_bytes"] = (hardware.host_memory_bytes_per_device, " per GPU")
    table = Table(title=title, show_header=False)
    for key, value in record.items():
        if value is None:
            continue
        if key == "breakdown":
            value = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in (value or {}).items())
        elif key in capacities and isinstance(value, int):
            capacity, per = capacities[key]
            value = f"{value:,} ({value / 2**30:.2f} of {capacity / 2**30:.2f} GiB{per})"
        elif key.endswith("_bytes") and isinstance(value, int):
            value = f"{value:,} ({value / 2**30:.2f} GiB)"
        elif key == "step_time_s" and isinstance(value, float):
            value = f"{significant(value)} ({format_duration(value)} a step)"
        elif key == "seq_len":
            from autotune.core.sizes import format_tokens

            value = format_tokens(value)
        elif isinstance(value, float):  # to a rate's or a time's precision, not 17 digits (--json keeps them)
            value = f"{value:,.1f}" if key.endswith("_per_s") else significant(value)
        elif isinstance(value, int) and not isinstance(value, bool):
            value = f"{value:,}"
        table.add_row(key, str(value))
    binding = None
    if hardware is not None and record.get("status") in ("ok", "oom"):
        binding = hardware.binding_memory(record.get("peak_device_bytes"), record.get("host_bytes"))
    if binding is not None:
        which, used, capacity = binding
        per = " per GPU" if which == "host" else ""
        table.add_row("binds", f"{which} memory: {used / capacity:.0%} of its {capacity / 2**30:.2f} GiB{per}")
    OUT.rich(table)


def significant(value: float, digits: int = 4) -> str:
    """``value`` to ``digits`` significant digits, grouped, never in exponent form: ``14,350``, ``5,489``,
    ``0.4024``."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    return f"{value:,.{max(0, digits - 1 - math.floor(math.log10(abs(value))))}f}"


def print_front(front: list[dict], target: int, hardware=None, best: dict | None = None, lora=None) -> None:
    """The front as a table; with ``hardware``, a peak within its preset's uncertainty of capacity marked ``!``
    (``Hardware.near_capacity``); with ``best`` (the front document's), the points of best.json's config marked;
    with ``lora`` (``LoraSpec``) that trains adapters, the title says so."""
    from autotune.outputs.plots import knob_label

    near = [e for e in front if hardware is not None and hardware.near_capacity(e["record"].get("peak_device_bytes"))]
    caption = "* reaches the target"
    of_best = [e for e in front if best is not None and e.get("techniques") == best.get("techniques")]
    if of_best:
        caption += "; = best.json's config"
    if near:
        caption += (
            f"; ! within the {hardware.name} preset's {hardware.oracle_margin:.0%} uncertainty of its "
            f"{hardware.device_memory_bytes / 2**30:.2f} GiB (autotune verify it on the node)"
        )
    trains = lora.aside if lora is not None else ""
    table = Table(title=f"Pareto front (sequence length vs tokens/s){trains}", caption=caption)
    from autotune.core.sizes import format_duration

    columns = ["trial", "seq_len", "tokens/s", "step", "peak GiB", "source", "config"]
    if hardware is not None:  # the memory nearest its capacity: what a longer sequence of the config runs out of
        columns.insert(5, "binds")
    for column in columns:
        table.add_column(column)
    for entry in front:
        record = entry["record"]
        cells = [
            str(entry["trial"]) + (" =" if entry in of_best else ""),
            f"{entry['seq_len']:,}" + (" *" if entry["seq_len"] >= target else ""),
            f"{entry['tokens_per_s']:,.0f}",
            format_duration(record["step_time_s"]) if record.get("step_time_s") else "-",
            f"{(record.get('peak_device_bytes') or 0) / 2**30:.2f}" + (" !" if entry in near else ""),
            record["source"],
            knob_label(entry["techniques"]),
        ]
        if hardware is not None:
            binding = hardware.binding_memory(record.get("peak_device_bytes"), record.get("host_bytes"))
            cells.insert(5, f"{binding[0]} {binding[1] / binding[2]:.0%}" if binding else "-")
        table.add_row(*cells)
    OUT.rich(table)


def validate_run(run, hw, seq_len: int | None) -> None:
    """Refuse (``ConfigError``, one line) a config file's techniques that cannot run ``run``'s model on its GPUs of
    ``hw`` at ``seq_len`` (None: any length)."""
    run.techniques.validate(
        run.model_config,
        run.gpus * run.nodes,
        seq_len,
        on_gpu=not hw.device_is_host,
        compute_capability_major=hw.compute_capability or None,
    )
