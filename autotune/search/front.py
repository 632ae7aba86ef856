"""The Pareto front of a study (longest sequence, most tokens/s) and what it says about the target."""

from __future__ import annotations

import optuna

from autotune.search.study import FINISHED


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
