"""Sliding-window attention is priced by its band: the unmasked pairs, the tiles a kernel computes, the counter's
keys (from the oracle's fake flash kernels and from flash-attn-like dispatcher ops), and the time model."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autotune.core.hardware import load_hardware
from autotune.oracle.fake_world import (
    _fake_flash_attn_func,
    _fake_wrapped_flash_attn_backward,
    _fake_wrapped_flash_attn_forward,
)
from autotune.timing.attention_cost import (
    _tiled_pairs_closed,
    _tiled_pairs_loop,
    attention_flops,
    causal_pairs,
    tiled_pairs,
)
from autotune.timing.counting import StepCounter
from autotune.timing.counts import COMPUTE_PHASES, StepCounts, attention_key_parts
from autotune.timing.model import attention_time
from trials.core.memory import DeviceMemoryTracker

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too


def band_mask(sq: int, sk: int, causal: bool, window: int | None) -> torch.Tensor:
    """Hugging Face's mask, top-left aligned: ``kv_idx <= q_idx`` (causal) and ``kv_idx > q_idx - W``."""
    q, kv = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    mask = kv <= q if causal else torch.ones(sq, sk, dtype=torch.bool)
    return mask & (kv > q - window) if window else mask


SHAPES = [(1, 1), (7, 7), (16, 16), (7, 12), (12, 7), (20, 5)]


@pytest.mark.parametrize("sq,sk", SHAPES)
def test_band_pairs_match_a_brute_force_count(sq, sk):
    for causal in (True, False):
        for window in (None, 1, 2, 3, 5, sq - 1, sq, sq + 3):
            pairs = causal_pairs(sq, sk, causal, window)
            assert pairs == int(band_mask(sq, sk, causal, window).sum()), (causal, window)
            fwd, bwd, dense = attention_flops(2, 3, sq, sk, 16, 8, causal, window)
            assert fwd == 2 * 3 * pairs * (2 * 16 + 2 * 8) and bwd == 2 * 3 * pairs * (6 * 16 + 4 * 8)
            assert dense == 2 * 3 * sq * sk * (8 * 16 + 6 * 8)  # the dense figure ignores the mask


def tile_walk(sq: int, sk: int, causal: bool, tile_q: int, tile_kv: int, window: int | None) -> int:
    """Pairs of every (query tile, key tile) that holds an unmasked pair, whole (clipped to the sequences)."""
    mask = band_mask(sq, sk, causal, window)
    total = 0
    for q0 in range(0, sq, tile_q):
        for k0 in range(0, sk, tile_kv):
            block = mask[q0 : q0 + tile_q, k0 : k0 + tile_kv]
            total += block.numel() if block.any() else 0
    return total


@pytest.mark.parametrize("sq,sk", SHAPES + [(64, 64), (50, 37)])
def test_tiled_pairs_skip_tiles_on_both_sides_of_the_band(sq, sk):
    for tile_q, tile_kv in ((1, 1), (4, 4), (4, 8), (8, 3), (5, 7)):
        for causal in (True, False):
            for window in (None, 1, 3, 4, 9, sq, sq + 5):
                expected = tile_walk(sq, sk, causal, tile_q, tile_kv, window)
                assert tiled_pairs(sq, sk, causal, tile_q, tile_kv, window) == expected, (
                    tile_q,
                    tile_kv,
                    causal,
                    window,
                )


@pytest.mark.parametrize(
    "seq,window,tile_q,tile_kv,causal",
    [
        (1 << 20, 4096, 128, 128, True),
        (1 << 20, 4096, 128, 64, True),
        (1 << 20, 4096, 256, 512, True),
        (1 << 20, None, 128, 128, True),
        (1 << 20, 3000, 100, 96, True),
        (1 << 20, 3000, 100, 96, False),
        (1_000_003, 777, 48, 80, True),
    ],
)
def test_the_closed_form_matches_the_loop(seq, window, tile_q, tile_kv, causal):
    loop = _tiled_pairs_loop(seq, seq, causal, tile_q, tile_kv, window)
    assert _tiled_pairs_closed(seq, seq, causal, tile_q, tile_kv, window) == pytest.approx(loop, rel=1e-5)
    # huge sequences take the closed form
    huge = 1 << 26
    assert tiled_pairs(huge, huge, causal, 128, 128, window) == _tiled_pairs_closed(
        huge, huge, causal, 128, 128, window
    )


def windowed_flash_counts(seq: int, window: int | None, wrapped: bool = False) -> StepCounts:
    """A StepCounter's counts of the oracle's fake flash kernel, forward and backward, on fake tensors, in the
    memory tracker's phases as the oracle runs them."""
    b, h, d = 1, 4, 128
    left = window - 1 if window else -1
    with FakeTensorMode():
        q, k, v = (torch.empty(b, seq, h, d, dtype=torch.bfloat16, requires_grad=not wrapped) for _ in range(3))
        tracker = DeviceMemoryTracker()
        counter = StepCounter(tracker)
        with tracker, counter:
            if wrapped:  # flash-attn >= 2.7's entry points, as trials.kernels.attention drives them
                with tracker.in_phase("forward"):
                    out, lse, _, _ = _fake_wrapped_flash_attn_forward(q, k, v, 0.0, None, True, left, 0)
                with tracker.in_phase("backward"):
                    grads = [torch.empty_like(t) for t in (q, k, v)]
                    _fake_wrapped_flash_attn_backward(out, q, k, v, out, lse, *grads, 0.0, None, True, left, 0)
            else:
                with tracker.in_phase("forward"):
                    out = _fake_flash_attn_func(q, k, v, causal=True, window_size=(left, 0), softcap=0.0)
                with tracker.in_phase("backward"):
                    out.backward(torch.empty_like(out))
    assert counter.failures == {}
    return counter.counts


def test_the_counter_prices_a_windowed_fake_flash_call_by_its_band():
    seq, window, h, d = 1 << 20, 4096, 4, 128
    full, band = windowed_flash_counts(seq, None), windowed_flash_counts(seq, window)
    pairs = causal_pairs(seq, seq, True, window)
    assert pairs == window * (window + 1) // 2 + (seq - window) * window
    assert band.phases["forward"].attention_flops == h * pairs * 4 * d
    assert band.phases["backward"].attention_bwd_flops == 2.5 * band.phases["forward"].attention_flops
    assert band.phases["forward"].attention_dense_flops == full.phases["forward"].attention_dense_flops
    assert sorted(band.attention_calls) == [
        f"backward|bwd|{seq}|{seq}|{d}|{d}|1|{window}",
        f"forward|fwd|{seq}|{seq}|{d}|{d}|1|{window}",
    ]
    assert windowed_flash_counts(seq, window, wrapped=True).attention_calls == band.attention_calls
    # the time model: the band costs about s / (2W) times less than full causal attention
    r = load_hardware("h100-sxm").rates_for(1)
    ratio = attention_time(full, COMPUTE_PHASES, r) / attention_time(band, COMPUTE_PHASES, r)
    tiles = (r.attention_tile_q, r.attention_tile_kv)
    assert ratio == pytest.approx(tiled_pairs(seq, seq, True, *tiles) / tiled_pairs(seq, seq, True, *tiles, window))
    assert ratio == pytest.approx(seq / (2 * window), rel=0.04)  # a band row computes ~a tile more than W


def test_flash_attn_dispatcher_ops_carry_their_window():
    """flash-attn's custom ops reach the counter as dispatcher ops: the window comes from their arguments."""

    @torch.library.custom_op("autotune_window_test::_flash_attn_forward", mutates_args=())
    def flash_forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window_size_left: int, window_size_right: int
    ) -> torch.Tensor:
        return torch.empty_like(q)

    b, s, h, d, window = 1, 64, 2, 16, 10
    q = torch.empty(b, s, h, d)
    counter = StepCounter()
    with counter:
        flash_forward(q, q, q, True, window - 1, 0)
        flash_forward(q, q, q, False, window - 1, 0)  # right 0: causal all the same
        flash_forward(q, q, q, True, -1, -1)
    assert counter.failures == {}
    assert counter.counts.attention_calls == {
        f"forward|fwd|{s}|{s}|{d}|{d}|1|{window}": 2 * b * h,
        f"forward|fwd|{s}|{s}|{d}|{d}|1|0": b * h,
    }
    band = causal_pairs(s, s, True, window)
    assert counter.counts.phases["forward"].attention_flops == b * h * 4 * d * (2 * band + causal_pairs(s, s, True))


def test_keys_without_the_window_field_parse_as_no_window():
    old, new = "forward|fwd|4096|4096|64|64|1", "forward|fwd|4096|4096|64|64|1|0"
    assert attention_key_parts(old) == attention_key_parts(new) == ("forward", False, 4096, 4096, 64, 64, True, None)
    assert attention_key_parts("backward|bwd|8|8|4|4|1|3")[-1] == 3
    r = load_hardware("h100-sxm").rates_for(1)
    times = [attention_time(StepCounts(attention_calls={key: 8.0}), COMPUTE_PHASES, r) for key in (old, new)]
    assert times[0] == times[1] > 0
    stored = StepCounts.from_dict(StepCounts(attention_calls={old: 8.0}).to_dict())
    assert attention_time(stored, COMPUTE_PHASES, r) == times[0]
