"""``autotune export``: ``best.json``'s config, else the fastest front config a trainer can run, in that trainer's
format (``autotune.outputs.exporters``), to stdout or a file."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from autotune.cli.common import OUT, app, fail, say


@app.command()
def export(
    directory: Path = typer.Argument(..., help="a search output folder"),
    target: str | None = typer.Option(
        None,
        help="export the fastest front config reaching this length (default: the search's target, best.json's config)",
    ),
    format: str = typer.Option(
        "autotune", help="autotune | deepspeed | arctic | accelerate | accelerate-deepspeed | torchrun | slurm"
    ),
    output: Path | None = typer.Option(
        None, "-o", "--output", help="write here instead of stdout (missing folders are made)"
    ),
    allow_partial: bool = typer.Option(
        False,
        "--allow-partial",
        help="export the fastest config at the target even where the format cannot "
        "express all of it (with what it will not do and the oracle's re-estimate of what it runs)",
    ),
):
    """Export best.json's config where the format's trainer runs it in full, else the fastest front config it runs in
    full (ArcticTraining, Accelerate/Trainer, DeepSpeed, autotune's own runner); exit 1 when none reaches the
    target."""
    from autotune.core.sizes import parse_tokens
    from autotune.outputs.exporters import NotExpressible, make_exporter
    from autotune.outputs.exporters import export as export_front

    exporter = make_exporter(format)
    length = parse_tokens(target, "--target") if target is not None else None
    if output is not None:
        _check_output(output)
    try:
        result = export_front(
            directory,
            length,
            exporter,
            allow_partial,
            str(output) if output is not None else exporter.default_file,
            progress=lambda line: say(f"autotune: {line}"),
        )
    except NotExpressible as exc:
        say(f"autotune: {exc}")
        raise typer.Exit(1) from None
    text, companions = result.rendered.text, result.rendered.companions
    if output is None:
        OUT.print(text)
        for suffix, body in companions.items():  # the files the export refers to, under the names it uses
            say(f"# ---- {Path(exporter.default_file).with_suffix(suffix)} ----\n{body}")
    else:
        for line in result.notes[1:-1]:  # what the trainer runs differently (the export carries them too)
            say(f"autotune: {line}")
        output.parent.mkdir(parents=True, exist_ok=True)
        for path, body in [(output, text), *((output.with_suffix(s), b) for s, b in companions.items())]:
            try:
                path.write_text(body + "\n")
            except OSError as exc:
                fail(f"-o {str(path)!r} cannot be written: {exc.strerror}")
            say(f"autotune: wrote {path}")


def _check_output(output: Path) -> None:
    """Refuse, before any work, an ``-o`` that names a folder or lies where no folder can be made (its nearest
    existing parent is a file or not writable); missing folders are made when the export is written."""
    if output.is_dir():
        fail(f"-o {str(output)!r} is a folder; name the file to write")
    existing = next(parent for parent in output.absolute().parents if parent.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK):
        fail(f"-o {str(output)!r} cannot be written: {str(existing)!r} is not a folder this user may write in")
