"""Apply a tuned technique set to a model: one visible place where the stack is composed.

    from trials.stack import apply
    apply(model, techniques, mesh)          # model: trials.models.model.TrainingModel

Order matters and mirrors torchtitan's ``parallelize``: attention swaps first (plain Ulysses, or head-chunked
Ulysses which replaces the whole attention computation), then the sequence tiling of MLP, loss and RMSNorm (they replace
module forwards / the loss function, so they must sit inside the checkpoint wrappers), then activation
checkpointing and its offload per layer, then sharding, which must see the final module tree.

Every knob is exact: the model trains the same loss and gradients (to rounding) as the plain single-process model.

    knob                        module                       what it changes
    ulysses_degree > 1          trials.stack.ulysses         DeepSpeed UlyssesSPAttentionHF around the attention op
    ring_degree > 1             trials.stack.ring            the attention op -> ring attention (inside Ulysses' exchange)
    head_chunk                  trials.stack.upipe           attention forward -> untied Ulysses (any degree, 1 included)
    mlp_tile_tokens             trials.stack.tiling          each MLP forward -> TiledMLP (DeepSpeed's)
    loss_tile_tokens            trials.stack.tiling          model.loss_fn -> TiledLogitsLoss
    norm_tile_tokens            trials.stack.tiling          each RMSNorm forward -> TiledRMSNorm
    activation_checkpointing    trials.stack.checkpointing   checkpoint_wrapper per decoder layer
    activation_offload_layers   trials.stack.offload         the first N checkpointed inputs live on the host
    fsdp / optimizer_offload    trials.stack.fsdp            fully_shard per layer + root; CPUOffloadPolicy
"""

from __future__ import annotations

from trials.core.dist import Mesh, ensure_device_mesh
from trials.stack.checkpointing import apply_activation_checkpointing
from trials.stack.fsdp import apply_fsdp
from trials.stack.ring import apply_ring
from trials.stack.rules import requirement_problems
from trials.stack.techniques import Techniques
from trials.stack.tiling import apply_loss_tiling, apply_mlp_tiling, apply_norm_tiling
from trials.stack.ulysses import apply_ulysses, attention_modules
from trials.stack.upipe import apply_head_chunking


def apply(model, techniques: Techniques, mesh: Mesh, param_dtype=None):
    """Apply ``techniques`` to ``model`` in place; returns the model.

    With ``fsdp`` on a single rank (no process group), a 1-rank process group is started in this process so
    FSDP2 (and ``optimizer_offload``) work as on several ranks.
    """
    if techniques.ulysses_degree != mesh.sp_degree:
        raise ValueError(
            f"techniques ask for ulysses_degree {techniques.ulysses_degree}, the mesh has {mesh.sp_degree}"
        )
    if techniques.ring_degree != mesh.ring_degree:
        raise ValueError(f"techniques ask for ring_degree {techniques.ring_degree}, the mesh has {mesh.ring_degree}")
    missing = requirement_problems(techniques)
    if missing:
        raise ValueError(missing[0])
    for attn_module in attention_modules(model):
        attn_module.autotune_kernel = techniques.attention
    if techniques.head_chunk is not None:
        apply_head_chunking(model, mesh, techniques.head_chunk, kernel=techniques.attention)
    elif techniques.ring_degree > 1:
        apply_ring(model, mesh, kernel=techniques.attention)
    elif techniques.ulysses_degree > 1:
        apply_ulysses(model, mesh, kernel=techniques.attention)
    if techniques.mlp_tile_tokens:
        apply_mlp_tiling(model, techniques.mlp_tile_tokens)
    if techniques.loss_tile_tokens:
        apply_loss_tiling(model, techniques.loss_tile_tokens)
    if techniques.norm_tile_tokens:
        apply_norm_tiling(model, techniques.norm_tile_tokens)
    if techniques.activation_checkpointing:
        apply_activation_checkpointing(model, offload_layers=techniques.activation_offload_layers)
    if techniques.fsdp:
        ensure_device_mesh(mesh)
        apply_fsdp(model, mesh, optimizer_offload=techniques.optimizer_offload, param_dtype=param_dtype)
    return model
