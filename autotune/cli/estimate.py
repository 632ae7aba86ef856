"""``autotune estimate``: a prediction by the plan backend for one config, resolved by ``autotune.core.overrides``
(the config file's values, the options over them). ``autotune trial`` (``autotune.cli.trial``) measures one the
same way."""

from __future__ import annotations

from pathlib import Path

import typer

from autotune.cli.common import (
    NODES_HELP,
    TARGET_HELP,
    app,
    fail,
    fail_outcome,
    note_rates,
    print_record,
    say,
    validate_run,
)
from autotune.cli.options import ranged_option
from autotune.core import lora as lora_options
from autotune.core.documents import DOCUMENTS_HELP
from trials.kernels.registry import KERNEL_NAMES

CONFIG_HELP = (
    "config file (config-v1 JSON: its model, gpus, nodes, hardware and seq_len default the options) or 'baseline'"
)
MODEL_HELP = "preset name or path to a Hugging Face config.json (default: the config file's model)"
OTHER_MODEL_HELP = "run the config file's techniques on a --model of another architecture than the file's model"
SEQ_HELP = f"{TARGET_HELP} (default: the config file's seq_len)"
TIMELINE_HELP = (
    "write one rank's step as PyTorch's memory_viz active memory timeline (HTML): every allocation and free, each "
    "with its op, module, technique and category"
)
SNAPSHOT_HELP = "write that step's memory snapshot (pickle: pytorch.org/memory_viz opens it)"
RANK_HELP = "the rank the timeline shows (default 0, the rank the oracle predicts: the most loaded)"
ATTENTION_HELP = f"the attention kernel, over the config file's (baseline: sdpa): {' | '.join(KERNEL_NAMES)}"


def _say_routing(model_config: dict) -> None:
    """What the prediction of a mixture-of-experts model assumes of its routing (a router's depends on the data)."""
    from trials.models.config import experts

    moe = experts(model_config)
    if moe:
        count, top_k = moe
        say(
            f"autotune: MoE layers ({count} experts, top-{top_k}) run as grouped GEMMs over all tokens x {top_k} "
            "slots: memory and FLOPs do not depend on the routing; its balance moves time between experts, which "
            "the prediction does not see (a trial records it in moe_routing)"
        )


def _say_overrides(notices: list[str]) -> None:
    """The options that overrode the config file, one line each, after the input checks (bad input: one line)."""
    for notice in notices:
        say(f"autotune: {notice}")


@app.command()
def estimate(
    model: str | None = typer.Option(None, help=MODEL_HELP),
    seq: str | None = typer.Option(None, help=SEQ_HELP),
    config: str = typer.Option(..., help=CONFIG_HELP),
    gpus: int | None = ranged_option("--gpus", None, "devices per node (default: the config file's; 8 with baseline)"),
    nodes: int | None = ranged_option("--nodes", None, NODES_HELP + " (default: the config file's)"),
    hardware: str | None = typer.Option(
        None, help="hardware preset (default: the config file's; h100-sxm with baseline)"
    ),
    other_model: bool = typer.Option(False, "--other-model", help=OTHER_MODEL_HELP),
    attention: str | None = typer.Option(None, help=ATTENTION_HELP),
    documents: str | None = typer.Option(None, help=DOCUMENTS_HELP + " (default: the config file's, else one)"),
    lora_rank: int | None = ranged_option("--lora-rank", None, lora_options.RANK_HELP),
    lora_alpha: float | None = ranged_option("--lora-alpha", None, lora_options.ALPHA_HELP),
    lora_targets: str | None = typer.Option(None, "--lora-targets", help=lora_options.TARGETS_HELP),
    lora_trainable: str | None = typer.Option(None, "--lora-trainable", help=lora_options.TRAINABLE_HELP),
    max_seq: bool = typer.Option(False, "--max-seq", help="bisect for the longest sequence that fits"),
    probes_only: bool = typer.Option(
        False, "--probes-only", hidden=True, help="--max-seq by grid probes alone, without the length model"
    ),
    plot: Path | None = typer.Option(
        None, help="write the peak memory per rank by category as a PNG, the step time and tokens/s in its title"
    ),
    memory_gib: float | None = ranged_option("--memory-gib", None, "per-rank capacity in GiB (overrides preset)"),
    memory_timeline: Path | None = typer.Option(None, "--memory-timeline", help=TIMELINE_HELP),
    memory_snapshot: Path | None = typer.Option(None, "--memory-snapshot", help=SNAPSHOT_HELP),
    rank: int = ranged_option("--rank", 0, RANK_HELP),
    as_json: bool = typer.Option(False, "--json"),
):
    """Predict peak memory per rank and step time for one config (plan backend, no GPU needed). Exit 1 when the
    prediction itself failed (status error); an OOM prediction is an answer (exit 0)."""
    from autotune.backends import make_backend
    from autotune.backends.plan_store import default_store
    from autotune.backends.setup import check_node_size
    from autotune.core.hardware import load_hardware
    from autotune.core.overrides import Defaults, resolve_config

    run = resolve_config(
        config,
        Defaults(gpus=8),  # --config baseline: a node of 8 h100-sxm
        model=model,
        seq=seq,
        gpus=gpus,
        nodes=nodes,
        hardware=hardware,
        other_model=other_model,
        attention=attention,
        documents=documents,
        lora=lora_options.parse_lora(lora_rank, lora_alpha, lora_targets, lora_trainable),
    )
    hw = load_hardware(run.hardware).with_memory_gib(memory_gib).for_nodes(run.nodes)
    check_node_size(hw, run.gpus, run.nodes)
    if run.seq_len is None and not max_seq:
        fail("--seq is required (or --max-seq, or a config file with seq_len)")
    validate_run(run, hw, run.seq_len if not max_seq else None)
    if unlisted := hw.kernel_problem(run.techniques.attention):
        fail(unlisted)
    _check_timeline_options(memory_timeline, memory_snapshot, rank, run.gpus * run.nodes)
    _say_overrides(run.notices)
    note_rates(hw)
    _say_routing(run.model_config)
    from autotune.core.trainers import TRAINERS

    if run.trainer in TRAINERS:  # what that trainer holds beside the traced tensors counts against capacity
        hw = hw.holding(TRAINERS[run.trainer].held_bytes(run.techniques, run.model_config))
    evaluation = run.evaluation(hw)
    timeline = None
    wants_timeline = memory_timeline is not None or memory_snapshot is not None
    if max_seq:  # what the config's trainer runs at each length tried (autotune's: the config itself)
        from autotune.search.max_seq import search_trainer_max_seq

        record, how = search_trainer_max_seq(
            evaluation, TRAINERS.get(run.trainer or "autotune", TRAINERS["autotune"]), length_model=not probes_only
        )
        say(f"autotune: --max-seq {how.summary()}")
    elif wants_timeline:  # recorded in the prediction's own trace where it traces
        from autotune.outputs.timeline import estimate_with_timeline

        record, timeline = estimate_with_timeline(
            make_backend("plan", store=default_store()), evaluation, rank, run.model
        )
    else:
        record = make_backend("plan", store=default_store()).evaluate(evaluation)
    if plot is not None:
        from autotune.outputs.plots import plot_memory, plot_title

        title = plot_title(record, run.model, run.gpus, hw.name, run.nodes)
        plot_memory([record], hw.device_memory_bytes, plot, title=title, host_capacity=hw.host_memory_bytes_per_device)
    if wants_timeline and record.status in ("ok", "oom"):
        from dataclasses import replace

        from autotune.oracle.timeline import predicted_timeline
        from autotune.outputs.timeline import write_predicted

        if timeline is None:  # --max-seq: the timeline of the longest length that fits
            timeline = predicted_timeline(replace(evaluation, seq_len=record.seq_len), rank, run.model)
        write_predicted(timeline, memory_timeline, memory_snapshot)
        wrote = ", ".join(str(p) for p in (memory_timeline, memory_snapshot) if p is not None)
        say(f"autotune: wrote {wrote}: {timeline.title}")
    where = f"{run.nodes} nodes x " if run.nodes > 1 else ""
    shown = record.to_dict()
    if max_seq and as_json:  # how the length was found (the length model, or the probes and why)
        shown["max_seq_search"] = how.to_dict()
    title = f"{run.model} on {where}{run.gpus}x {hw.name} (predicted, {run.documents.describe()}{run.lora.aside})"
    print_record(shown, as_json, title, hw)
    _say_trainer(run)
    if record.status == "error":
        fail_outcome(f"the prediction failed: {record.error}")


def _check_timeline_options(html: Path | None, snapshot: Path | None, rank: int, world_size: int) -> None:
    """The timeline's files can be written and its rank is in the world: bad input exits 2 before any work."""
    from autotune.outputs.timeline import check_output_file, check_rank

    check_output_file(html, "--memory-timeline")
    check_output_file(snapshot, "--memory-snapshot")
    check_rank(rank, world_size)


def _say_trainer(run) -> None:
    """For a config searched for another trainer: what the prediction does not describe when that trainer runs it."""
    from autotune.core.trainers import TRAINERS

    trainer = TRAINERS.get(run.trainer or "autotune")
    if trainer is None:
        say(f"autotune: the config names trainer {run.trainer!r}, which this autotune does not know")
        return
    padding = trainer.ring_padding_note(run.documents, run.techniques)
    for note in (trainer.prediction_note(run.techniques, run.model_config), _unmasked_note(trainer, run), padding):
        if note:
            say(f"autotune: for {trainer.words}: {note}")


def _unmasked_note(trainer, run) -> str | None:
    """The trainer's line on packed documents its attention crosses (``Trainer.masks_documents``), or None."""
    masks = run.documents.one or trainer.masks_documents(run.techniques.attention)
    return None if masks else trainer.packing_note(run.documents, run.techniques.attention)
