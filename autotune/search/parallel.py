"""Plan trials on every core, the study unchanged: while the search waits for one record, worker processes
evaluate what it will ask for next.

``plan_workers(job, study)`` swaps the job's plan backend, for the length of a run, for a
``autotune.backends.pool.PooledBackend`` (one ``PlanBackend`` per core, with the same options and the on-disk
``plan_store``) whose ``lookahead`` reads the study each time a record is asked for:

- wanted: the trials already queued (seeds, follow-ups), in the order Optuna hands them out, less those the
  study already answers (``policy.infer_record``);
- likely: the next grid length of each config being evaluated or queued, where it is not known yet (the climb
  ``policy.follow_ups`` queues when that config fits on the front).

Trials are still created, sampled and told one at a time, in the same order, by the same objective; only the
records come back sooner. So the study's trial count, the follow-up queue's order and every record are exactly
those of a search in one process (``tests/test_plan_parallel.py``).
"""

from __future__ import annotations

import contextlib

import optuna
from optuna.trial import TrialState

from autotune.backends.plan import PlanBackend
from autotune.backends.plan_store import default_store
from autotune.backends.pool import PooledBackend, default_workers
from autotune.core.evaluation import Evaluation
from autotune.search.job import SearchJob
from autotune.search.policy import infer_record
from autotune.search.space import split_unit


@contextlib.contextmanager
def plan_workers(job: SearchJob, study: optuna.Study, lookahead=None):
    """For the run inside: the job's plan backend keeps its records in the on-disk store and, with more than one
    worker (``job.workers``, default one per core), runs on a pool that looks ahead (``lookahead(evaluation)``:
    the pool's (wanted, likely) when ``evaluation`` is asked for; default ``upcoming``, the study's queue). Other
    backends: unchanged."""
    backend = job.backend
    if not isinstance(backend, PlanBackend):
        yield
        return
    options = backend.options()
    if options["store"] is None:
        options["store"] = default_store()
    workers = job.workers or default_workers()
    if workers <= 1:
        job.backend = PlanBackend(**options)
    else:
        job.backend = PooledBackend(
            options, workers, lookahead=lookahead or (lambda evaluation: upcoming(job, study, evaluation))
        )
    try:
        yield
    finally:
        pooled, job.backend = job.backend, backend
        if isinstance(pooled, PooledBackend):
            job.stats = dict(pooled.stats, workers=workers)
            pooled.close()


def upcoming(job: SearchJob, study: optuna.Study, current: Evaluation) -> tuple[list[Evaluation], list[Evaluation]]:
    """(wanted, likely) as the study stands while ``current`` is being asked for (see the module doc)."""
    layers = job.model_config["num_hidden_layers"]
    wanted: list[Evaluation] = []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):  # Optuna pops the lowest first
        params = trial.system_attrs.get("fixed_params")
        if not params:
            continue
        try:
            techniques, seq_len = job.space.point_of(params, layers)
        except Exception:  # params this space cannot sample: the trial itself will say so when it runs
            continue
        techniques = job.space.runs(techniques, seq_len)  # what the objective evaluates (the trainer's config)
        if infer_record(study, techniques, seq_len) is None:
            wanted.append(job.evaluation(techniques, seq_len))
    likely = []
    for evaluation in [current] + wanted:
        degree = split_unit(evaluation.techniques.ulysses_degree, evaluation.techniques.ring_degree)
        longer = [s for s in job.space.seq_lens if s > evaluation.seq_len and s % degree == 0]
        if longer and infer_record(study, evaluation.techniques, longer[0]) is None:
            likely.append(job.evaluation(evaluation.techniques, longer[0]))
    return wanted, likely
