"""The oracle's fake world: a fake process group, constants for data-dependent scalars, and GPU kernels'
memory footprints on a CPU-only torch (flash-attn 2, and the CUDA SDPA flash backward's scratch)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.timing.counting import flash_window, record_attention
from trials import attention


@contextlib.contextmanager
def fake_process_group(world_size: int, needed: bool | None = None):
    """A fake default process group of ``world_size`` ranks (this process is rank 0); destroyed on exit.

    ``needed``: default ``world_size > 1``; one rank needs one too when FSDP runs there."""

    if not (world_size > 1 if needed is None else needed):
        yield
        return
    if dist.is_initialized():
        raise RuntimeError(
            "the memory oracle cannot run in a process that already has a process group; run it in a separate process"
        )

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
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


class FakeFlashAttn(torch.autograd.Function):
    """flash-attn 2's ``flash_attn_func`` as far as memory goes (fake tensors only: nothing is computed).

    q [b, s, hq, d], k/v [b, s, hkv, d] -> out [b, s, hq, d]; saves q, k, v, out, softmax_lse [b, hq, s] fp32.
    Backward (``mha_bwd``): dq/dk/dv like q/k/v; while it runs, fp32 ``dq_accum`` [b, s, hq, d], fp32
    ``softmax_d`` [b, hq, s] and, when hkv < hq, ``dk``/``dv`` expanded to hq heads (summed down at the end).
    ``causal`` and the sliding ``window`` (W keys per query, None: none) change the FLOPs the throughput counter
    is told, not the memory (flash's buffers are O(s)).
    """

    @staticmethod
    def forward(ctx, q, k, v, causal=True, window=None):
        check_flash_inputs(q, k, v)
        b, s, h, d = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.window = causal, window
        _record_attention(q, k, v, backward=False, causal=causal, window=window)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        b, s, h, d = q.shape
        _record_attention(q, k, v, backward=True, causal=ctx.causal, window=ctx.window)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        scratch = [
            torch.empty((b, s, h, d), dtype=torch.float32, device=q.device),
            torch.empty((b, h, s), dtype=torch.float32, device=q.device),
        ]
        if k.shape[2] != h:
            scratch += [
                torch.empty((b, k.shape[1], h, d), dtype=k.dtype, device=k.device),
                torch.empty((b, v.shape[1], h, d), dtype=v.dtype, device=v.device),
            ]
            # summed down to the kv heads into dk/dv (an op while the scratch buffers are live)
            groups = h // k.shape[2]
            torch.sum(scratch[2].unflatten(2, (k.shape[2], groups)), 3, out=dk)
            torch.sum(scratch[3].unflatten(2, (v.shape[2], groups)), 3, out=dv)
        else:
            dq.zero_()  # an op while the scratch buffers are live
        del scratch
        return dq, dk, dv, None, None


def check_flash_inputs(*tensors) -> None:
    """Refuse what flash-attn's kernels refuse (``mha_fwd``/``mha_bwd``: fp16/bf16 only, one dtype for all), so a
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
    """flash-attn's ``mha_bwd`` into dq/dk/dv, with its scratch (see ``FakeFlashAttn``); returns softmax_d."""
    check_flash_inputs(dout, q, k, v, out, dq, dk, dv)
    b, s, h, d = q.shape
    _record_attention(q, k, v, True, causal or window_size_right == 0, flash_window(window_size_left))
    softmax_d = torch.empty((b, h, s), dtype=torch.float32, device=q.device)
    scratch = [torch.empty((b, s, h, d), dtype=torch.float32, device=q.device)]
    if k.shape[2] != h:
        groups = h // k.shape[2]
        scratch += [
            torch.empty((b, k.shape[1], h, d), dtype=k.dtype, device=k.device),
            torch.empty((b, v.shape[1], h, d), dtype=v.dtype, device=v.device),
        ]
        torch.sum(scratch[1].unflatten(2, (k.shape[2], groups)), 3, out=dk)
        torch.sum(scratch[2].unflatten(2, (v.shape[2], groups)), 3, out=dv)
    else:
        dq.zero_()
    del scratch
    return softmax_d


def fake_flash_kernels(enabled: bool):
    """Make ``trials.attention``'s flash path use fake flash-attn ops with flash-attn 2's memory footprint, on the
    (fake) cpu device, through its public hook (restored on exit)."""
    if not enabled:
        return contextlib.nullcontext()
    return attention.flash_kernels(
        _fake_flash_attn_func, _fake_wrapped_flash_attn_forward, _fake_wrapped_flash_attn_backward
    )
