"""Which kernel ``F.scaled_dot_product_attention`` runs for the stack's whole-layer call, per torch release and GPU.

The call (``trials.kernels.attention.causal_attention``, kernel ``sdpa``): bf16, ``is_causal=True``, no mask, no
dropout, head dim 64 or 128, query ``[b, h, s, d]`` as Hugging Face passes it (a transposed view of ``[b, s, h, d]``,
last dim contiguous), key/value repeated to the query heads (``repeat_interleave``, contiguous; no ``enable_gqa``),
seqlen_q == seqlen_k > 1. Head-chunked attention does not go through this choice: ``attention_forward`` /
``attention_backward`` call the memory-efficient kernel (``_scaled_dot_product_efficient_attention``) directly.

The dispatch (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, read at pytorch/pytorch commit
001f694aef6f922b4fdf6d27d59162d27bf3df58): ``select_sdp_backend`` walks ``priority_order`` and returns the first
backend whose ``can_use_*`` passes. The order is ``Context``'s default (flash, efficient, math, cuDNN) unless
``check_prefer_cudnn_attention()`` holds on the process's first SDPA call, which installs (cuDNN, flash, efficient,
math). ``check_prefer_cudnn_attention``:

    prefer_cudnn = c10::utils::check_env("TORCH_CUDNN_SDPA_DEPRIORITIZED") != true     (only the value "1" is true:
                                                                                         c10/util/env.cpp check_env)
    #if CUDA_VERSION < 13000:  runtime cuDNN > 91500 && major in {9, 10} && minor in {0, 3}
    #else:                     runtime cuDNN > 91500 && major in {9, 10}

The cuDNN version is the runtime one (``versionRuntimeCuDNN``: the library loaded, which a system cuDNN on
``LD_LIBRARY_PATH`` can shadow; ``torch.backends.cudnn.version()`` reports the same). For the stack's call every
other constraint passes on compute capability 8.0 to 12.1: cuDNN's ``check_cudnn_tensor_shapes`` (head dim <= 128,
a multiple of 8; batch and heads <= 65535; seqlen_k != 1), ``check_cudnn_hardware_support`` ([sm80, sm121]),
``check_dtypes_low_precision`` (bf16 from sm80), ``check_last_dim_stride_equals_1_dense`` (stride layout is not
checked: ``check_cudnn_layout`` is defined but not in ``can_use_cudnn_attention``'s lists); flash's
``check_flash_attention_hardware_support`` ([sm80, sm121]), ``check_flash_causal_non_square_seqlens`` (square here),
head dim <= 256; efficient's ``check_mem_efficient_hardware_support`` ([sm50, sm121]) with bf16 from sm80. So the
order alone decides: cuDNN where it is preferred, else flash; below sm80 or above sm121 no fused kernel takes bf16
and math runs. Not modelled (the stack sets none of them): ``torch.use_deterministic_algorithms(True)`` (cuDNN
refuses: ``check_cudnn_deterministic``), the ``torch.backends.cuda.enable_*_sdp`` switches, ``sdpa_kernel``'s
``set_priority``, and ``torch.nn.attention.activate_flash_attention_impl("FA3" / "FA4")`` (it swaps the flash
backend's kernel; off by default).

Evidence per release (``RELEASES``): the rule's source as above; the installed ``2.15.0+cu132`` (git
d0f2af8b66b20da4baa50644c0cd3f887a2eae2e): ``objdump`` of ``sdp::select_sdp_backend`` in ``libtorch_cuda.so``
shows the inlined rule (``cudnn_version > 0x1656c`` = 91500, ``major - 9 <= 1``, no minor test: the CUDA 13 arm);
the cuDNN each release's PyPI wheel pins (``Requires-Dist: nvidia-cudnn-cu13==...``, read from the wheels'
metadata, each with ``cuda-bindings>=13.0.3,<14``: CUDA 13 builds).

What each backend keeps for backward (the autograd nodes' saved variables, torch ``2.15.0``'s
``torch/csrc/autograd/generated/Functions.h``; shapes from ``torch/_meta_registrations.py``), beyond q, k, v:
    flash   out [b, h, s, d] (a transposed [b, s, h, d] buffer) + logsumexp fp32 [b, h, s] + rng_state (2 x uint64)
    cudnn   out [b, h, s, d] (``alloc_with_matching_layout(query)``) + logsumexp fp32 [b, h, s, 1] (the same bytes)
            + philox seed and offset (int64 scalars)
    efficient  out + logsumexp fp32 [b, h, s rounded up to 32] + philox seed and offset
    math    the composite's intermediates, among them the softmaxed [b, h, s, s] attention weights
So flash and cuDNN keep the same bytes: the oracle's sdpa footprint (the CPU flash op's out + logsumexp, traced under
FakeTensorMode; ``autotune.oracle.fake_world``) holds for cuDNN's residuals. Their backwards differ: the oracle adds
FA2's scratch (fp32 ``dq_accum`` [b, s, h, d] + ``softmax_d`` [b, h, s]) to the CPU backward, while cuDNN's
backward allocates a workspace whose size cuDNN's execution plan reports at run time (``get_workspace_size``, through
torch's caching allocator); no source states it, so for cuDNN that scratch is an assumption until measured.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

BACKENDS = ("cudnn", "flash", "efficient", "math")
DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn")  # aten/src/ATen/Context.h sdp_priority_order
CUDNN_ORDER = ("cudnn", "flash", "efficient", "math")  # sdp_utils.cpp priority_order, cudnn_order
DEPRIORITIZE_ENV = "TORCH_CUDNN_SDPA_DEPRIORITIZED"
CUDNN_PREFERRED_ABOVE = 91500  # check_prefer_cudnn_attention: cudnn_version > 91500 (cuDNN 9.15.1's seq-len fix)
CUDNN_PREFERRED_MAJORS = (9, 10)  # Hopper, Blackwell (datacenter)
CUDNN_PREFERRED_MINORS_CUDA12 = (0, 3)  # sm90, sm100, sm103 (PR #170800); CUDA < 13 builds only

# The op each backend runs (what a trace records for it)
ATEN_OPS = {
    "cudnn": "aten::_scaled_dot_product_cudnn_attention",
    "flash": "aten::_scaled_dot_product_flash_attention",
    "efficient": "aten::_scaled_dot_product_efficient_attention",
    "math": "aten::_scaled_dot_product_attention_math",
}

# compute capability ranges each backend's hardware check accepts (sdp_utils.cpp at 001f694a; the same messages,
# "[sm80, sm121]" / "[sm50, sm121]", are in 2.15.0's libtorch_cuda.so); bf16 needs sm80 in every fused backend
HARDWARE = {
    "cudnn": ((8, 0), (12, 1)),  # check_cudnn_hardware_support
    "flash": ((8, 0), (12, 1)),  # check_flash_attention_hardware_support
    "efficient": ((8, 0), (12, 1)),  # check_mem_efficient_hardware_support [sm50, sm121]; bf16 only from sm80
}


class SdpaRelease(NamedTuple):
    """What decides SDPA's backend in one torch release: the cuDNN its PyPI wheel pins, and whether the minor-version
    test of ``check_prefer_cudnn_attention`` applies to CUDA 12 builds only (True) or to every build (False)."""

    release: str
    wheel_cudnn: int  # cuDNN's version number (major * 10000 + minor * 100 + patch) in the PyPI wheel's pin
    wheel_cudnn_pin: str  # the wheel's Requires-Dist
    minor_test_cuda12_only: bool
    source: str


RELEASES = {
    "2.11": SdpaRelease(
        "2.11",
        91900,
        "nvidia-cudnn-cu13==9.19.0.56",
        True,
        "rule: sdp_utils.cpp at 001f694a (this release's tag not read; huggingface/transformers#48163 reports the "
        "rule from 2.10 on, with 2.11's cuDNN the first past 91500); an unconditional minor test, as pytorch#174200 "
        "describes it in 2026-02, gives the same answer on 8.0, 9.0, 10.0 and 10.3",
    ),
    "2.12": SdpaRelease(
        "2.12",
        92000,
        "nvidia-cudnn-cu13==9.20.0.48",
        True,
        "rule: sdp_utils.cpp at 001f694a (this release's tag not read); 2.12.1 pins the same cuDNN",
    ),
    "2.13": SdpaRelease(
        "2.13",
        92000,
        "nvidia-cudnn-cu13==9.20.0.48",
        True,
        "rule: sdp_utils.cpp at 001f694a; a third-party report quoting tag v2.13.0's sdp_utils.cpp (l. 80-107; found "
        "in the code index, its repository unnamed) has the same CUDA < 13000 arm",
    ),
    "2.14": SdpaRelease(
        "2.14",
        92400,
        "nvidia-cudnn-cu13==9.24.0.43",
        True,
        "rule: sdp_utils.cpp at 001f694a (this release's tag not read); 2.14.1 pins the same cuDNN",
    ),
    "2.15": SdpaRelease(
        "2.15",
        92600,
        "nvidia-cudnn-cu13==9.26.0.51",
        True,
        "rule: sdp_utils.cpp at 001f694a, and the 2.15.0+cu132 binary (git d0f2af8b): select_sdp_backend compares "
        "the runtime cuDNN with 91500 and the major with 9..10, no minor test (the CUDA 13 arm)",
    ),
}


def release_of(torch_version: str) -> SdpaRelease:
    """The declared release of ``torch_version`` ("2.15.0", "2.15.0+cu132", "2.13.0a0+git..."); a ValueError for a
    release not declared (its dispatch was not read, so it is not guessed)."""
    major_minor = ".".join(torch_version.split("+")[0].split(".")[:2])
    if major_minor not in RELEASES:
        raise ValueError(f"torch {torch_version}: SDPA's dispatch is declared for {', '.join(RELEASES)} only")
    return RELEASES[major_minor]


def _cuda_major(cuda_version: str | None) -> int | None:
    return int(cuda_version.split(".")[0]) if cuda_version else None


def prefers_cudnn(
    torch_version: str,
    compute_capability: tuple[int, int],
    cudnn_version: int | None,
    cuda_version: str | None,
    env: Mapping[str, str],
) -> bool:
    """``check_prefer_cudnn_attention()``: whether the first SDPA call puts cuDNN first in the priority order.
    Without cuDNN (``cudnn_version`` None) torch has no ``CUDNN_VERSION`` and returns false; ``cuda_version`` None
    (``CUDA_VERSION`` undefined) takes the ``#else`` arm, without the minor test, as the preprocessor does."""
    release = release_of(torch_version)
    if env.get(DEPRIORITIZE_ENV) == "1":  # check_env: "1" -> true, "0" -> false, anything else -> nullopt
        return False
    if cudnn_version is None or cudnn_version <= CUDNN_PREFERRED_ABOVE:
        return False
    major, minor = compute_capability
    if major not in CUDNN_PREFERRED_MAJORS:
        return False
    cuda_major = _cuda_major(cuda_version)
    minor_tested = not release.minor_test_cuda12_only or (cuda_major is not None and cuda_major < 13)
    return not minor_tested or minor in CUDNN_PREFERRED_MINORS_CUDA12


def _takes_the_call(backend: str, compute_capability: tuple[int, int], cudnn_version: int | None) -> bool:
    """Whether ``can_use_<backend>`` passes for the stack's whole-layer call (bf16, causal, head dim <= 128)."""
    if backend == "math":
        return True
    if backend == "cudnn" and (cudnn_version is None or cudnn_version < 90000):  # can_use_cudnn_attention: >= 9.0
        return False
    low, high = HARDWARE[backend]
    return low <= tuple(compute_capability) <= high


def sdpa_backend(
    torch_version: str,
    compute_capability: tuple[int, int],
    cudnn_version: int | None,
    cuda_version: str | None,
    env: Mapping[str, str],
) -> str:
    """The backend ("cudnn", "flash", "efficient" or "math") ``select_sdp_backend`` picks for the stack's whole-layer
    SDPA call in torch ``torch_version`` on a GPU of ``compute_capability`` with runtime cuDNN ``cudnn_version``
    (``torch.backends.cudnn.version()``: 92600 for 9.26.0; None without cuDNN), a build for CUDA ``cuda_version``
    (``torch.version.cuda``) and environment ``env``: the first backend of the priority order that takes the call."""
    prefer = prefers_cudnn(torch_version, compute_capability, cudnn_version, cuda_version, env)
    order = CUDNN_ORDER if prefer else DEFAULT_ORDER
    return next(b for b in order if _takes_the_call(b, compute_capability, cudnn_version))


def here() -> str | None:
    """``sdpa_backend`` for this process's torch, current CUDA device, runtime cuDNN, CUDA build and environment;
    None without a CUDA device."""
    import torch

    if not torch.cuda.is_available() or torch.version.hip:
        return None
    capability = tuple(torch.cuda.get_device_capability())
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return sdpa_backend(torch.__version__, capability, cudnn_version, torch.version.cuda, os.environ)
