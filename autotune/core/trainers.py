"""What each trainer runs, declared once per trainer (``Trainer.expresses``): the search space of ``autotune search
--trainer T`` (``autotune.search.space``), the export to that trainer and the re-estimate of what it runs
(``autotune.outputs.exporters``) all read this one declaration.

A ``Trainer`` says, for every knob of ``trials.stack.techniques.Techniques`` (each exactly once, checked when it is
declared), how the trainer is told (``Expression.how``) and which value it then runs for the value asked
(``Expression.runs``; ``not_expressed``: it has no such technique and runs the knob's default). Everything else
derives from that: the techniques the trainer runs (``Trainer.runs``), where they differ from a config
(``Trainer.gaps``) and whether a config is expressed in full (``Trainer.expresses_in_full``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from trials.kernels.documents import ONE, DocumentsSpec
from trials.kernels.registry import FLASH_KERNELS, KERNELS
from trials.models.config import parameter_count
from trials.models.lora import FULL_TRAINING, LoraSpec
from trials.stack.knobs import Knob
from trials.stack.rules import ring_document_unit
from trials.stack.techniques import Techniques, knobs


@dataclass(frozen=True)
class ExportJob:
    """One front config as a trainer would run it: the model, the node's GPU count, the length, the techniques,
    the documents packed into each sequence (``--documents``)."""

    model: str
    model_config: dict
    gpus: int
    seq_len: int
    techniques: Techniques
    nodes: int = 1  # nodes of ``gpus`` each
    documents: DocumentsSpec = ONE
    lora: LoraSpec = FULL_TRAINING  # the adapters trained on the frozen model (``--lora-rank``)

    @property
    def layers(self) -> int:
        return self.model_config["num_hidden_layers"]

    @property
    def hidden_size(self) -> int:
        return self.model_config["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.model_config["vocab_size"]

    @property
    def local_tokens(self) -> int:
        """Tokens per rank: Ulysses and the ring split the sequence over their degrees."""
        return self.seq_len // (self.techniques.ulysses_degree * self.techniques.ring_degree)


def _as_asked(value, job: ExportJob):
    return value


@dataclass(frozen=True)
class Expression:
    """How a format writes one knob (``how``: the trainer's keys or calls, in its words) and which value the
    trainer runs when the config asks for ``value`` (``runs(value, job)``; default: the value itself)."""

    how: str
    runs: Callable[[Any, ExportJob], Any] = _as_asked
    off: bool = False  # the trainer has no such technique: it runs the knob's default, whatever is asked

    @property
    def as_asked(self) -> bool:
        """The trainer runs exactly the value asked."""
        return not self.off and self.runs is _as_asked


def exactly(how: str) -> Expression:
    """The trainer runs the value asked."""
    return Expression(how)


def runs_as(how: str, runs: Callable[[Any, ExportJob], Any]) -> Expression:
    """The trainer runs its own value (``runs``) for the value asked."""
    return Expression(how, runs)


def not_expressed(why: str) -> Expression:
    """The trainer has no such technique: it runs the knob off (its default), whatever the config asks."""
    return Expression(f"not expressible: {why}", off=True)


def memory_rank(knob: Knob, value) -> float:
    """Orders a knob's values by the memory they save (larger = saves more), from the knob's ``less_memory``."""
    if knob.less_memory == "on":
        return 1.0 if value else 0.0
    if knob.less_memory == "larger":
        return float(value or 0)
    if knob.less_memory == "smaller":  # a tile or a chunk: off counts as the largest
        return -math.inf if knob.is_off(value) else -float(value)
    raise ValueError(f"{knob.name} has no memory order")


@dataclass(frozen=True)
class Gap:
    """A knob whose value the trainer runs differs from the one the config asks for."""

    knob: Knob
    asked: Any
    runs: Any
    how: str

    @property
    def needs_more_memory(self) -> bool:
        """The trainer does less of a memory-saving technique than asked (or the knob has no memory order, so
        it cannot be told): the config's length is no longer guaranteed, only a re-estimate can say."""
        if self.knob.less_memory is None:
            return True
        return memory_rank(self.knob, self.runs) < memory_rank(self.knob, self.asked)

    def line(self, trainer: str) -> str:
        kind = "will not do" if self.needs_more_memory else "does its own way (never more device memory)"
        return f"{self.knob.name}: asked {_word(self.asked)}, {trainer} runs {_word(self.runs)} -- {kind}; {self.how}"


def _word(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


# DeepSpeed ZeRO-3's buffers beside the shards, at its documented defaults (the exported JSON leaves them so)
ZERO3_BUFFER_ELEMENTS = {
    "reduce_bucket_size": 5e8,
    "stage3_prefetch_bucket_size": 5e7,
    "stage3_max_live_parameters": 1e9,
}


@dataclass(frozen=True)
class Trainer:
    """One trainer a search can be for and an export can go to (see the module docstring)."""

    name: str  # the ``--trainer`` word
    words: str  # the trainer, in words ("ArcticTraining 0.8")
    expresses: Mapping[str, Expression]
    sharding: str = "fsdp2"  # how ``fsdp`` shards: ``fsdp2`` (what the oracle traces) or ``zero3`` (DeepSpeed)
    # how the trainer is told packed documents' boundaries so that attention stays inside each document, and with
    # which attention kernels (None: any); ``packing`` None: it cannot mask documents
    packing: str | None = None
    packing_kernels: tuple[str, ...] | None = None
    # whether it pads each packed document up to a multiple of a ring's 2 x ring_degree chunks
    # (``trials.stack.rules.ring_document_unit``); where it does not, a ring runs only documents that already are
    pads_ring_documents: bool = False
    # how the trainer is told LoRA adapters (``--lora-rank``) and trains them with every knob it runs, peft's LoRA
    # layers on the frozen base as the oracle traces them; None: it trains every weight only (searched and exported
    # for full training alone)
    lora: str | None = None

    def __post_init__(self):
        declared, every = set(self.expresses), {k.name for k in knobs()}
        if declared != every:
            missing, unknown = sorted(every - declared), sorted(declared - every)
            raise TypeError(
                f"trainer {self.name!r} must declare every knob exactly once (missing {missing}, unknown {unknown})"
            )

    def runs(self, job: ExportJob) -> Techniques:
        """The techniques the trainer runs when handed ``job``'s config."""
        values = {}
        for knob in knobs():
            expression = self.expresses[knob.name]
            asked = getattr(job.techniques, knob.name)
            values[knob.name] = knob.default if expression.off else expression.runs(asked, job)
        return Techniques(**values)

    def gaps(self, job: ExportJob) -> list[Gap]:
        """Every knob the trainer runs differently from ``job``'s config."""
        runs = self.runs(job)
        return [
            Gap(knob, getattr(job.techniques, knob.name), getattr(runs, knob.name), self.expresses[knob.name].how)
            for knob in knobs()
            if getattr(runs, knob.name) != getattr(job.techniques, knob.name)
        ]

    def expresses_in_full(self, job: ExportJob) -> bool:
        """The trainer runs everything the config asks for, or differs only where that never needs more device
        memory (the re-estimate still checks the host memory, which offloading more layers takes)."""
        return not any(gap.needs_more_memory for gap in self.gaps(job))

    def held_bytes(self, techniques: Techniques, model_config: dict) -> int:
        """Device bytes per rank this trainer holds when it runs ``techniques`` on the model beside the tensors the
        oracle traces: DeepSpeed's ZeRO-3 keeps buffers of its own beside the shards that FSDP2 does not, each up to
        its size in the exported JSON (DeepSpeed's defaults) and never more than the model's parameters (they hold
        gradients or parameters), in bf16. Predictions for the trainer count them against capacity
        (``Hardware.holding``)."""
        if self.sharding != "zero3" or not techniques.fsdp:
            return 0
        parameters = parameter_count(model_config)
        return int(sum(min(elements, parameters) for elements in ZERO3_BUFFER_ELEMENTS.values()) * 2)

    def prediction_note(self, techniques: Techniques, model_config: dict) -> str | None:
        """What a prediction for ``techniques`` holds that the oracle's trace does not show when this trainer runs
        them (one line), or None: ZeRO-3's buffers (``held_bytes``)."""
        held = self.held_bytes(techniques, model_config)
        if not held:
            return None
        sizes = ", ".join(f"{key} {elements:.0e}" for key, elements in ZERO3_BUFFER_ELEMENTS.items())
        return (
            f"the prediction shards as FSDP2 does; {self.words}'s ZeRO-3 also keeps its own buffers ({sizes} "
            f"elements): up to {held / 2**30:.1f} GiB more per rank in bf16, counted in the predicted peak"
        )

    def masks_documents(self, attention: str) -> bool:
        """Whether the trainer keeps attention inside each packed document when it runs ``attention`` (a
        ``trials.kernels`` name): it has a way to be told the boundaries (``packing``) that this kernel honours."""
        return self.packing is not None and (self.packing_kernels is None or attention in self.packing_kernels)

    def documents_run(self, documents: DocumentsSpec, attention: str) -> DocumentsSpec:
        """The documents the trainer's attention runs for packed ``documents``: those documents where it masks
        them, else one document per sequence (it attends across their boundaries, over each whole window)."""
        return documents if self.masks_documents(attention) else ONE

    def packing_note(self, documents: DocumentsSpec, attention: str) -> str | None:
        """The export's line on packed ``documents`` (None when one document per sequence): how this trainer is
        told their boundaries, or that it attends across them (then the export re-estimates the config with
        attention over each whole window, ``documents_run``)."""
        if documents.one:
            return None
        if self.masks_documents(attention):
            return f"packed documents ({documents.describe()}): {self.packing}"
        kernels = f" with attention {attention!r}" if self.packing is not None else ""
        return (
            f"PACKED DOCUMENTS NOT MASKED: {self.words}{kernels} attends across the boundaries of the packed "
            f"documents ({documents.describe()}): it runs attention over each whole window, as --documents one "
            "prices it"
        )

    def ring_padding_note(self, documents: DocumentsSpec, techniques: Techniques) -> str | None:
        """The line on packed ``documents`` whose lengths ``techniques``' ring does not divide into its chunks
        (None where it does): this trainer pads them, as the prediction prices them, or it refuses them."""
        unit = ring_document_unit(techniques.ring_degree)
        share = documents.pad_share(unit)
        if not share:
            return None
        if self.pads_ring_documents:
            return (
                f"ring_degree {techniques.ring_degree} runs each packed document padded to a multiple of {unit} tokens "
                f"({share:.2%} of the tokens are pads), as the prediction prices them"
            )
        return (
            f"ring_degree {techniques.ring_degree} needs each packed document a multiple of {unit} tokens, and "
            f"{self.words} takes them as its batches carry them: pad each in the data ({share:.2%} of the tokens "
            "would be pads), or a batch with one that is not is refused"
        )

    def cannot_run(self) -> list[str]:
        """The knobs this trainer has no technique for (it runs them at their default)."""
        return [k.name for k in knobs() if self.expresses[k.name].off]


def _as_all_or_none(layers, job: ExportJob) -> int:
    """Every checkpointed layer's input offloaded, or none."""
    return job.layers if layers else 0


def _hidden_size_if_on(tile, job: ExportJob) -> int:
    """MLP tiles of the model's hidden size, or no tiling."""
    return job.hidden_size if tile else 0


def stand_in_kernel(asked: str, takes: Callable[[str], bool]) -> str:
    """The attention kernel a trainer runs in place of ``asked`` when it cannot run that one: the first
    flash-attn kernel it takes (``takes(name)``) that runs on every GPU generation ``asked`` runs on
    (``trials.kernels.registry``), else SDPA, which runs everywhere."""
    generations = KERNELS[asked].compute_capabilities
    for name in FLASH_KERNELS:
        if name != asked and takes(name) and generations and all(KERNELS[name].runs_on(g) for g in generations):
            return name
    return "sdpa"


# Accelerate's DeepSpeed sequence parallelism: the ``sp_attn_implementation`` values it takes
# (``DeepSpeedSequenceParallelConfig.__post_init__``, accelerate 1.12-1.15; besides hub kernels)
ACCELERATE_SP_ATTENTION = ("flash_attention_2", "flash_attention_3", "sdpa")


def _accelerate_sp_kernel(asked: str, job: ExportJob) -> str:
    """The kernel Accelerate runs: the asked one, except under its sequence parallelism where
    ``sp_attn_implementation`` does not take that kernel's transformers name (FlashAttention-4): then
    ``stand_in_kernel``."""
    if job.techniques.ulysses_degree == 1 or KERNELS[asked].hf_implementation in ACCELERATE_SP_ATTENTION:
        return asked
    return stand_in_kernel(asked, lambda name: KERNELS[name].hf_implementation in ACCELERATE_SP_ATTENTION)


_LOSS_TILE_LOGIT_BYTES = 2**30  # ArcticTraining sizes a loss tile to about 1 GiB of fp32 logits


def arctic_loss_tile_tokens(asked: int, job: ExportJob) -> int:
    """The loss tile ArcticTraining runs: with Ulysses, ``ceil(tokens per rank x vocab x 4 B / 1 GiB)`` tiles
    (as many tokens each as autotune's tiled loss then takes); without it, the model's own untiled loss."""
    if job.techniques.ulysses_degree == 1:
        return 0
    tiles = math.ceil(job.local_tokens * job.vocab_size * 4 / _LOSS_TILE_LOGIT_BYTES)
    return math.ceil(job.local_tokens / tiles)


AUTOTUNE = Trainer(
    "autotune",
    "autotune's own runner (trials)",
    {k.name: exactly(f"techniques.{k.name} of the config") for k in knobs()},
    packing="the config file's documents; the stack masks the documents a batch carries (Batch.documents: "
    "position ids restart at each, attention stays inside each)",
    pads_ring_documents=True,  # trials.training.data.pad_documents
    lora="the config file's lora: trials.train freezes the --init weights, draws the adapters by --seed, checkpoints "
    "them with their optimizer state, and --export-hf writes them as a peft folder (--export-merged: merged)",
)

DEEPSPEED = Trainer(
    "deepspeed",
    "DeepSpeed",
    {
        "fsdp": exactly("zero_optimization.stage: 3 (0 without)"),
        "optimizer_offload": exactly("zero_optimization.offload_optimizer and offload_param on the cpu"),
        "ulysses_degree": exactly(
            "sequence_parallel_size; UlyssesSPAttentionHF and UlyssesSPDataLoaderAdapter in .alst.py"
        ),
        "ring_degree": not_expressed("DeepSpeed has no ring attention"),
        "head_chunk": not_expressed("DeepSpeed's Ulysses attention runs all local heads at once"),
        "activation_checkpointing": exactly("model.gradient_checkpointing_enable() in .alst.py"),
        "activation_offload_layers": exactly("CheckpointHiddenStatesOffload(keep_last_count = layers - N) in .alst.py"),
        "mlp_tile_tokens": exactly("TiledMLP over ceil(tokens per rank / tile) tiles in .alst.py"),
        "loss_tile_tokens": exactly("TiledFusedLogitsLoss over ceil(tokens per rank / tile) tiles in .alst.py"),
        "norm_tile_tokens": not_expressed("DeepSpeed has no tiled RMSNorm"),
        "attention": exactly(
            "core_attn_implementation / attn_implementation in .alst.py: the kernel's transformers name "
            "(flash_attention_2 | flash_attention_3 | flash_attention_4 | sdpa; DeepSpeed's Ulysses takes any "
            "attention transformers registers but eager; flash_attention_4 needs transformers >= 5)"
        ),
    },
    sharding="zero3",
    packing="position_ids that restart at each document, labels that never cross one (.alst.py's packed_windows "
    "packs your documents into windows with transformers' DataCollatorWithFlattening; UlyssesSPDataLoaderAdapter "
    "shards them); transformers' flash_attention_2 derives cu_seqlens from them",
    packing_kernels=("flash",),
)

ARCTIC = Trainer(
    "arctic",
    "ArcticTraining",
    {
        "fsdp": exactly("deepspeed.zero_optimization.stage: 3 (0 without)"),
        "optimizer_offload": exactly(
            "deepspeed.zero_optimization.offload_optimizer and offload_param on the cpu, optimizer.type: cpu_adam"
        ),
        "ulysses_degree": exactly("sequence_parallel_size"),
        "ring_degree": not_expressed("ArcticTraining has no ring attention"),
        "head_chunk": not_expressed("ArcticTraining runs plain Ulysses attention (no head chunking)"),
        "activation_checkpointing": exactly("on by default; model.disable_activation_checkpoint: true turns it off"),
        "activation_offload_layers": runs_as(
            "activation_checkpoint_cpu_offload: every checkpointed layer input or none",
            _as_all_or_none,
        ),
        "mlp_tile_tokens": runs_as("tiled_mlp_compute: true tiles at the model's hidden size", _hidden_size_if_on),
        "loss_tile_tokens": runs_as(
            "tiled logits + loss are automatic with sequence_parallel_size > 1 (~1 GiB of fp32 logits per tile), "
            "absent without",
            arctic_loss_tile_tokens,
        ),
        "norm_tile_tokens": not_expressed("ArcticTraining has no tiled RMSNorm"),
        "attention": exactly(
            "model.attn_implementation: flash_attention_2 | flash_attention_3 | flash_attention_4 | sdpa (its config "
            "check imports flash_attn for flash_attention_2 and _3)"
        ),
    },
    sharding="zero3",
    # arctic_training/data/causal_factory.py (0.8): slice_and_pack_causal_batch packs, it has no key to turn it off
    packing="type causal packs each text row of data.sources (a document) into max_length windows with "
    "position_ids restarting at each; transformers' flash_attention_2 derives cu_seqlens from them (its labels "
    "still cross the boundaries: each document's first token is a label of the one before)",
    packing_kernels=("flash",),
)

ACCELERATE = Trainer(
    "accelerate",
    "Accelerate + trials.hf",
    {
        k.name: exactly(
            f"techniques.{k.name}, applied by the plugin trials.hf (from_pretrained) in the export's .train.py "
            "and .trainer.py (transformers' Trainer with trials.hf_trainer)"
        )
        for k in knobs()
    },
    packing="position_ids that restart at 0 at each document (trials.hf.batch derives the documents from them; "
    "the .trainer.py's --sft --packing: TRL's SFTTrainer(packing=True))",
    lora="the config's lora: trials.hf.from_pretrained(..., lora=config.lora) in .train.py and .trainer.py puts "
    "peft's LoRA layers in before the stack, the base frozen; the .trainer.py's save_model writes a peft adapter folder",
)

ACCELERATE_DEEPSPEED = Trainer(
    "accelerate-deepspeed",
    "Accelerate/Trainer with DeepSpeed",
    {
        "fsdp": exactly("zero_optimization.stage: 3 (0 without) in the DeepSpeed JSON"),
        "optimizer_offload": exactly(
            "zero_optimization.offload_optimizer and offload_param on the cpu in the DeepSpeed JSON"
        ),
        "ulysses_degree": exactly("parallelism_config_sp_size with sp_backend deepspeed"),
        "ring_degree": not_expressed(
            "Accelerate refuses cp_size > 1 beside sp_size > 1, and its cp_size is torch's context parallel, not "
            "this ring"
        ),
        "head_chunk": not_expressed("DeepSpeed's Ulysses attention runs all local heads at once"),
        "activation_checkpointing": exactly(
            "TrainingArguments(activation_checkpointing=True) or model.activation_checkpointing_enable()"
        ),
        "activation_offload_layers": runs_as(
            "activation_checkpointing_kwargs={'offload': True}: every checkpointed layer input or none, copied "
            "synchronously (slower than autotune's overlapped offload)",
            _as_all_or_none,
        ),
        "mlp_tile_tokens": not_expressed("Accelerate and the Trainer have no tiled MLP"),
        "loss_tile_tokens": not_expressed("the Trainer computes the model's own untiled loss"),
        "norm_tile_tokens": not_expressed("no tiled RMSNorm outside autotune"),
        "attention": runs_as(
            "parallelism_config_sp_attn_implementation and the model's attn_implementation: the kernel's "
            "transformers name; with sp_size > 1 Accelerate takes flash_attention_2 | flash_attention_3 | sdpa only "
            "(not flash_attention_4: SDPA runs instead)",
            _accelerate_sp_kernel,
        ),
    },
    sharding="zero3",
)

TRAINERS: dict[str, Trainer] = {t.name: t for t in (AUTOTUNE, DEEPSPEED, ARCTIC, ACCELERATE, ACCELERATE_DEEPSPEED)}


def trainer_named(name: str) -> Trainer:
    """The trainer ``--trainer NAME`` means; an unknown name is bad input (one line)."""
    from autotune.core.errors import UserError

    if name not in TRAINERS:
        raise UserError(f"--trainer {name!r} must be one of {', '.join(TRAINERS)}")
    return TRAINERS[name]
