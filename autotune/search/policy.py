"""What to evaluate and what needs no evaluation: seeds, answers from the study (cache, monotone inference), and
follow-ups (see ``autotune.search``)."""

from __future__ import annotations

import dataclasses
import math

import optuna
from optuna.trial import TrialState

from autotune.core.record import ResultRecord
from autotune.search.job import SearchJob
from autotune.search.space import param_name
from autotune.search.study import FINISHED
from trials.stack.rules import length_unit, split_unit
from trials.stack.techniques import Techniques, knobs


def seed_params(job: SearchJob) -> list[dict]:
    """Known-good starting points (Optuna params): the plain model at the shortest length and at the longest (where
    its wall is), ALST's stack at the target (each knob at its declared ``alst`` value), plus, for each knob
    split by the Ulysses degree (``head_chunk``), UPipe's: ALST with its smallest chunk; and the space's most
    memory-frugal config (``SearchSpace.frugal``) at the target and at the grid's end, between which (or past
    which) ``follow_ups`` take it to its wall."""
    space, choices = job.space, job.space.choices
    degree = max(choices["ulysses_degree"])
    target_len = min((s for s in space.seq_lens if s >= job.target and s % degree == 0), default=space.seq_lens[-1])
    base, alst = {}, {}
    kernel = seed_kernel(job)
    for knob in knobs():
        if knob.kind == "choice":  # the same kernel in every seed: the fastest the preset prices
            base[knob.name] = alst[knob.name] = kernel
            continue
        if knob.parent is None:  # a split knob (the ring) under its parameter at the plain model's Ulysses degree
            base[param_name(knob, base) if knob.split_by else knob.name] = knob.default
        if knob.split_by is None:
            alst[knob.name] = max(choices[knob.name]) if knob.alst == "max" else knob.alst
    base["seq_len"], alst["seq_len"] = space.seq_lens[0], target_len
    # the plain model at the shortest length keeps the front non-empty; at the longest it finds the wall
    # without techniques (cheap: an OOM aborts at the allocation that crosses capacity, or is predicted)
    seeds = [
        _only_valid(base, choices),
        _only_valid(alst, choices),
        _only_valid({**base, "seq_len": space.seq_lens[-1]}, choices),
    ]
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
    layers = job.model_config["num_hidden_layers"]
    for frugal in search_frugals(job):
        unit = split_unit(frugal.ulysses_degree, frugal.ring_degree)
        top = max((s for s in space.seq_lens if s % unit == 0), default=target_len)
        at_target = min((s for s in space.seq_lens if s >= job.target and s % unit == 0), default=top)
        for at, length in ((2, at_target), (len(seeds), top)):  # at the target, and at the grid's end (its wall)
            params = space.params_for(frugal, length, layers)
            if params is not None and params not in seeds:
                seeds.insert(at, params)
    return seeds


def seed_kernel(job: SearchJob) -> str:
    """The attention kernel of every seed: of the space's kernels, the fastest the hardware preset prices (FA3 on
    an H100 that lists it), else ALST's where the space has it, else the space's first. The flash kernels' memory
    differs by their backward scratch only, so a wall climbed with one holds for the others to within it. Over
    packed documents only the kernels with which the search's trainer masks them are considered, where it has
    any (DeepSpeed: FlashAttention-2): attention inside each document is a fraction of attention over the window."""
    choices = job.space.choices["attention"]
    if not job.documents.one:
        choices = [a for a in choices if job.trainer.masks_documents(a)] or choices
    (knob,) = [k for k in knobs() if k.name == "attention"]
    fallback = knob.alst if knob.alst in choices else choices[0]
    return job.hardware.fastest_kernel(choices) or fallback


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
            inferred = ResultRecord(
                status="oom",
                source=record.source,
                seq_len=seq_len,
                error=f"inferred: the same config is out of memory at {record.seq_len:,} tokens (trial {past.number})",
            )
            return inferred, "monotone"
    return None


def _known_points(study: optuna.Study) -> list[tuple[dict, int, ResultRecord]]:
    """(techniques, seq_len, record) of every trial that has a record, finished or still running; the techniques
    as sampled (``asked``, where the search's trainer runs something else), which are the same at every length."""
    known = []
    for past in study.get_trials(deepcopy=False, states=(*FINISHED, TrialState.RUNNING)):
        if "record" in past.user_attrs and "techniques" in past.user_attrs:
            record = ResultRecord.from_dict(past.user_attrs["record"])
            known.append((past.user_attrs.get("asked", past.user_attrs["techniques"]), record.seq_len, record))
    return known


WALL_TOLERANCE = 0.01  # a config's wall is reached when its longest fitting length is within this of its shortest OOM


def _on_front(known: list[tuple[dict, int, ResultRecord]], length: int, rate: float) -> bool:
    feasible = [(s, r.tokens_per_s or 0.0) for _, s, r in known if r.status == "ok"]
    return not any(s >= length and t >= rate and (s, t) != (length, rate) for s, t in feasible)


def wall_step(job: SearchJob, known: list[tuple[dict, int, ResultRecord]], techniques: Techniques) -> int | None:
    """The next length at which to look for ``techniques``' memory wall, or None.

    A config whose longest fitting length ``lo`` is on the front and whose shortest OOM above it is ``hi`` has its
    wall in between; the grid (2 points per doubling) leaves up to 30% of the length there. Lengths are
    multiples of the config's ``length_unit`` (as ``autotune estimate --max-seq``'s). The step is where the line
    through the two longest fitting points' device peaks (and host bytes) reaches capacity -- memory is nearly
    affine in the length -- or, with one fitting point, the line through it and the origin; rounded down to the
    unit and kept inside (lo, hi). When a step off the grid was out of memory and the line points at or past
    it again (the peak bends upward), bisection. None when no multiple of the unit lies inside, or ``lo`` is
    within ``WALL_TOLERANCE`` of ``hi``: the front then reaches the wall."""
    wanted = techniques.to_dict()
    mine = sorted((s, r) for t, s, r in known if t == wanted and r.status in ("ok", "oom"))
    fits = [(s, r) for s, r in mine if r.status == "ok"]
    if not fits:
        return None
    lo, lo_record = fits[-1]
    above = [(s, r) for s, r in mine if r.status == "oom" and s > lo]
    if not above or not (_on_front(known, lo, lo_record.tokens_per_s or 0.0) or _is_frugal(job, techniques)):
        return None
    hi = above[0][0]
    if not _is_frugal(job, techniques) and any(
        lo < s < hi and s % split_unit(techniques.ulysses_degree, techniques.ring_degree) == 0
        for s in job.space.seq_lens
    ):
        return None  # the climb goes on along the grid first (the frugal config goes straight for its wall)
    unit = math.lcm(length_unit(techniques), techniques.ulysses_degree)
    first, last = (lo // unit + 1) * unit, (hi - 1) // unit * unit  # the unit's multiples strictly inside
    if first > last or lo >= hi * (1 - WALL_TOLERANCE):
        return None
    origin = (0, ResultRecord(status="ok", source="", seq_len=0, peak_device_bytes=0, host_bytes=0))
    crossing = _crossing(fits[-2] if len(fits) >= 2 else origin, fits[-1], job.hardware)
    overshot = not job.space.on_grid(hi)  # hi is an earlier step that did not fit
    if crossing is None or (overshot and crossing >= last):
        crossing = (lo + hi) // 2
    return min(max(crossing // unit * unit, first), last)


def _crossing(a: tuple[int, ResultRecord], b: tuple[int, ResultRecord], hardware) -> int | None:
    """Where the line through two fitting points reaches the device capacity or the host memory, whichever first."""
    (la, ra), (lb, rb) = a, b
    limits = [(ra.peak_device_bytes, rb.peak_device_bytes, hardware.device_memory_bytes)]
    if hardware.host_memory_bytes_per_device:
        limits.append((ra.host_bytes, rb.host_bytes, hardware.host_memory_bytes_per_device))
    found = []
    for pa, pb, capacity in limits:
        if pa is None or pb is None or pb <= pa or lb <= la:
            continue
        found.append(lb + (capacity - pb) * (lb - la) / (pb - pa))
    return int(min(found)) if found else None


def search_frugal(job: SearchJob) -> Techniques:
    """The most frugal config the search climbs to its wall: ``SearchSpace.frugal`` with the seeds' kernel."""
    return dataclasses.replace(job.space.frugal(job.model_config["num_hidden_layers"]), attention=seed_kernel(job))


def search_frugals(job: SearchJob) -> list[Techniques]:
    """The frugal configs the search climbs to their walls: ``search_frugal``, and over several nodes the most
    frugal config of each layout the world admits (``SearchSpace.layouts``: Ulysses inside a node x a ring across
    the nodes, up to Ulysses over every GPU). Which layout's wall is the longest depends on the heads (Ulysses
    past the KV heads replicates them) and the links, so each is taken to its own."""
    layers, kernel = job.model_config["num_hidden_layers"], seed_kernel(job)
    found = [search_frugal(job)]
    for layout in job.space.layouts(job.world_size, job.gpus):
        frugal = dataclasses.replace(job.space.frugal(layers, layout), attention=kernel)
        if frugal not in found:
            found.append(frugal)
    return found


def _is_frugal(job: SearchJob, techniques: Techniques) -> bool:
    """One of the search's frugal configs (``search_frugals``): it climbs to its wall even off the front, as the
    longest of those walls is the world's for the search's trainer (the front's longest point)."""
    return techniques in search_frugals(job)


def follow_ups(
    job: SearchJob, known: list[tuple[dict, int, ResultRecord]], techniques: Techniques, record: ResultRecord
) -> list[tuple[Techniques, int]]:
    """Points worth evaluating next, given a new record (already in ``known``) -- the structure TPE cannot see:

    - climb: a config that fits at L and is on the current front (nothing known is both as long and as fast), or
      is the space's most frugal one (``_is_frugal``), is tried at the next longer length of the grid (the frugal
      one past the grid's end too, at twice its length; out of memory wherever it was tried, at the middle of the
      grid below): each front config is followed up to its own memory wall;
    - reach the wall: a front config that fits at L and is out of memory at the next length it was tried at
      is tried in between (``wall_step``, a length off the grid), until its longest fitting length is its wall;
    - step down in memory: a config that is out of memory at a grid length L, having fit on the front at the
      previous one, is tried at L with each one-knob change that should need less memory
      (``SearchSpace.memory_steps``): the fastest way past that wall is usually one technique more.

    Points already known (or answered by monotone inference) are left out. Returns (techniques, seq_len)."""
    lens = [s for s in job.space.seq_lens]
    wanted = techniques.to_dict()
    seq_len = record.seq_len

    def on_front(length: int, rate: float) -> bool:
        return _on_front(known, length, rate)

    candidates: list[tuple[Techniques, int]] = []
    wall = wall_step(job, known, techniques) if record.status in ("ok", "oom") else None
    if wall is not None:
        candidates.append((techniques, wall))
    frugal = _is_frugal(job, techniques)
    if record.status == "ok" and (on_front(seq_len, record.tokens_per_s or 0.0) or frugal):
        fits = max((s for t, s, r in known if t == wanted and r.status == "ok"), default=seq_len)
        longer = [
            s for s in lens if s > fits and s % split_unit(techniques.ulysses_degree, techniques.ring_degree) == 0
        ]  # beyond what it fits at
        if longer:
            candidates.append((techniques, longer[0]))
        elif frugal:  # past the grid's end: the node's wall may lie beyond it, and the front should show it
            unit = math.lcm(length_unit(techniques), techniques.ulysses_degree)
            candidates.append((techniques, 2 * fits // unit * unit))
    elif record.status == "oom" and frugal and not any(t == wanted and r.status == "ok" for t, s, r in known):
        # the most frugal config out of memory wherever it was tried: its wall (the node's) lies below; halve the
        # grid below in log space until it fits, then the wall steps close in
        lower = [
            s for s in lens if s < seq_len and s % split_unit(techniques.ulysses_degree, techniques.ring_degree) == 0
        ]
        if lower:
            candidates.append((techniques, lower[len(lower) // 2]))
    elif record.status == "oom" and seq_len in lens:
        shorter = [(s, r) for t, s, r in known if t == wanted and s < seq_len and r.status == "ok"]
        if shorter:
            last_len, last = max(shorter, key=lambda item: item[0])
            previous = [
                s
                for s in lens
                if s < seq_len and s % split_unit(techniques.ulysses_degree, techniques.ring_degree) == 0
            ]
            if previous and last_len == previous[-1] and on_front(last_len, last.tokens_per_s or 0.0):
                layers = job.model_config["num_hidden_layers"]
                candidates += [
                    (step, seq_len)
                    for step in job.space.memory_steps(techniques, layers)
                    if seq_len % split_unit(step.ulysses_degree, step.ring_degree) == 0
                ]
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


def enqueue_follow_ups(
    job: SearchJob, study: optuna.Study, techniques: Techniques, record: ResultRecord, origin: int
) -> int:
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
