"""The oracle's fake world: a fake process group, constants for data-dependent scalars, and GPU kernels'
memory footprints on a CPU-only torch (FlashAttention 2, 3 and 4, and the CUDA SDPA flash backward's scratch)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.timing.counting import flash_window, record_attention
from trials.kernels import attention


@contextlib.contextmanager
def fake_process_group(world_size: int, needed: bool | None = None, rank: int = 0):
    """A fake default process group of ``world_size`` ranks, this process being ``rank``; destroyed on exit.

    ``needed``: default ``world_size > 1``; one rank needs one too when FSDP runs there."""

    if not (world_size > 1 if needed is None else needed):
        yield
        return
    if dist.is_initialized():
        raise RuntimeError(
            "the memory oracle cannot run in a process that already has a process group; run it in a separate process"
        )

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def oracle_mode(gpu_kernels: bool):

    aten = torch.ops.aten
    sdpa_cpu_bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    class OracleMode(TorchDispatchMode):
        """Top of the mode stack: constants for data-dependent scalars, GPU-kernel temporaries."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is aten._local_scalar_dense.default:
                dtype = args[0].dtype
                return True if dtype == torch.bool else (1.0 if dtype.is_floating_point else 1)
            if gpu_kernels and func is sdpa_cpu_bwd:
                # CUDA flash backward (torch's vendored FA2): fp32 dq accumulator + softmax_d while it runs
                query = args[1]
                b, h, s, d = query.shape
                scratch = (
                    torch.empty((b, s, h, d), dtype=torch.float32, device=query.device),
                    torch.empty((b, h, s), dtype=torch.float32, device=query.device),
                )
                out = func(*args, **kwargs)
                del scratch
                return out
            return func(*args, **kwargs)

    return OracleMode()


# -- the flash kernels' memory footprints -------------------------------------------------------------------------
# Each fake takes the real entry point's arguments (the ones trials.kernels.attention passes; tests/test_kernels.py holds
# the real signatures) and allocates what the real one allocates, from Dao-AILab/flash-attention at commit
# 0251105a2fb19d2957484b7f023cd8c115286ced (FA2: csrc/flash_attn/flash_api.cpp ``mha_fwd`` / ``mha_bwd``; FA3:
# hopper/flash_api.cpp ``mha_fwd`` / ``mha_bwd``; FA4: flash_attn/cute/interface.py ``_flash_attn_fwd`` /
# ``_flash_attn_bwd``). All three forwards return out [b, s, hq, d] and softmax_lse fp32 [b, hq, s], which the
# whole-layer autograd functions save with q, k, v. Their backwards differ (below). A causal call and a sliding
# window change the FLOPs the throughput counter is told, not the memory (the buffers are O(s)), except where a
# window changes a kernel's block size (FA3's and FA4's Hopper kBlockM at head_dim 128).


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def _fp32(*shape, like):
    return torch.empty(shape, dtype=torch.float32, device=like.device)


def _fa2_rows(s: int) -> int:
    """FA2's ``seqlen_q_rounded`` (csrc/flash_attn/flash_api.cpp ``mha_bwd``): s rounded up to 128."""
    return _round_up(s, 128)


def _fa2_backward_scratch(q, k, v, dq, dk, dv) -> None:
    """flash-attn 2's ``mha_bwd`` (csrc/flash_attn/flash_api.cpp l. 872-937) while it runs: fp32 ``dq_accum``
    [b, s rounded to 128, hq, d rounded to 32 (64 above 128)] (and fp32 ``softmax_d`` [b, hq, s rounded], which the
    caller allocates: it is returned) and, when hkv < hq, dk/dv expanded to hq heads, summed down at the end."""
    b, s, h, d = q.shape
    d_r = _round_up(d, 32 if d <= 128 else 64)
    scratch = [torch.empty((b, _fa2_rows(s), h, d_r), dtype=torch.float32, device=q.device)]
    if k.shape[2] != h:
        groups = h // k.shape[2]
        scratch += [
            torch.empty((b, k.shape[1], h, d), dtype=k.dtype, device=k.device),
            torch.empty((b, v.shape[1], h, d), dtype=v.dtype, device=v.device),
        ]
        # summed down to the kv heads into dk/dv (an op while the scratch buffers are live)
        torch.sum(scratch[1].unflatten(2, (k.shape[2], groups)), 3, out=dk)
        torch.sum(scratch[2].unflatten(2, (v.shape[2], groups)), 3, out=dv)
    else:
        dq.zero_()  # an op while the scratch buffers are live
    del scratch


def _fa3_round_up_headdim(head_size: int) -> int:
    """FA3's ``round_up_headdim`` (hopper/flash_attn_interface.py, every head dim compiled in)."""
    return next((r for r in (64, 96, 128, 192) if head_size <= r), 256)


def _fa3_backward(dout, q, k, v, dq, dk, dv, causal: bool, left: int, right: int, softcap: float):
    """FA3's ``mha_bwd`` on Hopper (hopper/flash_api.cpp l. 1267-1562), non-varlen: with seqlen_q rounded up to
    kBlockM and seqlen_k to kBlockN, head_dim rounded by ``round_up_headdim``, it allocates fp32 softmax_d and
    softmax_lse_log2 [b, hq, sq_r], fp32 dq_accum [b, hq, sq_r * d_r], int32 dq_semaphore [sq / kBlockM, b, hq] and,
    when hkv < hq, fp32 dk_accum / dv_accum [b, hkv, sk_r * d_r] (zeroed); it returns them all, and the Python
    wrapper keeps softmax_d only. Returns softmax_d."""
    b, sq, h, d = q.shape
    sk, hk = k.shape[1], k.shape[2]
    left = -1 if left >= sk - 1 else left
    right = 0 if causal else (-1 if right >= sq - 1 else right)
    is_causal = left < 0 and right == 0
    is_local = (left >= 0 or right >= 0) and not is_causal
    d_r = _fa3_round_up_headdim(max(d, v.shape[-1]))
    if d_r <= 64:
        block_m = 96 if is_causal and softcap > 0.0 else 128
    elif d_r <= 96:
        block_m = 64
    elif d_r <= 128:
        block_m = 64 if is_causal or is_local or softcap > 0.0 else 80
    else:
        block_m = 64
    block_n = 128 if d_r <= 128 else (96 if d_r <= 192 else 80)
    sq_r, sk_r = _round_up(sq, block_m), _round_up(sk, block_n)
    softmax_d = _fp32(b, h, sq_r, like=q)
    scratch = [
        _fp32(b, h, sq_r, like=q),  # softmax_lse_log2
        _fp32(b, h, sq_r * d_r, like=q),  # dq_accum
        torch.empty(((sq + block_m - 1) // block_m, b, h), dtype=torch.int32, device=q.device),  # dq_semaphore
    ]
    if hk != h:
        scratch += [torch.zeros((b, hk, sk_r * d_r), dtype=torch.float32, device=q.device) for _ in range(2)]
    dq.zero_()  # the kernel writes dq/dk/dv while its scratch is live
    del scratch
    return softmax_d


FA4_FAKE_ARCH = 10  # the generation the FA4 fakes size their blocks for: Blackwell (SM100), FA4's own target


def _fa4_backward(q, k, v, dq, dk, dv, causal: bool, left, right, arch: int = FA4_FAKE_ARCH):
    """FA4's ``_flash_attn_bwd`` (flash_attn/cute/interface.py l. 1807-2601), non-varlen, not deterministic: with
    seqlen_q rounded up to m_block and seqlen_k to n_block (SM100: 128 x 128, one more n_block to make them even
    under 2-CTA at head_dim >= 128; SM90: ``_tile_size_bwd_sm90``), head dims rounded up to 32, it allocates fp32
    dq_accum [b, hq, sq_r * d_r] (none for SM100's dedicated head_dim-256 kernel), dpsum and lse_log2 [b, hq, sq_r]
    and, when hkv < hq, dk_accum / dv_accum [b, hkv, sk_r * d_r] (zeroed); all are dropped when it returns
    (dq, dk, dv)."""
    b, sq, h, d = q.shape
    sk, hk, d_v = k.shape[1], k.shape[2], v.shape[-1]
    # _resolve_causal_local_window: a causal call with a left window runs "local"
    if causal:
        right = 0
    if left is not None and right is not None and left + right < 0:
        left = right = None
    local = (left is not None or right is not None) and not (left is None and right == 0)
    causal = not local and right == 0
    hd256 = arch in (10, 11) and d == d_v == 256
    if arch == 9:
        if d <= 64:
            block_m, block_n = 128, 128
        elif d <= 96:
            block_m, block_n = 64, 128
        elif d <= 128:
            block_m, block_n = (64 if causal or local else 80), 128
        else:
            block_m, block_n = 64, (96 if d <= 192 else 64)
        cluster = 1
    else:
        block_m, block_n = 128, 128
        cluster = 2 if d >= 128 or hd256 else 1
    sq_r, sk_r = _round_up(sq, block_m), _round_up(sk, block_n)
    if cluster == 2 and (sk_r // block_n) % 2:
        sk_r += block_n
    d_r, dv_r = _round_up(d, 32), _round_up(d_v, 32)
    scratch = [_fp32(b, h, sq_r, like=q), _fp32(b, h, sq_r, like=q)]  # dpsum, lse_log2
    if not hd256:
        scratch.append(_fp32(b, h, sq_r * d_r, like=q))  # dq_accum
    if hk != h and not hd256:
        scratch += [
            torch.zeros((b, hk, sk_r * d_r), dtype=torch.float32, device=q.device),
            torch.zeros((b, hk, sk_r * dv_r), dtype=torch.float32, device=q.device),
        ]
    dq.zero_()  # the kernel writes dq/dk/dv while its scratch is live
    del scratch
    return dq, dk, dv


class FakeFlashAttn(torch.autograd.Function):
    """A flash kernel's ``flash_attn_func`` as far as memory goes (fake tensors only: nothing is computed).

    q [b, s, hq, d], k/v [b, s, hkv, d] -> out [b, s, hq, d]; saves q, k, v, out, softmax_lse [b, hq, s] fp32.
    Backward: dq/dk/dv like q/k/v, then the ``kernel``'s backward scratch (``_fa2_backward_scratch`` with fp32
    ``softmax_d`` for "flash", ``_fa3_backward`` for "flash3", ``_fa4_backward`` for "flash4").
    ``causal`` and the sliding ``window`` (W keys per query, None: none) set the FLOPs the throughput counter is
    told; ``softcap`` (FA3's block size) is 0 when off.
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=True, window=None, kernel="flash", softcap=0.0):
        check_flash_inputs(q, k, v)
        b, s, h, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.window, ctx.kernel, ctx.softcap = causal, window, kernel, softcap
        _record_attention(q, k, v, backward=False, causal=causal, window=window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, s, h, d = q.shape
        _record_attention(q, k, v, backward=True, causal=ctx.causal, window=ctx.window)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        left = ctx.window - 1 if ctx.window else -1
        if ctx.kernel == "flash3":
            _fa3_backward(dout, q, k, v, dq, dk, dv, ctx.causal, left, 0, ctx.softcap)  # softmax_d dropped
        elif ctx.kernel == "flash4":
            _fa4_backward(q, k, v, dq, dk, dv, ctx.causal, left if ctx.window else None, 0)
        else:
            softmax_d = torch.empty((b, h, _fa2_rows(s)), dtype=torch.float32, device=q.device)
            _fa2_backward_scratch(q, k, v, dq, dk, dv)
            del softmax_d
        return dq, dk, dv, None, None, None, None


def check_flash_inputs(*tensors) -> None:
    """Refuse what the flash kernels refuse (``mha_fwd``/``mha_bwd``: fp16/bf16 only, one dtype for all), so a
    config the real kernel would reject fails in the oracle too instead of getting a prediction."""
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) != 1 or not dtypes <= set(attention.FLASH_DTYPES):
        raise RuntimeError(
            f"FlashAttention only supports fp16 and bf16 data type, all inputs alike; got "
            f"{', '.join(str(t.dtype) for t in tensors if t is not None)}"
        )


def _record_attention(q, k, v, backward: bool, causal: bool = True, window: int | None = None) -> None:
    """Tell the throughput counter (``autotune.timing.counting.StepCounter``) about the fake kernel's FLOPs."""
    record_attention(q, k, v, causal=causal, backward=backward, layout="bshd", window=window)


# -- FA2 (flash-attn >= 2.7): flash_attn/flash_attn_interface.py ---------------------------------------------------


def _fake_flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, **kwargs
):
    """flash-attn's ``flash_attn_func``: ``window_size=(left, right)``, -1 unlimited; right 0 is causal."""
    return FakeFlashAttn.apply(q, k, v, causal or window_size[1] == 0, flash_window(window_size[0]))


def _fake_wrapped_flash_attn_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    return_softmax=False,
):
    """flash-attn >= 2.7 ``_wrapped_flash_attn_forward``: (out, softmax_lse fp32 [b, h, s], S_dmask, rng_state)."""
    check_flash_inputs(q, k, v)
    b, s, h, d = q.shape
    _record_attention(q, k, v, False, causal or window_size_right == 0, flash_window(window_size_left))
    out = torch.empty_like(q)
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    rng_state = torch.empty((2,), dtype=torch.int64, device=q.device)
    return out, lse, None, rng_state


def _fake_wrapped_flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    rng_state=None,
):
    """flash-attn's ``mha_bwd`` into dq/dk/dv, with its scratch (``_fa2_backward_scratch``); returns softmax_d."""
    check_flash_inputs(dout, q, k, v, out, dq, dk, dv)
    b, s, h, d = q.shape
    _record_attention(q, k, v, True, causal or window_size_right == 0, flash_window(window_size_left))
    softmax_d = torch.empty((b, h, _fa2_rows(s)), dtype=torch.float32, device=q.device)
    _fa2_backward_scratch(q, k, v, dq, dk, dv)
    return softmax_d


class FakeVarlenFlashAttn(torch.autograd.Function):
    """flash-attn 2's ``flash_attn_varlen_func`` as far as memory goes: packed documents, q [total, hq, d], k/v
    [total, hkv, d] -> out [total, hq, d]; saves q, k, v, out, softmax_lse fp32 [hq, total] (``mha_varlen_fwd``) and
    cu_seqlens. Backward (``mha_varlen_bwd``): dq/dk/dv like q/k/v, ``softmax_d`` fp32 [hq, total + 128 * docs],
    ``dq_accum`` fp32 [total + 128 * docs, hq, d rounded to 32 (64 above 128)] and, when hkv < hq, dk/dv expanded to
    hq heads. Each document's attention is counted as its own causal call (``documents``: the host boundaries)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, causal, window, documents):
        check_flash_inputs(q, k, v)
        total, h, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((h, total), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
        ctx.causal, ctx.window, ctx.documents = causal, window, documents
        _record_documents(q, k, v, documents, False, causal, window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
        total, h, d = q.shape
        _record_documents(q, k, v, ctx.documents, True, ctx.causal, ctx.window)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        padded = total + 128 * len(ctx.documents.lengths)
        softmax_d = torch.empty((h, padded), dtype=torch.float32, device=q.device)
        d_r = _round_up(d, 32 if d <= 128 else 64)
        scratch = [torch.empty((padded, h, d_r), dtype=torch.float32, device=q.device)]
        if k.shape[1] != h:
            groups = h // k.shape[1]
            scratch += [torch.empty((total, h, d), dtype=k.dtype, device=k.device) for _ in range(2)]
            torch.sum(scratch[1].unflatten(1, (k.shape[1], groups)), 2, out=dk)
            torch.sum(scratch[2].unflatten(1, (v.shape[1], groups)), 2, out=dv)
        else:
            dq.zero_()  # an op while the scratch buffers are live
        del scratch, softmax_d
        return dq, dk, dv, None, None, None, None


def _record_documents(q, k, v, documents, backward: bool, causal: bool, window) -> None:
    """Each document of a varlen call as its own causal call ([1, n, h, d] views): the counter prices it by its own
    shape (``autotune.timing.attention_cost``)."""
    for start, end in documents.spans():
        rows = slice(start, end)
        _record_attention(q[rows].unsqueeze(0), k[rows].unsqueeze(0), v[rows].unsqueeze(0), backward, causal, window)


def _fake_flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    *,
    documents,
):
    """flash-attn's ``flash_attn_varlen_func`` (``FakeVarlenFlashAttn``); ``documents``: the host boundaries that
    ``cu_seqlens_q`` holds on the device."""
    return FakeVarlenFlashAttn.apply(
        q, k, v, cu_seqlens_q, causal or window_size[1] == 0, flash_window(window_size[0]), documents
    )


_fake_flash_attn_varlen_func.takes_documents = True


def _fake_split_forward(q, k, v, causal: bool, window_left, num_splits: int, kernel: str) -> torch.Tensor:
    """What FA3's and FA4's forward entry points share: the inputs checked, the call recorded, ``out`` allocated.
    Training calls them with ``num_splits`` 1 (no split-KV partials), the only value the oracle sizes."""
    check_flash_inputs(q, k, v)
    if num_splits != 1:
        raise NotImplementedError(f"the oracle's {kernel} forward sizes num_splits=1 only")
    _record_attention(q, k, v, False, causal, flash_window(window_left))
    return torch.empty_like(q)


# -- FA3 (Hopper): hopper/flash_attn_interface.py ----------------------------------------------------------------


def _fake_fa3_flash_attn_func(q, k, v, softmax_scale=None, causal=False, *, window_size=(-1, -1), softcap=0.0):
    """FA3's ``flash_attn_func`` (its whole-layer autograd function): out."""
    return FakeFlashAttn.apply(q, k, v, causal or window_size[1] == 0, flash_window(window_size[0]), "flash3", softcap)


def _fake_fa3_forward(
    q, k, v, *, softmax_scale=None, causal=False, window_size_left=-1, window_size_right=-1, softcap=0.0, num_splits=1
):
    """FA3's ``_flash_attn_forward``: (out, softmax_lse fp32 [b, h, s], out_accum, softmax_lse_accum); the two
    split-KV accumulators are empty at ``num_splits`` 1 (what training uses)."""
    out = _fake_split_forward(q, k, v, causal or window_size_right == 0, window_size_left, num_splits, "FA3")
    b, s, h, d = q.shape
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    return out, lse, torch.empty((0,), device=q.device), torch.empty((0,), device=q.device)


def _fake_fa3_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    *,
    dq=None,
    dk=None,
    dv=None,
    softmax_scale=None,
    is_causal=False,
    window_size_left=-1,
    window_size_right=-1,
    softcap=0.0,
    deterministic=False,
):
    """FA3's ``_flash_attn_backward`` into dq/dk/dv (allocated here when not given), with ``mha_bwd``'s scratch
    (``_fa3_backward``); returns softmax_d fp32 [b, h, seqlen_q rounded]."""
    check_flash_inputs(dout, q, k, v, out, dq, dk, dv)
    _record_attention(q, k, v, True, is_causal or window_size_right == 0, flash_window(window_size_left))
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    return _fa3_backward(dout, q, k, v, dq, dk, dv, is_causal, window_size_left, window_size_right, softcap)


# -- FA4 (CuTe DSL): flash_attn/cute/interface.py ----------------------------------------------------------------


def _fake_fa4_flash_attn_func(
    q, k, v, *, softmax_scale=None, causal=False, window_size=(None, None), softcap=0.0, return_lse=False
):
    """FA4's ``flash_attn_func``: (out, lse); ``window_size`` None is unlimited."""
    left, right = window_size
    out = FakeFlashAttn.apply(q, k, v, causal or right == 0, flash_window(left), "flash4", softcap or 0.0)
    return out, None


def _fake_fa4_forward(
    q,
    k,
    v,
    *,
    softmax_scale=None,
    causal=False,
    softcap=None,
    window_size_left=None,
    window_size_right=None,
    num_splits=1,
    return_lse=False,
):
    """FA4's ``_flash_attn_fwd``: (out, lse fp32 [b, h, s] when asked for or an input requires grad, p, row_max);
    p / row_max are None without ``gather_kv_indices``, and at ``num_splits`` 1 there are no fp32 partials."""
    out = _fake_split_forward(q, k, v, causal or window_size_right == 0, window_size_left, num_splits, "FA4")
    b, s, h, d = q.shape
    wants_lse = return_lse or any(t.requires_grad for t in (q, k, v))
    lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device) if wants_lse else None
    return out, lse, None, None


def _fake_fa4_backward(
    q,
    k,
    v,
    out,
    dout,
    lse,
    softmax_scale=None,
    causal=False,
    softcap=0.0,
    window_size_left=None,
    window_size_right=None,
    *,
    deterministic=False,
    dq=None,
    dk=None,
    dv=None,
):
    """FA4's ``_flash_attn_bwd`` with its scratch (``_fa4_backward``); returns (dq, dk, dv), allocated here when
    not given."""
    check_flash_inputs(q, k, v, out, dout, dq, dk, dv)
    if deterministic:
        raise NotImplementedError("the oracle's FA4 backward sizes the non-deterministic kernel only")
    _record_attention(q, k, v, True, causal or window_size_right == 0, flash_window(window_size_left))
    dq = torch.empty_like(q) if dq is None else dq
    dk = torch.empty_like(k) if dk is None else dk
    dv = torch.empty_like(v) if dv is None else dv
    return _fa4_backward(q, k, v, dq, dk, dv, causal, window_size_left, window_size_right)


FAKE_KERNELS = {  # kernel -> its fakes (layer, forward, backward), the entry points trials.kernels.registry declares
    "flash": (_fake_flash_attn_func, _fake_wrapped_flash_attn_forward, _fake_wrapped_flash_attn_backward),
    "flash3": (_fake_fa3_flash_attn_func, _fake_fa3_forward, _fake_fa3_backward),
    "flash4": (_fake_fa4_flash_attn_func, _fake_fa4_forward, _fake_fa4_backward),
}


FAKE_VARLEN = {"flash": _fake_flash_attn_varlen_func}  # the varlen entry points ``VARLEN_KERNELS`` declare


def fake_flash_kernels(enabled: bool, kernel: str = "flash"):
    """Make ``trials.kernels.attention``'s path for flash kernel ``kernel`` use fake ops with that kernel's memory
    footprint, on the (fake) cpu device, through its public hook (restored on exit); a no-op for other kernels."""
    if not enabled or kernel not in FAKE_KERNELS:
        return contextlib.nullcontext()
    return attention.flash_kernels(*FAKE_KERNELS[kernel], kernel=kernel, varlen=FAKE_VARLEN.get(kernel))
