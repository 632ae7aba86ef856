"""The configs that reach the target, evaluated at exactly the target: what ``best.json`` is chosen from.

The search's trials sit at grid lengths and at configs' walls, so a config that fits beyond the target may have no
trial at it; its rate there is not its rate further out (attention grows with the length, tiles and chunks cost
per call). ``evaluate_at_target`` evaluates each such config at the target (``front.at_target``'s missing ones)
with the search's own backend -- a plan prediction, which the on-disk store answers where a climb traced it
already, or a real trial on this node, at the depth the search runs -- and stores each record as the study's
user attribute ``at_target_attr``, not as a trial: the front, the trials and the sampler's history are unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import optuna

from autotune.backends import Backend
from autotune.core.evaluation import Evaluation
from autotune.core.record import ResultRecord
from autotune.core.trainers import ExportJob, Trainer
from autotune.search.front import at_target, at_target_attr
from autotune.search.job import SearchJob
from autotune.search.parallel import plan_workers
from trials.core.errors import ConfigError
from trials.stack.techniques import Techniques


def evaluate_at_target(
    job: SearchJob,
    study: optuna.Study,
    backend: Backend | None = None,
    trainer: Trainer | None = None,
    progress: Callable[[str], None] | None = None,
) -> int:
    """Evaluate at ``job.target`` every config that reaches it and has no record there yet, with ``backend``
    (default: the job's; a plan backend keeps its records in the store and runs on every core), as ``trainer``
    (default: the job's) runs the config at the target; returns how many were evaluated."""
    _, missing = at_target(study, job.target)
    if not missing:
        return 0
    trainer = trainer or job.trainer
    layers = job.model_config["num_hidden_layers"]
    todo = []
    for asked, trial in missing:
        config = Techniques.from_dict(asked, layers)
        techniques = trainer.runs(ExportJob("", job.model_config, job.world_size, job.target, config, job.nodes))
        evaluation = job.evaluation(techniques, job.target, trainer)
        todo.append((asked, trial, evaluation))
    evaluations = [evaluation for _, _, evaluation in todo]

    def lookahead(current: Evaluation) -> tuple[list[Evaluation], list[Evaluation]]:
        return evaluations[evaluations.index(current) + 1 :], []  # the rest, in order: every worker busy

    if backend is None:
        with plan_workers(job, study, lookahead=lookahead):
            _evaluate(job, study, job.backend, todo, progress)
    else:
        _evaluate(job, study, backend, todo, progress)
    return len(todo)


def _evaluate(job, study, backend: Backend, todo: list, progress) -> None:
    for index, (asked, trial, evaluation) in enumerate(todo, 1):
        if progress is not None:
            progress(f"at the target: trial {trial.number}'s config at {job.target:,} tokens ({index} of {len(todo)})")
        record = _record(backend, evaluation)
        study.set_user_attr(
            at_target_attr(asked, job.target),
            {
                "trial": trial.number,
                "asked": asked,
                "techniques": evaluation.techniques.to_dict(),
                "seq_len": job.target,
                "record": record.to_dict(),
            },
        )


def _record(backend: Backend, evaluation: Evaluation) -> ResultRecord:
    """The backend's record; an ``error`` one where the config cannot run at the target's length at all (a length
    its Ulysses degree does not divide)."""
    hw = evaluation.hardware
    try:
        evaluation.techniques.validate(
            evaluation.model_config, evaluation.world_size, evaluation.seq_len, on_gpu=not hw.device_is_host
        )
    except ConfigError as exc:
        source = "predicted" if backend.name == "plan" else "measured"
        return ResultRecord(status="error", source=source, seq_len=evaluation.seq_len, error=str(exc))
    return backend.evaluate(evaluation)
