"""Ring attention over packed documents is exact (issues 49 and 50): the per-document zigzag.

A ring of R splits each packed document into 2R chunks and ring rank r holds chunks r and 2R-1-r of every document
(``trials.training.data.zigzag_columns``, ``trials.stack.ring``). Exactness: the stack harness
(``tests/stack_harness.py``) on gloo ranks, each case against the plain single-process model run on each document
alone (its documents reference: loss within rel 1e-5, every parameter gradient within rel 1e-4, fp32). Three
documents of unequal lengths, each a multiple of 2 x ring only (not of 2 x ring x Ulysses: Ulysses splits a ring
rank's columns as a whole), boundaries off the Ulysses shards' edges. Ring 2 on 2 ranks in the fast suite; head
chunks, the full stack, ring 4 and Ulysses 2 x ring 2 on 4 ranks slow (``four_rank_ring_cases``, in
``tests/test_stack.py``'s 4-rank launch at this file's length). Each launch runs the ring's own cases of its world
size and suite too, without documents (``tests/test_ring.py``): starting ranks costs more than the cases.

Without processes: the per-document split gives every column to one rank, positions restarting per document; the
ring's block schedule over documents, run for every rank and step, visits exactly each document's causal (query,
key) pairs once and no pair across documents, every rank running the same block shapes; the step counter sees each
document's blocks (what the time model prices); and the rules.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_ring import CKPT_OFFLOAD, FULL, TILES, four_rank_cases, two_rank_cases, two_rank_slow_cases
from tests.test_stack import HARNESS, _check_exact, _launch
from trials.core.errors import ConfigError
from trials.kernels.documents import Documents, DocumentsSpec
from trials.models.config import load_model_config
from trials.stack.ring import Ring, local_documents
from trials.stack.techniques import Techniques
from trials.training.data import make_batch, zigzag_columns

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

SEQ = 256
LENGTHS = [36, 8, 212]  # multiples of 4 (2 x ring 2), 36 not of 8 (2 x ring 2 x Ulysses 2)


def _case(name: str, model: str, step: bool = False, **techniques) -> dict:
    return {
        "name": f"{model}/documents/{name}",
        "model": model,
        "techniques": techniques,
        "step": step,
        "documents": LENGTHS,
    }


def test_ring_with_and_without_documents_exact_two_ranks(tmp_path):
    cases = [
        _case("ring2", "tiny-llama", ring_degree=2),
        _case("ring2+checkpointing+offload+tiles", "tiny-qwen3", ring_degree=2, **CKPT_OFFLOAD, **TILES),
        *two_rank_cases(),  # the ring's own (tests/test_ring.py), in the same launch
    ]
    _check_exact(_launch(HARNESS, 2, {"seq_len": SEQ, "cases": cases}, tmp_path, timeout=600), len(cases))


@pytest.mark.slow
def test_ring_with_and_without_documents_exact_two_ranks_with_head_chunks_the_full_stack_and_the_plugin(tmp_path):
    cases = [
        _case("ring2+head_chunk=1", "tiny-llama", ring_degree=2, head_chunk=1),
        _case("ring2+full+head_chunk=2", "tiny-qwen3", step=True, ring_degree=2, head_chunk=2, **FULL),
        # the plugin's seam: a Hugging Face batch, the documents only in its position_ids (trials.hf.batch)
        {**_case("ring2 (trials.hf.batch)", "tiny-llama", ring_degree=2), "hf_batch": True},
        *two_rank_slow_cases(tmp_path),  # the ring's own (tests/test_ring.py), in the same launch
    ]
    _check_exact(_launch(HARNESS, 2, {"seq_len": SEQ, "cases": cases}, tmp_path, timeout=600), len(cases))


def four_rank_ring_cases() -> list[dict]:
    """Ulysses 2 x ring 2 and a ring of 4, with and without documents, at this file's length: they run in
    ``tests/test_stack.py``'s 4-rank launch (``test_exact_four_ranks_with_replicated_kv_heads``), with the ring's own
    4-rank cases (tests/test_ring.py); four ranks cost the most to start."""
    cases = [
        _case("ulysses2xring2", "tiny-llama", ulysses_degree=2, ring_degree=2),
        _case(
            "ulysses2xring2+head_chunk=1+checkpointing",
            "tiny-qwen3",
            ulysses_degree=2,
            ring_degree=2,
            head_chunk=1,
            **CKPT_OFFLOAD,
        ),
        _case(
            "ulysses2xring2+full+head_chunk=2",
            "tiny-llama",
            step=True,
            ulysses_degree=2,
            ring_degree=2,
            head_chunk=2,
            **FULL,
        ),
        {**_case("ring4+tiles", "tiny-llama", ring_degree=4, **TILES), "documents": [48, 8, 200]},
    ]
    # each case's mesh is built on the same 4 ranks
    return [{**case, "seq_len": SEQ} for case in cases + four_rank_cases()]


# -- the split and the schedule (no processes) ----------------------------------------------------------------------


@pytest.mark.parametrize("ring", [2, 3])
def test_each_rank_holds_two_mirrored_chunks_of_every_document(ring):
    documents = Documents((4 * ring, 2 * ring, 6 * ring))
    seq = documents.total
    held = [zigzag_columns(seq, r, ring, documents) for r in range(ring)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    for r, columns in enumerate(held):
        at = 0
        for start, end in documents.spans():
            chunk = (end - start) // (2 * ring)
            mirror = 2 * ring - 1 - r
            expected = [*range(start + r * chunk, start + (r + 1) * chunk)]
            expected += range(start + mirror * chunk, start + (mirror + 1) * chunk)
            assert columns[at : at + 2 * chunk].tolist() == expected
            at += 2 * chunk
    with pytest.raises(ValueError, match="a document of 6 tokens is not a multiple of 4"):
        zigzag_columns(18, 0, 2, Documents((8, 6, 4)))


def test_a_ring_batch_restarts_positions_per_document_and_labels_no_boundary():
    documents = Documents((8, 4, 12))
    tokens = torch.arange(100, 125)
    positions, labels = [], []
    for start, end in documents.spans():
        positions += range(end - start)
        labels += tokens[start + 1 : end].tolist() + [-100]
    seen = []
    for ring_rank in range(2):
        for u in range(2):
            batch = make_batch(tokens, u, 2, "cpu", ring_rank=ring_rank, ring_degree=2, documents=documents)
            columns = zigzag_columns(24, ring_rank, 2, documents)[u * 6 : (u + 1) * 6]
            assert batch.input_ids[0].tolist() == tokens[columns].tolist()
            assert batch.position_ids[0].tolist() == [positions[c] for c in columns]
            assert batch.labels[0].tolist() == [labels[c] for c in columns]
            assert batch.valid_tokens == 24 - 3 and batch.documents == documents
            seen += columns.tolist()
    assert sorted(seen) == list(range(24))


def _ring(rank: int, degree: int) -> Ring:
    ring = Ring.__new__(Ring)
    ring.rank, ring.degree = rank, degree
    return ring


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_the_schedule_visits_each_documents_causal_pairs_once_and_no_pair_across_documents(degree):
    documents = Documents((2 * degree * 3, 2 * degree, 2 * degree * 5))
    seq = documents.total
    local = seq // degree
    layout = local_documents(documents, degree)
    columns = [zigzag_columns(seq, r, degree, documents) for r in range(degree)]
    visits = torch.zeros(seq, seq, dtype=torch.int64)
    for step in range(degree):
        shapes = set()
        for rank in range(degree):
            ring = _ring(rank, degree)
            blocks = ring.blocks(step, local, layout)
            shapes.add(tuple((q_rows, kv_rows, causal) for _, q_rows, _, kv_rows, causal in blocks))
            for q_start, q_rows, kv_start, kv_rows, causal in blocks:
                q_cols = columns[rank][q_start : q_start + q_rows]
                k_cols = columns[ring.source(step)][kv_start : kv_start + kv_rows]
                visible = torch.ones(len(q_cols), len(k_cols), dtype=torch.bool)
                if causal:
                    visible = visible.tril()
                rows, cols = torch.nonzero(visible, as_tuple=True)
                visits.index_put_((q_cols[rows], k_cols[cols]), torch.ones_like(rows), accumulate=True)
        assert len(shapes) == 1  # every rank runs the same blocks: the oracle's trace of one rank stands for all
    expected = torch.zeros(seq, seq, dtype=torch.int64)
    for start, end in documents.spans():
        expected[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.int64).tril()
    assert torch.equal(visits, expected)


# -- the rules --------------------------------------------------------------------------------------------------


def test_a_ring_runs_packed_documents_padded_to_its_chunks():
    """Any documents run on a ring: each padded up to a multiple of 2 x ring (what autotune's trainer runs, and so
    what the predictions price), the sequence's own rules unchanged."""
    from trials.stack.rules import ring_document_unit

    llama = load_model_config("tiny-llama")
    usp = Techniques(ulysses_degree=2, ring_degree=2)
    usp.validate(llama, 4, 256)
    assert [ring_document_unit(ring) for ring in (1, 2, 4)] == [1, 4, 8]
    spec = DocumentsSpec((30, 2))
    assert spec.padded(4) == DocumentsSpec((32, 4)) and spec.padded(1) is spec
    assert spec.pad_share(4) == pytest.approx(4 / 36) and DocumentsSpec((36, 8)).pad_share(4) == 0.0
    assert spec.for_length(256, 4) == Documents((32, 4) * 7 + (4,))  # the last one cut at the sequence's end
    assert spec.for_length(256) == Documents((30, 2) * 8)
    assert DocumentsSpec((20,)).for_length(256, 8) == Documents((24,) * 10 + (16,))
    assert DocumentsSpec((255,)).for_length(256, 4) is None  # padded to 256: the sequence is one document
    for ring, documents in ((2, spec), (4, DocumentsSpec((20,)))):
        packed = documents.for_length(256, ring_document_unit(ring))
        assert all(n % (2 * ring) == 0 for n in packed.lengths), (ring, packed)
    with pytest.raises(ConfigError, match="sliding-window"):
        Techniques(ring_degree=2).validate(load_model_config("tiny-mistral"), 2, 256)


# -- the time model: the counter sees each document's ring blocks ----------------------------------------------------


@pytest.mark.parametrize("degree", [2, 3])
def test_the_counter_prices_a_ring_over_documents_as_each_document_on_the_ring(degree):
    """A rank's counted attention over packed documents (forward and backward) equals the sum of each document's on
    the same ring alone, call shape by call shape: the time model prices each document's blocks, not the sequence's."""
    from autotune.timing.counting import StepCounter
    from tests.test_ring import _OneProcessRing
    from trials.stack.ring import ring_backward, ring_forward

    def counted(lengths, documents):
        local = sum(lengths) // degree
        query = torch.randn(1, 4, local, 8)
        key, value = torch.randn(1, 2, local, 8), torch.randn(1, 2, local, 8)
        ring = _OneProcessRing(degree, rank=degree - 1)
        counter = StepCounter()
        with counter:
            out, residuals = ring_forward(query, key, value, 8**-0.5, "sdpa", ring, documents=documents)
            ring_backward(
                torch.ones_like(out), query, [key, value], out, residuals, 8**-0.5, "sdpa", ring, documents=documents
            )
        return counter.counts

    lengths = [2 * degree * 6, 2 * degree, 2 * degree * 3]
    packed = counted(lengths, Documents(tuple(lengths)))
    alone = [counted([n], None) for n in lengths]
    assert packed.attention_flops == sum(c.attention_flops for c in alone) > 0
    calls = {}
    for counts in alone:
        for key, heads in counts.attention_calls.items():
            calls[key] = calls.get(key, 0) + heads
    assert packed.attention_calls == calls
    assert packed.attention_flops < counted([sum(lengths)], None).attention_flops  # the whole sequence's ring
