"""Attention kernels (issue 39): FlashAttention 2 / 3 / 4 in the stack and the oracle, on CPU.

- Signatures: the CPU stand-ins here and the oracle's fakes take the real entry points' arguments; the real
  signatures are data below (copied from the source), and every call the stack makes binds to them.
- Exactness: each flash kernel, through CPU stand-ins that compute what the real kernel computes from the arguments
  it is given, gives SDPA's loss and gradients, whole layers and head-chunked, with and without a sliding window;
  at the kernel level, its forward / backward (softcap included) equal an fp32 reference.
- The oracle: a traced step with each flash kernel runs its fakes, and their bytes are the footprints the source
  allocates (forward: out + fp32 lse; backward: each kernel's scratch).
- Refusal: a kernel that is not installed is refused in one line naming it, its package and bin/setup-gpu.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.model_families import TINY_WINDOW, save, tiny_configs
from trials.kernels import attention
from trials.kernels.registry import FLASH_KERNELS, KERNELS, VARLEN_KERNELS, forget_resolved

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

# -- the real signatures ---------------------------------------------------------------------------------------------
# Dao-AILab/flash-attention at commit 0251105a2fb19d2957484b7f023cd8c115286ced (annotations dropped):
#   flash:  flash_attn/flash_attn_interface.py  flash_attn_func l. 1156; _flash_attn_forward l. 85 and
#           _flash_attn_backward l. 253 (``_wrapped_flash_attn_forward`` / ``_backward`` on torch >= 2.4);
#           flash_attn_varlen_func l. 1391 (the same in release 2.8.3, l. 1370)
#   flash3: hopper/flash_attn_interface.py      flash_attn_func l. 809; _flash_attn_forward l. 60;
#           _flash_attn_backward l. 259
# and flash-attn-4's wheel of the release the registry pins (4.0.0b36; checked against it below):
#   flash4: flash_attn/cute/interface.py        flash_attn_func l. 4145; _flash_attn_fwd l. 678; _flash_attn_bwd l. 2241
REAL_SIGNATURES = {
    "flash": {
        "layer": "q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
        "alibi_slopes=None, deterministic=False, return_attn_probs=False",
        "forward": "q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, "
        "alibi_slopes, return_softmax",
        "backward": "dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left, "
        "window_size_right, softcap, alibi_slopes, deterministic, rng_state=None",
        "varlen": "q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None, "
        "causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, "
        "return_attn_probs=False, block_table=None",
    },
    "flash3": {
        "layer": "q, k, v, softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, "
        "v_descale=None, window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None, "
        "deterministic=False, sm_margin=0, return_attn_probs=False",
        "forward": "q, k, v, k_new=None, v_new=None, qv=None, out_=None, cu_seqlens_q=None, cu_seqlens_k=None, "
        "cu_seqlens_k_new=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, "
        "page_table=None, kv_batch_idx=None, leftpad_k=None, rotary_cos=None, rotary_sin=None, "
        "seqlens_rotary=None, q_descale=None, k_descale=None, v_descale=None, softmax_scale=None, causal=False, "
        "window_size_left=-1, window_size_right=-1, attention_chunk=0, softcap=0.0, rotary_interleaved=True, "
        "scheduler_metadata=None, num_splits=1, pack_gqa=None, sm_margin=0",
        "backward": "dout, q, k, v, out, softmax_lse, cu_seqlens_q=None, cu_seqlens_k=None, sequed_q=None, "
        "sequed_k=None, max_seqlen_q=None, max_seqlen_k=None, dq=None, dk=None, dv=None, softmax_scale=None, "
        "is_causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0, deterministic=False, sm_margin=0",
    },
    "flash4": {
        "layer": "q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, "
        "window_size=(None, None), learnable_sink=None, softcap=0.0, num_splits=1, pack_gqa=None, "
        "deterministic=False, score_mod=None, score_mod_bwd=None, mask_mod=None, aux_tensors=None, "
        "aux_scalars=None, block_sparse_tensors=None, block_sparse_tensors_bwd=None, return_lse=False, "
        "gather_bwd_recompute_p=False, gather_bwd_token_chunk=None",
        "forward": "q, k, v, qv=None, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None, seqused_k=None, "
        "max_seqlen_q=None, max_seqlen_k=None, min_seqlen_k=None, page_table=None, softmax_scale=None, "
        "causal=False, softcap=None, window_size_left=None, window_size_right=None, learnable_sink=None, "
        "tile_mn=None, mma_pv_is_rs=None, intra_wg_overlap=None, num_threads=384, num_splits=1, pack_gqa=None, "
        "_arch=None, score_mod=None, mask_mod=None, block_sparse_tensors=None, return_lse=False, out=None, "
        "lse=None, aux_tensors=None, aux_scalars=None, q_descale=None, k_descale=None, v_descale=None, "
        "gather_kv_indices=None, scheduler_metadata=None, seqlen_k_per_split=None, "
        "disable_scheduler_metadata=False, gather_bwd_recompute_p=False",
        "backward": "q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None, "
        "window_size_right=None, m_block_size=64, n_block_size=128, num_threads=256, pack_gqa=False, "
        "num_stages_Q=2, num_stages_dO=2, SdP_swapAB=False, dKV_swapAB=False, dQ_swapAB=False, "
        "AtomLayoutMSdP=2, AtomLayoutNdKV=2, AtomLayoutMdQ=2, V_in_regs=False, cu_seqlens_q=None, "
        "cu_seqlens_k=None, seqused_q=None, seqused_k=None, max_seqlen_q=None, max_seqlen_k=None, "
        "deterministic=False, dq=None, dk=None, dv=None, score_mod=None, score_mod_bwd=None, mask_mod=None, "
        "aux_tensors=None, aux_scalars=None, block_sparse_tensors=None, dlse=None, learnable_sink=None",
    },
}
WHICH = ("layer", "forward", "backward")
DECLARED = (*WHICH, "varlen")  # every entry point a kernel may declare (``EntryPoints``)


def real_signature(kernel: str, which: str) -> inspect.Signature:
    namespace: dict = {}
    exec(f"def entry({REAL_SIGNATURES[kernel][which]}): pass", namespace)
    return inspect.signature(namespace["entry"])


def check_signature(stand_in, real: inspect.Signature) -> None:
    """``stand_in`` takes a subset of the real parameters: its positional ones are the real ones' first, in order,
    and every one it names is a real one with the real default where the real one has one (the rest are
    keyword-only, or swallowed by **kwargs)."""
    ours = inspect.signature(stand_in).parameters.values()
    real_params = list(real.parameters.values())
    positional = [p for p in ours if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert [p.name for p in positional] == [p.name for p in real_params[: len(positional)]], stand_in
    for p in ours:
        if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
            continue
        assert p.name in real.parameters, (stand_in, p.name)
        default = real.parameters[p.name].default
        assert default is inspect.Parameter.empty or p.default == default, (stand_in, p.name, p.default)


# -- CPU stand-ins: what each real kernel computes from its arguments -------------------------------------------------


def reference(q, k, v, scale, causal, left, right, softcap):
    """fp32 attention of [b, s, h, d] inputs as flash-attn defines it (GQA; query i sees keys i - left .. i + right,
    -1 / None unlimited; causal sets right 0; softcap: cap * tanh(scores / cap)): (out [b, s, hq, d] fp32,
    lse [b, hq, s] fp32), whatever autocast is on (a kernel computes in its own precision)."""
    with torch.autocast("cpu", enabled=False):
        return _reference(q, k, v, scale, causal, left, right, softcap)


def _reference(q, k, v, scale, causal, left, right, softcap):
    q, k, v = (t.float() for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    k, v = (t.repeat_interleave(groups, dim=2) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    rows, cols = torch.arange(q.shape[1])[:, None], torch.arange(k.shape[1])[None, :]
    right = 0 if causal else right
    visible = torch.ones(scores.shape[-2:], dtype=torch.bool)
    if left is not None and left >= 0:
        visible &= cols >= rows - left
    if right is not None and right >= 0:
        visible &= cols <= rows + right
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(scores - lse[..., None]), v)
    return out, lse


def _check_inputs(*tensors):
    dtypes = {t.dtype for t in tensors}
    assert len(dtypes) == 1 and dtypes <= {torch.float16, torch.bfloat16}, dtypes  # what mha_fwd / mha_bwd check


def _gradients(dout, q, k, v, lse, scale, causal, left, right, softcap):
    """(dq, dk, dv) fp32 by autograd through ``reference``, after checking the logsumexp handed back."""
    inputs = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    with torch.enable_grad():
        out, ref_lse = reference(*inputs, scale, causal, left, right, softcap)
        grads = torch.autograd.grad(out, inputs, dout.float())
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)  # the forward's residual comes back intact
    return grads


class _Layer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, causal, left, right, softcap):
        _check_inputs(q, k, v)
        out, lse = reference(q, k, v, scale, causal, left, right, softcap)
        ctx.save_for_backward(q, k, v, lse)
        ctx.args = scale, causal, left, right, softcap
        return out.to(q.dtype), lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, lse = ctx.saved_tensors
        dq, dk, dv = _gradients(dout, q, k, v, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def stand_ins(kernel: str, calls: list):
    """CPU stand-ins (layer, forward, backward) for ``kernel`` with its real parameter names and defaults; each
    call is appended to ``calls`` as (which, args, kwargs)."""
    if kernel == "flash":

        def layer(
            q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **kwargs
        ):
            return _Layer.apply(q, k, v, softmax_scale, causal, *window_size, softcap)[0]

        def forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, *rest):
            _check_inputs(q, k, v)
            out, lse = reference(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap)
            return out.to(q.dtype), lse, None, torch.zeros(2, dtype=torch.int64)

        def backward(
            dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size_left,
            window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
        ):  # fmt: skip
            _check_inputs(dout, q, k, v, out)
            window = (window_size_left, window_size_right)
            grads = _gradients(dout, q, k, v, softmax_lse, softmax_scale, causal, *window, softcap)
            for into, grad in zip((dq, dk, dv), grads):
                into.copy_(grad)
            return softmax_lse.new_empty(softmax_lse.shape)

    elif kernel == "flash3":

        def layer(q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1), softcap=0.0):
            return _Layer.apply(q, k, v, softmax_scale, causal, *window_size, softcap)[0]

        def forward(
            q, k, v, *, softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0
        ):
            _check_inputs(q, k, v)
            out, lse = reference(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap)
            return out.to(q.dtype), lse, torch.empty(0), torch.empty(0)

        def backward(
            dout, q, k, v, out, softmax_lse, *, dq=None, dk=None, dv=None, softmax_scale=None, is_causal=False,
            window_size_left=-1, window_size_right=-1, softcap=0.0,
        ):  # fmt: skip
            _check_inputs(dout, q, k, v, out)
            window = (window_size_left, window_size_right)
            grads = _gradients(dout, q, k, v, softmax_lse, softmax_scale, is_causal, *window, softcap)
            for into, grad in zip((dq, dk, dv), grads):
                into.copy_(grad)
            return softmax_lse.new_empty(softmax_lse.shape)

    else:

        def layer(q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0):
            return _Layer.apply(q, k, v, softmax_scale, causal, *window_size, softcap)

        def forward(
            q, k, v, *, softmax_scale=None, causal=False, softcap=None, window_size_left=None, window_size_right=None,
            return_lse=False,
        ):  # fmt: skip
            _check_inputs(q, k, v)
            out, lse = reference(q, k, v, softmax_scale, causal, window_size_left, window_size_right, softcap)
            return out.to(q.dtype), lse if return_lse else None, None, None

        def backward(
            q, k, v, out, dout, lse, softmax_scale=None, causal=False, softcap=0.0, window_size_left=None,
            window_size_right=None,
        ):  # fmt: skip
            _check_inputs(dout, q, k, v, out)
            grads = _gradients(dout, q, k, v, lse, softmax_scale, causal, window_size_left, window_size_right, softcap)
            return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))

    def logged(which, entry):
        @functools.wraps(entry)  # inspect.signature follows __wrapped__ to the stand-in's own
        def call(*args, **kwargs):
            calls.append((which, args, kwargs))
            return entry(*args, **kwargs)

        return call

    return tuple(logged(which, entry) for which, entry in zip(WHICH, (layer, forward, backward)))


def varlen_stand_in(calls: list):
    """A CPU stand-in for FA2's ``flash_attn_varlen_func`` with its real parameter names and defaults: each
    document of ``cu_seqlens_q`` attends as its own sequence (q/k/v [tokens, heads, dim]); each call is appended to
    ``calls`` as ("varlen", args, kwargs)."""

    def flash_attn_varlen_func(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, softmax_scale=None,
        causal=False, window_size=(-1, -1), softcap=0.0, **kwargs,
    ):  # fmt: skip
        assert cu_seqlens_q.tolist() == cu_seqlens_k.tolist()
        bounds = cu_seqlens_q.tolist()
        parts = [
            _Layer.apply(*(t[start:end].unsqueeze(0) for t in (q, k, v)), softmax_scale, causal, *window_size, softcap)
            for start, end in zip(bounds, bounds[1:])
        ]
        return torch.cat([out[0] for out, _ in parts])

    @functools.wraps(flash_attn_varlen_func)  # inspect.signature follows __wrapped__ to the stand-in's own
    def call(*args, **kwargs):
        calls.append(("varlen", args, kwargs))
        return flash_attn_varlen_func(*args, **kwargs)

    return call


def window_left(kernel: str, call) -> int | None:
    """The left window extent a logged call passed (bound to the real signature)."""
    which, args, kwargs = call
    bound = real_signature(kernel, which).bind(*args, **kwargs).arguments
    return bound["window_size"][0] if "window_size" in bound else bound.get("window_size_left")


# -- signatures --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_stand_ins_and_fakes_take_the_real_arguments(kernel):
    from autotune.oracle.fake_world import FAKE_KERNELS

    entry_points = KERNELS[kernel].entry_points
    assert [getattr(entry_points, w).split(":")[1] for w in WHICH] == {
        "flash": ["flash_attn_func", "_wrapped_flash_attn_forward", "_wrapped_flash_attn_backward"],
        "flash3": ["flash_attn_func", "_flash_attn_forward", "_flash_attn_backward"],
        "flash4": ["flash_attn_func", "_flash_attn_fwd", "_flash_attn_bwd"],
    }[kernel]
    for which, stand_in, fake in zip(WHICH, stand_ins(kernel, []), FAKE_KERNELS[kernel]):
        real = real_signature(kernel, which)
        check_signature(stand_in, real)
        check_signature(fake, real)
    if kernel in VARLEN_KERNELS:
        from autotune.oracle.fake_world import FAKE_VARLEN

        assert entry_points.varlen.split(":")[1] == "flash_attn_varlen_func"
        real = real_signature(kernel, "varlen")
        check_signature(varlen_stand_in([]), real)
        # the fake also takes the host boundaries (keyword ``documents``), which the stack passes only to a stand-in
        # that asks for them (``takes_documents``), never to the real entry point
        fake = FAKE_VARLEN[kernel]
        assert fake.takes_documents

        def fake_without_documents():
            pass

        signature = inspect.signature(fake)
        kept = [p for name, p in signature.parameters.items() if name != "documents"]
        fake_without_documents.__signature__ = signature.replace(parameters=kept)
        check_signature(fake_without_documents, real)


def test_every_declared_entry_point_has_its_real_signature_here():
    """Each entry point a kernel declares (the varlen one too) has its real signature in ``REAL_SIGNATURES``, so
    the calls the stack makes of it are bound to it below."""
    for kernel in FLASH_KERNELS:
        declared = {which for which in DECLARED if getattr(KERNELS[kernel].entry_points, which)}
        assert declared == set(REAL_SIGNATURES[kernel]), kernel


def stack_calls(kernel: str) -> list:
    """The calls the stack makes of ``kernel``'s entry points (whole layers, head-chunk forward and backward, with
    and without a window, with a softcap; a varlen kernel's layer over packed documents, with and without a window
    shorter than the longest document), each (which, args, kwargs), made of CPU stand-ins."""
    from trials.kernels.documents import Documents

    calls: list = []
    q, k, v = _qkv(seq=64)
    varlen = varlen_stand_in(calls) if kernel in VARLEN_KERNELS else None
    with attention.flash_kernels(*stand_ins(kernel, calls), kernel=kernel, varlen=varlen):
        for window in (None, 16):
            attention.causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0.25, kernel, window)
            out, residuals = attention.attention_forward(q, k, v, 0.25, kernel, window, 30.0)
            attention.attention_backward(torch.ones_like(out), q, k, v, out, residuals, 0.25, kernel, window, 30.0)
            if varlen is not None:
                documents = Documents((10, 30, 24))
                layer_in = [t.transpose(1, 2) for t in (q, k, v)]
                attention.causal_attention(*layer_in, 0.25, kernel, window, 30.0, documents=documents)
    assert sorted({which for which, _, _ in calls}) == sorted(WHICH + (("varlen",) if varlen else ()))
    return calls


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_every_call_the_stack_makes_binds_to_the_real_signature(kernel):
    for which, args, kwargs in stack_calls(kernel):
        real_signature(kernel, which).bind(*args, **kwargs)


# -- exactness ----------------------------------------------------------------------------------------------------------


def _qkv(seq=128, b=1, hq=4, hkv=2, d=16, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, seq, h, d, generator=g).to(dtype) for h in (hq, hkv, hkv))


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
@pytest.mark.parametrize("window,softcap", [(None, None), (24, None), (None, 5.0), (24, 5.0)])
def test_kernel_forward_and_backward_equal_the_reference(kernel, window, softcap):
    """The arguments each kernel is given mean what the layer asks: the window's (left, right) form, the softcap,
    the scale, the logsumexp handed back (checked by the stand-in's backward)."""
    q, k, v = _qkv()
    dout = _qkv(seed=1)[0]
    scale = 0.3
    left = window - 1 if window else -1
    ref_out, _ = reference(q, k, v, scale, True, left, 0, softcap)
    ref_grads = _gradients(
        dout, q, k, v, reference(q, k, v, scale, True, left, 0, softcap)[1], scale, True, left, 0, softcap
    )
    with attention.flash_kernels(*stand_ins(kernel, []), kernel=kernel):
        out, residuals = attention.attention_forward(q, k, v, scale, kernel, window, softcap)
        grads = attention.attention_backward(dout, q, k, v, out, residuals, scale, kernel, window, softcap)
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        layer = attention.causal_attention(*(t.transpose(1, 2) for t in leaves), scale, kernel, window, softcap)
        layer.backward(dout)
    tolerance = dict(rtol=1e-2, atol=1e-2)  # bf16 outputs of fp32 math
    torch.testing.assert_close(out.float(), ref_out, **tolerance)
    torch.testing.assert_close(layer.float(), ref_out, **tolerance)
    for got, leaf, ref in zip(grads, leaves, ref_grads):
        torch.testing.assert_close(got.float(), ref, **tolerance)
        torch.testing.assert_close(leaf.grad.float(), ref, **tolerance)


SEQ = 256  # above TINY_WINDOW: windowed layers attend a band


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, dict]:
    from trials.models.config import load_model_config

    root, configs = tmp_path_factory.mktemp("kernels"), tiny_configs()
    return {name: load_model_config(str(save(configs[name], root / name))) for name in ("tiny-qwen2", "tiny-mistral")}


def _loss_and_grads(config: dict, techniques: dict) -> tuple[float, dict[str, torch.Tensor]]:
    from tests.stack_harness import full_grads
    from trials.core.dist import Mesh
    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import build_training, forward_backward

    mesh = Mesh.single("cpu")
    model, _ = build_training(config, Techniques(**techniques), mesh, seed=0, compute_dtype=torch.bfloat16)
    batch = make_batch(synthetic_sample(0, SEQ, config["vocab_size"], 0), 0, 1, mesh.device)
    return float(forward_backward(model, batch, mesh)), full_grads(model)


def _distance(grads: dict, reference_grads: dict) -> float:
    assert set(grads) == set(reference_grads)
    return max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in reference_grads.items())


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_each_flash_kernel_trains_like_sdpa_through_the_stack(kernel, tiny_models):
    """Whole layers and head chunks, a plain and a windowed model (TINY_WINDOW of SEQ tokens), bf16 compute: the
    loss and gradients of SDPA's, to bf16 rounding (SDPA runs the same bf16 q/k/v; the stand-ins compute in fp32).
    """
    for name, config in tiny_models.items():
        for knobs in ({}, {"head_chunk": 1}):
            sdpa_loss, sdpa_grads = _loss_and_grads(config, {"attention": "sdpa", **knobs})
            calls: list = []
            with attention.flash_kernels(*stand_ins(kernel, calls), kernel=kernel):
                loss, grads = _loss_and_grads(config, {"attention": kernel, **knobs})
            assert {c[0] for c in calls} == ({"forward", "backward"} if knobs else {"layer"}), (name, knobs)
            windows = {window_left(kernel, call) for call in calls}
            assert (TINY_WINDOW - 1 in windows) == (name == "tiny-mistral"), (name, windows)
            assert abs(loss - sdpa_loss) <= 1e-4 * abs(sdpa_loss), (name, knobs, loss, sdpa_loss)  # seen: 1e-5
            # bf16 gradients: 0.8-1.3e-2 apart; a window one key too wide: 6.6e-2
            assert _distance(grads, sdpa_grads) < 3e-2, (name, knobs, _distance(grads, sdpa_grads))


# -- the oracle ---------------------------------------------------------------------------------------------------------


def expected_forward_bytes(b: int, s: int, hq: int, d: int) -> int:
    """Every flash forward returns out [b, s, hq, d] bf16 and softmax_lse fp32 [b, hq, s] (FA2 mha_fwd; FA3
    hopper/flash_api.cpp l. 889; FA4 interface.py l. 711-728), which the layer saves for backward."""
    return b * s * hq * d * 2 + b * hq * s * 4


def expected_backward_scratch(kernel: str, b: int, s: int, hq: int, hkv: int, d: int) -> int:
    """The bytes a causal bf16 backward allocates beyond dq/dk/dv (d = 128 here; no window needed: at head_dim 128
    a causal and a windowed call size their blocks alike):
    - flash (FA2 csrc/flash_attn/flash_api.cpp l. 872-937): fp32 dq_accum [b, s rounded to 128, hq, 128]; for GQA
      dk/dv expanded to hq heads (bf16). Its softmax_d is allocated by the caller.
    - flash3 (hopper/flash_api.cpp l. 1373-1536, Hopper, head_dim rounded to 128): kBlockM 64 (causal), kBlockN 128;
      fp32 softmax_d and softmax_lse_log2 [b, hq, s rounded to 64], fp32 dq_accum [b, hq, that * 128], int32
      dq_semaphore [s / 64 rounded up, b, hq]; for GQA fp32 dk_accum / dv_accum [b, hkv, s rounded to 128 * 128].
    - flash4 (interface.py l. 1937-2186, Blackwell): 128 x 128 blocks, 2-CTA at head_dim 128 (an even count of key
      blocks); fp32 dpsum and lse_log2 [b, hq, s rounded to 128], fp32 dq_accum [b, hq, that * 128]; for GQA fp32
      dk_accum / dv_accum [b, hkv, key rows * 128].
    """
    assert d == 128

    def up(x, m):
        return -(-x // m) * m

    gqa = hkv != hq
    if kernel == "flash":
        return b * up(s, 128) * hq * d * 4 + (2 * b * s * hq * d * 2 if gqa else 0)
    if kernel == "flash3":
        rows, key_rows = up(s, 64), up(s, 128)
        semaphore = -(-s // 64) * b * hq * 4
        return (
            2 * b * hq * rows * 4 + b * hq * rows * d * 4 + semaphore + (2 * b * hkv * key_rows * d * 4 if gqa else 0)
        )
    rows, key_blocks = up(s, 128), -(-s // 128)
    key_rows = (key_blocks + key_blocks % 2) * 128
    return 2 * b * hq * rows * 4 + b * hq * rows * d * 4 + (2 * b * hkv * key_rows * d * 4 if gqa else 0)


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_the_oracle_traces_each_flash_kernel_with_its_footprint(kernel, monkeypatch):
    """A traced bf16 step (whole layers, then head chunks of 2 query heads over 1 kv head) runs the kernel's fakes:
    each forward keeps out + lse, each backward's scratch is the kernel's, to the byte. 1060 tokens: not a multiple
    of any block, so the rounding shows."""
    from autotune import oracle
    from autotune.oracle import fake_world
    from trials.core.memory import TrackerListener
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    seq, hq, hkv, d = 1060, 4, 2, 128
    config = dict(load_model_config("tiny-llama"), num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d)
    config["num_hidden_layers"] = 2
    trackers, seen = [], []

    class Peak(TrackerListener):
        inside, peak = False, 0

        def on_change(self, tracker):
            if self.inside:
                self.peak = max(self.peak, tracker.device_bytes)

    peak = Peak()

    def tracked(modes_tracker):
        trackers.append(modes_tracker)
        modes_tracker.add_listener(peak)
        return []

    def forward_probe(entry):
        def call(q, k, v, *args, **kwargs):
            before = trackers[-1].device_bytes
            result = entry(q, k, v, *args, **kwargs)
            seen.append(("forward", q.shape, k.shape[2], trackers[-1].device_bytes - before))
            return result

        return call

    def scratch_probe(helper, first: int):
        def call(*args, **kwargs):
            q, k = args[first], args[first + 1]
            peak.inside, peak.peak = True, trackers[-1].device_bytes
            before = peak.peak
            result = helper(*args, **kwargs)
            peak.inside = False
            seen.append(("backward", q.shape, k.shape[2], peak.peak - before))
            return result

        return call

    layer, forward, backward = fake_world.FAKE_KERNELS[kernel]
    monkeypatch.setitem(fake_world.FAKE_KERNELS, kernel, (forward_probe(layer), forward_probe(forward), backward))
    helper, first = {
        "flash": ("_fa2_backward_scratch", 0),
        "flash3": ("_fa3_backward", 1),
        "flash4": ("_fa4_backward", 0),
    }[kernel]
    monkeypatch.setattr(fake_world, helper, scratch_probe(getattr(fake_world, helper), first))  # first: q's index
    from autotune.timing.counting import StepCounter

    counted = []  # per knob set: the attention calls the time model's counter heard of

    def tracked_and_counted(modes_tracker):
        counter = StepCounter(modes_tracker)
        counted.append(counter.counts)
        return [*tracked(modes_tracker), counter]

    for knobs, heads in (({}, (hq, hkv)), ({"head_chunk": 2}, (2, 1))):
        seen.clear()
        trace = oracle.trace(
            config,
            Techniques(attention=kernel, **knobs),
            seq,
            1,
            compute_dtype=torch.bfloat16,
            gpu_kernels=True,
            modes=tracked_and_counted,
        )
        assert not trace.stopped and trace.peak_device_bytes > 0
        chunks = 2 if knobs else 1
        assert [w for w, *_ in seen] == ["forward"] * 2 * chunks + ["backward"] * 2 * chunks, (knobs, seen)
        for which, shape, kv_heads, nbytes in seen:
            b, s, h, _ = shape
            assert (s, h, kv_heads) == (seq, *heads)
            rng_state = 16 if kernel == "flash" and knobs else 0  # FA2's forward returns its int64[2] rng state
            expected = (
                expected_forward_bytes(b, s, h, d) + rng_state
                if which == "forward"
                else expected_backward_scratch(kernel, b, s, h, kv_heads, d)
            )
            assert nbytes == expected, (knobs, which, nbytes, expected)
    # head chunks run the same attention, a chunk of heads per call: every call is counted, forward and backward
    whole, chunked = counted[0].attention_calls, counted[-1].attention_calls
    assert whole and chunked == whole


# -- the install-time check (bin/setup-gpu) ------------------------------------------------------------------------------


def _drifted(kernel: str, which: str):
    """The stand-ins with entry point ``which`` renamed ``softcap`` to ``logit_softcap`` (a release's drift)."""
    entries = list(stand_ins(kernel, []))
    index = WHICH.index(which)
    original = entries[index]

    def drifted(*args, logit_softcap=0.0, **kwargs):
        if "softcap" in kwargs:
            raise TypeError(f"{which}() got an unexpected keyword argument 'softcap'")
        return original(*args, softcap=logit_softcap, **kwargs)

    entries[index] = drifted
    return entries


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_the_install_check_passes_a_kernel_the_stack_can_call(kernel):
    with attention.flash_kernels(*stand_ins(kernel, []), kernel=kernel):
        line = attention.check_kernel(kernel, "cpu", seq=64, dim=16)
    assert line.startswith("its layer and head-chunk forward and backward (as the stack calls them) match SDPA")


@pytest.mark.parametrize("which", WHICH)
def test_the_install_check_catches_drift_in_each_entry_point_the_stack_calls(which):
    """Review item 9: a kernel whose installed signature no longer takes what the stack passes fails at install
    (setup-gpu runs ``check_kernel``), not in the first trial -- whichever entry point drifted."""
    kernel = "flash3" if which != "forward" else "flash4"  # keyword calls: a renamed keyword is a TypeError
    with attention.flash_kernels(*_drifted(kernel, which), kernel=kernel):
        with pytest.raises(TypeError, match="softcap"):
            attention.check_kernel(kernel, "cpu", seq=64, dim=16)


def test_the_install_check_catches_a_kernel_that_computes_wrong_gradients():
    layer, forward, backward = stand_ins("flash3", [])

    def wrong_backward(*args, dq=None, **kwargs):
        result = backward(*args, dq=dq, **kwargs)
        dq.mul_(0.5)
        return result

    with attention.flash_kernels(layer, forward, wrong_backward, kernel="flash3"):
        with pytest.raises(RuntimeError, match="head chunk dq differs from SDPA's"):
            attention.check_kernel("flash3", "cpu", seq=64, dim=16)


# -- refusal ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_a_kernel_not_installed_is_refused_in_one_line(kernel):
    from autotune.backends.setup import check_local_node
    from autotune.core.errors import UserError
    from trials.kernels.registry import usable_here

    package = KERNELS[kernel].package
    q, k, v = _qkv(seq=16)
    for run in (
        lambda: attention.causal_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, kernel),
        lambda: attention.attention_forward(q, k, v, 0.25, kernel),
        lambda: check_local_node(1, kernel),
    ):
        with pytest.raises((RuntimeError, UserError)) as refused:
            run()
        line = str(refused.value)
        assert "\n" not in line and line.startswith(f"attention {kernel!r} cannot run here: {package} is not installed")
        assert "bin/setup-gpu" in line
    assert kernel not in usable_here() and "sdpa" in usable_here()
    check_local_node(1, "sdpa")


def test_an_installed_kernel_on_another_gpu_generation_is_refused(monkeypatch):
    from trials.kernels import registry as kernels

    monkeypatch.setattr(kernels.AttentionKernel, "import_error", lambda self: None)  # as if every one imported
    assert kernels.refusal("flash3", 10) == (
        "attention 'flash3' cannot run here: flash-attn-3 runs on compute capability 9.x GPUs, not on compute "
        "capability 10.x"
    )
    assert kernels.refusal("flash4", 9) is None  # FA4's backward runs on Hopper (interface.py l. 1854)
    assert kernels.refusal("flash", None).endswith("not on a CPU")


def test_autotune_run_refuses_a_kernel_not_installed_with_exit_2(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    config = tmp_path / "cfg.json"
    techniques = {"attention": "flash4"}
    config.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": "tiny-llama",
                "hardware": "cpu",
                "gpus": 1,
                "seq_len": 512,
                "techniques": techniques,
                "predicted": None,
                "measured": None,
            }
        )  # fmt: skip
    )
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from autotune.cli import main; sys.exit(main())",
            "run",
            "--config",
            str(config),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "attention 'flash4' cannot run here: flash-attn-4 is not installed" in lines[0] and done.stdout == ""


def test_verify_refuses_a_front_point_whose_kernel_cannot_run_here():
    """``autotune verify`` names the kernel and why it cannot run on this node, for every flash variant."""
    from types import SimpleNamespace

    from autotune.outputs.verify import _kernel_refusal

    assert _kernel_refusal(SimpleNamespace(techniques={"attention": "sdpa"})) is None
    for name in ("flash", "flash3", "flash4"):
        refusal = _kernel_refusal(SimpleNamespace(techniques={"attention": name}))
        assert refusal.startswith(f"attention {name!r} cannot run here: "), refusal


# -- the limits a kernel declares per GPU generation: head dims, softcaps ----------------------------------------


def _gemma2(tmp_path, head_dim: int, softcap: float | None) -> dict:
    """A Gemma 2 config (sliding windows, attention softcap) with this head dim, as a user's config.json."""
    from transformers import Gemma2Config

    from trials.models.config import load_model_config

    config = Gemma2Config(
        vocab_size=256, hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=head_dim,
        num_hidden_layers=2, intermediate_size=128, sliding_window=TINY_WINDOW, attn_logit_softcapping=softcap,
        query_pre_attn_scalar=head_dim,
    )  # fmt: skip
    folder = tmp_path / f"gemma2-{head_dim}-{softcap}"
    config.save_pretrained(folder)
    return load_model_config(str(folder))


@pytest.mark.parametrize(
    "head_dim, softcap, kernel, major, refused",
    [
        (256, 50.0, "flash4", 10, "softcap"),  # Gemma 2 on B200: the head-dim-256 kernels take no softcap
        (256, 50.0, "flash4", 12, "softcap"),  # SM 12.x: a softcap backward is a score_mod, which it refuses
        (128, 50.0, "flash4", 12, "softcap"),
        (256, 50.0, "flash4", 9, None),  # Hopper runs it
        (256, None, "flash4", 10, None),  # (256, 256) without a softcap: the dedicated kernels
        (192, None, "flash4", 10, "head dims up to 128"),  # SM100: up to 128, (192, 128), (256, 256)
        (192, None, "flash4", 9, None),
        (128, 50.0, "flash4", 10, None),
        (256, 50.0, "flash", 10, None),  # FA2 runs softcaps and head dims up to 256 anywhere it runs
        (256, 50.0, "flash4", None, None),  # the GPUs' generation unknown: nothing to refuse by
    ],
)
def test_a_kernels_declared_limits_refuse_what_it_cannot_train(tmp_path, head_dim, softcap, kernel, major, refused):
    """``Techniques.validate`` refuses a kernel by the head dims and softcaps its declaration states for the GPUs'
    generation (``AttentionKernel.head_dims``, ``no_softcap``), naming the kernel's source."""
    from trials.core.errors import ConfigError
    from trials.stack.techniques import Techniques

    config = _gemma2(tmp_path, head_dim, softcap)
    techniques = Techniques(attention=kernel)
    if refused is None:
        techniques.validate(config, 1, on_gpu=True, compute_capability_major=major)
        return
    with pytest.raises(ConfigError, match=refused) as raised:
        techniques.validate(config, 1, on_gpu=True, compute_capability_major=major)
    assert "flash_attn/cute/interface.py" in str(raised.value) and f"{major}.x" in str(raised.value)


def test_the_search_space_drops_a_kernel_its_limits_refuse_on_the_presets_gpus(tmp_path):
    """A B200 search of Gemma 2 (head dim 256, softcap) offers FA2, not FA4; an H100 search offers both."""
    from autotune.core.hardware import load_hardware
    from autotune.search.space import load_space

    config = _gemma2(tmp_path, 256, 50.0)
    space = tmp_path / "space.yaml"
    space.write_text("schema: autotune/space-v1\nknobs:\n  attention: [flash, flash4]\n")
    offered = {}
    for preset in ("b200", "h100-sxm"):
        hw = load_hardware(preset)
        loaded = load_space(space, config, 1, 8192, on_gpu=True, compute_capability_major=hw.compute_capability)
        offered[preset] = loaded.choices["attention"]
    assert offered == {"b200": ["flash"], "h100-sxm": ["flash", "flash4"]}


@pytest.fixture
def fresh_resolution():
    """No entry point resolved before the test, and none of its stand-ins kept after it (``forget_resolved``): a
    test that installs a stand-in package or hub build resolves it, and later tests must not see it."""
    forget_resolved()
    yield
    forget_resolved()


def test_a_hub_build_that_setup_gpu_put_into_the_venv_provides_every_entry_point(
    tmp_path, monkeypatch, fresh_resolution
):
    """Without the pip package, the stack calls the kernel hub's build from ``hub_kernel_dir`` (loaded with
    ``kernels.get_local_kernel``, never from the network): the layer from the module, forward and backward from its
    ``flash_attn_interface``, as kernels-community/flash-attn3 exports them."""
    import sys
    import types

    from trials.kernels import registry

    interface = types.SimpleNamespace(_flash_attn_forward=object(), _flash_attn_backward=object())
    hub_module = types.SimpleNamespace(flash_attn_func=object(), flash_attn_interface=interface)
    loaded = []
    fake_kernels = types.ModuleType("kernels")
    fake_kernels.get_local_kernel = lambda path: loaded.append(path) or hub_module
    monkeypatch.setitem(sys.modules, "kernels", fake_kernels)
    monkeypatch.setattr(registry, "_hub_modules", {})
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    kernel = KERNELS["flash3"]
    assert not kernel.installed()  # no pip package, no hub build in this venv
    registry.hub_kernel_dir("flash3").mkdir(parents=True)
    assert kernel.installed()
    assert kernel.resolve("layer") is hub_module.flash_attn_func
    assert kernel.resolve("forward") is interface._flash_attn_forward
    assert kernel.resolve("backward") is interface._flash_attn_backward
    assert loaded == [tmp_path / "share" / "autotune" / "kernels" / "flash3"]


# -- flash-attn-4's wheel of the release the registry pins, really installed -------------------------------------------


@pytest.fixture(scope="module")
def flash_attn_4(tmp_path_factory) -> Path:
    """The flash-attn-4 release the registry pins (its wheel route's requirement), installed from the index without
    its dependencies into a folder of its own: that folder."""
    target = tmp_path_factory.mktemp("flash-attn-4")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:", "--target",
         str(target), KERNELS["flash4"].requirement(None)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return target


def _defined_in(root: Path, module: str, attribute: str) -> ast.FunctionDef:
    """The function ``module.attribute`` under the folder ``root``, followed through ``from .x import attribute``
    re-exports, read from the source (importing it needs torch's CUDA build and the CuTe DSL)."""
    path = root.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == attribute:
            return node
        if isinstance(node, ast.ImportFrom) and any(
            alias.name == attribute and not alias.asname for alias in node.names
        ):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            return _defined_in(root, f"{base}.{node.module}" if node.level else node.module, attribute)
    raise AssertionError(f"{path} defines no {attribute}")


def _signature_of(function: ast.FunctionDef) -> inspect.Signature:
    """``function``'s signature, annotations dropped (as ``REAL_SIGNATURES`` writes them)."""
    arguments = function.args
    for argument in (*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs, arguments.vararg, arguments.kwarg):
        if argument is not None:
            argument.annotation = None
    namespace: dict = {}
    exec(f"def entry({ast.unparse(arguments)}): pass", namespace)
    return inspect.signature(namespace["entry"])


@pytest.mark.any_release  # a package index's wheel and Python's import machinery
def test_the_pinned_flash_attn_4_wheel_has_the_entry_points_and_signatures_the_stack_calls(flash_attn_4):
    """Each flash4 entry point the registry declares is a function in the pinned release's wheel, with the signature
    ``REAL_SIGNATURES`` holds, and every call the stack makes binds to it."""
    kernel = KERNELS["flash4"]
    assert (flash_attn_4 / f"flash_attn_4-{kernel.package_version}.dist-info").is_dir(), sorted(flash_attn_4.iterdir())
    real = {}
    for which in WHICH:
        module, attribute = getattr(kernel.entry_points, which).split(":")
        real[which] = _signature_of(_defined_in(flash_attn_4, module, attribute))
        assert real[which] == real_signature("flash4", which), (which, str(real[which]))
    for which, args, kwargs in stack_calls("flash4"):
        real[which].bind(*args, **kwargs)


# Resolves FA2's entry points with flash-attn-4 installed (sys.argv[1]: the checkout, its folder and a stand-in
# ``kernels`` package, on sys.path), first in a venv without a hub build (sys.argv[2]), then in one with setup-gpu's
# FA2 hub build (sys.argv[3]). Run with -S: the test venv's own packages are out of sight.
_RESOLVE_FA2 = r"""
import json, sys
sys.path[:0] = sys.argv[1].split(":")
import flash_attn
from trials.kernels import registry
said = {"flash_attn": [getattr(flash_attn, "__file__", None), list(flash_attn.__path__)]}
sys.prefix = sys.argv[2]
said["problem without a hub build"] = registry.install_problem("flash")
said["broken without a hub build"] = registry.broken_import("flash")
sys.prefix = sys.argv[3]
said["problem with the hub build"] = registry.install_problem("flash")
entries = {which: registry.KERNELS["flash"].resolve(which) for which in ("layer", "forward", "backward", "varlen")}
said["entry points"] = {which: f"{entry.__module__}:{entry.__name__}" for which, entry in entries.items()}
print(json.dumps(said))
"""

# kernels.get_local_kernel as the registry uses it: the repository folder's build variant, imported as a package
_GET_LOCAL_KERNEL = """
import importlib.util, sys
from pathlib import Path


def get_local_kernel(repo_path, *, backend=None, trust_remote_code=False, user_agent=None):
    (variant,) = sorted(Path(repo_path, "build").iterdir())
    spec = importlib.util.spec_from_file_location(
        "hub_flash_attn2", variant / "__init__.py", submodule_search_locations=[str(variant)]
    )
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
"""

# a FA2 hub build's variant (kernels-community/flash-attn2): its module exports the layer functions, its
# flash_attn_interface the head-chunk forward and backward
_HUB_FA2 = {
    "__init__.py": "from .flash_attn_interface import flash_attn_func, flash_attn_varlen_func\n",
    "flash_attn_interface.py": "".join(
        f"def {name}(*args, **kwargs):\n    raise NotImplementedError\n\n\n"
        for name in (
            "flash_attn_func",
            "flash_attn_varlen_func",
            "_wrapped_flash_attn_forward",
            "_wrapped_flash_attn_backward",
        )
    ),
}


@pytest.mark.any_release  # a package index's wheel and Python's import machinery
def test_flash_attn_4s_namespace_flash_attn_leaves_fa2_to_its_hub_build(flash_attn_4, tmp_path):
    """flash-attn-4's wheel installs ``flash_attn/cute/`` and no ``flash_attn/__init__.py``: ``import flash_attn``
    gives a namespace package without FA2's entry points. FA2 then counts as not installed from pip, so its hub
    build serves every entry point, and without one FA2 is "not installed" (not "installed but does not import")."""
    from trials.kernels import registry

    stand_ins_folder = tmp_path / "stand-ins" / "kernels"
    stand_ins_folder.mkdir(parents=True)
    (stand_ins_folder / "__init__.py").write_text(_GET_LOCAL_KERNEL)
    variant = registry.hub_kernel_dir("flash", tmp_path / "venv") / "build" / "torch215-cxx11-cu130-x86_64-linux"
    variant.mkdir(parents=True)
    for name, text in _HUB_FA2.items():
        (variant / name).write_text(text)
    root = Path(__file__).resolve().parents[1]
    path = ":".join(map(str, (root, flash_attn_4, stand_ins_folder.parent)))
    done = subprocess.run(
        [sys.executable, "-S", "-c", _RESOLVE_FA2, path, str(tmp_path / "bare-venv"), str(tmp_path / "venv")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    said = json.loads(done.stdout.strip().splitlines()[-1])
    assert said["flash_attn"] == [None, [str(flash_attn_4 / "flash_attn")]], said  # flash-attn-4's namespace only
    assert said["problem without a hub build"] == (
        "flash-attn is not installed (module flash_attn; bin/setup-gpu sets up the GPU kernels)"
    )
    assert said["broken without a hub build"] is None  # no "installed but cannot be imported" warning in a search
    assert said["problem with the hub build"] is None
    assert said["entry points"] == {
        "layer": "hub_flash_attn2.flash_attn_interface:flash_attn_func",
        "forward": "hub_flash_attn2.flash_attn_interface:_wrapped_flash_attn_forward",
        "backward": "hub_flash_attn2.flash_attn_interface:_wrapped_flash_attn_backward",
        "varlen": "hub_flash_attn2.flash_attn_interface:flash_attn_varlen_func",
    }


def test_a_pip_package_without_an_entry_point_leaves_it_to_the_hub_build(tmp_path, monkeypatch, fresh_resolution):
    """flash-attn 2.6 imports but lacks the head-chunk entry points (``_wrapped_flash_attn_forward`` / ``_backward``
    are new in 2.7): the hub build that setup-gpu put into the venv serves them; without one, flash-attn is
    "installed but does not import", with the AttributeError."""
    import types

    from trials.kernels import registry

    old = types.ModuleType("flash_attn")
    old.__file__ = str(tmp_path / "site-packages" / "flash_attn" / "__init__.py")
    old.flash_attn_func = old.flash_attn_varlen_func = object()
    old.flash_attn_interface = types.ModuleType("flash_attn.flash_attn_interface")
    old.flash_attn_interface.__file__ = str(tmp_path / "site-packages" / "flash_attn" / "flash_attn_interface.py")
    monkeypatch.setitem(sys.modules, "flash_attn", old)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", old.flash_attn_interface)
    interface = types.SimpleNamespace(_wrapped_flash_attn_forward=object(), _wrapped_flash_attn_backward=object())
    hub_module = types.SimpleNamespace(flash_attn_interface=interface)
    fake_kernels = types.ModuleType("kernels")
    fake_kernels.get_local_kernel = lambda path: hub_module
    monkeypatch.setitem(sys.modules, "kernels", fake_kernels)
    monkeypatch.setattr(registry, "_hub_modules", {})
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    problem = registry.install_problem("flash")
    assert problem.startswith("flash-attn is installed but does not import (AttributeError: "), problem
    registry.hub_kernel_dir("flash").mkdir(parents=True)
    kernel = KERNELS["flash"]
    assert kernel.installed()
    assert kernel.resolve("layer") is old.flash_attn_func
    assert kernel.resolve("forward") is interface._wrapped_flash_attn_forward
    assert kernel.resolve("backward") is interface._wrapped_flash_attn_backward
