"""The ``local`` backend: a real trial, ``torchrun --nproc-per-node N -m trials.runner`` on this node.

Every trial runs in its own process group (session) with a deadline; on timeout the whole group is killed,
so a hung collective cannot outlive its trial. The deadline and the ranks' collective (NCCL watchdog) timeout
follow the trial's predicted step time (``trial_deadlines``) unless a fixed ``timeout_s`` is given: a step at
5M tokens is predicted at hours, and a constant deadline could only kill it. Each rank writes its own record; they are merged here:
the peak is the max over ranks, the status the worst one (oom > error > ok), and a rank that died without
writing a record (killed by a signal, segfault) becomes ``error`` with its last lines of output.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from trials import allocator
from trials.errors import ConfigError
from trials.spec import RankRecord, TrialSpec
from autotune.backends.base import Backend, Evaluation
from autotune.core.record import ResultRecord

STARTUP_S = 600.0        # starting the ranks, imports, DeepSpeed's JIT op build, building and sharding the model
STEP_TIME_MARGIN = 3.0   # the time model's predictions are not exact (docs/throughput.md): allow 3x per step
MIN_COLLECTIVE_TIMEOUT_S = 600.0


def trial_deadlines(predicted_step_s: float | None, steps: int, warmup: int) -> tuple[float, float]:
    """(the whole trial's deadline, one collective's timeout) in seconds for a predicted step time.

    A collective waits at most as long as the slowest rank takes to reach it, which is within one step; the trial
    runs ``warmup + steps`` steps after its start-up. Without a prediction: the defaults (one hour, 10 minutes)."""
    if not predicted_step_s or predicted_step_s <= 0:
        return 3600.0, MIN_COLLECTIVE_TIMEOUT_S
    step = STEP_TIME_MARGIN * predicted_step_s
    return STARTUP_S + (warmup + steps) * step, max(MIN_COLLECTIVE_TIMEOUT_S, step)


def visible_devices() -> int:
    """GPUs this process can use (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


_PEER_LOST = re.compile(r"Connection closed by peer|Connection reset|Read error|pair\.cc|NCCL.*(remote|closed)",
                        re.IGNORECASE)


class LocalBackend(Backend):
    """Real trials on this machine (CUDA+NCCL when there are GPUs, else CPU+gloo with a tracked capacity)."""

    name = "local"

    def __init__(self, steps: int = 2, warmup: int = 1, timeout_s: float | None = None,
                 memory_gib: float | None = None, seed: int = 0, keep_logs: str | None = None,
                 predictor: Backend | None = None):
        """``timeout_s``: a fixed deadline per trial; None = from the step time ``predictor`` (a plan backend with
        the time model; its cached records are reused) predicts for the trial (``trial_deadlines``)."""
        self.steps, self.warmup, self.timeout_s = steps, warmup, timeout_s
        self.memory_gib, self.seed, self.keep_logs = memory_gib, seed, keep_logs
        self.predictor = predictor

    def command(self, gpus: int, spec_path: Path, out_dir: Path) -> list[str]:
        if gpus == 1:
            return [sys.executable, "-m", "trials.runner", str(spec_path), str(out_dir)]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
                "-m", "trials.runner", str(spec_path), str(out_dir)]

    def capacity_bytes(self, evaluation: Evaluation) -> int | None:
        """``--memory-gib`` per rank: the tracker's capacity on CPU, the caching allocator's limit on a GPU (the
        card's own capacity raises OOM when not given)."""
        return None if self.memory_gib is None else int(self.memory_gib * 1024**3)

    def deadlines(self, evaluation: Evaluation) -> tuple[float, float]:
        if self.timeout_s is not None:
            return self.timeout_s, max(MIN_COLLECTIVE_TIMEOUT_S, self.timeout_s)
        predicted = self.predictor.evaluate(evaluation).step_time_s if self.predictor is not None else None
        return trial_deadlines(predicted, self.steps, self.warmup)

    def evaluate(self, evaluation: Evaluation) -> ResultRecord:
        visible = visible_devices()
        if visible and evaluation.gpus > visible:
            raise ConfigError(f"--gpus {evaluation.gpus} but this node shows {visible} CUDA device(s)")
        deadline_s, collective_timeout_s = self.deadlines(evaluation)
        spec = TrialSpec(model_config=evaluation.model_config, techniques=evaluation.techniques,
                         seq_len=evaluation.seq_len, steps=self.steps, warmup=self.warmup,
                         capacity_bytes=self.capacity_bytes(evaluation), seed=self.seed,
                         collective_timeout_s=collective_timeout_s)
        work = Path(tempfile.mkdtemp(prefix="autotune-trial-"))
        try:
            spec_path = work / "spec.json"
            spec.write(spec_path)
            return self._run(evaluation, spec_path, work, deadline_s)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    def _run(self, evaluation: Evaluation, spec_path: Path, work: Path, deadline_s: float) -> ResultRecord:
        log_path = work / "output.log"
        env = allocator.trial_environment(dict(os.environ))
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // evaluation.gpus)))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self.command(evaluation.gpus, spec_path, work), stdout=log,
                                    stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                returncode = proc.wait(timeout=deadline_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                returncode = None
            finally:
                _kill_group(proc)
        tail = _tail(log_path)
        ranks = RankRecord.read_all(work)
        return merge_rank_records(evaluation, ranks, returncode, timed_out, tail, deadline_s)


def merge_rank_records(evaluation: Evaluation, ranks: list[RankRecord], returncode, timed_out: bool, tail: str,
                       timeout_s: float) -> ResultRecord:
    """One record from the per-rank ones, root cause first: an OOM anywhere makes the trial ``oom``; else the
    earliest error a rank wrote itself; else a rank that died without writing its record (a signal, a
    segfault) -- its peers' "connection closed" errors are only symptoms of it."""
    base = {"source": "measured", "seq_len": evaluation.seq_len}
    peak = max((r.peak_device_bytes or 0 for r in ranks), default=None)
    if timed_out:
        return ResultRecord(status="timeout", **base, peak_device_bytes=peak,
                            error=f"trial exceeded its {timeout_s:g} s deadline; last output:\n{tail}")
    ooms = [r for r in ranks if r.status == "oom"]
    missing = sorted(set(range(evaluation.gpus)) - {r.rank for r in ranks})
    errors = sorted((r for r in ranks if r.status == "error"), key=lambda r: r.finished_at or 0)
    # a peer's broken connection is a symptom: report the rank that caused it
    primary = [r for r in errors if not _PEER_LOST.search(r.error or "")]
    errors = primary if (primary or not missing) else []
    if ooms:
        cause = ooms[0]
        return ResultRecord(status="oom", **base, peak_device_bytes=peak, breakdown=cause.breakdown or {},
                            host_bytes=cause.host_bytes, device=cause.device,
                            error=f"rank {cause.rank}: {cause.error}")
    if errors:
        cause = errors[0]
        return ResultRecord(status="error", **base, peak_device_bytes=peak,
                            error=f"rank {cause.rank}: {cause.error}\n"
                                  f"--- last lines of the trial's output ---\n{tail}")
    if missing:
        return ResultRecord(status="error", **base, peak_device_bytes=peak,
                            error=f"rank(s) {missing} ended without a record from every rank "
                                  f"({_signal_reason(returncode)}); last output:\n{tail}")
    if returncode not in (0, None):
        return ResultRecord(status="error", **base, peak_device_bytes=peak,
                            error=f"trial exited with code {returncode} after every rank reported ok; "
                                  f"last output:\n{tail}")
    first = next(r for r in ranks if r.rank == 0)
    peak_rank = max(ranks, key=lambda r: r.peak_device_bytes or 0)
    return ResultRecord(
        status="ok", **base, tokens_per_s=first.tokens_per_s, step_time_s=first.step_time_s,
        peak_device_bytes=peak, peak_allocated_bytes=max(r.peak_allocated_bytes or 0 for r in ranks),
        peak_reserved_bytes=max(r.peak_reserved_bytes or 0 for r in ranks),
        host_bytes=max((r.host_bytes or 0) for r in ranks),
        breakdown=peak_rank.breakdown or {}, loss=first.loss, grad_norm=first.grad_norm,
        device=first.device,
    )


def _signal_reason(returncode) -> str:
    if returncode is not None and returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the trial's whole process group (torchrun and every rank)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if "Setting OMP_NUM_THREADS" not in line and line.strip("* ")]
    return "\n".join(kept[-lines:])
