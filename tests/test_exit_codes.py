"""Exit codes that tell the truth (issue 18), README's "Exit codes" table: the installed ``autotune`` executable, run
as a user or a job scheduler runs it (a fresh process), exits 0 when it did what was asked; 1 when it ran but the
outcome is a failure (the cause on the last line of stderr); 2 for bad input (one line on stderr, no traceback); 130
when interrupted (outputs saved) -- for every command."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import ROOT

AUTOTUNE = Path(sys.executable).with_name("autotune")  # the console script pip installed
PLAN = ["--model", "tiny-llama", "--gpus", "1", "--backend", "plan", "--hardware", "cpu"]
TECHNIQUES = {"ulysses_degree": 1, "activation_checkpointing": True, "attention": "sdpa"}


def autotune(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    assert AUTOTUNE.is_file(), f"{AUTOTUNE} is not installed (pip install -e .)"
    return subprocess.run(
        [str(AUTOTUNE), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def stderr_lines(done) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.strip()]


def assert_exit(done, code: int, last_line: str | None = None) -> None:
    """``done`` exited ``code``, never with a traceback, its last stderr line containing ``last_line``."""
    assert done.returncode == code, f"exit {done.returncode}, not {code}:\n{done.stderr[-3000:]}"
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    if last_line is not None:
        assert last_line in stderr_lines(done)[-1], done.stderr[-3000:]


def assert_bad_input(done, fragment: str) -> None:
    assert_exit(done, 2, fragment)
    assert len(stderr_lines(done)) == 1, done.stderr
    assert done.stdout == ""


def write_config(path: Path, model: str = "tiny-llama", seq_len: int = 512, gpus: int = 1) -> Path:
    path.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": model,
                "hardware": "cpu",
                "gpus": gpus,
                "seq_len": seq_len,
                "techniques": TECHNIQUES,
                "predicted": None,
                "measured": None,
            }
        )
    )
    return path


def unbuildable_model(folder: Path) -> Path:
    """A config.json that passes every check before launching but that transformers cannot build (its activation
    does not exist): a prediction or a training that fails while it runs."""
    config = json.loads((ROOT / "trials/models/presets/tiny-llama.json").read_text())
    path = folder / "unbuildable-config.json"
    path.write_text(json.dumps({**config, "hidden_act": "no-such-activation"}))
    return path


@pytest.fixture(scope="module")
def reached(tmp_path_factory):
    """A plan search that reaches its target (tiny-llama at 1K, 4 GiB per rank): exit 0 and a best.json."""
    out = tmp_path_factory.mktemp("reached") / "out"
    done = autotune("search", *PLAN, "--target", "1K", "--memory-gib", "4", "--trials", "4", "--out", str(out))
    return out, done


# --- search ---------------------------------------------------------------------------------------------------------


def test_search_that_reaches_its_target_exits_0(reached):
    out, done = reached
    assert_exit(done, 0)
    assert json.loads((out / "best.json").read_text())["seq_len"] >= 1024


def test_search_that_reaches_no_config_exits_1_without_best_json(tmp_path):
    out = tmp_path / "out"
    done = autotune("search", *PLAN, "--target", "4K", "--memory-gib", "0.001", "--trials", "3", "--out", str(out))
    assert_exit(done, 1, "no config reached the target 4,096 tokens")
    assert not (out / "best.json").exists()
    assert (out / "trials.parquet").is_file() and (out / "pareto.json").is_file()  # the outputs are still written


def test_search_bad_input_exits_2(tmp_path):
    assert_bad_input(
        autotune("search", *PLAN, "--target", "4K", "--timeout", "-5", "--out", str(tmp_path)),
        "Invalid value for '--timeout': must be above 0 seconds, got -5",
    )


def _point(trial) -> dict:
    """The params a trial was queued with, then those it sampled: the point it evaluates."""
    return {**trial.system_attrs.get("fixed_params", {}), **trial.params}


def _trials(out: Path):
    storage = f"sqlite:///{out / 'study.db'}"
    (name,) = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


def _wait_for_a_running_trial(out: Path, process: subprocess.Popen, timeout_s: float = 300) -> None:
    """Until the study holds a finished trial and one RUNNING (the search is inside a trial)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert process.poll() is None, "the search ended before it could be interrupted"
        if (out / "study.db").exists():
            try:
                with sqlite3.connect(out / "study.db") as db:
                    states = [state for (state,) in db.execute("select state from trials")]
            except sqlite3.OperationalError:  # the schema is still being created
                states = []
            if "COMPLETE" in states and "RUNNING" in states:
                return
        time.sleep(0.05)
    raise AssertionError("no trial was running")


@pytest.mark.slow
def test_sigint_during_a_search_exits_130_and_the_resumed_search_loses_nothing(tmp_path):
    out = tmp_path / "out"
    command = [
        str(AUTOTUNE),
        "search",
        "--model",
        "tiny-llama",
        "--target",
        "4K",
        "--gpus",
        "2",
        "--backend",
        "plan",
        "--hardware",
        "cpu",
        "--memory-gib",
        "0.5",
        "--trials",
        "10",
        "--out",
        str(out),
    ]
    # two plan workers, a user's default on two cores: Ctrl-C ends them too, without a traceback
    env = {**os.environ, "AUTOTUNE_WORKERS": "2"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        _wait_for_a_running_trial(out, process)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "interrupted" in stderr.splitlines()[-1], stderr[-3000:]
    assert (out / "trials.parquet").is_file() and (out / "pareto.json").is_file()  # outputs saved
    trials = _trials(out)
    finished_before = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    interrupted = [t for t in trials if t.state == optuna.trial.TrialState.FAIL]
    retries = {t.user_attrs.get("retry_of"): t for t in trials if t.state == optuna.trial.TrialState.WAITING}
    for trial in interrupted:  # the trial cut short is queued again with its point
        assert trial.number in retries, (trial.number, list(retries))
        assert _point(retries[trial.number]) == _point(trial)

    resumed = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600, env=env)
    assert resumed.returncode in (0, 1) and "Traceback" not in resumed.stderr, resumed.stderr[-3000:]
    after = _trials(out)
    finished = [t for t in after if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(finished) == 10  # the interrupted trial did not use up the budget
    assert {t.number for t in finished_before} <= {t.number for t in finished}
    queued = [t for t in after if t.state == optuna.trial.TrialState.WAITING]
    for trial in interrupted:  # its point was evaluated by the resumed search, or is still queued for the next
        assert _point(trial) in [_point(t) for t in finished + queued], trial.number
    assert len(pq.read_table(out / "trials.parquet")) == 10


def _analytic_search(tmp_path):
    """A backend whose memory and speed come from the length alone (no trace), and a 6-trial search job on it."""
    from autotune import search
    from autotune.backends import Backend
    from autotune.core.hardware import load_hardware
    from autotune.core.record import ResultRecord
    from autotune.search.space import SPACES_DIR, load_space
    from trials.models.config import load_model_config

    class Analytic(Backend):
        """Memory and speed from the length alone; raises KeyboardInterrupt on its ``interrupt_at``-th call."""

        name = "plan"

        def __init__(self, interrupt_at: int | None = None):
            self.calls, self.interrupt_at = [], interrupt_at

        def evaluate(self, evaluation):
            self.calls.append((evaluation.techniques, evaluation.seq_len))
            if len(self.calls) == self.interrupt_at:
                raise KeyboardInterrupt
            fits = evaluation.seq_len <= 4096
            return ResultRecord(
                status="ok" if fits else "oom",
                source="predicted",
                seq_len=evaluation.seq_len,
                tokens_per_s=1e7 / evaluation.seq_len if fits else None,
                peak_device_bytes=evaluation.seq_len * 1000,
            )

    config = load_model_config("tiny-llama")

    def job(backend):
        return search.SearchJob(
            model="tiny-llama",
            model_config=config,
            target=8192,
            gpus=2,
            hardware=load_hardware("cpu").with_memory_gib(4096 * 1000 / 2**30),
            space=load_space(SPACES_DIR / "reduced-tiny.yaml", config, 2, 8192, kernels=["sdpa"]),
            backend=backend,
            out=tmp_path,
            trials=6,
            seed=0,
            follow_ups=False,
        )

    return Analytic, job


def test_an_interrupted_trial_is_queued_again_and_evaluated_on_resume(tmp_path):
    """In process, the interrupt lands in a known trial: Ctrl-C inside the second seed's evaluation. The study marks
    it failed and queues its point again; resuming evaluates it, and the budget is still the trials asked for."""
    from autotune import search

    Analytic, job = _analytic_search(tmp_path)
    with pytest.raises(KeyboardInterrupt):
        search.run(job(Analytic(interrupt_at=2)))
    study = search.open_study(job(Analytic()))
    (cut_short,) = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))
    assert cut_short.number == 1  # the second seed
    (retry,) = [t for t in study.get_trials(deepcopy=False) if t.user_attrs.get("retry_of") == 1]
    assert retry.state == optuna.trial.TrialState.WAITING and _point(retry) == _point(cut_short)

    search.run(job(Analytic()), study=study)
    finished = search.finished_trials(study)
    assert len(finished) == 6
    evaluated = {t.number: t for t in finished}
    assert retry.number in evaluated and _point(evaluated[retry.number]) == _point(cut_short)


def test_a_trial_killed_before_it_was_marked_is_evaluated_in_the_same_resumed_run(tmp_path, monkeypatch):
    """kill -9 right after Optuna created a trial, before the objective marked it as its worker's: the resumed
    search cannot tell it from another worker's until it is an orphan (``sharing.ORPHAN_S``), and while RUNNING it
    counted against the budget. Once the wait fails it and queues its point again, the same run evaluates it: the
    study ends with the trials asked for, the orphan's point among them."""
    from autotune import search
    from autotune.search import sharing

    Analytic, job = _analytic_search(tmp_path)
    study = search.open_study(job(Analytic()))
    orphan = study.ask()  # a seed, RUNNING, with no worker: what a search killed at that instant leaves
    monkeypatch.setattr(sharing, "ORPHAN_S", 0.0)
    search.run(job(Analytic()), study=study)
    assert study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.FAIL,))[0].number == orphan.number
    finished = search.finished_trials(study)
    assert len(finished) == 6
    (retry,) = [t for t in finished if t.user_attrs.get("retry_of") == orphan.number]
    assert retry.system_attrs["fixed_params"] == _point(study.trials[orphan.number])  # the seed it was handed


# --- estimate -------------------------------------------------------------------------------------------------------


def test_estimate_exits_0_for_a_prediction_oom_or_not():
    fits = autotune("estimate", *PLAN[:4], "--hardware", "cpu", "--seq", "1K", "--config", "baseline", "--json")
    assert_exit(fits, 0)
    assert json.loads(fits.stdout)["status"] == "ok"
    oom = autotune(
        "estimate",
        *PLAN[:4],
        "--hardware",
        "cpu",
        "--seq",
        "1K",
        "--config",
        "baseline",
        "--memory-gib",
        "0.001",
        "--json",
    )
    assert_exit(oom, 0)
    assert json.loads(oom.stdout)["status"] == "oom"


def test_estimate_whose_prediction_fails_exits_1_with_the_record(tmp_path):
    done = autotune(
        "estimate",
        "--model",
        str(unbuildable_model(tmp_path)),
        "--gpus",
        "1",
        "--hardware",
        "cpu",
        "--seq",
        "1K",
        "--config",
        "baseline",
        "--json",
    )
    assert_exit(done, 1, "the prediction failed")
    assert json.loads(done.stdout)["status"] == "error"  # the record is still printed
    assert "no-such-activation" in stderr_lines(done)[-1]


def test_estimate_bad_input_exits_2():
    assert_bad_input(
        autotune("estimate", *PLAN[:2], "--seq", "1K", "--config", "baseline", "--gpus", "0"),
        "Invalid value for '--gpus': must be at least 1, got 0",
    )


# --- trial ----------------------------------------------------------------------------------------------------------


def test_trial_whose_record_is_ok_exits_0():
    done = autotune(
        "trial",
        "--model",
        "tiny-llama",
        "--seq",
        "512",
        "--config",
        "baseline",
        "--gpus",
        "1",
        "--steps",
        "1",
        "--json",
    )
    assert_exit(done, 0)
    assert json.loads(done.stdout)["status"] == "ok"


def test_trial_whose_record_is_not_ok_exits_1_with_the_record():
    done = autotune(
        "trial",
        "--model",
        "tiny-llama",
        "--seq",
        "1K",
        "--config",
        "baseline",
        "--gpus",
        "1",
        "--steps",
        "1",
        "--memory-gib",
        "0.001",
        "--json",
    )
    assert_exit(done, 1, "the trial ended oom")
    assert json.loads(done.stdout)["status"] == "oom"  # the record is still printed


def _stop_a_running_trial(gpus: int, settle_s: float) -> tuple[int, list]:
    """SIGTERM to ``autotune trial`` ``settle_s`` after its ranks started: (its exit code, the trial processes still
    alive 30 s on)."""
    import psutil

    process = subprocess.Popen(
        [
            str(AUTOTUNE),
            "trial",
            "--model",
            "tiny-llama",
            "--seq",
            "1K",
            "--config",
            "baseline",
            "--gpus",
            str(gpus),
            "--steps",
            "100000",
            "--timeout",
            "600",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        cwd=ROOT,
    )
    trial_processes = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None:
            trial_processes = psutil.Process(process.pid).children(recursive=True)
            ranks = [
                p
                for p in trial_processes
                if "trials.trial.runner" in p.cmdline()  # not torchrun, which names it
                and "torch.distributed.run" not in p.cmdline()
            ]
            if len(ranks) == gpus:
                break
            time.sleep(0.2)
        assert len(ranks) == gpus, "the trial's ranks never started"
        time.sleep(settle_s)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=120)
        _, alive = psutil.wait_procs(trial_processes, timeout=30)
        return code, alive
    finally:
        if process.poll() is None:
            process.kill()
        for leftover in trial_processes:  # this test's own processes only
            with contextlib.suppress(psutil.NoSuchProcess):
                leftover.kill()


def test_trial_stopped_by_sigterm_exits_130_and_leaves_no_process():
    """A one-rank trial runs in its own process group: a SIGTERM to autotune kills it."""
    code, alive = _stop_a_running_trial(gpus=1, settle_s=3)
    assert code == 130
    assert not alive, alive


def test_trial_bad_input_exits_2():
    assert_bad_input(
        autotune("trial", "--model", "tiny-llama", "--seq", "1K", "--config", "baseline", "--steps", "0"),
        "Invalid value for '--steps': must be at least 1, got 0",
    )


# --- verify ---------------------------------------------------------------------------------------------------------


# verify's exit 0 when every trial ran: test_verify.py's module fixture (its first verify of a search)


def test_verify_exits_1_when_a_trial_failed(reached, tmp_path):
    out, _ = reached
    shutil.copytree(out, tmp_path / "out")
    done = autotune("verify", str(tmp_path / "out"), "--top", "1", "--json", env={"AUTOTUNE_TEST_FAULT": "crash:0"})
    assert done.returncode == 1, done.stderr[-3000:]
    # the cause is printed: the failed trial's error, which carries the trial's own traceback (not autotune's)
    assert any("failed (error): rank 0: RuntimeError: injected crash" in line for line in stderr_lines(done))
    assert "autotune/cli/" not in done.stderr


def test_verify_bad_input_exits_2(reached):
    out, _ = reached
    assert_bad_input(autotune("verify", str(out), "--top", "0"), "Invalid value for '--top': must be at least 1, got 0")


# --- export, show, plot, models, hardware -----------------------------------------------------------------------------


def test_export_show_plot_exit_0_on_a_search_folder_and_2_on_another(reached, tmp_path):
    out, _ = reached
    exported = autotune("export", str(out))
    assert_exit(exported, 0)
    assert json.loads(exported.stdout)["schema"] == "autotune/config-v1"
    assert_exit(autotune("show", str(out)), 0)
    assert_exit(autotune("plot", str(out), "-o", str(tmp_path / "front.png")), 0)
    assert (tmp_path / "front.png").is_file()
    for command in ("export", "show", "plot"):
        assert_bad_input(autotune(command, str(tmp_path)), "no pareto.json")


def test_export_exits_1_when_the_format_expresses_no_config_at_the_target(tmp_path):
    """ArcticTraining has no tiled loss without Ulysses: a front of only that config has nothing it runs in full."""
    from trials.stack.techniques import Techniques

    record = {"status": "ok", "source": "predicted", "seq_len": 1024, "tokens_per_s": 1000.0}
    techniques = Techniques(activation_checkpointing=True, loss_tile_tokens=512).to_dict()
    (tmp_path / "pareto.json").write_text(
        json.dumps(
            {
                "schema": "autotune/pareto-v1",
                "model": "tiny-llama",
                "hardware": "cpu",
                "gpus": 1,
                "target": 1024,
                "capacity_bytes": 2**30,
                "front": [
                    {
                        "trial": 0,
                        "seq_len": 1024,
                        "tokens_per_s": 1000.0,
                        "techniques": techniques,
                        "record": record,
                        "predicted": record,
                        "measured": None,
                    }
                ],
            }
        )
    )
    assert_exit(autotune("export", str(tmp_path), "--format", "autotune"), 0)
    done = autotune("export", str(tmp_path), "--format", "arctic")
    assert_exit(done, 1, "no front config that --format arctic expresses in full reaches 1,024 tokens")
    assert done.stdout == ""


def test_models_and_hardware_exit_0():
    for command in ("models", "hardware"):
        done = autotune(command)
        assert_exit(done, 0)
        assert "tiny-llama" in done.stdout or "h100-sxm" in done.stdout


# --- run --------------------------------------------------------------------------------------------------------------


def test_run_that_trains_exits_0(tmp_path):
    tokens = [[(7 * i + j) % 4096 for j in range(600)] for i in range(2)]
    pq.write_table(pa.table({"input_ids": tokens}), tmp_path / "tokens.parquet")
    done = autotune(
        "run",
        "--config",
        str(write_config(tmp_path / "cfg.json")),
        "--steps",
        "1",
        "--data",
        str(tmp_path / "tokens.parquet"),
    )
    assert_exit(done, 0)
    assert json.loads(done.stdout.split("summary ", 1)[1].splitlines()[0])["steps"] == 1


def test_run_whose_training_fails_exits_1_with_the_root_cause_last(tmp_path):
    config = write_config(tmp_path / "cfg.json", model=str(unbuildable_model(tmp_path)))
    done = subprocess.run(
        [str(AUTOTUNE), "run", "--config", str(config), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=ROOT,
    )
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" in done.stderr  # the training's own, passed through; the root cause is the last line
    assert stderr_lines(done)[-1].startswith("autotune: training failed: ")
    assert "no-such-activation" in stderr_lines(done)[-1]


def test_run_bad_data_exits_2_before_launching(tmp_path):
    (tmp_path / "tokens.txt").write_text("1 2 3\n")
    done = autotune("run", "--config", str(write_config(tmp_path / "cfg.json")), "--data", str(tmp_path / "tokens.txt"))
    assert_bad_input(done, "cannot be read as a Parquet or Arrow file")


@pytest.mark.parametrize("gpus, stop", [(1, "sigterm"), (2, "sigterm"), (2, "ctrl-c")])
def test_run_stopped_by_sigterm_or_ctrl_c_exits_130(tmp_path, gpus, stop):
    """A scheduler's SIGTERM to autotune (not to its training, which is another process) stops the training too,
    one rank or torchrun's, without a traceback of the stop; so does Ctrl-C, which a terminal sends to every process
    of the foreground group: autotune, torchrun's agent and each rank at once."""
    import psutil

    config = write_config(tmp_path / "cfg.json", gpus=gpus)
    process = subprocess.Popen(
        [str(AUTOTUNE), "run", "--config", str(config), "--steps", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        start_new_session=stop == "ctrl-c",  # its own process group, as a terminal's foreground job has
    )
    try:
        first = process.stdout.readline()  # rank 0's first step line: training runs
        assert first.startswith("step 1/"), first
        training = psutil.Process(process.pid).children(recursive=True)
        if stop == "ctrl-c":
            os.killpg(process.pid, signal.SIGINT)
        else:
            process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr[-3000:]
    assert "interrupted" in stderr.splitlines()[-1], stderr[-3000:]
    assert "Traceback" not in stderr and "During handling" not in stderr, stderr[-3000:]
    assert "closing signal SIGTERM" not in stderr, stderr[-3000:]  # torchrun's notice of the stop (shown with -v)
    _, alive = psutil.wait_procs(training, timeout=30)
    assert training and not alive, (training, alive)


def test_the_stops_tracebacks_are_left_out_whole_chains_included_and_the_trainings_own_kept():
    from autotune.cli.run import without_stop_tracebacks

    stopped_rank = [  # a rank cut by Ctrl-C inside a lookup: a chain whose last exception is the stop
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "step.py", line 3, in step',
        "[rank1]: KeyError: 30",
        "[rank1]: ",
        "[rank1]: During handling of the above exception, another exception occurred:",
        "[rank1]: ",
        "[rank1]: Traceback (most recent call last):",
        '[rank1]:   File "train.py", line 9, in main',
        "[rank1]: KeyboardInterrupt",
    ]
    agent = [
        "Traceback (most recent call last):",
        '  File "run.py", line 1, in <module>',
        "torch.distributed.elastic.multiprocessing.api.SignalException: Process 7 got signal: 2",
    ]
    failed = [  # the training's own error, chained to another: stays whole
        "[rank0]: Traceback (most recent call last):",
        "[rank0]: ValueError: bad batch",
        "[rank0]: ",
        "[rank0]: The above exception was the direct cause of the following exception:",
        "[rank0]: ",
        "[rank0]: Traceback (most recent call last):",
        "[rank0]: RuntimeError: step failed",
    ]
    interleaved = [line for pair in zip(stopped_rank, failed) for line in pair] + stopped_rank[len(failed) :]
    kept = without_stop_tracebacks(["step 3/9 loss 1.0", *interleaved, *agent, "autotune: bye"])
    assert kept == ["step 3/9 loss 1.0", *failed, "autotune: bye"]  # in their order
    assert without_stop_tracebacks(stopped_rank[:3]) == stopped_rank[:3]  # a KeyError alone is the training's


def test_the_root_cause_is_the_first_exception_a_rank_raised():
    from autotune.cli.run import root_cause

    torchrun = [
        "[rank1]: Traceback (most recent call last):",
        "[rank1]: KeyError: 'no-such-activation'",
        "[rank0]: RuntimeError: Connection closed by peer",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    ]
    assert root_cause(torchrun, 1) == "rank 1: KeyError: 'no-such-activation'"
    chained = [
        "Traceback (most recent call last):",
        "ValueError: bad ids",
        "During handling of the above exception, another exception occurred:",
        "RuntimeError: cleanup",
    ]
    assert root_cause(chained, 1) == "ValueError: bad ids"
    assert root_cause(["step 1/10  loss 8.3"], -9) == "killed by signal SIGKILL"


def test_an_interrupt_inside_storage_code_waits_until_that_code_returns():
    """Ctrl-C inside SQLAlchemy / Optuna's storage would leave the study's database locked or a trial half told:
    the interrupt is held there and raised as soon as the main thread is back in other code."""
    from autotune.cli.interrupts import interrupts_at_safe_points

    namespace = {}
    source = (
        "import os, signal, time\n"
        "def storage_call(steps):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(0.3)\n"
        "    steps.append('storage call finished')\n"
    )
    exec(compile(source, "/site-packages/sqlalchemy/orm/session_stand_in.py", "exec"), namespace)
    steps = []
    with interrupts_at_safe_points():
        with pytest.raises(KeyboardInterrupt):
            namespace["storage_call"](steps)
            steps.append("back in our code")
            time.sleep(2)  # the held interrupt lands here, within a retry or two
            steps.append("never")
        with pytest.raises(KeyboardInterrupt):  # anywhere else: at once
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(2)
    assert steps == ["storage call finished", "back in our code"]


def test_an_interrupt_while_the_outputs_are_written_is_deferred_until_they_are(tmp_path, monkeypatch, capsys):
    """Ctrl-C that lands as the search's last trial ends (a held retry, a slow host) used to reach Typer, which
    exits 130 silently: no message and the outputs unwritten. It waits until they are written, then exits 130."""
    from autotune import cli
    from autotune.outputs import report

    write_outputs = report.write_outputs

    def interrupted_while_writing(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)  # an interrupt raised at once would land here
        return write_outputs(*args, **kwargs)

    monkeypatch.setattr(report, "write_outputs", interrupted_while_writing)
    out = tmp_path / "out"
    code = cli.main(["search", *PLAN, "--target", "1K", "--memory-gib", "0.5", "--trials", "3", "--out", str(out)])
    stderr = capsys.readouterr().err
    assert code == 130, stderr[-2000:]
    assert "interrupted" in stderr.splitlines()[-1], stderr[-2000:]
    assert (out / "trials.parquet").is_file() and (out / "pareto.json").is_file()
    assert len(pq.read_table(out / "trials.parquet")) == 3


def test_a_command_that_saves_nothing_says_it_was_interrupted(monkeypatch, capsys):
    """Typer turns a KeyboardInterrupt a command does not handle into exit 130 without a word; ours says so."""
    import trials.models.config
    from autotune import cli

    def interrupted(name):
        raise KeyboardInterrupt

    monkeypatch.setattr(trials.models.config, "load_model_config", interrupted)
    code = cli.main(["estimate", "--model", "tiny-llama", "--seq", "1K", "--config", "baseline"])
    assert code == 130
    assert capsys.readouterr().err.splitlines()[-1] == "autotune: interrupted"


def test_autotune_run_hides_torchruns_notices_and_gives_each_rank_its_threads(tmp_path, capfd, monkeypatch):
    """torchrun's OpenMP banner and the SIGTERM notices it sends a failed rank's peers are its own noise: hidden
    unless -v, every other line passed through; each of the node's ranks gets its share of the cores as OpenMP
    threads (the CPU optimizer step's), which also keeps torchrun from printing its banner."""
    from autotune.cli.run import train

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("AUTOTUNE_VERBOSE", raising=False)
    code = (
        "import os, sys\n"
        "for line in ('*' * 40, 'Setting OMP_NUM_THREADS environment variable for each process to be 1 in default',"
        " 'W1129 torch/distributed/elastic/multiprocessing/api.py] Sending process 7 closing signal SIGTERM',"
        " 'step 1/1 loss 8.1'):\n"
        "    print(line, file=sys.stderr)\n"
        "print(os.environ['OMP_NUM_THREADS'])\n"
    )
    with open(tmp_path / "out.txt", "w") as stdout:
        assert train([sys.executable, "-c", code], stdout=stdout, ranks=2) == 0
    err = capfd.readouterr().err
    assert "step 1/1 loss 8.1" in err and "SIGTERM" not in err and "OMP_NUM_THREADS" not in err and "****" not in err
    assert (tmp_path / "out.txt").read_text().strip() == str(max(1, (os.cpu_count() or 1) // 2))
    monkeypatch.setenv("AUTOTUNE_VERBOSE", "1")
    with open(tmp_path / "out.txt", "w") as stdout:
        assert train([sys.executable, "-c", code], stdout=stdout, ranks=2) == 0
    assert "closing signal SIGTERM" in capfd.readouterr().err
