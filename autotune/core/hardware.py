"""Hardware presets: one type, ``Hardware``, parsed once from ``hardware_presets/<name>.yaml`` (or any YAML path).

A preset holds the memory facts of one accelerator of a node (capacity, runtime overheads no tensor shows, the
host RAM per device, the oracle's error band) and the time model's rates (``Rates``: peaks, efficiencies,
overheads; each YAML value says where it comes from), among them the attention kernels the device runs, each at
its own rates (``attention_kernels``: ``KernelRates``; ``trials.kernels.registry`` declares the kernels themselves).
Presets whose device is simulated in host memory
(``device_is_host``: the ``cpu`` preset of CPU trials) also carry a calibration of a typical machine in the YAML
(``calibration:``), replaced by this machine's own when one is cached (``autotune.core.calibration_store``;
``autotune.timing.calibration`` measures it, only when asked for). Their rates depend on the world size (trial
ranks share the machine's cores): ``Hardware.rates_for(world_size)``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path

import yaml

from autotune.core import calibration_store
from autotune.core.errors import UserError

HOST_PRESET = "cpu"  # the preset of real trials on a machine without CUDA devices


@dataclass(frozen=True)
class KernelRates:
    """One attention kernel of a preset (``trials.kernels.registry`` declares it) at its rates on the preset's device.

    The efficiencies are fractions of ``bf16_flops`` at causal attention, head dim 128 and long sequences (what
    millions of tokens run at); the tiles are the query / key tiles a causal kernel computes whole on the
    diagonal. A kernel listed without figures (0) runs at the preset's own attention rates: the ``cpu`` preset's
    SDPA, whose rates its calibration sets. ``source`` says where the figures come from; ``assumed`` until
    ``autotune calibrate`` measures the kernel on the node."""

    name: str
    forward_efficiency: float = 0.0
    backward_efficiency: float = 0.0
    tile_q: int = 0
    tile_kv: int = 0
    source: str = ""
    assumed: bool = True

    def to_yaml(self) -> dict:
        """The preset YAML entry of this kernel (``autotune calibrate`` writes it)."""
        entry = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name" and getattr(self, f.name)}
        entry["assumed"] = self.assumed
        return entry


@dataclass(frozen=True)
class Rates:
    """Per-device rates and efficiencies of the time model; each is a named field of the hardware YAML.

    Rates are per device (per rank), and per direction for links. Defaults are the H100-class values of
    docs/predictions.md; presets override them.
    """

    name: str
    bf16_flops: float  # matmul peak of the training dtype (bf16 on GPUs, fp32 for cpu)
    hbm_bytes_per_s: float  # device memory bandwidth
    intra_node_bytes_per_s: float  # device-device link, per direction (NVLink / gloo loopback)
    host_bytes_per_s: float  # host link, per direction (PCIe / memcpy)
    matmul_efficiency: float = 0.7  # achieved fraction of bf16_flops for the step's GEMMs
    attention_efficiency: float = 0.35  # achieved fraction of bf16_flops, attention forward (computed FLOPs)
    attention_backward_efficiency: float = 0.3
    # SDPA under head chunking (UPipe) calls one CUDA kernel explicitly (``trials.kernels.attention``: memory-efficient),
    # where a whole layer's SDPA picks its own (flash or cuDNN): its efficiencies when calibrated (0: as above)
    chunked_sdpa_efficiency: float = 0.0
    chunked_sdpa_backward_efficiency: float = 0.0
    attention_tile_q: int = 128  # the kernel's query / key tile: causal blocks on the diagonal are
    attention_tile_kv: int = 128  # computed whole, so computed pairs exceed s*(s+1)/2 by ~s*tile/2
    elementwise_efficiency: float = 0.7  # achieved fraction of hbm_bytes_per_s for memory-bound ops
    elementwise_traffic_factor: float = 3.0  # bytes moved per output byte counted (read ~2 operands, write 1)
    all_to_all_efficiency: float = 0.75  # achieved fraction of the link for all-to-all
    all_gather_efficiency: float = 0.8  # achieved fraction of the link for all-gather (FSDP unshard)
    reduce_scatter_efficiency: float = 0.8  # ... reduce-scatter (FSDP gradient reduction)
    all_reduce_efficiency: float = 0.8  # ... all-reduce (replicated gradients, loss)
    collective_latency_s: float = 20e-6  # fixed cost per collective call
    # the inter-node fabric (jobs over several nodes): per GPU, per direction (one NIC per GPU, rail-optimised);
    # 0 = no fabric of its own: collectives across nodes are priced on the intra-node link
    inter_node_bytes_per_s: float = 0.0
    inter_node_efficiency: float = 0.9  # achieved fraction of inter_node_bytes_per_s per NIC
    inter_node_latency_s: float = 0.0  # fixed cost of a collective spanning nodes (0: collective_latency_s)
    host_copy_efficiency: float = 1.0  # achieved fraction of host_bytes_per_s
    host_optimizer_bytes_per_s: float = 50e9  # optimizer-step output bytes per second on the host, per rank
    op_overhead_s: float = 0.0  # host time per dispatched op that does work (python + launch)
    view_overhead_s: float = 0.0  # host time per dispatched view / metadata op
    launch_overlaps_compute: bool = True  # GPUs queue kernels: overhead is a floor, not an addition
    side_stream_overlap: float = 1.0  # fraction of compute time FSDP collectives / offload copies can hide behind
    collective_wait_s: float = 0.0  # several ranks: seconds per collective call beyond its priced transfer
    # (waiting for the slower rank at each rendezvous; cpu calibration)
    device_is_host: bool = False  # cpu preset: the "device" is host memory, so FSDP2's offload copies
    # (shards to the device, gradients to the host) are no-ops
    # measured attention efficiency per head dim (cpu calibration), {head_dim: (fwd, bwd)}; overrides the scalars
    attention_by_head_dim: tuple = ()
    # the attention kernels the device runs, each at its own rates, in the preset's order. The attention fields
    # above are the reference kernel's, which prices a kernel the preset does not list: the first listed, unless
    # the preset gives them itself (a calibrated preset: FlashAttention-2 as measured, else SDPA). () = a preset
    # without a kernel list: every kernel at the attention fields above
    attention_kernels: tuple[KernelRates, ...] = ()

    def kernel(self, name: str) -> KernelRates | None:
        """The preset's entry of attention kernel ``name`` (None: not listed)."""
        return next((k for k in self.attention_kernels if k.name == name), None)

    def for_kernel(self, attention: str, head_chunk: int | None) -> Rates:
        """These rates for what a config's attention runs: the kernel's own rates where the preset lists them with
        figures (a kernel it does not list runs at the reference kernel's), and SDPA under head chunking at its own
        calibrated efficiencies, where they were measured."""
        rates = self
        kernel = self.kernel(attention)
        if kernel is not None and kernel.forward_efficiency:
            rates = replace(
                self,
                attention_efficiency=kernel.forward_efficiency,
                attention_backward_efficiency=kernel.backward_efficiency or kernel.forward_efficiency,
                attention_tile_q=kernel.tile_q or self.attention_tile_q,
                attention_tile_kv=kernel.tile_kv or self.attention_tile_kv,
                attention_by_head_dim=(),
            )
        if attention != "sdpa" or head_chunk is None or not self.chunked_sdpa_efficiency:
            return rates
        return replace(
            rates,
            attention_efficiency=self.chunked_sdpa_efficiency,
            attention_backward_efficiency=self.chunked_sdpa_backward_efficiency or rates.attention_backward_efficiency,
            attention_by_head_dim=(),
        )

    @property
    def matmul_flops_per_s(self) -> float:
        return self.bf16_flops * self.matmul_efficiency

    def attention_eff(self, head_dim: int, backward: bool) -> float:
        if not self.attention_by_head_dim:
            return self.attention_backward_efficiency if backward else self.attention_efficiency
        table = sorted(self.attention_by_head_dim)
        index = 1 if backward else 0
        if head_dim <= table[0][0]:
            return table[0][1][index]
        if head_dim >= table[-1][0]:
            return table[-1][1][index]
        for (d0, e0), (d1, e1) in zip(table, table[1:]):
            if d0 <= head_dim <= d1:  # linear in log(head_dim)
                w = (math.log(head_dim) - math.log(d0)) / (math.log(d1) - math.log(d0))
                return e0[index] * (1 - w) + e1[index] * w
        return table[-1][1][index]


@dataclass(frozen=True)
class Hardware:
    """One accelerator of a node: capacity and overheads in bytes, and the time model's rates."""

    name: str
    description: str
    device_memory_bytes: int
    rates: Rates
    compute_capability: int = 0  # the CUDA compute-capability major of the device (0: not a CUDA GPU, or unknown)
    cuda_context_bytes: int = 0
    nccl_buffer_bytes: int = 0
    allocator_fragmentation: float = 0.0
    host_memory_bytes_per_device: int = 0  # the node's host RAM / its accelerators; 0 = not checked
    gpus_per_node: int = 0  # accelerators in one node of this kind (0: any number, e.g. cpu)
    # NCCL's buffers for peers on other nodes (network transport), added to nccl_buffer_bytes when a job spans nodes
    nccl_inter_node_buffer_bytes: int = 0
    # the oracle's error band on this hardware: a local search's prefilter skips a real trial only when the
    # predicted peak is over capacity by more than this fraction; closer calls run for real
    oracle_margin: float = 0.05
    # device bytes a trainer holds beside the tensors the oracle traces (DeepSpeed ZeRO-3's buffers:
    # ``Trainer.held_bytes``), counted as a runtime overhead; set per config by ``holding``, never by a preset
    trainer_held_bytes: int = 0
    calibration: dict | None = field(default=None, compare=False)  # per-world measurements (device_is_host)
    # ``autotune calibrate``'s record in a preset it wrote: when, on what, and how each rate was measured
    calibrated: dict | None = field(default=None, compare=False)
    source: str = field(default="shipped", compare=False)  # shipped | user (a preset in user_preset_dir) | file

    def rate_provenance(self) -> str:
        """One line: where the time model's rates come from (measured here, a typical machine's, or assumed)."""
        if self.calibrated:
            return (
                f"rates measured by `autotune calibrate` on {self.calibrated.get('device', '?')} at "
                f"{self.calibrated.get('measured_at', '?')}"
            )
        if self.calibration:
            machine = self.calibration.get("machine", {})
            own = machine == calibration_store.machine_key()
            return (
                f"rates from {'this' if own else 'a typical'} machine's calibration "
                f"({machine.get('cpu', '?')}, {machine.get('cpus', '?')} cores, {self.calibration.get('measured_at', '?')})"
            )
        return "rates assumed from public figures, not measured on this node"

    @property
    def kernels(self) -> tuple[str, ...]:
        """The attention kernels this device runs (the preset's ``attention_kernels``, in its order). A preset
        without a list: SDPA, and flash-attn 2 on a GPU (what such presets priced, all at their one attention rate)."""
        if self.rates.attention_kernels:
            return tuple(k.name for k in self.rates.attention_kernels)
        return ("sdpa",) if self.device_is_host else ("flash", "sdpa")

    def fastest_kernel(self, names) -> str | None:
        """Of the kernels ``names``, the one this preset prices fastest (least time per causal (query, key) pair:
        the forward's flops at its efficiency plus the backward's, 2.5 times as many, at its own); None when none
        of them has figures here."""
        timed = [
            (1 / k.forward_efficiency + 2.5 / k.backward_efficiency, k.name)
            for name in names
            if (k := self.rates.kernel(name)) is not None and k.forward_efficiency and k.backward_efficiency
        ]
        return min(timed)[1] if timed else None

    def kernel_problem(self, attention: str) -> str | None:
        """Why this device does not run attention kernel ``attention`` (not among ``kernels``), or None."""
        if attention in self.kernels:
            return None
        return (
            f"attention {attention!r} does not run on {self.name}: its kernels are {', '.join(self.kernels)} "
            "(the preset's attention_kernels)"
        )

    @property
    def device_is_host(self) -> bool:
        """The device is simulated in host memory (CPU trials): fp32 compute, CPU kernels, no copies to offload."""
        return self.rates.device_is_host

    @property
    def bf16_flops(self) -> float:
        """The preset's peak (its rates' ``bf16_flops``), the headline figure of a preset."""
        return self.rates.bf16_flops

    def rates_for(self, world_size: int = 1) -> Rates:
        """The time model's rates for a job of ``world_size`` ranks (calibrated ones where there are)."""
        if not self.calibration:
            return self.rates
        return replace(self.rates, **calibration_store.rates_from_calibration(self.calibration, world_size))

    def host_fits(self, host_bytes_per_rank: int | None) -> bool:
        return not self.host_memory_bytes_per_device or (host_bytes_per_rank or 0) <= self.host_memory_bytes_per_device

    @property
    def runtime_overhead_bytes(self) -> int:
        """Bytes no traced tensor shows: CUDA context, NCCL buffers, and what the trainer holds beside them."""
        return int(self.cuda_context_bytes + self.nccl_buffer_bytes + self.trainer_held_bytes)

    def holding(self, held_bytes: int) -> Hardware:
        """The device as a trainer that holds ``held_bytes`` beside the traced tensors sees it (``Trainer.held_bytes``):
        those bytes count against capacity in every prediction."""
        return self if held_bytes == self.trainer_held_bytes else replace(self, trainer_held_bytes=int(held_bytes))

    def binding_memory(self, peak_device_bytes: int | None, host_bytes: int | None) -> tuple[str, int, int] | None:
        """(``"device"`` or ``"host"``, bytes used, capacity) of the memory nearest its capacity at these figures:
        what binds a longer sequence. Host bytes and capacity are per accelerator; a preset that does not check the
        host (``host_memory_bytes_per_device`` 0) binds on the device. None: no figures."""
        uses = []
        if peak_device_bytes and self.device_memory_bytes:
            uses.append(("device", int(peak_device_bytes), self.device_memory_bytes))
        if host_bytes and self.host_memory_bytes_per_device:
            uses.append(("host", int(host_bytes), self.host_memory_bytes_per_device))
        return max(uses, key=lambda use: use[1] / use[2]) if uses else None

    def near_capacity(self, peak_device_bytes: int | None) -> bool:
        """A peak within the oracle's error band on this hardware (``oracle_margin``) below capacity: it fits as
        predicted, by less than the prediction may be off."""
        capacity = self.device_memory_bytes
        return bool(peak_device_bytes) and capacity * (1 - self.oracle_margin) <= peak_device_bytes <= capacity

    def fragmentation_bytes(self, tensor_peak: int) -> int:
        """What the caching allocator reserves beyond the live tensors at a tensor peak (reserved - allocated)."""
        return int(math.ceil(self.allocator_fragmentation * tensor_peak))

    def overhead_bytes(self, tensor_peak: int) -> int:
        """Device bytes no tensor shows at a tensor peak: CUDA context, NCCL buffers, allocator fragmentation."""
        return int(self.runtime_overhead_bytes + self.fragmentation_bytes(tensor_peak))

    def for_nodes(self, nodes: int) -> Hardware:
        """The preset as a job over ``nodes`` nodes sees it: NCCL's inter-node buffers join the runtime overhead."""
        if nodes <= 1 or not self.nccl_inter_node_buffer_bytes:
            return self
        return replace(
            self,
            nccl_buffer_bytes=self.nccl_buffer_bytes + self.nccl_inter_node_buffer_bytes,
            nccl_inter_node_buffer_bytes=0,
        )

    def with_memory_gib(self, gib: float | None) -> Hardware:
        return self if gib is None else replace(self, device_memory_bytes=int(gib * 1024**3))


def shipped_dir() -> Path:
    """Where the shipped presets are (``autotune/core/hardware_presets``)."""
    return Path(str(resources.files("autotune.core") / "hardware_presets"))


def user_preset_dir() -> Path:
    """Where ``autotune calibrate --name NAME`` writes presets: ``$AUTOTUNE_CONFIG_DIR/hardware``, else
    ``$XDG_CONFIG_HOME/autotune/hardware``, else ``~/.config/autotune/hardware``."""
    base = os.environ.get("AUTOTUNE_CONFIG_DIR")
    if base:
        return Path(base) / "hardware"
    xdg = os.environ.get("XDG_CONFIG_HOME")
    return (Path(xdg) if xdg else Path.home() / ".config") / "autotune" / "hardware"


def is_shipped(name: str) -> bool:
    return (shipped_dir() / f"{name}.yaml").is_file()


def hardware_names() -> list[str]:
    """Shipped presets, then the user's (a user preset may not shadow a shipped name)."""
    shipped = sorted(p.stem for p in shipped_dir().glob("*.yaml"))
    user = sorted(p.stem for p in user_preset_dir().glob("*.yaml")) if user_preset_dir().is_dir() else []
    return shipped + [name for name in user if name not in shipped]


def preset_path(name: str) -> tuple[Path, str]:
    """(the YAML file, shipped | user | file) of a preset name or path."""
    for directory, source in ((shipped_dir(), "shipped"), (user_preset_dir(), "user")):
        path = directory / f"{name}.yaml"
        if "/" not in name and path.is_file():
            return path, source
    path = Path(name)
    if path.suffix in (".yaml", ".yml") and not path.is_file():
        raise UserError(f"hardware preset file {name!r} does not exist")
    if not path.is_file():
        raise UserError(
            f"unknown hardware {name!r}: choose one of {', '.join(hardware_names())} "
            f"(or a preset YAML file; `autotune calibrate --name NAME` makes one for this node)"
        )
    return path, "file"


_HARDWARE_KEYS = {f.name for f in fields(Hardware)} - {
    "rates",
    "calibration",
    "calibrated",
    "source",
    "trainer_held_bytes",
}
_RATE_KEYS = {f.name for f in fields(Rates)} - {"name", "attention_by_head_dim", "attention_kernels"}
_KERNEL_KEYS = {f.name for f in fields(KernelRates)} - {"name"}
_REFERENCE_KEYS = {  # the attention fields of Rates the reference kernel's figures fill when the preset omits them
    "attention_efficiency": "forward_efficiency",
    "attention_backward_efficiency": "backward_efficiency",
    "attention_tile_q": "tile_q",
    "attention_tile_kv": "tile_kv",
}


def _cast(kind, value):
    """YAML 1.1 reads 989.0e12 (no exponent sign) as a string: coerce to the field's declared type."""
    kind = str(kind)
    if "bool" in kind:
        return bool(value)
    if kind.startswith("int"):
        return int(float(value))
    if kind.startswith("float"):
        return float(value)
    return value


def load_hardware(name: str) -> Hardware:
    """A preset by name (``autotune hardware`` lists them) or a path to a preset YAML file."""
    path, source = preset_path(name)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise UserError(f"hardware preset {str(path)!r} is not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise UserError(f"hardware preset {str(path)!r} must be a YAML mapping")
    unknown = sorted(set(data) - _HARDWARE_KEYS - _RATE_KEYS - {"calibration", "calibrated", "attention_kernels"})
    if unknown:
        raise UserError(f"hardware preset {str(path)!r}: unknown key {unknown[0]!r}")
    types = {f.name: f.type for f in (*fields(Hardware), *fields(Rates))}
    try:
        values = {k: _cast(types[k], v) for k, v in data.items() if k in _HARDWARE_KEYS}
        kernels = _kernel_table(data.get("attention_kernels"), values.get("compute_capability", 0), data)
        given = {k: _cast(types[k], v) for k, v in data.items() if k in _RATE_KEYS}
        reference = next((k for k in kernels if k.forward_efficiency), None)
        if reference is not None:  # the attention fields the preset leaves out: its first kernel's figures
            for key, attribute in _REFERENCE_KEYS.items():
                if key not in given and getattr(reference, attribute):
                    given[key] = getattr(reference, attribute)
        rates = Rates(name=data["name"], attention_kernels=kernels, **given)
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"hardware preset {str(path)!r}: {exc}") from None
    hardware = Hardware(rates=rates, calibrated=data.get("calibrated"), source=source, **values)
    if rates.device_is_host:
        # a calibrated preset's own measurements; else this machine's cached calibration, else the typical
        # machine's the preset ships
        calibration = (
            (data.get("calibration") if data.get("calibrated") else None)
            or calibration_store.load_cached()
            or data.get("calibration")
        )
        if calibration:
            hardware = replace(hardware, calibration=calibration)
    return hardware


def _kernel_table(raw, compute_capability: int, data: dict) -> tuple[KernelRates, ...]:
    """A preset's ``attention_kernels``: a mapping of kernel name -> its figures (``KernelRates``' fields), or a
    list of names that run at the preset's own attention rates. Each kernel must be declared in
    ``trials.kernels.registry`` and run on the preset's device (its ``compute_capability``; a host device runs only the
    kernels that need no GPU); ``ValueError`` says which does not."""
    from trials.kernels.registry import KERNELS

    if raw is None:
        return ()
    entries = {name: {} for name in raw} if isinstance(raw, list) else raw
    if not isinstance(entries, dict) or not entries:
        raise ValueError("attention_kernels must be a mapping of kernel -> its rates, or a list of kernels")
    on_host = bool(data.get("device_is_host"))
    table = []
    for name, entry in entries.items():
        if name not in KERNELS:
            raise ValueError(f"attention kernel {name!r} is not one of {', '.join(KERNELS)} (trials.kernels.registry)")
        if (on_host or compute_capability) and not KERNELS[name].runs_on(None if on_host else compute_capability):
            where = "a host device" if on_host else f"compute capability {compute_capability}"
            raise ValueError(f"attention kernel {name!r} does not run on {where} (trials.kernels.registry)")
        entry = entry or {}
        if not isinstance(entry, dict):
            raise ValueError(f"attention kernel {name!r}: its rates must be a mapping")
        unknown = sorted(set(entry) - _KERNEL_KEYS)
        if unknown:
            raise ValueError(f"attention kernel {name!r}: unknown key {unknown[0]!r}")
        kernel = KernelRates(
            name=name,
            forward_efficiency=float(entry.get("forward_efficiency", 0.0)),
            backward_efficiency=float(entry.get("backward_efficiency", 0.0)),
            tile_q=int(entry.get("tile_q", 0)),
            tile_kv=int(entry.get("tile_kv", 0)),
            source=str(entry.get("source", "")),
            assumed=bool(entry.get("assumed", True)),
        )
        for figure in (kernel.forward_efficiency, kernel.backward_efficiency):
            if not 0.0 <= figure <= 1.0:
                raise ValueError(f"attention kernel {name!r}: an efficiency is a fraction of the peak, got {figure}")
        table.append(kernel)
    return tuple(table)
