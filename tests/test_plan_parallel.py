"""The main job in under a minute (issue 21): plan records from worker processes and from the on-disk store are
exactly the records of a direct evaluation; a search on several workers is exactly the search in one process;
a 4-layer copy stops as soon as its extension cannot fit; wall steps reach a config's --max-seq."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import optuna
import pytest

from autotune import search
from autotune.backends import Evaluation
from autotune.backends.plan import PlanBackend
from autotune.backends.plan_store import PlanStore
from autotune.backends.pool import PooledBackend
from autotune.core.hardware import load_hardware
from autotune.search.max_seq import find_max_seq
from autotune.search.policy import WALL_TOLERANCE
from autotune.search.space import SPACES_DIR, WALL_PARAM, load_space
from trials.models.config import load_model_config
from trials.stack.rules import length_unit
from trials.stack.techniques import Techniques

K = 1024
REDUCED = SPACES_DIR / "reduced-tiny.yaml"


def model(layers=None):
    config = dict(load_model_config("tiny-llama"))
    if layers:
        config["num_hidden_layers"] = layers
    return config


def evaluation(config, seq=2 * K, gpus=2, memory_gib=0.5, host_gib=None, **techniques):
    hardware = load_hardware("cpu").with_memory_gib(memory_gib)
    if host_gib is not None:
        hardware = replace(hardware, host_memory_bytes_per_device=int(host_gib * 2**30))
    return Evaluation(config, Techniques(**techniques), seq, gpus, hardware)


def _points(config):
    return [
        evaluation(config, seq=4 * K, fsdp=True, ulysses_degree=2, activation_checkpointing=True),
        evaluation(
            config, seq=8 * K, fsdp=True, ulysses_degree=2, activation_checkpointing=True, loss_tile_tokens=2 * K
        ),
        evaluation(config, seq=16 * K),  # far over: stopped at the crossing
        evaluation(config, seq=2 * K, ulysses_degree=3),
    ]  # invalid: an error record


def test_pooled_records_are_the_direct_records():
    config = model(layers=6)
    points = _points(config)
    direct = PlanBackend(stop_above=1.0)
    with PooledBackend(direct.options(), workers=2) as pooled:
        pooled.prefetch(points[1:])  # start on the others while the first is asked for
        got = [pooled.evaluate(p) for p in points]
    assert [r.to_dict() for r in got] == [direct.evaluate(p).to_dict() for p in points]
    assert {r.status for r in got} == {"ok", "oom", "error"}
    assert pooled.stats["asked"] == 4


def test_an_evaluation_that_kills_its_worker_twice_is_an_error_record_and_the_pool_goes_on(monkeypatch):
    from autotune.backends.pool import DIE_AT_ENV

    config = model()
    monkeypatch.setenv(DIE_AT_ENV, str(4 * K))
    killer, fine = evaluation(config, seq=4 * K), evaluation(config, seq=2 * K)
    with PooledBackend(PlanBackend(stop_above=1.0).options(), workers=1) as pooled:
        record = pooled.evaluate(killer)
        assert record.status == "error" and "died twice" in record.error
        assert pooled.evaluate(fine).status == "ok"  # a new worker answers the next question


def test_stored_records_are_the_direct_records(tmp_path):
    """Whole records answer any stop they stay below; a stopped record answers only its own stop."""
    config = model(layers=6)
    points = _points(config)
    for stop in (1.0, None):
        first, again = (
            PlanBackend(stop_above=stop, store=PlanStore(tmp_path)),
            PlanBackend(stop_above=stop, store=PlanStore(tmp_path)),
        )
        direct = PlanBackend(stop_above=stop)
        for point in points:
            expected = direct.evaluate(point).to_dict()
            assert first.evaluate(point).to_dict() == expected
            assert again.evaluate(point).to_dict() == expected, (stop, point.seq_len)
            if expected["status"] != "error":
                assert again.last_prediction is None  # read back, not traced
    # the unstopped trace of the far-over point was kept whole: it does not answer a request that stops
    stopped = PlanBackend(stop_above=1.0, store=PlanStore(tmp_path)).evaluate(points[2])
    assert stopped.to_dict() == PlanBackend(stop_above=1.0).evaluate(points[2]).to_dict()
    assert "trace stopped" in stopped.error


def test_a_store_of_other_code_is_not_read(tmp_path, monkeypatch):
    config = model()
    point = _points(config)[0]
    PlanBackend(store=PlanStore(tmp_path)).evaluate(point)
    import autotune.backends.plan_store as plan_store

    monkeypatch.setattr(plan_store, "code_digest", lambda: "another-version")
    fresh = PlanBackend(store=PlanStore(tmp_path))
    fresh.evaluate(point)
    assert fresh.last_prediction is not None  # traced again


def test_the_deeper_copy_stops_when_its_extension_cannot_fit():
    """3-layer copy fits, the model does not: the 4-layer copy stops early, same verdict as the whole trace, and
    the lower bound it gives lies between capacity and the whole peak. The same for host memory."""
    config = model(layers=8)
    ev = evaluation(
        config, seq=4 * K, memory_gib=None, fsdp=True, activation_checkpointing=True, activation_offload_layers=8
    )
    whole_backend = PlanBackend(throughput=False)
    whole = whole_backend.evaluate(ev)
    three = whole_backend.last_prediction.traces[0]
    for fraction in (0.9, 0.99):  # the device: capacity between the 3-layer copy's peak and the model's
        capacity = int(three.peak_device_bytes + fraction * (whole.peak_device_bytes - three.peak_device_bytes))
        hw = replace(ev.hardware, device_memory_bytes=capacity)
        full, stopping = PlanBackend(throughput=False), PlanBackend(throughput=False, stop_above=1.0)
        a, b = full.evaluate(replace(ev, hardware=hw)), stopping.evaluate(replace(ev, hardware=hw))
        assert a.status == b.status == "oom"
        prediction = stopping.last_prediction
        assert len(prediction.traces) == 2 and prediction.traces[1].stopped and prediction.stop_reason == "device"
        assert capacity < b.peak_device_bytes <= a.peak_device_bytes
        assert "extended to 8 layers" in b.error
    host = whole.host_bytes
    for fraction in (0.9, 1.01):  # the host: offloaded activations against the node's RAM per device
        hw = replace(ev.hardware, host_memory_bytes_per_device=int(host * fraction))
        a = PlanBackend(throughput=False).evaluate(replace(ev, hardware=hw))
        stopping = PlanBackend(throughput=False, stop_above=1.0)
        b = stopping.evaluate(replace(ev, hardware=hw))
        assert a.status == b.status == ("ok" if fraction > 1 else "oom")
        if b.status == "oom":
            assert stopping.last_prediction.stop_reason == "host" and "host" in b.error
            assert hw.host_memory_bytes_per_device < b.host_bytes <= a.host_bytes
        else:
            assert b.to_dict() == a.to_dict()


def test_wall_params_round_trip_and_survive_a_requeue():
    config = model()
    space = load_space(REDUCED, config, 2, 8 * K, kernels=["sdpa"])
    techniques = Techniques(fsdp=True, ulysses_degree=2, activation_checkpointing=True)
    between = space.seq_lens[3] + 1 * K  # 6144 < 7168 < 8192
    assert between not in space.seq_lens
    params = space.params_for(techniques, between, config["num_hidden_layers"])
    assert params[WALL_PARAM] == between and params["seq_len"] == space.seq_lens[3]
    assert space.point_of(params, config["num_hidden_layers"]) == (techniques, between)
    study = optuna.create_study(directions=["maximize", "maximize"])
    study.enqueue_trial(params)
    trial = study.ask()
    assert space.sample(trial, config["num_hidden_layers"]) == (techniques, between)
    # a killed or interrupted trial is queued again with its params (study.reap_dead_trials): the same point
    study.enqueue_trial(study._storage.get_trial(trial._trial_id).params)
    again = study.ask()
    assert space.sample(again, config["num_hidden_layers"]) == (techniques, between)


def _job(tmp_path: Path, trials: int, workers: int, target: int = 8 * K, memory_gib: float = 0.5):
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = model()
    hardware = load_hardware("cpu").with_memory_gib(memory_gib)
    space = load_space(REDUCED, config, 2, target, kernels=["sdpa"])
    return search.SearchJob(
        model="tiny-llama",
        model_config=config,
        target=target,
        gpus=2,
        hardware=hardware,
        space=space,
        backend=PlanBackend(stop_above=1.0),
        out=tmp_path,
        trials=trials,
        seed=0,
        workers=workers,
    )


def _trials(study):
    return [
        (t.number, t.params, t.user_attrs["record"], t.user_attrs["answered_by"], t.user_attrs.get("follow_up_of"))
        for t in search.finished_trials(study)
    ]


@pytest.mark.slow
def test_a_search_on_two_workers_is_the_search_in_one_process(tmp_path, monkeypatch):
    """Same trials in the same order with the same records (and the follow-up queue's order with them)."""
    monkeypatch.setenv("AUTOTUNE_PLAN_CACHE", "off")
    one = search.run(_job(tmp_path / "one", trials=8, workers=1))
    job = _job(tmp_path / "two", trials=8, workers=2)
    two = search.run(job)
    assert _trials(two) == _trials(one)
    assert len(_trials(two)) == 8 and any(follow_up is not None for *_, follow_up in _trials(two))
    assert job.stats["asked"] > 0 and job.stats["ready"] + job.stats["running"] > 0  # it did look ahead


@pytest.mark.slow
def test_wall_steps_take_the_front_to_max_seq(tmp_path, monkeypatch):
    """The front's longest point is within WALL_TOLERANCE (or one length unit) of its config's --max-seq (a 16K
    target: the grid reaches 64K, past the 0.3 GiB walls; the front's longest point lies off the grid, between
    two of its lengths)."""
    monkeypatch.setenv("AUTOTUNE_PLAN_CACHE", "off")
    # in one process: a pool's search is this search (the test above), less the interpreters it spawns
    job = _job(tmp_path, trials=22, workers=1, target=16 * K, memory_gib=0.3)
    study = search.run(job)
    longest = search.pareto_front(study)[0]
    techniques = Techniques.from_dict(longest.user_attrs["techniques"])
    wall = find_max_seq(Evaluation(job.model_config, techniques, int(longest.values[0]), job.gpus, job.hardware))
    assert wall.status == "ok" and wall.seq_len < job.space.seq_lens[-1]  # the wall is inside the grid
    assert longest.params.get(WALL_PARAM) == int(longest.values[0])  # a wall step found it
    assert int(longest.values[0]) not in job.space.seq_lens
    unit = math.lcm(length_unit(techniques), techniques.ulysses_degree)
    assert longest.values[0] <= wall.seq_len
    assert longest.values[0] >= min(wall.seq_len * (1 - WALL_TOLERANCE), wall.seq_len - unit)


def test_a_ctrl_c_while_a_worker_spawns_waits_for_the_spawn(monkeypatch):
    """Ctrl-C during ``submit`` (which may spawn a worker) is held until the submit returns, then raised: a spawn
    cut off half-way would print the new interpreter's traceback on the user's terminal."""
    import os
    import signal
    from concurrent.futures import Future, ProcessPoolExecutor

    from autotune.backends import pool as pool_module

    submitted = []

    def interrupted_submit(self, fn, *args):
        os.kill(os.getpid(), signal.SIGINT)  # arrives mid-submit
        submitted.append(fn)  # not reached if the interrupt were raised here
        return Future()

    monkeypatch.setattr(ProcessPoolExecutor, "submit", interrupted_submit)
    # the held interrupt goes to the handler there was: Python's own here, whatever an earlier test or library
    # installed in this process
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    backend = pool_module.PooledBackend({}, workers=1)
    try:
        with pytest.raises(KeyboardInterrupt):
            backend._submit(evaluation(model()), guess=False)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(submitted) == 1
    backend.close()
