"""``autotune search --trainer T``: the space holds what T runs (its ``Trainer.expresses``, declared once), every
front config exports to T in full, the most frugal config climbs to T's wall, ``best.json`` prefers headroom
when speed is a wash, and bad input names the knob and the trainer."""

from __future__ import annotations

import json

import optuna
import pytest
from conftest import run_cli, run_judge, tiny_plan_search

from autotune import search
from autotune.backends import Evaluation, make_backend
from autotune.core.hardware import load_hardware
from autotune.core.trainers import TRAINERS, ExportJob
from autotune.search.front import BEST_SPEED_TOLERANCE, best_choice, best_point
from autotune.search.job import SearchJob
from autotune.search.max_seq import find_max_seq
from autotune.search.space import load_space
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

K = 1024


def test_an_arctic_search_holds_only_what_arctic_runs_and_every_front_config_exports(tmp_path, capsys):
    # the search and the export in-process (the CLI's own entry point): a fresh interpreter each would import torch
    # again; ArcticTraining's loader runs in its own
    from autotune.cli import main

    out = tmp_path / "s"
    done = main(["search", *tiny_plan_search("4K"), "--trainer", "arctic", "--trials", "6", "--out", str(out)])
    assert done == 0, capsys.readouterr().err[-2000:]
    front_doc = json.loads((out / "pareto.json").read_text())
    assert front_doc["trainer"] == "arctic"
    assert json.loads((out / "best.json").read_text())["trainer"] == "arctic"
    model_config = load_model_config("tiny-llama")
    arctic = TRAINERS["arctic"]
    for entry in front_doc["front"]:
        techniques = Techniques.from_dict(entry["techniques"])
        job = ExportJob("tiny-llama", model_config, 2, entry["seq_len"], techniques)
        assert arctic.gaps(job) == [], entry["trial"]  # what the front shows is what ArcticTraining runs
        assert techniques.head_chunk is None and techniques.norm_tile_tokens == 0
    exported = main(["export", str(out), "--format", "arctic", "-o", str(tmp_path / "recipe.yaml")])
    assert exported == 0, capsys.readouterr().err
    assert "PARTIAL" not in (tmp_path / "recipe.yaml").read_text()
    # ArcticTraining's own loader takes the recipe (tests/trainer_judges.py), the model folder being tiny-llama's
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({k: v for k, v in model_config.items() if k[0] != "_"}))
    [verdict] = run_judge("arctic", str(model_dir), "2", str(tmp_path / "recipe.yaml"))
    assert verdict["type"] == "causal" and verdict["world_size"] == 2 and verdict["max_length"] >= 4 * K


def test_the_space_for_a_trainer_keeps_one_choice_per_value_it_runs():
    model_config = load_model_config("llama3-8b")
    space = load_space(None, model_config, 8, 1024 * K, trainer=TRAINERS["arctic"])
    assert space.choices["head_chunk"] == [None] and space.choices["norm_tile_tokens"] == [0]
    assert space.choices["mlp_tile_tokens"] == [0, 16 * K]  # off, or tiled at the hidden size
    assert len(space.choices["loss_tile_tokens"]) == 1  # ArcticTraining sizes its loss tiles itself
    runs = space.runs(Techniques(ulysses_degree=8, mlp_tile_tokens=16 * K), 1024 * K)
    assert runs.mlp_tile_tokens == model_config["hidden_size"] and runs.loss_tile_tokens > 0
    every = load_space(None, model_config, 8, 1024 * K)
    assert every.choices["head_chunk"] == [None, 1, 2, 4] and every.choices["norm_tile_tokens"] == [0, 64 * K]


def test_the_frugal_config_is_each_knobs_most_memory_saving_choice():
    space = load_space(None, load_model_config("llama3-8b"), 8, 5 * 1024 * K)
    assert space.frugal(32) == Techniques(
        fsdp=True,
        optimizer_offload=True,
        ulysses_degree=8,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers=32,
        mlp_tile_tokens=16 * K,
        loss_tile_tokens=2 * K,
        norm_tile_tokens=64 * K,
        attention="flash",
    )


def _front_reach(tmp_path, trainer: str, target: int) -> tuple[float, object]:
    """A 20-trial plan search for ``trainer`` (tiny-llama, 2 CPU ranks of 0.5 GiB): (its front's longest length,
    ``--max-seq``'s record of the most frugal config the trainer runs)."""
    model_config = load_model_config("tiny-llama")
    hardware = load_hardware("cpu").with_memory_gib(0.5)
    space = load_space(None, model_config, 2, target, kernels=["sdpa"], trainer=TRAINERS[trainer])
    job = SearchJob(
        model="tiny-llama",
        model_config=model_config,
        target=target,
        gpus=2,
        hardware=hardware,
        space=space,
        backend=make_backend("plan", stop_above=1.0),
        out=tmp_path,
        trials=20,
        workers=1,
    )
    study = search.run(job)
    longest = max((p.values[0] for p in search.front.front_points(study)), default=0.0)
    frugal = space.frugal(model_config["num_hidden_layers"])
    return longest, find_max_seq(Evaluation(model_config, frugal, target, 2, hardware))


@pytest.mark.slow
def test_a_deepspeed_search_reaches_the_wall_of_its_most_frugal_config(tmp_path, monkeypatch):
    """The frugal config is seeded and climbs to its wall even where faster configs hold the front: the front's
    longest point is within 3% of that config's --max-seq (DeepSpeed: no head chunking, no tiled RMSNorm). That
    wall lies past the grid's end (4x the 8K target): the frugal config climbs on beyond it."""
    monkeypatch.setenv("AUTOTUNE_PLAN_CACHE", "off")
    longest, wall = _front_reach(tmp_path, "deepspeed", 8 * K)
    assert wall.status == "ok" and wall.seq_len > 4 * 8 * K
    assert longest >= 0.97 * wall.seq_len, (longest, wall.seq_len)


@pytest.mark.slow
def test_a_trainer_whose_wall_is_below_the_target_finds_that_wall(tmp_path, monkeypatch):
    """accelerate-deepspeed (no tiles, no head chunks): out of memory at the target and the grid's end, the frugal
    config steps down the grid until it fits, then closes in on its wall; the front shows how far it goes. The
    grid reaches down to 8K (a 128K target), past that wall."""
    monkeypatch.setenv("AUTOTUNE_PLAN_CACHE", "off")
    longest, wall = _front_reach(tmp_path, "accelerate-deepspeed", 128 * K)
    assert wall.status == "ok" and wall.seq_len < 128 * K
    assert longest >= 0.97 * wall.seq_len, (longest, wall.seq_len)


def _study_with(points: list[tuple[int, float, float]]) -> optuna.Study:
    """A study of finished trials (seq_len, tokens/s, peak GiB), each with the record a search stores."""
    study = optuna.create_study(directions=["maximize", "maximize"])
    for seq_len, rate, peak_gib in points:
        record = {
            "status": "ok",
            "source": "predicted",
            "seq_len": seq_len,
            "tokens_per_s": rate,
            "peak_device_bytes": int(peak_gib * 2**30),
        }
        study.add_trial(
            optuna.trial.create_trial(
                values=[seq_len, rate], user_attrs={"record": record, "techniques": Techniques().to_dict()}
            )
        )
    return study


def test_best_prefers_headroom_when_speed_is_a_wash():
    study = _study_with([(5_242_880, 372.85, 76.0), (5_242_880, 372.68, 61.2), (5_242_880, 300.0, 30.0)])
    assert best_point(study, 5_242_880).number == 1  # 0.05% slower, 14.8 GiB more margin
    line = best_choice(study, 5_242_880)
    assert "trial 1" in line and "trial 0" in line and "14.8 GiB more headroom" in line
    slower = 372.85 * (1 - BEST_SPEED_TOLERANCE) - 1  # just outside the tolerance: speed wins
    study = _study_with([(5_242_880, 372.85, 76.0), (5_242_880, slower, 61.2)])
    assert best_point(study, 5_242_880).number == 0 and best_choice(study, 5_242_880) is None


def test_an_unknown_trainer_is_one_line_and_exit_2(tmp_path):
    done = run_cli("search", *tiny_plan_search(), "--trainer", "megatron", "--out", str(tmp_path / "s"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "autotune: error: --trainer 'megatron' must be one of autotune, deepspeed, arctic, accelerate"
        + "".join(f", {name}" for name in list(TRAINERS)[4:])
    ]


def test_a_space_file_offering_a_knob_the_trainer_cannot_run_is_one_line_and_exit_2(tmp_path):
    space = tmp_path / "space.yaml"
    space.write_text("knobs:\n  ulysses_degree: [1, 2]\n  head_chunk: [null, 1]\n")
    done = run_cli(
        "search", *tiny_plan_search(), "--trainer", "deepspeed", "--space", str(space), "--out", str(tmp_path / "s")
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--trainer deepspeed cannot run head_chunk [1]" in lines[0], lines
