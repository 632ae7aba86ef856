"""Mixture-of-experts layers with shapes the memory oracle can trace.

Transformers' MoE models (Qwen3-MoE, Mixtral, ...) hold their experts as 3-D parameters (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]) in a module whose forward(hidden [T, H], top_k_index [T, k],
top_k_weights [T, k]) dispatches by ``config._experts_implementation``. HF's ``eager`` one finds each expert's
tokens with ``nonzero``/``where``, shapes that depend on the data, which FakeTensorMode cannot run. The
implementation registered here as ``autotune`` sorts the T*k (token, slot) pairs by expert (stable), gathers
their rows once, runs each expert's MLP on its contiguous slice and ``index_add_``s the weighted result back:
the same values as ``eager``, with the per-expert counts (``bincount(...).tolist()``) the only data-dependent
quantity.

``balanced_routing`` replaces those counts with a stated static routing (each expert T*k/E pairs, or one hot
expert at ``capacity_factor`` times that), so the oracle traces a step with fixed shapes: its memory is that of
the stated routing, not the router's (``routing_description``). Outside it the real counts are used and their
maximum is recorded (``routing_stats``), so a trial reports how far its routing was from balanced.
"""

from __future__ import annotations

import contextlib
import math
from fractions import Fraction

import torch
import torch.nn.functional as F

EXPERTS_IMPLEMENTATION = "autotune"


def is_moe_config(config) -> bool:
    """An HF config with routed experts (Qwen3-MoE's ``num_experts``, Mixtral's ``num_local_experts``)."""
    return any((getattr(config, name, None) or 0) > 0 for name in ("num_experts", "num_local_experts"))


def is_experts_module(module) -> bool:
    """A module of a class decorated with transformers' ``use_experts_implementation``."""
    return all(hasattr(module, name) for name in ("has_gate", "is_transposed", "_apply_gate", "num_experts"))


def is_router_module(module) -> bool:
    """An MoE router (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``): its ``weight`` is a plain [E, H] Parameter."""
    return type(module).__name__.endswith("Router")


def register() -> None:
    """Make ``experts_implementation="autotune"`` known to transformers (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, experts_forward)


# -- routing: the router's, or a stated static one ---------------------------------------------------------------


def _check_capacity(capacity_factor: float) -> None:
    if not capacity_factor >= 1.0:
        raise ValueError(f"capacity_factor must be >= 1, got {capacity_factor}")


def balanced_counts(slots: int, experts: int, capacity_factor: float = 1.0) -> list[int]:
    """(token, slot) pairs per expert of the static routing: expert 0 gets min(slots, ceil(c * slots / experts))
    and the others share the rest evenly, the remainder one each to the first of them. With c = 1 that is the
    even split (remainder to the first experts); with c > 1 expert 0 is the worst-case hot expert."""
    _check_capacity(capacity_factor)
    hot = min(slots, math.ceil(Fraction(repr(float(capacity_factor))) * slots / experts))
    if experts == 1:
        return [slots]
    base, extra = divmod(slots - hot, experts - 1)
    return [hot] + [base + 1] * extra + [base] * (experts - 1 - extra)


class BalancedRouting:
    """A static routing in force (``balanced_routing``); remembers the largest call made under it."""

    def __init__(self, capacity_factor: float):
        _check_capacity(capacity_factor)
        self.capacity_factor = float(capacity_factor)
        self.largest: tuple[int, int, int] | None = None  # (slots, experts, top_k)

    def counts(self, slots: int, experts: int, top_k: int) -> list[int]:
        if self.largest is None or slots > self.largest[0]:
            self.largest = (slots, experts, top_k)
        return balanced_counts(slots, experts, self.capacity_factor)

    def description(self) -> str:
        c = f"{self.capacity_factor:g}"
        if self.largest is None:
            return f"static routing, capacity factor {c} (no MoE layer ran)"
        slots, experts, top_k = self.largest
        counts = balanced_counts(slots, experts, self.capacity_factor)
        shape = f"({experts} experts, top-{top_k})"
        if self.capacity_factor == 1.0 or experts == 1:
            return f"balanced: {_span(counts)} of {slots} token slots per expert {shape}"
        return (
            f"hot expert (capacity factor {c}): {counts[0]} of {slots} token slots on one expert, "
            f"{_span(counts[1:])} on each other {shape}"
        )


def _span(counts: list[int]) -> str:
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


class _Routing:
    active: BalancedRouting | None = None  # the static routing in force, None: the router's
    last: BalancedRouting | None = None  # the most recent static routing (described after it ends)
    stats: dict | None = None  # real routing seen since ``reset_routing_stats``


@contextlib.contextmanager
def balanced_routing(capacity_factor: float = 1.0):
    """While inside, experts ignore the router's indices for shapes and use ``balanced_counts``: the sorted pair
    j goes to the expert whose static slice holds position j. Static shapes: a step runs under FakeTensorMode."""
    routing = BalancedRouting(capacity_factor)
    saved = _Routing.active
    _Routing.active = _Routing.last = routing
    try:
        yield routing
    finally:
        _Routing.active = saved


def routing_description() -> str:
    """One line for the routing in force (or the last static one, once it ended), e.g.
    "balanced: 6144 of 49152 token slots per expert (8 experts, top-2)"."""
    routing = _Routing.active or _Routing.last
    return routing.description() if routing is not None else "the router's own (data-dependent per-expert counts)"


def reset_routing_stats() -> None:
    _Routing.stats = None


def routing_stats() -> dict | None:
    """The real routing since ``reset_routing_stats`` (calls under ``balanced_routing`` excluded), maxima over
    the calls: {"max_tokens_per_expert", "balanced_tokens_per_expert" (T*k/E of the largest call), "experts",
    "top_k"}; None when no MoE layer ran."""
    return dict(_Routing.stats) if _Routing.stats is not None else None


def _record(counts: list[int], slots: int, experts: int, top_k: int) -> None:
    stats = _Routing.stats or {"max_tokens_per_expert": 0, "balanced_tokens_per_expert": 0.0}
    stats["max_tokens_per_expert"] = max(stats["max_tokens_per_expert"], max(counts))
    stats["balanced_tokens_per_expert"] = max(stats["balanced_tokens_per_expert"], slots / experts)
    stats["experts"], stats["top_k"] = experts, top_k
    _Routing.stats = stats


def _expert_counts(expert_ids: torch.Tensor, slots: int, experts: int, top_k: int) -> list[int]:
    if _Routing.active is not None:
        return _Routing.active.counts(slots, experts, top_k)
    from torch._subclasses.fake_tensor import is_fake

    if is_fake(expert_ids) or expert_ids.device.type == "meta":
        raise RuntimeError(
            "MoE experts without real routing: the per-expert token counts depend on the data; "
            "trace under trials.moe.balanced_routing()"
        )
    counts = torch.bincount(expert_ids, minlength=experts).tolist()
    if len(counts) != experts:
        raise ValueError(f"router chose expert {len(counts) - 1}, the layer has {experts}")
    _record(counts, slots, experts, top_k)
    return counts


# -- the experts implementation ------------------------------------------------------------------------------------


def _check_layout(module) -> None:
    """Layouts HF's own grouped implementations handle (gate or not, bias or not, [E, out, in] or transposed,
    the gate as the class's ``_apply_gate``); expert parallelism (sentinel expert ids) is not supported."""
    weights = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    if getattr(module, "_is_expert_parallel", False):
        raise ValueError(f"{type(module).__name__}: the autotune experts implementation has no expert parallelism")
    missing = [name for name in weights if getattr(module, name, None) is None or getattr(module, name).dim() != 3]
    if missing:
        raise ValueError(
            f"{type(module).__name__}: the autotune experts implementation needs 3-D {', '.join(weights)} "
            f"([experts, out, in], or [experts, in, out] when transposed); missing or not 3-D: {', '.join(missing)}"
        )


def _linear(x, weights, index: int, bias, transposed: bool):
    weight = weights[index]
    return F.linear(x, weight.T if transposed else weight, None if bias is None else bias[index])


def _expert_mlp(module, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert's MLP on its rows x [n, H] -> [n, H], as HF's batched/grouped implementations compute it."""
    bias = module.has_bias
    if module.has_gate:
        h = _linear(x, module.gate_up_proj, expert, module.gate_up_proj_bias if bias else None, module.is_transposed)
        h = module._apply_gate(h)
    else:
        h = _linear(x, module.up_proj, expert, module.up_proj_bias if bias else None, module.is_transposed)
        h = module.act_fn(h)
    h = _linear(h, module.down_proj, expert, module.down_proj_bias if bias else None, module.is_transposed)
    return module.post_expert_norm(h) if getattr(module, "has_post_expert_norm", False) else h


def experts_forward(module, hidden_states, top_k_index, top_k_weights):
    """hidden [T, H], top_k_index / top_k_weights [T, k] -> [T, H]: sum over the k chosen experts of weight *
    expert(hidden). Pairs are sorted by expert (stable), so expert e's rows are one contiguous slice."""
    _check_layout(module)
    tokens, top_k = top_k_index.shape
    experts, slots = module.num_experts, tokens * top_k
    expert_ids = top_k_index.reshape(-1)
    order = torch.sort(expert_ids, stable=True).indices
    counts = _expert_counts(expert_ids, slots, experts, top_k)
    token_index = order // top_k
    weights = top_k_weights.reshape(-1)[order]
    rows = hidden_states[token_index]  # [T*k, H], grouped by expert
    out = torch.zeros_like(hidden_states)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        stop = start + count
        y = _expert_mlp(module, expert, rows[start:stop]) * weights[start:stop, None]
        out.index_add_(0, token_index[start:stop], y.to(out.dtype))
        start = stop
    return out
