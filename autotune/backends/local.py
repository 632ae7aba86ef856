"""The ``local`` backend: a real trial, ``torchrun --nproc-per-node N -m trials.trial.runner`` on this node (on several
nodes: the same on every node through torchrun's c10d rendezvous, one agent per node, ``autotune.backends.nodes``).

Every trial runs in its own process group (session) with a deadline; on timeout the whole group is killed,
so a hung collective cannot outlive its trial. The deadline and the ranks' collective (NCCL watchdog) timeout
follow the trial's predicted step time (``trial_deadlines``) unless a fixed ``timeout_s`` is given: a step at
5M tokens is predicted at hours, and a constant deadline could only kill it. Each rank writes its own record; they are merged here:
the peak is the max over ranks, the status the worst one (oom > error > ok), and a rank that died without
writing a record (killed by a signal, segfault) becomes ``error`` with its last lines of output -- or ``oom`` when
the kernel's OOM killer ended it: a rank killed by SIGKILL while the host's memory ran out (``oom_killed_rank``:
cgroup v2's ``memory.events`` counted an OOM kill during the trial).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from autotune.backends.base import Backend, Evaluation
from autotune.backends.nodes import NodeGroup, NodeResult
from autotune.core.record import ResultRecord
from autotune.oracle import EXTRAPOLATE_FROM, Trace, extend_value
from autotune.oracle.extrapolation import extrapolate, plan_traces
from trials.core import allocator
from trials.core.dist import MIN_COLLECTIVE_TIMEOUT_S, STEP_TIME_MARGIN, collective_timeout_s, rank_threads
from trials.core.errors import ConfigError
from trials.models.config import copy_for_runs
from trials.trial.segments import Segment, layer_positions, model_runs, techniques_for_runs
from trials.trial.spec import RankRecord, TrialSpec, timeline_path

DEPTHS = ("full", "reduced")

STARTUP_S = 600.0  # starting the ranks, imports, DeepSpeed's JIT op build, building and sharding the model
FOLLOWER_GRACE_S = 60.0  # how long after its deadline the driver still waits for another node's report
POLL_S = 1.0  # how often a running trial's exit and records are checked
PROGRESS_EVERY_S = 5.0  # how often its latest progress line is passed on
TEARDOWN_GRACE_S = 30.0  # how long a trial whose every rank wrote its record may take to exit


def trial_deadlines(predicted_step_s: float | None, steps: int, warmup: int) -> tuple[float, float]:
    """(the whole trial's deadline, one collective's timeout) in seconds for a predicted step time.

    A collective waits at most as long as the slowest rank takes to reach it, which is within one step; the trial
    runs ``warmup + steps`` steps after its start-up. Without a prediction: the defaults (one hour, 10 minutes)."""
    if not predicted_step_s or predicted_step_s <= 0:
        return 3600.0, collective_timeout_s(None)
    return STARTUP_S + (warmup + steps) * STEP_TIME_MARGIN * predicted_step_s, collective_timeout_s(predicted_step_s)


def visible_devices() -> int:
    """GPUs this process can use (0 on a CPU-only machine)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


MEMORY_EVENTS = Path("/sys/fs/cgroup/memory.events")  # cgroup v2, where /proc/self/cgroup names no cgroup of its own
# torchrun's report of a rank a signal ended (torch.distributed.elastic's failure format): "rank      : 1 (local_rank:
# 1)" and on the next line "exitcode  : -9 (pid: 123) (SIGKILL)"
TORCHRUN_SIGKILLED = re.compile(rf"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*-{int(signal.SIGKILL)}\b")


def memory_events_path() -> Path:
    """This process's cgroup's ``memory.events`` (cgroup v2: the "0::PATH" line of /proc/self/cgroup), else
    ``MEMORY_EVENTS`` (inside a container's cgroup namespace the cgroup is the root of /sys/fs/cgroup)."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return MEMORY_EVENTS
    own = next((line[3:] for line in lines if line.startswith("0::")), "/")
    path = MEMORY_EVENTS.parent / own.lstrip("/") / "memory.events"
    return path if own.strip("/") and path.is_file() else MEMORY_EVENTS


def oom_kills() -> int | None:
    """How many processes of this process's cgroup (its trials' ranks included) the kernel's OOM killer has ended
    so far: ``memory.events``' ``oom_kill`` (cgroup v2; it counts every OOM killer, the host's and the cgroup's
    limit's). None: no cgroup v2 memory.events here."""
    try:
        text = memory_events_path().read_text()
    except OSError:
        return None
    found = re.search(r"^oom_kill\s+(\d+)\s*$", text, flags=re.M)
    return int(found.group(1)) if found else None


PEER_LOST = re.compile(  # a rank's error that is only the symptom of a peer's failure
    r"Connection closed by peer|Connection reset|Read error|pair\.cc|NCCL.*(remote|closed)", re.IGNORECASE
)


class LocalBackend(Backend):
    """Real trials on this machine (CUDA+NCCL when there are GPUs, else CPU+gloo with a tracked capacity)."""

    name = "local"

    def __init__(
        self,
        steps: int = 2,
        warmup: int = 1,
        timeout_s: float | None = None,
        memory_gib: float | None = None,
        seed: int = 0,
        keep_logs: str | None = None,
        predictor: Backend | None = None,
        depth: str = "full",
        progress=None,
        group: NodeGroup | None = None,
        timeline_rank: int | None = None,
    ):
        """``timeout_s``: a fixed deadline per trial; None = from the step time ``predictor`` (a plan backend with
        the time model; its cached records are reused) predicts for what the trial runs (``trial_deadlines``).
        ``depth``: ``full`` runs the model; ``reduced`` runs its 3- and 4-layer copies (the memory oracle's) in one
        launch and extends each segment's measured peak and the step time exactly to the model's depth
        (``ResultRecord.measured_layers``); models of up to 4 layers run whole either way. ``progress``: called
        with the trial's latest progress line and the seconds elapsed, every few seconds. ``group``: the agents of
        a job over several nodes (``NodeGroup``), which evaluations with ``nodes`` > 1 need; only its driver
        evaluates, its followers ``follow``. ``timeline_rank``: that rank records its memory timeline
        (``trials.trial.spec.TrialSpec.timeline_rank``), kept after each evaluation in ``last_timeline`` (a torch memory
        snapshot; None where the rank runs on another node or wrote none)."""
        if depth not in DEPTHS:
            raise ConfigError(f"depth must be one of {', '.join(DEPTHS)}, got {depth!r}")
        self.steps, self.warmup, self.timeout_s = steps, warmup, timeout_s
        self.memory_gib, self.seed, self.keep_logs = memory_gib, seed, keep_logs
        self.predictor, self.depth, self.progress = predictor, depth, progress
        self.group = group
        self.timeline_rank = timeline_rank
        self.last_timeline: dict | None = None

    def command(
        self, gpus: int, spec_path: Path, out_dir: Path, nodes: int = 1, rdzv_id: str | None = None
    ) -> list[str]:
        """The trial's launch on this node: one process, ``torchrun --standalone``, or (``nodes`` > 1) torchrun
        joining the c10d rendezvous at the group's endpoint under ``rdzv_id`` (``autotune.backends.nodes``)."""
        runner = ["-m", "trials.trial.runner", str(spec_path), str(out_dir)]
        if nodes > 1:
            if self.group is None or rdzv_id is None:
                raise ConfigError(
                    f"a trial over {nodes} nodes needs --rdzv-endpoint HOST:PORT (the same on every node)"
                )
            return [
                sys.executable,
                "-m",
                "torch.distributed.run",
                f"--nnodes={nodes}",
                f"--nproc-per-node={gpus}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.group.endpoint}",
                f"--rdzv-id={rdzv_id}",
                *runner,
            ]
        if gpus == 1:
            return [sys.executable, *runner]
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}", *runner]

    def capacity_bytes(self, evaluation: Evaluation) -> int | None:
        """``--memory-gib`` per rank: the tracker's capacity on CPU, the caching allocator's limit on a GPU (the
        card's own capacity raises OOM when not given)."""
        return None if self.memory_gib is None else int(self.memory_gib * 1024**3)

    def deadlines(self, evaluation: Evaluation, copies: list[dict] | None = None) -> tuple[float, float]:
        """(deadline, collective timeout) for the model, or for its ``copies`` run one after the other."""
        if self.timeout_s is not None:
            return self.timeout_s, max(MIN_COLLECTIVE_TIMEOUT_S, self.timeout_s)
        if self.predictor is None:
            return trial_deadlines(None, self.steps, self.warmup)
        if not copies:
            return trial_deadlines(self.predictor.evaluate(evaluation).step_time_s, self.steps, self.warmup)
        times = [self.predictor.evaluate(_copy_evaluation(evaluation, copy)).step_time_s for copy in copies]
        if not all(times):
            return trial_deadlines(None, self.steps, self.warmup)
        # a copy for memory only runs one step after priming the optimizer (about one more step's worth)
        each = [
            trial_deadlines(t, self.steps, self.warmup) if copy["timed"] else trial_deadlines(t, 2, 0)
            for t, copy in zip(times, copies)
        ]
        return STARTUP_S + sum(d - STARTUP_S for d, _ in each), max(c for _, c in each)

    def copies(self, evaluation: Evaluation) -> tuple[list, list[dict]]:
        """(the model's layer runs, the shallower copies a reduced trial runs: [] = run the model itself)."""
        runs = model_runs(evaluation.techniques, evaluation.model_config)
        base, varied = plan_traces(runs)
        if self.depth == "full" or not varied:
            return runs, []
        shallow = [base] + [longer for _, longer in varied]
        # memory needs each copy's first step (after priming the optimizer states); time needs only one copy,
        # its layers split by the layer clock: the last (deepest) one runs warm-up + measured steps
        return runs, [
            {
                "runs": [list(r) for r in copy],
                "techniques": techniques_for_runs(evaluation.techniques, copy).to_dict(),
                "timed": index == len(shallow) - 1,
            }
            for index, copy in enumerate(shallow)
        ]

    def evaluate(self, evaluation: Evaluation) -> ResultRecord:
        visible = visible_devices()
        if visible and evaluation.gpus > visible:
            raise ConfigError(f"--gpus {evaluation.gpus} but this node shows {visible} CUDA device(s)")
        runs, copies = self.copies(evaluation)
        deadline_s, collective_timeout_s = self.deadlines(evaluation, copies)
        spec = TrialSpec(
            model_config=evaluation.model_config,
            techniques=evaluation.techniques,
            seq_len=evaluation.seq_len,
            steps=self.steps,
            warmup=self.warmup,
            capacity_bytes=self.capacity_bytes(evaluation),
            seed=self.seed,
            collective_timeout_s=collective_timeout_s,
            copies=copies,
            timeline_rank=self.timeline_rank,
            documents=list(evaluation.documents.lengths),
            lora=evaluation.lora.to_json(),
        )
        work = Path(tempfile.mkdtemp(prefix="autotune-trial-"))
        self.last_timeline = None
        try:
            spec_path = work / "spec.json"
            spec.write(spec_path)
            record, ranks = self._run(evaluation, spec_path, work, deadline_s)
            if self.timeline_rank is not None:
                self.last_timeline = _read_timeline(work, self.timeline_rank)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if copies and record.status == "ok":
            capacity = self.capacity_bytes(evaluation) or (evaluation.hardware.device_memory_bytes if visible else None)
            first = next(r for r in ranks if r.rank == 0)  # rank 0, as the oracle traces
            record = extend_to_depth(evaluation, copies, first.copies, record.device, runs, capacity)
        return record

    def _run(
        self, evaluation: Evaluation, spec_path: Path, work: Path, deadline_s: float
    ) -> tuple[ResultRecord, list[RankRecord]]:
        if evaluation.nodes == 1:
            kills_before = oom_kills()
            ranks, returncode, timed_out, tail = self.launch(evaluation.gpus, spec_path, work, deadline_s)
            killed = self.oom_killed_rank(evaluation, ranks, returncode, tail, kills_before, oom_kills())
            return merge_rank_records(evaluation, ranks, returncode, timed_out, tail, deadline_s, killed), ranks
        if self.group is None or not self.group.driver:
            raise ConfigError(
                f"a trial over {evaluation.nodes} nodes needs --rdzv-endpoint HOST:PORT, the same on every node"
            )
        # every node runs the same spec under the same rendezvous id; the followers report their ranks back
        started = time.monotonic()
        kills_before = oom_kills()  # this node's: a follower's OOM kill shows only by the fall-back below
        number, rdzv_id = self.group.publish(
            {
                "spec": json.loads(spec_path.read_text()),
                "gpus": evaluation.gpus,
                "nodes": evaluation.nodes,
                "deadline_s": deadline_s,
            }
        )
        ranks, returncode, timed_out, tail = self.launch(
            evaluation.gpus, spec_path, work, deadline_s, evaluation.nodes, rdzv_id
        )
        left = max(0.0, deadline_s - (time.monotonic() - started))
        for result in sorted(self.group.collect(number, wait_s=left + FOLLOWER_GRACE_S), key=lambda r: r.node):
            ranks += [RankRecord.from_dict(r) for r in result.ranks]
            timed_out = timed_out or result.timed_out
            returncode = returncode or result.returncode
            tail += f"\n--- node {result.node} ---\n{result.tail}"
        killed = self.oom_killed_rank(evaluation, ranks, returncode, tail, kills_before, oom_kills())
        return merge_rank_records(evaluation, ranks, returncode, timed_out, tail, deadline_s, killed), ranks

    def oom_killed_rank(
        self, evaluation: Evaluation, ranks: list[RankRecord], returncode, tail: str, before, after
    ) -> int | None:
        """The rank the kernel's OOM killer ended: the one a trial lost to SIGKILL (``sigkilled_rank``), when the
        host's memory ran out meanwhile -- cgroup v2's ``oom_kill`` count rose from ``before`` to ``after``
        (``oom_kills``); where there is no count, the trial's host figure (the most any rank's record holds, or the
        predictor's) is over the hardware's host memory per device, when that is known. None: no such rank."""
        killed = sigkilled_rank(evaluation, ranks, returncode, tail)
        if killed is None:
            return None
        if before is not None and after is not None:
            return killed if after > before else None
        limit = evaluation.hardware.host_memory_bytes_per_device
        if not limit:
            return None
        figures = [r.host_bytes or 0 for r in ranks]
        if self.predictor is not None:
            figures.append(self.predictor.evaluate(evaluation).host_bytes or 0)
        return killed if max(figures, default=0) > limit else None

    def follow(self) -> dict | None:
        """A follower's whole part in a multi-node command: run every trial the driver publishes on this node and
        report its ranks back, until the driver stops; returns what the driver sent with ``stop`` (``trial``'s
        merged record)."""
        group = self.group
        if group is None or group.driver:
            raise ValueError("only a follower of a node group follows")
        for number, job in group.jobs():
            work = Path(tempfile.mkdtemp(prefix="autotune-trial-"))
            try:
                spec_path = work / "spec.json"
                spec_path.write_text(json.dumps(job["spec"]))
                ranks, returncode, timed_out, tail = self.launch(
                    int(job["gpus"]), spec_path, work, float(job["deadline_s"]), int(job["nodes"]), job["rdzv_id"]
                )
            finally:
                shutil.rmtree(work, ignore_errors=True)
            group.report(number, NodeResult(group.node, [r.to_dict() for r in ranks], returncode, timed_out, tail))
        return group.final

    def launch(
        self, gpus: int, spec_path: Path, work: Path, deadline_s: float, nodes: int = 1, rdzv_id: str | None = None
    ) -> tuple[list[RankRecord], int | None, bool, str]:
        """Run the trial's processes of this node: (the records its ranks wrote, the exit code, whether it ran past
        ``deadline_s`` and was killed, the tail of its output)."""
        log_path = work / "output.log"
        env = allocator.trial_environment(dict(os.environ), cpu=not visible_devices())
        env.setdefault("OMP_NUM_THREADS", rank_threads(gpus))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                self.command(gpus, spec_path, work, nodes, rdzv_id),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
            try:
                returncode = self._wait(proc, deadline_s, log_path, work, gpus)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
                returncode = None
            finally:
                _kill_group(proc)
        return RankRecord.read_all(work), returncode, timed_out, _tail(log_path)

    def _wait(self, proc: subprocess.Popen, deadline_s: float, log_path: Path, work: Path, ranks: int):
        """Wait for the trial's exit code, passing its latest progress line to ``progress`` every few seconds.

        Once every one of this node's ``ranks`` has written its record the trial is over: a launcher still
        running ``TEARDOWN_GRACE_S`` later is stuck in its teardown (a process group's destroy, torchrun's exit
        barrier or rendezvous shutdown) and is stopped, its records kept (None: no exit code)."""
        started = time.monotonic()
        reported_at = None
        last_progress = started
        while True:
            now = time.monotonic()
            left = deadline_s - (now - started)
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, deadline_s)
            try:
                return proc.wait(timeout=min(POLL_S, left))
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if reported_at is None and len(list(work.glob("rank*.json"))) >= ranks:
                reported_at = now
            if reported_at is not None and now - reported_at > TEARDOWN_GRACE_S:
                return None
            if self.progress is not None and now - last_progress >= PROGRESS_EVERY_S:
                last_progress = now
                lines = [line for line in _tail(log_path, 200).splitlines() if line.startswith("progress: ")]
                self.progress(lines[-1][len("progress: ") :] if lines else "starting", now - started, deadline_s)


def _read_timeline(work: Path, rank: int) -> dict | None:
    """The memory timeline rank ``rank`` wrote into ``work``, or None."""
    path = timeline_path(work, rank)
    if not path.is_file():
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _copy_evaluation(evaluation: Evaluation, copy: dict) -> Evaluation:
    from trials.stack.techniques import Techniques

    return Evaluation(
        copy_for_runs(evaluation.model_config, copy["runs"]),
        Techniques.from_dict(copy["techniques"]),
        evaluation.seq_len,
        evaluation.gpus,
        evaluation.hardware,
        evaluation.nodes,
        evaluation.documents,
        evaluation.lora,
    )


def extend_to_depth(
    evaluation: Evaluation,
    copies: list[dict],
    measured: list[dict],
    device_name: str | None,
    runs: list,
    capacity_bytes: int | None,
) -> ResultRecord:
    """The reduced trial's ``copies`` (as ``copies()`` made them) and rank 0's records of them (``measured``:
    ``RankRecord.copies``) extended to the model's ``runs``: segment peaks exactly as the oracle extends its traces
    (``autotune.oracle.extrapolation``), the step time by ``extend_step_time``. Every byte and second measured,
    only the count of identical layers extended."""
    traces = []
    for copy in measured:
        segments = {
            (phase, tuple(position) if isinstance(position, list) else position):  # JSON made tuples lists
            Segment(int(device), dict(breakdown), int(host))
            for phase, position, device, breakdown, host in copy["segments"]
        }
        peak = max(segments.values(), key=lambda seg: seg.device_bytes)
        traces.append(
            Trace(
                layers=copy["layers"],
                peak_device_bytes=peak.device_bytes,
                breakdown=peak.breakdown,
                peak_host_bytes=int(copy["host_bytes"]),
                segments=segments,
            )
        )
    _, varied = plan_traces(runs)
    extended = extrapolate(traces[0], [(index, trace) for (index, _), trace in zip(varied, traces[1:])], runs)
    lengths = [runs[index][1] - EXTRAPOLATE_FROM[0] for index, _ in varied]
    parameters = extend_value(measured[0]["parameters"], [(c["parameters"], n) for c, n in zip(measured[1:], lengths)])
    timed = next(i for i, copy in enumerate(copies) if copy["timed"])
    step_time = extend_step_time(measured[timed], [tuple(r) for r in copies[timed]["runs"]], runs, parameters)
    last = measured[-1]
    allocator_slack = (last["peak_reserved_bytes"] or 0) - (last["peak_allocated_bytes"] or 0)
    allocated = int(extended.peak_device_bytes)
    reserved = allocated + max(0, allocator_slack)
    device = reserved + int(last.get("runtime_bytes") or 0)
    dp = evaluation.world_size // (evaluation.techniques.ulysses_degree * evaluation.techniques.ring_degree)
    result = ResultRecord(
        status="ok",
        source="measured",
        seq_len=evaluation.seq_len,
        step_time_s=float(step_time),
        tokens_per_s=evaluation.seq_len * dp / step_time if step_time > 0 else None,
        peak_device_bytes=device,
        peak_allocated_bytes=allocated,
        peak_reserved_bytes=reserved,
        host_bytes=int(extended.peak_host_bytes),
        breakdown=dict(extended.breakdown),
        device=device_name,
        measured_layers=max(c["layers"] for c in measured),
    )
    if step_time <= 0:
        result.status, result.error = "error", f"the extended step time is {step_time:.3g} s (timings too noisy)"
    elif capacity_bytes is not None and device > capacity_bytes:
        result.status = "oom"
        result.error = (
            f"measured at {result.measured_layers} layers and extended: peak {device:,} bytes > capacity "
            f"{capacity_bytes:,} bytes (at {'/'.join(map(str, extended.peak_segment or ()))})"
        )
    return result


def extend_step_time(timed: dict, timed_runs: list, runs: list, parameters: int) -> float:
    """The model's step time from the timed copy's (a ``RankRecord`` dict of ``timed_runs``): its step, plus a
    middle layer's time (its layer clock's mean over the copy's middle layers of that run, ``trials.trial.layer_clock``)
    for each layer a run has beyond the copy's, plus its tail scaled to the model's ``parameters`` (the tail --
    gradient reduction, norm, optimizer -- is elementwise over the parameters)."""
    labels = layer_positions(timed_runs)
    layer_s = timed["layer_times_s"]
    if len(layer_s) != len(labels):
        raise RuntimeError(f"the timed copy has {len(layer_s)} layer times for {len(labels)} layers")
    step = timed["step_time_s"]
    for (kind, count), (copy_kind, copy_count) in zip(runs, timed_runs):
        if count == copy_count:
            continue
        middle = [t for t, label in zip(layer_s, labels) if label == (copy_kind, "middle")]
        if kind != copy_kind or not middle:
            raise RuntimeError(f"run {kind} x{count} cannot be extended from the copy's {copy_kind} x{copy_count}")
        step += (count - copy_count) * sum(middle) / len(middle)
    return step + timed["tail_time_s"] * (parameters / timed["parameters"] - 1)


def sigkilled_rank(evaluation: Evaluation, ranks: list[RankRecord], returncode, tail: str) -> int | None:
    """The rank SIGKILL ended, without writing its record: the one torchrun's report names (``TORCHRUN_SIGKILLED``,
    its root cause where it names several), else the first rank without a record when the launch itself died
    of SIGKILL (one rank: the launch is rank 0's process). None: no rank died of SIGKILL."""
    written = {r.rank for r in ranks}
    root_cause = tail.rpartition("Root Cause")[2]  # the whole tail where torchrun's report is not in it
    reported = [*TORCHRUN_SIGKILLED.findall(root_cause), *TORCHRUN_SIGKILLED.findall(tail)]
    found = next((int(rank) for rank in reported if int(rank) not in written), None)
    if found is not None:
        return found
    missing = sorted(set(range(evaluation.world_size)) - written)
    return missing[0] if missing and returncode == -signal.SIGKILL else None


def merge_rank_records(
    evaluation: Evaluation,
    ranks: list[RankRecord],
    returncode,
    timed_out: bool,
    tail: str,
    timeout_s: float,
    oom_killed: int | None = None,
) -> ResultRecord:
    """One record from the per-rank ones, root cause first: an OOM anywhere makes the trial ``oom`` -- one a rank
    recorded, or the rank ``oom_killed`` the kernel's OOM killer ended (SIGKILL while the host's memory ran out,
    ``LocalBackend.oom_killed_rank``); else the earliest error a rank wrote itself; else a rank that died
    without writing its record (a signal, a segfault) -- its peers' "connection closed" errors are only symptoms
    of it."""
    base = {"source": "measured", "seq_len": evaluation.seq_len}
    peak = max((r.peak_device_bytes or 0 for r in ranks), default=None)
    if timed_out:
        return ResultRecord(
            status="timeout",
            **base,
            peak_device_bytes=peak,
            error=f"trial exceeded its {timeout_s:g} s deadline; last output:\n{tail}",
        )
    ooms = [r for r in ranks if r.status == "oom"]
    missing = sorted(set(range(evaluation.world_size)) - {r.rank for r in ranks})
    errors = sorted((r for r in ranks if r.status == "error"), key=lambda r: r.finished_at or 0)
    # a peer's broken connection is a symptom: report the rank that caused it
    primary = [r for r in errors if not PEER_LOST.search(r.error or "")]
    errors = primary if (primary or not missing) else []
    if ooms:
        cause = ooms[0]
        return ResultRecord(
            status="oom",
            **base,
            peak_device_bytes=peak,
            breakdown=cause.breakdown or {},
            host_bytes=cause.host_bytes,
            device=cause.device,
            error=f"rank {cause.rank}: {cause.error}",
        )
    if oom_killed is not None:
        return ResultRecord(
            status="oom",
            **base,
            peak_device_bytes=peak,
            host_bytes=max((r.host_bytes or 0 for r in ranks), default=None) or None,
            error=f"host out of memory (the kernel's OOM killer ended rank {oom_killed}); last output:\n{tail}",
        )
    if errors:
        cause = errors[0]
        return ResultRecord(
            status="error",
            **base,
            peak_device_bytes=peak,
            error=f"rank {cause.rank}: {cause.error}\n--- last lines of the trial's output ---\n{tail}",
        )
    if missing:
        return ResultRecord(
            status="error",
            **base,
            peak_device_bytes=peak,
            error=f"rank(s) {missing} ended without a record from every rank "
            f"({_signal_reason(returncode)}); last output:\n{tail}",
        )
    if returncode not in (0, None):
        return ResultRecord(
            status="error",
            **base,
            peak_device_bytes=peak,
            error=f"trial exited with code {returncode} after every rank reported ok; last output:\n{tail}",
        )
    first = next(r for r in ranks if r.rank == 0)
    peak_rank = max(ranks, key=lambda r: r.peak_device_bytes or 0)
    return ResultRecord(
        status="ok",
        **base,
        tokens_per_s=first.tokens_per_s,
        step_time_s=first.step_time_s,
        peak_device_bytes=peak,
        peak_allocated_bytes=max(r.peak_allocated_bytes or 0 for r in ranks),
        peak_reserved_bytes=max(r.peak_reserved_bytes or 0 for r in ranks),
        host_bytes=max((r.host_bytes or 0) for r in ranks),
        breakdown=peak_rank.breakdown or {},
        loss=first.loss,
        grad_norm=first.grad_norm,
        device=first.device,
    )


def _signal_reason(returncode) -> str:
    if returncode is not None and returncode < 0:
        return f"killed by signal {signal.Signals(-returncode).name}"
    return f"exit code {returncode}"


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the trial: its process group (torchrun, or the one rank) and every process below it. torchrun starts
    each rank in a session of its own (torch.distributed.elastic's ``SubprocessHandler``), so killing torchrun's
    group alone would leave the ranks running; their process trees are collected first, then all are killed."""
    ranks = _descendants(proc.pid)
    for pid in [proc.pid, *ranks]:
        try:
            os.killpg(pid, signal.SIGKILL)  # a rank leads its own group: its children (compile workers) too
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    proc.wait()


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), from /proc; [] where there is no /proc."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if "Setting OMP_NUM_THREADS" not in line and line.strip("* ")]
    return "\n".join(kept[-lines:])
