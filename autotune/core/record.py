"""The result record: what one evaluation (predicted or measured) of one config at one length says."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

STATUSES = ("ok", "oom", "error", "timeout")
BREAKDOWN_CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "other")


@dataclass
class ResultRecord:
    """One row of ``trials.parquet`` and the ``--json`` of estimate/trial (DESIGN.md, result record)."""

    status: str
    source: str  # "predicted" | "measured"
    seq_len: int
    tokens_per_s: float | None = None
    step_time_s: float | None = None
    # memory per rank, the same quantities predicted and measured (DESIGN.md, result record):
    peak_device_bytes: int | None = None  # all the process holds on the device (what capacity is compared with):
    # reserved + CUDA context/NCCL (measured; predicted: the preset's)
    peak_allocated_bytes: int | None = None  # live tensors (torch.cuda.max_memory_allocated; the oracle's tensor peak)
    peak_reserved_bytes: int | None = None  # the caching allocator's segments (max_memory_reserved; predicted:
    # tensor peak + the preset's fragmentation)
    host_bytes: int | None = None  # host memory the step holds (offloaded activations, shards, states)
    breakdown: dict[str, int] = field(default_factory=dict)
    loss: float | None = None
    grad_norm: float | None = None
    device: str | None = None
    error: str | None = None
    measured_layers: int | None = None  # a reduced-depth real trial: the decoder layers that ran (extended to
    # the model's depth); None at full depth and for predictions

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ResultRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})

    @property
    def fits(self) -> bool:
        return self.status == "ok"
