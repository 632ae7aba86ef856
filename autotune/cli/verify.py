"""``autotune verify``: re-measure a search's front with real trials (``autotune.outputs.verify``) and print
predicted against measured."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from autotune.cli.common import OUT, RDZV_HELP, app, console, fail, follow, say
from autotune.cli.interrupts import interrupts_deferred
from autotune.cli.options import ranged_option
from autotune.core.documents import DOCUMENTS_HELP


@app.command()
def verify(
    directory: Path = typer.Argument(..., help="a search output folder (typically of a plan search)"),
    top: int | None = ranged_option(
        "--top",
        None,
        "verify the K front configs with the highest predicted "
        "tokens/s (default: the whole front); the best config is always "
        "verified",
    ),
    depth: str = typer.Option("full", help="full | reduced (the model's shallower copies, extended to its depth)"),
    force: bool = typer.Option(False, help="measure again configs already measured at this depth"),
    memory_gib: float | None = ranged_option(
        "--memory-gib", None, "per-rank capacity in GiB (default: on CPU the search's, on a GPU the card's)"
    ),
    trial_timeout: float | None = ranged_option(
        "--trial-timeout", None, "seconds before a real trial is killed as hung (default: from its predicted step time)"
    ),
    storage: str | None = typer.Option(None, help="the search's --storage, when its study is not DIR/study.db"),
    study: str | None = typer.Option(None, help="the search's --study name"),
    nodes: int | None = ranged_option(
        "--nodes",
        None,
        "the nodes the search planned for (default: the search's; with --rdzv-endpoint say it on every node)",
    ),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help=RDZV_HELP + "; only the driver needs DIR"),
    documents: str | None = typer.Option(
        None, help=DOCUMENTS_HELP + " (default: the search's; others are predicted and measured, not stored)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
):
    """Re-measure a search's front with real trials on this node (or its nodes); outputs gain the measured
    records."""
    from autotune.backends import make_backend
    from autotune.backends.setup import check_depth, open_node_group

    check_depth(depth)
    group = open_node_group(nodes or 1, rdzv_endpoint) if rdzv_endpoint is not None else None
    if group is not None and not group.driver:
        follow(make_backend("local", group=group), "verify")
        return
    try:
        _verify(
            directory, top, depth, force, memory_gib, trial_timeout, storage, study, nodes, group, documents, as_json
        )
    finally:
        if group is not None:
            group.finish()


def _verify(
    directory, top, depth, force, memory_gib, trial_timeout, storage, study, nodes, group, documents, as_json
) -> None:
    from autotune.backends import make_backend
    from autotune.backends.plan_store import default_store
    from autotune.core.documents import describe_documents, parse_documents
    from autotune.outputs import verify as verify_mod

    spec = parse_documents(documents) if documents is not None else None
    if not directory.exists():
        fail(f"{str(directory)!r} does not exist: give the --out folder of a search")
    folder = verify_mod.open_folder(directory, storage, study)
    if spec == folder.job.documents:
        spec = None  # the search's own: verified as without --documents
    if nodes is not None and nodes != folder.job.nodes:
        fail(f"--nodes {nodes}, but the search in {str(directory)!r} planned for {folder.job.nodes} node(s)")
    if folder.job.nodes > 1 and group is None:
        fail(
            f"the search planned for {folder.job.nodes} nodes: run verify on every node with --nodes "
            f"{folder.job.nodes} --rdzv-endpoint HOST:PORT"
        )
    plan = make_backend("plan", store=default_store())
    chosen = verify_mod.select(folder, top, predictor=plan)  # predicts at the target what never was evaluated there
    verify_mod.check_node(folder, chosen)
    gib = verify_mod.node_memory_gib(folder, memory_gib)
    hw = verify_mod.local_hardware(folder.job.hardware, gib)
    backend = make_backend(
        "local",
        depth=depth,
        memory_gib=gib,
        timeout_s=trial_timeout,
        predictor=plan,
        group=group,
    )
    where = f"{folder.job.nodes} nodes x " if folder.job.nodes > 1 else ""
    console.print(
        f"autotune verify: {len(chosen)} front config(s) of {folder.job.model} on {where}{folder.job.gpus}x "
        f"{hw.name} ({hw.device_memory_bytes / 2**30:.2f} GiB per rank), depth {depth}",
        highlight=False,
        soft_wrap=True,
    )

    def on_outcome(outcome, index, total):
        say(verify_mod.progress_line(outcome, index, total))

    if spec is not None:
        say(
            f"--documents {describe_documents(spec)} overrides the search's {describe_documents(folder.job.documents)}: "
            f"each config is predicted and measured for {spec.describe()}; {str(directory)!r} keeps the search's records"
        )
    with interrupts_deferred() as deferral:  # once measuring stops, the outputs are written whatever comes
        if spec is None:
            result = verify_mod.verify(
                folder, chosen, backend, hw, depth, force, on_outcome=on_outcome, interruptible=deferral.lifted
            )
        else:
            result = verify_mod.verify_for_documents(
                folder, chosen, spec, backend, plan, hw, depth, on_outcome=on_outcome, interruptible=deferral.lifted
            )
    result.interrupted = result.interrupted or deferral.arrived
    if as_json:
        OUT.print(json.dumps(verify_mod.to_json(folder, result, depth, hw, spec)))
    else:
        _print_table(result, directory)
    for outcome in result.failed:
        say(f"trial {outcome.trial} failed ({outcome.measured['status']}): {outcome.measured.get('error')}")
    for line in result.notes + ([result.summary["message"]] if result.summary["message"] else []):
        say(line)
    if result.interrupted:
        console.print("interrupted: finished trials are saved; run the same command to go on")
        raise typer.Exit(130)
    if result.failed:
        raise typer.Exit(1)


def _print_table(result, directory: Path) -> None:
    from autotune.outputs import verify as verify_mod

    table = Table(title="predicted / measured")
    for column in verify_mod.TABLE_COLUMNS:
        table.add_column(column)
    for row in verify_mod.table_rows(result):
        table.add_row(*row)
    wide = Console(file=OUT.file)
    (wide if wide.is_terminal else Console(file=OUT.file, width=160)).print(table)  # no wrapping in logs
    best = result.summary["best"]
    if best:
        side = "measured" if best["measured"] else "predicted"
        OUT.print(
            f"best.json ({side}): {best['seq_len']:,} tokens at "
            f"{best[side]['tokens_per_s']:,.0f} tokens/s -> {directory / 'best.json'}"
        )
