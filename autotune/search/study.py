"""The study in its storage: opening storages (SQLite, RDB URLs, journal files), creating or resuming the
study, and queueing again the trials a killed worker left RUNNING or an interrupted one cut short."""

from __future__ import annotations

import os
import socket
import warnings
from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.core.errors import UserError
from autotune.search.job import SearchJob
from autotune.search.storage import open_storage, redact, scrub  # open_storage: re-exported (autotune.search)

optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own progress display says what happens
# heartbeats and metric names are marked experimental; the CLI should not print that on every run
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


class SurplusTrial(Exception):
    """Raised (and caught, leaving a FAIL trial outside every report) when the study is already full."""


def study_name_for(job: SearchJob) -> str:
    nodes = f"{job.nodes}x" if job.nodes > 1 else ""  # 2x8xh100-sxm: 2 nodes of 8
    trainer = "" if job.trainer.name == "autotune" else f"-{job.trainer.name}"  # another space
    return job.study_name or (
        f"autotune-{Path(job.model).stem}-{nodes}{job.gpus}x{job.hardware.name}-{job.target}{trainer}"
    )


def create_study(job: SearchJob, storage=None, seeds: list[dict] = ()) -> optuna.Study:
    """Create or load the job's study (``storage``: an already opened Optuna storage, else opened here); a new
    study gets ``seeds`` (Optuna params) queued first."""
    sampler = optuna.samplers.TPESampler(
        seed=job.seed, multivariate=True, group=True, constant_liar=True, n_startup_trials=8
    )
    storage = storage or open_storage(job.storage, job.out)
    try:
        study = optuna.create_study(
            storage=storage,
            sampler=sampler,
            study_name=study_name_for(job),
            directions=["maximize", "maximize"],
            load_if_exists=True,
        )
    except Exception as exc:
        where = redact(job.storage) if job.storage else job.out
        raise UserError(f"cannot open the study in {where}: {scrub(str(exc).splitlines()[0], job.storage)}") from None
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
