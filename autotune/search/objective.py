"""The objective of one Optuna trial: sample, answer the cheapest honest way, record, queue follow-ups; and
``run``, which drives a study to its trial count."""

from __future__ import annotations

import time
from collections.abc import Callable

import optuna
from optuna.trial import TrialState

from autotune.core.record import ResultRecord
from autotune.search.job import SearchJob
from autotune.search.parallel import plan_workers
from autotune.search.policy import enqueue_follow_ups, seed_params
from autotune.search.sharing import claim_or_answer, requeue_surplus, wait_for_others
from autotune.search.storage import set_constraints
from autotune.search.study import FINISHED, WORKER, SurplusTrial, create_study, queue_again


def constraint_value(record: ResultRecord, capacity_bytes: int) -> float:
    """<= 0 feasible. OOM: how far over capacity (at least a little); failures: 1."""
    if record.status == "ok":
        if record.peak_device_bytes:
            return min(0.0, record.peak_device_bytes / capacity_bytes - 1.0)
        return 0.0
    if record.status == "oom" and record.peak_device_bytes:
        return max(0.01, record.peak_device_bytes / capacity_bytes - 1.0)
    return 1.0


def make_objective(job: SearchJob, study: optuna.Study, on_record: Callable | None = None):
    layers = job.model_config["num_hidden_layers"]
    capacity = job.hardware.device_memory_bytes

    def objective(trial: optuna.Trial):
        try:
            return evaluate(trial)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: Optuna marks the trial FAIL; its point is queued again,
            # like a killed worker's RUNNING trial (reap_dead_trials), so a resumed search loses nothing
            queue_again(study, study._storage.get_trial(trial._trial_id))
            raise

    def evaluate(trial: optuna.Trial):
        trial.set_user_attr("worker", WORKER)  # first: a trial this worker leaves RUNNING when killed is reaped
        # several workers share one study: the trial is surplus if the study already holds ``job.trials``
        # trials created before it (finished or still running), so together they run exactly that many
        ahead = sum(
            1
            for t in study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.RUNNING))
            if t.number < trial.number
        )
        if ahead >= job.trials:
            study.stop()
            trial.set_user_attr("surplus", True)  # its FAIL is the budget's, not a run's: nothing to retry
            requeue_surplus(study, trial)  # a seed or follow-up it was handed stays queued, not lost
            raise SurplusTrial(f"trial {trial.number}: the study already holds {job.trials} trials")
        asked, seq_len = job.space.sample(trial, layers)
        techniques = job.space.runs(asked, seq_len)  # what the search's trainer runs: evaluated, on the front
        job.validate(techniques, seq_len)
        trial.set_user_attr("techniques", techniques.to_dict())
        if asked != techniques:
            trial.set_user_attr("asked", asked.to_dict())  # the sampled config, the same at every length
        evaluation = job.evaluation(techniques, seq_len)
        answered = claim_or_answer(study, trial, techniques, seq_len)  # None: claimed, no other worker runs it
        how = None
        if answered is not None:
            record, how = answered
        elif job.prefilter is not None:
            predicted = job.prefilter.evaluate(evaluation)
            # only a clear predicted OOM skips the real trial: within the oracle's error band (per hardware), measure
            margin = job.hardware.oracle_margin
            if predicted.status == "oom" and (predicted.peak_device_bytes or 0) > capacity * (1 + margin):
                record, how = predicted, "oracle"
        if how is None:
            record = job.backend.evaluate(evaluation)
        else:
            job.avoided[how] += 1
        trial.set_user_attr("record", record.to_dict())
        trial.set_user_attr("answered_by", how or job.backend.name)
        set_constraints(trial, [constraint_value(record, capacity)])  # where Optuna and optuna-dashboard read them
        if job.follow_ups:
            enqueue_follow_ups(job, study, asked, record, trial.number)
        if on_record is not None:
            on_record(trial.number, techniques, record, how)
        return float(seq_len), float(record.tokens_per_s or 0.0) if record.status == "ok" else 0.0

    return objective


def open_study(job: SearchJob, storage=None) -> optuna.Study:
    """The job's study: resumed, or created with its seeds queued first (``storage``: an already opened one)."""
    return create_study(job, storage, seeds=seed_params(job))


def run(job: SearchJob, on_record: Callable | None = None, study: optuna.Study | None = None) -> optuna.Study:
    """Run (or resume) the study until it holds ``job.trials`` finished trials or the timeout passes."""
    study = study or open_study(job)
    deadline = None if job.timeout_s is None else time.monotonic() + job.timeout_s
    while True:
        remaining = max(0, job.trials - len(study.get_trials(deepcopy=False, states=FINISHED)))
        timeout = None if deadline is None else deadline - time.monotonic()
        if remaining and (timeout is None or timeout > 0):
            with plan_workers(job, study):  # plan records from every core, the study unchanged (parallel.py)
                study.optimize(
                    make_objective(job, study, on_record), n_trials=remaining, timeout=timeout, catch=(SurplusTrial,)
                )
        wait_for_others(study, job.trials)  # other workers' last trials: the outputs written next hold them too
        # a dead worker's trial the wait failed (one killed before it was marked as its worker's is only found
        # then) was queued again, and while RUNNING it counted against the budget: evaluate the study's rest now
        short = len(study.get_trials(deepcopy=False, states=FINISHED)) < job.trials
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))  # the wait gave up on them
        if not short or running or (deadline is not None and time.monotonic() >= deadline):
            return study
