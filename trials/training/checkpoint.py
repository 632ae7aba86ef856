"""Training checkpoints: the model, its optimizer and where the run stands, saved with
``torch.distributed.checkpoint`` (DCP) so that a run continues on the same or another world size, and the trained
model written as a Hugging Face folder.

A checkpoint is a folder ``step-NNNNNNNN`` under the run's ``--save`` folder:

- the DCP files of ``{"model": ..., "optimizer": ...}`` (``get_state_dict``: fully qualified names, each rank writes
  its own FSDP2 shards; DCP reshards them on load when the world size differs);
- ``trainer_state.json``: the steps done, the data position (windows of the token stream consumed), the schedule's
  state, the training time so far;
- ``rng-rank{R}.pt``: each rank's random number generator states.

With LoRA adapters (``trials.models.lora``) a checkpoint holds the trainable adapters and their optimizer state
only (DCP's ``ignore_frozen_params``): the frozen base is the run's ``--init`` folder (or its seeded draw), read
again on resume, which ``TrainerState.frozen_base`` names so that a resume from another base is refused.

It is written as ``step-NNNNNNNN.tmp`` and renamed once every rank has finished writing, so a folder without
``.tmp`` is always complete: a run killed while saving leaves the previous checkpoint as the newest one. A save that
fails on any rank (disk full) removes its partial folder on every rank's word and raises ``CheckpointSaveError``.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

STEP_FOLDER = re.compile(r"^step-(\d{8})$")
STATE_FILE = "trainer_state.json"
PARTIAL_SUFFIX = ".tmp"
SHARDED = "sharded"  # an export's per-rank shards, inside its partial folder until rank 0 has merged them
WAIT_ROUND_S = 10.0  # the longest one collective waits while rank 0 finishes a save alone (``_on_rank_zero``)


class CheckpointSaveError(RuntimeError):
    """A checkpoint could not be written (the partial one is removed; earlier ones are untouched)."""


@dataclass
class TrainerState:
    """Where a run stands after ``step`` optimizer steps."""

    step: int = 0
    windows_consumed: int = 0  # token windows of the stream read so far, all replicas and micro-batches
    elapsed_s: float = 0.0  # training time so far, over every resumed run
    world_size: int = 1
    schedule: dict = field(default_factory=dict)  # the learning-rate scheduler's state_dict
    frozen_base: str | None = None  # LoRA: where the frozen base weights come from (not in the checkpoint)


def step_folder(save: Path, step: int) -> Path:
    return Path(save) / f"step-{step:08d}"


def complete_checkpoints(save: Path) -> list[Path]:
    """The complete checkpoints under ``save``, oldest first."""
    save = Path(save)
    if not save.is_dir():
        return []
    found = [p for p in save.iterdir() if STEP_FOLDER.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(STEP_FOLDER.match(p.name).group(1)))


def newest(save: Path) -> Path | None:
    checkpoints = complete_checkpoints(save)
    return checkpoints[-1] if checkpoints else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _all_ok(ok: bool, device) -> bool:
    """Whether every rank's ``ok`` holds (one collective)."""
    if not dist.is_initialized():
        return ok
    flag = torch.tensor(1 if ok else 0, dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def save(save: Path, model, optimizer, state: TrainerState, device, keep: int | None = None) -> Path:
    """Write the checkpoint of ``state.step`` under ``save`` (every rank calls it), then remove all but the newest
    ``keep`` complete ones. Returns the checkpoint's folder; ``CheckpointSaveError`` (on every rank) when any rank
    could not write its part."""

    def write(partial: Path) -> None:
        save_model_and_optimizer(partial, model, optimizer)
        torch.save(_rng_states(), partial / f"rng-rank{_rank()}.pt")
        if _rank() == 0:
            _write_durably(partial / STATE_FILE, json.dumps(asdict(state), indent=1))

    final = step_folder(save, state.step)  # saved again by a resumed run re-saving its last step: replaced
    _write_atomically(final, write, None, f"save the checkpoint of step {state.step} in {save}", device)
    if _rank() == 0 and keep is not None:
        for old in complete_checkpoints(save)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load(checkpoint: Path, model, optimizer) -> TrainerState:
    """Load ``checkpoint`` into ``model`` and ``optimizer`` (built for this run's world size: DCP reshards) and
    this rank's RNG states (where the checkpoint's world had this rank); returns the trainer state."""
    load_model_and_optimizer(checkpoint, model, optimizer)
    rng = Path(checkpoint) / f"rng-rank{_rank()}.pt"
    if rng.is_file():
        _set_rng_states(torch.load(rng, weights_only=False))
    return TrainerState(**json.loads((Path(checkpoint) / STATE_FILE).read_text()))


def save_model_and_optimizer(folder: Path, model, optimizer) -> None:
    """``{"model": ..., "optimizer": ...}`` as one DCP folder (every rank writes its shards; fully qualified names,
    so any world size reads it back), the frozen parameters left out (``state_dict_options``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=state_dict_options(model))
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=str(folder))


def load_model_and_optimizer(folder: Path, model, optimizer) -> None:
    """Read a folder of ``save_model_and_optimizer`` into ``model`` and ``optimizer`` (built for this run's world
    size: DCP reshards)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    options = state_dict_options(model)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=str(folder))
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"], options=options
    )


def state_dict_options(model):
    """DCP's state-dict options for ``model``: with frozen parameters (LoRA's base) the trainable ones alone, the
    frozen ones neither saved nor expected on load."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    frozen = any(not param.requires_grad for param in model.parameters())
    return StateDictOptions(ignore_frozen_params=frozen, strict=not frozen)


def remove_partial(save: Path) -> None:
    """Remove what a killed save left (``step-*.tmp`` folders); rank 0's job."""
    if _rank() == 0 and Path(save).is_dir():
        for leftover in Path(save).glob(f"step-*{PARTIAL_SUFFIX}"):
            shutil.rmtree(leftover, ignore_errors=True)


def export_hf(model, hf_config, folder: Path, device) -> None:
    """Write the model as a Hugging Face folder (``config.json`` + ``model.safetensors``) that
    ``AutoModelForCausalLM.from_pretrained`` loads: each rank writes its FSDP2 shards, then rank 0 alone merges them
    into whole tensors (what ``HuggingFaceStorageWriter``'s ``enable_consolidation`` runs, here as ``finish``, so the
    other ranks wait for it in short collectives rather than in one that a model of tens of GB outlasts); written
    beside ``folder`` and renamed into place when complete. Tensors are the fp32 master weights; a tied output head
    is stored once, as ``transformers`` saves it. A model with LoRA adapters is written with them merged into its
    base weights (``W + scaling * B @ A``, what peft's ``merge_and_unload`` gives), each rank merging its own rows."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    weights = {}
    for name, tensor in _merged(get_model_state_dict(model), model).items():
        name = name.removeprefix("lm.")
        if name == "lm_head.weight" and getattr(hf_config, "tie_word_embeddings", False):
            continue
        weights[name] = tensor

    def write(partial: Path) -> None:  # every rank its shards, under sharded/
        dcp.save(weights, storage_writer=HuggingFaceStorageWriter(str(partial / SHARDED), save_distributed=True))

    def finish(partial: Path) -> None:  # rank 0 merges the shards into whole tensors; the shards go, the config comes
        consolidate_safetensors_files(
            input_dir=str(partial / SHARDED), output_dir=str(partial), fqn_to_index_mapping=dict.fromkeys(weights, 1)
        )
        shutil.rmtree(partial / SHARDED, ignore_errors=True)
        hf_config.save_pretrained(partial)

    _write_atomically(Path(folder), write, finish, f"export the model to {folder}", device)


def _merged(state: dict, model) -> dict:
    """``state`` (a model state dict) with each LoRA layer's adapters merged into its base weight under the plain
    model's names (``q_proj.base_layer.weight`` + ``q_proj.lora_A/B`` -> ``q_proj.weight``); ``state`` itself for a
    model without adapters. An FSDP2 shard of the base weight and of B hold the same rows (both are sharded along
    the output rows), so each rank merges its rows with the whole A (gathered: rank x in values)."""
    from torch.distributed.tensor import DTensor

    from trials.models.lora import ADAPTER_NAME

    spec = model.lora
    if not spec.on:
        return state
    merged = {}
    for name, tensor in state.items():
        prefix, part, rest = name.partition(".base_layer.")
        if part and rest == "weight" and f"{prefix}.lora_A.{ADAPTER_NAME}.weight" in state:
            down = state[f"{prefix}.lora_A.{ADAPTER_NAME}.weight"]
            up = state[f"{prefix}.lora_B.{ADAPTER_NAME}.weight"]
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            if isinstance(down, DTensor):  # gathered on the mesh's device: offloaded shards live on the host
                down = down.to(down.device_mesh.device_type).full_tensor().to(local.device)
            rows = local + spec.scaling * ((up.to_local() if isinstance(up, DTensor) else up) @ down)
            if isinstance(tensor, DTensor):
                rows = DTensor.from_local(
                    rows, tensor.device_mesh, tensor.placements, shape=tensor.shape, stride=tensor.stride()
                )
            merged[f"{prefix}.weight"] = rows
        elif part:
            merged[f"{prefix}.{rest}"] = tensor  # the base layer's bias
        elif ".lora_A." not in name and ".lora_B." not in name:
            merged[name] = tensor
    return merged


def export_adapters(model, folder: Path, device, base_model: str | None = None) -> None:
    """Write the model's LoRA adapters as a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``)
    that ``peft.PeftModel.from_pretrained(base, folder)`` loads onto the base model, named as peft saves them
    (``base_model.model.<module>.lora_A.weight``). The adapters are small: they are gathered whole on rank 0, which
    writes them; ``base_model``: the base's folder, recorded as ``base_model_name_or_path``."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from trials.models.lora import ADAPTER_NAME

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    gathered = get_model_state_dict(model, options=options)  # rank 0's whole adapters; {} elsewhere
    tensors = {
        "base_model.model." + name.removeprefix("lm.").replace(f".{ADAPTER_NAME}.", "."): tensor.contiguous()
        for name, tensor in gathered.items()
    }
    config = copy.copy(model.lora_config)  # the peft.LoraConfig put in (``apply_lora``)
    config.base_model_name_or_path = str(base_model) if base_model is not None else None
    config.task_type = "CAUSAL_LM"

    def finish(partial: Path) -> None:
        save_file(tensors, str(partial / "adapter_model.safetensors"), metadata={"format": "pt"})
        config.save_pretrained(str(partial))

    _write_atomically(Path(folder), lambda partial: None, finish, f"export the adapters to {folder}", device)


def _write_atomically(final: Path, write, finish, failure: str, device) -> None:
    """Every rank's ``write(partial)`` into ``final`` + ``.tmp``, then rank 0's ``finish(partial)`` (if any) and the
    rename into place, an earlier ``final`` replaced: a folder under ``final``'s name is always complete. When any
    rank's write fails (a full disk; DCP's ``CheckpointException`` is a ``BaseException``), or rank 0's own steps
    before and after it do, the partial folder is removed and every rank raises ``CheckpointSaveError`` saying it
    could not ``failure``, and why: every rank learns the outcome from a collective, none waits in a barrier for
    a rank that has given up."""
    import torch.distributed.checkpoint as dcp

    partial = final.with_name(final.name + PARTIAL_SUFFIX)

    def fail(cause: BaseException | None, others: str) -> CheckpointSaveError:
        if _rank() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        _barrier()  # every rank knows the outcome: none is left in a collective
        return CheckpointSaveError(f"could not {failure}: {_reason(cause, final.parent, others)}")

    def prepare() -> None:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)

    def publish() -> None:
        if finish is not None:
            finish(partial)
        if final.exists():
            shutil.rmtree(final)
        os.rename(partial, final)
        _fsync_folder(final.parent)

    cause = _on_rank_zero(prepare)
    if not _all_ok(cause is None, device):
        raise fail(cause, "rank 0 could not make the folder")
    try:
        write(partial)
    except (Exception, dcp.api.CheckpointException) as exc:  # noqa: BLE001 -- any failure to write fails it
        cause = exc
    if not _all_ok(cause is None, device):
        raise fail(cause, "another rank could not write its part")
    cause = _on_rank_zero(publish, device)
    if not _all_ok(cause is None, device):
        raise fail(cause, "rank 0 could not put the written folder in place")


def _on_rank_zero(action, device=None) -> Exception | None:
    """Run ``action`` on rank 0 only; what it raised (None when it did not, and on every other rank).

    With ``device`` the ranks wait for it together: rank 0 runs it in a thread and every rank meets in one small
    collective each ``WAIT_ROUND_S`` until it is done, so however long it takes (merging an export of tens of GB),
    no collective waits longer than a round, far below the process group's timeout; a rank 0 that dies still
    leaves the others in a collective that times out."""
    outcome: dict = {}

    def run() -> None:
        try:
            action()
        except Exception as exc:  # noqa: BLE001 -- every rank is told, then raises
            outcome["cause"] = exc

    if device is None or not dist.is_initialized():
        if _rank() == 0:
            run()
        return outcome.get("cause")
    worker = threading.Thread(target=run, name="rank-0-save", daemon=True) if _rank() == 0 else None
    if worker is not None:
        worker.start()
    done = False
    while not done:
        if worker is not None:
            worker.join(WAIT_ROUND_S)
        done = _all_ok(worker is None or not worker.is_alive(), device)
    return outcome.get("cause")


def _rng_states() -> dict:
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def _write_durably(path: Path, text: str) -> None:
    with open(path, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_folder(folder: Path) -> None:
    handle = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(handle)
    finally:
        os.close(handle)


def _reason(cause: BaseException | None, folder: Path, others: str) -> str:
    """What went wrong, in one line: each failed rank's own exception (DCP wraps them), or ``others`` on a rank
    that did not fail itself, and the disk's free space (a full disk often surfaces as a serialiser's complaint
    rather than as ENOSPC)."""
    import torch.distributed.checkpoint as dcp

    if cause is None:
        said = others
    elif isinstance(cause, dcp.api.CheckpointException):
        said = "; ".join(f"rank {rank}: {_one_line(exc)}" for rank, (exc, _) in sorted(cause.failures.items()))
    else:
        said = _one_line(cause)
    try:
        existing = next(p for p in [Path(folder).absolute(), *Path(folder).absolute().parents] if p.exists())
        said += f" ({shutil.disk_usage(existing).free / 2**30:,.1f} GiB free on its disk)"
    except (OSError, StopIteration):
        pass
    return said


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__
