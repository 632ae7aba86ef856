"""Sequence tiling of the MLP and of the logits + loss (DeepSpeed ALST's ``TiledMLP`` / tiled loss).

Tiled MLP (``mlp_tile_tokens``). The MLP's intermediate activations are ``[s_l, intermediate]`` wide (3.5x the
hidden size for Llama-3) times three (gate, up, their product); tiling the sequence keeps only one tile of them
alive. ``TiledMLP`` is DeepSpeed's, op for op: forward runs the tiles under ``no_grad`` and saves just the MLP
input ``[b, s_l, h]``; backward recomputes each tile with autograd and backpropagates it at once, writing the
tile's input gradient into a preallocated ``[b, s_l, h]``. The number of tiles is ``ceil(s_l / mlp_tile_tokens)``
(one tile = plain MLP, no recompute). With FSDP2 the layer's parameters are unsharded while its backward runs,
so the per-tile weight gradients accumulate into the unsharded gradients that FSDP2 reduces afterwards (DeepSpeed's
``compute_params``, which only drive ZeRO's gradient buckets, have no place here).

Every tile loop here is ``trials.core.repeats.for_each_tile``: on real tensors it runs every tile; the memory
oracle accounts for the identical middle tiles of a long sequence without tracing each.

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
the result is ``sum of token cross-entropies * scale``, like ``trials.models.model.plain_loss``.

Tiled RMSNorm (``norm_tile_tokens``). HF's ``LlamaRMSNorm`` (and Qwen3's) upcasts its ``[b, s_l, h]`` input to
fp32, and autograd keeps the fp32 input and the fp32 normalised tensor for backward, whose own temporaries are
fp32 too: with bf16 compute that is ~7 fp32 copies of the hidden state alive at once in a checkpointed layer's
backward (2 bytes x h per token of input becomes ~28 x h), and at millions of tokens it is the largest memory
of the whole step once MLP, loss and activations are tiled or offloaded (``bench/ablation.py``). ``TiledRMSNorm``
saves only the input (in its own dtype) and the weight; forward and backward run the fp32 math one tile of
``norm_tile_tokens`` tokens at a time, backward by recomputing the tile under autograd (the same ops as the
module's own forward, so the result equals the plain model's to rounding). The role Liger-Kernel's fused
RMSNorm plays in ArcticTraining, in plain torch.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn as nn

from trials.core.repeats import for_each_tile


def _tiles(tokens: int, tile_tokens: int) -> int:
    return max(1, math.ceil(tokens / tile_tokens))


# -- tiled MLP ---------------------------------------------------------------------------------------------------


def _mlp_body(mlp, x):
    """The untiled MLP of the wrapped module (the class's own forward, not the tiled replacement). TiledMLP's
    backward passes tiles as [tokens, h]; MoE blocks take [b, s, h] only, so a 2-D tile runs as [1, tokens, h]."""
    if x.dim() == 2:
        return type(mlp).forward(mlp, x[None])[0]
    return type(mlp).forward(mlp, x)


def _autocast_body(device_type: str, dtype):
    """The MLP body under the caller's autocast: TiledMLP recomputes it in backward, where autocast is off."""

    def body(mlp, x):
        with torch.autocast(device_type, dtype=dtype):
            return _mlp_body(mlp, x)

    return body


class TiledMLP(torch.autograd.Function):
    """DeepSpeed's ``TiledMLP``, op for op, with its backward's tile loop in ``for_each_tile``.

    fn(mlp, x_tile) is the untiled MLP. Forward runs it on ``torch.chunk(x, shards, dim=-2)`` under ``no_grad`` and
    concatenates; backward recomputes each tile with autograd and backpropagates it at once, the tile's input
    gradient landing in its slice of a preallocated ``x_grad`` (the tile's ``.grad`` is a view of it). The same
    allocations in the same order as DeepSpeed's (the oracle's peaks are DeepSpeed's); the loop is ours so the
    memory oracle can account for identical tiles without tracing each (``trials.core.repeats``).
    """

    @staticmethod
    def forward(ctx, fn, mlp, x, shards: int):
        ctx.fn, ctx.mlp, ctx.shards = fn, mlp, shards
        ctx.save_for_backward(x)
        x_shards = list(torch.chunk(x, chunks=shards, dim=-2))
        with torch.no_grad():
            output_shards = for_each_tile(
                len(x_shards), lambda index: fn(mlp, x_shards[index]), x.shape[-2] // x_shards[0].shape[-2], True
            )
        return torch.cat(output_shards, dim=-2)

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        fn, mlp = ctx.fn, ctx.mlp
        x_requires_grad = x.requires_grad
        x = x.detach()
        x.requires_grad_(x_requires_grad)  # detach() unsets it
        x_shape = x.shape
        # rows [b * s, h], so a tile is a narrow of the sequence whatever the batch (reshape: x or the incoming
        # gradient may be non-contiguous)
        x = x.reshape(-1, x_shape[-1])
        incoming = grad_out.reshape(-1, x_shape[-1])
        x_grad = torch.zeros_like(x)
        x_shards = list(torch.chunk(x, chunks=ctx.shards, dim=0))
        full = x_shards[0].shape[0]

        def tile(index):
            x_shard = x_shards[index]
            x_shard.requires_grad_(x_requires_grad)
            rows = x_shard.shape[0]
            x_shard.grad = x_grad.narrow(0, index * full, rows).view_as(x_shard)
            incoming_shard = incoming.narrow(0, index * full, rows).view_as(x_shard)
            with torch.enable_grad():
                output = fn(mlp, x_shard)
            torch.autograd.backward(output, incoming_shard)
            return output  # alive until the next tile's output is, as a loop variable is

        last = for_each_tile(len(x_shards), tile, uniform=x.shape[0] // full)
        grads = None, None, x_grad.view(x_shape), None
        del last  # the last tile's output lives until here, as the loop variable it stands for would
        return grads


def _tiled_mlp_forward(self, x):
    """x [b, s_l, h] -> [b, s_l, h], in ceil(s_l / tile) sequence tiles."""
    shards = _tiles(x.shape[-2], self.autotune_tile_tokens)
    if shards == 1:
        return _mlp_body(self, x)
    device_type = x.device.type
    body = _mlp_body
    if torch.is_autocast_enabled(device_type):
        body = _autocast_body(device_type, torch.get_autocast_dtype(device_type))
    return TiledMLP.apply(body, self, x, shards)


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
    Saves d_hidden [b, s_l, h] and one gradient per lm_head parameter (fp32: accumulated over the tiles).
    """

    @staticmethod
    def forward(ctx, lm_head: nn.Module, hidden, labels, scale: float, tile_tokens: int, *params):
        b, s_l, h = hidden.shape
        x2d = hidden.detach().reshape(b * s_l, h)
        y1d = labels.reshape(b * s_l)
        tiles = _tiles(b * s_l, tile_tokens)
        step = math.ceil(b * s_l / tiles)
        d_hidden = torch.empty_like(x2d) if hidden.requires_grad else None
        # the weight gradient is a sum over every tile (~80 at 655K tokens per rank): fp32, whatever the weight's
        # dtype (FSDP's bf16 unsharded lm_head), rounded once when handed back
        d_params = [torch.zeros_like(p, dtype=torch.float32) if p.requires_grad else None for p in params]
        wanted = [p for p in params if p.requires_grad]
        total = hidden.new_zeros((), dtype=torch.float32)

        def tile(index):
            start = index * step
            x_tile = x2d[start : start + step]
            with torch.enable_grad():
                x_tile = x_tile.detach().requires_grad_(d_hidden is not None)
                logits = lm_head(x_tile).float()
                loss = (
                    nn.functional.cross_entropy(logits, y1d[start : start + step], ignore_index=-100, reduction="sum")
                    * scale
                )
                inputs = ([x_tile] if d_hidden is not None else []) + wanted
                grads = list(torch.autograd.grad(loss, inputs)) if inputs else []
            del logits
            total.add_(loss.detach())
            if d_hidden is not None:
                d_hidden[start : start + step] = grads.pop(0)
            for d_param, grad in zip((g for g in d_params if g is not None), grads):
                d_param += grad

        for_each_tile(math.ceil(b * s_l / step), tile, uniform=b * s_l // step)
        ctx.save_for_backward(*(t for t in [d_hidden, *d_params] if t is not None))
        ctx.has_hidden_grad = d_hidden is not None
        ctx.param_mask = [g is not None for g in d_params]
        ctx.param_dtypes = [p.dtype for p in params]
        ctx.hidden_shape = hidden.shape
        return total

    @staticmethod
    def backward(ctx, grad_total):
        saved = iter(ctx.saved_tensors)
        d_hidden = next(saved).view(ctx.hidden_shape) * grad_total if ctx.has_hidden_grad else None
        d_params = [
            (next(saved) * grad_total).to(dtype) if here else None
            for here, dtype in zip(ctx.param_mask, ctx.param_dtypes)
        ]
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


# -- tiled RMSNorm -----------------------------------------------------------------------------------------------


class TiledRMSNorm(torch.autograd.Function):
    """y = norm_module(x) over row tiles; saves x and the weight only, recomputes each tile in backward.

    x [b, s_l, ..., d] is viewed as rows [b * s_l * ..., d] (the norm is over the last dim); a tile is
    ``tile_tokens`` tokens, i.e. ``tile_tokens * rows_per_token`` rows (per-head norms have one row per head).
    """

    @staticmethod
    def forward(ctx, norm_module: nn.Module, x, weight, tile_rows: int):
        rows = x.reshape(-1, x.shape[-1])
        out = None

        def tile(index):
            nonlocal out
            start = index * tile_rows
            y_tile = _norm_body(norm_module, weight, rows[start : start + tile_rows])
            if out is None:  # the output dtype is the module's (weight * normalised.to(input dtype))
                out = rows.new_empty((rows.shape[0], rows.shape[1]), dtype=y_tile.dtype)
            out[start : start + tile_rows] = y_tile
            return y_tile  # alive until the next tile's is, as a loop variable is

        with torch.no_grad():
            last = for_each_tile(math.ceil(rows.shape[0] / tile_rows), tile, uniform=rows.shape[0] // tile_rows)
        ctx.save_for_backward(x, weight)
        ctx.norm_module, ctx.tile_rows = norm_module, tile_rows
        result = out.view(*x.shape[:-1], out.shape[-1])
        del last  # the last tile's output lives until here, as the loop variable it stands for would
        return result

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad_out.reshape(-1, grad_out.shape[-1])
        d_rows = torch.empty_like(rows) if ctx.needs_input_grad[1] else None
        d_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[2] else None
        tile_rows = ctx.tile_rows

        def tile(index):
            start = index * tile_rows
            with torch.enable_grad():
                x_tile = rows[start : start + tile_rows].detach().requires_grad_(d_rows is not None)
                w = weight.detach().requires_grad_(d_weight is not None)
                y_tile = _norm_body(ctx.norm_module, w, x_tile)
                inputs = [t for t, wanted in ((x_tile, d_rows is not None), (w, d_weight is not None)) if wanted]
                grads = list(torch.autograd.grad(y_tile, inputs, grad_rows[start : start + tile_rows]))
            if d_rows is not None:
                d_rows[start : start + tile_rows] = grads.pop(0)
            if d_weight is not None:
                d_weight.add_(grads.pop(0))
            return y_tile  # alive until the next tile's is, as a loop variable is

        last = for_each_tile(math.ceil(rows.shape[0] / tile_rows), tile, uniform=rows.shape[0] // tile_rows)
        grads = (
            None,
            None if d_rows is None else d_rows.view_as(x),
            None if d_weight is None else d_weight.to(weight.dtype),
            None,
        )
        del last  # the last tile's output lives until here, as the loop variable it stands for would
        return grads


def _norm_body(norm_module, weight, x):
    """The module class's own (untiled) forward on ``x`` with ``weight`` in place of its parameter.

    HF RMSNorm forwards read only ``self.weight``, plain attributes (``variance_epsilon``) and the class's own
    methods (Gemma's ``_norm``), so a bare instance of the class holding those stands in for the module: no hooks,
    no re-entry into the tiled forward, and the weight can be a detached leaf (backward) or whatever tensor
    ``functional_call`` swapped in (head-chunked attention).
    """
    cls = type(norm_module)
    stand_in = cls.__new__(cls)  # no __init__: nn.Module's bookkeeping stays out
    stand_in.__dict__.update({k: v for k, v in vars(norm_module).items() if not k.startswith("_") and k != "forward"})
    stand_in.__dict__["weight"] = weight
    return cls.forward(stand_in, x)


def _tiled_norm_forward(self, x):
    """x [b, s_l, ..., d] -> same shape, in ceil(s_l / tile) sequence tiles."""
    tokens = x.shape[0] * x.shape[1] if x.dim() >= 3 else x.shape[0]
    rows_per_token = max(1, x.numel() // x.shape[-1] // max(1, tokens))
    tile_rows = self.autotune_tile_tokens * rows_per_token
    if x.numel() // x.shape[-1] <= tile_rows:
        return type(self).forward(self, x)
    return TiledRMSNorm.apply(self, x, self.weight, tile_rows)


def rms_norm_modules(model) -> list[nn.Module]:
    """The model's RMSNorm modules (HF ``LlamaRMSNorm``, ``Qwen3RMSNorm``, ...): found by class name."""
    return [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]


def apply_norm_tiling(model, tile_tokens: int) -> None:
    if tile_tokens <= 0:
        raise ValueError(f"norm_tile_tokens must be positive, got {tile_tokens}")
    norms = rms_norm_modules(model)
    if not norms:
        raise ValueError("norm_tile_tokens: the model has no RMSNorm module to tile")
    for norm in norms:
        norm.autotune_tile_tokens = tile_tokens
        norm.forward = types.MethodType(_tiled_norm_forward, norm)
