"""What to evaluate and what needs no evaluation: seeds, answers from the study (cache, monotone inference), and
follow-ups (see ``autotune.search``)."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from trials.techniques import Techniques, knobs
from autotune.core.record import ResultRecord
from autotune.search.job import SearchJob
from autotune.search.space import param_name
from autotune.search.study import FINISHED


def seed_params(job: SearchJob) -> list[dict]:
    """Known-good starting points (Optuna params): the plain model at the shortest length and at the longest (where
    its wall is), and ALST's stack at the target (each knob at its declared ``alst`` value), plus, for each knob
    split by the Ulysses degree (``head_chunk``), UPipe's: ALST with its smallest chunk."""
    space, choices = job.space, job.space.choices
    degree = max(choices["ulysses_degree"])
    target_len = min((s for s in space.seq_lens if s >= job.target and s % degree == 0), default=space.seq_lens[-1])
    base, alst = {}, {}
    for knob in knobs():
        if knob.kind == "choice":  # the same kernel in every seed: ALST's where the space has it
            base[knob.name] = alst[knob.name] = knob.alst if knob.alst in choices[knob.name] else choices[knob.name][0]
            continue
        if knob.parent is None:
            base[knob.name] = knob.default
        if knob.split_by is None:
            alst[knob.name] = max(choices[knob.name]) if knob.alst == "max" else knob.alst
    base["seq_len"], alst["seq_len"] = space.seq_lens[0], target_len
    # the plain model at the shortest length keeps the front non-empty; at the longest it finds the wall
    # without techniques (cheap: an OOM aborts at the allocation that crosses capacity, or is predicted)
    seeds = [_only_valid(base, choices), _only_valid(alst, choices),
             _only_valid({**base, "seq_len": space.seq_lens[-1]}, choices)]
    values = {**alst, "ulysses_degree": degree}
    for knob in knobs():
        if knob.split_by is None:
            continue
        split = space.knob_choices(knob, values)
        if degree > 1 and len(split) > 1:  # a split knob is only a parameter when there is a choice
            name = param_name(knob, values)
            if knob.alst in split:
                seeds[1][name] = knob.alst  # ALST: plain Ulysses
            seeds.insert(2, {**seeds[1], name: min(c for c in split if not knob.is_off(c))})
    return seeds


def _only_valid(params: dict, choices: dict) -> dict:
    return {k: v for k, v in params.items() if k == "seq_len" or k not in choices or v in choices[k]}


def _same_config(trial: optuna.trial.FrozenTrial, techniques: dict) -> bool:
    return trial.user_attrs.get("techniques") == techniques


def infer_record(study: optuna.Study, techniques: Techniques, seq_len: int) -> tuple[ResultRecord, str] | None:
    """Answer from finished trials without running: an identical evaluation, or an OOM at a shorter length."""
    wanted = techniques.to_dict()
    for past in study.get_trials(deepcopy=False, states=FINISHED):
        if not _same_config(past, wanted) or "record" not in past.user_attrs:
            continue
        record = ResultRecord.from_dict(past.user_attrs["record"])
        if record.seq_len == seq_len and record.status in ("ok", "oom"):
            return record, "cache"
        if record.status == "oom" and record.seq_len <= seq_len:
            inferred = ResultRecord(status="oom", source=record.source, seq_len=seq_len,
                                    error=f"inferred: the same config is out of memory at {record.seq_len:,} "
                                          f"tokens (trial {past.number})")
            return inferred, "monotone"
    return None


def _known_points(study: optuna.Study) -> list[tuple[dict, int, ResultRecord]]:
    """(techniques, seq_len, record) of every trial that has a record, finished or still running."""
    known = []
    for past in study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.RUNNING)):
        if "record" in past.user_attrs and "techniques" in past.user_attrs:
            record = ResultRecord.from_dict(past.user_attrs["record"])
            known.append((past.user_attrs["techniques"], record.seq_len, record))
    return known


def follow_ups(job: SearchJob, known: list[tuple[dict, int, ResultRecord]], techniques: Techniques,
               record: ResultRecord) -> list[tuple[Techniques, int]]:
    """Points worth evaluating next, given a new record (already in ``known``) -- the structure TPE cannot see:

    - climb: a config that fits at L and is on the current front (nothing known is both as long and as fast) is
      tried at the next longer length of the grid: each front config is followed up to its own memory wall;
    - step down in memory: a config that is out of memory at L, having fit on the front at the previous
      length, is tried at L with each one-knob change that should need less memory
      (``SearchSpace.memory_steps``): the fastest way past that wall is usually one technique more.

    Points already known (or answered by monotone inference) are left out. Returns (techniques, seq_len)."""
    lens = [s for s in job.space.seq_lens]
    wanted = techniques.to_dict()
    seq_len = record.seq_len
    feasible = [(s, r.tokens_per_s or 0.0) for _, s, r in known if r.status == "ok"]

    def on_front(length: int, rate: float) -> bool:
        return not any(s >= length and t >= rate and (s, t) != (length, rate) for s, t in feasible)

    candidates: list[tuple[Techniques, int]] = []
    if record.status == "ok" and on_front(seq_len, record.tokens_per_s or 0.0):
        longer = [s for s in lens if s > seq_len and s % techniques.ulysses_degree == 0]
        if longer:
            candidates.append((techniques, longer[0]))
    elif record.status == "oom":
        shorter = [(s, r) for t, s, r in known if t == wanted and s < seq_len and r.status == "ok"]
        if shorter:
            last_len, last = max(shorter, key=lambda item: item[0])
            previous = [s for s in lens if s < seq_len and s % techniques.ulysses_degree == 0]
            if previous and last_len == previous[-1] and on_front(last_len, last.tokens_per_s or 0.0):
                layers = job.model_config["num_hidden_layers"]
                candidates += [(step, seq_len) for step in job.space.memory_steps(techniques, layers)
                               if seq_len % step.ulysses_degree == 0]
    fresh = []
    for candidate, length in candidates:
        as_dict = candidate.to_dict()
        if any(t == as_dict and s == length for t, s, r in known):
            continue
        if any(t == as_dict and r.status == "oom" and s < length for t, s, r in known):
            job.avoided["follow_up_inferred"] = job.avoided.get("follow_up_inferred", 0) + 1  # never queued
            continue
        fresh.append((candidate, length))
    return fresh


def enqueue_follow_ups(job: SearchJob, study: optuna.Study, techniques: Techniques, record: ResultRecord,
                       origin: int) -> int:
    """Queue ``follow_ups`` (skipping any already queued); returns how many were queued."""
    queued = 0
    layers = job.model_config["num_hidden_layers"]
    for candidate, length in follow_ups(job, _known_points(study), techniques, record):
        params = job.space.params_for(candidate, length, layers)
        if params is None:
            continue
        before = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
        study.enqueue_trial(params, user_attrs={"follow_up_of": origin}, skip_if_exists=True)
        queued += len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,))) - before
    return queued
