"""``autotune export``: ``best.json``'s config, else the fastest front config a trainer can run, in that trainer's
format (``autotune.outputs.exporters``), to stdout or a file."""

from __future__ import annotations

from pathlib import Path

import typer

from autotune.cli.common import OUT, app, console, fail, say


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
    output: Path | None = typer.Option(None, "-o", "--output", help="write here instead of stdout"),
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
    try:
        result = export_front(
            directory,
            length,
            exporter,
            allow_partial,
            str(output) if output is not None else exporter.default_file,
            progress=say,
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
            say(line)
        for path, body in [(output, text), *((output.with_suffix(s), b) for s, b in companions.items())]:
            try:
                path.write_text(body + "\n")
            except OSError as exc:
                fail(f"-o {str(path)!r} cannot be written: {exc.strerror}")
            console.print(f"wrote {path}")
