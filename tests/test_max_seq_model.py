"""``--max-seq`` by the length model (``autotune.oracle.lengths``): the same record as the grid probes alone, byte for
byte, on configs whose peak is affine in the length and on one whose peak steps (partial tiles at odd grid
indices); a model that misses falls back to the probes from the points it evaluated and still finds the probes'
answer; ``--json`` says how the answer was found."""

from __future__ import annotations

import json

import pytest
from conftest import run_cli

from autotune.backends import Evaluation
from autotune.backends.plan import PlanBackend
from autotune.core.hardware import load_hardware
from autotune.oracle.lengths import LengthModel
from autotune.search.max_seq import search_max_seq
from trials.models.config import load_model_config
from trials.stack.rules import length_unit
from trials.stack.techniques import Techniques

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

K = 1024


def _evaluation(memory_gib: float, gpus: int = 1, hardware: str = "cpu", **techniques) -> Evaluation:
    hw = load_hardware(hardware).with_memory_gib(memory_gib)
    return Evaluation(load_model_config("tiny-llama"), Techniques(**techniques), 0, gpus, hw)


# walls past the length model's traces (64K, 96K tokens); the tiled config's peak steps off the line at odd grid
# indices (half a norm tile per rank); the flash one's peak bends (another op holds it at 64K than at 128K)
CONFIGS = {
    "tiled, steps between grid points": _evaluation(
        0.47,
        gpus=2,
        fsdp=True,
        ulysses_degree=2,
        activation_checkpointing=True,
        mlp_tile_tokens=4 * K,
        loss_tile_tokens=4 * K,
        norm_tile_tokens=8 * K,
    ),
    "checkpointing": _evaluation(1.7, activation_checkpointing=True, loss_tile_tokens=4 * K),
    "flash, head chunks, offload": _evaluation(
        2.45,
        hardware="h100-sxm",
        gpus=2,
        fsdp=True,
        ulysses_degree=2,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers=2,
        loss_tile_tokens=4 * K,
        attention="flash",
    ),
}
SLOW = {"tiled, steps between grid points"}  # ~30 s on 2 idle cores


def _both(evaluation: Evaluation):
    probes = search_max_seq(evaluation, PlanBackend(throughput=False), length_model=False)
    model = search_max_seq(evaluation, PlanBackend(throughput=False))
    return probes, model


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CONFIGS])
def test_length_model_finds_the_probes_record(name):
    (probes, _), (record, how) = _both(CONFIGS[name])
    assert record.status == "ok" and record.to_dict() == probes.to_dict()
    assert how.method == "length model", how.reason
    # the model's answer and the next grid step, nothing else, were evaluated by the backend
    unit = length_unit(CONFIGS[name].techniques)
    assert how.lengths == [record.seq_len, record.seq_len + unit]


@pytest.mark.any_release
@pytest.mark.parametrize("miss", [-3, 2])
def test_a_missed_guess_falls_back_to_the_probes(monkeypatch, miss):
    """A model whose answer is off (short or long) hands over to the probes from the two lengths it evaluated:
    the answer is still the probes' own."""
    evaluation = CONFIGS["checkpointing"]
    longest = LengthModel.longest
    monkeypatch.setattr(LengthModel, "longest", lambda self, low, top: longest(self, low, top) + miss)
    (probes, _), (record, how) = _both(evaluation)
    assert record.to_dict() == probes.to_dict()
    assert how.method == "probes" and "length model's answer" in how.reason


@pytest.mark.any_release
def test_estimate_max_seq_json_says_how(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": "tiny-llama",
                "hardware": "cpu",
                "gpus": 1,
                "seq_len": 4 * K,
                "techniques": {"activation_checkpointing": True, "loss_tile_tokens": 4 * K},
            }
        )
    )
    answers = {}
    for extra in ([], ["--probes-only"]):
        done = run_cli(
            *"estimate --memory-gib 1.7 --max-seq --json --config".split(),
            str(config),
            *extra,
            env={"AUTOTUNE_CACHE_DIR": str(tmp_path / f"cache{len(extra)}")},
        )
        assert done.returncode == 0, done.stderr
        answers[bool(extra)] = json.loads(done.stdout)
    model, probes = answers[False], answers[True]
    assert model.pop("max_seq_search")["method"] == "length model"
    assert probes.pop("max_seq_search")["method"] == "probes"
    assert model == probes and model["status"] == "ok"
