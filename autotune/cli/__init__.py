"""The ``autotune`` command line (typer). Bad input exits 2 with one line on stderr, never a traceback.

The top layer: it may import every other one. One module per command or group parses the options, calls the layer
that does the work and prints: ``search``, ``estimate``, ``trial``, ``export``, ``verify``, ``run``,
``plots`` (plot, show), ``presets`` (models, hardware, calibrate); ``common`` holds the app and what they share,
``options`` every numeric option's range, ``interrupts`` Ctrl-C and SIGTERM. Heavy modules (torch, the oracle,
the search) are imported inside the commands that need them, so ``autotune --help`` and ``autotune models``
start fast."""

from __future__ import annotations

import contextlib
import io
import os
import sys

import typer

from autotune.cli.common import OUT, CommandInterrupted, app

# each command module registers its commands on ``app`` as it is imported, in the order ``autotune --help`` lists
# them: the workflow's order, not the alphabet's
# isort: off
from autotune.cli import search, estimate, trial, export, verify, run, plots, presets  # noqa: F401

# isort: on
from autotune.cli.interrupts import interrupts_at_safe_points
from trials.core.errors import ConfigError

__all__ = ["app", "main"]


@contextlib.contextmanager
def library_noise_to_stderr():
    """Point fd 1 and sys.stdout at stderr while a command runs; ``OUT`` keeps the real stdout."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):  # captured stdout (tests): Python level only
        OUT.file = sys.stdout
        with contextlib.redirect_stdout(sys.stderr):
            yield
        return
    sys.stdout.flush()
    saved = os.dup(fd)
    OUT.file = os.fdopen(saved, "w")
    os.dup2(sys.stderr.fileno(), fd)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        OUT.file.flush()
        os.dup2(saved, fd)
        OUT.file.close()
        OUT.file = sys.stdout


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code (README, "Exit codes"): 0 done; 1 ran, but the outcome is a failure;
    2 bad input (ours or the parser's: one line on stderr, never a traceback); 130 interrupted (Ctrl-C, SIGTERM)."""
    args = sys.argv[1:] if argv is None else list(argv)
    # help is our own output (``autotune --help | less``); nothing else runs then, so no library noise to divert
    wants_help = "--help" in args or not args
    try:
        # Ctrl-C and a scheduler's SIGTERM: KeyboardInterrupt, never inside the study's storage (exit 130)
        with interrupts_at_safe_points(), contextlib.nullcontext() if wants_help else library_noise_to_stderr():
            # standalone_mode=False lets the errors below reach us; in this mode the parser *returns* the code of
            # a typer.Exit (130 for a KeyboardInterrupt) instead of exiting, and a command's return value (None)
            # when it ends normally
            exit_code = app(args=args, standalone_mode=False)
    except ConfigError as exc:  # bad input: ours (UserError) or the library's (a config that cannot run)
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt, CommandInterrupted):  # a command that saves nothing on Ctrl-C
        print("autotune: interrupted", file=sys.stderr)
        return 130
    except typer.TyperException as exc:  # the parser's: usage errors, options out of range; no arguments: the help
        print(exc.format_message() if not args else f"autotune: error: {exc.format_message()}", file=sys.stderr)
        return 2
    return exit_code if isinstance(exit_code, int) else 0
