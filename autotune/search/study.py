"""The study in its storage: opening storages (SQLite, RDB URLs, journal files), creating or resuming the
study, and queueing again the trials a killed worker left RUNNING or an interrupted one cut short."""

from __future__ import annotations

import os
import socket
import time
import warnings
from pathlib import Path

import optuna
from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState

from autotune.core.errors import UserError
from autotune.search.job import SearchJob

optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own progress display says what happens
# heartbeats and metric names are marked experimental; the CLI should not print that on every run
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


class SurplusTrial(Exception):
    """Raised (and caught, leaving a FAIL trial outside every report) when the study is already full."""

def open_storage(storage: str | None, out: Path):
    """SQLite in ``out`` by default; an RDB URL; or a journal file (path ending .log/.jsonl or ``journal:PATH``)."""
    try:
        if storage is None:
            url = f"sqlite:///{(out / 'study.db').resolve()}"
            return _rdb(url)
        if storage.startswith("journal:") or storage.endswith((".log", ".jsonl", ".journal")):

            path = storage.removeprefix("journal:")
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            return JournalStorage(JournalFileBackend(path))
        if "://" not in storage:
            raise UserError(f"--storage {storage!r} is neither a database URL nor a journal file (.log)")
        return _rdb(storage)
    except UserError:
        raise
    except Exception as exc:  # sqlalchemy/driver errors: a bad URL or unreachable server
        raise UserError(f"--storage {storage!r} cannot be opened: {str(exc).splitlines()[0]}") from None


def _rdb(url: str, attempts: int = 5):

    for attempt in range(attempts):
        try:
            # heartbeats: a trial whose worker was killed is marked FAIL after the grace period and retried once
            return RDBStorage(url, heartbeat_interval=5, grace_period=20,
                              heartbeat_stale_trial_callback=RetryHeartbeatStaleTrialCallback(max_retry=1))
        except Exception as exc:
            # workers starting together race to create the schema: the loser sees "already exists" or a lock
            # (or both insert the schema version: a UNIQUE violation on alembic_version)
            transient = any(sign in str(exc) for sign in ("already exists", "locked", "UNIQUE constraint failed"))
            if not transient or attempt == attempts - 1:
                raise
            time.sleep(0.5 * (attempt + 1))


def study_name_for(job: SearchJob) -> str:
    return job.study_name or f"autotune-{Path(job.model).stem}-{job.gpus}x{job.hardware.name}-{job.target}"


def create_study(job: SearchJob, storage=None, seeds: list[dict] = ()) -> optuna.Study:
    """Create or load the job's study (``storage``: an already opened Optuna storage, else opened here); a new
    study gets ``seeds`` (Optuna params) queued first."""
    sampler = optuna.samplers.TPESampler(seed=job.seed, multivariate=True, group=True, constant_liar=True,
                                         n_startup_trials=8)
    storage = storage or open_storage(job.storage, job.out)
    try:
        study = optuna.create_study(storage=storage, sampler=sampler, study_name=study_name_for(job),
                                    directions=["maximize", "maximize"], load_if_exists=True)
    except Exception as exc:
        raise UserError(f"cannot open the study in {job.storage or job.out}: {str(exc).splitlines()[0]}") from None
    study.set_metric_names(["seq_len", "tokens_per_s"])
    reap_dead_trials(study)
    if not study.trials:
        for params in seeds:
            study.enqueue_trial(params, skip_if_exists=True)
    return study


WORKER = f"{socket.gethostname()}:{os.getpid()}"


def reap_dead_trials(study: optuna.Study) -> list[int]:
    """Trials left RUNNING by a worker of this host that no longer exists (kill -9, power loss) become FAIL
    and are queued again, so a killed search resumes with nothing lost and nothing stuck. (RDB storages also
    do this through heartbeats, for workers on any host; journal files only get this.)"""
    reaped = []
    host = socket.gethostname()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker_host, _, pid = str(trial.user_attrs.get("worker", "")).partition(":")
        if worker_host != host or not pid.isdigit() or _alive(int(pid)):
            continue
        study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        queue_again(study, trial)
        reaped.append(trial.number)
    return reaped


def queue_again(study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
    """Queue ``trial``'s point (the params it was queued with, then those it sampled) as a new trial, marked
    ``retry_of``: what a killed or interrupted trial was evaluating is evaluated after all. A trial cut short
    before it had any params had no point yet: nothing to queue."""
    params = {**trial.system_attrs.get("fixed_params", {}), **trial.params}
    if params:
        study.enqueue_trial(params, user_attrs={"retry_of": trial.number})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
