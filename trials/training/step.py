"""One training step with gradients that match the plain single-process model.

Loss scaling: every rank computes ``sum of its tokens' cross-entropy * scale``. Gradients are then averaged
over all ``world = dp * cp`` ranks (FSDP's reduce-scatter, or ``allreduce_grads``; ``cp`` = Ulysses degree x ring
degree, the ranks that split one sequence). With ``scale = cp / valid_tokens`` that average is ``(1/dp) * sum over replicas of grad(replica mean loss)``:
exactly the plain model's gradient when dp = 1, and the data-parallel mean otherwise.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trials.core.memory import active_tracker
from trials.models.lora import FULL_TRAINING, LoraSpec, apply_lora
from trials.models.model import build_model, default_compute_dtype, materialize, set_compute_dtype
from trials.stack import apply
from trials.stack.fsdp import allreduce_grads
from trials.training.data import Batch


@dataclass
class StepResult:
    loss: float  # mean token loss over the whole global batch
    grad_norm: float  # L2 norm of the full (reduced) gradient


def build_training(
    model_config: dict,
    techniques,
    mesh,
    seed: int = 0,
    tracker=None,
    lr: float = 1e-5,
    compute_dtype: torch.dtype | None = None,
    fused_optimizer: bool | None = None,
    lora: LoraSpec = FULL_TRAINING,
    **adamw,
):
    """Model from the preset (seeded), ``lora``'s adapters on it (``trials.models.lora``: the base then frozen), the
    technique stack applied, and its AdamW optimizer over the trainable parameters.

    ``compute_dtype``: None = bf16 on CUDA, fp32 on CPU; fp32 master weights either way (see
    ``trials.models.model.set_compute_dtype``). ``tracker``: a ``DeviceMemoryTracker`` (default: the active one, if any),
    as for ``forward_backward`` and ``train_step``. ``fused_optimizer``: AdamW's fused kernel, ``adamw`` its other options (``make_optimizer``)."""
    tracker = tracker if tracker is not None else active_tracker()
    compute_dtype = compute_dtype or default_compute_dtype(mesh.device)
    # sharded: built on meta, so each rank only ever allocates its shards (the host's, with optimizer offload)
    model = build_model(model_config, seed=seed, device="meta" if techniques.fsdp or lora.on else mesh.device)
    apply_lora(model, lora)
    if not techniques.fsdp and lora.on:
        materialize(model, mesh.device, seed)
    apply(model, techniques, mesh, param_dtype=None if compute_dtype == torch.float32 else compute_dtype)
    if techniques.fsdp:
        materialize(model, mesh.device, seed, params_device="cpu" if techniques.optimizer_offload else None)
    set_compute_dtype(model, compute_dtype)
    if tracker is not None:
        tracker.retag(model.parameters(), "params")
    return model, make_optimizer(model, techniques, mesh, lr, fused_optimizer, **adamw)


def make_optimizer(model, techniques, mesh, lr: float = 1e-5, fused: bool | None = None, **adamw) -> torch.optim.AdamW:
    """The trials' AdamW: the fused kernel (one launch per parameter group, no temporaries) where ``fused`` -- None
    = where the optimizer steps on a GPU (not offloaded); elsewhere the per-parameter loop, whose temporaries are
    one parameter's size (the memory oracle says which it models). ``adamw``: AdamW's other options (betas,
    weight_decay), torch's defaults otherwise."""
    if fused is None:
        fused = mesh.device.type == "cuda" and not techniques.optimizer_offload
    trainable = [param for param in model.parameters() if param.requires_grad]  # LoRA: the adapters alone
    return torch.optim.AdamW(trainable, lr=lr, **adamw, **({"fused": True} if fused else {"foreach": False}))


def loss_scale(batch: Batch, mesh) -> float:
    return mesh.cp_degree / batch.valid_tokens


def grad_norm(model, mesh) -> torch.Tensor:
    """L2 norm of the whole reduced gradient, with at most one collective: a 0-d fp32 tensor on ``mesh.device``,
    not read, so that clipping by it (``clip_gradients``) and the optimizer step queue behind it without the host
    waiting for the device.

    Sharded gradients (FSDP2 DTensors, disjoint shards over the FSDP mesh) contribute the squares of their local
    shard, summed over ranks; replicated ones (already all-reduced) count once, locally. With optimizer offload
    the shards live on the host: their squares are summed there and moved to the device, because the step's
    process group may have no CPU backend (NCCL) -- ``.full_tensor()`` on a host DTensor would all-reduce CPU
    tensors over it."""
    from torch.distributed.tensor import DTensor

    sums = {}  # (device, sharded) -> sum of squares in fp32
    group = None
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        sharded = isinstance(grad, DTensor)
        if sharded:
            group = grad.device_mesh.get_group()
            grad = grad.to_local()
        key = (grad.device, sharded)
        square = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        sums[key] = square if key not in sums else sums[key] + square
    sharded = torch.zeros((), dtype=torch.float32, device=mesh.device)
    local = torch.zeros((), dtype=torch.float32, device=mesh.device)
    for (_, is_sharded), total in sums.items():
        if is_sharded:
            sharded += total.to(mesh.device)
        else:
            local += total.to(mesh.device)
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sharded, group=group)
    return (sharded + local).sqrt()


@torch.no_grad()
def clip_gradients(model, norm: torch.Tensor, max_norm: float) -> None:
    """Scale every gradient by ``max_norm / (norm + 1e-6)`` clamped at 1, as ``torch.nn.utils.clip_grad_norm_``
    does, the factor computed on the device: no value is read before the optimizer step. Each rank scales its local
    gradient (a DTensor's shard); host gradients (optimizer offload) get the factor copied to the host."""
    from torch.distributed.tensor import DTensor

    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    factors = {factor.device: factor}
    for param in model.parameters():
        grad = param.grad
        if grad is None:
            continue
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        if local.device not in factors:
            factors[local.device] = factor.to(local.device)
        local.mul_(factors[local.device])


def forward_backward(
    model, batch: Batch, mesh, tracker=None, micro_batches: int = 1, reduce: bool = True
) -> torch.Tensor:
    """Forward + backward + gradient reduction, no optimizer step; returns this rank's scaled loss (detached).

    After it every rank holds the reduced gradient (sharded DTensors under FSDP: ``.full_tensor()`` gathers).
    Gradient accumulation over ``micro_batches`` sequences per replica: each call's loss is scaled by
    ``1 / micro_batches`` (the gradients add up to the mean over all of them), and only the last call reduces
    (``reduce``) the replicated gradients that an all-reduce averages; FSDP2 reduce-scatters each call's into its
    sharded gradients, which add up.
    """
    tracker = tracker if tracker is not None else active_tracker()
    phase = tracker.in_phase if tracker is not None else _no_phase
    scale = loss_scale(batch, mesh) / micro_batches
    with phase("forward"):
        scaled_loss = model(batch.input_ids, batch.position_ids, batch.labels, scale=scale, documents=batch.documents)
    with phase("backward"):
        scaled_loss.backward()
        if reduce:
            allreduce_grads(model, mesh)
    if tracker is not None:
        tracker.retag((p.grad for p in model.parameters()), "grads")
    return scaled_loss.detach()


def summed_loss(scaled_loss: torch.Tensor, mesh) -> torch.Tensor:
    """The sum over ranks of each rank's ``local_sum * cp / valid``, on the device (a collective, no read); the global
    batch's mean token loss is it divided by ``cp * dp`` (``cp``: Ulysses x ring)."""
    loss = scaled_loss.detach().clone()
    if mesh.distributed:
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
    return loss


def global_loss(scaled_loss: torch.Tensor, mesh) -> float:
    """Mean token loss over the global batch from each rank's ``local_sum * cp / valid`` (a collective)."""
    return float(summed_loss(scaled_loss, mesh)) / (mesh.cp_degree * mesh.dp_size)


class DivergenceError(RuntimeError):
    """A step whose loss or gradient norm is not finite (nan, inf): the optimizer did not apply it."""


def step_if_finite(optimizer, loss: torch.Tensor, norm: torch.Tensor) -> tuple[float, float]:
    """The optimizer step, applied only when ``loss`` and ``norm`` (0-d device tensors, the same on every rank:
    ``summed_loss``, ``grad_norm``) are both finite; returns their values, the two reads the trainer's log makes
    anyway (the host waits at the first; the second is there by then).

    Fused AdamW (the GPU's): the step is queued with ``found_inf``, the device's own verdict, as ``GradScaler``
    queues it: the kernel leaves every weight, moment and step count as they are when it is set. The host reads the
    values after queueing the step, so it does not wait for the device before the optimizer step. The per-parameter
    loop (CPU, an offloaded optimizer, where the host runs the step on gradients it waits for anyway) takes no such
    flag: the values are read first and the step is skipped on the host. Either way a non-finite step changes no
    weight and no optimizer state, and the gradients are dropped."""
    values = torch.stack([loss.detach().float(), norm.detach().float()])
    if optimizer.defaults.get("fused"):
        optimizer.found_inf = (~torch.isfinite(values).all()).float()
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        loss_value, norm_value = (float(value) for value in values)
    else:
        loss_value, norm_value = (float(value) for value in values)
        if math.isfinite(loss_value) and math.isfinite(norm_value):
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_value, norm_value


def prime_optimizer(model, optimizer, tracker=None) -> None:
    """Create the optimizer states as a real first step does, without one: a step on zero gradients. Memory
    measured (or traced) in the step after it sees every state a later step holds. With optimizer offload (the
    tracker's host phase "optimizer") the zero gradients are made beside their parameters, on the host, as the
    step's offloaded gradients are: counted on the device they would add one copy of the parameters to it."""
    tracker = tracker if tracker is not None else active_tracker()
    phase = tracker.in_phase if tracker is not None else _no_phase
    offloaded = tracker is not None and "optimizer" in tracker.host_phases
    with tracker.on_host() if offloaded else contextlib.nullcontext():
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def train_step(model, optimizer, batch: Batch, mesh, tracker=None) -> StepResult:
    tracker = tracker if tracker is not None else active_tracker()
    phase = tracker.in_phase if tracker is not None else _no_phase
    scaled_loss = forward_backward(model, batch, mesh, tracker)
    norm = grad_norm(model, mesh)
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    # scaled_loss = local_sum * cp / valid; the global mean loss is sum over ranks / (cp * dp); the values are read
    # after the optimizer step is queued
    return StepResult(loss=global_loss(scaled_loss, mesh), grad_norm=float(norm))


class _NullPhase:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _no_phase(_name):
    return _NullPhase()
