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
wall), between its longest fit and the grid length where it ran out of memory (wall steps, off the grid, until
the front reaches the config's real maximum), and at a wall, the same config with one memory technique more.
Queued trials run first (Optuna's ``enqueue_trial``, shared by every worker of the study); when the queue is empty
TPE proposes. After the trials, on the plan backend, ``polish`` compares each front config and the best with the
configs one knob away and adds those it evaluates as trials (a faster one that fits takes the point's place). bench/results/search_quality.txt compares the hypervolume this reaches with TPE alone's.
The study lives in storage (SQLite in the out dir by default), so re-running the same command resumes,
and several workers may share one study.

    job.py        SearchJob: what to search, on what, into which folder
    request.py    from the user's options to the job: backend, hardware, nodes, prefilter, space, study
    space.py      the search space (knob choices, length grid) derived from the knob table
    study.py      storages, creating / resuming the study, reaping dead workers' trials
    policy.py     seeds, answers from the study, follow-ups
    objective.py  one trial's objective, and ``run``
    parallel.py   plan trials on every core (worker processes that evaluate what the study will ask next)
    front.py      the Pareto front, the best config for the target (each config that reaches it, at it)
    at_target.py  the configs that reach the target evaluated at exactly the target (what the best is chosen from)
    polish.py     each front config and the best compared with the configs one knob away, before the outputs
    max_seq.py    the longest sequence one config fits
"""

from autotune.search.at_target import evaluate_at_target
from autotune.search.front import best_for_target, finished_trials, pareto_front, what_bound
from autotune.search.job import SearchJob
from autotune.search.objective import constraint_value, make_objective, open_study, run
from autotune.search.policy import follow_ups, infer_record, seed_params
from autotune.search.polish import polish
from autotune.search.study import FINISHED, create_study, open_storage, reap_dead_trials, study_name_for

__all__ = [
    "FINISHED",
    "SearchJob",
    "best_for_target",
    "constraint_value",
    "create_study",
    "evaluate_at_target",
    "finished_trials",
    "follow_ups",
    "infer_record",
    "make_objective",
    "open_storage",
    "open_study",
    "pareto_front",
    "polish",
    "reap_dead_trials",
    "run",
    "seed_params",
    "study_name_for",
    "what_bound",
]
