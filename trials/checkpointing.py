"""Activation checkpointing per decoder layer: keep only each layer's input, recompute the rest in backward.

Uses torch's non-reentrant checkpoint through ``checkpoint_wrapper`` (the torchtitan way), which composes
with FSDP2 (shard the wrapper after wrapping).
"""

from __future__ import annotations


def apply_activation_checkpointing(model) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper

    layers = model.layers
    for index, layer in enumerate(layers):
        layers[index] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
                                           preserve_rng_state=False)
