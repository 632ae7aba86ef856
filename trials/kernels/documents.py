"""Packed documents: where each document starts and ends inside one training sequence.

A sequence of ``s`` tokens holds documents of ``lengths`` tokens (summing to ``s``), back to back. Attention stays
inside each document (a block-diagonal causal mask, never built: each document runs as its own causal call), and
position ids restart at 0 at each document (RoPE sees every document as it would alone), as ALST / Hugging Face
packing carry them in ``position_ids`` and flash-attn's varlen entry points in ``cu_seqlens``.

The boundaries are host integers, global over the whole sequence: under Ulysses each rank attends over the full
sequence for its heads, so every rank holds every boundary; a ring (``trials.stack.ring``) derives its ranks' layout of
every document from the global boundaries; the memory oracle runs the step under FakeTensorMode, where tensor values
do not exist, so boundaries never come from a tensor's values.

``Documents`` travels with the batch (``trials.training.data.Batch.documents``) and reaches attention as the
keyword ``DOCUMENTS_KWARG`` of the Hugging Face model's forward, which every decoder layer hands to its attention
module and attention interface (also when a checkpointed layer is recomputed in backward).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from itertools import accumulate

DOCUMENTS_KWARG = "autotune_documents"


@dataclass(frozen=True)
class Documents:
    """Lengths of the documents packed into one sequence, in order (each >= 1)."""

    lengths: tuple[int, ...]

    def __post_init__(self):
        if not self.lengths or any(int(n) < 1 for n in self.lengths):
            raise ValueError(f"document lengths must be positive integers, got {self.lengths[:8]}")
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))

    @classmethod
    def fixed(cls, seq_len: int, length: int) -> Documents:
        """``seq_len`` tokens cut into documents of ``length`` tokens (the last one shorter where it does not divide)."""
        full, rest = divmod(seq_len, length)
        return cls((length,) * full + ((rest,) if rest else ()))

    @classmethod
    def packed(cls, seq_len: int, lengths) -> Documents:
        """Documents of ``lengths`` (cycled) packed in order into ``seq_len`` tokens; the one that crosses the end is
        cut there (the rest of it would start the next sequence)."""
        lengths = [int(n) for n in lengths]
        if not lengths or min(lengths) < 1:
            raise ValueError("document lengths must be positive integers")
        out, total, index = [], 0, 0
        while total < seq_len:
            n = min(lengths[index % len(lengths)], seq_len - total)
            out.append(n)
            total += n
            index += 1
        return cls(tuple(out))

    @classmethod
    def from_position_ids(cls, position_ids) -> Documents | None:
        """The documents of one packed sequence's ``position_ids`` (a ``[1, seq]`` or ``[seq]`` tensor or list, the
        whole sequence's): a document starts at each 0 and counts up by 1, the convention of ``transformers``'
        ``DataCollatorWithFlattening`` and TRL's padding-free batches. None: the sequence is one document (0 ..
        seq-1). Read on the host (a few scalars and the starts), once per batch; ValueError, naming the first token
        that breaks the convention, for any other position ids."""
        import torch

        ids = torch.as_tensor(position_ids)
        if ids.dim() == 2 and ids.shape[0] == 1:
            ids = ids[0]
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"position_ids: one sequence's, not shape {list(ids.shape)}")
        starts = (ids == 0).nonzero().flatten()
        if starts.numel() == 0 or int(starts[0]) != 0:
            raise ValueError("position_ids: the first document starts at position 0")
        counted = torch.arange(ids.numel(), device=ids.device)
        expected = counted - starts[(ids == 0).cumsum(0) - 1]  # each token's offset in its document
        wrong = (ids != expected).nonzero().flatten()
        if wrong.numel():
            at = int(wrong[0])
            raise ValueError(
                f"position_ids: token {at} has position {int(ids[at])}, not {int(expected[at])}: each document counts "
                "0, 1, 2, ..."
            )
        offsets = [*starts.tolist(), ids.numel()]
        lengths = [end - start for start, end in zip(offsets, offsets[1:])]
        return cls(tuple(lengths)) if len(lengths) > 1 else None

    @property
    def total(self) -> int:
        return sum(self.lengths)

    @property
    def offsets(self) -> tuple[int, ...]:
        """``cu_seqlens``: 0, then each document's end (len = documents + 1)."""
        return (0, *accumulate(self.lengths))

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    def spans(self):
        """(start, end) of each document."""
        offsets = self.offsets
        return list(zip(offsets, offsets[1:]))

    def positions(self):
        """Position ids over the whole sequence, a numpy int64 array: 0 .. n-1 within each document (built
        vectorized: a 5M-token window is one array, not five million Python ints)."""
        import numpy as np

        lengths = np.asarray(self.lengths, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        return np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)

    def cu_seqlens(self, device):
        """flash-attn's ``cu_seqlens``: int32 [documents + 1] on ``device``, one tensor per device for these lengths.

        Building it is a blocking host-to-device copy; every layer's varlen call (a checkpointed layer's recompute
        included) reuses the first one. The cache is keyed by the lengths, not kept on the object: FSDP2 hands each
        module's forward a copy of its dataclass inputs (``dataclasses.replace``, casting their tensors), so a field
        would be copied empty per layer, and one that ``__init__`` does not take breaks the copy. It is built outside
        inference mode, since the kernel's autograd saves it for backward. Under FakeTensorMode (the memory oracle's
        trace) it is a fake of that mode, built per call and never cached: a fake belongs to its mode, and a real
        tensor does not enter one."""
        import torch
        from torch._guards import detect_fake_mode

        build = _offsets_tensor if detect_fake_mode() is not None else _cached_offsets_tensor
        return build(self.offsets, torch.device(device))


def _offsets_tensor(offsets: tuple[int, ...], device):
    """``offsets`` as an int32 tensor on ``device``, made outside inference mode."""
    import torch

    with torch.inference_mode(False):
        return torch.tensor(offsets, dtype=torch.int32, device=device)


# built once per documents layout and device (a step's few layouts: the last 16 kept)
_cached_offsets_tensor = functools.lru_cache(maxsize=16)(_offsets_tensor)


def documents_of(kwargs: dict, seq_len: int) -> Documents | None:
    """The documents an attention call was handed (None: the sequence is one document). ``seq_len`` is the full
    sequence the call attends over; a mismatch is a wiring error, raised with both lengths."""
    documents = kwargs.get(DOCUMENTS_KWARG)
    if documents is None or len(documents.lengths) == 1:
        return None
    if documents.total != seq_len:
        raise ValueError(f"documents cover {documents.total} tokens, attention sees {seq_len}")
    return documents


@dataclass(frozen=True)
class DocumentsSpec:
    """The documents a workload trains on, as part of the workload (``--documents``, the config file's
    ``documents``): one document per sequence (``lengths`` empty), documents of one fixed length (one length), or
    documents of the given lengths, packed in order into each sequence (``Documents.packed``)."""

    lengths: tuple[int, ...] = ()

    def __post_init__(self):
        if any(isinstance(n, bool) or int(n) < 1 for n in self.lengths):
            raise ValueError("document lengths must be positive integers")
        object.__setattr__(self, "lengths", tuple(int(n) for n in self.lengths))

    @property
    def one(self) -> bool:
        return not self.lengths

    def for_length(self, seq_len: int, unit: int = 1) -> Documents | None:
        """The documents of one sequence of ``seq_len`` tokens (None: the sequence is one document), each padded up
        to a multiple of ``unit`` tokens first (``padded``): a ring's, ``trials.stack.rules.ring_document_unit``."""
        padded = self.padded(unit)
        if padded.one or (len(padded.lengths) == 1 and padded.lengths[0] >= seq_len):
            return None
        return Documents.packed(seq_len, padded.lengths)

    def padded(self, unit: int) -> DocumentsSpec:
        """These documents, each followed by the fewest pad tokens that make its length a multiple of ``unit``:
        what a ring of ``unit / 2`` runs (``trials.training.data.pad_documents``)."""
        if unit <= 1 or all(n % unit == 0 for n in self.lengths):
            return self
        return DocumentsSpec(tuple(n + (-n) % unit for n in self.lengths))

    def pad_share(self, unit: int) -> float:
        """The share of pad tokens in the padded documents (``padded``): 0 where every length is a multiple."""
        padded = sum(self.padded(unit).lengths)
        return (padded - sum(self.lengths)) / padded if padded else 0.0

    def to_json(self):
        """The config file's form: "one", a length, or the list of lengths."""
        if self.one:
            return "one"
        return self.lengths[0] if len(self.lengths) == 1 else list(self.lengths)

    @classmethod
    def from_json(cls, value) -> DocumentsSpec:
        """Read ``to_json``'s form back (ValueError with the reason)."""
        if value is None or value == "one":
            return cls()
        if isinstance(value, int) and not isinstance(value, bool):
            return cls((value,))
        if isinstance(value, list) and value and all(isinstance(n, int) and not isinstance(n, bool) for n in value):
            return cls(tuple(value))
        raise ValueError(f'documents must be "one", a length or a list of lengths, got {str(value)[:60]}')

    def describe(self) -> str:
        if self.one:
            return "one document per sequence"
        if len(self.lengths) == 1:
            return f"documents of {self.lengths[0]:,} tokens"
        mean = sum(self.lengths) / len(self.lengths)
        return f"{len(self.lengths):,} documents of {mean:,.0f} tokens on average"


ONE = DocumentsSpec()
