"""The typed contract between a trial's launcher (``autotune``'s local backend) and ``trials.trial.runner``.

The launcher writes a ``TrialSpec`` as JSON and starts ``python -m trials.trial.runner SPEC OUT_DIR`` (under torchrun
for several ranks); each rank writes a ``RankRecord`` as ``OUT_DIR/rank{r}.json``. Both sides import these
classes, so a field added on one side is known to the other.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from trials.stack.techniques import Techniques


@dataclass
class TrialSpec:
    """What one trial runs: a model config, a technique set, a length, how many steps, and a capacity."""

    model_config: dict
    techniques: Techniques
    seq_len: int
    steps: int = 2
    warmup: int = 1
    capacity_bytes: int | None = None  # per-rank capacity (--memory-gib): the tracker's on CPU, the allocator's on CUDA
    seed: int = 0
    compute_dtype: str | None = None  # "bf16" | "fp32"; None = the device's default (bf16 CUDA, fp32 CPU)
    collective_timeout_s: float = 600.0  # the process group's (NCCL watchdog's) timeout: above the longest step
    # reduced depth: shallower copies of the model to run instead of it, in order, each
    # {"runs": [[kind, layers], ...], "techniques": {...}, "timed": bool} (``trials.trial.segments.layer_runs``); a copy
    # not timed runs one step after priming the optimizer states (memory only), a timed one warm-up + steps too
    copies: list[dict] = field(default_factory=list)
    # the rank that records its memory timeline (``trials.trial.memory_timeline``) as OUT_DIR/timeline{rank}.pickle:
    # on CUDA the allocator's history of an untimed step after the warm-up (``runner.step_plan``), on the CPU the tracker's events of the whole
    # run (the model's, or the first copy's); None: no rank records one
    timeline_rank: int | None = None
    # the documents packed into each sequence (``trials.kernels.documents.DocumentsSpec.lengths``; empty: one)
    documents: list[int] = field(default_factory=list)
    # the LoRA adapters trained on the frozen model (``trials.models.lora.LoraSpec.to_json``; None: every weight)
    lora: dict | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # the techniques too: a dataclass, as its own to_dict gives

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialSpec:
        return cls(**dict(data, techniques=Techniques.from_dict(data["techniques"])))

    def write(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def read(cls, path: Path) -> TrialSpec:
        return cls.from_dict(json.loads(Path(path).read_text()))


def timeline_path(out_dir: Path, rank: int) -> Path:
    """Where rank ``rank`` of a trial writes its memory timeline (``TrialSpec.timeline_rank``)."""
    return Path(out_dir) / f"timeline{rank}.pickle"


@dataclass
class RankRecord:
    """One rank's measurement of a trial (DESIGN.md's result record fields, plus the rank and when it ended)."""

    status: str  # ok | oom | error
    seq_len: int | None
    rank: int
    source: str = "measured"
    device: str | None = None
    loss: float | None = None  # first step, mean over the global batch
    grad_norm: float | None = None
    error: str | None = None
    # memory, the quantities the oracle predicts (on the simulated CPU device all three peaks are the tracker's):
    peak_device_bytes: int = 0  # everything the process holds on the device: reserved + runtime_bytes
    peak_allocated_bytes: int = 0  # live tensors (CUDA: max_memory_allocated; the oracle's tensor peak)
    peak_reserved_bytes: int = 0  # the caching allocator's segments (CUDA: max_memory_reserved)
    runtime_bytes: int = 0  # CUDA context, library workspaces, NCCL buffers (outside the allocator)
    breakdown: dict[str, int] = field(default_factory=dict)  # live tensors by category at the tracker's peak
    host_bytes: int = 0  # peak host bytes the step holds (offloaded activations, shards, states)
    step_time_s: float | None = None  # mean of the measured steps
    tokens_per_s: float | None = None
    finished_at: float | None = None  # the launcher reports the earliest failure as the root cause
    layers: int | None = None  # decoder layers of the model that ran
    segments: list = field(default_factory=list)  # with runs: [phase, position, device_bytes, breakdown, host_bytes]
    copies: list[dict] = field(default_factory=list)  # reduced depth: one record (as a dict) per copy
    # a timed copy's step split along its layers (``trials.trial.layer_clock``), means over the measured steps:
    layer_times_s: list[float] = field(default_factory=list)  # forward + backward of each decoder layer
    tail_time_s: float | None = None  # gradient reduction, norm, optimizer: scales with the parameters
    parameters: int | None = None  # parameters this rank holds
    moe_routing: dict | None = None  # MoE models: the routing the steps saw (``trials.models.moe.routing_stats``)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RankRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def write(self, out_dir: Path) -> None:
        """Written whole or not at all (the launcher reads the records while the trial still runs)."""
        path = Path(out_dir) / f"rank{self.rank}.json"
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(self.to_dict()))
        os.replace(partial, path)

    @classmethod
    def read_all(cls, out_dir: Path) -> list[RankRecord]:
        return [cls.from_dict(json.loads(p.read_text())) for p in sorted(Path(out_dir).glob("rank*.json"))]
