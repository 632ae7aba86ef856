"""The local backend: real trials, OOM through the capacity, and failures classified (issue 2, issue 8)."""

import json
import os
import subprocess
import sys

import psutil
import pytest
from conftest import here

from autotune.backends import Evaluation
from autotune.backends.local import LocalBackend
from autotune.core.hardware import load_hardware
from trials.stack.techniques import Techniques

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too


def evaluation(model_config, gpus=1, seq_len=1024, **techniques):
    return Evaluation(model_config, Techniques(**techniques), seq_len, gpus, load_hardware("cpu"))


def test_trial_measures_a_real_step(tiny_llama):
    record = LocalBackend(steps=1).evaluate(evaluation(tiny_llama))
    assert record.status == "ok", record.error
    assert record.source == "measured" and record.tokens_per_s > 0 and record.step_time_s > 0
    # loss of an untrained model over a 4096-token vocabulary is about ln(4096) = 8.32
    assert 7.9 < record.loss < 8.7
    assert record.peak_device_bytes > record.breakdown["params"] > 0


def test_capacity_turns_into_oom_at_the_crossing_allocation(tiny_llama):
    record = LocalBackend(steps=1, memory_gib=0.02).evaluate(evaluation(tiny_llama, seq_len=2048))
    assert record.status == "oom"
    assert "capacity" in record.error
    # it stopped right after crossing: the peak is just over the 0.02 GiB capacity, not the full step's
    assert 0.02 * 2**30 < record.peak_device_bytes < 0.03 * 2**30


@pytest.mark.parametrize(
    "fault, status, expected",
    [
        ("crash:0", "error", "injected crash on rank 0"),
        ("signal:0", "error", "without a record from every rank"),
    ],
)
def test_failures_are_classified_one_rank(tiny_llama, monkeypatch, fault, status, expected):
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", fault)
    record = LocalBackend(steps=1, timeout_s=120).evaluate(evaluation(tiny_llama))
    assert record.status == status
    assert expected in record.error


def test_hang_becomes_timeout_and_leaves_no_process(tiny_llama, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", "hang:0")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    record = LocalBackend(steps=1, timeout_s=15).evaluate(evaluation(tiny_llama))
    assert record.status == "timeout"
    assert "deadline" in record.error
    after = {p.pid for p in psutil.Process().children(recursive=True)}
    assert after <= before


def test_a_trial_stuck_after_every_rank_reported_keeps_its_records(tiny_llama, monkeypatch):
    """A rank that hangs in its teardown (a process group's destroy, torchrun's exit barrier) after writing its
    record: the trial is ok with its measurement, stopped after the grace, not a timeout at the deadline."""
    import autotune.backends.local as local

    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", "teardown-hang:0")
    monkeypatch.setattr(local, "TEARDOWN_GRACE_S", 2.0)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    record = LocalBackend(steps=1, timeout_s=120).evaluate(evaluation(tiny_llama))
    assert record.status == "ok", record.error
    assert record.loss is not None and record.tokens_per_s
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_a_finished_trial_is_not_failed_by_an_abort_in_the_interpreters_exit(tiny_llama, monkeypatch):
    """A C++ static destructor that aborts after the record is written (``exit-abort``: an abort in the exit's
    handlers): the runner leaves with ``os._exit`` once its record is written, as ``trials.train`` does."""
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", "exit-abort:0")
    record = LocalBackend(steps=1, timeout_s=120).evaluate(evaluation(tiny_llama))
    assert record.status == "ok", record.error


@pytest.mark.slow
def test_a_hung_two_rank_trial_leaves_no_rank_behind(tiny_llama, monkeypatch):
    """torchrun starts each rank in a session of its own: killing torchrun's group alone would orphan them."""
    import uuid

    mark = uuid.uuid4().hex
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", "hang:1")
    monkeypatch.setenv("AUTOTUNE_TEST_MARK", mark)

    def marked():
        found = []
        for process in psutil.process_iter():
            try:
                if process.environ().get("AUTOTUNE_TEST_MARK") == mark:
                    found.append(process.pid)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                pass
        return found

    import threading

    seen, done = set(), threading.Event()

    def watch():
        while not done.wait(1.0):
            seen.update(marked())

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    record = LocalBackend(steps=1, timeout_s=20).evaluate(evaluation(tiny_llama, gpus=2))  # ranks start in seconds
    done.set()
    watcher.join()
    assert record.status == "timeout", record.error
    assert len(seen) >= 3, seen  # torchrun and its two ranks were running when the timeout came
    assert marked() == []


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, status, expected",
    [
        ("crash:1", "error", "injected crash on rank 1"),
        ("signal:1", "error", "without a record from every rank"),
    ],
)
def test_failures_are_classified_two_ranks(tiny_llama, monkeypatch, fault, status, expected):
    monkeypatch.setenv("AUTOTUNE_TEST_FAULT", fault)
    record = LocalBackend(steps=1, timeout_s=300).evaluate(evaluation(tiny_llama, gpus=2))
    assert record.status == status
    assert expected in record.error


@pytest.mark.slow
def test_one_rank_and_two_ranks_see_the_same_sequence(tmp_path):
    """DESIGN.md data rule: FSDP + checkpointing + Ulysses 2 on 2 ranks trains on the 1-rank sequence. The loss and
    gradient norm are the first step's, so one measured step after the warm-up is enough; the commands run in this
    process (conftest.here), each trial's ranks in their own."""
    config = {
        "schema": "autotune/config-v1",
        "model": "tiny-llama",
        "hardware": "cpu",
        "gpus": 2,
        "seq_len": 512,
        "techniques": {"fsdp": True, "activation_checkpointing": True, "ulysses_degree": 2},
        "predicted": None,
        "measured": None,
    }
    (tmp_path / "stack.json").write_text(json.dumps(config))
    common = ["--model", "tiny-llama", "--seq", "512", "--steps", "1", "--json"]
    one = here("trial", *common, "--gpus", "1", "--config", "baseline")
    two = here("trial", *common, "--gpus", "2", "--config", str(tmp_path / "stack.json"))
    assert one.returncode == 0, one.stderr
    assert two.returncode == 0, two.stderr
    one, two = json.loads(one.stdout), json.loads(two.stdout)
    assert one["status"] == two["status"] == "ok"
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)


# a CPU trial's process, as the local backend launches it: free 256 MiB of touched memory, report RSS before/after
_FREES_MEMORY = """
import os, sys
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * os.sysconf('SC_PAGE_SIZE')
block = bytearray(256 << 20)  # zero-filled: every page touched
held = rss()
del block
open(sys.argv[1], 'w').write(f"{held} {rss()} {os.environ.get('GLIBC_TUNABLES', '')}")
"""


def _freed_bytes_given_back(tmp_path, environ=None) -> tuple[int, str]:
    """(bytes the probe's RSS fell by when it freed its block, the GLIBC_TUNABLES it saw)."""
    out = tmp_path / "rss.txt"
    backend = LocalBackend()
    backend.command = lambda *args, **kwargs: [sys.executable, "-c", _FREES_MEMORY, str(out)]
    if environ is None:
        backend.launch(1, tmp_path / "spec.json", tmp_path, deadline_s=60)
    else:
        subprocess.run(backend.command(), env=environ, check=True, timeout=60)
    held, after, tunables = (out.read_text().split(" ", 2) + [""])[:3]
    return int(held) - int(after), tunables


@pytest.mark.skipif(
    not os.path.exists("/proc/self/statm") or os.confstr("CS_GNU_LIBC_VERSION") is None, reason="glibc on Linux"
)
def test_a_cpu_trial_keeps_the_memory_it_frees_as_cudas_caching_allocator_does(tmp_path):
    from trials.core.allocator import HOST_MALLOC_TUNABLES, trial_environment

    # without the settings glibc unmaps a freed large block at once (so a long CPU step would page-fault its
    # activations in at every step) -- so the check below can fail
    plain = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    given_back, _ = _freed_bytes_given_back(tmp_path, plain)
    assert given_back > 200 << 20
    given_back, tunables = _freed_bytes_given_back(tmp_path)
    assert given_back < 16 << 20, given_back
    assert all(f"{name}={value}" in tunables for name, value in HOST_MALLOC_TUNABLES.items())
    # a user's own tunables are kept beside ours; ours replace the same names; a GPU trial's environment is untouched
    env = trial_environment({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=7:glibc.cpu.hwcaps=-AVX512F"}, cpu=True)
    assert env["GLIBC_TUNABLES"].split(":") == [
        "glibc.cpu.hwcaps=-AVX512F",
        "glibc.malloc.mmap_max=0",
        f"glibc.malloc.trim_threshold={HOST_MALLOC_TUNABLES['glibc.malloc.trim_threshold']}",
    ]
    assert trial_environment({"GLIBC_TUNABLES": "glibc.cpu.x=1"})["GLIBC_TUNABLES"] == "glibc.cpu.x=1"


# torchrun's report of a rank that SIGKILL ended (torch.distributed.elastic's failure format), as the tail ends
_TORCHRUN_SIGKILLED_RANK_1 = """torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
trials.trial.runner FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-01-01_00:00:00
  host      : node0
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 4242) (SIGKILL)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4242
============================================================"""


def _killed_trial(monkeypatch, model_config, kills, launched, gpus=1, host_limit=0, predictor=None):
    """``LocalBackend.evaluate`` of a trial whose launch gives ``launched`` (ranks, returncode, timed out, tail),
    no process started, while ``memory.events``' ``oom_kill`` reads ``kills`` (before, after; None: no file)."""
    from dataclasses import replace

    import autotune.backends.local as local

    readings = iter(kills)
    monkeypatch.setattr(local, "oom_kills", lambda: next(readings))
    backend = LocalBackend(steps=1, timeout_s=60, predictor=predictor)
    backend.launch = lambda *args, **kwargs: launched
    hardware = replace(load_hardware("cpu"), host_memory_bytes_per_device=host_limit)
    return backend.evaluate(Evaluation(model_config, Techniques(), 1024, gpus, hardware))


def _rank0_lost_its_peer(host_bytes: int = 0):
    from trials.trial.spec import RankRecord

    return RankRecord(
        status="error", seq_len=1024, rank=0, error="RuntimeError: Connection closed by peer", host_bytes=host_bytes
    )


def test_a_rank_the_oom_killer_ended_is_a_host_oom(tiny_llama, monkeypatch):
    """A rank SIGKILL ended (the one process's exit code -9) while cgroup v2's oom_kill count rose: ``oom``, the
    rank named; the same death without a count that rose stays an ``error`` (SIGKILL from someone else)."""
    record = _killed_trial(monkeypatch, tiny_llama, (3, 4), ([], -9, False, "step 1"))
    assert record.status == "oom", record.error
    assert record.error.startswith("host out of memory (the kernel's OOM killer ended rank 0)"), record.error
    record = _killed_trial(monkeypatch, tiny_llama, (3, 3), ([], -9, False, "step 1"))
    assert record.status == "error" and "killed by signal SIGKILL" in record.error, record.error
    record = _killed_trial(monkeypatch, tiny_llama, (3, 4), ([], -11, False, "step 1"))  # a segfault
    assert record.status == "error" and "SIGSEGV" in record.error, record.error


def test_torchruns_report_names_the_rank_the_oom_killer_ended(tiny_llama, monkeypatch):
    """Under torchrun the launch exits 1; its report names the rank that died of signal 9. Its peer's "connection
    closed" is the symptom, the host's memory the cause."""
    launched = ([_rank0_lost_its_peer()], 1, False, _TORCHRUN_SIGKILLED_RANK_1)
    record = _killed_trial(monkeypatch, tiny_llama, (0, 1), launched, gpus=2)
    assert record.status == "oom", record.error
    assert record.error.startswith("host out of memory (the kernel's OOM killer ended rank 1)"), record.error
    record = _killed_trial(monkeypatch, tiny_llama, (1, 1), launched, gpus=2)
    assert record.status == "error" and "without a record" in record.error, record.error


@pytest.mark.parametrize("host_limit, status", [(1 << 30, "oom"), (4 << 30, "error"), (0, "error")])
def test_without_memory_events_the_host_figure_against_the_host_limit_decides(
    tiny_llama, monkeypatch, host_limit, status
):
    """No cgroup v2 memory.events: a SIGKILLed rank is a host OOM where the trial's host figure (here its peer's
    record, 2 GiB) is over the hardware's host memory per device; an unknown limit (0) decides nothing."""
    launched = ([_rank0_lost_its_peer(host_bytes=2 << 30)], 1, False, _TORCHRUN_SIGKILLED_RANK_1)
    record = _killed_trial(monkeypatch, tiny_llama, (None, None), launched, gpus=2, host_limit=host_limit)
    assert record.status == status, record.error
    assert ("the kernel's OOM killer ended rank 1" in record.error) == (status == "oom")


def test_oom_kills_reads_the_oom_kill_count_of_memory_events(tmp_path, monkeypatch):
    import autotune.backends.local as local

    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n")
    monkeypatch.setattr(local, "memory_events_path", lambda: events)
    assert local.oom_kills() == 2
    events.unlink()
    assert local.oom_kills() is None
