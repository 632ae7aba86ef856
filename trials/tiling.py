"""Sequence tiling of the MLP and of the logits + loss (DeepSpeed ALST's ``TiledMLP`` / tiled loss).

Tiled MLP (``mlp_tile_tokens``). The MLP's intermediate activations are ``[s_l, intermediate]`` wide (3.5x the
hidden size for Llama-3) times three (gate, up, their product); tiling the sequence keeps only one tile of them
alive. DeepSpeed's ``TiledMLP`` fits as is: forward runs the tiles under ``no_grad`` and saves just the MLP input
``[b, s_l, h]``; backward recomputes each tile with autograd and backpropagates it at once, writing the tile's
input gradient into a preallocated ``[b, s_l, h]``. The number of tiles is ``ceil(s_l / mlp_tile_tokens)``
(one tile = plain MLP, no recompute). With FSDP2 the layer's parameters are unsharded while its backward runs,
so the per-tile weight gradients accumulate into the unsharded gradients that FSDP2 reduces afterwards;
``compute_params`` stays empty (it only drives DeepSpeed ZeRO's gradient buckets).

Tiled loss (``loss_tile_tokens``). ``lm_head`` + cross-entropy over ``[s_l, vocab]`` logits is the largest single
activation of a long-sequence step (vocab 128K: 32x the hidden size, in fp32). ``TiledLogitsLoss`` never
materialises more than one tile of logits: in *forward* it runs each tile with autograd and takes the tile's
gradients at once (``torch.autograd.grad``), keeping only d_hidden ``[b, s_l, h]`` and the lm_head weight
gradient; backward returns them times the incoming gradient. It is our own small Function rather than
DeepSpeed's ``TiledFusedLogitsLoss`` for two reasons: (1) that one accumulates lm_head's gradient into
``param.grad`` during forward, outside the backward pass -- with FSDP2 the reduce-scatter of the root group then
depends on the gradient having been stashed in the unsharded parameter before FSDP's backward hooks run, and the
gradient is silently wrong if the loss is scaled after the call; here the weight is an input of the Function, so
its gradient flows through autograd like any other and scales correctly; (2) its backward branches on the value
of the incoming gradient (``if grads[0] != 1.0``), which FakeTensorMode (the memory oracle) cannot evaluate.
The loss scale is applied per tile inside (``TrainingModel.loss_fn(hidden, lm_head, labels, scale)`` contract):
the result is ``sum of token cross-entropies * scale``, like ``trials.model.plain_loss``.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn as nn


def _tiles(tokens: int, tile_tokens: int) -> int:
    return max(1, math.ceil(tokens / tile_tokens))


# -- tiled MLP ---------------------------------------------------------------------------------------------------

def _mlp_body(mlp, x):
    """The untiled MLP of the wrapped module (the class's own forward, not the tiled replacement)."""
    return type(mlp).forward(mlp, x)


def _autocast_body(device_type: str, dtype):
    """The MLP body under the caller's autocast: TiledMLP recomputes it in backward, where autocast is off."""

    def body(mlp, x):
        with torch.autocast(device_type, dtype=dtype):
            return _mlp_body(mlp, x)

    return body


def _tiled_mlp_forward(self, x):
    """x [b, s_l, h] -> [b, s_l, h], in ceil(s_l / tile) sequence tiles."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    shards = _tiles(x.shape[-2], self.autotune_tile_tokens)
    if shards == 1:
        return _mlp_body(self, x)
    device_type = x.device.type
    body = _mlp_body
    if torch.is_autocast_enabled(device_type):
        body = _autocast_body(device_type, torch.get_autocast_dtype(device_type))
    return TiledMLP.apply(body, self, x, shards, [])


def apply_mlp_tiling(model, tile_tokens: int) -> None:
    if tile_tokens <= 0:
        raise ValueError(f"mlp_tile_tokens must be positive, got {tile_tokens}")
    for layer in model.layers:
        mlp = layer.mlp
        mlp.autotune_tile_tokens = tile_tokens
        mlp.forward = types.MethodType(_tiled_mlp_forward, mlp)


# -- tiled logits + loss -----------------------------------------------------------------------------------------

class TiledLogitsLoss(torch.autograd.Function):
    """sum over tiles of cross_entropy(lm_head(hidden_tile), labels_tile, reduction=sum) * scale.

    hidden [b, s_l, h], labels [b, s_l] -> scalar. Per tile: logits [b*tile, vocab] (fp32), freed before the next.
    Saves d_hidden [b, s_l, h] and one gradient per lm_head parameter.
    """

    @staticmethod
    def forward(ctx, lm_head: nn.Module, hidden, labels, scale: float, tile_tokens: int, *params):
        b, s_l, h = hidden.shape
        x2d = hidden.detach().reshape(b * s_l, h)
        y1d = labels.reshape(b * s_l)
        tiles = _tiles(b * s_l, tile_tokens)
        step = math.ceil(b * s_l / tiles)
        d_hidden = torch.empty_like(x2d) if hidden.requires_grad else None
        d_params = [torch.zeros_like(p) if p.requires_grad else None for p in params]
        wanted = [p for p in params if p.requires_grad]
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, b * s_l, step):
            x_tile = x2d[start:start + step]
            with torch.enable_grad():
                x_tile = x_tile.detach().requires_grad_(d_hidden is not None)
                logits = lm_head(x_tile).float()
                loss = nn.functional.cross_entropy(logits, y1d[start:start + step], ignore_index=-100,
                                                   reduction="sum") * scale
                inputs = ([x_tile] if d_hidden is not None else []) + wanted
                grads = list(torch.autograd.grad(loss, inputs)) if inputs else []
            del logits
            total += loss.detach()
            if d_hidden is not None:
                d_hidden[start:start + step] = grads.pop(0)
            for d_param, grad in zip((g for g in d_params if g is not None), grads):
                d_param += grad
            del grads, loss
        ctx.save_for_backward(*(t for t in [d_hidden, *d_params] if t is not None))
        ctx.has_hidden_grad = d_hidden is not None
        ctx.param_mask = [g is not None for g in d_params]
        ctx.hidden_shape = hidden.shape
        return total

    @staticmethod
    def backward(ctx, grad_total):
        saved = iter(ctx.saved_tensors)
        d_hidden = next(saved).view(ctx.hidden_shape) * grad_total if ctx.has_hidden_grad else None
        d_params = [next(saved) * grad_total if here else None for here in ctx.param_mask]
        return (None, d_hidden, None, None, None, *d_params)


def tiled_loss(tile_tokens: int):
    """A ``TrainingModel.loss_fn``: (hidden [b, s_l, h], lm_head, labels [b, s_l], scale) -> scaled loss sum."""

    def loss_fn(hidden, lm_head, labels, scale):
        params = tuple(lm_head.parameters())
        return TiledLogitsLoss.apply(lm_head, hidden, labels, scale, tile_tokens, *params)

    loss_fn.tile_tokens = tile_tokens
    return loss_fn


def apply_loss_tiling(model, tile_tokens: int) -> None:
    if tile_tokens <= 0:
        raise ValueError(f"loss_tile_tokens must be positive, got {tile_tokens}")
    model.loss_fn = tiled_loss(tile_tokens)
