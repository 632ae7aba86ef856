"""The plan store answers what a search already evaluated (issue 35, item 4): ``estimate`` of the search's best
config, and the predictions ``trial`` and ``verify`` make before a real trial (its deadline: the model's record at
full depth, its 3- and 4-layer copies' records at reduced depth). Same code, config and hardware: the record is
read back, not traced again (no oracle call), and it is exactly the record a trace gives.

The search's plan backend stops a trace at the out-of-memory crossing (``stop_above=1.0``): a record that ran
to its end answers a request without limits (``estimate``), a stopped one does not (its breakdown is cut short),
and a copy traced to its end inside a stopped prediction still answers that copy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import ROOT

import autotune.backends.plan as plan_module
from autotune.backends.local import LocalBackend, _copy_evaluation
from autotune.backends.plan import PlanBackend
from autotune.backends.plan_store import PlanStore
from autotune.core.evaluation import Evaluation
from autotune.core.hardware import load_hardware
from trials.models.config import load_model_config
from trials.stack.techniques import BASELINE

AUTOTUNE = Path(sys.executable).with_name("autotune")  # the console script pip installed
SIX_LAYERS = dict(load_model_config("tiny-llama"), num_hidden_layers=6)  # deep enough for 3- and 4-layer copies
H100 = load_hardware("h100-sxm")  # runtime overheads that are not 0 (the cpu preset has none)
CKPT = replace(BASELINE, activation_checkpointing=True)
PARTIAL_OFFLOAD = replace(CKPT, activation_offload_layers=2)  # two runs of layers: offloaded, on the device


def refuse_traces(monkeypatch) -> list:
    """From now on the oracle records each evaluation it is asked to trace and refuses it (a record answered
    from the store never gets here)."""
    calls = []

    def refuse(evaluation, **options):
        calls.append(evaluation.model_config["num_hidden_layers"])
        raise AssertionError("traced instead of read back")

    monkeypatch.setattr(plan_module, "predict", refuse)
    return calls


def test_a_record_the_search_kept_answers_an_estimate(tmp_path, monkeypatch):
    evaluation = Evaluation(SIX_LAYERS, CKPT, 4096, 2, H100)
    searched = PlanBackend(stop_above=1.0, store=PlanStore(tmp_path)).evaluate(evaluation)  # the search's backend
    assert searched.status == "ok" and searched.tokens_per_s
    calls = refuse_traces(monkeypatch)
    estimate = PlanBackend(store=PlanStore(tmp_path))  # estimate's: no limits, the whole breakdown
    assert estimate.evaluate(evaluation).to_dict() == searched.to_dict()
    assert calls == [] and estimate.last_prediction is None


@pytest.mark.parametrize("techniques", [CKPT, PARTIAL_OFFLOAD], ids=["one-run", "partial-offload"])
def test_a_reduced_trial_predicts_its_copies_from_the_search(tmp_path, monkeypatch, techniques):
    evaluation = Evaluation(SIX_LAYERS, techniques, 4096, 2, H100)
    _, copies = LocalBackend(depth="reduced").copies(evaluation)
    assert len(copies) == 2
    traced = [PlanBackend().evaluate(_copy_evaluation(evaluation, copy)) for copy in copies]  # each on its own
    PlanBackend(stop_above=1.0, store=PlanStore(tmp_path)).evaluate(evaluation)  # the search
    calls = refuse_traces(monkeypatch)
    predictor = PlanBackend(store=PlanStore(tmp_path))  # trial's and verify's deadline predictor
    stored = [predictor.evaluate(_copy_evaluation(evaluation, copy)) for copy in copies]
    assert [r.to_dict() for r in stored] == [r.to_dict() for r in traced]  # exactly the records a trace gives
    assert calls == []
    deadline, _ = LocalBackend(depth="reduced", predictor=predictor).deadlines(evaluation, copies)
    assert deadline > 0 and calls == []


def test_a_stopped_search_answers_only_the_copy_it_traced_to_its_end(tmp_path, monkeypatch):
    # 2.375 GiB: the 3-layer copy fits (2.48 GB with overheads), the 6-layer model does not (2.58 GB); the search's
    # trace of the 4-layer copy stops as soon as its extension to 6 layers is known to cross the capacity
    hardware = H100.with_memory_gib(2.375)
    evaluation = Evaluation(SIX_LAYERS, BASELINE, 4096, 2, hardware)
    searcher = PlanBackend(stop_above=1.0, store=PlanStore(tmp_path))
    assert searcher.evaluate(evaluation).status == "oom" and searcher.last_prediction.stopped
    _, copies = LocalBackend(depth="reduced").copies(evaluation)
    three = _copy_evaluation(evaluation, copies[0])
    traced = PlanBackend().evaluate(three)
    assert traced.status == "ok"
    calls = refuse_traces(monkeypatch)
    predictor = PlanBackend(store=PlanStore(tmp_path))
    assert predictor.evaluate(three).to_dict() == traced.to_dict() and calls == []
    predictor.evaluate(_copy_evaluation(evaluation, copies[1]))  # stopped in the search: traced
    predictor.evaluate(evaluation)  # a stopped OOM has no whole breakdown: estimate traces it
    assert calls == [4, 6]


def autotune(*args: str, env: dict) -> subprocess.CompletedProcess:
    assert AUTOTUNE.is_file(), f"{AUTOTUNE} is not installed (pip install -e .)"
    return subprocess.run(
        [str(AUTOTUNE), *args], capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, **env}
    )


def test_estimate_after_a_search_reads_the_search_record(tmp_path):
    """What the user sees: ``estimate --config best.json`` right after the search prints the record the search
    kept. Every whole record in the store is marked (tokens/s 12345): the estimate shows the mark, and writes
    nothing new (a trace would)."""
    env = {"AUTOTUNE_CACHE_DIR": str(tmp_path / "cache")}  # a store of its own
    out = tmp_path / "out"
    plan = ["--model", "tiny-llama", "--gpus", "1", "--hardware", "cpu", "--memory-gib", "4"]
    done = autotune("search", *plan, "--backend", "plan", "--target", "1K", "--trials", "4", "--out", str(out), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    entries = sorted((tmp_path / "cache" / "plan").glob("*/*.json"))
    whole = [path for path in entries if "-stop-" not in path.name]
    assert whole, entries
    for path in whole:
        entry = json.loads(path.read_text())
        entry["record"]["tokens_per_s"] = 12345.0
        path.write_text(json.dumps(entry))
    estimate = autotune(
        "estimate", *plan[:2], "--config", str(out / "best.json"), "--memory-gib", "4", "--json", env=env
    )
    assert estimate.returncode == 0, estimate.stderr[-3000:]
    assert json.loads(estimate.stdout)["tokens_per_s"] == 12345.0  # the search's record, read back
    assert sorted((tmp_path / "cache" / "plan").glob("*/*.json")) == entries  # nothing traced, nothing written
