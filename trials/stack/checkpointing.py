"""Activation checkpointing per decoder layer: keep only each layer's input, recompute the rest in backward.

Uses torch's non-reentrant checkpoint through ``checkpoint_wrapper`` (the torchtitan way), which composes
with FSDP2 (shard the wrapper after wrapping). With ``offload_layers = N > 0`` the first N layers' kept inputs
live on the host (``trials.stack.offload``); layer N's wrapper also takes part, to bring layer N-1's input back once
layer N's backward is done.
"""

from __future__ import annotations

from trials.stack.offload import ActivationOffload


def apply_activation_checkpointing(model, offload_layers: int = 0) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    layers = model.layers
    if not 0 <= offload_layers <= len(layers):
        raise ValueError(f"activation_offload_layers {offload_layers} must be between 0 and {len(layers)}")
    offload = None
    if offload_layers:
        offload = ActivationOffload(offload_layers)
        model.activation_offload = offload
    for index, layer in enumerate(layers):
        if offload is not None and index <= offload_layers:
            layers[index] = checkpoint_wrapper(layer, checkpoint_fn=offload.checkpoint_fn(index))
        else:
            layers[index] = checkpoint_wrapper(
                layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False
            )
