"""``trials.train`` as a trainer someone runs for days: pretrained weights in, resumable checkpoints out, a schedule,
a log, a Hugging Face folder at the end. Every run is a fresh process, as a user (or torchrun) starts it; the model
is the tiny-llama preset that the tests save with ``transformers`` (bf16 files, trained in fp32)."""

from __future__ import annotations

import json
import math
import resource
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.train_harness import (
    RECIPE,
    SEQ_LEN,
    STEPS,
    hf_loss,
    log_of,
    stored_largest,
    summary_of,
    train,
    train_until_killed,
    write_config,
    write_document,
    write_poisoned,
    write_pretrained,
    write_windows,
)
from tests.train_harness import first_window as window_of

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too


def losses_match(resumed: list[dict], reference: list[dict], rel: float) -> None:
    assert [e["step"] for e in resumed] == [e["step"] for e in reference]
    for mine, theirs in zip(resumed, reference):
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=rel), mine["step"]
        assert mine["lr"] == pytest.approx(theirs["lr"], rel=1e-12), mine["step"]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A pretrained tiny model (saved by transformers in bf16), a repeated document, and the run configs."""
    folder = tmp_path_factory.mktemp("train")
    write_pretrained(folder / "pretrained")
    write_document(folder / "document.parquet")
    write_config(folder / "one.json")
    write_config(folder / "ulysses.json", gpus=2, ulysses_degree=2)
    write_config(folder / "dp.json", gpus=2)
    return folder


def first_window(work: Path) -> torch.Tensor:
    return window_of(work / "document.parquet")


@pytest.fixture(scope="module")
def uninterrupted(work) -> list[dict]:
    """The reference run: 1 rank, 50 steps of fine-tuning on the document, checkpoints at 25 and 50, the model
    exported at the end."""
    done = train(
        1,
        "--config",
        "one.json",
        "--init",
        "pretrained",
        "--data",
        "document.parquet",
        *RECIPE,
        "--save",
        "reference",
        "--save-every",
        "25",
        "--export-hf",
        "exported",
        "--log-file",
        "reference.jsonl",
        cwd=work,
    )
    summary_of(done)
    return log_of(work / "reference.jsonl")


@pytest.mark.slow
def test_step_one_loss_with_init_is_transformers_loss_and_the_log_has_every_key(work, uninterrupted):
    assert uninterrupted[0]["loss"] == pytest.approx(hf_loss(work / "pretrained", first_window(work)), rel=1e-5)
    assert [e["step"] for e in uninterrupted] == list(range(1, STEPS + 1))
    keys = {"step", "loss", "lr", "grad_norm", "tokens_per_s", "peak_device_gib", "host_gib", "elapsed_s"}
    assert all(keys <= set(entry) for entry in uninterrupted)
    lrs = [e["lr"] for e in uninterrupted]
    assert lrs[0] == 0 and lrs[10] == pytest.approx(1e-3)  # transformers' warmup starts at 0, peaks at step 11
    assert lrs[-1] == pytest.approx(1e-4, rel=0.05) and all(a >= b for a, b in zip(lrs[10:], lrs[11:]))  # cosine


@pytest.mark.slow
def test_fine_tuning_on_a_repeated_document_lowers_its_loss(work, uninterrupted):
    before = hf_loss(work / "pretrained", first_window(work))
    after = hf_loss(work / "exported", first_window(work))
    assert after < before - 1.0, (before, after)  # nats: far beyond what a wrong update's noise moves


@pytest.mark.slow
def test_the_exported_folder_loads_and_holds_the_trained_weights(work, uninterrupted):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    dcp_to_torch_save(work / "reference" / "step-00000050", work / "final.pt")
    trained = {
        name.removeprefix("lm."): tensor
        for name, tensor in torch.load(work / "final.pt", weights_only=False)["model"].items()
    }
    exported = AutoModelForCausalLM.from_pretrained(work / "exported", dtype=torch.float32).state_dict()
    assert set(exported) == set(trained)
    for name, tensor in exported.items():
        assert torch.equal(tensor, trained[name]), name
    pretrained = AutoModelForCausalLM.from_pretrained(work / "pretrained", dtype=torch.float32).state_dict()
    assert not torch.equal(pretrained["model.norm.weight"], exported["model.norm.weight"])  # it trained


@pytest.mark.slow
def test_a_run_killed_after_its_second_checkpoint_resumes_to_the_same_losses(work, uninterrupted):
    args = ["--config", "one.json", "--init", "pretrained", "--data", "document.parquet", *RECIPE]
    args += ["--save", "killed", "--save-every", "10", "--keep", "2", "--log-file", "killed.jsonl"]
    assert train_until_killed(1, *args, cwd=work, after="step-00000020") == -signal.SIGKILL
    assert not (work / "killed" / f"step-{STEPS:08d}").exists()  # it did not finish
    done = train(1, *args, "--resume", cwd=work)
    summary_of(done)
    assert "resumed from killed/step-00000020" in done.stdout
    losses_match(log_of(work / "killed.jsonl"), uninterrupted, rel=1e-6)
    kept = sorted(p.name for p in (work / "killed").iterdir())
    assert kept == ["step-00000040", "step-00000050"]  # --keep 2, nothing partial left


@pytest.mark.slow
def test_a_two_rank_ulysses_run_starts_at_transformers_loss_and_resumes_on_one_rank(work, uninterrupted):
    args = ["--init", "pretrained", "--data", "document.parquet", *RECIPE, "--save", "two", "--save-every", "10"]
    args += ["--log-file", "two.jsonl"]
    assert train_until_killed(2, "--config", "ulysses.json", *args, cwd=work, after="step-00000020") < 0
    two_rank = log_of(work / "two.jsonl")
    assert two_rank[0]["loss"] == pytest.approx(hf_loss(work / "pretrained", first_window(work)), rel=1e-5)
    done = train(1, "--config", "one.json", *args, "--resume", cwd=work)
    summary_of(done)
    assert "saved on 2 ranks" in done.stdout
    losses_match(log_of(work / "two.jsonl")[20:], uninterrupted[20:], rel=1e-6)


@pytest.mark.slow
def test_accumulation_equals_data_parallel_ranks_and_loading_holds_a_shard_and_one_tensor(work):
    """Two sequences per step on 1 rank train as 2 data-parallel ranks with one each (the same windows); loading
    the pretrained folder on 2 FSDP ranks holds at most rank 0's shards and buffers plus the largest tensor."""
    common = ["--init", "pretrained", "--data", "document.parquet", "--steps", "3", "--lr", "1e-3"]
    accumulated = summary_of(
        train(1, "--config", "one.json", *common, "--accumulate", "2", "--log-file", "acc.jsonl", cwd=work)
    )
    parallel = summary_of(train(2, "--config", "dp.json", *common, "--log-file", "dp.jsonl", cwd=work))
    losses_match(log_of(work / "acc.jsonl"), log_of(work / "dp.jsonl"), rel=1e-6)
    assert accumulated["world_size"] == 1 and parallel["world_size"] == 2
    largest, _ = stored_largest(work / "pretrained" / "model.safetensors")  # as stored
    loading = parallel["init_load"]
    everything = accumulated["init_load"]["shard_bytes"]
    assert loading["shard_bytes"] < 0.55 * everything  # rank 0 holds half the model
    # the rotary buffers' construction allocates a few bytes besides
    assert loading["peak_bytes"] <= loading["shard_bytes"] + largest + 1024, (loading, largest)


# -- what fails, and how --------------------------------------------------------------------------------------------


def one_line_exit_2(done: subprocess.CompletedProcess, fragment: str) -> None:
    assert done.returncode == 2, done.stderr[-3000:]
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert len(lines) == 1 and fragment in lines[0], done.stderr[-3000:]


@pytest.fixture(scope="module")
def diverging(work) -> Path:
    """A model whose embedding of token 4000 is nan, and 4 windows of tokens below 4000, but for one 4000 in the
    third window (step 3 reads it, as its first sequence), in ``poisoned.parquet``; ``clean.parquet`` without it."""
    poison = 4000
    write_poisoned(work / "pretrained", work / "poisoned-model", poison)
    write_windows(work / "poisoned.parquet", 4, token_at=(poison, 2 * (SEQ_LEN + 1) + 10))
    write_windows(work / "clean.parquet", 4)
    return work


@pytest.mark.slow
def test_a_nan_loss_at_step_3_stops_the_run_with_exit_1_and_resumes_from_step_2(diverging, tmp_path):
    """The run stops at step 3 with exit 1 naming the step and the values; steps 1 and 2 were checkpointed and
    logged, step 3 neither; resumed on clean data, step 3's loss is that of a clean run from the start."""
    common = ["--config", str(diverging / "one.json"), "--init", str(diverging / "poisoned-model"), "--lr", "1e-3"]
    saving = ["--save", "ck", "--save-every", "1", "--log-file", "log.jsonl"]
    done = train(1, *common, "--data", str(diverging / "poisoned.parquet"), "--steps", "4", *saving, cwd=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "DivergenceError: training diverged at step 3: the loss is nan and the gradient norm is nan; the step was not "
        "applied and the newest checkpoint, ck/step-00000002, is from before it (--resume continues from it)"
    )
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000001", "step-00000002"]
    assert [e["step"] for e in log_of(tmp_path / "log.jsonl")] == [1, 2]

    clean = ["--data", str(diverging / "clean.parquet"), "--steps", "3"]
    resumed = train(1, *common, *clean, *saving, "--resume", cwd=tmp_path)
    summary_of(resumed)
    assert "resumed from ck/step-00000002 (step 2" in resumed.stdout
    reference = train(1, *common, *clean, "--log-file", "reference.jsonl", cwd=tmp_path)
    summary_of(reference)
    logged, expected = log_of(tmp_path / "log.jsonl"), log_of(tmp_path / "reference.jsonl")
    assert [(e["step"], e["loss"]) for e in logged] == [(e["step"], e["loss"]) for e in expected]


@pytest.mark.slow
def test_autotune_run_says_where_training_diverged_and_exits_1(diverging, tmp_path):
    from tests.conftest import run_cli

    args = ["--config", str(diverging / "one.json"), "--init", str(diverging / "poisoned-model")]
    done = run_cli("run", *args, "--data", str(diverging / "poisoned.parquet"), "--steps", "3")
    said = (
        "DivergenceError: training diverged at step 3: the loss is nan and the gradient norm is nan; the step was not "
        "applied and no checkpoint was written"
    )
    lines = [line for line in done.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "-m trials.train --config" in lines[0], lines  # the training command autotune run starts
    assert lines[1:] == [said, f"autotune: training failed: {said}"], done.stderr[
        -3000:
    ]  # the trainer's, the root cause


@pytest.mark.any_release
@pytest.mark.parametrize(
    "name, said",
    [
        (
            "big-ids.parquet",
            "big-ids.parquet: token 9 (document 1, position 4) is id 4096, outside the model's vocabulary [0, 4096)",
        ),
        ("empty.parquet", "empty.parquet: the file is empty (0 bytes)"),
        ("no-documents.parquet", "no-documents.parquet: holds no documents (the column 'input_ids' has no rows)"),
    ],
)
def test_the_trainer_refuses_a_data_file_it_cannot_use_before_building_a_model(work, tmp_path, name, said):
    """``python -m trials.train`` reads the whole ``--data`` file before it builds a model (each rank does, under
    torchrun): one line naming the file and the problem, exit 2, no traceback, no step."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"input_ids": [[1] * 5, [2] * 4 + [4096] + [3] * 600]}), tmp_path / "big-ids.parquet")
    (tmp_path / "empty.parquet").write_bytes(b"")
    pq.write_table(pa.table({"input_ids": pa.array([], type=pa.list_(pa.int64()))}), tmp_path / "no-documents.parquet")
    done = train(1, "--config", str(work / "one.json"), "--data", name, cwd=tmp_path)
    one_line_exit_2(done, f"trials.train: error: {said}")
    assert "Traceback" not in done.stderr and "step " not in done.stdout


@pytest.mark.any_release
def test_resume_without_a_checkpoint_is_bad_input(work):
    done = train(1, "--config", "one.json", "--save", "empty", "--resume", cwd=work)
    one_line_exit_2(done, "no complete checkpoint in 'empty'")


@pytest.mark.any_release
def test_init_from_another_model_or_a_checkpoint_missing_a_tensor_is_bad_input(work, tmp_path):
    from safetensors.torch import load_file, save_file

    from trials.hf import pretrained_problem
    from trials.models.config import load_model_config

    # a config may name the folder itself as its model
    assert pretrained_problem(work / "pretrained", load_model_config(str(work / "pretrained"))) is None
    assert pretrained_problem(work / "pretrained", load_model_config("tiny-llama")) is None
    other = json.loads((work / "pretrained" / "config.json").read_text())
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps({**other, "intermediate_size": 256}))
    done = train(1, "--config", str(work / "one.json"), "--init", "other", cwd=tmp_path)
    one_line_exit_2(done, "is not the model the config was tuned for")

    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "config.json").write_text((work / "pretrained" / "config.json").read_text())
    weights = load_file(work / "pretrained" / "model.safetensors")
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, tmp_path / "partial" / "model.safetensors")
    done = train(1, "--config", str(work / "one.json"), "--init", "partial", cwd=tmp_path)
    one_line_exit_2(done, "has no tensor 'model.layers.1.mlp.up_proj.weight'")


@pytest.mark.any_release
def test_resuming_a_finished_run_says_there_is_nothing_to_train(work, tmp_path):
    args = ["--config", str(work / "one.json"), "--steps", "2", "--save", "ck"]
    summary_of(train(1, *args, cwd=tmp_path))
    done = train(1, *args, "--resume", "--export-hf", "exported", cwd=tmp_path)
    summary = summary_of(done)
    said = [line for line in done.stdout.splitlines() if line.startswith("nothing to train")]
    assert said == ["nothing to train: the run is at step 2 and --steps 2 is its total (a larger --steps trains on)"]
    assert not any(line.startswith("step ") for line in done.stdout.splitlines()) and summary["first_loss"] is None
    assert (tmp_path / "exported" / "config.json").is_file()  # a finished run's model still exports


@pytest.mark.slow
def test_a_full_disk_while_saving_keeps_the_previous_checkpoint_and_exits_1(work, tmp_path):
    """Checkpoints fit until the process may write no file over the size of a small one (RLIMIT_FSIZE: the write
    fails, EFBIG, as it does on a full disk with ENOSPC)."""
    args = ["--config", str(work / "one.json"), "--steps", "2", "--save", "ck", "--save-every", "1"]
    summary_of(train(1, *args, cwd=tmp_path))
    biggest = max(f.stat().st_size for f in (tmp_path / "ck" / "step-00000002").iterdir())

    def small_files_only():
        resource.setrlimit(resource.RLIMIT_FSIZE, (biggest // 2, resource.RLIM_INFINITY))

    done = train(1, *args[:3], "4", *args[4:], "--resume", cwd=tmp_path, preexec_fn=small_files_only)
    assert done.returncode == 1, done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("CheckpointSaveError: could not save the checkpoint of step 3 in ck: rank 0: "), last
    assert "GiB free on its disk" in last
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step-00000001", "step-00000002"]
    resumed = train(1, *args[:3], "4", *args[4:], "--resume", cwd=tmp_path)
    assert "resumed from ck/step-00000002" in resumed.stdout and summary_of(resumed)["steps"] == 4


@pytest.mark.any_release
def test_autotune_run_passes_the_trainers_options_and_refuses_bad_ones_before_launching(work, tmp_path):
    from tests.conftest import run_cli

    config = str(work / "one.json")
    done = run_cli(
        "run",
        "--config",
        config,
        "--steps",
        "2",
        "--init",
        str(work / "pretrained"),
        "--save",
        str(tmp_path / "ck"),
        "--log-file",
        str(tmp_path / "log.jsonl"),
        "--tensorboard",
        str(tmp_path / "tb"),
    )
    assert summary_of(done)["init_load"]["shard_bytes"] > 0  # trained from the folder
    logged = log_of(tmp_path / "log.jsonl")
    assert [e["step"] for e in logged] == [1, 2]
    assert (tmp_path / "ck" / "step-00000002" / "trainer_state.json").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert losses == [(e["step"], pytest.approx(e["loss"])) for e in logged]
    for args, said in (
        (["--resume", "--save", str(tmp_path / "none")], "no complete checkpoint"),
        (["--init", str(tmp_path)], "is not a Hugging Face model folder"),
        (["--warmup-steps", "x"], "argument --warmup-steps: invalid int value: 'x'"),
    ):
        refused = run_cli("run", "--config", config, *args)
        lines = refused.stderr.strip().splitlines()
        assert refused.returncode == 2 and len(lines) == 1 and said in lines[0], refused.stderr
        assert "trials.train" not in refused.stdout  # refused before the training command was printed


def test_clipping_reads_no_value_before_the_optimizer_step_and_scales_as_torch_does(monkeypatch):
    """A trainer step with the fused AdamW (the GPU's) clips and checks its loss and norm on the device: no value is
    read back (a host sync) between the backward and the optimizer step, the loss and the norm after it, and the
    gradients the optimizer sees are ``torch.nn.utils.clip_grads_with_norm_``'s. lr 0 keeps the weights, so the
    same batch gives the same gradients with and without clipping."""
    from host_syncs import HostSyncs

    from trials import train
    from trials.core.dist import Mesh
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques
    from trials.train import TokenSource, TrainOptions, _step
    from trials.training.step import build_training, forward_backward

    mesh = Mesh.single("cpu")
    config = load_model_config("tiny-llama")
    model, optimizer = build_training(config, Techniques(), mesh, lr=0.0, fused_optimizer=True)
    source = TokenSource(64, config["vocab_size"])
    seen = {}
    real_step = optimizer.step

    def backward(*args, **kwargs):
        loss = forward_backward(*args, **kwargs)
        seen["reads before"] = len(syncs.where)
        return loss

    def step(*args, **kwargs):
        seen["reads"] = syncs.where[seen["reads before"] :]
        seen["grads"] = [p.grad.clone() for p in model.parameters()]
        return real_step(*args, **kwargs)

    optimizer.step = step
    monkeypatch.setattr(train, "forward_backward", backward)
    with HostSyncs() as syncs:
        _, raw_norm = _step(model, optimizer, source, 0, TrainOptions(config="", max_grad_norm=None), mesh, None)
    raw = seen["grads"]
    max_norm = raw_norm / 3
    with HostSyncs() as syncs:
        _, norm = _step(model, optimizer, source, 0, TrainOptions(config="", max_grad_norm=max_norm), mesh, None)
    assert seen["reads"] == [] and norm == raw_norm
    after = syncs.where[seen["reads before"] :]  # what the trainer reads once the optimizer step is queued
    assert len(after) == 2 and all("trials/training/step.py" in where for where in after), after
    reference = [torch.zeros_like(g, requires_grad=True) for g in raw]
    for param, grad in zip(reference, raw):
        param.grad = grad.clone()
    torch.nn.utils.clip_grads_with_norm_(reference, max_norm, torch.tensor(raw_norm))
    assert all(torch.equal(mine, theirs.grad) for mine, theirs in zip(seen["grads"], reference))
    assert not all(torch.equal(mine, theirs) for mine, theirs in zip(seen["grads"], raw))


@pytest.mark.parametrize("fail_at", ["prepare", "finish"])
def test_rank_zero_failing_around_the_writes_fails_the_save_on_every_rank_at_once(tmp_path, fail_at):
    """Rank 0's own steps of an atomic save (making the partial folder; its finish and rename after every rank
    wrote) failing: every rank raises ``CheckpointSaveError`` within seconds, none waits in a barrier until the
    collective timeout (120 s here), and no folder is left under the final name."""
    import multiprocessing
    import queue

    from tests.train_harness import atomic_write_rank

    context = multiprocessing.get_context("spawn")
    outcomes = context.Queue()
    (tmp_path / "save").mkdir()
    final = tmp_path / "save" / "step-00000001"
    args = (str(tmp_path / "store"), str(final), fail_at, outcomes)
    ranks = [context.Process(target=atomic_write_rank, args=(rank, 2, *args)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        said = dict(outcomes.get(timeout=60) for _ in ranks)
    except queue.Empty:
        said = None
    finally:
        for process in ranks:
            process.kill()
            process.join()
    assert said is not None, "a rank is still waiting for rank 0"
    assert all(text.startswith("CheckpointSaveError: could not save the test folder") for text in said.values()), said
    assert not final.exists() and (fail_at == "prepare" or not final.with_name(final.name + ".tmp").exists())


class _MeshMade(Exception):
    pass


@pytest.mark.parametrize(
    "records, step_s",
    [
        ({"predicted": {"status": "ok", "step_time_s": 1000.0}}, 1000.0),
        (
            {"predicted": {"status": "ok", "step_time_s": 1000.0}, "measured": {"status": "ok", "step_time_s": 1500.0}},
            1500.0,
        ),
        ({"predicted": {"status": "oom", "step_time_s": None}}, None),
        ({}, None),
    ],
    ids=["predicted", "measured", "not-ok", "none"],
)
def test_the_trainers_collective_timeout_follows_the_step_time_its_config_records(
    tmp_path, monkeypatch, records, step_s
):
    """A trainer whose steps take longer than torch's 10-minute default gets the trials' rule: 3 steps (measured
    over predicted), never under the default."""
    from trials import train as trainer
    from trials.core.dist import MIN_COLLECTIVE_TIMEOUT_S, STEP_TIME_MARGIN

    path = tmp_path / "config.json"
    config = json.loads(Path(write_config(path)).read_text())
    path.write_text(json.dumps({**config, **records}))
    timeouts = []

    def init_mesh(sp_degree, device=None, timeout_s=None, ring_degree=1):
        timeouts.append(timeout_s)
        raise _MeshMade

    monkeypatch.setattr(trainer, "init_mesh", init_mesh)
    with pytest.raises(_MeshMade):
        trainer.train(trainer.TrainOptions(config=str(path)))
    assert timeouts == [
        max(MIN_COLLECTIVE_TIMEOUT_S, STEP_TIME_MARGIN * step_s) if step_s else MIN_COLLECTIVE_TIMEOUT_S
    ]


def test_ranks_wait_for_a_finish_longer_than_the_collective_timeout_in_short_rounds(tmp_path):
    """Rank 0 alone finishing a save (merging an export's shards) for longer than the group's collective timeout:
    the other ranks wait in short collectives, and the save completes on every rank."""
    import multiprocessing

    from tests.train_harness import atomic_write_rank

    context = multiprocessing.get_context("spawn")
    outcomes = context.Queue()
    final = tmp_path / "step-00000001"
    args = (str(tmp_path / "store"), str(final), "", outcomes, 3.0, 9.0)  # 3 s timeout, 9 s finish
    ranks = [context.Process(target=atomic_write_rank, args=(rank, 2, *args)) for rank in range(2)]
    for process in ranks:
        process.start()
    try:
        said = dict(outcomes.get(timeout=90) for _ in ranks)
    finally:
        for process in ranks:
            process.kill()
            process.join()
    assert said == {0: "ok", 1: "ok"}
    assert sorted(p.name for p in final.iterdir()) == ["part-0", "part-1"]


@pytest.mark.parametrize("fused", [True, False], ids=["fused AdamW", "per-parameter AdamW"])
@pytest.mark.parametrize("poisoned", ["loss", "gradient norm"])
def test_a_step_whose_loss_or_gradient_norm_is_not_finite_changes_no_weight_and_no_optimizer_state(fused, poisoned):
    """A nan loss (an embedding row of a token in the window set to nan) or an inf gradient (a finite loss, one
    gradient overflowed): the trainer's step reads the value and leaves every weight and every AdamW state as the
    last good step left them, with the fused kernel (its ``found_inf``) as with the per-parameter loop."""
    from trials.core.dist import Mesh
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques
    from trials.train import TokenSource, TrainOptions, _step
    from trials.training.step import build_training

    mesh = Mesh.single("cpu")
    config = load_model_config("tiny-llama")
    model, optimizer = build_training(config, Techniques(), mesh, lr=1e-3, fused_optimizer=fused)
    source, options = TokenSource(64, config["vocab_size"]), TrainOptions(config="")
    loss, norm = _step(model, optimizer, source, 0, options, mesh, None)  # a good step: the AdamW states exist
    assert math.isfinite(loss) and math.isfinite(norm)
    params = dict(model.named_parameters())
    if poisoned == "loss":
        with torch.no_grad():
            params["lm.model.embed_tokens.weight"][source.window(1)[5]] = float("nan")
    else:
        params["lm.model.norm.weight"].register_hook(lambda grad: grad * float("inf"))
    weights = {name: param.detach().clone() for name, param in params.items()}
    states = {name: {k: v.clone() for k, v in optimizer.state[param].items()} for name, param in params.items()}

    loss, norm = _step(model, optimizer, source, 1, options, mesh, None)
    assert math.isfinite(loss) == (poisoned != "loss") and not math.isfinite(norm), (loss, norm)
    for name, param in params.items():
        same_bits = torch.equal(param.detach().view(torch.int32), weights[name].view(torch.int32))  # nan too
        assert same_bits and param.grad is None, name
        for key, value in states[name].items():
            assert torch.equal(optimizer.state[param][key], value), (name, key)


# -- packed documents -----------------------------------------------------------------------------------------------

ROW_DOCUMENTS = (100, 1, 60, 200, 40)  # token counts of the rows of documents.parquet: one of 1, one past a window
EOS_DOCUMENTS = (90, 120, 30, 150)  # token counts (each with its EOS) of the stream in eos.parquet


def write_packed_config(path: Path, documents, gpus: int = 1, **techniques) -> str:
    """``write_config``'s config, its estimate made for ``documents`` (the config file's ``documents``)."""
    write_config(path, gpus=gpus, **techniques)
    path.write_text(json.dumps({**json.loads(path.read_text()), "documents": documents}))
    return str(path)


@pytest.fixture(scope="module")
def packed(work) -> Path:
    """documents.parquet (one document per row of ``input_ids``, ``ROW_DOCUMENTS``), eos.parquet (a ``tokens`` stream
    of ``EOS_DOCUMENTS``, each ending in the pretrained model's EOS id) and configs for them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    generator = torch.Generator().manual_seed(3)
    rows = [torch.randint(0, 4096, (n,), generator=generator).tolist() for n in ROW_DOCUMENTS]
    pq.write_table(pa.table({"input_ids": rows}), work / "documents.parquet")
    eos = json.loads((work / "pretrained" / "config.json").read_text())["eos_token_id"]
    stream = [
        token
        for n in EOS_DOCUMENTS
        for token in [*torch.randint(eos + 1, 4096, (n - 1,), generator=generator).tolist(), eos]
    ]
    pq.write_table(pa.table({"tokens": stream}), work / "eos.parquet")
    write_packed_config(work / "eos-config.json", list(EOS_DOCUMENTS))
    write_packed_config(work / "rows-config.json", list(ROW_DOCUMENTS))
    write_packed_config(work / "ulysses-packed.json", list(ROW_DOCUMENTS), gpus=2, ulysses_degree=2)
    write_packed_config(work / "ring-packed.json", list(ROW_DOCUMENTS), gpus=2, ring_degree=2)
    return work


def first_window_pieces(lengths, seq_len: int = SEQ_LEN) -> list[tuple[int, int]]:
    """(start, end) in the stream of each document of window 1, documents cut at the window's end."""
    pieces, start = [], 0
    for n in lengths:
        if start >= seq_len:
            break
        pieces.append((start, min(start + n, seq_len)))
        start += n
    return pieces


def documents_alone_loss(folder: Path, stream: torch.Tensor, pieces) -> float:
    """The mean token loss of ``transformers``' model (fp32, eager) run on each document alone: every document's
    summed loss, over all documents' labelled tokens (a document of one token has none)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    total, labelled = 0.0, 0
    with torch.no_grad():
        for start, end in pieces:
            if end - start < 2:
                continue
            document = stream[start:end][None]
            total += float(model(document, labels=document).loss) * (end - start - 1)
            labelled += end - start - 1
    return total / labelled


def stream_of(path: Path) -> torch.Tensor:
    from trials.training.data import read_token_file

    return read_token_file(str(path), 4096)


@pytest.mark.parametrize(
    "ranks, config, data, documents, flags",
    [
        (1, "one.json", "documents.parquet", ROW_DOCUMENTS, ["--pack"]),
        (1, "eos-config.json", "eos.parquet", EOS_DOCUMENTS, []),  # packed as the config's documents say
        (2, "ulysses-packed.json", "documents.parquet", ROW_DOCUMENTS, ["--pack"]),
        pytest.param(
            2, "ring-packed.json", "documents.parquet", ROW_DOCUMENTS, ["--pack"], marks=pytest.mark.slow
        ),  # the ring splits each document (the per-document zigzag), the one of 1 token padded to 4
    ],
    ids=["rows-pack", "eos-by-config", "rows-ulysses-2", "rows-ring-2"],
)
def test_a_packed_step_ones_loss_is_each_documents_own_loss_and_the_log_counts_documents(
    packed, tmp_path, ranks, config, data, documents, flags
):
    """Documents (rows of ``input_ids``, or a ``tokens`` stream cut after each EOS) packed into the window: step 1's
    loss is that of the plain model on each document alone (position ids restart, no label crosses a boundary, the
    document crossing the window's end cut there), and the log says how many documents the step held. On a ring of
    2 each document is padded to a multiple of 4 tokens, which changes no real token's loss."""
    args = ["--config", str(packed / config), "--init", str(packed / "pretrained"), "--data", str(packed / data)]
    done = train(ranks, *args, *flags, "--steps", "1", "--lr", "1e-3", "--log-file", "log.jsonl", cwd=tmp_path)
    summary_of(done)
    (logged,) = log_of(tmp_path / "log.jsonl")
    stream, padded = stream_of(packed / data), [n + (-n) % 4 for n in documents] if "ring" in config else documents
    if "ring" in config:  # the stream as the trainer pads it; each window's piece of a document, its real tokens
        from trials.training.data import pad_documents

        stream, _, _ = pad_documents(stream, np.cumsum(documents), 4)
        assert done.stderr.count("trials.train: ring_degree 2 splits each packed document into 4 chunks: each is ") == 1
        assert "3 pad tokens in all (0.74% of the stream; no pad is a label or has one)" in done.stderr
    pieces = first_window_pieces(padded)
    real = [(start, min(end, start + n)) for (start, end), n in zip(pieces, documents, strict=False)]
    expected = documents_alone_loss(packed / "pretrained", stream, real)
    assert logged["loss"] == pytest.approx(expected, rel=1e-5)
    assert logged["documents"] == len(pieces)
    assert f"{len(pieces)} documents" in done.stdout
    warned = [line for line in done.stderr.splitlines() if line.startswith("trials.train: warning:")]
    if config == "one.json":  # its estimate was for one document per window
        assert warned == [
            "trials.train: warning: the config's estimate assumed one document per sequence; --data "
            f"{packed / data} packs {len(documents)} documents of {sum(documents) / len(documents):,.0f} tokens on "
            f"average (autotune estimate --documents {packed / data} prices them)"
        ]
    else:
        assert warned == []


def test_no_pack_reads_the_stream_as_before_and_says_the_estimate_assumed_documents(packed, tmp_path):
    """``--no-pack`` trains windows of the stream across documents, as a run without packing does; a config whose
    estimate assumed packed documents is told so in one warning."""
    args = ["--config", str(packed / "rows-config.json"), "--init", str(packed / "pretrained")]
    args += ["--data", str(packed / "documents.parquet"), "--steps", "1", "--log-file", "log.jsonl"]
    done = train(1, *args, "--no-pack", cwd=tmp_path)
    summary_of(done)
    (logged,) = log_of(tmp_path / "log.jsonl")
    window = stream_of(packed / "documents.parquet")[: SEQ_LEN + 1]
    assert logged["loss"] == pytest.approx(hf_loss(packed / "pretrained", window), rel=1e-5)
    assert logged["documents"] == 1
    warned = [line for line in done.stderr.splitlines() if "warning" in line]
    assert warned == [
        f"trials.train: warning: the config's estimate assumed {len(ROW_DOCUMENTS)} documents of "
        f"{sum(ROW_DOCUMENTS) / len(ROW_DOCUMENTS):,.0f} tokens on average; this run trains each window as one "
        "document (--no-pack)"
    ]


def test_packed_windows_cut_documents_at_their_edges_and_wrap_around_the_stream():
    """Window w of a packed stream holds tokens [w * seq, (w + 1) * seq) of the stream read around its end; its
    documents are the stream's, cut at the window's edges."""
    import numpy as np

    from trials.train import TokenSource

    lengths = [2, 5, 1, 5]  # 13 tokens: windows of 4 cross the stream's end, and a document after it
    stream = torch.arange(sum(lengths))
    ends = np.cumsum(lengths)
    source = TokenSource(4, 100, stream=stream, ends=ends)
    owner = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))  # each token's document
    for index in range(12):
        picked = (torch.arange(4) + index * 4) % stream.numel()
        assert torch.equal(source.window(index)[:4], stream[picked])
        runs = torch.unique_consecutive(owner[picked], return_counts=True)[1]
        assert source.documents(index).lengths == tuple(runs.tolist()), index
    assert source.documents_in(0, 3) == sum(len(source.documents(i).lengths) for i in range(3))


SPIKE_BYTES = 2**28  # far above the tiny model's step


def test_the_logged_peak_is_the_steps_not_the_init_loadings(tmp_path, monkeypatch):
    """A peak reached while the --init weights load (here a transient buffer of SPIKE_BYTES on the simulated device)
    is not the peak the steps log: the peak starts over once the model is loaded."""
    from trials import hf, train
    from trials.core.memory import active_tracker

    loaded = hf.from_pretrained

    def from_pretrained_with_a_spike(*args, **kwargs):
        model = loaded(*args, **kwargs)
        assert active_tracker() is not None
        buffer = torch.ones(SPIKE_BYTES, dtype=torch.uint8)  # a transient buffer on the simulated device
        del buffer
        return model

    monkeypatch.setattr(hf, "from_pretrained", from_pretrained_with_a_spike)
    write_pretrained(tmp_path / "pretrained")
    config = write_config(tmp_path / "one.json", fsdp=False)
    options = train.TrainOptions(
        config=config, steps=1, init=str(tmp_path / "pretrained"), log_file=str(tmp_path / "log.jsonl")
    )
    summary = train.train(options, print_fn=lambda *a, **k: None)
    logged = json.loads((tmp_path / "log.jsonl").read_text().splitlines()[0])
    assert summary["init_load"]["peak_bytes"] >= SPIKE_BYTES  # the loading's peak is still reported as such
    assert 0 < summary["peak_device_bytes"] < SPIKE_BYTES, summary
    assert logged["peak_device_gib"] == summary["peak_device_bytes"] / 2**30
