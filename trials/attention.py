"""Attention as one op with a known memory footprint: output + logsumexp, never a [seq, seq] matrix.

Shapes (Hugging Face convention at the call site):
    query [batch, q_heads, seq, head_dim], key/value [batch, kv_heads, seq, head_dim]
    returns [batch, seq, q_heads, head_dim] (what HF attention interfaces return)

Causal masking is implied (training on whole sequences; position ids are not packed), so no mask tensor
is ever built. Kernels:
- ``flash``: flash-attn's ``flash_attn_func`` (CUDA, handles GQA natively);
- ``sdpa``: torch's fused SDPA. On CPU it runs the flash-style kernel, which saves (out, logsumexp) for
  backward; kv heads are repeated to the query heads first (the CPU kernel has no GQA), which costs
  2 * seq * (q_heads - kv_heads) * head_dim elements per layer — part of the known footprint.

The model calls attention through the HF interface registered under the name ``autotune``; each
attention module may carry ``module.autotune_attention`` (set by Ulysses / head chunking) that replaces
the core op for that module, so the same model object can be used with or without the stack.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTN_IMPLEMENTATION = "autotune"

try:  # optional GPU extra
    from flash_attn import flash_attn_func  # type: ignore
except Exception:  # pragma: no cover - flash-attn is not installable on CPU machines
    flash_attn_func = None


def flash_available(device: torch.device) -> bool:
    return flash_attn_func is not None and device.type == "cuda"


def causal_attention(query, key, value, scaling: float | None = None, kernel: str = "sdpa"):
    """[b, hq, s, d] x [b, hkv, s, d] -> [b, s, hq, d], causal."""
    if kernel == "flash":
        if not flash_available(query.device):
            raise RuntimeError("attention 'flash' needs flash-attn installed and a CUDA device")
        out = flash_attn_func(
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=True, softmax_scale=scaling
        )
        return out
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2)


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The HF attention interface ``autotune``: dispatches to the module's stack attention if any."""
    override = getattr(module, "autotune_attention", None)
    if override is not None:
        return override(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kernel = getattr(module, "autotune_kernel", "sdpa")
    return causal_attention(query, key, value, scaling=scaling, kernel=kernel), None


def _no_mask(*args, **kwargs):
    """Masks are implied causal; building one would cost O(seq^2) memory."""
    return None


def register() -> None:
    """Make ``attn_implementation="autotune"`` known to transformers (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, hf_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _no_mask)
