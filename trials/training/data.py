"""Synthetic (or user) token stream and the sequence split of DESIGN.md's data rule.

Each data-parallel replica (a group of ``ulysses_degree`` consecutive ranks) trains on one sequence per
step; replica r gets sample r of a seeded stream. Labels are shifted over the *whole* sequence before it is
split, so the token at the end of one rank's shard is predicted from the start of the next one:

    tokens       [seq + 1]           sample r of the stream
    input_ids    [1, seq]            tokens[:-1]
    labels       [1, seq]            tokens[1:]
    position_ids [1, seq]            0 .. seq-1
    shard k of ulysses_degree: columns [k * seq/deg, (k+1) * seq/deg) of each

With packed documents (``trials.kernels.documents.Documents``, global over the sequence) position ids restart at
0 at each document, and the label of each document's last token (the next document's first token) is -100: no
label crosses a boundary, so the loss is the sum of each document's own loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trials.kernels.documents import Documents


@dataclass
class Batch:
    input_ids: torch.Tensor  # [1, seq_local]
    labels: torch.Tensor  # [1, seq_local]
    position_ids: torch.Tensor  # [1, seq_local]
    valid_tokens: int  # labelled tokens in the whole sequence (not just this shard)
    documents: Documents | None = None  # packed documents, global over the whole sequence (None: one)


def synthetic_sample(index: int, seq_len: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 1_000_003 + index)
    return torch.randint(0, vocab_size, (seq_len + 1,), generator=generator)


def make_batch(tokens: torch.Tensor, sp_rank: int, sp_degree: int, device, documents: Documents | None = None) -> Batch:
    """tokens [seq + 1] -> this rank's shard of the shifted sequence (of packed ``documents`` when given)."""
    seq_len = tokens.numel() - 1
    if seq_len % sp_degree:
        raise ValueError(f"seq_len {seq_len} is not divisible by ulysses_degree {sp_degree}")
    local = seq_len // sp_degree
    cols = slice(sp_rank * local, (sp_rank + 1) * local)
    input_ids = tokens[:-1][cols].unsqueeze(0)
    labels = tokens[1:].clone()
    positions = torch.arange(seq_len)
    valid = seq_len
    if documents is not None:
        if documents.total != seq_len:
            raise ValueError(f"documents cover {documents.total} tokens, the sequence has {seq_len}")
        positions = torch.tensor(documents.positions())
        labels[[end - 1 for end in documents.offsets[1:]]] = -100
        valid = seq_len - len(documents.lengths)
    labels, positions = labels[cols].unsqueeze(0), positions[cols].unsqueeze(0)
    return Batch(input_ids.to(device), labels.to(device), positions.to(device), valid, documents)
