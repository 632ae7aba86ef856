"""Documents as part of the workload (issue 50): ``--documents`` parsed once, carried by the config file, the
search's outputs and the plan backend's evaluation; the time model prices each document's own causal triangle. The
commands run in-process (``conftest.here``: ``autotune.cli.main``, whose code is the exit status)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import here, tiny_plan_search
from test_cli_config import assert_exit

from autotune.backends import Evaluation
from autotune.backends.plan import PlanBackend, step_counts
from autotune.core.documents import parse_documents
from autotune.core.errors import UserError
from autotune.core.hardware import load_hardware
from autotune.timing.model import attention_time
from trials.kernels.documents import ONE, DocumentsSpec
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques
from trials.training.config_file import TrialConfig, parse_config

K = 1024


def test_documents_spec_forms(tmp_path):
    assert parse_documents("one") == ONE
    assert parse_documents("64K").lengths == (64 * K,)
    lengths = [300, 17, 2048]
    (tmp_path / "lengths.json").write_text(json.dumps(lengths))
    (tmp_path / "tokens.json").write_text(json.dumps([[1] * n for n in lengths]))
    pq.write_table(pa.table({"n": lengths}), tmp_path / "lengths.parquet")
    pq.write_table(pa.table({"input_ids": [[5] * n for n in lengths]}), tmp_path / "tokens.parquet")
    (tmp_path / "lengths.csv").write_text("".join(f"{n}\n" for n in lengths))  # no header row
    (tmp_path / "named.csv").write_text("source,tokens\n" + "".join(f"a,{n}\n" for n in lengths))
    for name in ("lengths.json", "tokens.json", "lengths.parquet", "tokens.parquet", "lengths.csv", "named.csv"):
        assert parse_documents(str(tmp_path / name)).lengths == tuple(lengths), name
    (tmp_path / "words.csv").write_text("source\na\n")
    with pytest.raises(UserError, match="has no column of integer lengths"):
        parse_documents(str(tmp_path / "words.csv"))
    # packed in order, cycled, the last one cut at the sequence's end
    assert DocumentsSpec(tuple(lengths)).for_length(3000).lengths == (300, 17, 2048, 300, 17, 318)
    assert DocumentsSpec((4 * K,)).for_length(2 * K) is None  # longer than the sequence: one document


def test_the_config_file_carries_documents():
    techniques = Techniques()
    for spec in (ONE, DocumentsSpec((64 * K,)), DocumentsSpec((100, 200))):
        doc = TrialConfig(model="tiny-llama", techniques=techniques, seq_len=4096, documents=spec).to_dict()
        assert ("documents" in doc) == (not spec.one)
        assert parse_config(json.loads(json.dumps(doc))).documents == spec


def _attention_s(seq: int, documents: DocumentsSpec) -> tuple[float, float]:
    """(attention seconds, step seconds) the plan backend predicts for tiny-llama on one CPU rank."""
    hardware = load_hardware("cpu")
    config = load_model_config("tiny-llama")
    techniques = Techniques(head_chunk=2)
    backend = PlanBackend()
    evaluation = Evaluation(config, techniques, seq, 1, hardware, documents=documents)
    record = backend.evaluate(evaluation)
    assert record.status == "ok", record.error
    counts = step_counts(backend.last_prediction)
    rates = hardware.rates_for(1).for_kernel(techniques.attention, techniques.head_chunk)
    return attention_time(counts, set(counts.phases), rates), record.step_time_s


def test_the_time_model_prices_each_documents_triangle():
    """A sequence of n documents of length L costs n times one L-token document's attention (the same kernel calls
    of the same shape), and less than one document of n * L tokens."""
    packed, packed_step = _attention_s(2 * K, DocumentsSpec((K // 2,)))
    alone, _ = _attention_s(K // 2, ONE)
    whole, whole_step = _attention_s(2 * K, ONE)
    assert packed == pytest.approx(4 * alone, rel=1e-9)
    assert packed < whole and packed_step < whole_step


@pytest.mark.slow
def test_a_search_records_its_documents_and_refuses_others_in_its_folder(tmp_path):
    out = tmp_path / "out"
    done = here("search", *tiny_plan_search("4K"), "--trials", "4", "--out", str(out), "--documents", "1K")
    assert_exit(done, 0)
    assert json.loads((out / "pareto.json").read_text())["documents"] == K
    assert json.loads((out / "best.json").read_text())["documents"] == K
    again = here("search", *tiny_plan_search("4K"), "--trials", "4", "--out", str(out))
    assert_exit(again, 2)
    assert "give another --out" in again.stderr


def test_each_trainer_says_how_it_masks_packed_documents_or_that_it_does_not():
    from autotune.core.trainers import TRAINERS

    packed = DocumentsSpec((64 * K,))
    for trainer in TRAINERS.values():
        assert trainer.packing_note(ONE, "sdpa") is None
    deepspeed = TRAINERS["deepspeed"]
    assert "position_ids" in deepspeed.packing_note(packed, "flash")
    assert deepspeed.packing_note(packed, "sdpa").startswith("PACKED DOCUMENTS NOT MASKED")  # HF SDPA ignores them
    arctic = TRAINERS["arctic"]  # its causal data factory packs with restarting position_ids
    assert "position_ids" in arctic.packing_note(packed, "flash")
    assert arctic.packing_note(packed, "sdpa").startswith("PACKED DOCUMENTS NOT MASKED")
    assert TRAINERS["accelerate-deepspeed"].packing_note(packed, "flash").startswith("PACKED DOCUMENTS NOT MASKED")
    for name in ("autotune", "accelerate"):
        assert not TRAINERS[name].packing_note(packed, "sdpa").startswith("PACKED DOCUMENTS NOT MASKED")


def test_estimate_of_a_packed_config_for_a_trainer_that_attends_across_says_so(tmp_path):
    """``autotune estimate --config`` of a packed config searched for DeepSpeed, with SDPA (which its Ulysses runs
    over the whole window): one line saying it attends across the documents; with autotune's runner, none."""
    config = TrialConfig(
        model="tiny-llama",
        hardware="cpu",
        gpus=1,
        seq_len=2 * K,
        techniques=Techniques(),
        documents=DocumentsSpec((512,)),
    )
    for trainer, says in (("deepspeed", True), (None, False)):
        path = tmp_path / f"{trainer}.json"
        path.write_text(json.dumps({**config.to_dict(), **({"trainer": trainer} if trainer else {})}))
        done = here("estimate", "--config", str(path), "--json")
        assert_exit(done, 0)
        lines = [line for line in done.stderr.splitlines() if "PACKED DOCUMENTS NOT MASKED" in line]
        assert len(lines) == says, done.stderr
        assert all("for DeepSpeed: PACKED DOCUMENTS NOT MASKED: DeepSpeed with attention 'sdpa'" in x for x in lines)


def test_a_search_offers_every_ring_where_its_trainer_pads_documents_and_none_for_windows(tmp_path):
    """A ring splits each packed document into 2 x ring chunks and runs no sliding window. autotune's trainer pads
    each document to a multiple of the chunks, so its search keeps every ring whatever the documents; a trainer that
    does not pad them (Accelerate with trials.hf: the user's batches) drops the rings that do not divide every
    document's length (all of them for documents of 1,002 tokens: 2 x 2 does not divide 1,002; for 1,000 tokens
    rings 2 and 4, 16 does not divide 1,000), and a user's space offering one is bad input (one line). No trainer
    gets a ring for a windowed model."""
    from autotune.core.errors import UserError
    from autotune.core.trainers import TRAINERS
    from autotune.search.space import load_space
    from trials.kernels.documents import DocumentsSpec
    from trials.models.config import load_model_config

    model, accelerate = load_model_config("tiny-llama"), TRAINERS["accelerate"]
    assert load_space(None, model, 4, 8192, on_gpu=False).choices["ring_degree"] == [1, 2, 4, 8]
    unsplit = DocumentsSpec((1002,))
    assert load_space(None, model, 4, 8192, on_gpu=False, documents=unsplit).choices["ring_degree"] == [1, 2, 4, 8]
    split = load_space(None, model, 4, 8192, trainer=accelerate, on_gpu=False, documents=DocumentsSpec((1000,)))
    assert split.choices["ring_degree"] == [1, 2, 4]
    unpadded = load_space(None, model, 4, 8192, trainer=accelerate, on_gpu=False, documents=unsplit)
    assert unpadded.choices["ring_degree"] == [1]
    windowed = load_model_config("tiny-mistral")
    assert load_space(None, windowed, 4, 8192, on_gpu=False).choices["ring_degree"] == [1]
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  ulysses_degree: [1, 2]\n  ring_degree: [1, 2]\n")
    assert load_space(str(space), model, 4, 8192, on_gpu=False, documents=unsplit).choices["ring_degree"] == [1, 2]
    with pytest.raises(UserError, match="ring_degree 2 splits each packed document into 2 x ring_degree = 4 chunks"):
        load_space(str(space), model, 4, 8192, trainer=accelerate, on_gpu=False, documents=unsplit)
    ring = Techniques(ring_degree=2)  # what the estimate and an export say of each
    assert "runs each packed document padded to a multiple of 4" in TRAINERS["autotune"].ring_padding_note(
        unsplit, ring
    )
    assert "pad each in the data (0.20% of the tokens would be pads)" in accelerate.ring_padding_note(unsplit, ring)
    assert accelerate.ring_padding_note(DocumentsSpec((1004,)), ring) is None
    assert TRAINERS["autotune"].ring_padding_note(unsplit, Techniques()) is None


def test_an_estimate_prices_a_rings_documents_padded_to_its_chunks(tmp_path):
    """On a ring of 2 documents of 1,002 tokens run padded to 1,004 (the trainer pads them): the estimate of those
    documents is the estimate of documents of 1,004 tokens, and differs from the same config's without a ring
    only by what the ring does, not by a refusal."""
    config = tmp_path / "ring.json"
    techniques = {"fsdp": True, "ulysses_degree": 2, "ring_degree": 2, "activation_checkpointing": True}
    config.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": "tiny-llama",
                "hardware": "cpu",
                "gpus": 4,
                "seq_len": 8192,
                "techniques": techniques,
            }
        )
    )
    records = {}
    for documents in ("1002", "1004"):
        done = here("estimate", "--config", str(config), "--documents", documents, "--json", "--memory-gib", "4")
        assert_exit(done, 0)
        records[documents] = json.loads(done.stdout)
        said = "ring_degree 2 runs each packed document padded to a multiple of 4 tokens (0.20% of the tokens are pads)"
        assert (said in done.stderr) == (documents == "1002"), done.stderr
    keys = ("peak_device_bytes", "step_time_s", "tokens_per_s")
    assert {k: records["1002"][k] for k in keys} == {k: records["1004"][k] for k in keys}


def test_a_search_for_a_trainer_that_attends_across_documents_prices_whole_windows(tmp_path):
    """DeepSpeed's Ulysses with SDPA (the only kernel on a CPU) attends across packed documents' boundaries: its
    search over 1K documents evaluates whole-window attention, so its front is the one-document front, length for
    length and tokens/s for tokens/s (priced as masked, the same lengths run faster)."""

    def front(*extra: str) -> list:
        out = tmp_path / "-".join(extra)
        done = here(
            "search", *tiny_plan_search("4K"), "--trials", "4", "--out", str(out), "--trainer", "deepspeed", *extra
        )
        assert_exit(done, 0)
        return [(e["seq_len"], e["tokens_per_s"]) for e in json.loads((out / "pareto.json").read_text())["front"]]

    assert front("--documents", "1K") == front()


def test_documents_no_shorter_than_the_sequence_are_said_to_make_one_document_each():
    """``--documents 64K --seq 32K``: every sequence is one document (``DocumentsSpec.for_length``), and the run
    says so rather than taking the documents silently; shorter documents are said nothing of."""
    from autotune.core.overrides import Defaults, resolve_config

    defaults = Defaults(gpus=1, nodes=1, hardware="cpu")
    said = resolve_config("baseline", defaults, model="tiny-llama", seq="32K", documents="64K").notices
    assert said == ["--documents 64K is not shorter than the sequence (32K): each sequence is one document"]
    assert resolve_config("baseline", defaults, model="tiny-llama", seq="64K", documents="16K").notices == []
