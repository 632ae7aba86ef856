"""Attention as one op with a known memory footprint: output + logsumexp, never a [seq, seq] matrix.

Shapes (Hugging Face convention at the call site):
    query [batch, q_heads, seq, head_dim], key/value [batch, kv_heads, seq, head_dim]
    returns [batch, seq, q_heads, head_dim] (what HF attention interfaces return)

Causal masking is implied, so no [seq, seq] mask is ever built. A sequence may pack several documents
(``trials.kernels.documents.Documents``): attention then stays inside each document -- one varlen call
(``cu_seqlens``) on a flash kernel that declares one, else one causal call per document -- still without a mask. A layer may attend through a sliding window ``W`` (Hugging Face's ``sliding_window``: query ``i``
sees keys ``i-W+1 .. i``) and may softcap its logits (Gemma 2). Kernels (``trials.kernels.registry``):
- ``flash`` / ``flash3`` / ``flash4``: FlashAttention 2 / 3 / 4's ``flash_attn_func`` (CUDA, GQA natively, layout
  "bshd"; a window is its ``window_size`` -- (W - 1, 0), unlimited (-1, -1), FA4's (None, None) -- a softcap its
  ``softcap``). Head-chunked attention drives each one's low-level forward and backward (below);
- ``sdpa``: torch's fused SDPA. On CPU it runs the flash-style kernel, which saves (out, logsumexp) for
  backward; kv heads are repeated to the query heads first (the CPU kernel has no GQA), which costs
  2 * seq * (q_heads - kv_heads) * head_dim elements per layer — part of the known footprint. A window runs as
  blocks of ``WINDOW_BLOCK`` queries, each over its band of keys with a [block, block + W - 1] mask: memory
  O(block * W), never O(seq^2). What SDPA cannot run (a window on CUDA, any softcap) is refused with the reason
  (``trials.kernels.registry.attention_kernel_problem``).

The model calls attention through the HF interface registered under the name ``autotune``; each
attention module may carry ``module.autotune_attention`` (set by Ulysses / head chunking) that replaces
the core op for that module, so the same model object can be used with or without the stack.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from trials.core.repeats import for_each_kind, kind_of
from trials.kernels.documents import Documents, documents_of
from trials.kernels.registry import (
    FLASH_KERNELS,
    KERNELS,
    VARLEN_KERNELS,
    attention_kernel_problem,
    install_problem,
    kernel_problem,
)

ATTN_IMPLEMENTATION = "autotune"

FLASH_DTYPES = (torch.float16, torch.bfloat16)
WINDOW_BLOCK = 256  # queries per block of the CPU kernel's windowed attention


# -- the flash kernels' entry points: real (imported on use) or stand-ins ---------------------------------------------

_stand_ins: dict[str, dict] = {}  # kernel name -> {"layer", "forward", "backward"}: callables or None (the real one)


@contextlib.contextmanager
def flash_kernels(layer, forward=None, backward=None, kernel: str = "flash", varlen=None):
    """Use stand-ins for flash kernel ``kernel``'s entry points (``trials.kernels.registry.EntryPoints``: ``layer``,
    ``forward``, ``backward``; None keeps the real one) on any device while inside (restored on exit): the memory
    oracle runs the flash kernels under FakeTensorMode on a CPU-only torch with their memory footprints, and CPU
    tests run them through stand-ins with the real call signatures."""
    if kernel not in FLASH_KERNELS:
        raise ValueError(f"{kernel!r} is not a flash kernel ({', '.join(FLASH_KERNELS)})")
    saved = _stand_ins.get(kernel)
    _stand_ins[kernel] = {"layer": layer, "forward": forward, "backward": backward, "varlen": varlen}
    try:
        yield
    finally:
        if saved is None:
            _stand_ins.pop(kernel, None)
        else:
            _stand_ins[kernel] = saved


def _entry(kernel: str, which: str):
    stand_in = _stand_ins.get(kernel, {}).get(which)
    return stand_in if stand_in is not None else KERNELS[kernel].resolve(which)


def flash_problem(kernel: str = "flash") -> str | None:
    """Why flash kernel ``kernel``'s entry points cannot be used in this process (None: they import, or stand in)."""
    return None if kernel in _stand_ins else install_problem(kernel)


def _device_major(device: torch.device) -> int | None:
    return torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else None


def flash_available(device: torch.device, kernel: str = "flash") -> bool:
    """Whether flash kernel ``kernel`` runs on ``device``: stand-ins run anywhere; the real one needs its package
    and a GPU of a generation it is built for."""
    if kernel in _stand_ins:
        return True
    return device.type == "cuda" and kernel_problem(kernel, _device_major(device)) is None


def _require(kernel: str, device: torch.device) -> None:
    """Refuse, in one line naming the kernel and its package, a flash kernel that cannot run on ``device``."""
    if not flash_available(device, kernel):
        problem = kernel_problem(kernel, _device_major(device))
        raise RuntimeError(f"attention {kernel!r} cannot run here: {problem or f'the device is {device}'}")


def flash_inputs(*tensors, kernel: str = "flash"):
    """q/k/v in the one 16-bit dtype the flash kernels compute in.

    Under autocast, HF's rotary step multiplies 16-bit q/k by fp32 cos/sin, so q/k arrive in fp32 while v is
    16-bit; flash-attn takes fp16/bf16 only, all three in one dtype. The target is the autocast dtype when
    autocast is on, else the 16-bit dtype among the inputs; all-fp32 inputs are an error (flash has no fp32)."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type) and torch.get_autocast_dtype(device_type) in FLASH_DTYPES:
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = next((t.dtype for t in reversed(tensors) if t.dtype in FLASH_DTYPES), None)
    if dtype is None:
        raise RuntimeError(
            f"attention {kernel!r} computes in fp16/bf16 only, got q/k/v in "
            f"{', '.join(str(t.dtype) for t in tensors)} (use compute dtype bf16, or attention 'sdpa')"
        )
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in tensors)


def band(window: int | None, seq_len: int) -> int | None:
    """The window a kernel runs for ``seq_len`` keys: None when it covers the whole sequence (plain causal)."""
    return window if window is not None and window < seq_len else None


def _refuse(kernel: str, device: torch.device, window, softcap) -> None:
    features = {"window": window} if window else {}
    if softcap:
        features["softcap"] = softcap
    problem = attention_kernel_problem(kernel, features, device.type == "cuda")
    if problem:
        raise RuntimeError(problem)


def causal_attention(
    query,
    key,
    value,
    scaling: float | None = None,
    kernel: str = "sdpa",
    window: int | None = None,
    softcap=None,
    documents: Documents | None = None,
):
    """[b, hq, s, d] x [b, hkv, s, d] -> [b, s, hq, d], causal (within ``window`` keys when given), inside each of
    ``documents`` when given."""
    if _packed(documents):
        return _document_attention(query, key, value, scaling, kernel, window, softcap, documents)
    window = band(window, key.shape[2])
    if kernel in FLASH_KERNELS:
        _require(kernel, query.device)
        query, key, value = flash_inputs(query, key, value, kernel=kernel)
        out = _entry(kernel, "layer")(
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            softmax_scale=scaling,
            causal=True,
            window_size=_window_size(kernel, window),
            softcap=softcap or 0.0,
        )
        return out[0] if isinstance(out, tuple) else out  # FA4 returns (out, lse); FA3 with return_attn_probs
    _refuse(kernel, query.device, window, softcap)
    if window:
        scale = query.shape[-1] ** -0.5 if scaling is None else scaling
        device_type = query.device.type
        if torch.is_autocast_enabled(device_type):  # what autocast does for F.scaled_dot_product_attention
            dtype = torch.get_autocast_dtype(device_type)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        return _WindowedAttention.apply(query, key, value, scale, window).transpose(1, 2)
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2)


def hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The HF attention interface ``autotune``: dispatches to the module's stack attention if any."""
    override = getattr(module, "autotune_attention", None)
    if override is not None:
        return override(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    kernel = getattr(module, "autotune_kernel", "sdpa")
    out = causal_attention(
        query,
        key,
        value,
        scaling,
        kernel,
        window=kwargs.get("sliding_window"),
        softcap=kwargs.get("softcap"),
        documents=documents_of(kwargs, key.shape[2]),
    )
    return out, None


def _no_mask(*args, **kwargs):
    """Masks are implied causal; building one would cost O(seq^2) memory."""
    return None


def register() -> None:
    """Make ``attn_implementation="autotune"`` known to transformers (idempotent)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ALL_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, hf_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _no_mask)


# -- kernel-level forward/backward (for head-chunked attention, which saves out + logsumexp only) -------------
#
# ``attention_forward`` returns the output and the kernel's residuals (logsumexp, and RNG state where the kernel
# has one); ``attention_backward`` takes them back, so a caller can drop q/k/v between forward and backward and
# recompute them, without recomputing the attention itself. Tensors are in the kernel's own layout
# (``head_layout``), so the caller can produce them densely in one copy (the CPU flash kernel is many times
# slower on some strided inputs, e.g. one head viewed out of a wider buffer):
#   "bhsd": query [b, hq, s, d], key/value [b, hkv, s, d]   (torch SDPA kernels: CPU flash, CUDA mem-efficient)
#   "bshd": query [b, s, hq, d], key/value [b, s, hkv, d]   (the flash kernels)
# hq is a multiple of hkv (GQA); out has the query's shape and layout.


def head_layout(kernel: str) -> str:
    return KERNELS[kernel].layout


def _repeat_kv(tensor, groups: int):
    """[b, h, s, d] -> [b, h * groups, s, d] (the GQA expansion HF's ``repeat_kv`` does)."""
    return tensor if groups == 1 else tensor.repeat_interleave(groups, dim=1)


def _sum_kv_groups(grad, groups: int):
    """Gradient of ``_repeat_kv``: [b, h * groups, s, d] -> [b, h, s, d]."""
    if groups == 1:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, h // groups, groups, s, d).sum(dim=2)


def _window_size(kernel: str, window: int | None) -> tuple:
    """A causal call's (window_size_left, window_size_right) in ``kernel``'s form: query i sees keys i - left ..
    i + right; unlimited is -1 in FA2 / FA3 and None in FA4."""
    if window:
        return (window - 1, 0)
    return (None, None) if kernel == "flash4" else (-1, -1)


def attention_forward(
    query,
    key,
    value,
    scaling: float,
    kernel: str = "sdpa",
    window=None,
    softcap=None,
    documents=None,
    causal: bool = True,
):
    """Causal attention (within ``window`` keys, inside each of ``documents``) without autograd, in
    ``head_layout(kernel)``; returns (out, residuals tuple). Packed documents run one call per document: the
    residuals are then one fp32 logsumexp [b, h, s] holding each document's rows. ``causal=False``: every query sees
    every key (a ring's block of earlier keys, ``trials.stack.ring``; no window, one document)."""
    if not causal and (window or documents is not None):
        raise ValueError("a sliding window and packed documents are causal")
    if _packed(documents):
        return _per_document_forward(query, key, value, scaling, kernel, window, softcap, documents)
    if kernel in FLASH_KERNELS:
        _require(kernel, query.device)
        left, right = _window_size(kernel, band(window, key.shape[1]))
        query, key, value = flash_inputs(query, key, value, kernel=kernel)
        forward = _entry(kernel, "forward")
        if kernel == "flash":  # (out, softmax_lse, S_dmask, rng_state); positional, as flash-attn 2's op takes them
            out, lse, _, rng_state = forward(
                query, key, value, 0.0, scaling, causal, left, right, softcap or 0.0, None, False
            )
            return out, (lse, rng_state)
        kwargs = dict(softmax_scale=scaling, causal=causal, softcap=softcap or 0.0)
        kwargs.update(window_size_left=left, window_size_right=right)
        if kernel == "flash3":  # (out, softmax_lse, out_accum, softmax_lse_accum)
            out, lse, *_ = forward(query, key, value, **kwargs)
        else:  # flash4: (out, lse, p, row_max); lse only when asked for (or when an input requires grad)
            out, lse, *_ = forward(query, key, value, **kwargs, return_lse=True)
        return out, (lse,)
    window = band(window, key.shape[2])
    _refuse(kernel, query.device, window, softcap)
    groups = query.shape[1] // key.shape[1]
    k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
    if window:
        return _windowed_forward(query, k, v, scaling, window)
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(query, k, v, 0.0, causal, scale=scaling)
        return out, (lse,)
    # CUDA "sdpa": the memory-efficient kernel (any float dtype, returns logsumexp; the flash one is 16-bit only).
    # Not necessarily the backend F.scaled_dot_product_attention picks for a whole layer (cuDNN or flash in 16-bit
    # on recent GPUs), so its speed is a kernel of its own.
    out, lse, seed, offset = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, k, v, None, True, 0.0, causal, scale=scaling
    )
    return out, (lse, seed, offset)


def attention_backward(
    grad_out,
    query,
    key,
    value,
    out,
    residuals,
    scaling: float,
    kernel: str = "sdpa",
    window=None,
    softcap=None,
    documents=None,
    causal: bool = True,
):
    """Gradients (dq, dk, dv) of ``attention_forward``, same layout and shapes as (query, key, value)."""
    if _packed(documents):
        return _per_document_backward(
            grad_out, query, key, value, out, residuals, scaling, kernel, window, softcap, documents
        )
    if kernel in FLASH_KERNELS:
        left, right = _window_size(kernel, band(window, key.shape[1]))
        backward, softcap = _entry(kernel, "backward"), softcap or 0.0
        kwargs = dict(softmax_scale=scaling, softcap=softcap, window_size_left=left, window_size_right=right)
        if kernel == "flash4":  # allocates and returns (dq, dk, dv); its order: q, k, v, out, dout, lse
            (lse,) = residuals
            return backward(query, key, value, out, grad_out, lse, causal=causal, **kwargs)[:3]
        dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
        if kernel == "flash":  # into dq/dk/dv; returns softmax_d
            lse, rng_state = residuals
            args = (grad_out, query, key, value, out, lse, dq, dk, dv, 0.0, scaling, causal, left, right, softcap)
            backward(*args, None, False, rng_state)
        else:  # flash3: into dq/dk/dv; returns softmax_d
            (lse,) = residuals
            backward(grad_out, query, key, value, out, lse, dq=dq, dk=dk, dv=dv, is_causal=causal, **kwargs)
        return dq, dk, dv
    window = band(window, key.shape[2])
    groups = query.shape[1] // key.shape[1]
    k, v = _repeat_kv(key, groups), _repeat_kv(value, groups)
    if window:
        dq, dk, dv = _windowed_backward(grad_out, query, k, v, out, residuals, scaling, window)
    elif query.device.type == "cpu":
        (lse,) = residuals
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, k, v, out, lse, 0.0, causal, scale=scaling
        )
    else:
        lse, seed, offset = residuals
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            grad_out, query, k, v, None, out, lse, seed, offset, 0.0, [True, True, True, False], causal, scale=scaling
        )
    return dq, _sum_kv_groups(dk, groups), _sum_kv_groups(dv, groups)


def residuals_from_lse(kernel: str, lse, like) -> tuple:
    """The residuals ``attention_backward`` takes for ``kernel``, from one call's rows of a logsumexp kept for
    several calls (a ring's blocks merged, packed documents side by side; fp32 [b, h, rows], contiguous):
    FlashAttention 2 also takes an RNG state, CUDA SDPA (memory-efficient) a philox seed and offset and a logsumexp
    padded to 32 rows; none is read without dropout."""
    if kernel == "flash":
        return (lse, None)
    if kernel == "sdpa" and like.device.type == "cuda":
        rows = lse.shape[-1]
        padded = torch.nn.functional.pad(lse, (0, -rows % 32))
        empty = torch.empty((), dtype=torch.int64, device=like.device)
        return (padded, empty, empty)
    return (lse,)


# -- packed documents -------------------------------------------------------------------------------------------------
# Each document is a causal sequence of its own: the kernel runs on its rows of q/k/v (views, no copy of the whole
# sequence), within its window. A flash kernel with a varlen entry point runs a whole layer in one call instead.
# The per-document calls are a ``for_each_kind`` loop: each call leaves memory as it found it (it writes its rows of
# outputs made before the loop), and documents of one length run the same ops on the same shapes, in any order, so
# the memory oracle traces the first document of each length and accounts for the rest
# (``trials.core.repeats``); on real tensors every document runs.


def _seq_dim(kernel: str) -> int:
    return 1 if head_layout(kernel) == "bshd" else 2


def _packed(documents: Documents | None) -> bool:
    return documents is not None and len(documents.lengths) > 1


def _for_each_document(loop: str, documents: Documents, tokens: int, kernel: str, body, *context):
    """``body(index, rows)`` for each document in order, ``rows`` the ``Tensor.narrow`` arguments of its tokens in
    ``kernel``'s layout. ``loop``: which body it is; ``context``: every tensor and argument ``body`` reads besides
    ``rows``. With the document's length, the grad mode and autocast, they are the iteration's kind (what its ops
    depend on)."""
    if documents.total != tokens:
        raise ValueError(f"documents cover {documents.total} tokens, attention sees {tokens}")
    dim, spans, lengths = _seq_dim(kernel), documents.spans(), documents.lengths
    common = kind_of(loop, kernel, *context)
    for_each_kind(
        len(spans),
        lambda index: body(index, (dim, spans[index][0], lengths[index])),
        lambda index: (common, lengths[index]),
    )


def _per_document_forward(query, key, value, scaling, kernel, window, softcap, documents: Documents):
    """(out, (lse,)): each document's output and logsumexp in its rows of one output and one fp32 logsumexp
    [b, h, s], both made before the first call, so every document's call is the same and nothing else is kept."""
    dim = _seq_dim(kernel)
    out = query.new_empty(query.shape)
    lse = query.new_empty((query.shape[0], query.shape[3 - dim], query.shape[dim]), dtype=torch.float32)

    def document(_, rows):
        part, residuals = attention_forward(
            query.narrow(*rows), key.narrow(*rows), value.narrow(*rows), scaling, kernel, window, softcap
        )
        out.narrow(*rows).copy_(part)
        lse.narrow(2, rows[1], rows[2]).copy_(residuals[0][..., : rows[2]])

    _for_each_document(
        "per-document forward",
        documents,
        key.shape[dim],
        kernel,
        document,
        query,
        key,
        value,
        out,
        lse,
        scaling,
        window,
        softcap,
    )
    return out, (lse,)


def _per_document_backward(grad_out, query, key, value, out, residuals, scaling, kernel, window, softcap, documents):
    (lse,) = residuals
    grads = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)

    def document(_, rows):
        parts = attention_backward(
            grad_out.narrow(*rows).contiguous(),
            query.narrow(*rows),
            key.narrow(*rows),
            value.narrow(*rows),
            out.narrow(*rows),
            residuals_from_lse(kernel, lse.narrow(2, rows[1], rows[2]).contiguous(), query),
            scaling,
            kernel,
            window,
            softcap,
        )
        for grad, part in zip(grads, parts):
            grad.narrow(*rows).copy_(part)

    _for_each_document(
        "per-document backward",
        documents,
        key.shape[_seq_dim(kernel)],
        kernel,
        document,
        grad_out,
        query,
        key,
        value,
        out,
        lse,
        *grads,
        scaling,
        window,
        softcap,
    )
    return grads


def _document_attention(query, key, value, scaling, kernel, window, softcap, documents: Documents):
    """A whole layer over packed documents: [b, hq, s, d] x [b, hkv, s, d] -> [b, s, hq, d]."""
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    if kernel in VARLEN_KERNELS:
        _require(kernel, query.device)
        query, key, value = flash_inputs(query, key, value, kernel=kernel)
        if query.shape[0] != 1:
            raise ValueError(f"packed documents are one sequence per batch, got batch {query.shape[0]}")
        cu_seqlens = documents.cu_seqlens(query.device)
        longest = documents.max_length
        varlen = _entry(kernel, "varlen")
        # a stand-in may ask for the host boundaries (the oracle's fake counts each document's work: a fake
        # cu_seqlens has no values)
        told = {"documents": documents} if getattr(varlen, "takes_documents", False) else {}
        out = varlen(
            query[0].transpose(0, 1),  # [s, h, d]: the documents' tokens back to back
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            cu_seqlens_q=cu_seqlens,
            cu_seqlens_k=cu_seqlens,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            softmax_scale=scaling,
            causal=True,
            window_size=_window_size(kernel, window if window and window < longest else None),
            softcap=softcap or 0.0,
            **told,
        )
        out = out[0] if isinstance(out, tuple) else out
        return out.unsqueeze(0)
    if kernel in FLASH_KERNELS:
        _require(kernel, query.device)
        query, key, value = flash_inputs(query, key, value, kernel=kernel)
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))  # [b, s, h, d]
        return _DocumentAttention.apply(query, key, value, scaling, kernel, window, softcap, documents)
    _refuse(kernel, query.device, band(window, documents.max_length), softcap)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # what autocast does for F.scaled_dot_product_attention
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    return _DocumentAttention.apply(query, key, value, scaling, kernel, window, softcap, documents).transpose(1, 2)


class _DocumentAttention(torch.autograd.Function):
    """Attention of a whole layer over packed documents, one kernel call per document (the kernel's layout in and
    out): saves q, k, v, out and the documents' logsumexps side by side in one tensor, what the kernel's own
    autograd saves for one sequence."""

    @staticmethod
    def forward(ctx, query, key, value, scaling, kernel, window, softcap, documents):
        out, residuals = attention_forward(query, key, value, scaling, kernel, window, softcap, documents)
        ctx.save_for_backward(query, key, value, out, *residuals)
        ctx.args = (scaling, kernel, window, softcap, documents)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, *residuals = ctx.saved_tensors
        scaling, kernel, window, softcap, documents = ctx.args
        grads = attention_backward(
            grad_out, query, key, value, out, tuple(residuals), scaling, kernel, window, softcap, documents
        )
        return (*grads, None, None, None, None, None)


# -- sliding windows on the CPU kernel -----------------------------------------------------------------------------
# Query block [a, e) attends keys [max(0, a - W + 1), e): a [e - a, e - lo] additive mask holds the causal band. The
# kernel computes whole blocks, so its work is about (WINDOW_BLOCK + W) keys per query, twice the band at most.


def _blocks(seq_len: int, window: int):
    step = min(window, WINDOW_BLOCK)
    for start in range(0, seq_len, step):
        end = min(start + step, seq_len)
        yield start, end, max(0, start - window + 1)


def _band_mask(start: int, end: int, low: int, window: int, like: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(start, end, device=like.device).unsqueeze(1)
    cols = torch.arange(low, end, device=like.device).unsqueeze(0)
    visible = (cols <= rows) & (cols > rows - window)
    return torch.zeros(visible.shape, dtype=like.dtype, device=like.device).masked_fill_(~visible, float("-inf"))


def _windowed_forward(query, key, value, scaling, window: int):
    """[b, h, s, d] (kv heads already repeated) -> (out [b, h, s, d], (lse [b, h, s],)), block by block."""
    out = torch.empty_like(query)
    lse = query.new_empty(query.shape[:3], dtype=torch.float32)
    for start, end, low in _blocks(query.shape[2], window):
        mask = _band_mask(start, end, low, window, query)
        block_out, block_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query[:, :, start:end], key[:, :, low:end], value[:, :, low:end], 0.0, False, attn_mask=mask, scale=scaling
        )
        out[:, :, start:end] = block_out
        lse[:, :, start:end] = block_lse
        del mask, block_out, block_lse
    return out, (lse,)


def _windowed_backward(grad_out, query, key, value, out, residuals, scaling, window: int):
    """Gradients of ``_windowed_forward``: dq block by block, dk/dv summed over the blocks that see each key."""
    (lse,) = residuals
    dq, dk, dv = torch.empty_like(query), torch.zeros_like(key), torch.zeros_like(value)
    for start, end, low in _blocks(query.shape[2], window):
        mask = _band_mask(start, end, low, window, query)
        rows = slice(start, end)
        block_dq, block_dk, block_dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out[:, :, rows].contiguous(),
            query[:, :, rows],
            key[:, :, low:end],
            value[:, :, low:end],
            out[:, :, rows],
            lse[:, :, rows],
            0.0,
            False,
            attn_mask=mask,
            scale=scaling,
        )
        dq[:, :, rows] = block_dq
        dk[:, :, low:end] += block_dk
        dv[:, :, low:end] += block_dv
        del mask, block_dq, block_dk, block_dv
    return dq, dk, dv


class _WindowedAttention(torch.autograd.Function):
    """Sliding-window attention of a whole layer on the CPU kernel: saves q, k, v, out and logsumexp (what SDPA's
    own autograd saves). query [b, hq, s, d], key/value [b, hkv, s, d] -> out [b, hq, s, d]."""

    @staticmethod
    def forward(ctx, query, key, value, scaling: float, window: int):
        groups = query.shape[1] // key.shape[1]
        out, (lse,) = _windowed_forward(query, _repeat_kv(key, groups), _repeat_kv(value, groups), scaling, window)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scaling, ctx.window = scaling, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        groups = query.shape[1] // key.shape[1]
        dq, dk, dv = _windowed_backward(
            grad_out, query, _repeat_kv(key, groups), _repeat_kv(value, groups), out, (lse,), ctx.scaling, ctx.window
        )
        return dq, _sum_kv_groups(dk, groups), _sum_kv_groups(dv, groups), None, None


# -- the install-time check (bin/setup-gpu) ---------------------------------------------------------------------------


def check_kernel(kernel: str, device: str = "cuda", seq: int = 256, heads: tuple[int, int] = (4, 2), dim: int = 64):
    """Run flash kernel ``kernel`` through every call the stack makes (``causal_attention``, the whole layer, and
    ``attention_forward`` / ``attention_backward``, the head chunks; each with and without a sliding window) in
    bf16 on ``device``, against SDPA's fp32 math. Returns the line ``bin/setup-gpu`` prints; raises with the cause
    (a ``TypeError`` where the installed kernel's signature drifted from the calls above), so a kernel the stack
    cannot call is refused when it is installed, not in the first trial."""
    generator = torch.Generator().manual_seed(0)
    q_heads, kv_heads = heads
    q, k, v = (torch.randn(1, seq, h, dim, generator=generator) for h in (q_heads, kv_heads, kv_heads))
    dout = torch.randn(1, seq, q_heads, dim, generator=generator)
    scaling = dim**-0.5
    worst = 0.0
    for window in (None, seq // 4):
        expected, expected_grads = _fp32_reference(q, k, v, dout, scaling, window)
        on = [t.to(device, torch.bfloat16) for t in (q, k, v, dout)]
        layer_in = [t.detach().transpose(1, 2).requires_grad_() for t in on[:3]]  # [b, h, s, d], as HF passes
        out = causal_attention(*layer_in, scaling, kernel, window=window)
        out.backward(on[3])
        chunk_out, residuals = attention_forward(*on[:3], scaling, kernel, window)
        chunk_grads = attention_backward(on[3], *on[:3], chunk_out, residuals, scaling, kernel, window)
        got = {
            "layer": (out, [t.grad.transpose(1, 2) for t in layer_in]),
            "head chunk": (chunk_out, list(chunk_grads)),
        }
        for call, (result, grads) in got.items():
            for name, value, reference in zip(("out", "dq", "dk", "dv"), (result, *grads), (expected, *expected_grads)):
                error = (value.float().cpu() - reference).abs().max().item()
                scale = reference.abs().max().item()
                if not error <= 0.02 * scale + 1e-3:  # bf16 rounding of inputs and outputs; NaN fails too
                    window_said = f", window {window}" if window else ""
                    raise RuntimeError(
                        f"{call} {name} differs from SDPA's by {error:.3g} (of {scale:.3g}{window_said})"
                    )
                worst = max(worst, error / scale)
    where = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else str(device)
    return (
        f"its layer and head-chunk forward and backward (as the stack calls them) match SDPA on {where} "
        f"(worst {worst:.1%} of the largest value)"
    )


def _fp32_reference(q, k, v, dout, scaling, window):
    """SDPA's math in fp32 on the CPU: out and (dq, dk, dv), in the flash layout [b, s, h, d]."""
    q, k, v = (t.detach().transpose(1, 2).float().requires_grad_() for t in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    seq = q.shape[2]
    rows, cols = torch.arange(seq).unsqueeze(1), torch.arange(seq).unsqueeze(0)
    visible = (cols <= rows) & ((cols > rows - window) if window else True)
    out = F.scaled_dot_product_attention(
        q, _repeat_kv(k, groups), _repeat_kv(v, groups), attn_mask=visible, scale=scaling
    )
    out.backward(dout.transpose(1, 2).float())
    return out.detach().transpose(1, 2), [t.grad.transpose(1, 2) for t in (q, k, v)]
