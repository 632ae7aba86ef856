"""Apply a tuned technique set to a model: one visible place where the stack is composed.

    from trials.stack import apply
    apply(model, techniques, mesh)          # model: trials.model.TrainingModel

Order matters and mirrors torchtitan's ``parallelize``: attention swaps (Ulysses, head chunking) first,
then the sequence tiling of MLP and loss, then activation checkpointing (and its offload) per layer, then
sharding, which must see the final module tree.
"""

from __future__ import annotations

from autotune.config import Techniques
from trials.checkpointing import apply_activation_checkpointing
from trials.dist import Mesh
from trials.fsdp import apply_fsdp
from trials.ulysses import apply_ulysses, attention_modules


def apply(model, techniques: Techniques, mesh: Mesh, param_dtype=None):
    """Apply ``techniques`` to ``model`` in place; returns the model."""
    if techniques.ulysses_degree != mesh.sp_degree:
        raise ValueError(f"techniques ask for ulysses_degree {techniques.ulysses_degree}, "
                         f"the mesh has {mesh.sp_degree}")
    for attn_module in attention_modules(model):
        attn_module.autotune_kernel = techniques.attention
    if techniques.ulysses_degree > 1:
        apply_ulysses(model, mesh, kernel=techniques.attention)
    if techniques.head_chunk is not None:
        raise NotImplementedError("head_chunk (untied Ulysses) is not implemented yet")
    if techniques.mlp_tile_tokens:
        raise NotImplementedError("mlp_tile_tokens is not implemented yet")
    if techniques.loss_tile_tokens:
        raise NotImplementedError("loss_tile_tokens is not implemented yet")
    if techniques.activation_checkpointing:
        apply_activation_checkpointing(model)
    if techniques.activation_offload_layers:
        raise NotImplementedError("activation_offload_layers is not implemented yet")
    if techniques.fsdp and mesh.distributed:
        apply_fsdp(model, mesh, optimizer_offload=techniques.optimizer_offload, param_dtype=param_dtype)
    elif techniques.optimizer_offload:
        raise NotImplementedError("optimizer_offload on one rank is not implemented yet")
    return model
