"""``autotune trial``: one real training trial on this node (or on every node of a group), one config resolved by
``autotune.core.overrides`` as ``autotune estimate`` resolves it, measured and printed beside nothing else."""

from __future__ import annotations

from pathlib import Path

import typer

from autotune.cli.common import RDZV_HELP, app, console, fail, fail_outcome, follow, print_record, say, validate_run
from autotune.cli.estimate import (
    ATTENTION_HELP,
    CONFIG_HELP,
    MODEL_HELP,
    NODES_HELP,
    OTHER_MODEL_HELP,
    SEQ_HELP,
    SNAPSHOT_HELP,
    TIMELINE_HELP,
    _check_timeline_options,
    _say_overrides,
)
from autotune.cli.options import ranged_option
from autotune.core import lora as lora_options
from autotune.core.documents import DOCUMENTS_HELP


@app.command()
def trial(
    model: str | None = typer.Option(None, help=MODEL_HELP),
    seq: str | None = typer.Option(None, help=SEQ_HELP),
    config: str = typer.Option(..., help=CONFIG_HELP),
    gpus: int | None = ranged_option("--gpus", None, "ranks per node (default: the config file's; 1 with baseline)"),
    nodes: int | None = ranged_option("--nodes", None, NODES_HELP + " (default: the config file's)"),
    other_model: bool = typer.Option(False, "--other-model", help=OTHER_MODEL_HELP),
    attention: str | None = typer.Option(None, help=ATTENTION_HELP),
    documents: str | None = typer.Option(None, help=DOCUMENTS_HELP + " (default: the config file's, else one)"),
    lora_rank: int | None = ranged_option("--lora-rank", None, lora_options.RANK_HELP),
    lora_alpha: float | None = ranged_option("--lora-alpha", None, lora_options.ALPHA_HELP),
    lora_targets: str | None = typer.Option(None, "--lora-targets", help=lora_options.TARGETS_HELP),
    lora_trainable: str | None = typer.Option(None, "--lora-trainable", help=lora_options.TRAINABLE_HELP),
    steps: int = ranged_option("--steps", 2, "measured steps after one warm-up"),
    depth: str = typer.Option("full", help="full | reduced (run the 3/4-layer copies, extend to full depth)"),
    memory_gib: float | None = ranged_option("--memory-gib", None, "per-rank capacity on CPU (GiB)"),
    timeout: float | None = ranged_option(
        "--timeout", None, "seconds before the trial is killed as hung (default: from its predicted step time)"
    ),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help=RDZV_HELP),
    memory_timeline: Path | None = typer.Option(
        None, "--memory-timeline", help=TIMELINE_HELP + "; measured, beside the prediction for the same config"
    ),
    memory_snapshot: Path | None = typer.Option(
        None, "--memory-snapshot", help=SNAPSHOT_HELP + "; the prediction's beside it as NAME-predicted.pickle"
    ),
    rank: int = ranged_option("--rank", 0, "the rank whose memory timeline is recorded (default 0)"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Run one real training trial on this node (or, with --nodes, on every node) and print its measured record
    (exit 1 when its status is not ok: oom, error or timeout, the cause on the last line of stderr). The
    hardware is this node's: the config file's preset with this card's memory, the cpu preset without CUDA."""
    from autotune.backends import make_backend
    from autotune.backends.plan_store import default_store
    from autotune.backends.setup import check_depth, check_local_node, open_node_group, trial_hardware
    from autotune.core.overrides import Defaults, resolve_config
    from autotune.core.record import ResultRecord

    run = resolve_config(
        config,
        Defaults(gpus=1),  # --config baseline: one rank
        model=model,
        seq=seq,
        gpus=gpus,
        nodes=nodes,
        other_model=other_model,
        attention=attention,
        documents=documents,
        lora=lora_options.parse_lora(lora_rank, lora_alpha, lora_targets, lora_trainable),
    )
    if run.seq_len is None:
        fail(f"--seq is required: {'--config baseline' if config == 'baseline' else 'the config file'} has no seq_len")
    hw = trial_hardware("local", run.hardware, memory_gib).for_nodes(run.nodes)
    validate_run(run, hw, run.seq_len)
    check_local_node(run.gpus, run.techniques.attention)
    check_depth(depth)
    _check_timeline_options(memory_timeline, memory_snapshot, rank, run.gpus * run.nodes)
    timeline_rank = rank if memory_timeline or memory_snapshot else None
    group = open_node_group(run.nodes, rdzv_endpoint)
    _say_overrides(run.notices)
    backend = make_backend(
        "local",
        steps=steps,
        memory_gib=memory_gib,
        timeout_s=timeout,
        predictor=make_backend("plan", store=default_store()),
        depth=depth,
        progress=_show_progress,
        group=group,
        timeline_rank=timeline_rank,
    )
    if group is not None and not group.driver:
        final = follow(backend, "trial")
        if final is None:
            fail_outcome(f"the driver at {group.endpoint} stopped without a record")
        record = ResultRecord.from_dict(final)
    else:
        record = None
        try:
            record = backend.evaluate(run.evaluation(hw))
        finally:
            if group is not None:
                group.finish(record.to_dict() if record is not None else None)
    where = f"{run.nodes} nodes x {run.gpus}" if run.nodes > 1 else f"x{run.gpus}"
    print_record(record.to_dict(), as_json, f"{run.model} {where} (measured)", hw)
    if timeline_rank is not None and (group is None or group.driver):
        _write_trial_timeline(backend.last_timeline, run, hw, rank, depth, memory_timeline, memory_snapshot)
    if record.status != "ok":
        fail_outcome(f"the trial ended {record.status}: {record.error or 'no cause recorded'}")


def _write_trial_timeline(measured, run, hw, rank: int, depth: str, html, snapshot) -> None:
    """The trial's measured timeline beside the predicted one, or one line saying why there is none."""
    from autotune.outputs.timeline import write_trial

    if measured is None:
        say(f"autotune: rank {rank} recorded no memory timeline (it runs on another node, or failed before its step)")
        return
    evaluation = run.evaluation(hw)
    title, written = write_trial(measured, evaluation, rank, depth == "reduced", html, snapshot, run.model)
    say(f"autotune: wrote {', '.join(str(p) for p in written)}: {title}, beside the prediction")


def _show_progress(line: str, elapsed_s: float, deadline_s: float) -> None:
    """A long real trial's latest progress line, elapsed vs its deadline (stderr)."""
    console.print(f"  trial: {line} ({elapsed_s:,.0f} s of at most {deadline_s:,.0f} s)", highlight=False)
