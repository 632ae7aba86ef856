"""FLOPs of fused causal attention kernels: unmasked pairs, and the pairs a tiled kernel really computes."""

from __future__ import annotations


def causal_pairs(sq: int, sk: int, causal: bool) -> int:
    """Unmasked (query, key) pairs: ``sq*sk`` dense; causal (top-left aligned) ``sum_i min(i+1, sk)``."""
    if not causal:
        return sq * sk
    if sq <= sk:
        return sq * (sq + 1) // 2
    return sk * (sk + 1) // 2 + (sq - sk) * sk


def attention_flops(
    batch: int, q_heads: int, sq: int, sk: int, head_dim: int, v_head_dim: int | None = None, causal: bool = True
) -> tuple[float, float, float]:
    """(forward, backward, dense forward+backward) FLOPs of one fused attention call.

    Forward: QK^T and PV, ``2*d + 2*dv`` FLOPs per unmasked pair per head. Backward recomputes QK^T and does
    dV, dP, dQ, dK: ``6*d + 4*dv`` per pair (2.5x the forward when ``d == dv``).
    """
    dv = head_dim if v_head_dim is None else v_head_dim
    pairs = causal_pairs(sq, sk, causal)
    fwd = batch * q_heads * pairs * (2 * head_dim + 2 * dv)
    bwd = batch * q_heads * pairs * (6 * head_dim + 4 * dv)
    dense = batch * q_heads * sq * sk * (8 * head_dim + 6 * dv)
    return float(fwd), float(bwd), float(dense)


def tiled_pairs(sq: int, sk: int, causal: bool, tile_q: int, tile_kv: int) -> float:
    """(query, key) pairs a tiled kernel computes: for each query tile, every key tile up to its last unmasked
    key, whole (torch's CPU flash kernel and flash-attn both skip fully masked tiles only)."""
    if not causal:
        return float(sq * sk)
    tile_q, tile_kv = max(1, tile_q), max(1, tile_kv)
    blocks = -(-sq // tile_q)
    if blocks > 200_000:  # closed form for huge sequences: the excess is about half a tile per query row
        return min(float(sq) * sk, causal_pairs(sq, sk, True) + sq * tile_kv / 2.0 + sq * tile_q / 2.0)
    total = 0
    for index in range(blocks):
        start = index * tile_q
        rows = min(tile_q, sq - start)
        keys = min(start + rows, sk)
        total += rows * min(-(-keys // tile_kv) * tile_kv, sk)
    return float(total)
