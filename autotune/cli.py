"""The ``autotune`` command line (typer). Bad input exits 2 with one line on stderr, never a traceback.

The top layer: it may import every other one. Heavy modules (torch, the oracle, the search) are imported inside
the commands that need them, so ``autotune --help`` and ``autotune models`` start fast."""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table
from typer._click import exceptions as click_exceptions  # typer vendors click; its errors live here

from autotune.cli_interrupts import interrupts_at_safe_points, interrupts_deferred
from autotune.cli_options import ranged_option
from autotune.core.errors import UserError
from trials.errors import ConfigError


class _CommandInterrupted(Exception):
    """A KeyboardInterrupt a command did not handle, carried past Typer (which would exit 130 without a word)."""


class _Commands(typer.core.TyperGroup):
    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt as exc:
            raise _CommandInterrupted from exc


app = typer.Typer(
    cls=_Commands,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Find the memory/throughput configuration for multi-million-token training.",
)
console = Console(stderr=True)


class _Output:
    """Where our own output goes. Libraries print to stdout (DeepSpeed's logger, its JIT build messages), but
    ``--json`` promises stdout holds exactly one JSON object, so while a command runs fd 1 and sys.stdout point
    at stderr and our output is written to the saved stdout (see ``_library_noise_to_stderr``)."""

    file = sys.stdout

    def print(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def rich(self, renderable) -> None:
        Console(file=self.file).print(renderable)


OUT = _Output()

TARGET_HELP = "tokens: an integer or K/M suffix (K=1024, M=1024^2; 5M = 5,242,880)"


def fail(message: str) -> None:
    raise UserError(message)


def _out_dir(out: Path) -> Path:
    if out.exists() and not out.is_dir():
        fail(f"--out {str(out)!r} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"--out {str(out)!r} cannot be created: {exc.strerror}")
    if not os.access(out, os.W_OK):
        fail(f"--out {str(out)!r} is not writable")
    return out


def _hardware_for(backend_name: str, hardware: str, memory_gib: float | None):
    """Local trials on a CPU-only machine run on the ``cpu`` preset with ``--memory-gib`` per rank; on a GPU node
    the preset's capacity is the card's own (an H100 80GB has 79.65 GiB, not the 80 its name says)."""
    import dataclasses

    import torch

    from autotune.core.hardware import HOST_PRESET, load_hardware

    preset = load_hardware(hardware)
    if backend_name == "local" and not torch.cuda.is_available():
        preset = load_hardware(HOST_PRESET)
    elif backend_name == "local":
        card = torch.cuda.get_device_properties(0).total_memory
        preset = dataclasses.replace(preset, device_memory_bytes=card)
    return preset.with_memory_gib(memory_gib)


def _depth(depth: str) -> str:
    from autotune.backends.local import DEPTHS

    if depth not in DEPTHS:
        fail(f"--depth must be one of {', '.join(DEPTHS)}, got {depth!r}")
    return depth


def _show_progress(line: str, elapsed_s: float, deadline_s: float) -> None:
    """A long real trial's latest progress line, elapsed vs its deadline (stderr)."""
    console.print(f"  trial: {line} ({elapsed_s:,.0f} s of at most {deadline_s:,.0f} s)", highlight=False)


def _local_checks(gpus: int, techniques_wanting_flash: bool) -> None:
    """What a real trial on this node needs before it starts: enough visible devices, a usable flash-attn."""
    from autotune.backends.local import visible_devices

    visible = visible_devices()
    if visible and gpus > visible:
        fail(f"--gpus {gpus} but this node shows {visible} CUDA device(s) (CUDA_VISIBLE_DEVICES limits them)")
    if techniques_wanting_flash:
        from trials.attention import flash_problem

        problem = flash_problem() or (None if visible else "this node has no CUDA device")
        if problem:
            fail(f"attention 'flash' cannot run here: {problem}")


RDZV_HELP = (
    "HOST:PORT for real trials over --nodes nodes: run the same command on every node; the agent on HOST "
    "drives, the others follow (torchrun's c10d rendezvous)"
)
NODES_HELP = "nodes of --gpus devices each (the world is nodes x gpus)"


def _node_group(nodes: int, rdzv_endpoint: str | None, backend_name: str = "local"):
    """The agents of a command running real trials over several nodes (``autotune.backends.nodes``), or None."""
    if rdzv_endpoint is not None and (nodes < 2 or backend_name != "local"):
        fail("--rdzv-endpoint is for real trials over several nodes: give it with --nodes 2 or more (local backend)")
    if backend_name != "local" or nodes < 2:
        return None
    if rdzv_endpoint is None:
        fail(f"--nodes {nodes} runs real trials on every node: give --rdzv-endpoint HOST:PORT, the same on every node")
    from autotune.backends.nodes import NodeGroup

    return NodeGroup.open(rdzv_endpoint, nodes)


def _follow(backend, what: str):
    """A follower's part of a multi-node command: run what the driver publishes; returns what came with its stop."""
    group = backend.group
    console.print(
        f"autotune: node {group.node} of {group.nodes}: following the {what} driven at {group.endpoint}",
        markup=False,
        highlight=False,
    )
    try:
        return backend.follow()
    except RuntimeError as exc:  # the driver's store went away before it said stop
        _fail_outcome(f"the driver at {group.endpoint} went away before the end: {str(exc).splitlines()[0]}")


def _check_node_size(hw, gpus: int, nodes: int) -> None:
    """``--gpus`` counts one node's devices: more than a node of this preset has is several nodes."""
    if hw.gpus_per_node and gpus > hw.gpus_per_node:
        per, world = hw.gpus_per_node, gpus * nodes
        hint = f" (for {world} GPUs: --nodes {world // per} --gpus {per})" if world % per == 0 else ""
        fail(f"--gpus {gpus}: a {hw.name} node has {per} GPUs, and --gpus counts one node's{hint}")


def _print_record(record: dict, as_json: bool, title: str) -> None:
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


@app.command()
def search(
    model: str = typer.Option(..., help="preset name or path to a Hugging Face config.json"),
    target: str = typer.Option(..., help=TARGET_HELP),
    gpus: int = ranged_option("--gpus", 8, "devices on the node"),
    nodes: int = ranged_option("--nodes", 1, NODES_HELP),
    hardware: str = typer.Option("h100-sxm", help="hardware preset (autotune hardware)"),
    backend: str = typer.Option("auto", help="auto | plan | local"),
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
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (the summary)"),
):
    """Search the technique space for the Pareto front of sequence length vs tokens/s."""
    from autotune import search as search_mod
    from autotune.backends import make_backend, resolve_backend
    from autotune.core.sizes import format_tokens, parse_tokens
    from autotune.outputs import report
    from autotune.outputs.progress import SearchProgress
    from autotune.search.space import load_space
    from trials.model_config import load_model_config

    target_tokens = parse_tokens(target, "--target")
    model_config = load_model_config(model)
    backend_name = resolve_backend(backend, gpus)
    if backend == "auto" and nodes > 1 and rdzv_endpoint is None:
        backend_name = "plan"  # real trials over several nodes need the rendezvous
    if backend_name not in ("plan", "local"):
        fail(f"unknown backend {backend!r}: choose auto, plan or local")
    group = _node_group(nodes, rdzv_endpoint, backend_name)
    hw = _hardware_for(backend_name, hardware, memory_gib).for_nodes(nodes)
    if backend_name == "plan":
        _check_node_size(hw, gpus, nodes)
    if group is not None and not group.driver:
        _local_checks(gpus, False)
        _follow(make_backend("local", memory_gib=memory_gib, group=group), "search")
        return
    out = _out_dir(out)
    opened_storage = search_mod.open_storage(storage, out)
    flash_ok = backend_name == "plan" and not hw.device_is_host or _flash_installed()
    if backend_name == "local":
        _local_checks(gpus, False)
        _warn_if_flash_is_broken()
    search_space = load_space(space, model_config, gpus * nodes, target_tokens, flash_ok=flash_ok)
    if backend_name == "local":
        oracle = make_backend("plan", stop_above=1 + hw.oracle_margin) if prefilter else None
        # the trial deadlines follow the predicted step time: the prefilter's cached records, else a plan backend
        chosen = make_backend(
            "local",
            memory_gib=memory_gib,
            timeout_s=trial_timeout,
            seed=seed,
            predictor=oracle or make_backend("plan"),
            depth=_depth(depth),
            group=group,
        )
    else:  # the search needs to know only that an OOM does not fit: its trace may stop at the crossing
        chosen, oracle = make_backend("plan", stop_above=1.0), None
    job = search_mod.SearchJob(
        model=model,
        model_config=model_config,
        target=target_tokens,
        gpus=gpus,
        hardware=hw,
        space=search_space,
        backend=chosen,
        out=out,
        trials=trials,
        timeout_s=timeout,
        storage=storage,
        study_name=study,
        seed=seed,
        prefilter=oracle,
        nodes=nodes,
    )
    result_study = search_mod.open_study(job, opened_storage)
    _note_rates(hw)  # after every input check (storage, space, study): bad input stays one line
    console.print(
        f"autotune: {model} on {f'{nodes} nodes x ' if nodes > 1 else ''}{gpus}x {hw.name}, target "
        f"{format_tokens(target_tokens)}, backend {backend_name}, out {out}"
    )
    interrupted = False
    with interrupts_deferred() as deferral:  # once the search stops, its outputs are written whatever comes
        with SearchProgress(job, console=console, enabled=not as_json) as progress:
            try:
                with deferral.lifted():
                    search_mod.run(job, on_record=progress.on_record, study=result_study)
            except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (main): the trial it cut short is queued again
                interrupted = True
            finally:
                if group is not None:
                    group.finish()
        summary = report.write_outputs(job, result_study)
        summary["avoided"] = dict(job.avoided)
        if as_json:
            OUT.print(json.dumps({k: summary[k] for k in ("rows", "best", "message", "avoided")}))
        else:
            _print_front(summary["front"], target_tokens)
            if summary["best"]:
                best = summary["best"]
                OUT.rich(
                    f"best for {format_tokens(target_tokens)}: {format_tokens(best['seq_len'])} at "
                    f"{(best['predicted'] or best['measured'])['tokens_per_s']:,.0f} tokens/s -> "
                    f"{out / 'best.json'}"
                )
    if interrupted or deferral.arrived:
        console.print("interrupted: finished trials are saved; run the same command to resume")
        raise typer.Exit(130)
    if summary["message"]:  # no config reached the target: no best.json
        console.print(summary["message"], markup=False, highlight=False, soft_wrap=True)  # one line, the last
        raise typer.Exit(1)


def _flash_installed() -> bool:
    import torch

    from trials.attention import flash_available

    return torch.cuda.is_available() and flash_available(torch.device("cuda"))


def _warn_if_flash_is_broken() -> None:
    """flash-attn installed but not importable (an ABI mismatch with torch, a missing CUDA library) would make
    ``flash`` vanish from a search on a GPU node: say so, loudly, with the import error."""
    from trials.attention import FLASH_INSTALLED, flash_problem

    problem = flash_problem()
    if FLASH_INSTALLED and problem:
        console.print(
            f"[bold red]warning:[/] {problem}; attention 'flash' is left out of this search "
            f"(reinstall it with bin/setup-gpu)"
        )


def _print_front(front: list[dict], target: int) -> None:
    from autotune.outputs.plots import knob_label

    table = Table(title="Pareto front (sequence length vs tokens/s)")
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


@app.command()
def estimate(
    model: str = typer.Option(...),
    seq: str | None = typer.Option(None, help=TARGET_HELP),
    config: str = typer.Option(..., help="config file (config-v1 JSON) or 'baseline'"),
    gpus: int | None = ranged_option("--gpus", None, "devices per node (default: the config file's)"),
    nodes: int | None = ranged_option("--nodes", None, NODES_HELP + " (default: the config file's)"),
    hardware: str | None = typer.Option(None),
    max_seq: bool = typer.Option(False, "--max-seq", help="bisect for the longest sequence that fits"),
    plot: Path | None = typer.Option(None, help="write the memory (and time) breakdown as a PNG"),
    memory_gib: float | None = ranged_option("--memory-gib", None, "per-rank capacity in GiB (overrides preset)"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Predict peak memory per rank and step time for one config (plan backend, no GPU needed). Exit 1 when the
    prediction itself failed (status error); an OOM prediction is an answer (exit 0)."""
    from autotune.backends import Evaluation, make_backend
    from autotune.core.hardware import load_hardware
    from autotune.core.sizes import parse_tokens
    from trials.model_config import load_model_config

    model_config = load_model_config(model)
    techniques, file_gpus, file_hw, file_seq = _load_config_arg(config, model_config)
    gpus = gpus if gpus is not None else file_gpus
    if gpus < 1:
        fail(f"config {config!r} has gpus {gpus}: it must be at least 1")
    nodes = nodes if nodes is not None else _config_nodes(config)
    hw = load_hardware(hardware or file_hw).with_memory_gib(memory_gib).for_nodes(nodes)
    _check_node_size(hw, gpus, nodes)
    if seq is None and file_seq is None and not max_seq:
        fail("--seq is required (or --max-seq, or a config file with seq_len)")
    seq_len = parse_tokens(seq, "--seq") if seq is not None else file_seq
    techniques.validate(model_config, gpus * nodes, seq_len if not max_seq else None)
    _note_rates(hw)  # after the input checks: bad input stays one line
    plan = make_backend("plan")
    if max_seq:
        from autotune.search.max_seq import find_max_seq

        record = find_max_seq(Evaluation(model_config, techniques, seq_len or 0, gpus, hw, nodes))
    else:
        record = plan.evaluate(Evaluation(model_config, techniques, seq_len, gpus, hw, nodes))
    if plot is not None:
        from autotune.outputs.plots import plot_memory

        plot_memory([record], hw.device_memory_bytes, plot)
    _print_record(
        record.to_dict(), as_json, f"{model} on {f'{nodes} nodes x ' if nodes > 1 else ''}{gpus}x {hw.name} (predicted)"
    )
    if record.status == "error":
        _fail_outcome(f"the prediction failed: {record.error}")


def _fail_outcome(cause: str) -> None:
    """The command ran but its outcome is a failure: ``cause``'s first line as the last line of stderr, exit 1."""
    lines = cause.strip().splitlines()
    print(f"autotune: {lines[0] if lines else 'failed'}", file=sys.stderr, flush=True)
    raise typer.Exit(1)


def _load_config_arg(config: str, model_config: dict):
    from trials.config_file import load_config_file
    from trials.techniques import BASELINE

    if config == "baseline":
        return BASELINE, 8, "h100-sxm", None
    loaded = load_config_file(config)
    return loaded.techniques, loaded.gpus, loaded.hardware, loaded.seq_len


def _config_nodes(config: str) -> int:
    """The nodes a config file is for (1 for ``baseline`` and files without ``nodes``)."""
    from trials.config_file import load_config_file

    return 1 if config == "baseline" else load_config_file(config).nodes


@app.command()
def trial(
    model: str = typer.Option(...),
    seq: str = typer.Option(..., help=TARGET_HELP),
    config: str = typer.Option(..., help="config file (config-v1 JSON) or 'baseline'"),
    gpus: int = ranged_option("--gpus", 1, "ranks (per node)"),
    nodes: int = ranged_option("--nodes", 1, NODES_HELP),
    steps: int = ranged_option("--steps", 2, "measured steps after one warm-up"),
    depth: str = typer.Option("full", help="full | reduced (run the 3/4-layer copies, extend to full depth)"),
    memory_gib: float | None = ranged_option("--memory-gib", None, "per-rank capacity on CPU (GiB)"),
    timeout: float | None = ranged_option(
        "--timeout", None, "seconds before the trial is killed as hung (default: from its predicted step time)"
    ),
    rdzv_endpoint: str | None = typer.Option(None, "--rdzv-endpoint", help=RDZV_HELP),
    as_json: bool = typer.Option(False, "--json"),
):
    """Run one real training trial on this node (or, with --nodes, on every node) and print its measured record
    (exit 1 when its status is not ok: oom, error or timeout, the cause on the last line of stderr)."""
    from autotune.backends import Evaluation, make_backend
    from autotune.core.record import ResultRecord
    from autotune.core.sizes import parse_tokens
    from trials.model_config import load_model_config

    model_config = load_model_config(model)
    seq_len = parse_tokens(seq, "--seq")
    techniques = _load_config_arg(config, model_config)[0]
    techniques.validate(model_config, gpus * nodes, seq_len)
    _local_checks(gpus, techniques.attention == "flash")
    group = _node_group(nodes, rdzv_endpoint)
    hw = _hardware_for("local", "h100-sxm", memory_gib).for_nodes(nodes)
    backend = make_backend(
        "local",
        steps=steps,
        memory_gib=memory_gib,
        timeout_s=timeout,
        predictor=make_backend("plan"),
        depth=_depth(depth),
        progress=_show_progress,
        group=group,
    )
    where = f"{nodes} nodes x {gpus}" if nodes > 1 else f"x{gpus}"
    if group is not None and not group.driver:
        final = _follow(backend, "trial")
        if final is None:
            _fail_outcome(f"the driver at {group.endpoint} stopped without a record")
        record = ResultRecord.from_dict(final)
    else:
        record = None
        try:
            record = backend.evaluate(Evaluation(model_config, techniques, seq_len, gpus, hw, nodes))
        finally:
            if group is not None:
                group.finish(record.to_dict() if record is not None else None)
    _print_record(record.to_dict(), as_json, f"{model} {where} (measured)")
    if record.status != "ok":
        _fail_outcome(f"the trial ended {record.status}: {record.error or 'no cause recorded'}")


@app.command()
def export(
    directory: Path = typer.Argument(..., help="a search output folder"),
    target: str | None = typer.Option(None, help="export the fastest front config reaching this length"),
    format: str = typer.Option("autotune", help="autotune | deepspeed | arctic | accelerate | torchrun | slurm"),
    output: Path | None = typer.Option(None, "-o", "--output", help="write here instead of stdout"),
    allow_partial: bool = typer.Option(
        False,
        "--allow-partial",
        help="export the fastest config at the target even where the format cannot "
        "express all of it (with what it will not do and the oracle's re-estimate of what it runs)",
    ),
):
    """Export the fastest front config the format's trainer can run in full (ArcticTraining, Accelerate/Trainer,
    DeepSpeed, autotune's own runner); exit 1 when none reaches the target."""
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
            progress=lambda line: console.print(line, markup=False, highlight=False, soft_wrap=True),
        )
    except NotExpressible as exc:
        console.print(f"autotune: {exc}", markup=False, highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    text, companions = result.rendered.text, result.rendered.companions
    if output is None:
        OUT.print(text)
        for suffix, body in companions.items():  # the files the export refers to, under the names it uses
            console.print(
                f"# ---- {Path(exporter.default_file).with_suffix(suffix)} ----\n{body}",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    else:
        for line in result.notes[1:-1]:  # what the trainer runs differently (the export carries them too)
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        for path, body in [(output, text), *((output.with_suffix(s), b) for s, b in companions.items())]:
            try:
                path.write_text(body + "\n")
            except OSError as exc:
                fail(f"-o {str(path)!r} cannot be written: {exc.strerror}")
            console.print(f"wrote {path}")


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
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
):
    """Re-measure a search's front with real trials on this node (or its nodes); outputs gain the measured
    records."""
    from autotune.backends import make_backend

    _depth(depth)
    group = _node_group(nodes or 1, rdzv_endpoint) if rdzv_endpoint is not None else None
    if group is not None and not group.driver:
        _follow(make_backend("local", group=group), "verify")
        return
    try:
        _verify(directory, top, depth, force, memory_gib, trial_timeout, storage, study, nodes, group, as_json)
    finally:
        if group is not None:
            group.finish()


def _verify(directory, top, depth, force, memory_gib, trial_timeout, storage, study, nodes, group, as_json) -> None:
    from autotune.backends import make_backend
    from autotune.outputs import verify as verify_mod

    if not directory.exists():
        fail(f"{str(directory)!r} does not exist: give the --out folder of a search")
    folder = verify_mod.open_folder(directory, storage, study)
    if nodes is not None and nodes != folder.job.nodes:
        fail(f"--nodes {nodes}, but the search in {str(directory)!r} planned for {folder.job.nodes} node(s)")
    if folder.job.nodes > 1 and group is None:
        fail(
            f"the search planned for {folder.job.nodes} nodes: run verify on every node with --nodes "
            f"{folder.job.nodes} --rdzv-endpoint HOST:PORT"
        )
    chosen = verify_mod.select(folder, top)
    verify_mod.check_node(folder, chosen)
    gib = verify_mod.node_memory_gib(folder, memory_gib)
    hw = verify_mod.local_hardware(folder.job.hardware, gib)
    backend = make_backend(
        "local", depth=depth, memory_gib=gib, timeout_s=trial_timeout, predictor=make_backend("plan"), group=group
    )
    where = f"{folder.job.nodes} nodes x " if folder.job.nodes > 1 else ""
    console.print(
        f"autotune verify: {len(chosen)} front config(s) of {folder.job.model} on {where}{folder.job.gpus}x "
        f"{hw.name} ({hw.device_memory_bytes / 2**30:.2f} GiB per rank), depth {depth}",
        highlight=False,
        soft_wrap=True,
    )

    def on_outcome(outcome, index, total):
        console.print(verify_mod.progress_line(outcome, index, total), markup=False, highlight=False, soft_wrap=True)

    with interrupts_deferred() as deferral:  # once measuring stops, the outputs are written whatever comes
        result = verify_mod.verify(
            folder, chosen, backend, hw, depth=depth, force=force, on_outcome=on_outcome, interruptible=deferral.lifted
        )
    result.interrupted = result.interrupted or deferral.arrived
    if as_json:
        OUT.print(json.dumps(verify_mod.to_json(folder, result, depth, hw)))
    else:
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
    for outcome in result.failed:
        console.print(
            f"trial {outcome.trial} failed ({outcome.measured['status']}): {outcome.measured.get('error')}",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
    for line in result.notes + ([result.summary["message"]] if result.summary["message"] else []):
        console.print(line, markup=False, highlight=False, soft_wrap=True)
    if result.interrupted:
        console.print("interrupted: finished trials are saved; run the same command to go on")
        raise typer.Exit(130)
    if result.failed:
        raise typer.Exit(1)


@app.command()
def run(
    config: Path = typer.Option(..., help="config-v1 JSON (best.json) to train with"),
    steps: int = ranged_option("--steps", 10, "training steps"),
    data: Path | None = typer.Option(None, help="Parquet/Arrow file of token ids (column input_ids or tokens)"),
    seed: int = ranged_option("--seed", 0, "seed of the weights and the synthetic tokens"),
):
    """Train with a tuned config through the same runner as trials (synthetic tokens or --data). Exit 1 when
    training fails, its root cause on the last line of stderr."""
    from autotune import cli_run
    from autotune.outputs.exporters import torchrun_command
    from trials.config_file import load_config_file
    from trials.model_config import load_model_config

    loaded = load_config_file(config)
    if loaded.seq_len is None:
        fail(f"config {str(config)!r} has no seq_len to train at")
    if loaded.gpus < 1:
        fail(f"config {str(config)!r} has gpus {loaded.gpus}: it must be at least 1")
    if loaded.nodes > 1:
        fail(
            f"config {str(config)!r} is for {loaded.nodes} nodes: `autotune export --format slurm` (or --format "
            f"torchrun, run on every node) trains it there"
        )
    model_config = load_model_config(loaded.model)
    loaded.techniques.validate(model_config, loaded.gpus, loaded.seq_len)
    _local_checks(loaded.gpus, loaded.techniques.attention == "flash")
    if data is not None:
        cli_run.check_token_file(data, model_config["vocab_size"], loaded.seq_len)
    command = torchrun_command(str(config), loaded.gpus, str(steps)).split()
    if data is not None:
        command += ["--data", str(data)]
    command += ["--seed", str(seed)]
    if command[0] == "python":
        command[0] = sys.executable
    else:
        command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    console.print(" ".join(command), markup=False, highlight=False)
    raise typer.Exit(cli_run.train(command, stdout=OUT.file))


@app.command()
def plot(directory: Path = typer.Argument(...), output: Path | None = typer.Option(None, "-o", "--output")):
    """Redraw pareto.png and memory.png (trials.parquet, pareto.json) and pareto.html (study.db, plotly)."""
    import pyarrow.parquet as pq

    from autotune.outputs.exporters import load_front
    from autotune.outputs.plots import plot_pareto

    front_doc = load_front(directory)
    rows = pq.read_table(directory / "trials.parquet").to_pylist()
    path = output or directory / "pareto.png"
    plot_pareto(rows, front_doc["front"], front_doc["target"], path, title=f"{front_doc['model']}")
    console.print(f"wrote {path}")
    if output is None and front_doc["front"] and "capacity_bytes" in front_doc:
        from autotune.outputs.report import plot_front_memory

        plot_front_memory(
            front_doc["front"],
            front_doc["capacity_bytes"],
            directory / "memory.png",
            title=f"memory per rank of the front, {front_doc['model']}",
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

    front_doc = load_front(directory)
    _print_front(front_doc["front"], front_doc["target"])


@app.command()
def models():
    """List model presets."""
    from trials.model_config import load_model_config, model_names, parameter_count

    table = Table(title="model presets (or pass a path to a Hugging Face config.json)")
    for column in ("name", "type", "layers", "hidden", "heads", "kv heads", "vocab", "params"):
        table.add_column(column)
    for name in model_names():
        c = load_model_config(name)
        table.add_row(
            name,
            c["model_type"],
            str(c["num_hidden_layers"]),
            str(c["hidden_size"]),
            str(c["num_attention_heads"]),
            str(c["num_key_value_heads"]),
            str(c["vocab_size"]),
            f"{parameter_count(c) / 1e9:.2f} B",
        )
    OUT.rich(table)


@app.command()
def hardware():
    """List hardware presets: the shipped ones and yours (``autotune calibrate --name NAME``)."""
    from autotune.core.hardware import hardware_names, load_hardware, user_preset_dir

    table = Table(title="hardware presets")
    for column in ("name", "from", "GiB", "TFLOP/s", "HBM TB/s", "link GB/s", "host GB/s", "rates"):
        table.add_column(column, no_wrap=column in ("name", "rates"))
    for name in hardware_names():
        hw = load_hardware(name)
        rates = hw.rates_for(1)  # what the time model uses (a calibrated preset's measured rates)
        table.add_row(
            name,
            hw.source,
            f"{hw.device_memory_bytes / 2**30:.0f}",
            f"{rates.bf16_flops / 1e12:.3g}",
            f"{rates.hbm_bytes_per_s / 1e12:.2f}",
            f"{rates.intra_node_bytes_per_s / 1e9:.0f}",
            f"{rates.host_bytes_per_s / 1e9:.0f}",
            _rates_origin(hw),
        )
    OUT.rich(table)
    OUT.print(
        f"user presets: {user_preset_dir()} (autotune calibrate --name NAME writes one; "
        f"autotune calibrate --check --hardware NAME says whether it still holds)"
    )


def _rates_origin(hw) -> str:
    if hw.calibrated:
        return f"measured {hw.calibrated.get('measured_at', '')[:10]}"
    if hw.calibration:
        return "typical CPU's"
    return "assumed"


def _note_rates(hw) -> None:
    """One line on stderr when the time model's rates were not measured on this node."""
    if hw.calibrated:
        return
    print(
        f"note: hardware {hw.name}: {hw.rate_provenance()}; `autotune calibrate --name NAME` measures this "
        f"node's, then --hardware NAME",
        file=sys.stderr,
    )


@app.command()
def calibrate(
    hardware: str | None = typer.Option(
        None,
        help="base preset whose memory facts the new preset keeps "
        "(default: the one matching this node's devices; cpu without CUDA)",
    ),
    gpus: int | None = ranged_option(
        "--gpus",
        None,
        "devices to measure the collectives over (default: all visible; cpu: trial world sizes 1, 2, 4 up to this)",
    ),
    name: str | None = typer.Option(None, help="save as a user preset, usable as --hardware NAME everywhere"),
    output: Path | None = typer.Option(None, "-o", "--output", help="write the preset YAML to this file instead"),
    model: str = typer.Option("llama3-8b", help="model whose GEMM shapes and head dim to measure (GPU presets)"),
    repeats: int = ranged_option(
        "--repeats",
        2,
        "CPU: calibration runs per world; the whole run whose own training "
        "step its rates predict best is kept, spread recorded",
    ),
    check: bool = typer.Option(
        False,
        "--check",
        help="measure nothing new: re-time the reference workload of the "
        "preset --hardware names and say how far this machine moved "
        "since it was calibrated (seconds)",
    ),
):
    """Measure this node's rates (GEMMs, attention, elementwise, host copies, host AdamW, collectives, per-op
    overheads) and write a hardware preset with them; a few minutes, with progress. With --check, only say
    whether an existing preset still describes this machine."""
    import torch

    from autotune.backends.local import visible_devices
    from autotune.core.hardware import load_hardware
    from autotune.timing.calibration import preset as preset_mod
    from trials.model_config import load_model_config

    if check:
        _check_preset(hardware, name, output)
        return
    preset_name, path = preset_mod.output_path(name, output)
    base = hardware or preset_mod.default_base()
    base_hw = load_hardware(base)
    visible = visible_devices()
    if not base_hw.device_is_host and not visible:
        fail(
            f"--hardware {base} is a GPU preset, but this machine shows no CUDA device: calibrate it on the node "
            f"(here: --hardware cpu)"
        )
    world = gpus or (visible if visible else 4)  # CPU: world sizes 1, 2 and 4 up to --gpus
    if visible and world > visible:
        fail(f"--gpus {world} but this node shows {visible} CUDA device(s)")
    model_config = load_model_config(model)
    print(
        f"calibrating {preset_name} on {torch.cuda.get_device_name(0) + f' x{world}' if visible else 'this CPU'} "
        f"(base preset {base}); a few minutes",
        file=sys.stderr,
        flush=True,
    )
    data = preset_mod.calibrate_preset(base, preset_name, world, model_config, model, repeats=repeats)
    written = preset_mod.write_preset(data, path)
    hw = load_hardware(str(written))
    rates = hw.rates_for(world)
    OUT.print(f"wrote {written}")
    OUT.print(
        f"  matmul {rates.matmul_flops_per_s / 1e12:.4g} TFLOP/s, attention fwd/bwd efficiency "
        f"{rates.attention_eff(128, False):.3f}/{rates.attention_eff(128, True):.3f}, elementwise "
        f"{rates.hbm_bytes_per_s * rates.elementwise_efficiency / 1e9:.4g} GB/s, host link "
        f"{rates.host_bytes_per_s / 1e9:.3g} GB/s, host AdamW {rates.host_optimizer_bytes_per_s / 1e9:.3g} GB/s"
    )
    spread = data["calibrated"].get("spread")
    if spread:
        OUT.print(f"  spread (max-min)/max between runs or samples: {json.dumps(spread)}")
    use = preset_name if name else written
    OUT.print(
        f"use it: --hardware {use}; later, `autotune calibrate --check --hardware {use}` says in seconds "
        f"whether it still describes this node"
    )


def _check_preset(hardware: str | None, name: str | None, output: Path | None) -> None:
    """``calibrate --check``: re-time --hardware's reference workload here (autotune.timing.calibration.check)."""
    from autotune.core.hardware import load_hardware
    from autotune.timing.calibration import preset as preset_mod
    from autotune.timing.calibration.check import check_preset

    if name is not None or output is not None:
        fail("--check writes nothing: give the preset to check as --hardware NAME|FILE, without --name / -o")
    hw = load_hardware(hardware or preset_mod.default_base())
    result = check_preset(
        hw,
        announce=lambda workload: print(f"checking {hw.name}: re-timing {workload} ...", file=sys.stderr, flush=True),
    )
    measured, verdict = result.lines(hw.name)
    OUT.print(measured)
    if result.contended:  # a check that could not measure: a failed run, not a verdict
        _fail_outcome(verdict)
    OUT.print(verdict)


@contextlib.contextmanager
def _library_noise_to_stderr():
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
        with interrupts_at_safe_points(), contextlib.nullcontext() if wants_help else _library_noise_to_stderr():
            # standalone_mode=False lets the errors below reach us; in this mode click *returns* the code of a
            # typer.Exit (130 for a KeyboardInterrupt) instead of exiting, and a command's return value (None)
            # when it ends normally
            exit_code = app(args=args, standalone_mode=False)
    except ConfigError as exc:  # bad input: ours (UserError) or the library's (a config that cannot run)
        print(f"autotune: error: {exc}", file=sys.stderr)
        return 2
    except click_exceptions.NoArgsIsHelpError as exc:
        print(exc.format_message(), file=sys.stderr)
        return 2
    except (typer.Abort, KeyboardInterrupt, _CommandInterrupted):  # a command that saves nothing on Ctrl-C
        print("autotune: interrupted", file=sys.stderr)
        return 130
    except click_exceptions.ClickException as exc:  # the parser's own usage errors, options out of range
        print(f"autotune: error: {exc.format_message()}", file=sys.stderr)
        return 2
    return exit_code if isinstance(exit_code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
