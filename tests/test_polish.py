"""The front and the best are compared with the configs one knob away (``autotune.search.polish``): no front config
is left slower at its longest front length than a neighbour that fits there, and a resumed search evaluates none
again."""

from __future__ import annotations

import optuna
import pytest
from conftest import run_cli

from autotune.core.record import ResultRecord
from autotune.search.front import asked_of, best_point, finished_trials, front_points
from autotune.search.polish import POLISH_ATTR
from autotune.search.space import SPACES_DIR, load_space
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

K = 1024
POLISHED = {"AUTOTUNE_POLISH": "1"}  # the suite's searches run unpolished (tests/conftest.py)
FA2_FRONT_CONFIG = {  # the main job's front below 2M: FlashAttention-2, head chunks of 2, no MLP tiles
    "fsdp": True,
    "optimizer_offload": False,
    "ulysses_degree": 8,
    "ring_degree": 1,
    "head_chunk": 2,
    "activation_checkpointing": True,
    "activation_offload_layers": 32,
    "mlp_tile_tokens": 0,
    "loss_tile_tokens": 2 * K,
    "norm_tile_tokens": 0,
    "attention": "flash",
}


def _changes(config: Techniques, neighbours: list[Techniques]) -> list[dict]:
    before = config.to_dict()
    return [{k: v for k, v in n.to_dict().items() if before[k] != v} for n in neighbours]


def test_the_neighbours_that_can_run_faster_are_each_knob_one_step_toward_more_memory_and_the_layout_either_way():
    space = load_space(None, load_model_config("llama3-8b"), 8, 5 * K * K, kernels=["sdpa", "flash", "flash3"])
    config = Techniques.from_dict(FA2_FRONT_CONFIG, 32)
    faster = _changes(config, space.neighbours(config, 32, faster_only=True))
    assert faster == [
        {"fsdp": False},
        {"ulysses_degree": 4, "ring_degree": 2, "head_chunk": None},  # the same 8 ranks: Ulysses 4 x ring 2
        {"head_chunk": 4},
        {"activation_checkpointing": False, "activation_offload_layers": 0},
        {"activation_offload_layers": 0},
        {"loss_tile_tokens": 8 * K},
        {"attention": "sdpa"},
        {"attention": "flash3"},
    ]
    either = _changes(config, space.neighbours(config, 32))
    assert (
        {"head_chunk": 1} in either and {"mlp_tile_tokens": 64 * K} in either and {"optimizer_offload": True} in either
    )
    assert set(map(str, faster)) < set(map(str, either))


@pytest.mark.slow
def test_no_front_config_is_slower_than_a_neighbour_that_fits_and_a_resumed_search_polishes_nothing_again(tmp_path):
    out = tmp_path / "search"
    space_file = SPACES_DIR / "reduced-tiny.yaml"
    args = ["search", "--model", "tiny-llama", "--target", "4K", "--gpus", "2", "--backend", "plan"]
    args += ["--hardware", "cpu", "--memory-gib", "0.5", "--space", str(space_file), "--trials", "4", "--out", str(out)]
    first = run_cli(*args, env=POLISHED)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "polish: " in first.stderr
    assert " one knob from the front): " in first.stdout + first.stderr  # the tally counts them, apart

    [summary] = optuna.get_all_study_summaries(f"sqlite:///{out / 'study.db'}")
    study = optuna.load_study(study_name=summary.study_name, storage=f"sqlite:///{out / 'study.db'}")
    trials = finished_trials(study)
    polished = [t for t in trials if POLISH_ATTR in t.user_attrs]
    assert polished and len(trials) > 4  # the neighbours are trials of the study, beyond the search's own four
    known = {(str(asked_of(t)), t.user_attrs["record"]["seq_len"]): t.user_attrs["record"] for t in trials}

    space = load_space(space_file, load_model_config("tiny-llama"), 2, 4 * K)
    front = front_points(study, verified=False)
    by_config: dict[str, list] = {}
    for point in front:
        by_config.setdefault(str(asked_of(point.trial)), []).append(point)
    for points in by_config.values():
        config = Techniques.from_dict(asked_of(points[0].trial), 8)
        longest = max(points, key=lambda p: p.values)
        length, rate = int(longest.values[0]), longest.values[1]
        for neighbour in space.neighbours(config, 8, faster_only=True):
            record = known.get((str(neighbour.to_dict()), length))
            if record is None:  # not evaluated there: out of memory at a shorter length, or a length it cannot run
                shorter = [r for (c, s), r in known.items() if c == str(neighbour.to_dict()) and s < length]
                can_run = length % (neighbour.ulysses_degree * neighbour.ring_degree) == 0
                assert not can_run or any(r["status"] == "oom" for r in shorter), (neighbour, length)
                continue
            assert record["status"] != "ok" or ResultRecord.from_dict(record).tokens_per_s <= rate, (neighbour, length)

    best = best_point(study, 4 * K)  # and the best's neighbours either way, at the target (the headroom rule)
    for neighbour in space.neighbours(Techniques.from_dict(asked_of(best.trial), 8), 8):
        shorter = [r for (c, s), r in known.items() if c == str(neighbour.to_dict()) and s <= 4 * K]
        assert any(r["status"] == "oom" or r["seq_len"] == 4 * K for r in shorter), neighbour

    again = run_cli(*args, env=POLISHED)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "polish: " not in again.stderr  # every neighbour is a trial of the study already
    assert len(finished_trials(optuna.load_study(study_name=summary.study_name, storage=study._storage))) == len(trials)
