"""The time model: ``predict_step_time(counts, rates, world_size, techniques)`` turns one rank's ``StepCounts``
(``autotune.timing.counting``) into a predicted step time.

A small roofline-style model, every rate and efficiency a named field of the hardware preset
(``autotune.core.hardware.Rates``), documented in docs/predictions.md:

       t_phase  = matmul_flops / (peak * matmul_efficiency)
                + attention_fwd_flops / (peak * attention_efficiency)
                + attention_bwd_flops / (peak * attention_backward_efficiency)
                + elementwise_bytes * elementwise_traffic_factor / (hbm * elementwise_efficiency)
                (+ ops * op_overhead_s, added -- or as a floor, when launches overlap compute: GPUs)
       stalled comm   = sum over non-FSDP collectives (wire bytes / (link * eff) + latency)     -> exposed
                        (link: NVLink inside a node; a group spanning nodes is bound by the NICs: ``_transfer_time``)
       FSDP comm      = same for FSDP's; hidden behind compute up to the compute time (side streams) except
                        the first all-gather and the last reduce-scatter
       host transfers = (d2h, h2d) / host link per direction, per phase; hidden behind that phase's compute,
                        but activation offload's inputs back (``waited_h2d_bytes``), which the next layer waits for
       optimizer      = optimizer bytes / host_optimizer_bytes_per_s (offloaded) or as elementwise (device)
       step_time      = compute + recompute + exposed comm + exposed host + optimizer

       ring transfers = K/V (and dK/dV) sends to the next ring rank, hidden behind each ring step's attention
                        but the last (``ring_transfer_time``), NVLink inside a node, the NIC across nodes
   ``tokens_per_s = seq_len * dp_size / step_time`` with ``dp_size = world_size / (ulysses_degree x ring_degree)``.

The ``cpu`` preset's rates come from a calibration (``autotune calibrate``; the preset ships a typical
machine's) so predictions can be checked against real CPU trials (bench/throughput_fidelity.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from autotune.core.hardware import Rates
from autotune.timing.attention_cost import tiled_pairs
from autotune.timing.counts import COMPUTE_PHASES, CollectiveCounts, PhaseCounts, StepCounts, attention_key_parts
from trials.stack.techniques import Techniques


@dataclass
class TimeBreakdown:
    """Predicted step time and where it goes (seconds per step, one rank; ranks run in lockstep)."""

    step_time_s: float
    tokens_per_s: float | None
    compute_s: float  # forward + backward (+ small "other" work), incl. per-op overhead
    recompute_s: float  # activation checkpointing / tiling recompute
    exposed_comm_s: float  # collectives not hidden behind compute
    exposed_host_s: float  # host<->device copies not hidden behind compute
    optimizer_s: float  # the optimizer step (host or device)
    detail: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def table(self) -> str:
        rows = [
            ("step", self.step_time_s),
            ("compute", self.compute_s),
            ("recompute", self.recompute_s),
            ("exposed comm", self.exposed_comm_s),
            ("exposed host", self.exposed_host_s),
            ("optimizer", self.optimizer_s),
        ]
        return "  ".join(f"{k} {v:.4g}s" for k, v in rows)


def attention_time(counts: StepCounts, phases, r: Rates) -> float | None:
    """Seconds of the fused attention calls in ``phases``, from their shapes; None when no shapes were kept."""
    if not counts.attention_calls:
        return None
    total = 0.0
    for key, bh in counts.attention_calls.items():
        phase, backward, sq, sk, d, dv, causal, window = attention_key_parts(key)
        if phase not in phases:
            continue
        per_pair = (6 * d + 4 * dv) if backward else (2 * d + 2 * dv)
        flops = bh * tiled_pairs(sq, sk, causal, r.attention_tile_q, r.attention_tile_kv, window) * per_pair
        total += flops / (r.bf16_flops * r.attention_eff(d, backward))
    return total


def work_by_kind(pc: PhaseCounts, r: Rates, attention_s: float | None = None) -> dict[str, float]:
    """Device work seconds of one phase by kind: matmul, attention (``attention_s`` when the calls' shapes were
    kept, else the forward FLOPs at the flat efficiency, with the backward's under ``attention_backward``) and
    elementwise. Summed in this order, they are the phase's work."""
    work = {"matmul": 0.0, "attention": 0.0, "attention_backward": 0.0, "elementwise": 0.0}
    if pc.matmul_flops:
        work["matmul"] = pc.matmul_flops / (r.bf16_flops * r.matmul_efficiency)
    if attention_s is not None:
        work["attention"] = attention_s
    else:
        if pc.attention_flops:
            work["attention"] = pc.attention_flops / (r.bf16_flops * r.attention_efficiency)
        if pc.attention_bwd_flops:
            work["attention_backward"] = pc.attention_bwd_flops / (r.bf16_flops * r.attention_backward_efficiency)
    if pc.elementwise_bytes:
        work["elementwise"] = (
            pc.elementwise_bytes * r.elementwise_traffic_factor / (r.hbm_bytes_per_s * r.elementwise_efficiency)
        )
    return work


def host_overhead_s(pc: PhaseCounts, r: Rates) -> float:
    """Host seconds of one phase's dispatches (per-op and per-view overhead)."""
    return pc.ops * r.op_overhead_s + pc.views * r.view_overhead_s


def _phase_time(pc: PhaseCounts, r: Rates, attention_s: float | None = None) -> tuple[float, float]:
    """(device work seconds, host overhead seconds) of one phase."""
    return sum(work_by_kind(pc, r, attention_s).values()), host_overhead_s(pc, r)


def _combine(work: float, overhead: float, r: Rates) -> float:
    return max(work, overhead) if r.launch_overlaps_compute else work + overhead


def group_layout(group_size: int | None, world_size: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(nodes, fewest ranks on one node) of the worst-placed process group of ``group_size`` ranks.

    Groups are consecutive ranks starting at multiples of their size (``trials.core.dist``: Ulysses groups; the FSDP /
    data-parallel group is every rank), ranks fill nodes of ``gpus_per_node`` in order (torchrun), and ranks run
    in lockstep, so the group that spans most nodes with fewest ranks on one of them sets the pace. (1, size)
    when the job is one node, or the group size is unknown (counts from before sizes were kept)."""
    if not group_size or not gpus_per_node or world_size <= gpus_per_node:
        return 1, group_size or 1
    worst = (1, group_size)
    for start in range(0, max(world_size, group_size), group_size):
        per_node: dict[int, int] = {}
        for rank in range(start, start + group_size):
            per_node[rank // gpus_per_node] = per_node.get(rank // gpus_per_node, 0) + 1
        layout = (len(per_node), min(per_node.values()))
        if layout[0] > 1 and (layout[0], -layout[1]) > (worst[0], -worst[1]):
            worst = layout
    return worst


def _collective_time(
    c: CollectiveCounts,
    kind: str,
    r: Rates,
    group_size: int | None = None,
    world_size: int = 1,
    gpus_per_node: int | None = None,
) -> float:
    if not c.calls:
        return 0.0
    return _transfer_time(c.wire_bytes, kind, r, group_size, world_size, gpus_per_node) + c.calls * _latency(
        r, group_size, world_size, gpus_per_node
    )


def _efficiency(kind: str, r: Rates) -> float:
    return {
        "all_to_all": r.all_to_all_efficiency,
        "all_gather": r.all_gather_efficiency,
        "reduce_scatter": r.reduce_scatter_efficiency,
    }.get(kind, r.all_reduce_efficiency)


def _spans_fabric(r: Rates, group_size: int | None, world_size: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(nodes, fewest ranks on one node) of the group when it crosses an inter-node fabric, else (1, size)."""
    if not r.inter_node_bytes_per_s:  # no fabric of its own (cpu: "nodes" on one machine): the intra-node link
        return 1, group_size or 1
    return group_layout(group_size, world_size, gpus_per_node)


def _latency(r: Rates, group_size: int | None, world_size: int, gpus_per_node: int | None) -> float:
    nodes, _ = _spans_fabric(r, group_size, world_size, gpus_per_node)
    return (r.inter_node_latency_s or r.collective_latency_s) if nodes > 1 else r.collective_latency_s


def _transfer_time(
    wire_bytes: float,
    kind: str,
    r: Rates,
    group_size: int | None = None,
    world_size: int = 1,
    gpus_per_node: int | None = None,
) -> float:
    """Seconds to move ``wire_bytes`` (this rank's share, the algorithmic factor applied) of a ``kind`` collective
    over a group of ``group_size`` ranks.

    Inside a node: the NVLink/NVSwitch link at the kind's efficiency. Across nodes (docs/predictions.md, "Several
    nodes"), with one NIC per GPU (``inter_node_bytes_per_s``) and ``local`` = the group's fewest ranks on one node:
      - all-to-all: each rank sends (local-1)/(P-1) of its wire bytes over NVLink and (P-local)/(P-1) through its own
        NIC, at once; the NIC share bounds it (an all-to-all cannot aggregate several NICs: nccl-tests #130, #267);
      - ring / tree collectives (all-gather, reduce-scatter, all-reduce): NCCL runs one channel per NIC, so each
        ring crosses a node boundary through a different NIC: the node's ``local`` NICs carry the wire bytes
        together (wire / (local x NIC)), while every rank also moves its wire bytes over NVLink.
    """
    eff = _efficiency(kind, r)
    intra = r.intra_node_bytes_per_s * eff
    nodes, local = _spans_fabric(r, group_size, world_size, gpus_per_node)
    if nodes <= 1:
        return wire_bytes / intra
    nic = r.inter_node_bytes_per_s * r.inter_node_efficiency
    size = group_size or 1
    if kind == "all_to_all":
        return max(
            wire_bytes * (local - 1) / max(1, size - 1) / intra, wire_bytes * (size - local) / max(1, size - 1) / nic
        )
    return max(wire_bytes / intra if local > 1 else 0.0, wire_bytes / (local * nic))


def ring_crosses_nodes(techniques: Techniques, world_size: int, gpus_per_node: int | None) -> bool:
    """Whether a ring's hops cross nodes: ring neighbours are ``ulysses_degree`` ranks apart (``trials.core.dist``),
    so every context-parallel group of more ranks than a node holds has a hop between nodes, and ranks run in
    lockstep."""
    cp = techniques.ulysses_degree * techniques.ring_degree
    return bool(gpus_per_node) and world_size > gpus_per_node and cp > gpus_per_node


def ring_transfer_time(
    counts: StepCounts, r: Rates, techniques: Techniques, world_size: int, gpus_per_node: int | None
) -> tuple[float, float]:
    """(seconds of the ring's point-to-point transfers, seconds of them not hidden) per step.

    Each ring step sends the K/V it holds to the next rank while it computes attention on them (in backward also
    the dV accumulator), so a step costs max(attention on the chunk, transfer): per phase the transfers hide
    behind the attention of every ring step but the last, ``attention x (R-1)/R``. In backward a layer makes
    2R-1 such transfers (R-1 of K/V, R of dV) and the last has nothing after it: at least 1/(2R-1) of them shows.
    The dK accumulator's R sends are waited at once (``p2p_waited``: one fp32 buffer fewer in flight), so they
    all show. A hop inside a node moves over NVLink; a hop across nodes through the sending rank's own NIC
    (``ring_crosses_nodes``), its latency the fabric's."""
    ring = techniques.ring_degree
    if ring <= 1:
        return 0.0, 0.0
    crosses = ring_crosses_nodes(techniques, world_size, gpus_per_node) and bool(r.inter_node_bytes_per_s)
    link = (
        r.inter_node_bytes_per_s * r.inter_node_efficiency
        if crosses
        else r.intra_node_bytes_per_s * _efficiency("other", r)
    )
    latency = (r.inter_node_latency_s or r.collective_latency_s) if crosses else r.collective_latency_s
    total = exposed = 0.0
    for phase, c in counts.by_phase("p2p").items():
        seconds = c.wire_bytes / link + c.calls * latency
        hidden = (attention_time(counts, (phase,), r) or 0.0) * (ring - 1) / ring
        floor = seconds / (2 * ring - 1) if phase == "backward" else 0.0
        total += seconds
        exposed += max(floor, seconds - hidden)
    for c in counts.by_phase("p2p_waited").values():
        seconds = c.wire_bytes / link + c.calls * latency
        total += seconds
        exposed += seconds
    return total, exposed


def predict_step_time(
    counts: StepCounts,
    rates: Rates,
    world_size: int,
    techniques: Techniques,
    seq_len: int | None = None,
    gpus_per_node: int | None = None,
) -> TimeBreakdown:
    """Predicted time of one training step from ``counts`` (one rank's ``StepCounts``) at ``rates``
    (``Hardware.rates_for(world_size)``). ``techniques`` gives the Ulysses degree (tokens/s) and where the
    optimizer runs. ``gpus_per_node``: ranks per node of a job over several nodes (None: one node), so
    collectives whose group spans nodes are priced on the inter-node fabric. See the module docstring and
    docs/predictions.md for the model and its assumptions.
    """
    r = rates.for_kernel(techniques.attention, techniques.head_chunk)
    degree = techniques.ulysses_degree
    offload_optimizer = techniques.optimizer_offload
    seq_len = seq_len if seq_len is not None else counts.seq_len

    phase_t = {}
    detail: dict[str, float] = {}
    for p in COMPUTE_PHASES:
        work, overhead = _phase_time(counts.phases[p], r, attention_time(counts, (p,), r))
        phase_t[p] = _combine(work, overhead, r)
        detail[f"{p}_work_s"] = work
        detail[f"{p}_overhead_s"] = overhead
    compute = phase_t["forward"] + phase_t["backward"] + phase_t["other"]
    recompute = phase_t["recompute"]
    busy = compute + recompute

    # collectives: FSDP's overlap compute on side streams, the rest stall
    sync = 0.0
    kinds = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce", "other")
    layout = {"world_size": world_size, "gpus_per_node": gpus_per_node}
    for kind in kinds:
        t = sum(_collective_time(c, kind, r, size, **layout) for size, c in counts.by_group(kind, fsdp=False).items())
        detail[f"{kind}_sync_s"] = t
        sync += t
    ring_s, ring_exposed = ring_transfer_time(counts, r, techniques, world_size, gpus_per_node)
    detail["ring_transfer_s"] = ring_s
    detail["ring_exposed_s"] = ring_exposed
    sync += ring_exposed
    fsdp_total = 0.0
    for kind in kinds:
        t = sum(_collective_time(c, kind, r, size, **layout) for size, c in counts.by_group(kind, fsdp=True).items())
        detail[f"{kind}_fsdp_s"] = t
        fsdp_total += t
    first_last = 0.0
    if fsdp_total:
        # the first all-gather of forward and the last reduce-scatter of backward have nothing to hide behind
        # (FSDP's group is every rank)
        first_last = (
            _transfer_time(counts.first_fsdp_all_gather_wire_bytes, "all_gather", r, world_size, **layout)
            + _transfer_time(counts.last_fsdp_reduce_scatter_wire_bytes, "reduce_scatter", r, world_size, **layout)
            + 2 * _latency(r, world_size, **layout)
        )
        first_last = min(first_last, fsdp_total)
    hideable = max(0.0, fsdp_total - first_last)
    fsdp_exposed = first_last + max(0.0, hideable - r.side_stream_overlap * busy)
    # every collective call is a rendezvous: the rank that got there first waits for the other. Priced per call
    # (``collective_wait_s``, which the calibration fits per world size; docs/validation.md, "Time model", shows
    # multi-rank trials against it)
    waiting = r.collective_wait_s * counts.collective_calls() if world_size > 1 else 0.0
    exposed_comm = sync + fsdp_exposed + waiting
    detail["fsdp_total_s"] = fsdp_total
    detail["rank_wait_s"] = waiting

    # host <-> device copies, per phase, each direction on its own; hidden behind the same phase's compute
    host_bw = r.host_bytes_per_s * r.host_copy_efficiency
    d2h = {p: counts.phases[p].d2h_bytes for p in COMPUTE_PHASES}
    h2d = {p: counts.phases[p].h2d_bytes for p in COMPUTE_PHASES}
    if r.device_is_host:
        # FSDP marks its offloaded gradients as host memory, but on a CPU device no copy happens
        for p, nbytes in counts.fsdp_d2h_bytes.items():
            d2h[_compute_phase(p)] = max(0.0, d2h.get(_compute_phase(p), 0) - nbytes)
    elif offload_optimizer and not counts.fsdp_h2d_bytes:
        # CPU path (everything is "cpu"): FSDP2's host->device copy of each offloaded shard before its
        # all-gather is a no-op ``.to(device)``, invisible. It copies the master (fp32) shard: all-gather input
        # elements x master itemsize. (The sharded gradients going to the host are seen: FSDP marks them.)
        itemsize = (counts.optimizer_param_bytes / counts.optimizer_params) if counts.optimizer_params else 4
        for p, numel in counts.fsdp_all_gather_input_numel.items():
            h2d[_compute_phase(p)] = h2d.get(_compute_phase(p), 0) + numel * itemsize
    host_total = 0.0
    exposed_host = 0.0
    fwd_busy = phase_t["forward"] + phase_t["other"]
    bwd_busy = phase_t["backward"] + phase_t["recompute"]
    for group, busy_t in ((("forward", "other"), fwd_busy), (("backward", "recompute"), bwd_busy)):
        t = max(sum(d2h.get(p, 0) for p in group), sum(h2d.get(p, 0) for p in group)) / host_bw
        host_total += t
        exposed_host += max(0.0, t - r.side_stream_overlap * busy_t)
    # activation offload's layer inputs come back once the layer after them is done: the next layer waits for them
    waited = sum(counts.phases[p].waited_h2d_bytes for p in COMPUTE_PHASES)
    host_total += waited / host_bw
    exposed_host += waited / host_bw
    detail["host_transfer_s"] = host_total
    detail["host_d2h_bytes"] = float(sum(d2h.values()))
    detail["host_h2d_bytes"] = float(sum(h2d.values()) + waited)
    detail["host_waited_h2d_bytes"] = float(waited)

    # the optimizer step
    opt = counts.phases["optimizer"]
    if offload_optimizer or r.device_is_host:
        optimizer = (
            opt.elementwise_bytes / r.host_optimizer_bytes_per_s
            + opt.ops * r.op_overhead_s
            + opt.views * r.view_overhead_s
        )
    else:
        work, overhead = _phase_time(opt, r, 0.0)
        optimizer = _combine(work, overhead, r)

    step = compute + recompute + exposed_comm + exposed_host + optimizer
    dp = max(1, world_size // (degree * techniques.ring_degree))
    tokens_per_s = seq_len * dp / step if seq_len and step > 0 else None
    return TimeBreakdown(
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        compute_s=compute,
        recompute_s=recompute,
        exposed_comm_s=exposed_comm,
        exposed_host_s=exposed_host,
        optimizer_s=optimizer,
        detail=detail,
    )


def _compute_phase(phase: str) -> str:
    return phase if phase in COMPUTE_PHASES else "other"
