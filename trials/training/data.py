"""Synthetic (or user) token stream and the sequence split of DESIGN.md's data rule.

Each data-parallel replica (a group of ``ulysses_degree`` consecutive ranks) trains on one sequence per
step; replica r gets sample r of a seeded stream. Labels are shifted over the *whole* sequence before it is
split, so the token at the end of one rank's shard is predicted from the start of the next one:

    tokens       [seq + 1]           sample r of the stream
    input_ids    [1, seq]            tokens[:-1]
    labels       [1, seq]            tokens[1:]
    position_ids [1, seq]            0 .. seq-1
    shard k of ulysses_degree: columns [k * seq/deg, (k+1) * seq/deg) of each

With a ring (``ring_degree`` R > 1) the sequence is first cut into 2R equal chunks and ring rank r takes chunks r
and 2R-1-r, in that order (the zigzag split: under a causal mask every ring step then does equal work); the
Ulysses ranks of that ring rank split those 2 * seq/(2R) columns as above. Position ids are the columns' global
positions, so rotary embeddings see where each token sits in the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # [1, seq_local]
    labels: torch.Tensor  # [1, seq_local]
    position_ids: torch.Tensor  # [1, seq_local]
    valid_tokens: int  # labelled tokens in the whole sequence (not just this shard)


def synthetic_sample(index: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randint(0, vocab_size, (seq_len + 1,), generator=generator)


def zigzag_columns(seq_len: int, ring_rank: int, ring_degree: int) -> torch.Tensor:
    """The global columns ring rank ``ring_rank`` holds: chunks r and 2R-1-r of 2R equal chunks (all of them
    when ``ring_degree`` is 1)."""
    if seq_len % (2 * ring_degree):
        raise ValueError(f"seq_len {seq_len} is not divisible by 2 x ring_degree {ring_degree}")
    if ring_degree == 1:
        return torch.arange(seq_len)
    chunk = seq_len // (2 * ring_degree)
    first, second = ring_rank, 2 * ring_degree - 1 - ring_rank
    return torch.cat(
        [torch.arange(first * chunk, (first + 1) * chunk), torch.arange(second * chunk, (second + 1) * chunk)]
    )


def make_batch(
    tokens: torch.Tensor, sp_rank: int, sp_degree: int, device, ring_rank: int = 0, ring_degree: int = 1
) -> Batch:
    """tokens [seq + 1] -> this rank's shard of the shifted sequence (its ring rank's zigzag columns, then its
    Ulysses slice of them)."""
    seq_len = tokens.numel() - 1
    if seq_len % sp_degree:
        raise ValueError(f"seq_len {seq_len} is not divisible by ulysses_degree {sp_degree}")
    if ring_degree == 1:  # one contiguous slice: views of the sample
        local = seq_len // sp_degree
        cols = slice(sp_rank * local, (sp_rank + 1) * local)
        positions = torch.arange(seq_len)[cols].unsqueeze(0)
    else:
        columns = zigzag_columns(seq_len, ring_rank, ring_degree)
        if columns.numel() % sp_degree:
            raise ValueError(
                f"seq_len {seq_len} is not divisible by 2 x ring_degree {ring_degree} x ulysses_degree {sp_degree}"
            )
        local = columns.numel() // sp_degree
        cols = columns[sp_rank * local : (sp_rank + 1) * local]
        positions = cols.unsqueeze(0)
    input_ids = tokens[:-1][cols].unsqueeze(0)
    labels = tokens[1:][cols].unsqueeze(0)
    return Batch(input_ids.to(device), labels.to(device), positions.to(device), valid_tokens=seq_len)


def mesh_batch(tokens: torch.Tensor, mesh, device=None) -> Batch:
    """``make_batch`` for this rank of ``mesh`` (a ``trials.core.dist.Mesh``): its ring rank's zigzag columns and
    its Ulysses slice of them, on ``device`` (default: the mesh's)."""
    return make_batch(tokens, mesh.sp_rank, mesh.sp_degree, device or mesh.device, mesh.ring_rank, mesh.ring_degree)
