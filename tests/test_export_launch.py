"""How the ``accelerate`` export's scripts (``.train.py``, ``.trainer.py``) and ``trials.hf`` start the process group:
with the config's Ulysses and ring degrees, and a collective timeout above the config's step time
(``trials.core.dist.collective_timeout_s``, as trials and ``trials.train`` use) where torch's 600 s default would let
NCCL's watchdog abort a longer step. Each script's ``main`` runs in this process up to ``init_mesh``, which records
its arguments and stops it there."""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
from conftest import ROOT

from trials.core.dist import MIN_COLLECTIVE_TIMEOUT_S, collective_timeout_s, init_mesh
from trials.stack.techniques import Techniques
from trials.training.config_file import TrialConfig

STEP_TIME_S = 1000.0  # a predicted step past torch's 600 s default
TECHNIQUES = Techniques(fsdp=True, ulysses_degree=2, ring_degree=2)


class MeshStarted(Exception):
    """Raised by the recording ``init_mesh``: the caller stops where the process group would start."""


@pytest.fixture
def started(monkeypatch):
    """A recording ``init_mesh`` and what each call asked for (its arguments by name, defaults filled in); the
    allocator settings are left as they are (the scripts apply them before the mesh)."""
    from trials.core import allocator

    calls = []

    def record(*args, **kwargs):
        bound = inspect.signature(init_mesh).bind(*args, **kwargs)
        bound.apply_defaults()
        calls.append(dict(bound.arguments))
        raise MeshStarted

    monkeypatch.setattr(allocator, "configure", lambda: "")
    record.calls = calls
    return record


def test_the_hf_plugin_starts_its_group_with_the_timeout_it_is_given(started, monkeypatch):
    from trials import hf

    monkeypatch.setattr(hf, "init_mesh", started)
    with pytest.raises(MeshStarted):
        hf.apply(object(), TECHNIQUES, timeout_s=1800.0)
    with pytest.raises(MeshStarted):
        hf.from_pretrained("no-folder", TECHNIQUES, timeout_s=2400.0)
    with pytest.raises(MeshStarted):
        hf.from_pretrained("no-folder", TECHNIQUES)
    asked = [(c["sp_degree"], c["ring_degree"], c["timeout_s"]) for c in started.calls]
    assert asked == [(2, 2, 1800.0), (2, 2, 2400.0), (2, 2, MIN_COLLECTIVE_TIMEOUT_S)]


@pytest.mark.parametrize(
    "suffix, argv",
    [(".train.py", ["--model", "no-folder"]), (".trainer.py", ["--model", "no-folder", "--output-dir", "out"])],
)
def test_each_exported_script_starts_its_group_with_the_ring_and_a_timeout_above_the_predicted_step(
    started, monkeypatch, tmp_path, suffix, argv
):
    from autotune.outputs.exporters.accelerate_config import AccelerateConfigExporter

    config = TrialConfig(
        model="tiny-llama",
        techniques=TECHNIQUES,
        hardware="cpu",
        gpus=4,
        seq_len=2048,
        predicted={"status": "ok", "source": "predicted", "step_time_s": STEP_TIME_S},
    )
    rendered = AccelerateConfigExporter().render(config, [], str(tmp_path / "run.yaml"))
    script = tmp_path / f"run{suffix}"
    script.write_text(rendered.companions[suffix])
    spec = importlib.util.spec_from_file_location(f"exported_{suffix.strip('.').replace('.', '_')}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "init_mesh", started)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(MeshStarted):
        module.main(argv)
    assert collective_timeout_s(STEP_TIME_S) > MIN_COLLECTIVE_TIMEOUT_S
    [call] = started.calls
    assert (call["sp_degree"], call["ring_degree"]) == (2, 2)
    assert call["timeout_s"] == collective_timeout_s(STEP_TIME_S)


def test_a_ulysses_and_ring_config_in_one_process_names_the_launch_it_needs():
    """``hf.apply`` of a config with Ulysses 2 x ring 2 in a script started as one process: one line saying how
    many processes to launch and how (``init_mesh``), not only that the ranks are missing."""
    import subprocess
    import sys

    code = "from trials.core.dist import init_mesh; init_mesh(2, ring_degree=2)"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert done.returncode != 0
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "needs 4 ranks, have 1: launch 4 processes: accelerate launch --multi_gpu --num_processes 4 your_train.py "
            "(or torchrun --nproc-per-node 4)"
        )
    ), done.stderr[-2000:]
