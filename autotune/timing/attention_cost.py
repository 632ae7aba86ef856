"""FLOPs of fused attention kernels (causal, dense, sliding-window): unmasked pairs, and the pairs a tiled
kernel really computes.

A window ``W`` is Hugging Face's ``sliding_window``: query i sees keys from ``i-W+1`` on (W keys with its own;
flash-attn's ``window_size_left = W-1``). None or 0: no window. Rows are top-left aligned: query i's last key is
i (causal, clipped to ``sk``) or ``sk-1`` (dense).
"""

from __future__ import annotations

import math

_CLOSED_FORM_TILES = 200_000  # query tiles above which ``tiled_pairs`` uses its closed form


def causal_pairs(sq: int, sk: int, causal: bool, window: int | None = None) -> int:
    """Unmasked (query, key) pairs: ``sq*sk`` dense; causal ``sum_i min(i+1, sk)``. A window takes off the keys
    left of each row's band, ``sum_i min(max(0, i-W+1), sk)``: the causal count over the first ``sq-W`` rows."""
    if not causal:
        pairs = sq * sk
    elif sq <= sk:
        pairs = sq * (sq + 1) // 2
    else:
        pairs = sk * (sk + 1) // 2 + (sq - sk) * sk
    if window and window > 0 and sq > window:
        pairs -= causal_pairs(sq - window, sk, True)
    return pairs


def attention_flops(
    batch: int,
    q_heads: int,
    sq: int,
    sk: int,
    head_dim: int,
    v_head_dim: int | None = None,
    causal: bool = True,
    window: int | None = None,
) -> tuple[float, float, float]:
    """(forward, backward, dense forward+backward) FLOPs of one fused attention call.

    Forward: QK^T and PV, ``2*d + 2*dv`` FLOPs per unmasked pair per head. Backward recomputes QK^T and does
    dV, dP, dQ, dK: ``6*d + 4*dv`` per pair (2.5x the forward when ``d == dv``). Dense: every ``sq*sk`` pair.
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    pairs = causal_pairs(sq, sk, causal, window)
    fwd = batch * q_heads * pairs * (2 * head_dim + 2 * dv)
    bwd = batch * q_heads * pairs * (6 * head_dim + 4 * dv)
    dense = batch * q_heads * sq * sk * (8 * head_dim + 6 * dv)
    return float(fwd), float(bwd), float(dense)


def tiled_pairs(sq: int, sk: int, causal: bool, tile_q: int, tile_kv: int, window: int | None = None) -> float:
    """(query, key) pairs a tiled kernel computes: for each query tile, whole key tiles from the one holding its
    first row's first unmasked key to the one holding its last row's last unmasked key, clipped to ``sk``.
    Kernels skip fully masked tiles only: right of the diagonal (torch's CPU flash kernel, flash-attn) and, with
    a window, left of the band (flash-attn)."""
    window = window if window and window > 0 else None
    if not causal and window is None:
        return float(sq * sk)
    tile_q, tile_kv = max(1, tile_q), max(1, tile_kv)
    if -(-sq // tile_q) > _CLOSED_FORM_TILES:
        return _tiled_pairs_closed(sq, sk, causal, tile_q, tile_kv, window)
    return _tiled_pairs_loop(sq, sk, causal, tile_q, tile_kv, window)


def _tiled_pairs_loop(sq: int, sk: int, causal: bool, tile_q: int, tile_kv: int, window: int | None) -> float:
    total = 0
    for start in range(0, sq, tile_q):
        rows = min(tile_q, sq - start)
        first = max(0, start - window + 1) if window else 0  # the first row's first key
        end = min(start + rows, sk) if causal else sk  # one past the last row's last key
        if first < end:
            total += rows * (min(-(-end // tile_kv) * tile_kv, sk) - first // tile_kv * tile_kv)
    return float(total)


def _tiled_pairs_closed(sq: int, sk: int, causal: bool, tile_q: int, tile_kv: int, window: int | None) -> float:
    """The unmasked pairs plus, per query row and mask edge that cuts through tiles, the keys computed beyond the
    row's own: the edge's staircase inside a query tile (``(tile_q-1)/2`` on average) and the rounding out to
    whole key tiles, averaged over the query tiles' offsets to the key tiles (they repeat every
    ``tile_kv / gcd(tile_q, tile_kv)`` query tiles). Edges: the diagonal (causal rows before ``sk``) and the
    band's left edge (rows past the window that still see a key): about a tile per row inside a band."""
    period = tile_kv // math.gcd(tile_q, tile_kv)
    staircase = (tile_q - 1) / 2.0
    excess = 0.0
    if causal:  # a query tile at s computes keys up to s + tile_q, rounded up to a key tile
        excess += min(sq, sk) * (staircase + sum(-(j + 1) * tile_q % tile_kv for j in range(period)) / period)
    if window:  # ... and from s - window + 1, rounded down to a key tile
        rows = max(0, min(sq, sk + window - 1) - window)
        excess += rows * (staircase + sum((j * tile_q - window + 1) % tile_kv for j in range(period)) / period)
    return min(float(sq) * sk, causal_pairs(sq, sk, causal, window) + excess)
