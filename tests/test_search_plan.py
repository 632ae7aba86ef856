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

from conftest import ROOT, run_cli

TINY = ["--model", "tiny-llama", "--target", "4K", "--gpus", "2", "--backend", "plan", "--hardware", "cpu",
        "--memory-gib", "0.5"]


def load_study(out, storage=None, name=None):
    storage = storage or f"sqlite:///{out / 'study.db'}"
    names = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name or names[0], storage=storage)


def finished(study):
    return [t for t in study.get_trials(deepcopy=False) if t.state in (optuna.trial.TrialState.COMPLETE,
                                                                       optuna.trial.TrialState.PRUNED)]


def test_plan_search_reports_ooms_as_constraint_violations(tmp_path):
    out = tmp_path / "s"
    result = run_cli("search", *TINY, "--trials", "16", "--out", str(out), "--json")
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


def test_monotone_inference_and_cache_answer_without_running(tmp_path):
    out = tmp_path / "s"
    result = run_cli("search", *TINY, "--trials", "30", "--out", str(out), "--json")
    assert result.returncode in (0, 1), result.stderr[-3000:]
    rows = pq.read_table(out / "trials.parquet").to_pylist()
    inferred = [r for r in rows if r["answered_by"] == "monotone"]
    for row in inferred:  # every inference is backed by a real OOM of the same config at a shorter length
        knobs = {k: row[k] for k in ("fsdp", "ulysses_degree", "head_chunk", "activation_checkpointing",
                                      "mlp_tile_tokens", "loss_tile_tokens", "activation_offload_layers")}
        assert any(r["status"] == "oom" and r["answered_by"] == "plan" and r["seq_len"] <= row["seq_len"]
                   and all(r[k] == v for k, v in knobs.items()) for r in rows)
    assert json.loads(result.stdout)["avoided"]["monotone"] == len(inferred)


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
    proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 300
    while _trials_in_db(out / "study.db") < 5 and time.time() < deadline:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = {t.number: (t.params, t.values) for t in finished(load_study(out))}
    assert len(before) >= 5
    result = run_cli("search", *TINY, "--trials", "14", "--out", str(out), "--json")
    assert result.returncode in (0, 1), result.stderr[-3000:]
    study = load_study(out)
    after = {t.number: (t.params, t.values) for t in finished(study)}
    assert len(after) == 14
    assert all(after[n] == before[n] for n in before), "a finished trial changed or vanished"
    assert not study.get_trials(states=(optuna.trial.TrialState.RUNNING,)), "a trial is stuck RUNNING"
    retried = [t for t in study.trials if "retry_of" in t.user_attrs]
    failed = [t for t in study.trials if t.state == optuna.trial.TrialState.FAIL]
    # every trial the kill cut short (the only FAIL trials here: an error is a record, not a FAIL) is evaluated
    # again, once -- one killed after writing its record but before Optuna's tell too, so the record is no guide
    retry_targets = [t.user_attrs["retry_of"] for t in retried]
    assert len(set(retry_targets)) == len(retry_targets), "a killed trial was queued again twice"
    assert set(retry_targets) == {t.number for t in failed}, "a killed trial was lost, or a finished one retried"
    children = subprocess.run(["pgrep", "-f", f"autotune.cli search.*{out}"], capture_output=True, text=True)
    assert children.stdout.strip() == "", "a process of the killed search survived"


def test_workers_opening_a_new_sqlite_study_together_all_open_it(tmp_path):
    # four processes open one new SQLite database at the same instant (after their imports): the ones that lose the
    # race to create its schema retry (autotune.search.storage._SCHEMA_RACE) instead of failing
    url = f"sqlite:///{tmp_path / 'new.db'}"
    start_at = time.time() + 8.0
    code = ("import sys, time; from pathlib import Path; from autotune.search.storage import open_storage; "
            "time.sleep(max(0.0, float(sys.argv[2]) - time.time())); open_storage(sys.argv[1], Path('.'))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    workers = [subprocess.Popen([sys.executable, "-c", code, url, str(start_at)], cwd=tmp_path, env=env,
                                stderr=subprocess.PIPE, text=True) for _ in range(4)]
    errors = [worker.communicate(timeout=120)[1] for worker in workers]
    assert [worker.returncode for worker in workers] == [0] * 4, "\n".join(errors)[-3000:]
    assert optuna.storages.RDBStorage(url).get_all_studies() == []


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_two_workers_share_one_study(tmp_path, kind):
    storage = f"sqlite:///{tmp_path / 'shared.db'}" if kind == "sqlite" else str(tmp_path / "shared.log")
    args = ["search", *TINY, "--trials", "12", "--storage", storage, "--study", "shared"]
    # Traced, not read back from the plan store that earlier tests filled: read back, twelve trials take less
    # than a process's start-up, and the first worker would finish the study before the second joined it.
    env = {**os.environ, "PYTHONPATH": str(ROOT), "AUTOTUNE_PLAN_CACHE": "off"}
    if kind == "sqlite":
        # the schema made beforehand: a worker that loses the race to create it backs off for up to 5 s, long
        # enough for the other to finish all twelve trials alone (the race has its own test above)
        optuna.storages.RDBStorage(storage)
    workers = [subprocess.Popen([sys.executable, "-m", "autotune.cli", *args, "--out", str(tmp_path / f"w{i}"),
                                 "--seed", str(i)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for i in range(2)]
    for worker in workers:
        _, err = worker.communicate(timeout=600)
        assert worker.returncode in (0, 1), err[-3000:]
    if kind == "journal":
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        storage = JournalStorage(JournalFileBackend(str(tmp_path / "shared.log")))
    study = optuna.load_study(study_name="shared", storage=storage)
    done = finished(study)
    assert len(done) == 12
    assert len({t.number for t in done}) == 12
    assert len({t.user_attrs["worker"] for t in done}) == 2, "one worker did all the work"
