"""``autotune run``: train with a tuned config through the same runner as trials; what it checks before it
launches training, and how it reports the way training ended.

Its options are ``trials.train``'s: that parser reads the command line (no option is matched by a prefix of its
name) and ``--help`` lists every option from it. Bad input it can find before launching is a ``UserError`` (exit 2,
one line): an option that does not parse, or outside the range ``autotune.cli.options`` gives it, a config it
cannot train (no seq_len, several nodes), a ``--data`` file that is missing or empty, cannot be read as
Parquet/Arrow, has no token column of integers, no documents or no tokens, a null or an id outside the model's
vocabulary (the first one named with its place), or fewer tokens than one sequence, and whatever
``trials.train.options_problem`` finds in the options (an ``--init`` folder that is not the tuned model,
``--resume`` without a checkpoint, ...), and packing the trainer refuses (``trials.train.packing``: ``--pack`` with
data that has no document boundary, documents a ring cannot split). The data file is read with
``trials.training.data.read_token_data``, exactly as the training reads it. The command line is passed to the training as given. Training that fails exits 1 with its
root cause (the first exception a rank raised) on the last line of stderr."""

from __future__ import annotations

import collections
import inspect
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import typer

from autotune.cli.common import OUT, Command, app, console, fail
from autotune.cli.options import RANGES, check_range, ranged_help
from autotune.core.errors import UserError

# the last line of a Python traceback ("ValueError: ...", "torch.OutOfMemoryError: ..."), as a rank prints it
# (torchrun may prefix each line of a rank's output with "[rankN]:")
_EXCEPTION_LINE = re.compile(r"^(?:\[rank(\d+)\]:\s*)?((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception)(?::.*)?)$")
# torchrun's own summary of a failed rank: a symptom, the rank's own exception is the cause
_SYMPTOMS = ("ChildFailedError",)
_STDERR_KEPT = 2000  # lines of the training's stderr searched for the root cause
_RANK_PREFIX = re.compile(r"(\[rank\d+\]:\s?)?")
# torchrun's own notices, hidden unless -v: its OpenMP banner (not printed where OMP_NUM_THREADS is set) and the
# SIGTERM it sends a failed rank's peers (the rank's own error is the cause, said last)
_AGENT_NOTICE = re.compile(r"closing signal SIGTERM|Setting OMP_NUM_THREADS environment variable|^\*{20,}$")
_STOP_EXCEPTIONS = ("SignalException", "KeyboardInterrupt")  # how torchrun's agent and a rank report a stop
_CHAINS = ("During handling of the above exception", "The above exception was the direct cause")  # chained tracebacks
_KEYWORD = inspect.Parameter.KEYWORD_ONLY


class TrainerCommand(Command):
    """``autotune run``: ``trials.train``'s parser reads the command line (the one declaration of its options, which
    the exported scripts pass through too), and ``--help`` lists every option of it."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        if "--help" in args or "-h" in args:
            typer.echo(ctx.get_help(), color=ctx.color)
            ctx.exit()
        ctx.args = list(args)
        return []

    def get_params(self, ctx: typer.Context) -> list:
        return [*trainer_params(), *super().get_params(ctx)]


def trainer_options() -> list[tuple[str, object]]:
    """(long flag, argparse action) of each option ``trials.train``'s parser declares, but its help."""
    from trials.train import parser

    actions = [action for action in parser()._actions if action.dest != "help"]
    return [(next(name for name in action.option_strings if name.startswith("--")), action) for action in actions]


def trainer_params() -> list:
    """typer's options for ``trials.train``'s (what ``--help`` shows): each option's flags, type, default and help
    as its parser declares them, and the range ``autotune.cli.options`` gives a flag it knows."""
    parameters = []
    for flag, action in trainer_options():
        switch = action.nargs == 0  # --resume, --no-clip
        default = ... if action.required else False if switch else action.default
        option = typer.Option(
            default,
            *action.option_strings,
            help=ranged_help(flag, action.help) if flag in RANGES else action.help,
            metavar="" if switch else f"<{'|'.join(action.choices)}>" if action.choices else None,
            show_default=not switch and action.default is not None,
        )
        annotation = bool if switch else action.type or str
        parameters.append(
            inspect.Parameter(flag[2:].replace("-", "_"), _KEYWORD, default=option, annotation=annotation)
        )

    def options(**_): ...

    options.__signature__ = inspect.Signature(parameters)
    declared = typer.Typer(add_completion=False)
    declared.command()(options)
    return typer.main.get_command(declared).params


@app.command(cls=TrainerCommand)
def run(ctx: typer.Context):
    """Train with a tuned config through the same runner as trials (synthetic tokens or --data). The options are
    those of `python -m trials.train`, checked before launching: pretrained weights (--init), checkpoints (--save,
    --resume), the schedule, the log, a Hugging Face export (docs/training.md). Exit 1 when training fails, its
    root cause on the last line of stderr."""
    from autotune.backends.setup import check_local_node
    from autotune.outputs.exporters import trainer_launcher
    from trials.models.config import load_model_config
    from trials.train import OptionsError, lora_problem, options_problem, packing, parse_options
    from trials.training.config_file import load_config_file

    try:
        options = parse_options(ctx.args)
    except OptionsError as exc:
        fail(str(exc))
    for flag, action in trainer_options():
        if flag in RANGES:
            check_range(flag, getattr(options, action.dest))
    config = Path(options.config)
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
    import torch

    loaded.techniques.validate(model_config, loaded.gpus, loaded.seq_len, on_gpu=torch.cuda.is_available())
    check_local_node(loaded.gpus, loaded.techniques.attention)
    if options.data is not None:
        data = check_token_file(Path(options.data), model_config["vocab_size"], loaded.seq_len)
        try:  # its warning, if any, the trainer prints
            packing(options, loaded, model_config, data)
        except ValueError as exc:
            fail(str(exc))
    elif options.pack:
        fail("--pack needs --data (the synthetic tokens are one document per window)")
    problem = options_problem(options, model_config) or lora_problem(options, loaded, model_config)
    if problem is not None:
        fail(problem)
    command = trainer_launcher(loaded.gpus).split() + ctx.args
    if command[0] == "python":
        command[0] = sys.executable
    else:
        command = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    console.print(shlex.join(command), markup=False, highlight=False, soft_wrap=True)  # one line, pasteable
    raise typer.Exit(train(command, stdout=OUT.file, ranks=loaded.gpus))


def check_token_file(path: Path, vocab_size: int, seq_len: int):
    """The tokens of ``path`` (``trials.training.data.TokenData``), a Parquet/Arrow token file for a model of
    ``vocab_size`` trained on ``seq_len``-token sequences; ``UserError`` (one line) when training could not use it."""
    from trials.training.data import DataError, read_token_data

    try:
        data = read_token_data(str(path), vocab_size)
    except DataError as exc:  # one line: the file, then what is wrong with it
        raise UserError(f"--data {exc}") from None
    if data.tokens.numel() < seq_len + 1:
        raise UserError(
            f"--data {str(path)!r} holds {data.tokens.numel():,} tokens, fewer than one sequence of "
            f"{seq_len:,} (+1 for the shifted labels)"
        )
    return data


def train(command: list[str], stdout, ranks: int = 1) -> int:
    """Run the training ``command`` (its stdout to ``stdout``, its stderr passed through to ours, torchrun's own
    notices left out unless verbose); 0 when it trained, else 1 after printing its root cause as the last line of
    stderr. Each of the node's ``ranks`` processes gets its share of the cores as OpenMP threads (the CPU optimizer
    step's, as trials measured it) unless ``OMP_NUM_THREADS`` is set. Ctrl-C or SIGTERM (a ``KeyboardInterrupt``)
    stops the training and is raised again."""
    from autotune.core.quiet import verbose_from_env
    from trials.core.dist import rank_threads

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", rank_threads(ranks))
    verbose = verbose_from_env()
    kept: collections.deque[str] = collections.deque(maxlen=_STDERR_KEPT)
    process = subprocess.Popen(command, stdout=stdout, stderr=subprocess.PIPE, text=True, errors="replace", env=env)
    try:
        for line in process.stderr:
            kept.append(line.rstrip("\n"))
            if not verbose and _AGENT_NOTICE.search(line):
                continue
            sys.stderr.write(line)
            sys.stderr.flush()
        returncode = process.wait()
    except KeyboardInterrupt:
        _stop(process, verbose)
        print("autotune: training stopped", file=sys.stderr, flush=True)  # main says "interrupted" after it
        raise
    if returncode == 0:
        return 0
    print(f"autotune: training failed: {root_cause(list(kept), returncode)}", file=sys.stderr, flush=True)
    return 1


def root_cause(stderr_lines: list[str], returncode: int) -> str:
    """The first exception a rank raised (a peer's, or torchrun's own report of it, is a symptom), else how the
    process ended."""
    for line in stderr_lines:
        match = _EXCEPTION_LINE.match(line.strip())
        if match is None:
            continue
        rank, exception = match.groups()
        if not any(symptom in exception.split(":")[0] for symptom in _SYMPTOMS):
            return exception if rank is None else f"rank {rank}: {exception}"
    if returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exited with code {returncode} without a Python exception (see the output above)"


def _stop(process: subprocess.Popen, verbose: bool = False) -> None:
    """Stop the training: Ctrl-C reached it too, a SIGTERM to autotune did not; drain its output meanwhile (without
    the stop's own tracebacks, and torchrun's notices unless ``verbose``)."""
    if process.poll() is None:
        process.terminate()
    try:
        _, rest = process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        _, rest = process.communicate()
    lines = without_stop_tracebacks((rest or "").splitlines())
    sys.stderr.writelines(line + "\n" for line in lines if verbose or not _AGENT_NOTICE.search(line))


def without_stop_tracebacks(lines: list[str]) -> list[str]:
    """The training's last output lines without the tracebacks of the stop itself: torchrun's agent raises
    ``SignalException`` at the signal, a rank that got Ctrl-C ``KeyboardInterrupt``. A chain of tracebacks ("During
    handling of the above exception, another exception occurred:", "The above exception was the direct cause of
    the following exception:") is one: dropped whole when its last exception is the stop (the error a signal cut
    into is the stop's, not the training's). A rank's lines, prefixed ``[rankN]:``, are followed apart from the
    others'; every other traceback stays."""
    kept: list[list[str]] = []  # the output in its order: single lines, and each chain where it began
    reading: dict[str, list[str]] = {}  # the traceback chain each prefix is in, so far (a list inside ``kept``)
    state: dict[str, str] = {}  # per prefix: "trace" (inside a traceback), "ended" (its exception said), "chained"
    last: dict[str, str] = {}  # the last exception line of each prefix's chain

    def close(prefix: str) -> None:
        block = reading.pop(prefix)
        state.pop(prefix)
        if last.pop(prefix, "").split(":")[0].rsplit(".", 1)[-1] in _STOP_EXCEPTIONS:
            block.clear()

    for line in lines:
        prefix = _RANK_PREFIX.match(line).group(0)
        body = line[len(prefix) :]
        if state.get(prefix) == "ended":
            if body.startswith(_CHAINS):
                state[prefix] = "chained"
                reading[prefix].append(line)
                continue
            if not body.strip():
                reading[prefix].append(line)
                continue
            close(prefix)
        if body.startswith("Traceback (most recent call last):"):
            if state.get(prefix) == "trace":  # a traceback cut off by another: the first one as it stands
                close(prefix)
            if prefix not in reading:
                reading[prefix] = []
                kept.append(reading[prefix])
            reading[prefix].append(line)
            state[prefix] = "trace"
        elif prefix in reading:
            reading[prefix].append(line)
            if state[prefix] == "trace" and body[:1].strip():  # the exception's line ends the traceback
                state[prefix], last[prefix] = "ended", body
        else:
            kept.append([line])
    for prefix in list(reading):
        close(prefix)
    return [line for lines in kept for line in lines]
