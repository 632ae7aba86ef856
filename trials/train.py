"""Train with a tuned config: the same model, stack and step as a trial, from pretrained weights, for days.

    torchrun --standalone --nproc-per-node=N -m trials.train --config best.json --steps S \\
        [--init HF_FOLDER] [--data tokens.parquet] [--save CKPT --save-every K [--keep 3] [--resume]] \\
        [--log-file log.jsonl] [--export-hf OUT_FOLDER] [--export-merged OUT_FOLDER] \\
        [--lr ... --schedule cosine --warmup-steps ...]

(``python -m trials.train ...`` for one rank; ``autotune run`` checks the options and launches this.)

- Weights: ``--init``, a Hugging Face model folder whose model is the one the config was tuned for; each rank reads
  only its FSDP2 shards' rows of each tensor (``trials.hf``). Without it, seeded random weights (as trials).
- Data: synthetic tokens by default (the trials' seeded stream: step 1 matches the trial's loss), or token ids from
  a Parquet/Arrow file: a column ``input_ids`` (list of ints per row) or ``tokens`` (ints), read as one stream of
  windows of seq_len + 1 tokens (``--no-pack``). Packed (``--pack``; the default when the config's ``documents`` is
  not "one"): documents (rows of ``input_ids``, or the ``tokens`` stream cut after each of the model's EOS ids) back
  to back in windows of seq_len tokens, a document crossing a window's end cut there, each window's boundaries
  passed to the stack (position ids restart, no label crosses a boundary). A step takes ``accumulate * dp`` consecutive windows (replica r, micro-batch m:
  window ``consumed + m * dp + r``), wrapping around; ``consumed`` is kept in checkpoints.
- Checkpoints (``trials.training.checkpoint``): every ``--save-every`` steps and at the end, atomically; ``--resume``
  continues from the newest complete one, on any world size; ``--steps`` is the run's total.
- LoRA (a config whose ``lora`` trains adapters, ``trials.models.lora``): the base weights are ``--init``'s (or the
  seeded draw), frozen; the adapters are drawn by ``--seed``; checkpoints hold the adapters and their optimizer
  state (a resume reads the same base again: another ``--init`` is refused); ``--export-hf`` writes the adapters
  as a folder ``peft.PeftModel.from_pretrained(base, folder)`` loads, ``--export-merged`` the model with them merged
  into its weights, as a plain Hugging Face folder. Full training's ``--export-hf`` writes the whole model.
- Log: rank 0 prints each step (a progress bar on a terminal), appends one JSON object per step to ``--log-file``
  and to TensorBoard with ``--tensorboard``; a final ``summary {json}`` line.
Bad options and a ``--data`` file training cannot use (``trials.training.data.read_token_data``: empty, no documents,
an id outside the vocabulary, ...): one line on stderr, exit 2, before any rank builds a model; an option is spelt in
full (``--log`` is no ``--log-file``). A failed checkpoint save: exit 1 with the cause. A step whose loss or gradient
norm is not finite is not applied, and the run stops there with exit 1 (``DivergenceError``, naming the step and the
value), writing no checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trials.core import allocator
from trials.core.dist import collective_timeout_s, init_mesh
from trials.core.errors import ConfigError
from trials.core.memory import DeviceMemoryTracker
from trials.kernels.documents import Documents, DocumentsSpec
from trials.models.config import load_model_config
from trials.models.model import lora_mismatch
from trials.stack.rules import ring_document_unit
from trials.training import checkpoint
from trials.training.config_file import load_config_file
from trials.training.data import (
    TokenData,
    mesh_batch,
    pad_documents,
    read_token_data,
    synthetic_sample,
    window_documents,
)
from trials.training.step import (
    DivergenceError,
    build_training,
    clip_gradients,
    forward_backward,
    grad_norm,
    make_optimizer,
    step_if_finite,
    summed_loss,
)

SCHEDULES = ("constant", "cosine")
LOG_KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_device_gib", "host_gib", "elapsed_s", "documents")


@dataclass
class TrainOptions:
    """What ``trials.train`` trains: every command-line option (``main``'s parser is built from the defaults)."""

    config: str
    steps: int = 10
    data: str | None = None
    seed: int = 0
    init: str | None = None
    save: str | None = None
    save_every: int | None = None
    keep: int | None = None
    resume: bool = False
    export_hf: str | None = None
    export_merged: str | None = None
    lr: float = 1e-5
    min_lr: float = 0.0
    warmup_steps: int = 0
    schedule: str = "constant"
    max_grad_norm: float | None = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    accumulate: int = 1
    log_file: str | None = None
    tensorboard: str | None = None
    pack: bool | None = None  # None: pack when the config's documents are not "one" (``packing``)


class TokenSource:
    """Windows of seq_len + 1 tokens, from the synthetic stream or a Parquet/Arrow file; packed documents when
    ``ends`` (where each document of the stream ends, ``TokenData.document_ends``) is given, and ``pads`` (bool, one
    per token of the stream) where ``pad_documents`` padded them for a ring."""

    def __init__(
        self,
        seq_len: int,
        vocab_size: int,
        seed: int = 0,
        path: str | None = None,
        stream: torch.Tensor | None = None,
        ends: np.ndarray | None = None,
        pads: torch.Tensor | None = None,
    ):
        """``stream``: the file's tokens already read (``read_token_data``), else ``path`` is read here."""
        self.seq_len, self.vocab_size, self.seed, self.ends, self.pads = seq_len, vocab_size, seed, ends, pads
        self.stream = stream if stream is not None or not path else read_token_data(path, vocab_size).tokens

    def window(self, index: int) -> torch.Tensor:
        """Window ``index``: seq_len + 1 tokens, windows back to back around the stream; packed, windows start
        seq_len tokens apart (the last token is only a label, and packed it predicts nothing: ``documents``)."""
        if self.stream is None:
            return synthetic_sample(index, self.seq_len, self.vocab_size, self.seed)
        return self.stream[self._picked(index)]

    def _picked(self, index: int) -> torch.Tensor:
        width = self.seq_len + 1
        start = (index * (self.seq_len if self.ends is not None else width)) % self.stream.numel()
        return torch.arange(start, start + width) % self.stream.numel()

    def batch(self, index: int, mesh):
        """This rank's ``Batch`` of window ``index`` (``mesh_batch``): its documents, and their pads, when packed."""
        if self.pads is None:
            return mesh_batch(self.window(index), mesh, documents=self.documents(index))
        picked = self._picked(index)  # the window's tokens and their pads, picked once
        return mesh_batch(self.stream[picked], mesh, documents=self.documents(index), pads=self.pads[picked])

    def documents(self, index: int) -> Documents | None:
        """The packed documents of window ``index`` (its first seq_len tokens), or None: not packed."""
        if self.ends is None:
            return None
        return window_documents(self.ends, (index * self.seq_len) % self.stream.numel(), self.seq_len)

    def documents_in(self, first: int, windows: int) -> int:
        """How many documents (pieces cut at a window's edge counted as one each) ``windows`` windows from
        ``first`` hold: one per window when not packed."""
        if self.ends is None:
            return windows
        return sum(len(self.documents(index).lengths) for index in range(first, first + windows))


@dataclass
class Packing:
    """How the ``--data`` file trains: the stream it trains on (the file's, or on a ring whose chunks do not divide
    every document, each document padded: ``pad_documents``, with ``pads`` True at each pad and a line saying so,
    ``note``), the documents' ends in it (None: windows of one stream, unpacked), and a line to warn with when
    that differs from the documents the config's estimate assumed."""

    tokens: torch.Tensor
    ends: np.ndarray | None
    warning: str | None = None
    pads: torch.Tensor | None = None
    note: str | None = None


def packing(options: TrainOptions, config, model_config: dict, data: TokenData) -> Packing:
    """Whether and how ``data`` is packed (``--pack``, ``--no-pack``, else packed when the config's documents are
    not "one" and the data has boundaries); ``ValueError`` (one line) for ``--pack`` with data that has no document
    boundaries. On a ring each document is padded to a multiple of its 2 x ring_degree chunks
    (``trials.stack.rules.ring_document_unit``), as the estimate prices them."""
    ends = data.document_ends(eos_token_ids(options, model_config))
    wanted = options.pack if options.pack is not None else not config.documents.one
    if options.pack and ends is None:
        if data.row_lengths is not None:
            why = "its rows of 'input_ids' hold one document"
        else:
            eos = eos_token_ids(options, model_config)
            named = (
                f"the model's eos_token_id is {', '.join(map(str, eos))}"
                if eos
                else "the model names no eos_token_id: --init a folder whose config.json does"
            )
            why = f"its 'tokens' hold no EOS id before the last token ({named})"
        raise ValueError(f"--pack: --data {options.data} has no document boundary: {why}")
    assumed = config.documents
    if not (wanted and ends is not None):
        if assumed.one:
            return Packing(data.tokens, None)
        why = "--no-pack" if options.pack is False else "the data has no document boundary"
        return Packing(
            data.tokens,
            None,
            f"the config's estimate assumed {assumed.describe()}; this run trains each window as one document ({why})",
        )
    # on a ring each document runs padded to a multiple of its chunks, in the estimate as here; the windows cut
    # documents at multiples of seq_len only (``window_documents``), itself a multiple of that unit
    unit = ring_document_unit(config.techniques.ring_degree)
    tokens, padded_ends, pads = pad_documents(data.tokens, ends, unit)
    lengths = np.diff(ends, prepend=0)
    warning = (
        None
        if _same_documents(assumed.padded(unit), np.diff(padded_ends, prepend=0))
        else f"the config's estimate assumed {assumed.describe()}; --data {options.data} packs "
        f"{DocumentsSpec(tuple(lengths.tolist())).describe()} (autotune estimate --documents {options.data} prices them)"
    )
    if pads is None:
        return Packing(data.tokens, ends, warning)
    padded = int(pads.sum())
    note = (
        f"ring_degree {config.techniques.ring_degree} splits each packed document into {unit} chunks: each is "
        f"padded to a multiple of {unit} tokens, {padded:,} pad tokens in all ({padded / pads.numel():.2%} of the "
        "stream; no pad is a label or has one)"
    )
    return Packing(tokens, padded_ends, warning, pads, note)


def _same_documents(spec: DocumentsSpec, lengths: np.ndarray) -> bool:
    """Whether a file's document ``lengths`` are those ``spec`` packs: the same list, or all of one fixed length
    (the last one possibly shorter)."""
    if len(spec.lengths) == 1:
        return bool((lengths[:-1] == spec.lengths[0]).all() and lengths[-1] <= spec.lengths[0])
    return tuple(lengths.tolist()) == spec.lengths


def eos_token_ids(options: TrainOptions, model_config: dict) -> tuple[int, ...]:
    """The model's end-of-sequence ids, which cut a ``tokens`` stream into documents: the ``--init`` folder's
    ``config.json``'s ``eos_token_id`` (an id or a list), else the config's model's; () when neither names one."""
    value = None
    if options.init is not None and (Path(options.init) / "config.json").is_file():
        with contextlib.suppress(ValueError, OSError):
            value = json.loads((Path(options.init) / "config.json").read_text()).get("eos_token_id")
    if value is None:
        value = model_config.get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    return tuple(int(v) for v in values if isinstance(v, int) and not isinstance(v, bool))


def options_problem(options: TrainOptions, model_config: dict) -> str | None:
    """Why the options cannot train the config's model (one line), or None. Reads only headers and folder
    listings, so ``autotune run`` asks it before launching and every rank before its first step."""
    from trials import hf

    checks = [
        (options.steps < 1, f"--steps must be at least 1, got {options.steps}"),
        (options.accumulate < 1, f"--accumulate must be at least 1, got {options.accumulate}"),
        (not options.lr > 0, f"--lr must be positive, got {options.lr}"),
        (not 0 <= options.min_lr <= options.lr, f"--min-lr must lie in [0, --lr], got {options.min_lr}"),
        (options.warmup_steps < 0, f"--warmup-steps must be at least 0, got {options.warmup_steps}"),
        (options.schedule not in SCHEDULES, f"--schedule must be one of {', '.join(SCHEDULES)}"),
        (options.max_grad_norm is not None and not options.max_grad_norm > 0, "--max-grad-norm must be positive"),
        (not (0 <= options.beta1 < 1 and 0 <= options.beta2 < 1), "--beta1 and --beta2 must lie in [0, 1)"),
        (options.weight_decay < 0, f"--weight-decay must be at least 0, got {options.weight_decay}"),
        (options.save_every is not None and options.save_every < 1, "--save-every must be at least 1"),
        (options.keep is not None and options.keep < 1, "--keep must be at least 1"),
        (
            options.save is None and (options.save_every or options.keep or options.resume),
            "--save-every, --keep and --resume need --save FOLDER",
        ),
    ]
    for failed, message in checks:
        if failed:
            return message
    for flag, path in (
        ("--save", options.save),
        ("--export-hf", options.export_hf),
        ("--export-merged", options.export_merged),
    ):
        if path is not None and Path(path).exists() and not Path(path).is_dir():
            return f"{flag} {path!r} is a file, not a folder"
        if path is not None and not _creatable(Path(path)):
            return f"{flag} {path!r} cannot be created (its parent is missing or not writable)"
    if options.log_file is not None:
        log = Path(options.log_file)
        if log.is_dir() or not (os.access(log, os.W_OK) if log.exists() else _creatable(log.parent)):
            return f"--log-file {options.log_file!r} cannot be written"
    for flag, path in (("--export-hf", options.export_hf), ("--export-merged", options.export_merged)):
        if path is not None and _is_foreign_folder(Path(path)):
            return f"{flag} {path!r} holds other files; name a new folder or a previous export"
    if options.resume and checkpoint.newest(Path(options.save)) is None:
        return f"--resume: no complete checkpoint in {options.save!r} to resume from"
    if options.tensorboard is not None:
        try:
            import torch.utils.tensorboard  # noqa: F401
        except ImportError:
            return "--tensorboard needs the tensorboard package (pip install tensorboard)"
    if options.init is not None:
        return hf.pretrained_problem(options.init, model_config)
    return None


def lora_problem(options: TrainOptions, config, model_config: dict) -> str | None:
    """Why the options cannot train ``config``'s adapters on ``model_config``'s model (one line), or None:
    ``--export-merged`` of full training (there is nothing to merge), adapters that do not fit the model
    (``lora_mismatch``), or a LoRA resume on another base than its checkpoint's (the checkpoint holds the adapters
    alone: ``frozen_base``)."""
    if not config.lora.on:
        if options.export_merged is not None:
            return "--export-merged merges LoRA adapters; the config trains every weight (--export-hf writes it)"
        return None
    mismatch = lora_mismatch(model_config, config.lora)
    if mismatch:
        return mismatch
    newest = checkpoint.newest(Path(options.save)) if options.resume and options.save is not None else None
    if newest is not None:
        saved = json.loads((newest / checkpoint.STATE_FILE).read_text()).get("frozen_base")
        if saved is not None and saved != frozen_base(options):
            return (
                f"--resume: {newest} trained adapters on {saved}; this run's base is {frozen_base(options)} (the "
                "checkpoint holds the adapters only: resume with the same --init)"
            )
    return None


def frozen_base(options: TrainOptions) -> str:
    """Where a LoRA run's frozen base weights come from: the ``--init`` folder (its absolute path), else the seeded
    draw."""
    return str(Path(options.init).absolute()) if options.init is not None else f"random weights of seed {options.seed}"


def _creatable(path: Path) -> bool:
    """Whether the folder ``path`` exists and is writable, or can be made (its nearest existing parent is)."""
    path = path.absolute()
    existing = next((p for p in [path, *path.parents] if p.exists()), None)
    return existing is not None and existing.is_dir() and os.access(existing, os.W_OK)


def _is_foreign_folder(folder: Path) -> bool:
    """A non-empty folder that is not an earlier export (config.json + safetensors, or a peft adapter folder):
    replacing it would lose files."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return False
    configs = ("config.json", "adapter_config.json")
    return not (any((folder / name).is_file() for name in configs) and any(folder.glob("*.safetensors")))


def learning_rate_schedule(optimizer, options: TrainOptions):
    """``transformers``' warmup schedules: linear warmup, then constant or cosine decay to ``min_lr`` at the
    run's last step."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    if options.schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, options.warmup_steps)
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, options.warmup_steps, options.steps, min_lr=options.min_lr
    )


class StepLog:
    """Rank 0's record of each step: a JSON line in ``--log-file`` (a resumed run first drops the lines of steps after
    its checkpoint: they are trained again), TensorBoard scalars, and the console (a progress bar on a terminal,
    one line per step otherwise)."""

    def __init__(self, options: TrainOptions, first_step: int, print_fn):
        self.total = options.steps
        self.print_fn = print_fn
        self.file = None
        if options.log_file is not None:
            path = Path(options.log_file)
            kept = []
            if options.resume and path.is_file():
                kept = [line for line in path.read_text().splitlines() if line.strip() and _step_of(line) <= first_step]
            path.write_text("".join(line + "\n" for line in kept))
            self.file = open(path, "a")
        self.tensorboard = None
        if options.tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(options.tensorboard, purge_step=first_step + 1)
        self.bar = None
        if print_fn is print and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(
                TextColumn("step"),
                MofNCompleteColumn(),
                BarColumn(bar_width=12),
                TimeRemainingColumn(),
                TextColumn("{task.fields[line]}"),
            )
            self.task = self.bar.add_task("train", total=self.total, completed=first_step, line="")
            self.bar.start()

    def record(self, entry: dict) -> None:
        if self.file is not None:
            self.file.write(json.dumps(entry) + "\n")
            self.file.flush()
        if self.tensorboard is not None:
            for key, value in entry.items():
                if key != "step":
                    self.tensorboard.add_scalar(f"train/{key}", value, entry["step"])
        line = (
            f"loss {entry['loss']:.6f}  lr {entry['lr']:.3g}  grad_norm {entry['grad_norm']:.4f}  "
            f"{entry['tokens_per_s']:,.0f} tokens/s  peak {entry['peak_device_gib']:.3f} GiB  "
            f"host {entry['host_gib']:.2f} GiB  {entry['documents']:,} documents"
        )
        if self.bar is not None:  # compact enough for an 80-column terminal; the log file has every figure
            self.bar.update(
                self.task,
                completed=entry["step"],
                line=f"loss {entry['loss']:.4f} lr {entry['lr']:.1e} gnorm {entry['grad_norm']:.3g} "
                f"{entry['tokens_per_s']:,.0f} tok/s {entry['peak_device_gib']:.2f} GiB",
            )
        else:
            self.print_fn(f"step {entry['step']}/{self.total}  {line}", flush=True)

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False)
        else:
            self.print_fn(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.file is not None:
            self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 0


class _Silent:
    def record(self, entry):
        pass

    def say(self, text):
        pass

    def close(self):
        pass


def train(
    options: TrainOptions,
    print_fn=print,
    tokens: torch.Tensor | None = None,
    ends: np.ndarray | None = None,
    pads: torch.Tensor | None = None,
) -> dict:
    """Train as ``options`` say; returns rank 0's summary (every rank returns one). ``tokens``: the ``--data`` file's
    stream, when the caller has read it (``main`` does, before any rank builds a model); ``ends``: where its
    documents end, when it is packed, and ``pads`` its pad tokens, when padded for a ring (``packing``)."""
    config = load_config_file(options.config)
    techniques, seq_len = config.techniques, config.seq_len
    mesh = init_mesh(
        techniques.ulysses_degree,
        timeout_s=collective_timeout_s(recorded_step_time_s(config)),
        ring_degree=techniques.ring_degree,
    )
    tracker = DeviceMemoryTracker() if mesh.device.type != "cuda" else None
    resume_from = checkpoint.newest(Path(options.save)) if options.resume else None
    losses, rates, peak = [], [], 0
    with tracker if tracker is not None else contextlib.nullcontext():
        model, optimizer, loading = _build(options, config, mesh, tracker, load_weights=resume_from is None)
        schedule = learning_rate_schedule(optimizer, options)
        state = checkpoint.TrainerState(world_size=mesh.world_size)
        if options.save is not None:
            checkpoint.remove_partial(Path(options.save))
        if resume_from is not None:
            state = checkpoint.load(resume_from, model, optimizer)
            schedule.load_state_dict(state.schedule)
        if loading is not None or resume_from is not None:  # the logged peak is the steps', not the loading's
            _reset_peak(mesh.device, tracker)
        log = StepLog(options, state.step, print_fn) if mesh.rank == 0 else _Silent()
        try:
            if loading is not None:
                log.say(
                    f"loaded {options.init} in {loading['seconds']:.1f} s; rank 0 held at most "
                    f"{loading['peak_bytes'] / 2**30:.3f} GiB (its shards and buffers: "
                    f"{loading['shard_bytes'] / 2**30:.3f} GiB)"
                )
            if config.lora.on:  # the global sizes (a DTensor's numel is the whole parameter's)
                trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
                every = sum(p.numel() for p in model.parameters())
                log.say(
                    f"training {config.lora.describe()}: {trainable:,} of {every:,} parameters "
                    f"({trainable / every:.2%}), the rest frozen"
                )
            if resume_from is not None:
                log.say(
                    f"resumed from {resume_from} (step {state.step}, saved on {state.world_size} ranks, "
                    f"{state.windows_consumed:,} windows read)"
                )
            if state.step >= options.steps:  # a finished run resumed: --export-hf still exports its model
                log.say(
                    f"nothing to train: the run is at step {state.step} and --steps {options.steps} is its total "
                    f"(a larger --steps trains on)"
                )
            source = TokenSource(seq_len, model.config.vocab_size, options.seed, options.data, tokens, ends, pads)
            started = time.perf_counter() - state.elapsed_s
            while state.step < options.steps:
                step_start = time.perf_counter()
                lr = optimizer.param_groups[0]["lr"]
                windows = options.accumulate * mesh.dp_size
                documents = source.documents_in(state.windows_consumed, windows) if mesh.rank == 0 else windows
                loss, norm = _step(model, optimizer, source, state.windows_consumed, options, mesh, tracker)
                if not (math.isfinite(loss) and math.isfinite(norm)):  # every rank reads the same two values
                    raise DivergenceError(divergence(state.step + 1, loss, norm, options.save))
                schedule.step()
                elapsed = time.perf_counter() - step_start
                state.step += 1
                state.windows_consumed += options.accumulate * mesh.dp_size
                state.elapsed_s = time.perf_counter() - started
                peak = torch.cuda.max_memory_allocated(mesh.device) if tracker is None else tracker.peak_device_bytes
                losses.append(loss)
                rates.append(seq_len * options.accumulate * mesh.dp_size / elapsed)
                log.record(
                    {
                        "step": state.step,
                        "loss": loss,
                        "lr": lr,
                        "grad_norm": norm,
                        "tokens_per_s": rates[-1],
                        "peak_device_gib": peak / 2**30,
                        "host_gib": _peak_host_bytes() / 2**30,
                        "elapsed_s": state.elapsed_s,
                        "documents": documents,
                    }
                )
                due = options.save_every is not None and state.step % options.save_every == 0
                if options.save is not None and (due or state.step == options.steps):
                    state.schedule, state.world_size = schedule.state_dict(), mesh.world_size
                    state.frozen_base = frozen_base(options) if config.lora.on else None
                    saved = checkpoint.save(Path(options.save), model, optimizer, state, mesh.device, options.keep)
                    log.say(f"saved {saved}")
            if options.export_hf is not None and config.lora.on:
                checkpoint.export_adapters(model, Path(options.export_hf), mesh.device, options.init)
                log.say(f"exported the adapters to {options.export_hf} (peft format: PeftModel.from_pretrained)")
            elif options.export_hf is not None:
                checkpoint.export_hf(model, model.config, Path(options.export_hf), mesh.device)
                log.say(f"exported the model to {options.export_hf} (Hugging Face format)")
            if options.export_merged is not None:
                checkpoint.export_hf(model, model.config, Path(options.export_merged), mesh.device)
                log.say(f"exported the model with its adapters merged to {options.export_merged} (Hugging Face format)")
        finally:
            log.close()
    summary = {
        "steps": options.steps,
        "seq_len": seq_len,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "tokens_per_s": sum(rates[1:] or rates) / len(rates[1:] or rates) if rates else None,
        "peak_device_bytes": int(peak),
        "world_size": mesh.world_size,
    }
    if loading is not None:
        summary["init_load"] = loading
    if mesh.rank == 0:
        print_fn("summary " + json.dumps(summary), flush=True)
    return summary


def divergence(step: int, loss: float, norm: float, save: str | None) -> str:
    """What a diverged step says (one line): the step, the values that are not finite, the checkpoint to resume."""
    bad = [
        f"the {name} is {value}"
        for name, value in (("loss", loss), ("gradient norm", norm))
        if not math.isfinite(value)
    ]
    newest = checkpoint.newest(Path(save)) if save is not None else None
    kept = (
        f"the newest checkpoint, {newest}, is from before it (--resume continues from it)"
        if newest is not None
        else "no checkpoint was written"
    )
    return f"training diverged at step {step}: {' and '.join(bad)}; the step was not applied and {kept}"


def recorded_step_time_s(config) -> float | None:
    """The step time the config file records for its model and length: the measured one (``autotune verify``'s),
    else the predicted one; None when it records neither (a config written by hand). The trainer's collective
    timeout follows it, as a trial's does: a step longer than torch's 10-minute default would abort the run."""
    for record in (config.measured, config.predicted):
        if record and record.get("status", "ok") == "ok" and record.get("step_time_s"):
            return float(record["step_time_s"])
    return None


def _build(options: TrainOptions, config, mesh, tracker, load_weights: bool):
    """(model, optimizer, what loading held): the ``--init`` folder's model, its weights read shard by shard unless
    a checkpoint supplies them (``load_weights`` False), or the config's model with seeded random weights."""
    adamw = {"betas": (options.beta1, options.beta2), "weight_decay": options.weight_decay}
    techniques = config.techniques
    if options.init is None:
        model_config = load_model_config(config.model)
        model, optimizer = build_training(
            model_config, techniques, mesh, options.seed, tracker, options.lr, lora=config.lora, **adamw
        )
        return model, optimizer, None
    from trials import hf

    start = time.perf_counter()
    # a LoRA resume reads the base again (the checkpoint holds the adapters alone) and the adapters from it
    load_weights = load_weights or config.lora.on
    model = hf.from_pretrained(
        options.init, techniques, mesh, load_weights=load_weights, lora=config.lora, seed=options.seed
    )
    loading = None
    if load_weights:  # what reading the weights held, at most (CUDA: device memory only)
        held = (
            tracker.peak_device_bytes + tracker.peak_host_bytes
            if tracker is not None
            else torch.cuda.max_memory_allocated(mesh.device)
        )
        loading = {
            "seconds": time.perf_counter() - start,
            "peak_bytes": held,
            "shard_bytes": sum(_local_bytes(t) for t in [*model.parameters(), *model.buffers()]),
        }
    return model, make_optimizer(model, techniques, mesh, options.lr, **adamw), loading


def _step(model, optimizer, source: TokenSource, consumed: int, options: TrainOptions, mesh, tracker):
    """One optimizer step over ``options.accumulate`` sequences per replica (replica r's m-th: window
    ``consumed + m * dp + r``), clipped; (the mean token loss of all of them, the gradient's norm before clipping),
    read after the optimizer step is queued where it is fused. A loss or norm that is not finite leaves the weights and the optimizer as they were
    (``step_if_finite``)."""
    scaled = torch.zeros((), device=mesh.device)
    for micro in range(options.accumulate):
        index = consumed + micro * mesh.dp_size + mesh.dp_rank
        batch = source.batch(index, mesh)
        last = micro == options.accumulate - 1
        scaled += forward_backward(model, batch, mesh, tracker, options.accumulate, reduce=last)
    loss = summed_loss(scaled, mesh)  # on the device, as the norm: clipping and the optimizer step queue without a sync
    norm = grad_norm(model, mesh)
    if options.max_grad_norm is not None:
        clip_gradients(model, norm, options.max_grad_norm)
    with tracker.in_phase("optimizer") if tracker is not None else contextlib.nullcontext():
        loss_sum, norm_value = step_if_finite(optimizer, loss, norm)  # skipped when either is nan or inf
    return loss_sum / (mesh.cp_degree * mesh.dp_size), norm_value


def _reset_peak(device: torch.device, tracker) -> None:
    """Start the peak over from what is live: the tracker's (the simulated device and the host), else torch.cuda's."""
    if tracker is not None:
        tracker.reset_peak()
    else:
        torch.cuda.reset_peak_memory_stats(device)


def _local_bytes(param) -> int:
    local = param.to_local() if hasattr(param, "to_local") else param
    return local.numel() * local.element_size()


def _peak_host_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class OptionsError(ValueError):
    """The command line does not parse (an unknown option, a value of the wrong type): one line."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise OptionsError(message)


def parse_options(argv: list[str] | None) -> TrainOptions:
    """The options of a ``trials.train`` command line (``OptionsError`` when it does not parse: an unknown option
    names the closest known one); the one declaration of every option, which ``autotune run`` and the exported
    scripts pass through."""
    options = parser()
    parsed, unknown = options.parse_known_args(argv)
    if unknown:
        word, flags = unknown[0], [flag for action in options._actions for flag in action.option_strings]
        close = [flag for flag in flags if flag.startswith(word)] or difflib.get_close_matches(word, flags, n=1)
        hint = f" (did you mean {' or '.join(close)}?)" if close and word.startswith("--") else ""
        raise OptionsError(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    return TrainOptions(**vars(parsed))


def parser() -> argparse.ArgumentParser:
    """Every option; none is matched by a prefix of its name (torchrun's parser, which sees the same command line,
    would take a prefix for one of its own options)."""
    defaults = TrainOptions(config="")
    parser = _Parser(prog="trials.train", description=__doc__.splitlines()[0], allow_abbrev=False)
    add = parser.add_argument
    add("--config", required=True, help="autotune/config-v1 JSON (best.json)")
    add("--steps", type=int, default=defaults.steps, help="the run's total optimizer steps (a resumed run too)")
    add("--data", default=None, help="Parquet/Arrow file of token ids (default: synthetic tokens)")
    add(
        "--pack",
        dest="pack",
        action="store_true",
        default=None,
        help="pack --data's documents (input_ids rows, or cut after EOS) into windows (default: if the config packs)",
    )
    add("--no-pack", dest="pack", action="store_false", help="read --data as one stream of windows, unpacked")
    add("--seed", type=int, default=defaults.seed, help="seed of the random weights and synthetic tokens")
    add("--init", default=None, help="Hugging Face model folder to start from (config.json + safetensors)")
    add("--save", default=None, help="folder of the run's checkpoints")
    add("--save-every", type=int, default=None, help="steps between checkpoints (and one at the end)")
    add("--keep", type=int, default=None, help="complete checkpoints kept (default: all)")
    add("--resume", action="store_true", help="continue from the newest complete checkpoint in --save")
    add(
        "--export-hf",
        default=None,
        help="at the end, write the model as a Hugging Face folder here (LoRA: the adapters, as a peft folder)",
    )
    add("--export-merged", default=None, help="LoRA: at the end, write the model, its adapters merged, here")
    add("--lr", type=float, default=defaults.lr, help="peak learning rate")
    add("--min-lr", type=float, default=defaults.min_lr, help="learning rate at the last step (cosine)")
    add("--warmup-steps", type=int, default=defaults.warmup_steps, help="linear warmup from 0")
    add("--schedule", choices=SCHEDULES, default=defaults.schedule, help="after warmup")
    add("--max-grad-norm", type=float, default=defaults.max_grad_norm, help="clip the gradient's L2 norm to this")
    add("--no-clip", dest="max_grad_norm", action="store_const", const=None, help="no gradient clipping")
    add("--beta1", type=float, default=defaults.beta1, help="AdamW beta1")
    add("--beta2", type=float, default=defaults.beta2, help="AdamW beta2")
    add("--weight-decay", type=float, default=defaults.weight_decay, help="AdamW weight decay")
    add("--accumulate", type=int, default=defaults.accumulate, help="sequences per replica per step")
    add("--log-file", default=None, help="JSON-lines file: one object per step (appended to on --resume)")
    add("--tensorboard", default=None, help="TensorBoard log folder (needs tensorboard)")
    return parser


def main(argv: list[str] | None = None) -> int:
    rank0 = int(os.environ.get("RANK", "0")) == 0
    tokens = ends = pads = None
    try:
        options = parse_options(argv)
        config = load_config_file(options.config)
        model_config = load_model_config(config.model)
        problem = options_problem(options, model_config) or lora_problem(options, config, model_config)
        if problem is None and options.data is not None:  # the whole file checked before any rank builds a model
            data = read_token_data(options.data, model_config["vocab_size"])
            packed = packing(options, config, model_config, data)
            tokens, ends, pads = packed.tokens, packed.ends, packed.pads
            if packed.warning is not None and rank0:
                print(f"trials.train: warning: {packed.warning}", file=sys.stderr, flush=True)
            if packed.note is not None and rank0:
                print(f"trials.train: {packed.note}", file=sys.stderr, flush=True)
        elif problem is None and options.pack:
            problem = "--pack needs --data (the synthetic tokens are one document per window)"
    except (ConfigError, ValueError, OSError) as exc:  # OptionsError and DataError are ValueErrors
        problem = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if problem is not None:
        if rank0:
            print(f"trials.train: error: {problem}", file=sys.stderr, flush=True)
        return 2
    allocator.configure()  # before CUDA starts: the allocator settings the trials measured under
    try:
        train(options, tokens=tokens, ends=ends, pads=pads)
    except (checkpoint.CheckpointSaveError, DivergenceError) as exc:
        if rank0:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    import torch.distributed as dist

    if dist.is_initialized():
        # every rank done before any tears its group down: a rank that finishes first and destroys the group
        # while a peer still talks can abort ("terminate called without an active exception", after the last
        # step), failing the job
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Leave without running C++ static destructors: on multi-node runs one of them can find a thread still
    # joinable and abort the finished rank ("terminate called without an active exception" after the interpreter
    # has no Python frame left), failing a job whose steps were all done. An exception from main() still exits
    # the usual way, with its traceback.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
