"""The declared SDPA dispatch (``trials.kernels.sdpa_backend``): which kernel torch's SDPA runs for the stack's
whole-layer call, one case per rule of ``check_prefer_cudnn_attention`` and of the backends' hardware checks; and,
on a CUDA GPU (``-m cuda``), that the declaration agrees with the backend this torch picks for the stack's call."""

from __future__ import annotations

import pytest

from trials.kernels.sdpa_backend import (
    BACKENDS,
    DEPRIORITIZE_ENV,
    RELEASES,
    here,
    prefers_cudnn,
    release_of,
    sdpa_backend,
)

H100, A100, B200, B300 = (9, 0), (8, 0), (10, 0), (10, 3)
CUDNN_2_15 = RELEASES["2.15"].wheel_cudnn  # 9.26.0: nvidia-cudnn-cu13==9.26.0.51


def backend(capability=H100, cudnn=CUDNN_2_15, cuda="13.0", env=None, torch_version="2.15.0"):
    return sdpa_backend(torch_version, capability, cudnn, cuda, env or {})


def test_hopper_runs_cudnn_with_the_shipped_cudnn():
    """torch 2.15 with its wheel's cuDNN 9.26 on an H100/H200: cuDNN first, and it takes the call."""
    assert backend(H100) == "cudnn"


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_every_declared_release_ships_a_cudnn_past_the_threshold(release):
    """2.11 (cuDNN 9.19) to 2.15 (9.26): every PyPI wheel's cuDNN is past 9.15, so Hopper runs cuDNN in each."""
    assert backend(H100, cudnn=RELEASES[release].wheel_cudnn, torch_version=f"{release}.0") == "cudnn"


def test_the_environment_variable_deprioritizes_cudnn():
    """TORCH_CUDNN_SDPA_DEPRIORITIZED=1 keeps the default order: flash first. c10's check_env reads only "1" as
    true; "0" and other values leave cuDNN preferred."""
    assert backend(H100, env={DEPRIORITIZE_ENV: "1"}) == "flash"
    assert backend(B200, env={DEPRIORITIZE_ENV: "1"}) == "flash"
    assert backend(H100, env={DEPRIORITIZE_ENV: "0"}) == "cudnn"
    assert backend(H100, env={DEPRIORITIZE_ENV: "true"}) == "cudnn"


def test_ampere_runs_flash():
    """sm80 is not among cuDNN's preferred majors: the default order puts torch's vendored FA2 first."""
    assert backend(A100) == "flash"


def test_blackwell_runs_cudnn():
    assert backend(B200) == "cudnn"
    assert backend(B300) == "cudnn"


def test_cudnn_must_be_newer_than_9_15():
    """cudnn_version > 91500: 9.15.0 keeps flash first, 9.15.1 (the seq-len fix) puts cuDNN first; no cuDNN at all
    (a build without it) keeps flash."""
    assert backend(H100, cudnn=91500) == "flash"
    assert backend(H100, cudnn=91501) == "cudnn"
    assert backend(H100, cudnn=None) == "flash"


def test_a_cuda_12_build_prefers_cudnn_on_minor_0_and_3_only():
    """Built for CUDA < 13, the preference also needs minor 0 or 3 (sm90, sm100, sm103); a CUDA 13 build drops
    that test (sm101 stands for a 10.x part of another minor)."""
    assert backend(H100, cuda="12.9") == "cudnn"
    assert backend(B300, cuda="12.9") == "cudnn"
    assert backend((10, 1), cuda="12.9") == "flash"
    assert backend((10, 1), cuda="13.0") == "cudnn"
    assert prefers_cudnn("2.15.0", (10, 1), CUDNN_2_15, None, {})  # CUDA_VERSION undefined: the #else arm


def test_outside_the_fused_kernels_range_math_runs():
    """bf16 needs sm80 in every fused backend, and each checks [sm80 (sm50), sm121]: a T4 and a part past sm121
    run math; consumer Blackwell (sm120) is not a preferred major, so flash."""
    assert backend((7, 5)) == "math"
    assert backend((13, 0)) == "math"
    assert backend((12, 0)) == "flash"


def test_releases_are_read_from_torch_versions():
    assert release_of("2.15.0+cu132").release == "2.15"
    assert release_of("2.13.0a0+gitd0f2af8").release == "2.13"
    with pytest.raises(ValueError, match="2.11, 2.12, 2.13, 2.14, 2.15"):
        release_of("2.10.0")


def test_here_is_none_without_cuda():
    import torch

    if torch.cuda.is_available():
        assert here() in BACKENDS
    else:
        assert here() is None


@pytest.mark.cuda
def test_here_matches_the_backend_torch_picks():
    """On a GPU: the declared backend is the one ``torch._fused_sdp_choice`` returns for the stack's call (bf16,
    causal, head dim 64 and 128, query a transposed [b, s, h, d] view, key/value contiguous)."""
    import torch
    from torch.nn.attention import SDPBackend

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    names = {
        SDPBackend.CUDNN_ATTENTION: "cudnn",
        SDPBackend.FLASH_ATTENTION: "flash",
        SDPBackend.EFFICIENT_ATTENTION: "efficient",
        SDPBackend.MATH: "math",
    }
    for dim in (64, 128):
        q = torch.randn(1, 256, 4, dim, device="cuda", dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k, v = (torch.randn(1, 4, 256, dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in "kv")
        choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True)
        picked = next(name for member, name in names.items() if int(member.value) == choice)
        assert picked == here(), f"head dim {dim}: torch picks {picked}, the table says {here()}"
