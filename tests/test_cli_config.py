"""What a user sees of ``--config`` (issue 35): the config file supplies model, GPUs, nodes, hardware and length to
every command that takes it; an option overrides it and says so in one line; a ``--model`` of another architecture
is refused naming both, unless ``--other-model``. And of a search folder: each target's best is kept; and of
``autotune models``: parameter counts in a unit that fits. The trial, ``models`` and the search beside its model
folder run as the installed ``autotune`` as a user runs it; the estimates, the other searches and the refusals run
in-process (``conftest.here``: the console script's own entry point, ``autotune.cli.main``), as
a fresh interpreter each would import torch again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, here, tiny_plan_search

from autotune.core.sizes import format_count

AUTOTUNE = Path(sys.executable).with_name("autotune")  # the console script pip installed
# two ranks, a short sequence, on the cpu preset: what `trial` runs on this machine
SMALL = {
    "schema": "autotune/config-v1",
    "model": "tiny-llama",
    "hardware": "cpu",
    "gpus": 2,
    "seq_len": 512,
    "techniques": {"ulysses_degree": 2, "activation_checkpointing": True, "attention": "sdpa"},
}
# a llama3-8b best.json: offloads 32 layers, which only a 32-layer model has
LLAMA3_8B = {
    "schema": "autotune/config-v1",
    "model": "llama3-8b",
    "hardware": "h100-sxm",
    "gpus": 8,
    "seq_len": 5242880,
    "techniques": {
        "fsdp": True,
        "ulysses_degree": 8,
        "activation_checkpointing": True,
        "activation_offload_layers": 32,
        "attention": "flash",
    },
}


def autotune(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    assert AUTOTUNE.is_file(), f"{AUTOTUNE} is not installed (pip install -e .)"
    return subprocess.run(
        [str(AUTOTUNE), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ)
    )


def stderr_lines(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.strip()]


def assert_exit(done, code: int) -> None:
    assert done.returncode == code, f"exit {done.returncode}, not {code}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("configs")
    paths = {}
    for name, doc in (("small", SMALL), ("llama3-8b", LLAMA3_8B)):
        path = root / f"{name}.json"
        path.write_text(json.dumps(doc))
        paths[name] = str(path)
    return paths


def test_an_option_over_the_config_says_so_in_one_line(configs):
    done = here("estimate", "--config", configs["small"], "--gpus", "4", "--seq", "1K", "--json")
    assert_exit(done, 0)
    lines = stderr_lines(done)
    assert "autotune: --gpus 4 overrides the config's 2" in lines, done.stderr[-3000:]
    assert "autotune: --seq 1K overrides the config's 512" in lines, done.stderr[-3000:]
    record = json.loads(done.stdout)
    assert record["seq_len"] == 1024 and "x4" in record["device"], record
    # what the config file says is taken as it is, without a word: no override
    same = here("estimate", "--config", configs["small"], "--model", "tiny-llama", "--gpus", "2", "--json")
    assert_exit(same, 0)
    assert not [line for line in stderr_lines(same) if "overrides" in line], same.stderr[-3000:]
    assert json.loads(same.stdout)["seq_len"] == 512  # the config's length: --seq is optional with a config file


def test_attention_names_the_kernel_over_the_config_and_the_baseline(configs):
    """A windowed model on a GPU preset: the baseline's sdpa runs windows on the CPU only, and ``--attention`` names a
    kernel that runs them; over a config file's kernel it says so in one line."""
    baseline = ["estimate", "--config", "baseline", "--model", "tiny-mistral", "--seq", "8K", "--gpus", "1", "--json"]
    refused = here(*baseline)
    assert_exit(refused, 2)
    assert "attention 'sdpa' runs sliding windows" in stderr_lines(refused)[0]
    done = here(*baseline, "--attention", "flash")
    assert_exit(done, 0)
    assert json.loads(done.stdout)["status"] == "ok"
    over = here("estimate", "--config", configs["llama3-8b"], "--attention", "flash3", "--json")
    assert_exit(over, 0)
    assert "autotune: --attention flash3 overrides the config's flash" in stderr_lines(over), over.stderr[-3000:]
    unknown = here(*baseline, "--attention", "flash9")
    assert_exit(unknown, 2)
    assert stderr_lines(unknown) == ["autotune: error: --attention 'flash9' must be one of sdpa, flash, flash3, flash4"]


@pytest.mark.parametrize(
    "command, model, config",
    [
        ("estimate", "qwen3-32b", "llama3-8b"),  # another model type and shape: was a 334 GiB OOM, exit 0
        ("estimate", "tiny-llama", "llama3-8b"),  # was "activation_offload_layers 32 must be between 0 and 4"
        ("trial", "tiny-qwen3", "small"),
    ],
)
def test_a_model_of_another_architecture_is_refused_naming_both(configs, command, model, config):
    done = here(command, "--model", model, "--config", configs[config])
    assert_exit(done, 2)
    lines = stderr_lines(done)
    assert len(lines) == 1 and done.stdout == "", done.stderr
    file_model = {"llama3-8b": "llama3-8b", "small": "tiny-llama"}[config]
    assert f"--model {model} " in lines[0] and f"config's model {file_model} " in lines[0], lines[0]
    assert "--other-model" in lines[0], lines[0]


def test_other_model_runs_the_configs_techniques_on_that_model(configs):
    done = here("estimate", "--model", "tiny-qwen3", "--config", configs["small"], "--other-model", "--json")
    assert_exit(done, 0)
    notice = [line for line in stderr_lines(done) if "--other-model" in line]
    assert len(notice) == 1 and "tiny-llama" in notice[0] and "tiny-qwen3" in notice[0], done.stderr[-3000:]
    record = json.loads(done.stdout)
    assert record["status"] == "ok" and record["seq_len"] == 512 and "x2" in record["device"], record
    # the model is tiny-qwen3: its parameters, as the baseline on tiny-qwen3 holds them (no knob here shards them)
    own = here(
        "estimate",
        "--model",
        "tiny-qwen3",
        "--config",
        "baseline",
        "--gpus",
        "2",
        "--seq",
        "512",
        "--hardware",
        "cpu",
        "--json",
    )
    assert_exit(own, 0)
    assert record["breakdown"]["params"] == json.loads(own.stdout)["breakdown"]["params"]


def test_trial_takes_the_gpus_and_the_length_from_the_config(configs):
    """The issue's command: it used to run one rank ("ulysses_degree 2 does not divide the GPU count 1") and,
    without --seq, to ask for it."""
    done = autotune("trial", "--model", "tiny-llama", "--config", configs["small"], "--steps", "1")
    assert_exit(done, 0)
    assert "tiny-llama x2 (measured)" in done.stdout, done.stdout
    assert "512" in next(line for line in done.stdout.splitlines() if "seq_len" in line), done.stdout
    assert not [line for line in stderr_lines(done) if "overrides" in line], done.stderr[-3000:]


def test_models_lists_parameter_counts_in_a_unit_that_fits():
    done = autotune("models")
    assert_exit(done, 0)
    rows = {line.split()[1]: line for line in done.stdout.splitlines() if line.startswith("│")}
    assert "1.75 M" in rows["tiny-llama"] and "1.05 M" in rows["tiny-qwen3"], done.stdout
    assert "8.03 B" in rows["llama3-8b"] and "70.55 B" in rows["llama3-70b"], done.stdout
    assert "0.00" not in done.stdout, done.stdout
    assert [format_count(n) for n in (0, 994, 999_999, 1_754_240, 8_030_261_248)] == [
        "0",
        "994",
        "1.00 M",
        "1.75 M",
        "8.03 B",
    ]


@pytest.mark.slow
def test_a_search_for_another_target_keeps_each_targets_best(tmp_path):
    """best.json is the latest search's; another target's best, searched in the same folder, is kept beside it as
    best-<target>.json (until a search for that target writes best.json again)."""
    out = tmp_path / "out"

    def search(target: str) -> dict:
        done = here(
            "search",
            *tiny_plan_search(target),
            "--trials",
            "3",
            "--out",
            str(out),
        )
        assert_exit(done, 0)
        return json.loads((out / "best.json").read_text())

    best_4k = search("4K")
    assert not list(out.glob("best-*.json"))
    best_2k = search("2K")
    assert json.loads((out / "pareto.json").read_text())["target"] == 2048
    assert best_2k["seq_len"] >= 2048
    assert json.loads((out / "best-4K.json").read_text()) == best_4k
    assert search("4K") == best_4k  # the 4K study resumed: its best is best.json again, the 2K one kept
    assert json.loads((out / "best-2K.json").read_text()) == best_2k
    assert sorted(p.name for p in out.glob("best*.json")) == ["best-2K.json", "best.json"]


def test_a_best_json_searched_with_a_relative_model_folder_loads_from_any_folder(tmp_path):
    """``--model tiny`` beside the folder: best.json records the folder absolute, so ``estimate --config`` of it
    runs from another folder (a relative path would be unknown there)."""
    from tests.model_families import save, tiny_configs

    searched = tmp_path / "a"
    save(tiny_configs()["tiny-qwen2"], searched / "tiny")
    args = [*tiny_plan_search("2K")[2:], "--trials", "2", "--out", "s"]
    done = subprocess.run(
        [str(AUTOTUNE), "search", "--model", "tiny", *args], capture_output=True, text=True, cwd=searched, timeout=600
    )
    assert_exit(done, 0)
    best = searched / "s" / "best.json"
    assert json.loads(best.read_text())["model"] == str((searched / "tiny").resolve())
    elsewhere = tmp_path / "b"
    elsewhere.mkdir()
    estimate = subprocess.run(
        [str(AUTOTUNE), "estimate", "--config", "../a/s/best.json", "--json"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        timeout=600,
    )
    assert_exit(estimate, 0)
    assert json.loads(estimate.stdout)["status"] == "ok"
