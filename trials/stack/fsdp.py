"""Sharding: FSDP2 ``fully_shard`` per decoder layer plus the root (ZeRO-3 semantics).

Why FSDP2 and not DeepSpeed ZeRO-3: it composes with plain ``torch.utils.checkpoint`` and our own attention
module swaps without an engine wrapping the model, runs on CPU+gloo for the exactness tests, works under
FakeTensorMode with a fake process group (the memory oracle), and its memory is visible tensor by tensor
(the tracker follows its storage resizes). ``optimizer_offload`` uses FSDP2's ``CPUOffloadPolicy``: the
sharded parameters, gradients and optimizer states live on the host and the optimizer steps there.

On a CPU-only machine "host" and "device" are the same memory, so the tracker is told what would be on the host:
FSDP2's sharded parameters and gradients of an offloaded module (the tracker hears of every tensor FSDP2 turns
into a sharded DTensor through ``trials.core.patches.fsdp_shard_made``: the sharded parameters at ``fully_shard`` and
each new sharded gradient after the reduce-scatter) and everything the optimizer step allocates (its states).

One rank with ``fsdp``: ``trials.core.dist.ensure_device_mesh`` gives the process a 1-rank group so ``fully_shard``
runs (shards are whole tensors; collectives are trivial). That is what ``optimizer_offload`` needs on one GPU.

Without sharding but with several ranks, gradients are averaged with an all-reduce (``allreduce_grads``),
so every configuration reduces gradients the same way: the mean over all ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trials.core.dist import is_sharded
from trials.core.memory import active_tracker


def apply_fsdp(model, mesh, optimizer_offload: bool = False, param_dtype: torch.dtype | None = None) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if mesh.device_mesh is None:
        raise ValueError("apply_fsdp needs a mesh with a device mesh (trials.core.dist.ensure_device_mesh)")
    offload = CPUOffloadPolicy(pin_memory=mesh.device.type == "cuda") if optimizer_offload else OffloadPolicy()
    if optimizer_offload:
        tracker = active_tracker()
        if tracker is not None:
            tracker.host_phases.add("optimizer")
    precision = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh.device_mesh, offload_policy=offload, mp_policy=precision)
    fully_shard(model, mesh=mesh.device_mesh, offload_policy=offload, mp_policy=precision)


def allreduce_grads(model, mesh) -> None:
    """Average replicated gradients over all ranks (the unsharded multi-rank case)."""
    if not mesh.distributed or is_sharded(model):
        return
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad.div_(mesh.world_size)
