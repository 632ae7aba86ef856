"""Process groups for a trial: one flat FSDP mesh over all ranks, Ulysses groups of consecutive ranks, rings
spanning them (USP: Ulysses inside a node, the ring across nodes).

    cp_degree = sp_degree * ring_degree          (the context-parallel world: ranks that split one sequence)
    world = dp_size * cp_degree;  rank = dp_rank * cp_degree + ring_rank * sp_degree + sp_rank
    Ulysses group of replica d, ring rank r: ranks d*cp_degree + r*sp_degree + [0, sp_degree)
    ring of replica d, Ulysses rank u:       ranks d*cp_degree + u + sp_degree * [0, ring_degree)

CPU -> gloo; CUDA -> NCCL for device tensors plus gloo for host ones (``process_group_backend``): with optimizer
offload FSDP2's shards and gradients live on the host, and any collective on them needs a CPU backend. World size 1 needs no process group at all (``Mesh.single()``), except for FSDP
(``fsdp``/``optimizer_offload`` on one rank): ``ensure_device_mesh`` then starts a 1-rank group in this process
(an in-memory store, no port, no torchrun) so ``fully_shard`` has a mesh.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from trials.core.patches import deepspeed_shm_comm_op_skipped

MIN_COLLECTIVE_TIMEOUT_S = 600.0  # torch's NCCL default
STEP_TIME_MARGIN = 3.0  # the time model's predictions are not exact (docs/predictions.md): allow 3x per step


def collective_timeout_s(step_time_s: float | None) -> float:
    """One collective's timeout for steps of ``step_time_s`` seconds (predicted or measured): a collective waits at
    most as long as the slowest rank takes to reach it, which is within one step; ``STEP_TIME_MARGIN`` steps, never
    under torch's default. Unknown (None or 0): the default."""
    if not step_time_s or step_time_s <= 0:
        return MIN_COLLECTIVE_TIMEOUT_S
    return max(MIN_COLLECTIVE_TIMEOUT_S, STEP_TIME_MARGIN * step_time_s)


def launch_line(processes: int) -> str:
    """How ``processes`` processes of a script start on one node, on CUDA and CPU alike (``torch.distributed.run``;
    ``accelerate launch --cpu`` starts one process whatever ``--num_processes`` says)."""
    return (
        f"accelerate launch --multi_gpu --num_processes {processes} your_train.py "
        f"(or torchrun --nproc-per-node {processes})"
    )


def rank_threads(ranks_per_node: int) -> str:
    """``OMP_NUM_THREADS`` for each of a node's ``ranks_per_node`` processes: its share of the node's cores (the
    host's optimizer step and copies run on them), at least one. torchrun's own default is one thread a rank."""
    return str(max(1, (os.cpu_count() or 1) // max(1, ranks_per_node)))


@dataclass
class Mesh:
    rank: int
    world_size: int
    sp_degree: int
    device: torch.device
    sp_group: dist.ProcessGroup | None = None
    device_mesh: object | None = None  # torch DeviceMesh over all ranks (FSDP), None when world is 1
    ring_degree: int = 1
    ring_group: dist.ProcessGroup | None = None  # this rank's ring (``trials.stack.ring``), None when ring_degree is 1

    @property
    def cp_degree(self) -> int:
        """Ranks that split one sequence: the Ulysses degree times the ring degree."""
        return self.sp_degree * self.ring_degree

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_degree

    @property
    def ring_rank(self) -> int:
        return self.rank % self.cp_degree // self.sp_degree

    @property
    def dp_rank(self) -> int:
        return self.rank // self.cp_degree

    @property
    def dp_size(self) -> int:
        return self.world_size // self.cp_degree

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> Mesh:
        return cls(rank=0, world_size=1, sp_degree=1, device=torch.device(device))


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def process_group_backend(device: torch.device) -> str:
    """The backend string for ``init_process_group``: one backend per device type the step's tensors live on."""
    return "cuda:nccl,cpu:gloo" if torch.device(device).type == "cuda" else "gloo"


def init_mesh(sp_degree: int, device: torch.device | None = None, timeout_s: float = 600, ring_degree: int = 1) -> Mesh:
    """Join the torchrun job (or stay single-process) and build the groups."""
    device = device or default_device()
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size == 1 and not dist.is_initialized():
        if sp_degree != 1 or ring_degree != 1:
            ranks = sp_degree * ring_degree
            raise ValueError(
                f"ulysses_degree {sp_degree} x ring_degree {ring_degree} needs {ranks} ranks, have 1: launch {ranks} "
                f"processes: {launch_line(ranks)}"
            )
        return Mesh.single(device)
    if not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend=process_group_backend(device), timeout=timedelta(seconds=timeout_s))
    return build_mesh(sp_degree, device, timeout_s, ring_degree=ring_degree)


def ensure_device_mesh(mesh: Mesh) -> Mesh:
    """Give a 1-rank mesh a device mesh (for FSDP), initialising a 1-rank process group if there is none."""
    if mesh.device_mesh is not None:
        return mesh
    if not dist.is_initialized():
        if mesh.world_size != 1:
            raise ValueError("a multi-rank mesh without a process group")
        dist.init_process_group(
            backend=process_group_backend(mesh.device), store=dist.HashStore(), rank=0, world_size=1
        )
    from torch.distributed.device_mesh import init_device_mesh

    mesh.device_mesh = init_device_mesh(mesh.device.type, (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    return mesh


def build_mesh(sp_degree: int, device: torch.device, timeout_s: float | None = None, ring_degree: int = 1) -> Mesh:
    """Groups over an initialised default process group (real or fake).

    ``timeout_s``: the Ulysses groups' collective timeout (``init_mesh`` passes the trial's, as it gives the default
    group). ``new_group`` without one gets torch's default for its backend (``_get_default_timeout``: 10 or 30
    minutes), not the default group's, and NCCL's watchdog counts from when a collective is enqueued: in a long step
    the CPU queues layers ahead of the GPU, so a healthy collective can wait longer than that. None: torch's default (fake and CPU worlds). The FSDP mesh spans every rank and reuses the
    default group, with its timeout."""
    from torch.distributed.device_mesh import init_device_mesh

    rank, world_size = dist.get_rank(), dist.get_world_size()
    cp_degree = sp_degree * ring_degree
    if world_size % cp_degree:
        raise ValueError(
            f"ulysses_degree {sp_degree} x ring_degree {ring_degree} does not divide world size {world_size}"
        )
    sp_group = ring_group = None
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    # every rank must create every group, in the same order
    for start in range(0, world_size, sp_degree):
        group = dist.new_group(list(range(start, start + sp_degree)), timeout=timeout)
        if start <= rank < start + sp_degree:
            sp_group = group
    if ring_degree > 1:
        for replica in range(0, world_size, cp_degree):
            for offset in range(sp_degree):
                members = [replica + offset + sp_degree * r for r in range(ring_degree)]
                group = dist.new_group(members, timeout=timeout)
                if rank in members:
                    ring_group = group
    device_mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("fsdp",))
    if sp_degree > 1:
        import deepspeed.comm

        if not deepspeed.comm.is_initialized():
            # the already-initialised default group is reused; DeepSpeed wants the device backend's plain name.
            # Its shared-memory comm op (a g++ build on a CPU accelerator) serves no collective a trial runs
            with deepspeed_shm_comm_op_skipped():
                deepspeed.comm.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo", verbose=False)
    return Mesh(
        rank=rank,
        world_size=world_size,
        sp_degree=sp_degree,
        device=device,
        sp_group=sp_group,
        device_mesh=device_mesh,
        ring_degree=ring_degree,
        ring_group=ring_group,
    )


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)
