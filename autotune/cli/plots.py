"""``autotune plot`` (redraw a search folder's figures) and ``autotune show`` (its front as a table)."""

from __future__ import annotations

from pathlib import Path

import typer

from autotune.cli.common import OUT, app, best_line, console, print_front, say


@app.command()
def plot(directory: Path = typer.Argument(...), output: Path | None = typer.Option(None, "-o", "--output")):
    """Redraw pareto.png and memory.png (trials.parquet, pareto.json) and pareto.html (study.db, plotly)."""
    import pyarrow.parquet as pq

    from autotune.outputs.exporters import load_front
    from autotune.outputs.plots import model_title, plot_pareto, where_title
    from trials.models.lora import LoraSpec

    front_doc = load_front(directory)
    rows = pq.read_table(directory / "trials.parquet").to_pylist()
    path = output or directory / "pareto.png"
    where = where_title(front_doc["gpus"], front_doc["hardware"], front_doc.get("nodes", 1))
    where += LoraSpec.from_json(front_doc.get("lora")).aside
    title = f"{model_title(front_doc['model'])} on {where}"  # the search's own
    plot_pareto(rows, front_doc["front"], front_doc["target"], path, title=title, best=front_doc.get("best"))
    console.print(f"wrote {path}")
    if output is None and front_doc["front"] and "capacity_bytes" in front_doc:
        from autotune.outputs.report import plot_front_memory

        plot_front_memory(
            front_doc["front"],
            front_doc["capacity_bytes"],
            directory / "memory.png",
            title=f"memory per rank of the front, {title}",
            host_capacity=front_doc.get("host_capacity_bytes", 0),
        )
        console.print(f"wrote {directory / 'memory.png'}")
    if output is None:
        _plot_html(directory)


def _plot_html(directory: Path) -> None:
    """pareto.html from the study in ``directory/study.db`` (a search with --storage elsewhere has none here)."""
    import optuna

    from autotune.outputs.plots import write_pareto_html

    db = directory / "study.db"
    if not db.exists():
        console.print(f"pareto.html skipped: no study.db in {directory} (the study lives in its --storage)")
        return
    storage = f"sqlite:///{db.resolve()}"
    names = optuna.get_all_study_names(storage)
    if len(names) != 1:
        console.print(f"pareto.html skipped: {len(names)} studies in {db}")
        return
    if write_pareto_html(optuna.load_study(study_name=names[0], storage=storage), directory / "pareto.html"):
        console.print(f"wrote {directory / 'pareto.html'}")
    else:
        console.print("pareto.html skipped: plotly is not installed (pip install 'autotune[plots]')")


@app.command()
def show(directory: Path = typer.Argument(...)):
    """Print a search folder's Pareto front as a table."""
    from autotune.outputs.exporters import load_front
    from autotune.outputs.exporters.selection import search_hardware
    from trials.models.lora import LoraSpec

    front_doc = load_front(directory)
    trainer = front_doc.get("trainer", "autotune")
    if trainer != "autotune":
        say(f"autotune: a search for --trainer {trainer}: every config is what {trainer} runs")
    lora = LoraSpec.from_json(front_doc.get("lora"))
    print_front(front_doc["front"], front_doc["target"], search_hardware(front_doc), front_doc.get("best"), lora)
    best = front_doc.get("best")
    if best:
        step = (best.get("record") or {}).get("step_time_s")
        OUT.rich(
            best_line(front_doc["target"], best["trial"], best["seq_len"], best["tokens_per_s"], "best.json", step)
        )
    if front_doc.get("best_choice"):
        say(f"autotune: {front_doc['best_choice']}")
