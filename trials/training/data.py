"""Synthetic (or user) token stream and the sequence split of DESIGN.md's data rule.

Each data-parallel replica (a group of ``ulysses_degree`` consecutive ranks) trains on one sequence per
step; replica r gets sample r of a seeded stream. Labels are shifted over the *whole* sequence before it is
split, so the token at the end of one rank's shard is predicted from the start of the next one:

    tokens       [seq + 1]           sample r of the stream
    input_ids    [1, seq]            tokens[:-1]
    labels       [1, seq]            tokens[1:]
    position_ids [1, seq]            0 .. seq-1
    shard k of ulysses_degree: columns [k * seq/deg, (k+1) * seq/deg) of each

A user's tokens come from a Parquet/Arrow file (``read_token_file``), checked whole before any rank builds a model:
a file training cannot use is a ``DataError`` naming the file and what is wrong.

With a ring (``ring_degree`` R > 1) the sequence is first cut into 2R equal chunks and ring rank r takes chunks r
and 2R-1-r, in that order (the zigzag split: under a causal mask every ring step then does equal work); the
Ulysses ranks of that ring rank split those 2 * seq/(2R) columns as above. Position ids are the columns' global
positions, so rotary embeddings see where each token sits in the whole sequence.

With packed documents (``trials.kernels.documents.Documents``, global over the sequence) position ids restart at
0 at each document, and the label of each document's last token (the next document's first token) is -100: no
label crosses a boundary, so the loss is the sum of each document's own loss. A ring then splits each document
instead of the sequence (the per-document zigzag, as TransformerEngine's context parallelism splits each sequence
of ``cu_seqlens``): every document of L_d tokens (L_d divisible by 2R) is cut into 2R chunks and ring rank r holds
chunks r and 2R-1-r of every document, document after document, so every document's causal work is balanced over
the ring and every rank holds L_d / R tokens of each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trials.kernels.documents import Documents
from trials.stack.rules import ring_documents_problem


class DataError(ValueError):
    """A token file training cannot use (one line: the file, then what is wrong with it)."""


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


def zigzag_columns(seq_len: int, ring_rank: int, ring_degree: int, documents: Documents | None = None) -> torch.Tensor:
    """The global columns ring rank ``ring_rank`` holds: chunks r and 2R-1-r of 2R equal chunks (all of them
    when ``ring_degree`` is 1); with packed ``documents``, chunks r and 2R-1-r of each document, in the documents'
    order (each document's length divisible by 2R)."""
    spans = [(0, seq_len)] if documents is None else documents.spans()
    if documents is not None and documents.total != seq_len:
        raise ValueError(f"documents cover {documents.total} tokens, the sequence has {seq_len}")
    if ring_degree == 1:
        return torch.arange(seq_len)
    unit = 2 * ring_degree
    if documents is not None:
        problem = ring_documents_problem(ring_degree, documents.lengths)
    else:
        problem = f"seq_len {seq_len} is not divisible by 2 x ring_degree {ring_degree}" if seq_len % unit else None
    if problem:
        raise ValueError(problem)
    held = []
    for start, end in spans:
        chunk = (end - start) // unit
        for which in (ring_rank, unit - 1 - ring_rank):
            held.append(torch.arange(start + which * chunk, start + (which + 1) * chunk))
    return torch.cat(held)


def rank_columns(
    seq_len: int,
    sp_rank: int,
    sp_degree: int,
    ring_rank: int = 0,
    ring_degree: int = 1,
    documents: Documents | None = None,
):
    """The global columns of a ``seq_len`` sequence this rank holds: its ring rank's zigzag columns (of each of
    ``documents`` when given), then its Ulysses slice of them (a ``slice`` without a ring, so the shard is a view; a
    tensor of indices with one)."""
    if seq_len % sp_degree:
        raise ValueError(f"seq_len {seq_len} is not divisible by ulysses_degree {sp_degree}")
    if ring_degree == 1:
        local = seq_len // sp_degree
        return slice(sp_rank * local, (sp_rank + 1) * local)
    columns = zigzag_columns(seq_len, ring_rank, ring_degree, documents)
    if columns.numel() % sp_degree:
        raise ValueError(
            f"seq_len {seq_len} is not divisible by 2 x ring_degree {ring_degree} x ulysses_degree {sp_degree}"
        )
    local = columns.numel() // sp_degree
    return columns[sp_rank * local : (sp_rank + 1) * local]


def make_batch(
    tokens: torch.Tensor,
    sp_rank: int,
    sp_degree: int,
    device,
    ring_rank: int = 0,
    ring_degree: int = 1,
    documents: Documents | None = None,
    pads: torch.Tensor | None = None,
) -> Batch:
    """tokens [seq + 1] -> this rank's shard of the shifted sequence (its ring rank's zigzag columns, per document
    when packed ``documents`` are given, then its Ulysses slice of them: ``rank_columns``). ``pads`` (bool [seq + 1],
    with ``documents``): the pad tokens ``pad_documents`` put at the ends of documents; no label is a pad, and a pad
    predicts nothing (each is after every real token of its document, which causal attention never lets one see)."""
    seq_len = tokens.numel() - 1
    cols = rank_columns(seq_len, sp_rank, sp_degree, ring_rank, ring_degree, documents)
    input_ids = tokens[:-1][cols].unsqueeze(0)
    positions = torch.arange(seq_len)
    valid = seq_len
    if documents is None:
        labels = tokens[1:]
    else:
        if documents.total != seq_len:
            raise ValueError(f"documents cover {documents.total} tokens, the sequence has {seq_len}")
        labels = tokens[1:].clone()
        positions = torch.tensor(documents.positions())
        labels[[end - 1 for end in documents.offsets[1:]]] = -100
        valid = seq_len - len(documents.lengths)
        if pads is not None:
            labels[pads[1:] | pads[:-1]] = -100
            valid = int((labels != -100).sum())
    labels, positions = labels[cols].unsqueeze(0), positions[cols].unsqueeze(0)
    return Batch(input_ids.to(device), labels.to(device), positions.to(device), valid, documents)


@dataclass
class TokenData:
    """A token file's contents: its ids as one stream, and the lengths of its rows of ``input_ids`` (one document
    each, in order; None for a ``tokens`` column, whose documents are found at the model's EOS id)."""

    tokens: torch.Tensor  # int64 [n]
    row_lengths: np.ndarray | None = None

    def document_ends(self, eos_token_ids=()) -> np.ndarray | None:
        """Where each document of the stream ends (exclusive, sorted, the last one the stream's end), or None when
        the data has no boundary inside the stream: rows of ``input_ids`` are documents; a ``tokens`` stream is cut
        after each of ``eos_token_ids`` (each document keeps its EOS)."""
        total = self.tokens.numel()
        if self.row_lengths is not None:
            ends = np.cumsum(self.row_lengths)
        else:
            ids = self.tokens.numpy()
            ends = np.flatnonzero(np.isin(ids, np.asarray(list(eos_token_ids), dtype=np.int64))) + 1
        ends = np.unique(np.append(ends[(ends > 0) & (ends < total)], total))  # rows of no tokens end nothing
        return ends if ends.size > 1 else None


def pad_documents(tokens: torch.Tensor, ends: np.ndarray, unit: int, pad_id: int = 0):
    """A token stream whose documents end at ``ends`` with each document followed by the fewest ``pad_id`` tokens
    that make its length a multiple of ``unit`` (a ring's, ``trials.stack.rules.ring_document_unit``): (its tokens,
    its documents' ends, a bool tensor that is True at each pad), or ``tokens, ends, None`` where every length
    already is a multiple. Real tokens keep their order; ``make_batch`` gives the pads no label."""
    lengths = np.diff(ends, prepend=0)
    padding = (-lengths) % unit
    if unit <= 1 or not padding.any():
        return tokens, ends, None
    padded_ends = np.cumsum(lengths + padding)
    shift = np.repeat(padded_ends - lengths - padding - (ends - lengths), lengths)  # each real token's move
    real = torch.from_numpy(np.arange(int(ends[-1])) + shift)
    padded = torch.full((int(padded_ends[-1]),), pad_id, dtype=tokens.dtype)
    padded[real] = tokens
    pads = torch.ones(padded.numel(), dtype=torch.bool)
    pads[real] = False
    return padded, padded_ends, pads


def window_documents(ends: np.ndarray, start: int, seq_len: int) -> Documents:
    """The documents of the ``seq_len`` tokens from ``start`` of a stream whose documents end at ``ends`` (the last
    one its length), read around its end: a document crossing the window's start or end is cut there."""
    total = int(ends[-1])
    cuts, lap, stop = [], 0, start + seq_len
    while lap * total < stop:
        low, high = start - lap * total, stop - lap * total
        inside = ends[np.searchsorted(ends, low, "right") : np.searchsorted(ends, high, "left")]
        cuts.extend(int(end) + lap * total - start for end in inside)
        lap += 1
    return Documents(tuple(np.diff([0, *cuts, seq_len]).tolist()))


def read_token_file(path: str, vocab_size: int) -> torch.Tensor:
    """The token stream of a Parquet/Arrow file for a model of ``vocab_size`` (``read_token_data``'s ids)."""
    return read_token_data(path, vocab_size).tokens


def read_token_data(path: str, vocab_size: int) -> TokenData:
    """The tokens of a Parquet/Arrow file for a model of ``vocab_size``: a column ``input_ids`` (one document,
    a list of ids, per row) or ``tokens`` (one id per row), flattened in row order; ``DataError`` when the file is
    missing, empty, not Parquet/Arrow, holds no documents or no tokens, a null, a non-integer column, or an id
    outside ``[0, vocab_size)``. The ids are checked whole, vectorized, before any rank builds a model."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    file = Path(path)
    if not file.is_file():
        raise DataError(f"{path}: does not exist")
    if file.stat().st_size == 0:
        raise DataError(f"{path}: the file is empty (0 bytes)")
    try:
        table = (
            pa.ipc.open_file(file).read_all() if file.suffix in (".arrow", ".feather", ".ipc") else pq.read_table(file)
        )
    except (pa.ArrowException, OSError) as exc:  # pyarrow's ArrowInvalid is a ValueError too
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(f"{path}: cannot be read as a Parquet or Arrow file: {said}") from None
    if "input_ids" in table.column_names:
        documents = table.column("input_ids")
        if not pa.types.is_list(documents.type) and not pa.types.is_large_list(documents.type):
            raise DataError(f"{path}: the column 'input_ids' holds {documents.type} values, not lists of token ids")
        if len(documents) == 0:
            raise DataError(f"{path}: holds no documents (the column 'input_ids' has no rows)")
        column = pc.list_flatten(documents)
        if len(column) == 0:
            raise DataError(f"{path}: its {len(documents):,} documents (rows of 'input_ids') hold no tokens")
    elif "tokens" in table.column_names:
        documents, column = None, table.column("tokens")
        if len(column) == 0:
            raise DataError(f"{path}: holds no tokens (the column 'tokens' has no rows)")
    else:
        raise DataError(f"{path}: needs a column 'input_ids' (lists of token ids) or 'tokens' (token ids)")
    if not pa.types.is_integer(column.type):  # floats would be truncated to ids, strings cannot be ids
        raise DataError(f"{path}: the token column holds {column.type} values, not integer token ids")
    if column.null_count:
        at = int(np.flatnonzero(pc.is_null(column).to_numpy(zero_copy_only=False))[0])
        raise DataError(f"{path}: token {_where(at, documents)} is null, not a token id")
    ids = column.to_numpy()
    bad = first_outside_vocabulary(ids, vocab_size)
    if bad is not None:
        raise DataError(
            f"{path}: token {_where(bad, documents)} is id {int(ids[bad])}, outside the model's vocabulary "
            f"[0, {vocab_size})"
        )
    if ids.size < 2:
        raise DataError(f"{path}: holds fewer than 2 tokens")
    tokens = torch.from_numpy(np.require(ids, np.int64, ["W"]))  # Arrow's buffers are read-only: copied once if so
    if documents is None:
        return TokenData(tokens)
    return TokenData(tokens, pc.list_value_length(documents).fill_null(0).to_numpy(zero_copy_only=False))


def first_outside_vocabulary(ids: np.ndarray, vocab_size: int) -> int | None:
    """The index of the first id outside ``[0, vocab_size)`` in ``ids``, or None: two vectorized reductions, and a
    search only when one of them is out of range."""
    if ids.size == 0 or (ids.min() >= 0 and ids.max() < vocab_size):
        return None
    return int(np.flatnonzero((ids < 0) | (ids >= vocab_size))[0])


def _where(index: int, documents) -> str:
    """Token ``index`` of the stream, named by its place in the file: ``12,345`` (a ``tokens`` row), or ``12,345
    (document 7, position 12)`` for a row of ``input_ids`` (each counted from 0)."""
    if documents is None:
        return f"{index:,}"
    import pyarrow.compute as pc

    ends = np.cumsum(pc.list_value_length(documents).fill_null(0).to_numpy(zero_copy_only=False))
    row = int(np.searchsorted(ends, index, side="right"))
    start = int(ends[row - 1]) if row else 0
    return f"{index:,} (document {row:,}, position {index - start:,})"


def mesh_batch(
    tokens: torch.Tensor, mesh, device=None, documents: Documents | None = None, pads: torch.Tensor | None = None
) -> Batch:
    """``make_batch`` for this rank of ``mesh`` (a ``trials.core.dist.Mesh``): its ring rank's zigzag columns and
    its Ulysses slice of them, on ``device`` (default: the mesh's), of packed ``documents`` (and their ``pads``)
    when given."""
    return make_batch(
        tokens, mesh.sp_rank, mesh.sp_degree, device or mesh.device, mesh.ring_rank, mesh.ring_degree, documents, pads
    )
