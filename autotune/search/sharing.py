"""Several workers on one study (``--storage`` shared by workers on one or many machines): what keeps their sum
equal to one search.

- ``claim_or_answer``: before a trial evaluates a config at a length, it claims that point under the storage's
  lock (``storage.study_lock``). A point already finished is answered from the study (``policy.infer_record``:
  cache, monotone inference); a point another live trial is evaluating right now is waited for, then answered
  from its record. So no config+length is evaluated twice by a backend, whichever workers sample it.
- ``requeue_surplus``: a trial the study no longer needs (it already holds ``--trials`` trials) that had been
  handed a queued point (a seed, a follow-up) puts that point back in the queue, for a later, longer run.
- ``wait_for_others``: a worker that ends while other workers' last trials still run waits for them, so the
  outputs it writes hold the whole study (``trials.parquet``, ``pareto.json``).
"""

from __future__ import annotations

import datetime
import time

import optuna
from optuna.trial import TrialState

from autotune.core.record import ResultRecord
from autotune.search.front import config_key
from autotune.search.policy import infer_record
from autotune.search.storage import has_heartbeat, study_lock
from autotune.search.study import FINISHED, queue_again, reap_dead_trials
from trials.stack.techniques import Techniques

CLAIM_ATTR = "autotune:evaluating"  # trial system attribute: the config_key this trial evaluates
POLL_S = 0.5
# storages without heartbeats (journal files) cannot tell a worker dead on another host from a slow one: after
# this long, a claim (or a RUNNING trial at the end) is no longer waited for
NO_HEARTBEAT_PATIENCE_S = 1800.0
# a trial RUNNING this long without the ``worker`` attribute (set first thing, once sampled) lost its worker between
# being handed out and starting (killed there): no heartbeat was recorded, no host can reap it
ORPHAN_S = 120.0


def claim_or_answer(
    study: optuna.Study, trial: optuna.Trial, techniques: Techniques, seq_len: int
) -> tuple[ResultRecord, str] | None:
    """An answer from the study for this point (``infer_record``), waiting first for another live trial that is
    evaluating it; else ``None``, with the point claimed by ``trial`` (which must then evaluate it)."""
    key = config_key(techniques.to_dict(), seq_len)
    storage = study._storage
    waited_since = None
    while True:
        with study_lock(storage, f"{study.study_name}:claims"):
            answered = infer_record(study, techniques, seq_len)
            if answered is not None:
                return answered
            busy = [
                t
                for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
                if t.number != trial.number and t.system_attrs.get(CLAIM_ATTR) == key
            ]
            patience_over = (
                waited_since is not None
                and not has_heartbeat(storage)
                and time.monotonic() - waited_since > NO_HEARTBEAT_PATIENCE_S
            )
            if not busy or patience_over:
                storage.set_trial_system_attr(trial._trial_id, CLAIM_ATTR, key)
                return None
        waited_since = waited_since or time.monotonic()
        _let_dead_trials_go(study)
        time.sleep(POLL_S)


def requeue_surplus(study: optuna.Study, trial: optuna.Trial) -> bool:
    """Put back the queued point (``fixed_params``) a surplus ``trial`` was handed, with its user attributes
    (``follow_up_of``, ``retry_of``, ...); True when there was one."""
    frozen = study._storage.get_trial(trial._trial_id)
    params = frozen.system_attrs.get("fixed_params")
    if not params:
        return False
    attrs = {k: v for k, v in frozen.user_attrs.items() if k != "worker"}
    study.enqueue_trial(params, user_attrs={**attrs, "requeued_from": frozen.number})
    return True


def wait_for_others(study: optuna.Study, trials: int) -> None:
    """When the study holds ``trials`` trials (finished, or still running in other workers), wait until none is
    RUNNING: the outputs this worker writes next then hold the whole study. A study cut short (``--timeout``)
    is not waited for: the others may run long after."""
    start = time.monotonic()
    while True:
        running = study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        done = len(study.get_trials(deepcopy=False, states=FINISHED))
        if not running or done + len(running) < trials:
            return
        if not has_heartbeat(study._storage) and time.monotonic() - start > NO_HEARTBEAT_PATIENCE_S:
            return
        _let_dead_trials_go(study)
        time.sleep(POLL_S)


def _let_dead_trials_go(study: optuna.Study) -> None:
    """Fail what dead workers left RUNNING, queueing their points again: stale heartbeats (RDB, any host), dead
    processes on this host, and orphans (``ORPHAN_S``)."""
    if has_heartbeat(study._storage):
        optuna.storages.fail_stale_trials(study)
    reap_dead_trials(study)
    now = datetime.datetime.now()
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        started = trial.datetime_start
        if "worker" in trial.user_attrs or started is None or (now - started).total_seconds() < ORPHAN_S:
            continue
        try:
            failed = study._storage.set_trial_state_values(trial._trial_id, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:  # it finished, or another worker failed it first
            continue
        if failed:
            queue_again(study, trial)
