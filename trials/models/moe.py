"""Mixture-of-experts layers as grouped GEMMs: exact to transformers' eager experts, with static shapes.

Transformers' MoE models (Qwen3-MoE, Mixtral, ...) hold their experts as 3-D parameters (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]) in a module whose forward(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) dispatches by ``config._experts_implementation``. HF's ``eager`` one finds each expert's
tokens with ``nonzero``/``where`` (shapes that depend on the data, which FakeTensorMode cannot run) and indexes
each expert's weights, whose gradient autograd then builds as a full-size tensor per expert: E full copies of the
experts' weights per layer in backward, a cost that grows with E squared.

The implementation registered here as ``autotune`` sorts the T*k (token, slot) pairs by expert, gathers their
rows once and runs each projection as one grouped GEMM over all of them, the per-expert boundaries given as
offsets (a tensor): every shape is T*k rows whatever the routing, so the memory oracle traces it as it runs,
and the weight gradients are written per expert into one [E, ...] tensor. The GEMM is ``F.grouped_mm`` in bf16
(the CUDA kernel; its meta kernel takes bf16 only) and ``transformers``' ``grouped_mm_fallback`` op otherwise
(one ``mm`` per expert into the same buffers). Memory and FLOPs do not depend on the routing; its balance only
moves time between experts. A real step records the routing it saw (``routing_stats``): the most tokens one
expert received, beside the balanced share.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EXPERTS_IMPLEMENTATION = "autotune"


def is_moe_config(config) -> bool:
    """An HF config with routed experts: its family's expert count (``trials.models.families.Family.experts``) above 0."""
    from trials.models.families import family_of

    return family_of(config.model_type).experts(config) > 0


def is_experts_module(module) -> bool:
    """A module of a class decorated with transformers' ``use_experts_implementation``."""
    return all(hasattr(module, name) for name in ("has_gate", "is_transposed", "_apply_gate", "num_experts"))


def is_router_module(module) -> bool:
    """An MoE router (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``): its ``weight`` is a plain [E, H] Parameter."""
    return type(module).__name__.endswith("Router")


def experts_options(config) -> dict:
    """``from_config`` keyword arguments that make an MoE model's experts autotune's (none for a dense model)."""
    if not is_moe_config(config):
        return {}
    register()
    return {"experts_implementation": EXPERTS_IMPLEMENTATION}


def register() -> None:
    """Make ``experts_implementation="autotune"`` known to transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)


# -- the routing real steps saw ------------------------------------------------------------------------------------


class _Routing:
    stats: dict | None = None  # since ``reset_routing_stats``
    max_counts: torch.Tensor | None = None  # the most tokens one expert received, on the device, unread


def reset_routing_stats() -> None:
    _Routing.stats, _Routing.max_counts = None, None


def routing_stats() -> dict | None:
    """The routing real steps saw since ``reset_routing_stats``, maxima over the calls: {"max_tokens_per_expert",
    "balanced_tokens_per_expert" (T*k/E of the largest call), "experts", "top_k"}; None when no MoE layer ran.
    Reading it waits for the device (the count is read here, once, not in every layer)."""
    if _Routing.stats is None:
        return None
    return {**_Routing.stats, "max_tokens_per_expert": int(_Routing.max_counts)}


def _record(counts: torch.Tensor, slots: int, experts: int, top_k: int) -> None:
    """Fold one call's per-expert counts into the maxima without reading them: a value read in every MoE layer
    (every recompute and tile too) would make the host wait for the device there, exposing the communication the
    CPU would otherwise queue ahead."""
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(counts) or counts.device.type == "meta":  # the oracle's trace: no data, nothing seen
        return
    most = counts.detach().max()
    _Routing.max_counts = most if _Routing.max_counts is None else torch.maximum(_Routing.max_counts, most)
    stats = _Routing.stats or {"balanced_tokens_per_expert": 0.0}
    stats["balanced_tokens_per_expert"] = max(stats["balanced_tokens_per_expert"], slots / experts)
    stats["experts"], stats["top_k"] = experts, top_k
    _Routing.stats = stats


# -- the experts implementation ------------------------------------------------------------------------------------


def _check_layout(module) -> None:
    """Layouts HF's own grouped implementations handle (gate or not, bias or not, [E, out, in] or transposed,
    the gate as the class's ``_apply_gate``); expert parallelism (sentinel expert ids) is not supported."""
    weights = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"{type(module).__name__}: the autotune experts implementation has no expert parallelism")
    missing = [name for name in weights if getattr(module, name, None) is None or getattr(module, name).dim() != 3]
    if missing:
        raise ValueError(
            f"{type(module).__name__}: the autotune experts implementation needs 3-D {', '.join(weights)} "
            f"([experts, out, in], or [experts, in, out] when transposed); missing or not 3-D: {', '.join(missing)}"
        )


class _EmptyGroupsGetNoGradient(torch.autograd.Function):
    """The identity on an [E, ...] weight whose backward sets the gradient of every expert without rows to zero,
    in place (no memory beside it). ``F.grouped_mm``'s backward leaves those experts' weight gradients non-zero,
    or NaN, on Blackwell GPUs (pytorch#172439, open; pytorch#193633: NaN on sm_103 with torch 2.13): it computes
    each group's X^T dY and an empty group's output is never written. Experts without tokens are routine here (a
    layer's routing of one sequence), and a non-zero gradient would move weights no token used."""

    @staticmethod
    def forward(ctx, weight, empty):
        ctx.save_for_backward(empty)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        (empty,) = ctx.saved_tensors
        return grad.masked_fill_(empty.view(-1, *([1] * (grad.dim() - 1))), 0), None


def _grouped_mm(rows, weight, offsets):
    """rows [S, K] x weight [E, K, N] -> [S, N], expert e on rows [offsets[e-1], offsets[e]); an expert without
    rows gets a zero weight gradient on every GPU (``_EmptyGroupsGetNoGradient``)."""
    if rows.dtype == weight.dtype == torch.bfloat16:
        if weight.requires_grad:
            empty = torch.diff(offsets, prepend=offsets.new_zeros(1)) == 0
            weight = _EmptyGroupsGetNoGradient.apply(weight, empty)
        return F.grouped_mm(rows, weight, offs=offsets)
    return torch.ops.transformers.grouped_mm_fallback(rows, weight, offsets)


def _grouped_linear(rows, weight, offsets, bias, expert_of_row, transposed: bool, dtype):
    """Each row through its expert's linear layer (``weight`` [E, out, in], or [E, in, out] when transposed)."""
    weight = weight.to(dtype)
    out = _grouped_mm(rows.to(dtype), weight if transposed else weight.transpose(-2, -1), offsets)
    return out if bias is None else out + bias.to(dtype)[expert_of_row]


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """hidden [T, H], top_k_index / top_k_weights [T, k] -> [T, H]: sum over the k chosen experts of weight *
    expert(hidden). The pairs sorted by expert make each expert's rows one contiguous block of the grouped GEMMs.
    Under autocast the GEMMs run in its dtype (grouped GEMMs are not autocast ops)."""
    _check_layout(module)
    tokens, top_k = top_k_index.shape
    experts, slots = module.num_experts, tokens * top_k
    device = hidden_states.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden_states.dtype
    expert_of_row, order = torch.sort(top_k_index.reshape(-1), stable=True)
    rows = hidden_states[order // top_k]  # [T*k, H], grouped by expert
    # per-expert counts as a histogram: a tensor of E bins whatever the data (bincount's length depends on it)
    counts = torch.histc(expert_of_row.float(), bins=experts, min=0, max=experts - 1)
    _record(counts, slots, experts, top_k)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    bias = module.has_bias
    first = module.gate_up_proj if module.has_gate else module.up_proj
    first_bias = getattr(module, "gate_up_proj_bias" if module.has_gate else "up_proj_bias", None) if bias else None
    h = _grouped_linear(rows, first, offsets, first_bias, expert_of_row, module.is_transposed, dtype)
    h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
    down_bias = module.down_proj_bias if bias else None
    h = _grouped_linear(h, module.down_proj, offsets, down_bias, expert_of_row, module.is_transposed, dtype)
    if getattr(module, "has_post_expert_norm", False):
        h = module.post_expert_norm(h)
    h = h * top_k_weights.reshape(-1)[order, None].to(h.dtype)
    # back to (token, slot) order, then each token's k slots summed (deterministic, unlike index_add_ on CUDA)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return h[inverse].view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)
