"""The search: a multi-objective Optuna study (maximize seq_len, maximize tokens/s) over a search space.

Each Optuna trial samples a technique set and a sequence length, then gets its record the cheapest
honest way:
    1. cache      the same config and length was already evaluated in this study: reuse its record;
    2. monotone   the same config OOMed at a length <= this one: it cannot fit here either;
    3. oracle     (local backend) the plan backend predicts OOM: no real trial is launched;
    4. backend    a plan prediction or a real local trial.
A config that does not fit (or fails) is reported to Optuna as a violated constraint
(``trial.set_constraint``), so TPE learns where the memory wall is instead of ignoring failures.

What to evaluate: the seeds first (``seed_params``), then *follow-ups* (``follow_ups``), then TPE. TPE treats
the length as one more categorical and the knobs as unrelated; the problem has structure it cannot see --
memory grows with the length, and each technique trades speed for memory -- so after every record the search
queues the points that structure says are worth it: a front config at the next longer length (climb to its
wall), and at a wall, the same config with one memory technique more. Queued trials run first (Optuna's
``enqueue_trial``, shared by every worker of the study); when the queue is empty TPE proposes. On
``bench/search_quality.py``'s reduced space this takes the hypervolume at 10% of the grid from 0.83 (TPE
alone) to 0.96.
The study lives in storage (SQLite in the out dir by default), so re-running the same command resumes,
and several workers may share one study.
"""

from __future__ import annotations

import json
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import optuna
from optuna.trial import TrialState

from autotune.backends import Backend, Evaluation
from autotune.config import Techniques
from autotune.errors import UserError
from autotune.presets import Hardware
from autotune.record import ResultRecord
from autotune.space import SearchSpace

optuna.logging.set_verbosity(optuna.logging.ERROR)  # our own progress display says what happens
# heartbeats and metric names are marked experimental; the CLI should not print that on every run
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

FINISHED = (TrialState.COMPLETE, TrialState.PRUNED)


class SurplusTrial(Exception):
    """Raised (and caught, leaving a FAIL trial outside every report) when the study is already full."""


@dataclass
class SearchJob:
    model: str
    model_config: dict
    target: int
    gpus: int
    hardware: Hardware
    space: SearchSpace
    backend: Backend
    out: Path
    trials: int
    timeout_s: float | None = None
    storage: str | None = None
    study_name: str | None = None
    seed: int = 0
    prefilter: Backend | None = None  # the plan backend in front of real trials
    follow_ups: bool = True  # climb front configs and step down in memory at their walls (see follow_ups)
    avoided: dict = field(default_factory=lambda: {"cache": 0, "monotone": 0, "oracle": 0})


def open_storage(storage: str | None, out: Path):
    """SQLite in ``out`` by default; an RDB URL; or a journal file (path ending .log/.jsonl or ``journal:PATH``)."""
    try:
        if storage is None:
            url = f"sqlite:///{(out / 'study.db').resolve()}"
            return _rdb(url)
        if storage.startswith("journal:") or storage.endswith((".log", ".jsonl", ".journal")):
            from optuna.storages.journal import JournalFileBackend, JournalStorage

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
    from optuna.storages import RDBStorage, RetryHeartbeatStaleTrialCallback

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


def create_study(job: SearchJob, storage=None) -> optuna.Study:
    """Create or load the job's study (``storage``: an already opened Optuna storage, else opened here)."""
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
        for params in seed_params(job):
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
        study.enqueue_trial(trial.params, user_attrs={"retry_of": trial.number})
        reaped.append(trial.number)
    return reaped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def seed_params(job: SearchJob) -> list[dict]:
    """Known-good starting points: plain baseline, ALST-like, UPipe-like (DESIGN.md techniques)."""
    space, choices = job.space, job.space.choices
    degree = max(choices["ulysses_degree"])
    kernel = "flash" if "flash" in choices["attention"] else choices["attention"][0]
    target_len = min((s for s in space.seq_lens if s >= job.target and s % degree == 0), default=space.seq_lens[-1])
    base = {"fsdp": False, "ulysses_degree": 1, "activation_checkpointing": False, "mlp_tile_tokens": 0,
            "loss_tile_tokens": 0, "norm_tile_tokens": 0, "attention": kernel, "seq_len": space.seq_lens[0]}
    alst = {"fsdp": True, "ulysses_degree": degree, "activation_checkpointing": True,
            "mlp_tile_tokens": max(choices["mlp_tile_tokens"]), "loss_tile_tokens": max(choices["loss_tile_tokens"]),
            "norm_tile_tokens": max(choices["norm_tile_tokens"]),
            "attention": kernel, "seq_len": target_len}
    if True in choices["optimizer_offload"]:
        alst["optimizer_offload"] = True
    if "all" in choices["activation_offload_layers"]:
        alst["activation_offload_layers"] = "all"
    # the plain model at the shortest length keeps the front non-empty; at the longest it finds the wall
    # without techniques (cheap: an OOM aborts at the allocation that crosses capacity, or is predicted)
    seeds = [_only_valid(base, choices), _only_valid(alst, choices),
             _only_valid({**base, "seq_len": space.seq_lens[-1]}, choices)]
    chunks = space.head_chunks(degree)
    if degree > 1 and len(chunks) > 1:  # head_chunk_u{degree} is only a parameter when there is a choice
        if None in chunks:
            seeds[1][f"head_chunk_u{degree}"] = None  # ALST: plain Ulysses
        seeds.insert(2, {**seeds[1], f"head_chunk_u{degree}": min(c for c in chunks if c is not None)})
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
        # several workers share one study: the trial is surplus if the study already holds ``job.trials``
        # trials created before it (finished or still running), so together they run exactly that many
        ahead = sum(1 for t in study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.RUNNING))
                    if t.number < trial.number)
        if ahead >= job.trials:
            study.stop()
            raise SurplusTrial(f"trial {trial.number}: the study already holds {job.trials} trials")
        trial.set_user_attr("worker", WORKER)
        techniques, seq_len = job.space.sample(trial, layers)
        techniques.validate(job.model_config, job.gpus, seq_len)
        trial.set_user_attr("techniques", techniques.to_dict())
        evaluation = Evaluation(job.model_config, techniques, seq_len, job.gpus, job.hardware)
        answered = infer_record(study, techniques, seq_len)
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
        trial.set_constraint("memory", constraint_value(record, capacity))
        if job.follow_ups:
            enqueue_follow_ups(job, study, techniques, record, trial.number)
        if on_record is not None:
            on_record(trial.number, techniques, record, how)
        return float(seq_len), float(record.tokens_per_s or 0.0) if record.status == "ok" else 0.0

    return objective


def run(job: SearchJob, on_record: Callable | None = None, study: optuna.Study | None = None) -> optuna.Study:
    """Run (or resume) the study until it holds ``job.trials`` finished trials or the timeout passes."""
    study = study or create_study(job)
    done = len(study.get_trials(deepcopy=False, states=FINISHED))
    remaining = max(0, job.trials - done)
    if remaining:
        study.optimize(make_objective(job, study, on_record), n_trials=remaining, timeout=job.timeout_s,
                       catch=(SurplusTrial,))
    return study


def finished_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED) if "record" in t.user_attrs]


def pareto_front(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Feasible non-dominated trials (seq_len up, tokens/s up), longest first."""
    feasible = [t for t in finished_trials(study) if t.user_attrs["record"]["status"] == "ok"]
    front = [t for t in feasible if not any(_dominates(o, t) for o in feasible)]
    unique = {}
    for t in sorted(front, key=lambda t: (-t.values[0], -t.values[1], t.number)):
        unique.setdefault((t.values[0], t.values[1]), t)
    return list(unique.values())


def _dominates(a, b) -> bool:
    return a.values[0] >= b.values[0] and a.values[1] >= b.values[1] and tuple(a.values) != tuple(b.values)


def best_for_target(study: optuna.Study, target: int):
    """The fastest feasible trial whose seq_len reaches the target, or None."""
    reaching = [t for t in pareto_front(study) if t.values[0] >= target]
    return max(reaching, key=lambda t: (t.values[1], -t.values[0]), default=None)


def what_bound(study: optuna.Study) -> str:
    """Which memory category dominated the OOM just past the longest feasible length."""
    trials = finished_trials(study)
    ooms = [t for t in trials if t.user_attrs["record"]["status"] == "oom" and t.user_attrs["record"].get("breakdown")]
    if not ooms:
        return "no out-of-memory trial recorded a breakdown"
    shortest = min(ooms, key=lambda t: t.values[0])
    breakdown = shortest.user_attrs["record"]["breakdown"]
    category = max(breakdown, key=breakdown.get)
    return (f"the shortest OOM ({shortest.values[0]:,.0f} tokens, trial {shortest.number}) was dominated by "
            f"{category} ({breakdown[category] / 2**30:.1f} GiB)")


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, default=str)
