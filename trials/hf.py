"""The technique stack as a plugin for Hugging Face training: any ``Techniques`` on a ``transformers`` causal LM, in
your own loop.

    import torch
    from trials import hf
    from trials.training.config_file import load_config_file
    from trials.training.data import mesh_batch
    from trials.training.step import make_optimizer, train_step

    cfg = load_config_file("best.json")                            # what autotune found
    model = hf.from_pretrained("path/to/hf-model", cfg.techniques)  # joins the torchrun / accelerate job
    mesh = model.mesh
    optimizer = make_optimizer(model, cfg.techniques, mesh, lr=3e-5)
    for tokens in my_token_windows(cfg.seq_len + 1, replica=mesh.dp_rank):  # one [seq_len + 1] LongTensor
        batch = mesh_batch(tokens, mesh)  # this rank's sequence shard (its zigzag columns with a ring)
        result = train_step(model, optimizer, batch, mesh)        # forward, backward, reduce, step
        print(result.loss)

A Hugging Face batch (a collator's ``input_ids``, unshifted ``labels``, and ``position_ids``) goes in as it is:
``batch = hf.batch(collator(examples), mesh)``. Packed documents are ``position_ids`` that restart at 0 at each
document (``transformers``' ``DataCollatorWithFlattening``, TRL's ``padding_free``): ``batch`` derives the
``Documents`` from them on the host, once per batch, and attention stays inside each document (exact: the loss and
gradients of the plain model run on each document alone). ``mesh_batch(tokens, mesh, documents=Documents(lengths))``
takes them as lengths.

Two entry points, both returning a ``trials.models.model.TrainingModel`` (its forward returns this rank's scaled loss;
``trials.training.step`` scales, reduces and steps so that every rank trains the plain single-process model's loss and
gradients) with ``.mesh`` set:

- ``apply(model, techniques, mesh=None)``: a model you already hold (``AutoModelForCausalLM.from_pretrained``).
  Its attention is switched to ``attn_implementation="autotune"`` (``trials.kernels.attention``), then
  ``trials.stack.apply`` adds the techniques. With ``fsdp`` the whole model exists on every rank before it is
  sharded.
- ``from_pretrained(path, techniques, mesh=None)``: a model folder (``config.json`` + safetensors) built the way
  trials build theirs, on ``meta``, stacked, materialised (each rank allocates only its own FSDP2 shards), and then
  each rank reads only its shards' rows of each tensor from the safetensors files. No rank ever holds the whole
  model; this is the path whose memory ``autotune estimate`` predicts.

LoRA: ``lora=`` (a config's ``cfg.lora``, or the ``peft.LoraConfig`` a TRL script passes as ``peft_config``) puts
peft's adapters in before the stack, every other weight frozen (``trials.models.lora``): ``apply`` lets peft draw
them, as ``get_peft_model`` does; ``from_pretrained`` draws them by ``seed`` (A ~ N(0, 1/rank), B zero), each rank
its shards' rows, and reads the base weights under their plain names.

Without ``mesh`` both join the torchrun / accelerate job (``trials.core.dist.init_mesh``); ``timeout_s`` is then its
collectives' timeout (default torch's 600 s), which must exceed the longest step or the NCCL watchdog aborts the run:
``timeout_s=collective_timeout_s(step_time_s)`` (``trials.core.dist``), as trials and the exported scripts pass it.

Precision is trials': fp32 master weights, compute in ``compute_dtype`` (None = bf16 on CUDA, fp32 on CPU;
``trials.models.model.set_compute_dtype``).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from trials import stack
from trials.core.dist import MIN_COLLECTIVE_TIMEOUT_S, Mesh, init_mesh
from trials.core.memory import active_tracker
from trials.kernels import attention
from trials.kernels.documents import Documents
from trials.models import moe
from trials.models.lora import FULL_TRAINING, LoraSpec, adapter_role, apply_lora
from trials.models.model import (
    TrainingModel,
    _canonical,
    _local_rows,
    default_compute_dtype,
    init_weights,
    materialize,
    set_compute_dtype,
)
from trials.stack import rules
from trials.stack.techniques import Techniques
from trials.training.data import Batch, rank_columns

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
if TYPE_CHECKING:
    from peft import LoraConfig

IGNORE_INDEX = -100  # transformers' and trials' label that no loss is taken for


def apply(
    model,
    techniques: Techniques,
    mesh: Mesh | None = None,
    compute_dtype: torch.dtype | None = None,
    timeout_s: float = MIN_COLLECTIVE_TIMEOUT_S,
    lora: LoraSpec | LoraConfig = FULL_TRAINING,
) -> TrainingModel:
    """Apply ``techniques`` to a ``transformers`` causal LM (``PreTrainedModel``) in place; returns the
    ``TrainingModel`` that wraps it, with ``.mesh``. ``mesh``: default ``trials.core.dist.init_mesh`` of the Ulysses and
    ring degrees, its collectives' timeout ``timeout_s`` (above the longest step:
    ``trials.core.dist.collective_timeout_s`` of the step time). ``lora``: LoRA adapters to train on the frozen model
    (a ``LoraSpec``, a config's ``cfg.lora``, or the ``peft.LoraConfig`` a TRL script passes as ``peft_config``), put
    in by peft before the stack, peft drawing their initial values as ``get_peft_model`` does."""
    mesh = mesh or init_mesh(techniques.ulysses_degree, timeout_s=timeout_s, ring_degree=techniques.ring_degree)
    attention.register()
    model.config.use_cache = False
    model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    if moe.experts_options(model.config):
        model.set_experts_implementation(moe.EXPERTS_IMPLEMENTATION)
    training = apply_lora(TrainingModel(model), lora)
    if not techniques.fsdp:  # FSDP2 moves the shards to the mesh's device itself
        training.to(mesh.device)
    return _stacked(training, techniques, mesh, compute_dtype, build=None)


def from_pretrained(
    path: str | Path,
    techniques: Techniques,
    mesh: Mesh | None = None,
    compute_dtype: torch.dtype | None = None,
    load_weights: bool = True,
    timeout_s: float = MIN_COLLECTIVE_TIMEOUT_S,
    lora: LoraSpec | LoraConfig = FULL_TRAINING,
    seed: int = 0,
) -> TrainingModel:
    """Build the model of ``path`` (a folder with ``config.json`` and ``model.safetensors`` or a sharded
    ``model.safetensors.index.json``) with ``techniques`` applied, each rank holding and reading only its shards.
    ``load_weights=False``: the parameters' storage is left unset, for values that come from elsewhere (a training
    checkpoint). ``mesh``: as ``apply``'s, ``timeout_s`` its collectives' timeout when this call starts it.
    ``lora``: as ``apply``'s; the base weights are the folder's, the adapters drawn by ``seed`` (``init_weights``:
    a rank draws its shards' rows only)."""
    mesh = mesh or init_mesh(techniques.ulysses_degree, timeout_s=timeout_s, ring_degree=techniques.ring_degree)
    model = apply_lora(TrainingModel(_meta_model(path)), lora)
    return _stacked(model, techniques, mesh, compute_dtype, build=Path(path), load=load_weights, seed=seed)


def _meta_model(path: str | Path):
    """The ``transformers`` model of the folder's ``config.json``, on the meta device, with trials' attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    attention.register()
    config = AutoConfig.from_pretrained(path)
    config.use_cache = False
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config,
            attn_implementation=attention.ATTN_IMPLEMENTATION,
            dtype=torch.float32,
            **moe.experts_options(config),
        )


def pretrained_problem(folder: str | Path, model_config: dict) -> str | None:
    """Why the pretrained folder cannot start a run tuned for ``model_config`` (None: it can), read from its
    ``config.json`` and the safetensors headers only: not a model folder, another architecture or shape than the
    tuned model's, or a checkpoint whose tensors (names, shapes) are not the model's parameters."""
    from trials.core.errors import ConfigError
    from trials.models.config import layer_windows, load_model_config
    from trials.models.model import build_model

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        return f"{folder} is not a Hugging Face model folder (no config.json)"
    try:
        own = load_model_config(str(folder / "config.json"))
    except ConfigError as exc:
        return str(exc)
    if own["model_type"] != model_config["model_type"]:
        return f"{folder} holds a {own['model_type']} model; the config was tuned for {model_config['model_type']}"
    tuned = _shapes(build_model(model_config, device="meta"))
    given = _shapes(build_model(own, device="meta"))
    differs = sorted(set(tuned.items()) ^ set(given.items()))
    if differs:
        name = differs[0][0]
        return (
            f"{folder} is not the model the config was tuned for ({model_config.get('_name')}): {name} is "
            f"{given.get(name, 'absent')} there, {tuned.get(name, 'absent')} in the tuned model"
        )
    if layer_windows(own) != layer_windows(model_config):
        return f"{folder}'s sliding windows differ from the tuned model's"
    try:
        files = checkpoint_files(folder)
    except FileNotFoundError as exc:
        return str(exc)
    return _stored_problem(folder, files, _meta_model(folder))  # the model the loader builds, as it names tensors


def _shapes(model) -> dict[str, tuple]:
    return {_canonical(n).removeprefix("lm."): tuple(p.shape) for n, p in model.named_parameters()}


def _stored_problem(folder: Path, files: dict, lm) -> str | None:
    """Whether every parameter of ``lm`` is stored with its shape (names and shapes from the headers)."""
    from safetensors import safe_open

    shapes = {}
    for file in set(files.values()):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                shapes[key] = tuple(handle.get_slice(key).get_shape())
    layout = _CheckpointLayout(lm.config.model_type, files)
    for name, param in lm.named_parameters(remove_duplicate=True):
        key = layout.renamed(name)
        if key in shapes:
            if shapes[key] != tuple(param.shape):
                return f"{folder}: {key} is stored as {list(shapes[key])}, the model's is {list(param.shape)}"
        elif not any(name.endswith(t.strip(".")) for rule in layout.merges for t in rule.target_patterns):
            return f"{folder}: the checkpoint has no tensor {key!r}"
    return None


def _stacked(
    model: TrainingModel, techniques, mesh, compute_dtype, build: Path | None, load: bool = True, seed: int = 0
) -> TrainingModel:
    """``trials.stack.apply`` with trials' precision; a meta model (``build``: its folder) is then materialised
    and (``load``) loaded, its LoRA adapters drawn by ``seed``."""
    compute_dtype = compute_dtype or default_compute_dtype(mesh.device)
    stack.apply(model, techniques, mesh, param_dtype=None if compute_dtype == torch.float32 else compute_dtype)
    if build is not None:
        materialize(model, mesh.device, params_device="cpu" if techniques.optimizer_offload else None, init=False)
        if load:
            load_safetensors(model, build)
            init_weights(model, seed, adapters_only=True)
    set_compute_dtype(model, compute_dtype)
    tracker = active_tracker()
    if tracker is not None:
        tracker.retag(model.parameters(), "params")
    model.mesh = mesh
    model.techniques = techniques  # what trials.hf_trainer reads (the optimizer, what Trainer cannot run)
    return model


class _CheckpointLayout:
    """Where a parameter's values sit in a checkpoint ``transformers`` saved: under its own name, a renamed one
    (Mixtral's ``block_sparse_moe``), or, for MoE experts stored one tensor per expert (gate and up apart), merged
    from those. Read from ``transformers``' own conversion mapping of the model type (what its loader applies)."""

    def __init__(self, model_type: str, files: dict):
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping

        self.files = files
        self.renamings, self.merges = [], []
        for rule in get_checkpoint_conversion_mapping(model_type) or []:
            kind = type(rule).__name__
            if kind == "WeightRenaming":
                self.renamings += list(zip(rule.target_patterns, rule.source_patterns))
            elif kind == "WeightConverter":
                self.merges.append(rule)

    def renamed(self, key: str) -> str:
        """``key`` as the checkpoint names it (the model's name when the checkpoint has it)."""
        if key in self.files:
            return key
        for target, source in self.renamings:
            if target in key and key.replace(target, source, 1) in self.files:
                return key.replace(target, source, 1)
        return key

    def merged(self, key: str, experts: range, stored_slice, folder) -> torch.Tensor:
        """The rows of ``experts`` of the merged parameter ``key`` ([E, ...]): per expert, its source tensors
        (one per source pattern, ``*`` = the expert) concatenated along their first dimension."""
        for rule in self.merges:
            ops = [type(op).__name__ for op in rule.operations]
            target = next((t for t in rule.target_patterns if key.endswith(t.strip("."))), None)
            if target is None:
                continue
            if ops not in (["MergeModulelist"], ["MergeModulelist", "Concatenate"]):
                raise KeyError(f"{folder}: {key} is stored through {ops}, which trials.hf cannot read by shard")
            prefix = key[: len(key) - len(target.strip("."))]
            per_expert = []
            for expert in experts:
                parts = []
                for pattern in rule.source_patterns:
                    source = self.renamed(prefix + pattern.strip(".").replace("*", str(expert)))
                    if source not in self.files:
                        raise KeyError(f"{folder}: the checkpoint has no tensor {source!r} (for {key})")
                    parts.append(stored_slice(source)[:])
                per_expert.append(torch.cat(parts, dim=0))
            return torch.stack(per_expert)
        raise KeyError(f"{folder}: the checkpoint has no tensor {key!r}")


def checkpoint_files(folder: Path) -> dict[str, Path]:
    """Every tensor name of the folder's safetensors checkpoint -> the file holding it."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        return {name: folder / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    single = folder / SAFETENSORS_FILE
    if not single.is_file():
        raise FileNotFoundError(f"{folder}: no {SAFETENSORS_FILE} or {SAFETENSORS_INDEX} (safetensors weights)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as handle:
        return dict.fromkeys(handle.keys(), single)


@torch.no_grad()
def load_safetensors(model: TrainingModel, folder: Path) -> None:
    """Copy the checkpoint's values into the model's parameters: for an FSDP2 shard only its rows are read (a
    safetensors slice), on the host, then copied into the shard. Every parameter but LoRA adapters must be in the
    checkpoint (tied weights once; a LoRA layer's base weight under its plain name); tensors the model has no
    parameter for are refused, except rotary buffers, which are computed."""
    from safetensors import safe_open

    files = checkpoint_files(Path(folder))
    tracker = active_tracker()
    handles: dict[Path, object] = {}
    loaded, seen = set(), set()
    layout = _CheckpointLayout(model.config.model_type, files)

    def stored_slice(key: str):
        file = files[key]
        if file not in handles:
            handles[file] = stack_of_files.enter_context(safe_open(file, framework="pt"))
        loaded.add(key)
        return handles[file].get_slice(key)

    with contextlib.ExitStack() as stack_of_files:
        for name, param in model.named_parameters(remove_duplicate=False):
            key = _canonical(name).removeprefix("lm.")
            if adapter_role(name) is not None:  # LoRA adapters are no part of the base checkpoint: drawn
                continue
            if id(param) in seen:  # a tied parameter's other name: loaded once, under its first name
                loaded.add(layout.renamed(key))
                continue
            seen.add(id(param))
            local, start = _local_rows(param)
            with tracker.on_host() if tracker is not None else contextlib.nullcontext():
                if layout.renamed(key) in files:
                    stored = stored_slice(layout.renamed(key))
                    if tuple(stored.get_shape()) != tuple(param.shape):
                        raise ValueError(
                            f"{key}: the checkpoint holds {stored.get_shape()}, the model {tuple(param.shape)}"
                        )
                    rows = stored[start : start + local.shape[0]]
                else:  # experts stored one tensor per expert (and gate/up apart): merged for this shard's experts
                    rows = layout.merged(key, range(start, start + local.shape[0]), stored_slice, folder)
            local.copy_(rows)
            del rows  # before the next tensor is read: the host holds one tensor's rows at a time
    unused = sorted(k for k in set(files) - loaded if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise KeyError(f"{folder}: tensors the model has no parameter for: {', '.join(unused[:4])}")


def batch(inputs: dict, mesh) -> Batch:
    """A Hugging Face batch (a collator's, ``Trainer``'s: the whole sequence, ``labels`` unshifted as
    ``transformers`` takes them) -> this rank's shard of the shifted sequence: labels shifted left over the whole
    sequence (the last position ignored), then this rank's columns of each (``trials.training.data.rank_columns``:
    its ring rank's zigzag columns, then its Ulysses slice). What it cannot take: ValueError, one line naming the
    key.

    Packed documents: ``position_ids`` that restart at 0 at each document (``transformers``'
    ``DataCollatorWithFlattening``, TRL's ``padding_free`` / ``packing``) give the batch its ``Documents``, derived on
    the host once per batch; attention then stays inside each document and the label at each document's last token
    (the next document's first token) is ignored, as ``trials.training.data.make_batch`` packs them.
    """
    input_ids = inputs["input_ids"]
    labels = inputs.get("labels", input_ids)
    if input_ids.dim() != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"input_ids: one sequence per batch, not shape {list(input_ids.shape)}")
    seq_len = input_ids.shape[1]
    if seq_len % mesh.sp_degree:
        raise ValueError(f"input_ids: {seq_len} tokens do not split over ulysses_degree {mesh.sp_degree}")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError("attention_mask: padded sequences are not supported; pack or trim them")
    positions, documents = inputs.get("position_ids"), None
    if positions is None:
        positions = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)
    elif tuple(positions.shape) != tuple(input_ids.shape):
        raise ValueError(f"position_ids: shape {list(positions.shape)}, input_ids {list(input_ids.shape)}")
    else:
        documents = Documents.from_position_ids(positions)  # also checks them: 0 .. n-1 within each document
        why = rules.ring_documents_problem(mesh.ring_degree, documents.lengths if documents is not None else ())
        if why is not None:
            raise ValueError(
                f"position_ids: {why}; pad each document to a multiple, its pad tokens labelled -100 "
                "(autotune run pads them so)"
            )
    shifted = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    if documents is not None:  # no document predicts the next one's first token
        shifted[:, [end - 1 for end in documents.offsets[1:]]] = IGNORE_INDEX
    valid = int((shifted != IGNORE_INDEX).sum())
    try:
        cols = rank_columns(seq_len, mesh.sp_rank, mesh.sp_degree, mesh.ring_rank, mesh.ring_degree, documents)
    except ValueError as exc:
        raise ValueError(f"input_ids: {exc}") from None
    return Batch(input_ids[:, cols], shifted[:, cols], positions[:, cols], max(valid, 1), documents)
