"""The technique stack inside Hugging Face's ``Trainer``: two lines in your own script.

    from trials import hf
    from trials.hf_trainer import StackTrainer

    model = hf.apply(model, cfg.techniques)                        # the stack on your transformers model
    trainer = StackTrainer(model=model, args=args, train_dataset=ds)  # in place of transformers.Trainer
    trainer.train()

launched with ``accelerate launch --config_file <the accelerate export>`` (or ``accelerate launch --multi_gpu
--num_processes N``, ``torchrun --nproc-per-node N``; on CPU too, with ``TrainingArguments(use_cpu=True)``). ``cfg`` is
``trials.training.config_file.load_config_file`` of a search's ``best.json``. TRL's ``SFTTrainer``
takes the same mixin: ``class StackSFTTrainer(StackTrainerMixin, SFTTrainer): pass`` (its ``SFTConfig`` with
``dataset_kwargs={"skip_prepare_dataset": True}`` for tokenised examples, and ``SFT_ARGUMENTS``).

Where ``Trainer`` meets the stack:

- **The plugin shards; Accelerate only starts the processes.** ``trials.hf.apply`` shards with FSDP2
  (``fully_shard`` per decoder layer + root: the code autotune's memory oracle traced). The trainer marks the model
  with ``Trainer``'s own flag for a model sharded before it (``is_distributed_loading_by_transformers``), so
  ``accelerator.prepare`` neither wraps it in DDP (which Accelerate refuses for DTensors) nor shards it again. Not
  Accelerate's FSDP2 (``distributed_type: FSDP``, ``fsdp_version: 2``): it only exists where Accelerate's device is a
  GPU (``AcceleratorState`` turns FSDP on for ``MULTI_GPU``-like types, never ``MULTI_CPU``), and its own sharding
  adds units the oracle does not trace (the embedding; the final norm with the head, kept unsharded after forward).
- **Checkpoints**: ``save_steps`` writes the sharded model and optimizer as one DCP folder (``stack-state``: each
  rank its shards, resharded on load at any world size) beside ``Trainer``'s schedule, RNG and state files;
  ``resume_from_checkpoint`` loads them.
- **Every rank of a Ulysses group reads the same batch.** The training data loader is sharded over the
  data-parallel replicas (``mesh.dp_size``), not over the processes; each rank then takes its own columns.
- **The labels are shifted over the whole sequence first**, as ``transformers``' causal-LM loss does (the last
  position is ignored) and as ``trials.training.data.make_batch`` does: the token at the end of one rank's shard is
  predicted from the start of the next one.
- **Packed documents run document-masked**: a batch whose ``position_ids`` restart at 0 at each document (TRL's
  ``packing`` / ``padding_free``, examples carrying ``position_ids``) trains as the plain model on each document
  alone (``trials.hf.batch``); a ring splits each document into 2 x ring chunks, so a batch with a document whose
  length is not a multiple of 2 x ring is refused in one line.
- **The loss is the plain model's.** Each rank returns ``sum of its tokens' cross-entropy * sp / labelled tokens
  of the whole sequence`` (``trials.training.step.loss_scale``): FSDP2 averages the gradients over every rank,
  which gives the plain single-process mean loss's gradient (the mean over replicas with several), and ``Trainer``'s
  logged loss, the mean of every rank's, is the plain model's mean loss.
- The optimizer is trials' AdamW (``make_optimizer``, with ``TrainingArguments``' learning rate, betas, epsilon and
  weight decay), the gradient norm and clipping trials' (``grad_norm``, ``clip_gradients``: one collective, host
  gradients with optimizer offload), and gradient accumulation reduce-scatters every micro-batch, as the oracle
  traced (``sync_each_batch``).
- ``save_model`` writes a Hugging Face folder (``config.json`` + safetensors) that ``from_pretrained`` loads
  (``trials.training.checkpoint.export_hf``: each rank its shards, merged by rank 0).
- **LoRA**: the adapters go in before the stack shards the model, so they are ``trials.hf.apply``'s:
  ``hf.apply(model, cfg.techniques, lora=peft_config)`` (a ``peft.LoraConfig``, or ``cfg.lora``), after
  ``transformers.set_seed(args.seed)`` as TRL's ``SFTTrainer`` seeds before ``get_peft_model``, so peft draws the same
  adapters. A trainer given ``peft_config`` too (TRL's ``SFTTrainer`` argument, kept in a script) takes it as said
  when it is the model's adapters and refuses another. Only the adapters train; checkpoints hold them and their
  optimizer state (the base is the script's model again on resume), and ``save_model`` writes a peft adapter
  folder (``PeftModel.from_pretrained``), as ``SFTTrainer`` with ``peft_config`` saves.

What cannot run is refused when the trainer is made, before training, with one line naming the argument
(``StackTrainerError``, a ``ConfigError``): see ``problem``, ``world_problem`` and ``launcher_problem``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Trainer

from trials import hf
from trials.core.dist import launch_line
from trials.core.errors import ConfigError
from trials.models.model import TrainingModel
from trials.training import checkpoint, step
from trials.training.data import Batch

IGNORE_INDEX = hf.IGNORE_INDEX
STATE = "stack-state"  # a checkpoint's DCP folder of the sharded model and optimizer
SCHEDULER_FILE = "scheduler.pt"  # transformers.trainer.SCHEDULER_NAME


# What ``TrainingArguments`` must say for the stack: field -> (the value, or the values, it runs; why). The export
# writes the first value of each; ``problem`` refuses any other.
REQUIRED_ARGUMENTS = {
    "per_device_train_batch_size": (
        1,
        "the stack trains one sequence per replica per micro-batch; use gradient_accumulation_steps for more",
    ),
    "bf16": (False, "precision is the stack's (fp32 master weights, bf16 compute on CUDA); leave it off"),
    "fp16": (False, "precision is the stack's (fp32 master weights, bf16 compute on CUDA); leave it off"),
    "bf16_full_eval": (False, "precision is the stack's; leave it off"),
    "fp16_full_eval": (False, "precision is the stack's; leave it off"),
    "activation_checkpointing": (
        False,
        "the config's own activation_checkpointing checkpoints the layers; leave it off",
    ),
    "torch_compile": (False, "the stack runs eager, as the memory oracle traced it"),
    "eval_strategy": ("no", "evaluation is not supported with the stack"),
    "optim": (("adamw_torch", "adamw_torch_fused"), "the stack's optimizer is trials' AdamW (optim 'adamw_torch')"),
    "label_smoothing_factor": (0.0, "the stack's loss is plain cross-entropy"),
    "save_only_model": (False, "a checkpoint of the stack holds the sharded model with its optimizer"),
}


# What TRL's ``SFTConfig`` must say besides (checked where the arguments have the field). ``packing`` and
# ``padding_free`` run: their batches' position_ids restart at each document, and the stack masks the documents.
SFT_ARGUMENTS = {
    "activation_offloading": (False, "the config's activation_offload_layers offloads the activations"),
    "use_liger_kernel": (False, "the stack's tiles and attention are its kernels"),
}


def training_arguments(sft: bool = False) -> dict:
    """The ``TrainingArguments`` fields the stack needs (``sft``: and TRL's ``SFTConfig`` fields), as the export
    writes them."""
    fields = {**REQUIRED_ARGUMENTS, **(SFT_ARGUMENTS if sft else {})}
    return {field: value[0] if isinstance(value, tuple) else value for field, (value, _) in fields.items()}


class StackTrainerError(ConfigError):
    """A ``Trainer`` setting the stack cannot run: one line naming it."""


def problem(model, args) -> str | None:
    """Why ``Trainer`` cannot train ``model`` (what ``trials.hf.apply`` returned) with ``args`` (None: it can). One
    line, naming the argument or knob."""
    if not isinstance(model, TrainingModel) or getattr(model, "mesh", None) is None:
        return "model: pass the model trials.hf.apply (or trials.hf.from_pretrained) returned"
    mesh, techniques = model.mesh, model.techniques
    if mesh.world_size > 1 and not techniques.fsdp:
        return (
            f"fsdp: the Trainer integration shards with FSDP2 on {mesh.world_size} processes; "
            "a config with fsdp false runs with trials.train or trials.hf in your own loop"
        )
    if args is None:
        return "args: pass TrainingArguments with the fields the stack needs (trials.hf_trainer.training_arguments())"
    for field, (value, why) in {**REQUIRED_ARGUMENTS, **SFT_ARGUMENTS}.items():
        if field in SFT_ARGUMENTS and not hasattr(args, field):
            continue
        given = getattr(args, field)
        given = getattr(given, "value", given)  # an enum (eval_strategy) as its string
        if given not in ((value,) if not isinstance(value, tuple) else value):
            return f"{field} {given!r}: {why}"
    if mesh.device.type == "cpu" and not getattr(args, "use_cpu", False):
        # Accelerate then sets itself up for a GPU and prepares a loader that is not sharded per process
        return "use_cpu False: the stack's model is on the CPU (a machine without CUDA); pass TrainingArguments(use_cpu=True)"
    return world_problem(mesh, techniques, launched_processes())


def adapters_problem(model, peft_config) -> str | None:
    """Why ``peft_config`` (TRL's ``SFTTrainer`` argument) cannot go with ``model`` (None: it can): the adapters
    are ``trials.hf.apply``'s (``lora=``), put in before the stack shards the model; the trainer checks that they are
    these."""
    if peft_config is None or peft_config is getattr(model, "lora_config", None):  # the config hf.apply put in
        return None  # (peft resolves its "all-linear" to names in place)
    from trials.models.lora import LoraSpec

    try:
        wanted = LoraSpec.of(peft_config)
    except ValueError as exc:
        return str(exc)
    held = model.lora
    if not held.on:
        return (
            "peft_config: the adapters go in before the stack shards the model: pass it to "
            "trials.hf.apply(model, techniques, lora=peft_config)"
        )
    compared = ("rank", "scaling", "targets", "trainable")
    if any(getattr(wanted, name) != getattr(held, name) for name in compared):
        return f"peft_config: {wanted.describe()}, the model's adapters (trials.hf.apply's lora) are {held.describe()}"
    return None


def launched_processes() -> int:
    """The processes of this run: torch.distributed's world once it is started, else the launcher's WORLD_SIZE."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def world_problem(mesh, techniques, processes: int) -> str | None:
    """Why a model on ``mesh`` with ``techniques`` cannot train in a run of ``processes`` processes (None: it can):
    the ranks that split one sequence (ulysses_degree x ring_degree) must divide them, and the mesh must span them.
    One line with the launch that fixes it."""
    ranks = techniques.ulysses_degree * techniques.ring_degree
    if processes % ranks:
        return (
            f"processes: ulysses_degree {techniques.ulysses_degree} x ring_degree {techniques.ring_degree} splits "
            f"each sequence over {ranks} processes, this run has {processes}; launch {ranks} (or a multiple): "
            + launch_line(ranks)
        )
    if mesh.world_size != processes:
        return (
            f"processes: the model's mesh has world size {mesh.world_size}, this run {processes} processes; "
            "call trials.hf.apply without a mesh in each launched process (it joins the launch)"
        )
    return None


def launcher_problem(accelerator_state) -> str | None:
    """Why the stack cannot run under Accelerate's ``accelerator_state`` (None: it can)."""
    kind = str(getattr(accelerator_state, "distributed_type", "")).rsplit(".", 1)[-1]
    if kind in ("FSDP", "DEEPSPEED"):
        return (
            f"accelerate config: distributed_type {kind}: the stack shards the model itself; "
            "launch with the accelerate export's config (MULTI_GPU), where Accelerate only starts the processes"
        )
    return None


class StackTrainerMixin:
    """The seam between ``transformers.Trainer`` (or a subclass: TRL's ``SFTTrainer``) and a model of
    ``trials.hf.apply``; see the module's docstring."""

    def __init__(self, model=None, args=None, *positional, **kwargs):
        why = problem(model, args) or adapters_problem(model, kwargs.pop("peft_config", None))
        if why is not None:  # before the trainer prepares anything (TRL's SFTTrainer its dataset)
            raise StackTrainerError(why)
        super().__init__(model, args, *positional, **kwargs)
        if not hasattr(self, "is_distributed_loading_by_transformers"):
            raise StackTrainerError(
                "transformers: this Trainer has no is_distributed_loading_by_transformers (a model sharded before it); "
                "the integration needs a transformers that has it (5.24 has)"
            )
        why = launcher_problem(self.accelerator.state)
        if why is not None:
            raise StackTrainerError(why)
        # Trainer's own flag for a model that owns its placement and gradient reduction: Accelerate prepares it
        # without wrapping it in DDP or sharding it again
        self.is_distributed_loading_by_transformers = True
        self.model_accepts_loss_kwargs = False
        self.loss_is_scaled_for_ga = False  # one micro-batch's mean: Trainer divides it by the accumulation steps
        # FSDP2 reduce-scatters each micro-batch's gradients into the shards, as the oracle traced
        self.accelerator.gradient_state.plugin_kwargs["sync_each_batch"] = True

    @property
    def stack_mesh(self):
        return self.accelerator.unwrap_model(self.model).mesh

    def _move_model_to_device(self, model, device) -> None:
        """The stack placed the model (FSDP2 shards on the mesh's device, offloaded ones on the host)."""

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            model = self.accelerator.unwrap_model(model if model is not None else self.model)
            self.optimizer = step.make_optimizer(
                model,
                model.techniques,
                model.mesh,
                lr=self.args.learning_rate,
                betas=(self.args.adam_beta1, self.args.adam_beta2),
                eps=self.args.adam_epsilon,
                weight_decay=self.args.weight_decay,
            )
        return self.optimizer

    def get_train_dataloader(self):
        """Trainer's loader, sharded over the data-parallel replicas: the ranks of a Ulysses group read one batch."""
        loader = super().get_train_dataloader()
        mesh = self.stack_mesh
        shard = getattr(loader, "batch_sampler", None)
        if not hasattr(shard, "process_index"):  # an iterable dataset: its shard is the dataset
            shard = getattr(loader, "dataset", None)
        if mesh.world_size > 1:
            if not hasattr(shard, "process_index"):
                raise StackTrainerError("train_dataset: the loader Accelerate prepared has no per-process shard")
            shard.num_processes, shard.process_index = mesh.dp_size, mesh.dp_rank
        return loader

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mesh = self.stack_mesh
        batch = stack_batch(inputs, mesh)
        scale = step.loss_scale(batch, mesh)
        loss = model(batch.input_ids, batch.position_ids, batch.labels, scale=scale, documents=batch.documents)
        return (loss, {"loss": loss}) if return_outputs else loss

    def _clip_grad_norm(self, model):
        norm = step.grad_norm(model, self.stack_mesh)
        step.clip_gradients(model, norm, self.args.max_grad_norm)
        return norm

    def _get_grad_norm(self, model, grad_norm=None):
        return float(grad_norm if grad_norm is not None else step.grad_norm(model, self.stack_mesh))

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """A Hugging Face folder ``from_pretrained`` loads. A checkpoint's model is written with its optimizer
        (``_save_optimizer_and_scheduler``)."""
        if _internal_call:
            return
        model = self.accelerator.unwrap_model(self.model)
        folder = Path(output_dir or self.args.output_dir)
        if model.lora.on:
            checkpoint.export_adapters(model, folder, model.mesh.device, model.config.name_or_path or None)
        else:
            checkpoint.export_hf(model, model.config, folder, model.mesh.device)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The sharded model and optimizer as one DCP folder (each rank its shards; resharded on load at any world
        size), and the schedule's state."""
        checkpoint.save_model_and_optimizer(Path(output_dir, STATE), self.model, self.optimizer)
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), Path(output_dir, SCHEDULER_FILE))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """The model is loaded with its optimizer, once that exists (``_load_optimizer_and_scheduler``)."""

    def _load_optimizer_and_scheduler(self, checkpoint_folder: str | None) -> None:
        if checkpoint_folder is None:
            return
        if not Path(checkpoint_folder, STATE).is_dir():
            raise StackTrainerError(f"resume_from_checkpoint: {checkpoint_folder} has no {STATE} (the stack's state)")
        checkpoint.load_model_and_optimizer(Path(checkpoint_folder, STATE), self.model, self.optimizer)
        self.lr_scheduler.load_state_dict(torch.load(Path(checkpoint_folder, SCHEDULER_FILE), weights_only=True))


class StackTrainer(StackTrainerMixin, Trainer):
    """``transformers.Trainer`` for a model of ``trials.hf.apply``."""


def stack_batch(inputs: dict, mesh) -> Batch:
    """``trials.hf.batch`` of Trainer's batch: this rank's shard of the shifted sequence, with its packed documents
    (``position_ids`` that restart at 0 at each document: ``DataCollatorWithFlattening``, TRL's ``packing`` /
    ``padding_free``). What it cannot take is refused in one line naming the key."""
    try:
        return hf.batch(inputs, mesh)
    except ValueError as exc:
        raise StackTrainerError(str(exc)) from None
