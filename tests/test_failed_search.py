"""A failure says why (issue 35, item 3): a search whose trials all fail exits 1 with the first full error text and,
as the last line of stderr, how many failed and the most common cause with its count; ``estimate`` and ``trial``
end stderr with the line that explains a failure, not the first line of a long error (a validation error's first
line only says that something is invalid). A search whose trials all ran out of memory keeps its message: the
longest that fits and the memory that bound it.

The failing model: tiny-llama with a ``pad_token_id`` outside its vocabulary. It passes every check before a trace
(transformers' config class only warns), and the embedding refuses it when the trial code builds the model. (A
config transformers' own validation refuses, such as a string ``rms_norm_eps``, is bad input before any trial:
``tests/test_config.py``.) Long, several-line error texts and the line that explains them: ``root_cause``'s tests
below."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from conftest import ROOT

from autotune.core.hardware import load_hardware
from autotune.core.record import ResultRecord
from autotune.outputs import report
from autotune.search.front import root_cause, what_failed
from autotune.search.job import SearchJob
from trials.models.config import load_model_config
from trials.stack.techniques import BASELINE

AUTOTUNE = Path(sys.executable).with_name("autotune")  # the console script pip installed
CAUSE = "AssertionError: Padding_idx must be within num_embeddings"


def autotune(*args: str) -> subprocess.CompletedProcess:
    assert AUTOTUNE.is_file(), f"{AUTOTUNE} is not installed (pip install -e .)"
    return subprocess.run(
        [str(AUTOTUNE), *args],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
        env={**os.environ, "AUTOTUNE_PLAN_CACHE": "off"},
    )


def last_line(done: subprocess.CompletedProcess) -> str:
    return [line for line in done.stderr.splitlines() if line.strip()][-1]


@pytest.fixture(scope="module")
def failing_model(tmp_path_factory) -> Path:
    config = json.loads((ROOT / "trials/models/presets/tiny-llama.json").read_text())
    path = tmp_path_factory.mktemp("model") / "config.json"
    path.write_text(json.dumps({**config, "pad_token_id": config["vocab_size"] + 10}))
    return path


def test_a_search_whose_trials_all_fail_says_why(tmp_path, failing_model):
    out = tmp_path / "out"
    done = autotune(
        "search", "--model", str(failing_model), "--gpus", "1", "--backend", "plan", "--hardware", "cpu",
        "--target", "4K", "--trials", "6", "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert last_line(done) == f"autotune: all 6 trials failed; 6 with: {CAUSE}", done.stderr[-3000:]
    above = done.stderr[: done.stderr.rindex("autotune: all 6")]
    first = above[above.rindex("\ntrial ") + 1 :]  # the first trial's full error text, above the count
    assert first.startswith("trial 0 ended error: AssertionError"), above[-3000:]
    assert 'File "' in first and "Padding_idx" in first  # the whole record, traceback tail too
    assert (out / "trials.parquet").is_file() and not (out / "best.json").exists()


def test_estimate_ends_with_the_line_that_explains_the_failure(failing_model):
    done = autotune(
        "estimate", "--model", str(failing_model), "--gpus", "1", "--hardware", "cpu", "--seq", "1K",
        "--config", "baseline", "--json",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert json.loads(done.stdout)["status"] == "error"  # the whole record is still printed
    assert last_line(done) == f"autotune: the prediction failed: {CAUSE}", done.stderr[-3000:]


def test_trial_ends_with_the_line_that_explains_the_failure(failing_model):
    done = autotune(
        "trial", "--model", str(failing_model), "--gpus", "1", "--memory-gib", "1", "--seq", "1K",
        "--config", "baseline", "--json",
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert last_line(done) == f"autotune: the trial ended error: rank 0: {CAUSE}", done.stderr[-3000:]


def _error(exc: BaseException) -> str:
    """A record's error text as the backends write it: the message, then the tail of the traceback."""
    import traceback

    text = "".join(traceback.format_exception(exc))
    return f"{type(exc).__name__}: {exc}\n{text[-1500:]}"


def _raised(make) -> BaseException:
    try:
        make()
    except Exception as exc:
        return exc
    raise AssertionError("nothing raised")


def test_the_root_cause_of_error_texts():
    from pydantic import BaseModel

    class Zero(BaseModel):
        stage: int

    pydantic_error = _error(_raised(lambda: Zero(stage="three")))
    assert root_cause(pydantic_error) == (
        "ValidationError: 1 validation error for Zero: stage: Input should be a valid integer, unable to parse "
        "string as an integer"
    )

    def chained():
        try:
            {}["rope_type"]
        except KeyError as exc:
            raise ValueError("rope_scaling is invalid:\n    KeyError: 'rope_type'") from exc

    chained_error = _error(_raised(chained))
    assert root_cause(chained_error) == "ValueError: rope_scaling is invalid: KeyError: 'rope_type'"
    assert root_cause(f"rank 0: {chained_error}") == f"rank 0: {root_cause(chained_error)}"
    output = '\n--- last lines of the trial\'s output ---\n  File "x.py", line 1\nOSError: a symptom'
    assert root_cause(f"rank 1: {chained_error}{output}") == f"rank 1: {root_cause(chained_error)}"
    assert root_cause("trial exceeded its 60 s deadline; last output:\nstep 3\nKeyError: 1") == (
        "trial exceeded its 60 s deadline"
    )
    summary = 'rank 0: tracked 9 bytes > capacity 8 bytes\n  File "step.py", line 3, in step\nRuntimeError: a symptom'
    assert root_cause(summary) == "rank 0: tracked 9 bytes > capacity 8 bytes"  # the record's own first line
    assert root_cause("predicted out of memory: 9 bytes > capacity 8 bytes") == (
        "predicted out of memory: 9 bytes > capacity 8 bytes"
    )
    assert root_cause(None) == root_cause("  ") == "no cause recorded"


def _study(tmp_path, records: list[dict]) -> tuple[SearchJob, optuna.Study]:
    """A finished plan study of ``records`` (one trial each), and its job."""
    study = optuna.create_study(
        directions=["maximize", "maximize"], study_name="s", storage=f"sqlite:///{tmp_path / 'study.db'}"
    )
    for fields in records:
        techniques = fields.pop("techniques", BASELINE.to_dict())
        record = ResultRecord(source="predicted", **fields)
        study.add_trial(
            optuna.trial.create_trial(
                values=[float(record.seq_len), record.tokens_per_s or 0.0],
                user_attrs={"techniques": techniques, "record": record.to_dict(), "answered_by": "plan"},
            )
        )
    job = SearchJob(
        model="tiny-llama",
        model_config=load_model_config("tiny-llama"),
        target=4096,
        gpus=1,
        hardware=load_hardware("cpu").with_memory_gib(0.001),
        space=None,
        backend=None,
        out=tmp_path,
        trials=len(records),
    )
    return job, study


OOM = {"status": "oom", "peak_device_bytes": 2**30, "breakdown": {"activations": 2**29, "params": 2**20}}


def test_an_all_oom_search_keeps_its_message(tmp_path):
    job, study = _study(tmp_path, [dict(OOM, seq_len=1024), dict(OOM, seq_len=2048)])
    assert what_failed(study) is None
    assert report.write_outputs(job, study)["message"] == (
        "no config reached the target 4,096 tokens; the longest that fits is 0 tokens; the shortest OOM "
        "(1,024 tokens, trial 0) was dominated by activations (0.5 GiB)"
    )


FIT = {"status": "ok", "tokens_per_s": 100.0, "peak_device_bytes": 3 * 2**28, "breakdown": {"params": 2**28}}
CHECKPOINTED = {**BASELINE.to_dict(), "activation_checkpointing": True}


def test_the_message_names_what_bound_the_longest_fit_not_the_shortest_oom(tmp_path):
    """The plain config is out of memory at 1K; the checkpointed one fits at 2K and is out of device memory at
    3K, where its activations hold the most: that wall is the answer, not the plain config's OOM."""
    records = [
        dict(OOM, seq_len=1024),
        dict(FIT, seq_len=2048, techniques=CHECKPOINTED),
        dict(OOM, seq_len=3072, techniques=CHECKPOINTED, breakdown={"activations": 2**28, "params": 2**29}),
    ]
    job, study = _study(tmp_path, records)
    assert report.write_outputs(job, study)["message"] == (
        "no config reached the target 4,096 tokens; the longest that fits is 2,048 tokens; the longest fit (trial 1) "
        "runs out of device memory at 3,072 tokens (trial 2), most of it params (0.5 GiB)"
    )


def test_a_longest_fit_bound_by_the_host_says_so(tmp_path):
    host_oom = {"status": "oom", "host_bytes": 3 * 2**30, "error": "predicted host memory 1 bytes per rank > the "
                "node's 0 bytes per device (host out of memory)", "breakdown": {"activations": 2**20}}  # fmt: skip
    records = [dict(FIT, seq_len=2048, techniques=CHECKPOINTED), dict(host_oom, seq_len=3072, techniques=CHECKPOINTED)]
    job, study = _study(tmp_path, records)
    assert report.write_outputs(job, study)["message"].endswith(
        "the longest fit (trial 0) runs out of host memory at 3,072 tokens (trial 1), 3.0 GiB per rank on the host"
    )


def test_a_longest_fit_never_tried_longer_gives_its_own_peak(tmp_path):
    job, study = _study(tmp_path, [dict(FIT, seq_len=2048), dict(OOM, seq_len=1024, techniques=CHECKPOINTED)])
    assert report.write_outputs(job, study)["message"].endswith(
        "the longest fit (trial 0) was not tried longer; its device peak there is 0.8 GiB, most of it params (0.2 GiB)"
    )


def test_a_search_with_some_failures_names_their_cause_last(tmp_path):
    failed = {"status": "error", "error": "KeyError: 'nope'\n  File \"m.py\", line 3\nKeyError: 'nope'"}
    job, study = _study(tmp_path, [dict(OOM, seq_len=1024), dict(failed, seq_len=2048), dict(failed, seq_len=512)])
    message = report.write_outputs(job, study)["message"]
    assert message.startswith("no config reached the target 4,096 tokens; the longest that fits is 0 tokens;")
    assert message.endswith("; 2 of 3 trials failed, 2 with: KeyError: 'nope'")


def test_an_all_failed_study_counts_the_most_common_cause(tmp_path):
    slow = {"status": "timeout", "error": "trial exceeded its 60 s deadline; last output:\nstep 1"}
    broken = {"status": "error", "error": "rank 0: KeyError: 'nope'\n  File \"m.py\", line 3\nKeyError: 'nope'"}
    job, study = _study(tmp_path, [dict(slow, seq_len=512), dict(broken, seq_len=1024), dict(broken, seq_len=2048)])
    lines = report.write_outputs(job, study)["message"].splitlines()
    assert lines[0] == "trial 1 ended error: rank 0: KeyError: 'nope'"  # the most common cause's first trial
    assert lines[-1] == (
        "autotune: all 3 trials failed (1 with other causes: the error column of trials.parquet); "
        "2 with: rank 0: KeyError: 'nope'"
    )
