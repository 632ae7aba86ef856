"""Exports of a search over packed documents (issue 50, item 5).

A front config searched with ``--documents 512`` (tiny-llama, 2K tokens, one rank's worth of Ulysses) is exported
to each trainer. Where the trainer masks the documents, the export feeds packed windows with their boundaries,
and the trainer's code trains them to the plain model run on each document alone: the DeepSpeed ``.alst.py``'s
``packed_windows`` (restarting ``position_ids``) and the ``accelerate`` export's ``.train.py`` (``--data`` packed
as ``autotune run --pack`` packs it). Where the trainer attends across the documents (its declaration,
``Trainer.masks_documents``), the export says so and re-estimates what it runs with attention over each whole
window (``--documents one``), beside the estimate as searched.
"""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, run_judge

from autotune.core.trainers import TRAINERS
from autotune.outputs.exporters import make_exporter
from autotune.outputs.exporters.selection import export_entry
from trials.kernels.documents import ONE, DocumentsSpec
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

SEQ_LEN = 2048
DOCUMENTS = DocumentsSpec((512,))  # what the search packed: 4 documents of 512 tokens per window
# one rank's config (the judges run one process): checkpointing, half the layers' inputs offloaded, tiles
KNOBS = dict(activation_checkpointing=True, activation_offload_layers=2, mlp_tile_tokens=512, loss_tile_tokens=512)
# the documents the trainers are fed: uneven, one of a single token, the last cut at the window's end
LENGTHS = [700, 1, 900, 600]
WINDOW = [700, 1, 900, SEQ_LEN - 1601]


def plan(model_config, techniques, documents):
    from autotune.backends import Evaluation, make_backend
    from autotune.core.hardware import load_hardware

    evaluation = Evaluation(model_config, techniques, SEQ_LEN, 2, load_hardware("cpu"), documents=documents)
    return make_backend("plan").evaluate(evaluation)


@pytest.fixture(scope="module")
def packed_front():
    """``pareto.json`` of a search over packed documents: the one config, as the plan backend predicts it."""
    model_config = load_model_config("tiny-llama")
    record = plan(model_config, Techniques(**KNOBS), DOCUMENTS).to_dict()
    assert record["status"] == "ok", record
    entry = {
        "trial": 0,
        "seq_len": SEQ_LEN,
        "tokens_per_s": record["tokens_per_s"],
        "techniques": Techniques(**KNOBS).to_dict(),
        "record": record,
        "predicted": record,
        "measured": None,
    }
    front = {
        "schema": "autotune/pareto-v1",
        "model": "tiny-llama",
        "hardware": "cpu",
        "gpus": 2,
        "target": SEQ_LEN,
        "documents": DOCUMENTS.to_json(),
        "front": [entry],
    }
    return front, entry, model_config


def exported(packed_front, fmt: str, folder):
    """``fmt``'s export of the config, written as ``autotune export -o`` writes it: (Export, main file)."""
    front, entry, model_config = packed_front
    exporter = make_exporter(fmt)
    path = folder / f"{fmt}{os.path.splitext(exporter.default_file)[1]}"
    result = export_entry(front, entry, exporter, str(path), model_config)
    path.write_text(result.rendered.text + "\n")
    for suffix, body in result.rendered.companions.items():
        path.with_suffix(suffix).write_text(body + "\n")
    return result, path


def test_a_trainer_that_attends_across_the_documents_is_re_estimated_over_whole_windows(packed_front, tmp_path):
    """DeepSpeed and ArcticTraining with SDPA, and Accelerate's DeepSpeed flavour, attend across the packed
    documents: each export's prediction is the plan backend's for what it runs with one document per window, exactly,
    and costs more than the masked estimate it is printed beside. Accelerate's plugin masks them: no re-estimate."""
    _, entry, model_config = packed_front
    for fmt in ("deepspeed", "arctic", "accelerate-deepspeed"):
        result, path = exported(packed_front, fmt, tmp_path)
        trainer = TRAINERS[fmt]
        assert not trainer.masks_documents(result.config.techniques.attention), fmt
        assert result.config.documents == DOCUMENTS  # the data stays packed; the trainer's attention does not see it
        whole = plan(model_config, result.config.techniques, ONE)
        masked = plan(model_config, result.config.techniques, DOCUMENTS)
        assert result.re_estimate is not None, fmt
        assert result.re_estimate.step_time_s == whole.step_time_s, fmt
        assert result.re_estimate.peak_device_bytes == whole.peak_device_bytes, fmt
        assert result.config.predicted["step_time_s"] == whole.step_time_s, fmt
        assert whole.step_time_s > masked.step_time_s, fmt  # attention over each whole window: more pairs
        text = (path.with_suffix(".alst.py") if fmt == "deepspeed" else path).read_text()
        words = trainer.words
        assert f"# autotune: tiny-llama, 2,048 tokens ({DOCUMENTS.describe()}, each attended alone)" in text, fmt
        kernel = " with attention 'sdpa'" if trainer.packing else ""  # a trainer with a way to mask: not with SDPA
        assert f"# PACKED DOCUMENTS NOT MASKED: {words}{kernel} attends across the boundaries" in text, fmt
        assert f"# re-estimate of what {words} runs attending across the documents (--documents one): ok at" in text
        assert f"{whole.tokens_per_s:,.0f} tokens/s" in text and f"{entry['record']['tokens_per_s']:,.0f}" in text
    result, path = exported(packed_front, "accelerate", tmp_path)
    assert result.re_estimate is None and result.config.predicted == entry["record"]
    assert f"# packed documents ({DOCUMENTS.describe()}): position_ids that restart at 0" in path.read_text()
    assert "NOT MASKED" not in path.read_text()


def test_the_deepspeed_export_packs_documents_that_train_like_each_alone(packed_front, tmp_path):
    """The ``.alst.py``'s ``packed_windows`` packs documents into a window whose position_ids restart at each and
    whose labels never cross one; trained one step (one rank, its tiles, checkpointing and offload; SDPA, which
    transformers masks from those position_ids on one rank, the CPU's stand-in for flash_attention_2), the loss and
    gradients are the plain model's on each of the window's documents alone."""
    result, path = exported(packed_front, "deepspeed", tmp_path)
    alst = path.with_suffix(".alst.py")
    assert f"DOCUMENTS = {DOCUMENTS.to_json()}" in alst.read_text()
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    config = {k: v for k, v in load_model_config("tiny-llama").items() if not k.startswith("_")}
    (model_dir / "config.json").write_text(json.dumps(config))
    (verdict,) = run_judge("alst-packed", str(alst), str(model_dir), ",".join(map(str, LENGTHS)))
    assert verdict["window"] == SEQ_LEN and verdict["documents"] == WINDOW
    assert verdict["loss"] == pytest.approx(verdict["reference"], rel=1e-5)
    assert verdict["worst_relative_grad_error"] < 1e-4
    assert verdict["position_ids_restart"] == len(WINDOW)


def test_the_accelerate_export_trains_packed_data_like_each_document_alone(packed_front, tmp_path):
    """The ``accelerate`` export's ``.train.py`` (one process) packs a Parquet file of documents as ``autotune run
    --pack`` does (the default: the config's documents are packed): the first step's loss is the plain model's on
    each document of the first window alone (no attention and no label across a boundary)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    _, path = exported(packed_front, "accelerate", tmp_path)
    values = {k: v for k, v in load_model_config("tiny-llama").items() if not k.startswith("_")}
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**values)).save_pretrained(tmp_path / "model")
    generator = torch.Generator().manual_seed(2)
    documents = [torch.randint(0, values["vocab_size"], (n,), generator=generator).tolist() for n in LENGTHS]
    pq.write_table(pa.table({"input_ids": documents}), tmp_path / "documents.parquet")
    trained = subprocess.run(
        [sys.executable, str(path.with_suffix(".train.py")), "--model", str(tmp_path / "model")]
        + ["--data", str(tmp_path / "documents.parquet"), "--steps", "1", "--summary", str(tmp_path / "summary.json")],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "packs 4 documents" in trained.stderr  # the data's documents are not the 512-token ones estimated
    loss = json.loads((tmp_path / "summary.json").read_text())["first_loss"]

    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    stream = torch.tensor([token for document in documents for token in document])
    pieces, start = [], 0
    for length in WINDOW:
        pieces.append(stream[start : start + length])
        start += length
    with torch.no_grad():
        total = sum(float(plain(input_ids=p[None], labels=p[None]).loss) * (len(p) - 1) for p in pieces if len(p) > 1)
    assert loss == pytest.approx(total / sum(len(p) - 1 for p in pieces), rel=1e-5)
