"""The search on the plan backend (issue 6, issue 8): constraints, pruning, resume after kill -9, workers."""

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import optuna
import pyarrow.parquet as pq
import pytest
from conftest import ROOT, here, tiny_plan_search

from autotune import search
from autotune.backends import Backend
from autotune.backends.plan import PlanBackend
from autotune.backends.plan_store import default_store
from autotune.core.hardware import load_hardware
from autotune.outputs import report
from autotune.search.policy import seed_params
from autotune.search.space import load_space
from trials.models.config import load_model_config
from trials.stack.techniques import knob_names

TINY = tiny_plan_search()


def load_study(out, storage=None, name=None):
    storage = storage or f"sqlite:///{out / 'study.db'}"
    names = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name or names[0], storage=storage)


def finished(study):
    return [
        t
        for t in study.get_trials(deepcopy=False)
        if t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
    ]


def test_plan_search_reports_ooms_as_constraint_violations(tmp_path):
    out = tmp_path / "s"
    result = here("search", *TINY, "--trials", "16", "--out", str(out), "--json")  # in this process: conftest.here
    assert result.returncode in (0, 1), result.stderr[-3000:]
    summary = json.loads(result.stdout)
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    assert len(rows) == 16 == summary["rows"]
    study = load_study(out)
    for trial in finished(study):
        record = trial.user_attrs["record"]
        (violation,) = trial.constraints.values()
        assert (violation > 0) == (record["status"] != "ok"), (trial.number, record["status"], violation)
        assert record["source"] == "predicted"
    assert any(r["status"] == "oom" for r in rows), "the 0.5 GiB capacity never bound"
    # Optuna's own feasible front is our front
    front = json.loads((out / "pareto.json").read_text())["front"]
    optuna_front = {(t.values[0], t.values[1]) for t in study.best_trials}
    assert {(f["seq_len"], f["tokens_per_s"]) for f in front} == optuna_front


class _Counting(Backend):
    """The search's plan backend (a trace stopped at the capacity), recording every point it is asked for."""

    name = "plan"

    def __init__(self):
        self.plan, self.calls = PlanBackend(stop_above=1.0, store=default_store()), []

    def evaluate(self, evaluation):
        self.calls.append((evaluation.techniques.to_dict(), evaluation.seq_len))
        return self.plan.evaluate(evaluation)


def test_monotone_inference_and_cache_answer_without_running(tmp_path):
    """A config out of memory at a length is out of memory at every longer one: asked again longer, the study
    answers from that OOM (monotone inference); asked again at the same length, from its record (cache); neither
    reaches the backend. A config that differs in one knob is another config: the backend evaluates it."""
    config = load_model_config("tiny-llama")
    job = search.SearchJob(
        model="tiny-llama",
        model_config=config,
        target=4096,
        gpus=2,
        hardware=load_hardware("cpu").with_memory_gib(0.5),
        space=load_space(None, config, 2, 4096, kernels=["sdpa"]),
        backend=_Counting(),
        out=tmp_path,
        trials=4,
        seed=0,
    )
    plain = seed_params(job)[0]  # the plain model
    tiled = {**plain, "norm_tile_tokens": 65536}  # one knob apart: another config
    study = search.create_study(job)  # no seeds: the queue below is the whole search
    for params, seq_len in ((plain, 8192), (plain, 16384), (plain, 8192), (tiled, 16384)):
        study.enqueue_trial({**params, "seq_len": seq_len})
    search.run(job, study=study)
    trials = sorted(search.finished_trials(study), key=lambda t: t.number)
    assert [(t.user_attrs["record"]["seq_len"], t.user_attrs["answered_by"]) for t in trials] == [
        (8192, "plan"),
        (16384, "monotone"),
        (8192, "cache"),
        (16384, "plan"),
    ]
    oom, inferred, cached, other = trials
    assert oom.user_attrs["record"]["status"] == "oom", "the plain model fits 8K tokens in 0.5 GiB: nothing to infer"
    # the inference is the OOMed config itself, every knob, at the longer length; the cache answer is its record
    assert inferred.user_attrs["techniques"] == oom.user_attrs["techniques"] == cached.user_attrs["techniques"]
    assert inferred.user_attrs["record"]["status"] == "oom"
    assert f"out of memory at 8,192 tokens (trial {oom.number})" in inferred.user_attrs["record"]["error"]
    assert cached.user_attrs["record"] == oom.user_attrs["record"]
    assert other.user_attrs["techniques"] == {**oom.user_attrs["techniques"], "norm_tile_tokens": 65536}
    # the backend saw the two points nobody had answered, once each
    assert job.backend.calls == [(oom.user_attrs["techniques"], 8192), (other.user_attrs["techniques"], 16384)]
    assert job.avoided == {"cache": 1, "monotone": 1, "oracle": 0}
    # the outputs say so too: trials.parquet's rows, each knob of the inferred row equal to the OOMed row's
    report.write_outputs(job, study)
    rows = sorted(pq.read_table(tmp_path / "trials.parquet").to_pylist(), key=lambda r: r["trial"])
    assert [r["answered_by"] for r in rows] == ["plan", "monotone", "cache", "plan"]
    assert all(rows[1][k] == rows[0][k] for k in knob_names()) and rows[1]["status"] == "oom"
    assert [k for k in knob_names() if rows[3][k] != rows[0][k]] == ["norm_tile_tokens"]


def _trials_in_db(path):
    if not path.exists():
        return 0
    try:
        with sqlite3.connect(path, timeout=1) as db:
            return db.execute("select count(*) from trials where state = 'COMPLETE'").fetchone()[0]
    except sqlite3.Error:
        return 0


@pytest.mark.slow
def test_kill_9_then_resume_loses_nothing(tmp_path):
    out = tmp_path / "s"
    args = [sys.executable, "-m", "autotune.cli", "search", *TINY, "--trials", "14", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    deadline = time.time() + 300
    while _trials_in_db(out / "study.db") < 5 and time.time() < deadline:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {t.number: (t.params, t.values) for t in finished(load_study(out))}
    assert len(before) >= 5
    # the resume in this process (conftest.here): the claim is the killed process's study, not the resuming one
    result = here("search", *TINY, "--trials", "14", "--out", str(out), "--json")
    assert result.returncode in (0, 1), result.stderr[-3000:]
    study = load_study(out)
    after = {t.number: (t.params, t.values) for t in finished(study)}
    assert len(after) == 14
    assert all(after[n] == before[n] for n in before), "a finished trial changed or vanished"
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,)), "a trial is stuck RUNNING"
    # queued again by autotune (``queue_again``: ``retry_of``), or by Optuna's heartbeat for a trial killed before
    # its worker was marked (``RetryHeartbeatStaleTrialCallback``: ``failed_trial``, on a machine slow enough that
    # the resumed run outlasts the grace period)
    retried = [t for t in study.trials if "retry_of" in t.user_attrs or "failed_trial" in t.system_attrs]
    # every trial the kill cut short (the FAIL trials here but a surplus one, which a busy machine can make: an
    # error is a record, not a FAIL) is evaluated again, once -- one killed after writing its record but before
    # Optuna's tell too, so the record is no guide
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL and not t.user_attrs.get("surplus")]
    retry_targets = [t.user_attrs.get("retry_of", t.system_attrs.get("failed_trial")) for t in retried]
    assert len(set(retry_targets)) == len(retry_targets), "a killed trial was queued again twice"
    failures = {t.number: sorted(t.user_attrs) for t in study.trials if t.state == optuna.trial.TrialState.FAIL}
    assert set(retry_targets) == {t.number for t in failed}, (
        f"a killed trial was lost, or a finished one retried: {failures}"
    )
    children = subprocess.run(["pgrep", "-f", f"autotune.cli search.*{out}"], capture_output=True, text=True)
    assert children.stdout.strip() == "", "a process of the killed search survived"


def test_workers_opening_a_new_sqlite_study_together_all_open_it(tmp_path):
    # four processes open one new SQLite database at the same instant (after their imports): the ones that lose the
    # race to create its schema retry (autotune.search.storage._SCHEMA_RACE) instead of failing
    url = f"sqlite:///{tmp_path / 'new.db'}"
    start_at = time.time() + 8.0
    code = (
        "import sys, time; from pathlib import Path; from autotune.search.storage import open_storage; "
        "time.sleep(max(0.0, float(sys.argv[2]) - time.time())); open_storage(sys.argv[1], Path('.'))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [
        subprocess.Popen(
            [sys.executable, "-c", code, url, str(start_at)], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
        )
        for _ in range(4)
    ]
    errors = [worker.communicate(timeout=120)[1] for worker in workers]
    assert [worker.returncode for worker in workers] == [0] * 4, "\n".join(errors)[-3000:]
    assert optuna.storages.RDBStorage(url).get_all_studies() == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_workers_share_one_study(tmp_path, kind):
    storage = f"sqlite:///{tmp_path / 'shared.db'}" if kind == "sqlite" else str(tmp_path / "shared.log")
    args = ["search", *TINY, "--trials", "8", "--storage", storage, "--study", "shared"]
    # Traced, not read back from the plan store that earlier tests filled: read back, eight trials take less
    # than a process's start-up, and the first worker would finish the study before the second joined it.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOTUNE_PLAN_CACHE": "off"}
    if kind == "sqlite":
        # the schema made beforehand: a worker that loses the race to create it backs off for up to 5 s, long
        # enough for the other to finish all eight trials alone (the race has its own test above)
        optuna.storages.RDBStorage(storage)
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "autotune.cli", *args, "--out", str(tmp_path / f"w{i}"), "--seed", str(i)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    for worker in workers:
        _, err = worker.communicate(timeout=600)
        assert worker.returncode in (0, 1), err[-3000:]
    if kind == "journal":
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        storage = JournalStorage(JournalFileBackend(str(tmp_path / "shared.log")))
    study = optuna.load_study(study_name="shared", storage=storage)
    done = finished(study)
    assert len(done) == 8
    assert len({t.number for t in done}) == 8
    assert len({t.user_attrs["worker"] for t in done}) == 2, "one worker did all the work"
