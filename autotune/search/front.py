"""The Pareto front of a study (longest sequence, most tokens/s) and what it says about the target.

A trial's record is what the search got for it (``user_attrs["record"]``: predicted by ``plan``, measured by
``local``). ``autotune verify`` re-measures some configs with real trials afterwards; Optuna refuses to change a
finished trial, so each measurement is a user attribute of the *study*, ``measured:<trial number>`` ->
``{"trial", "techniques", "seq_len", "depth", "record", "at"}`` (``measured_attr``). A measurement describes a
config at a length, so it applies to every finished trial of that config and length (the search's cache answers
repeat them). The front, the best config and what bound it read each trial's *current* record: its measurement
where there is one (a measured ``oom`` or ``error`` drops it from the front), else its own record.

The best config (``best_point``, what ``best.json`` holds) is chosen at exactly the target: each config that
reaches the target at the target (``at_target``), from its trial there or, where it has only longer trials, from
the search's evaluation of it there (the study user attribute ``at_target_attr``; a verify measurement of the
config at the target is ``measured_attr(trial, target)``). Where no config reaches the target, ``what_bound`` says
which memory stopped the longest and ``what_failed`` why trials failed (``root_cause``: the line of an error text
that says why)."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass

import optuna

from autotune.search.study import FINISHED

MEASURED_PREFIX = "measured:"


def finished_trials(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.get_trials(deepcopy=False, states=FINISHED) if "record" in t.user_attrs]


def measured_attr(trial_number: int, seq_len: int | None = None) -> str:
    """The study user attribute holding the measurement of trial ``trial_number``'s config (``autotune verify``);
    ``seq_len``: at that length instead of the trial's own (the config at the target, ``AtTarget``)."""
    return f"{MEASURED_PREFIX}{trial_number}" + (f"@{seq_len}" if seq_len is not None else "")


def config_key(techniques: dict, seq_len: int) -> str:
    """One config at one length, as a key (the same for every trial that evaluated it)."""
    return f"{int(seq_len)}:{json.dumps(techniques, sort_keys=True)}"


def measurements(study: optuna.Study) -> dict[str, dict]:
    """Every stored measurement by ``config_key``; the latest one where a config was measured twice."""
    found: dict[str, dict] = {}
    for key, value in study.user_attrs.items():
        if not key.startswith(MEASURED_PREFIX) or not isinstance(value, dict) or "record" not in value:
            continue
        at = config_key(value["techniques"], value["seq_len"])
        if at not in found or value.get("at", "") >= found[at].get("at", ""):
            found[at] = value
    return found


@dataclass(frozen=True)
class Point:
    """A finished trial with its current record: ``measured`` (a stored measurement) where there is one."""

    trial: optuna.trial.FrozenTrial
    record: dict  # the current record: the measurement's, else the trial's own
    own: dict  # the trial's own record (what the search got: predicted or measured)
    measured: dict | None  # the stored measurement ({"depth", "record", ...}) of this config, or None

    @property
    def values(self) -> tuple[float, float]:
        """(seq_len, tokens/s) as the front ranks them: the objective's values, or the measurement's."""
        if self.measured is None and self.trial.values is not None:
            return float(self.trial.values[0]), float(self.trial.values[1])
        rate = self.record.get("tokens_per_s") if self.record["status"] == "ok" else None
        return float(self.record["seq_len"]), float(rate or 0.0)

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def techniques(self) -> dict:
        return self.trial.user_attrs["techniques"]


def points(study: optuna.Study, verified: bool = True) -> list[Point]:
    """Every finished trial with its current record (``verified=False``: its own record only)."""
    stored = measurements(study) if verified else {}
    found = []
    for t in finished_trials(study):
        own = t.user_attrs["record"]
        measured = stored.get(config_key(t.user_attrs.get("techniques", {}), own["seq_len"]))
        found.append(Point(t, measured["record"] if measured else own, own, measured))
    return found


def front_points(study: optuna.Study, verified: bool = True) -> list[Point]:
    """Feasible non-dominated points (seq_len up, tokens/s up), longest first; one per (seq_len, tokens/s).
    ``verified=False``: the search's own front, from the trials' own records only."""
    feasible = [p for p in points(study, verified) if p.record["status"] == "ok"]
    front = [p for p in feasible if not any(_dominates(o.values, p.values) for o in feasible)]
    unique = {}
    for p in sorted(front, key=lambda p: (-p.values[0], -p.values[1], p.number)):
        unique.setdefault(p.values, p)
    return list(unique.values())


def pareto_front(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Feasible non-dominated trials (seq_len up, tokens/s up), longest first (measured records where stored)."""
    return [p.trial for p in front_points(study)]


def _dominates(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] >= b[0] and a[1] >= b[1] and a != b


BEST_SPEED_TOLERANCE = 0.02  # configs this close to the fastest at the target count as equally fast
AT_TARGET_PREFIX = "at_target:"


def at_target_attr(asked: dict, target: int) -> str:
    """The study user attribute holding a config's record at exactly ``target`` where no trial of it ran there:
    ``{"trial", "asked", "techniques", "seq_len", "record"}`` (``autotune.search.at_target`` writes it)."""
    return f"{AT_TARGET_PREFIX}{config_key(asked, target)}"


def asked_of(trial: optuna.trial.FrozenTrial) -> dict:
    """The config a trial sampled (``asked``, where the search's trainer runs something else), the same at every
    length: what identifies a config across lengths."""
    return trial.user_attrs.get("asked", trial.user_attrs["techniques"])


@dataclass(frozen=True)
class AtTarget:
    """A config at exactly the target length. ``own``: what the search got there (a trial at the target, or the
    search's evaluation of the config there, ``at_target_attr``); ``measured``: a verify measurement of it there;
    ``record``: the current one (the measurement where there is one). ``trial``: the trial it cites, the config's
    trial at the target, else its shortest feasible trial beyond it."""

    trial: optuna.trial.FrozenTrial
    techniques: dict  # what runs at the target
    record: dict
    own: dict
    measured: dict | None

    @property
    def number(self) -> int:
        return self.trial.number

    @property
    def seq_len(self) -> int:
        return int(self.own["seq_len"])

    @property
    def tokens_per_s(self) -> float:
        return float(self.record.get("tokens_per_s") or 0.0) if self.record["status"] == "ok" else 0.0

    @property
    def peak(self) -> int:
        return self.record.get("peak_device_bytes") or 0


def at_target(study: optuna.Study, target: int) -> tuple[list[AtTarget], list[tuple[dict, optuna.trial.FrozenTrial]]]:
    """Every config with a feasible point at or beyond ``target``, at exactly ``target``: (those whose record there
    is known: each trial at the target, and each config the search evaluated at the target, ``at_target_attr``;
    (asked config, cited trial) of the configs still to evaluate there, ``autotune.search.at_target``).
    A config that fits a longer length is not assumed to run as fast, or at all, at the target: its rate at a
    length is what that length's attention, tiles and chunks make it."""
    every = points(study)
    at_length = {}  # asked config -> its points at the target, whatever their status
    for p in every:
        if int(p.own["seq_len"]) == target:
            at_length.setdefault(_config(asked_of(p.trial)), []).append(p)
    known = [AtTarget(p.trial, p.techniques, p.record, p.own, p.measured) for ps in at_length.values() for p in ps]
    stored, missing, seen = measurements(study), [], set(at_length)
    beyond = [p for p in every if p.record["status"] == "ok" and p.values[0] > target]
    for p in sorted(beyond, key=lambda p: (p.values[0], p.number)):  # the shortest trial of a config first
        asked = asked_of(p.trial)
        if _config(asked) in seen:
            continue
        seen.add(_config(asked))
        entry = study.user_attrs.get(at_target_attr(asked, target))
        if entry is None:
            missing.append((asked, p.trial))
        else:
            known.append(_stored_at_target(p.trial, entry, target, stored))
    # a config evaluated at the target stays a candidate there when a measurement drops its longer trials
    trials = {t.number: t for t in study.get_trials(deepcopy=False)}
    for key, entry in study.user_attrs.items():
        if key.startswith(AT_TARGET_PREFIX) and entry["seq_len"] == target and _config(entry["asked"]) not in seen:
            seen.add(_config(entry["asked"]))
            known.append(_stored_at_target(trials[entry["trial"]], entry, target, stored))
    return known, missing


def _stored_at_target(trial, entry: dict, target: int, stored: dict[str, dict]) -> AtTarget:
    measured = stored.get(config_key(entry["techniques"], target))
    return AtTarget(
        trial, entry["techniques"], measured["record"] if measured else entry["record"], entry["record"], measured
    )


def _config(techniques: dict) -> str:
    return json.dumps(techniques, sort_keys=True)


def best_point(study: optuna.Study, target: int) -> AtTarget | None:
    """The config ``best.json`` holds: of the configs that reach the target, each at exactly the target
    (``at_target``), among those that fit there and run within ``BEST_SPEED_TOLERANCE`` of the fastest there, the
    one with the most device headroom (the lowest peak; then the faster). On rates that are partly assumed, a
    fraction of a percent of speed is not worth GiB of margin. None when none fits at the target (or none was
    evaluated there yet)."""
    fitting = _fitting(study, target)
    if not fitting:
        return None
    fastest = _fastest(fitting)
    near = [c for c in fitting if c.tokens_per_s >= fastest.tokens_per_s * (1 - BEST_SPEED_TOLERANCE)]
    return min(near, key=lambda c: (c.peak, -c.tokens_per_s, c.number))


def _fitting(study: optuna.Study, target: int) -> list[AtTarget]:
    return [c for c in at_target(study, target)[0] if c.record["status"] == "ok"]


def _fastest(candidates: list[AtTarget]) -> AtTarget:
    return max(candidates, key=lambda c: (c.tokens_per_s, -c.number))


def best_choice(study: optuna.Study, target: int) -> str | None:
    """Why ``best_point`` is not the fastest config at the target (one line), or None when it is."""
    best = best_point(study, target)
    if best is None:
        return None
    fastest = _fastest(_fitting(study, target))
    if fastest.number == best.number:
        return None
    gib = 2**30
    return (
        f"best is trial {best.number} ({best.tokens_per_s:,.0f} tokens/s at {best.peak / gib:.1f} GiB), not the "
        f"fastest, trial {fastest.number} ({fastest.tokens_per_s:,.0f} tokens/s at {fastest.peak / gib:.1f} GiB): "
        f"within {BEST_SPEED_TOLERANCE:.0%} of its speed with {(fastest.peak - best.peak) / gib:.1f} GiB more headroom"
    )


def best_for_target(study: optuna.Study, target: int):
    """The trial ``best_point`` cites, or None."""
    best = best_point(study, target)
    return None if best is None else best.trial


def what_bound(study: optuna.Study) -> str:
    """What bound the longest fit, for a search that did not reach its target: the same config's shortest
    out-of-memory record above it (host memory, or the device and its largest category there), else the longest
    fit's own peak (its config was not tried longer). With nothing fitting, the category that dominated the
    shortest OOM."""
    every = points(study)
    fits = [p for p in every if p.record["status"] == "ok"]
    if not fits:
        ooms = [p for p in every if p.record["status"] == "oom" and p.record.get("breakdown")]
        if not ooms:
            return "no out-of-memory trial recorded a breakdown"
        shortest = min(ooms, key=lambda p: p.record["seq_len"])
        category, gib = _largest(shortest.record)
        return (
            f"the shortest OOM ({shortest.record['seq_len']:,} tokens, trial {shortest.number}) was dominated by "
            f"{category} ({gib:.1f} GiB)"
        )
    longest = max(fits, key=lambda p: (p.record["seq_len"], p.record.get("tokens_per_s") or 0.0))
    length, config = longest.record["seq_len"], longest.trial.user_attrs.get("techniques")
    above = [
        p
        for p in every
        if p.record["status"] == "oom"
        and p.record["seq_len"] > length
        and p.trial.user_attrs.get("techniques") == config
    ]
    fit = f"the longest fit (trial {longest.number})"
    if not above:
        category, gib = _largest(longest.record)
        peak = (longest.record.get("peak_device_bytes") or 0) / 2**30
        return f"{fit} was not tried longer; its device peak there is {peak:.1f} GiB, most of it {category} ({gib:.1f} GiB)"
    wall = min(above, key=lambda p: p.record["seq_len"])
    host = "host out of memory" in (wall.record.get("error") or "")
    said = f"{fit} runs out of {'host' if host else 'device'} memory at {wall.record['seq_len']:,} tokens (trial {wall.number})"
    if host:
        return f"{said}, {(wall.record.get('host_bytes') or 0) / 2**30:.1f} GiB per rank on the host"
    if not wall.record.get("breakdown"):
        return said
    category, gib = _largest(wall.record)
    return f"{said}, most of it {category} ({gib:.1f} GiB)"


def _largest(record: dict) -> tuple[str, float]:
    """A record's largest memory category and its GiB ("none", 0.0 without a breakdown)."""
    breakdown = record.get("breakdown") or {}
    if not breakdown:
        return "none", 0.0
    category = max(breakdown, key=breakdown.get)
    return category, breakdown[category] / 2**30


FAILED = ("error", "timeout")  # a trial that says nothing about memory: no answer, a failure
_FRAME = re.compile(r'^\s*File "')
_PYDANTIC = re.compile(r"\d+ validation errors? for \S+$")
# where a real trial's error text goes on with the trial's own output (``autotune.backends.local``)
_OUTPUT_MARKERS = ("\n--- last lines of the trial's output ---", "; last output:\n")


def root_cause(error: str | None) -> str:
    """The one line of an error text that says why: a failed record's ``error`` (``Type: message``, then the
    tail of its traceback, then maybe the trial's output) as one line that ends with the cause.

    Where the first line is the exception that ended the traceback, its message is read there, where it is
    whole (above, the traceback's tail follows the message's first lines, cut anywhere): a header ending in ':'
    is joined with the line that explains it (``Validation error for field 'x': TypeError: ...``), pydantic's
    three-line errors into one. What precedes the exception on the first line (``rank 0: ``, ``the prediction
    failed: ``) stays in front; a first line that is not the traceback's exception is the record's own summary
    of it (``trial exceeded its 60 s deadline``), and the trial's output after it is left out."""
    if not error or not error.strip():
        return "no cause recorded"
    text = error
    for marker in _OUTPUT_MARKERS:
        text = text.split(marker)[0]
    lines = [line.rstrip() for line in text.strip().splitlines() if line.strip()]
    message = lines
    frames = [i for i, line in enumerate(lines) if _FRAME.match(line)]
    if frames:
        after = lines[frames[-1] + 1 :]
        start = next((i for i, line in enumerate(after) if not line[:1].isspace()), None)
        if start is not None:
            name, colon, rest = after[start].partition(": ")
            said = f"{name.rsplit('.', 1)[-1]}{colon}{rest}"  # huggingface_hub.errors.X: as the first line says it
            if lines[0].endswith(said):
                message = [lines[0]] + after[start + 1 :]
    return _one_line(message)


def _one_line(message: list[str]) -> str:
    first = message[0].strip()
    if _PYDANTIC.search(first) and len(message) >= 3:  # "N validation errors for X" / field / what is wrong
        detail = re.sub(r"\s*\[type=.*$", "", message[2].strip())
        return f"{first}: {message[1].strip()}: {detail}"
    line = first
    for more in message[1:]:
        if not line.endswith(":"):
            break
        line = f"{line} {more.strip()}"
    return line


def what_failed(study: optuna.Study) -> tuple[str, bool] | None:
    """Why trials failed (``FAILED``), for a search without an answer: (text, every trial failed), or None when
    none did. When every finished trial failed: the first full error text of the most common cause
    (``root_cause``), then a last line with how many failed and that cause with its count. When some did: one
    clause, to follow ``what_bound``; it ends with the most common cause too."""
    found = points(study)
    failed = [p for p in found if p.record["status"] in FAILED]
    if not failed:
        return None
    cause_of = {p.number: root_cause(p.record.get("error")) for p in failed}
    cause, count = Counter(cause_of.values()).most_common(1)[0]
    if len(failed) < len(found):
        return f"{len(failed)} of {len(found)} trials failed, {count} with: {cause}", False
    first = min((p for p in failed if cause_of[p.number] == cause), key=lambda p: p.number)
    others = len(failed) - count
    elsewhere = f" ({others} with other causes: the error column of trials.parquet)" if others else ""
    full = (first.record.get("error") or "no cause recorded").strip()
    text = (
        f"trial {first.number} ended {first.record['status']}: {full}\n"
        f"autotune: all {len(failed)} trials failed{elsewhere}; {count} with: {cause}"
    )
    return text, True
