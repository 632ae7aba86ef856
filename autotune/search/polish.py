"""The front and the best, each compared with the configs one knob away before the search writes them.

The search's trials follow its seeds, climbs and TPE; a front point it reached with FlashAttention-2 may have a
twin with FlashAttention-3 that fits at the same length and runs faster, which nothing made it try. ``polish``
evaluates, at a front config's longest front length, each of its one-knob neighbours that can run faster
(``SearchSpace.neighbours``: another kernel, an offload off, a larger tile or chunk or none, FSDP and the degrees
one step either way; a change that saves memory by recompute, offload or tiling only costs time); a neighbour
that fits there and runs faster takes the point's place on the front, and the config's next longest front point
is compared in the next round. The best config's neighbours either way are evaluated at the target, where the 2%
headroom rule may prefer a frugal one. Each evaluation is stored as a finished trial of the study
(``polish_of``: the trial whose config it neighbours), so the front and ``best.json`` take a faster neighbour the
way they take any trial (a point it beats at the same length drops off the front; the 2% headroom rule picks
the best among those at the target), ``trials.parquet`` lists it, and a resumed search does not evaluate it again.
Rounds repeat on the new front until no neighbour is left to try (at most ``ROUNDS``).

Only on the plan backend, whose records the on-disk store keeps (a warm run answers from it in seconds) and whose
workers evaluate on every core: on a local search each neighbour would be a real trial on the node.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import optuna
from optuna.distributions import CategoricalDistribution, IntDistribution
from optuna.trial import TrialState

from autotune.backends.plan import PlanBackend
from autotune.core.evaluation import Evaluation
from autotune.core.record import ResultRecord
from autotune.search.at_target import evaluate_at_target
from autotune.search.front import asked_of, best_point, finished_trials, front_points
from autotune.search.job import SearchJob
from autotune.search.objective import constraint_value
from autotune.search.parallel import plan_workers
from autotune.search.policy import infer_record
from autotune.search.storage import CONSTRAINTS_KEY
from autotune.search.study import WORKER
from trials.core.errors import ConfigError
from trials.stack.techniques import Techniques

ROUNDS = 4
POLISH_ATTR = "polish_of"  # a polishing trial's user attribute: the trial whose config it is one knob from


def polish(
    job: SearchJob,
    study: optuna.Study,
    progress: Callable[[str], None] | None = None,
    on_record: Callable[[ResultRecord], None] | None = None,
) -> int:
    """Evaluate the front's and the best's one-knob neighbours (see the module doc), as trials of ``study``;
    returns how many were evaluated (``progress``: a line per round; ``on_record``: each record). Other backends
    than plan: nothing."""
    if not isinstance(job.backend, PlanBackend):
        return 0
    evaluated, pending = 0, []  # pending: the round's evaluations, which the workers run ahead of the one asked

    def lookahead(current: Evaluation) -> tuple[list[Evaluation], list[Evaluation]]:
        return (pending[pending.index(current) + 1 :] if current in pending else []), []

    with plan_workers(job, study, lookahead=lookahead):  # one pool for every round and the evaluations at target
        for round_number in range(1, ROUNDS + 1):
            todo = candidates(job, study)
            if not todo:
                break
            if progress is not None:
                progress(f"polish: {len(todo)} configs one knob from the front and the best (round {round_number})")
            evaluations = [evaluation_at(job, asked, seq_len) for asked, seq_len, _ in todo]
            pending[:] = [e for e in evaluations if e is not None]
            for (asked, _, origin), evaluation in zip(todo, evaluations):
                if evaluation is None:  # a length the config's degrees do not divide
                    continue
                record = job.backend.evaluate(evaluation)
                _add_trial(job, study, asked, evaluation, record, origin)
                if on_record is not None:
                    on_record(record)
            evaluated += len(pending)
            pending.clear()
            evaluate_at_target(job, study)  # neighbours that reach the target, at it: what the best is chosen from
    return evaluated


def _key(techniques: dict) -> str:
    return json.dumps(techniques, sort_keys=True)


def candidates(job: SearchJob, study: optuna.Study) -> list[tuple[Techniques, int, int]]:
    """(asked config, length, trial it neighbours) not evaluated yet: each front config's neighbours that can run
    faster at its longest front length, and the best config's neighbours at the target. Points the study answers by
    monotone inference (out of memory shorter) are left out."""
    layers = job.model_config["num_hidden_layers"]
    known: dict[tuple[str, int], dict] = {}
    for trial in finished_trials(study):
        known[(_key(asked_of(trial)), int(trial.user_attrs["record"]["seq_len"]))] = trial.user_attrs["record"]
    lengths: dict[str, list[tuple[int, float, int]]] = {}  # config -> (length, tokens/s, trial) on the front
    configs: dict[str, dict] = {}
    for point in front_points(study, verified=False):
        asked = asked_of(point.trial)
        configs[_key(asked)] = asked
        lengths.setdefault(_key(asked), []).append((int(point.values[0]), point.values[1], point.number))
    wanted: list[tuple[Techniques, int, int]] = []

    def want(techniques: Techniques, seq_len: int, origin: int) -> None:
        point = (_key(techniques.to_dict()), seq_len)
        if point in known:
            return
        known[point] = {}  # wanted once
        if infer_record(study, job.space.runs(techniques, seq_len), seq_len) is not None:
            return
        if job.space.params_for(techniques, seq_len, layers) is not None:
            wanted.append((techniques, seq_len, origin))

    for key, points in lengths.items():
        config = Techniques.from_dict(configs[key], layers)
        longest, _, origin = max(points)
        for neighbour in job.space.neighbours(config, layers, faster_only=True):
            want(neighbour, longest, origin)
    best = best_point(study, job.target)
    if best is not None:
        config = Techniques.from_dict(asked_of(best.trial), layers)
        for neighbour in job.space.neighbours(config, layers):
            want(neighbour, job.target, best.number)
    return wanted


def evaluation_at(job: SearchJob, asked: Techniques, seq_len: int) -> Evaluation | None:
    """The evaluation of a sampled config at ``seq_len`` as the search runs it (its trainer's config, documents),
    or None where the config cannot run that length."""
    techniques = job.space.runs(asked, seq_len)
    try:
        job.validate(techniques, seq_len)
    except ConfigError:
        return None
    return job.evaluation(techniques, seq_len)


class _Recorder:
    """A stand-in trial for ``SearchSpace.sample``: answers from ``params`` and keeps each parameter's
    distribution, which a trial added to the study needs (the same ones the objective's trials have)."""

    def __init__(self, params: dict):
        self.params, self.distributions = params, {}

    def suggest_categorical(self, name: str, choices):
        self.distributions[name] = CategoricalDistribution(choices)
        return self.params[name]

    def suggest_int(self, name: str, low: int, high: int):
        self.distributions[name] = IntDistribution(low, high)
        return self.params[name]


def _add_trial(
    job: SearchJob, study: optuna.Study, asked: Techniques, evaluation: Evaluation, record: ResultRecord, origin: int
) -> None:
    layers = job.model_config["num_hidden_layers"]
    params = job.space.params_for(asked, evaluation.seq_len, layers)
    recorder = _Recorder(params)
    job.space.sample(recorder, layers, queued=params)
    user_attrs = {
        "worker": WORKER,
        "techniques": evaluation.techniques.to_dict(),
        "record": record.to_dict(),
        "answered_by": job.backend.name,
        POLISH_ATTR: origin,
    }
    if asked != evaluation.techniques:
        user_attrs["asked"] = asked.to_dict()
    rate = float(record.tokens_per_s or 0.0) if record.status == "ok" else 0.0
    study.add_trial(
        optuna.trial.create_trial(
            state=TrialState.COMPLETE,
            values=[float(evaluation.seq_len), rate],
            params=params,
            distributions=recorder.distributions,
            user_attrs=user_attrs,
            system_attrs={CONSTRAINTS_KEY: [constraint_value(record, job.hardware.device_memory_bytes)]},
        )
    )
