"""What ``StepCounter`` counts over one training step on one rank: work per phase, collectives, optimizer."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field, fields
from typing import Any

PHASES = ("forward", "backward", "recompute", "optimizer", "other")
COMPUTE_PHASES = ("forward", "backward", "recompute", "other")


@dataclass
class PhaseCounts:
    """Work of one phase of the step."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0  # forward attention kernels (unmasked pairs only)
    attention_bwd_flops: float = 0.0  # backward attention kernels
    attention_dense_flops: float = 0.0  # what forward + backward would cost without the causal saving
    elementwise_bytes: float = 0.0  # output bytes of memory-bound ops
    ops: int = 0  # ops that do work (kernel launches)
    views: int = 0  # dispatched ops that do no work (views, detach, metadata)
    d2h_bytes: float = 0.0  # device -> host copies (activation offload, grad offload)
    h2d_bytes: float = 0.0  # host -> device copies hidden behind compute (param offload)
    waited_h2d_bytes: float = 0.0  # host -> device copies the step waits for (activation offload's inputs back)

    def add(self, other: PhaseCounts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class CollectiveCounts:
    """All calls of one kind of collective in one phase."""

    calls: int = 0
    bytes: float = (
        0.0  # tensor bytes of the call (input for all-to-all/reduce-scatter/all-reduce, output for all-gather)
    )
    wire_bytes: float = 0.0  # bytes this rank sends over its link (algorithmic factor applied)
    max_wire_bytes: float = 0.0


@dataclass
class StepCounts:
    """Everything ``StepCounter`` counted over one step on one rank."""

    phases: dict[str, PhaseCounts] = field(default_factory=lambda: {p: PhaseCounts() for p in PHASES})
    # key: "<kind>/<phase>/<fsdp|sync>/<group size>", kind in all_to_all, all_gather, reduce_scatter, all_reduce,
    # other (counts from before group sizes were kept have no "/<group size>")
    collectives: dict[str, CollectiveCounts] = field(default_factory=dict)
    optimizer_params: int = 0  # elements stepped by the optimizer on this rank
    optimizer_param_bytes: int = 0  # their bytes (master dtype)
    fsdp_all_gather_input_numel: dict[str, int] = field(default_factory=dict)  # per phase: the sharded params
    fsdp_reduce_scatter_output_bytes: dict[str, int] = field(default_factory=dict)  # per phase: sharded grads
    fsdp_h2d_bytes: float = 0.0  # host->device copies seen inside FSDP (offloaded shards; CUDA only)
    fsdp_d2h_bytes: dict[str, float] = field(default_factory=dict)  # per phase: FSDP's offloaded gradients
    first_fsdp_all_gather_wire_bytes: float = 0.0
    last_fsdp_reduce_scatter_wire_bytes: float = 0.0
    # fused attention calls grouped by shape (``attention_key``) -> batch*heads summed
    attention_calls: dict[str, float] = field(default_factory=dict)
    seq_len: int | None = None
    steps: int = 1

    # -- totals --------------------------------------------------------------------------------------------
    def total(self, name: str, phases=PHASES) -> float:
        return sum(getattr(self.phases[p], name) for p in phases)

    @property
    def matmul_flops(self) -> float:
        return self.total("matmul_flops")

    @property
    def attention_flops(self) -> float:
        return self.total("attention_flops") + self.total("attention_bwd_flops")

    def collective(
        self, kind: str | None = None, phase: str | None = None, fsdp: bool | None = None, group_size: int | None = None
    ) -> CollectiveCounts:
        """The calls that match, summed (``group_size``: only those over groups of that many ranks)."""
        out = CollectiveCounts()
        for key, c in self.collectives.items():
            k, p, f, size = _parts(key)
            if (
                (kind is None or k == kind)
                and (phase is None or p == phase)
                and (fsdp is None or (f == "fsdp") == fsdp)
                and (group_size is None or size == group_size)
            ):
                out.calls += c.calls
                out.bytes += c.bytes
                out.wire_bytes += c.wire_bytes
                out.max_wire_bytes = max(out.max_wire_bytes, c.max_wire_bytes)
        return out

    def by_group(self, kind: str | None = None, fsdp: bool | None = None) -> dict[int | None, CollectiveCounts]:
        """The matching collectives summed per process-group size (None: counted before sizes were kept)."""
        out: dict[int | None, CollectiveCounts] = {}
        for key, c in self.collectives.items():
            k, _, f, size = _parts(key)
            if (kind is None or k == kind) and (fsdp is None or (f == "fsdp") == fsdp):
                total = out.setdefault(size, CollectiveCounts())
                total.calls += c.calls
                total.bytes += c.bytes
                total.wire_bytes += c.wire_bytes
                total.max_wire_bytes = max(total.max_wire_bytes, c.max_wire_bytes)
        return out

    def by_phase(self, kind: str) -> dict[str, CollectiveCounts]:
        """The collectives of ``kind`` summed per phase (every group size, sync and FSDP)."""
        out: dict[str, CollectiveCounts] = {}
        for key, c in self.collectives.items():
            k, phase, _, _ = _parts(key)
            if k == kind:
                total = out.setdefault(phase, CollectiveCounts())
                total.calls += c.calls
                total.bytes += c.bytes
                total.wire_bytes += c.wire_bytes
                total.max_wire_bytes = max(total.max_wire_bytes, c.max_wire_bytes)
        return out

    def collective_calls(self) -> int:
        """Collective calls over groups of several ranks (sync and FSDP; sizes unknown counted)."""
        return sum(c.calls for size, c in self.by_group().items() if size is None or size > 1)

    def scaled(self, factor: float) -> StepCounts:
        """Counts divided by ``factor`` (e.g. the number of steps traced)."""
        out = copy.deepcopy(self)
        for pc in out.phases.values():
            for f in fields(pc):
                setattr(pc, f.name, type(getattr(pc, f.name))(getattr(pc, f.name) / factor))
        for c in out.collectives.values():
            c.calls = int(round(c.calls / factor))
            c.bytes /= factor
            c.wire_bytes /= factor
        out.attention_calls = {k: v / factor for k, v in out.attention_calls.items()}
        out.optimizer_params = int(out.optimizer_params / factor)
        out.optimizer_param_bytes = int(out.optimizer_param_bytes / factor)
        out.fsdp_all_gather_input_numel = {k: int(v / factor) for k, v in out.fsdp_all_gather_input_numel.items()}
        out.fsdp_reduce_scatter_output_bytes = {
            k: int(v / factor) for k, v in out.fsdp_reduce_scatter_output_bytes.items()
        }
        out.steps = 1
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepCounts:
        data = dict(data)
        data["phases"] = {p: PhaseCounts(**v) for p, v in data.get("phases", {}).items()}
        for p in PHASES:
            data["phases"].setdefault(p, PhaseCounts())
        data["collectives"] = {k: CollectiveCounts(**v) for k, v in data.get("collectives", {}).items()}
        return cls(**data)

    def summary(self) -> str:
        lines = []
        for p in PHASES:
            c = self.phases[p]
            lines.append(
                f"{p:9s} matmul {c.matmul_flops / 1e9:10.3f} GF  attn {c.attention_flops / 1e9:9.3f}+"
                f"{c.attention_bwd_flops / 1e9:9.3f} GF  elementwise {c.elementwise_bytes / 1e6:10.2f} MB"
                f"  ops {c.ops:6d}  d2h {c.d2h_bytes / 1e6:8.2f} MB  h2d {c.h2d_bytes / 1e6:8.2f} MB"
            )
        for key, c in sorted(self.collectives.items()):
            lines.append(
                f"{key:32s} calls {c.calls:5d}  bytes {c.bytes / 1e6:10.3f} MB  wire {c.wire_bytes / 1e6:10.3f} MB"
            )
        lines.append(f"optimizer params {self.optimizer_params:,} ({self.optimizer_param_bytes:,} bytes)")
        return "\n".join(lines)


def attention_key(
    phase: str, backward: bool, sq: int, sk: int, d: int, dv: int, causal: bool, window: int | None
) -> str:
    """A ``StepCounts.attention_calls`` key: ``phase|fwd or bwd|sq|sk|d|dv|causal|window`` (window 0: none)."""
    return f"{phase}|{'bwd' if backward else 'fwd'}|{sq}|{sk}|{d}|{dv}|{int(causal)}|{window or 0}"


def attention_key_parts(key: str) -> tuple[str, bool, int, int, int, int, bool, int | None]:
    """(phase, backward, sq, sk, d, dv, causal, window or None) of an ``attention_key``; keys without the
    window field (counts from before windows were kept) have none."""
    phase, direction, sq, sk, d, dv, causal, *rest = key.split("|")
    window = int(rest[0]) if rest else 0
    return phase, direction == "bwd", int(sq), int(sk), int(d), int(dv), bool(int(causal)), window or None


def _parts(key: str) -> tuple[str, str, str, int | None]:
    """(kind, phase, fsdp|sync, group size or None) of a ``StepCounts.collectives`` key."""
    parts = key.split("/")
    return parts[0], parts[1], parts[2], int(parts[3]) if len(parts) > 3 else None
