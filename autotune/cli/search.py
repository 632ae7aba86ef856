"""``autotune search``: its options to a ``SearchRequest``, the search run by ``autotune.search``, its outputs
written by ``autotune.outputs.report``, the front and the best printed."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from autotune.cli.common import (
    NODES_HELP,
    OUT,
    RDZV_HELP,
    TARGET_HELP,
    app,
    best_line,
    console,
    follow,
    note_rates,
    print_front,
    say,
)
from autotune.cli.interrupts import interrupts_deferred
from autotune.cli.options import ranged_option
from autotune.core import lora as lora_options
from autotune.core.documents import DOCUMENTS_HELP


@app.command()
def search(
    model: str = typer.Option(..., help="preset name or path to a Hugging Face config.json"),
    target: str = typer.Option(..., help=TARGET_HELP),
    gpus: int = ranged_option("--gpus", 8, "devices on the node"),
    nodes: int = ranged_option("--nodes", 1, NODES_HELP),
    hardware: str = typer.Option("h100-sxm", help="hardware preset (autotune hardware)"),
    backend: str = typer.Option("auto", help="auto | plan | local"),
    trainer: str = typer.Option(
        "autotune",
        help="the trainer the config is for: autotune or accelerate (every knob) | deepspeed | arctic | "
        "accelerate-deepspeed; the search holds only what it runs (docs/trainers.md)",
    ),
    space: Path | None = typer.Option(
        None,
        help="search space YAML (default: search_spaces/default.yaml, shipped "
        "in the package; search_spaces/README.md: the format)",
    ),
    trials: int = ranged_option("--trials", 30, "finished trials the study should hold (resumes count)"),
    timeout: float | None = ranged_option("--timeout", None, "stop starting new trials after this many seconds"),
    out: Path = typer.Option(Path("autotune-out"), help="output folder (study.db, trials.parquet, ...)"),
    storage: str | None = typer.Option(None, help="Optuna RDB URL or journal file shared by workers"),
    study: str | None = typer.Option(None, help="study name (workers sharing --storage use the same)"),
    seed: int = ranged_option("--seed", 0, "sampler seed"),
    memory_gib: float | None = ranged_option(
        "--memory-gib", None, "per-rank capacity in GiB (CPU trials; overrides preset)"
    ),
    trial_timeout: float | None = ranged_option(
        "--trial-timeout", None, "seconds before a real trial is killed as hung (default: from its predicted step time)"
    ),
    prefilter: bool = typer.Option(True, help="local backend: skip real trials the oracle predicts to OOM"),
    depth: str = typer.Option(
        "reduced",
        help="local backend: reduced (a model deeper than 4 layers runs its 3/4-layer "
        "copies, extended exactly to full depth) | full",
    ),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help=RDZV_HELP),
    documents: str = typer.Option("one", help=DOCUMENTS_HELP),
    lora_rank: int | None = ranged_option("--lora-rank", None, lora_options.RANK_HELP),
    lora_alpha: float | None = ranged_option("--lora-alpha", None, lora_options.ALPHA_HELP),
    lora_targets: str | None = typer.Option(None, "--lora-targets", help=lora_options.TARGETS_HELP),
    lora_trainable: str | None = typer.Option(None, "--lora-trainable", help=lora_options.TRAINABLE_HELP),
    polish: bool = typer.Option(
        True,
        envvar="AUTOTUNE_POLISH",
        help="plan backend: before writing the outputs, evaluate the configs one knob from each front config and "
        "the best; a faster one that fits replaces it (--no-polish: the front as the trials left it)",
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (the summary)"),
):
    """Search the technique space for the Pareto front of sequence length vs tokens/s."""
    from autotune import search as search_mod
    from autotune.core.sizes import format_tokens, parse_tokens
    from autotune.outputs import report
    from autotune.outputs.progress import SearchProgress
    from autotune.search.request import SearchRequest, prepare_search

    request = SearchRequest(
        model=model,
        target=parse_tokens(target, "--target"),
        gpus=gpus,
        nodes=nodes,
        hardware=hardware,
        backend=backend,
        space=space,
        trials=trials,
        timeout_s=timeout,
        out=out,
        storage=storage,
        study=study,
        seed=seed,
        memory_gib=memory_gib,
        trial_timeout_s=trial_timeout,
        prefilter=prefilter,
        depth=depth,
        rdzv_endpoint=rdzv_endpoint,
        trainer=trainer,
        documents=documents,
        lora=lora_options.parse_lora(lora_rank, lora_alpha, lora_targets, lora_trainable),
    )
    prepared = prepare_search(request)
    if prepared.follower is not None:
        follow(prepared.follower, "search")
        return
    job, group, hw = prepared.job, prepared.group, prepared.hardware
    for warning in prepared.warnings:
        console.print(f"[bold red]warning:[/] {warning}")
    note_rates(hw)  # after every input check (storage, space, study): bad input stays one line
    console.print(
        f"autotune: {model} on {f'{nodes} nodes x ' if nodes > 1 else ''}{gpus}x {hw.name}, target "
        f"{format_tokens(job.target)}, backend {prepared.backend_name}"
        + (f", for {job.trainer.words}" if job.trainer.name != "autotune" else "")
        + job.lora.aside
        + f", out {job.out}"
    )
    note = job.trainer.prediction_note(job.space.frugal(job.model_config["num_hidden_layers"]), job.model_config)
    if note:
        say(f"autotune: {note}")
    interrupted = False
    with interrupts_deferred() as deferral:  # once the search stops, its outputs are written whatever comes
        with SearchProgress(job, console=console, enabled=not as_json) as progress:
            try:
                with deferral.lifted():
                    search_mod.run(job, on_record=progress.on_record, study=prepared.study)
                    # best.json is the fastest config at the target: each config that reaches it, evaluated there
                    search_mod.evaluate_at_target(job, prepared.study, progress=None if as_json else say)
                    if polish:  # no front point nor the best left slower than a config one knob away
                        search_mod.polish(
                            job, prepared.study, None if as_json else say, on_record=progress.on_polish_record
                        )
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (main): the trial it cut short is queued again
                interrupted = True
            finally:
                if group is not None:
                    group.finish()
        summary = report.write_outputs(job, prepared.study)
        summary["avoided"] = dict(job.avoided)
        if as_json:
            OUT.print(json.dumps({k: summary[k] for k in ("rows", "best", "message", "avoided")}))
        else:
            print_front(summary["front"], job.target, job.hardware, summary["best"], job.lora)
            if summary["best"]:
                best = summary["best"]
                record = best["measured"] or best["predicted"]
                OUT.rich(
                    best_line(
                        job.target,
                        summary["best_trial"],
                        best["seq_len"],
                        record["tokens_per_s"],
                        job.out / "best.json",
                        record.get("step_time_s"),
                    )
                )
                if summary["best_choice"]:
                    say(f"autotune: {summary['best_choice']}")
        if summary["kept"] is not None:
            say(f"autotune: the best for the folder's previous target is kept as {summary['kept']}")
        if summary["front_timeline"]:
            say(f"autotune: {summary['front_timeline']}")
    if interrupted or deferral.arrived:
        console.print("interrupted: finished trials are saved; run the same command to resume")
        raise typer.Exit(130)
    if summary["message"]:  # no config reached the target: no best.json
        console.print(summary["message"], markup=False, highlight=False, soft_wrap=True)  # its last line is the cause
        raise typer.Exit(1)
