"""The search's follow-up policy (issue 6): climbing front configs, stepping down in memory at their walls, and
the space helpers it relies on (``SearchSpace.params_for``, ``SearchSpace.memory_steps``)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from autotune import search
from autotune.backends import Backend, Evaluation
from autotune.backends.plan import PlanBackend
from autotune.core.hardware import load_hardware
from autotune.core.record import ResultRecord
from autotune.search.space import DEFAULT_SPACE, SPACES_DIR, load_space
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

ROOT = Path(__file__).resolve().parents[1]
REDUCED = SPACES_DIR / "reduced-tiny.yaml"


@pytest.mark.parametrize(
    "model,gpus,space_path",
    [("llama3-8b", 8, DEFAULT_SPACE), ("tiny-qwen3", 2, DEFAULT_SPACE), ("tiny-llama", 2, REDUCED)],
)
def test_params_for_inverts_sample(model, gpus, space_path):
    """Enqueued params must make ``sample`` give back exactly the config and length they were made from."""
    config = load_model_config(model)
    layers = config["num_hidden_layers"]
    space = load_space(space_path, config, gpus, 4 << 20 if gpus == 8 else 8192)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(300):
        trial = study.ask()
        techniques, seq_len = space.sample(trial, layers)
        params = space.params_for(techniques, seq_len, layers)
        assert params == trial.params
        again = space.sample(optuna.trial.FixedTrial(params), layers)
        assert again == (techniques, seq_len)
        study.tell(trial, 0.0)
    # a config the space cannot express has no params
    outside = replace(techniques, mlp_tile_tokens=12345)
    assert space.params_for(outside, seq_len, layers) is None


def test_memory_steps_change_one_knob_toward_less_memory():
    config = load_model_config("llama3-8b")
    space = load_space(DEFAULT_SPACE, config, 8, 4 << 20)
    layers = config["num_hidden_layers"]
    plain = Techniques(attention="flash")
    steps = space.memory_steps(plain, layers)
    changed = [{k for k, v in s.to_dict().items() if v != plain.to_dict()[k]} for s in steps]
    assert changed == [
        {"fsdp"},
        {"ulysses_degree"},
        {"ring_degree"},  # a ring over the 8 GPUs (Ulysses 1): the sequence split without a Ulysses group
        {"activation_checkpointing"},
        {"mlp_tile_tokens"},
        {"loss_tile_tokens"},
        {"norm_tile_tokens"},
    ]
    assert steps[4].mlp_tile_tokens == max(space.choices["mlp_tile_tokens"])  # the largest tile first
    full = Techniques(
        fsdp=True,
        optimizer_offload=True,
        ulysses_degree=8,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers=layers,
        mlp_tile_tokens=16 << 10,
        loss_tile_tokens=2 << 10,
        norm_tile_tokens=64 << 10,
        attention="flash",
    )
    assert space.memory_steps(full, layers) == []  # nothing left to turn on or shrink
    mid = Techniques(fsdp=True, ulysses_degree=4, activation_checkpointing=True, mlp_tile_tokens=64 << 10)
    steps = {
        frozenset(k for k, v in s.to_dict().items() if v != mid.to_dict()[k]): s
        for s in space.memory_steps(mid, layers)
    }
    assert steps[frozenset({"ulysses_degree"})].ulysses_degree == 8
    assert steps[frozenset({"head_chunk"})].head_chunk == 4  # the next smaller chunk than all 8 local heads
    assert steps[frozenset({"activation_offload_layers"})].activation_offload_layers == layers
    assert steps[frozenset({"mlp_tile_tokens"})].mlp_tile_tokens == 16 << 10
    assert all(space.params_for(s, 4 << 20, layers) is not None for s in steps.values())


def test_memory_steps_need_less_memory_by_the_oracle():
    """Each step from the plain config really lowers the predicted peak (tiny-llama, 2 ranks, 8K tokens: twice the 4K tiles)."""
    config = load_model_config("tiny-llama")
    space = load_space(REDUCED, config, 2, 8192, kernels=["sdpa"])
    hardware = load_hardware("cpu")
    backend = PlanBackend(throughput=False)
    plain = Techniques(fsdp=True)

    def peak(techniques):
        record = backend.evaluate(Evaluation(config, techniques, 8192, 2, hardware))
        assert record.status == "ok", record.error
        return record.peak_device_bytes

    base = peak(plain)
    steps = space.memory_steps(plain, config["num_hidden_layers"])
    assert len(steps) == 4  # ulysses 2, checkpointing, MLP tile, loss tile (fsdp is already on)
    for step in steps:
        assert peak(step) < base, step


class SyntheticBackend(Backend):
    """An analytic stand-in for the plan backend: each technique multiplies the per-token memory and the speed
    by a fixed factor, so the exhaustive front is known exactly and cheaply."""

    name = "plan"
    MEMORY = {
        "activation_checkpointing": 0.45,
        "mlp_tile_tokens": 0.8,
        "loss_tile_tokens": 0.7,
        "ulysses_degree": 0.55,
        "head_chunk": 0.8,
    }
    SPEED = {
        "activation_checkpointing": 0.75,
        "mlp_tile_tokens": 0.97,
        "loss_tile_tokens": 0.98,
        "ulysses_degree": 0.8,
        "head_chunk": 0.75,
    }
    CAPACITY = 2500.0

    def __init__(self):
        self.calls = []

    def factors(self, techniques: Techniques, table: dict) -> float:
        value = 1.0
        for knob, factor in table.items():
            on = getattr(techniques, knob)
            if on > 1 if knob == "ulysses_degree" else bool(on):
                value *= factor
        return value

    def evaluate(self, evaluation: Evaluation) -> ResultRecord:
        self.calls.append((evaluation.techniques, evaluation.seq_len))
        t, length = evaluation.techniques, evaluation.seq_len
        peak = 1000.0 * length / 2048 * self.factors(t, self.MEMORY)
        rate = 1e7 / length * self.factors(t, self.SPEED)
        fits = peak <= self.CAPACITY
        return ResultRecord(
            status="ok" if fits else "oom",
            source="predicted",
            seq_len=length,
            tokens_per_s=rate if fits else None,
            peak_device_bytes=int(peak),
        )


def _job(tmp_path, backend, trials, follow_ups=True):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = load_model_config("tiny-llama")
    space = load_space(REDUCED, config, 2, 8192, kernels=["sdpa"])
    hardware = load_hardware("cpu").with_memory_gib(SyntheticBackend.CAPACITY / 2**30)
    return search.SearchJob(
        model="tiny-llama",
        model_config=config,
        target=8192,
        gpus=2,
        hardware=hardware,
        space=space,
        backend=backend,
        out=tmp_path,
        trials=trials,
        seed=0,
        follow_ups=follow_ups,
    )


def _front(points):
    return sorted(p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points))


def test_follow_ups_climb_and_step_down(tmp_path):
    backend = SyntheticBackend()
    job = _job(tmp_path, backend, trials=22)
    study = search.run(job)
    trials = search.finished_trials(study)
    assert len(trials) == 22
    by_number = {t.number: t for t in trials}
    lens = job.space.seq_lens
    follow = [t for t in trials if "follow_up_of" in t.user_attrs]
    assert len(follow) >= 10
    climbs = steps = walls = 0
    for trial in follow:
        origin = by_number[trial.user_attrs["follow_up_of"]]
        record, before = trial.user_attrs["record"], origin.user_attrs["record"]
        same = [  # what the study knew of this config when the follow-up was queued (its origin just ended)
            t.user_attrs["record"]
            for t in trials
            if t.number <= origin.number and t.user_attrs["techniques"] == trial.user_attrs["techniques"]
        ]
        fits = max((r["seq_len"] for r in same if r["status"] == "ok"), default=0)
        if record["seq_len"] not in lens:
            assert trial.user_attrs["techniques"] == origin.user_attrs["techniques"]
            ooms = [r["seq_len"] for r in same if r["status"] == "oom" and r["seq_len"] > fits]
            if ooms:  # a wall step: the same config between its longest fit and its shortest OOM, off the grid
                assert fits < record["seq_len"] < min(ooms)
                walls += 1
            else:  # past the grid's end: the most frugal config at twice its longest fit
                assert Techniques.from_dict(trial.user_attrs["techniques"]) == job.space.frugal(4)
                assert record["seq_len"] > lens[-1]
        elif trial.user_attrs["techniques"] == origin.user_attrs["techniques"]:
            # a climb: the same config at the next grid length past the longest it is known to fit
            assert before["status"] == "ok"
            assert record["seq_len"] == min(s for s in lens if s > fits)
            climbs += 1
        else:
            # a memory step: one knob more at the length where the origin ran out of memory
            assert before["status"] == "oom" and record["seq_len"] == before["seq_len"]
            old, new = (
                Techniques.from_dict(origin.user_attrs["techniques"]),
                Techniques.from_dict(trial.user_attrs["techniques"]),
            )
            assert new in job.space.memory_steps(old, 4)
            steps += 1
        assert trial.user_attrs["answered_by"] == "plan"  # never a point the study already knew
    assert climbs >= 3 and steps >= 3 and walls >= 1
    # every backend call was a new point
    assert len(backend.calls) == len({(t, s) for t, s in backend.calls})


def test_follow_ups_find_the_exhaustive_front(tmp_path):
    """On the synthetic problem, 10% of the grid with follow-ups recovers the exhaustive front's hypervolume far
    better than TPE alone with the same seeds and budget."""
    import math

    probe = _job(tmp_path / "grid", SyntheticBackend(), trials=1)
    space = probe.space
    grid = []
    for fsdp, degree, ckpt, mlp, loss in itertools.product(
        *(
            space.choices[k]
            for k in ("fsdp", "ulysses_degree", "activation_checkpointing", "mlp_tile_tokens", "loss_tile_tokens")
        )
    ):
        for chunk in space.head_chunks(degree) if degree > 1 else [None]:
            grid.append(
                Techniques(
                    fsdp=fsdp,
                    ulysses_degree=degree,
                    head_chunk=chunk,
                    activation_checkpointing=ckpt,
                    mlp_tile_tokens=mlp,
                    loss_tile_tokens=loss,
                )
            )
    oracle = SyntheticBackend()
    points = [
        (s, r.tokens_per_s)
        for t in grid
        for s in space.seq_lens
        if (r := oracle.evaluate(Evaluation(probe.model_config, t, s, 2, probe.hardware))).status == "ok"
    ]

    def hypervolume(found):
        ref, area, best = math.log2(space.seq_lens[0]) - 1, 0.0, 0.0
        for seq, rate in sorted(_front(found), key=lambda p: -p[0]):
            if rate > best:
                area, best = area + (math.log2(seq) - ref) * (rate - best), rate
        return area

    budget = round(0.1 * len(grid) * len(space.seq_lens))
    ratios = {}
    for follow in (True, False):
        study = search.run(_job(tmp_path / str(follow), SyntheticBackend(), budget, follow))
        found = [(int(t.values[0]), t.values[1]) for t in search.pareto_front(study)]
        ratios[follow] = hypervolume(found) / hypervolume(points)
    assert ratios[True] >= 0.95, ratios
    assert ratios[True] > ratios[False], ratios


def test_over_packed_documents_the_seeds_run_a_kernel_the_trainer_masks_them_with(tmp_path):
    """DeepSpeed masks packed documents with FlashAttention-2 only: a search for it over 64K documents seeds FA2,
    where one document per sequence (or autotune's runner, which masks with every kernel) seeds the fastest, FA3."""
    from autotune.core.trainers import TRAINERS
    from autotune.search.job import SearchJob
    from autotune.search.policy import seed_kernel
    from trials.kernels.documents import ONE, DocumentsSpec

    model_config, hardware = load_model_config("llama3-8b"), load_hardware("h100-sxm")

    def seeded(trainer: str, documents) -> str:
        space = load_space(None, model_config, 8, 1024**2, trainer=TRAINERS[trainer])
        job = SearchJob("llama3-8b", model_config, 1024**2, 8, hardware, space, None, tmp_path, 1, documents=documents)
        return seed_kernel(job)

    packed = DocumentsSpec((64 * 1024,))
    assert seeded("deepspeed", packed) == "flash"
    assert seeded("deepspeed", ONE) == seeded("autotune", packed) == "flash3"


def test_over_several_nodes_every_layout_is_seeded_and_climbed(tmp_path):
    """4 nodes x 8 GPUs, Llama-3-8B (8 KV heads: Ulysses past 8 replicates them): Ulysses 8 x ring 4, 16 x 2 and
    32 over every GPU each get their most frugal config, seeded at the target and at the grid's end and climbed to
    its wall (``_is_frugal``); one node has no layout beside its frugal config."""
    from autotune.search.job import SearchJob
    from autotune.search.policy import _is_frugal, search_frugals, seed_params
    from trials.stack.rules import split_unit

    model_config, hardware = load_model_config("llama3-8b"), load_hardware("h100-sxm")
    target, layers = 25 * 1024**2, model_config["num_hidden_layers"]
    space = load_space(None, model_config, 32, target)
    assert space.layouts(32, 8) == [(8, 4), (16, 2), (32, 1)]
    assert load_space(None, model_config, 8, target).layouts(8, 8) == []
    job = SearchJob("llama3-8b", model_config, target, 8, hardware, space, None, tmp_path, 30, nodes=4)
    frugals = search_frugals(job)
    assert {(f.ulysses_degree, f.ring_degree) for f in frugals} >= {(8, 4), (16, 2), (32, 1)}
    seeds = seed_params(job)
    for frugal in frugals:
        assert _is_frugal(job, frugal)
        unit = split_unit(frugal.ulysses_degree, frugal.ring_degree)
        lengths = [s for s in space.seq_lens if s % unit == 0]
        at_target = min(s for s in lengths if s >= target)
        for length in (at_target, lengths[-1]):
            assert space.params_for(frugal, length, layers) in seeds, (frugal, length)
        assert frugal.fsdp and frugal.activation_checkpointing  # every other knob at its most frugal
