"""From what a user asked for (``SearchRequest``: the options of ``autotune search``) to what runs
(``PreparedSearch``): the backend (``auto``), the hardware, the nodes' agents, the search space, the backends in
front of each other (the prefilter, the deadline predictor) and the study, every input checked first."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from autotune.backends import Backend, make_backend, resolve_backend
from autotune.backends.setup import (
    broken_flash_warning,
    check_depth,
    check_local_node,
    check_node_size,
    open_node_group,
    trial_hardware,
)
from autotune.core.documents import parse_documents
from autotune.core.errors import UserError
from autotune.core.hardware import Hardware
from autotune.core.trainers import TRAINERS, trainer_named
from autotune.search.job import SearchJob
from autotune.search.objective import open_study
from autotune.search.space import load_space
from autotune.search.study import open_storage
from trials.kernels.documents import DocumentsSpec
from trials.models.lora import FULL_TRAINING, LoraSpec
from trials.models.model import lora_mismatch


@dataclass
class SearchRequest:
    """``autotune search``'s options, parsed (``target`` in tokens)."""

    model: str
    target: int
    gpus: int = 8
    nodes: int = 1
    hardware: str = "h100-sxm"
    backend: str = "auto"
    space: Path | None = None
    trials: int = 30
    timeout_s: float | None = None
    out: Path = Path("autotune-out")
    storage: str | None = None
    study: str | None = None
    seed: int = 0
    memory_gib: float | None = None
    trial_timeout_s: float | None = None
    prefilter: bool = True  # local backend: skip real trials the plan backend predicts to OOM
    depth: str = "reduced"
    rdzv_endpoint: str | None = None
    trainer: str = "autotune"  # search what that trainer runs (``autotune.core.trainers``)
    documents: str | None = None  # ``--documents`` (``autotune.core.documents``): None is one per sequence
    lora: LoraSpec | None = None  # ``--lora-rank`` (``autotune.core.lora``): None is full training


@dataclass
class PreparedSearch:
    """A search ready to run; on a follower node only ``follower`` (its part: run what the driver publishes)."""

    backend_name: str  # plan | local
    hardware: Hardware
    group: object | None = None  # the nodes' agents (``NodeGroup``) of a local search over several nodes
    follower: Backend | None = None
    job: SearchJob | None = None
    study: object | None = None  # the Optuna study, opened (resumed or created)
    warnings: list[str] = field(default_factory=list)


def prepare_search(request: SearchRequest) -> PreparedSearch:
    """Check ``request`` and build its job, backends and study; ``UserError`` (one line) for bad input."""
    from trials.models.config import load_model_config, model_reference

    model_config = load_model_config(request.model)
    documents = parse_documents(request.documents)
    lora = request.lora or FULL_TRAINING
    trainer = trainer_named(request.trainer)
    if lora.on and trainer.lora is None:
        takes = ", ".join(t.name for t in TRAINERS.values() if t.lora is not None)
        raise UserError(f"--lora-rank: {trainer.words} trains every weight only; --trainer {takes} train LoRA adapters")
    problem = lora_mismatch(model_config, lora)
    if problem:
        raise UserError(problem)
    backend_name = resolve_backend(request.backend, request.gpus)
    if request.backend == "auto" and request.nodes > 1 and request.rdzv_endpoint is None:
        backend_name = "plan"  # real trials over several nodes need the rendezvous
    if backend_name not in ("plan", "local"):
        raise UserError(f"unknown backend {request.backend!r}: choose auto, plan or local")
    group = open_node_group(request.nodes, request.rdzv_endpoint, backend_name)
    hw = trial_hardware(backend_name, request.hardware, request.memory_gib).for_nodes(request.nodes)
    if backend_name == "plan":
        check_node_size(hw, request.gpus, request.nodes)
    if group is not None and not group.driver:
        check_local_node(request.gpus, False)
        follower = make_backend("local", memory_gib=request.memory_gib, group=group)
        return PreparedSearch(backend_name, hw, group=group, follower=follower)
    out = out_dir(request.out)
    storage = open_storage(request.storage, out)
    warnings = []
    if backend_name == "local":
        check_local_node(request.gpus, False)
        warnings = [w for w in [broken_flash_warning()] if w]
    space = load_space(
        request.space,
        model_config,
        request.gpus * request.nodes,
        request.target,
        trainer=trainer,
        on_gpu=not hw.device_is_host,
        kernels=search_kernels(backend_name, hw),
        compute_capability_major=hw.compute_capability or None,
        documents=documents,
    )
    if backend_name == "local":
        prefilter = make_backend("plan", stop_above=1 + hw.oracle_margin) if request.prefilter else None
        # the trial deadlines follow the predicted step time: the prefilter's cached records, else a plan backend
        backend = make_backend(
            "local",
            memory_gib=request.memory_gib,
            timeout_s=request.trial_timeout_s,
            seed=request.seed,
            predictor=prefilter or make_backend("plan"),
            depth=check_depth(request.depth),
            group=group,
        )
    else:  # the search needs to know only that an OOM does not fit: its trace may stop at the crossing
        backend, prefilter = make_backend("plan", stop_above=1.0), None
    job = SearchJob(
        model=model_reference(request.model),  # best.json's model loads from any folder
        model_config=model_config,
        target=request.target,
        gpus=request.gpus,
        hardware=hw,
        space=space,
        backend=backend,
        out=out,
        trials=request.trials,
        timeout_s=request.timeout_s,
        storage=request.storage,
        study_name=request.study,
        seed=request.seed,
        prefilter=prefilter,
        nodes=request.nodes,
        documents=documents,
        lora=lora,
    )
    study = open_study(job, storage)
    check_same_workload(study, documents, lora, out)
    return PreparedSearch(backend_name, hw, group=group, job=job, study=study, warnings=warnings)


def check_same_workload(study, documents: DocumentsSpec, lora: LoraSpec, out: Path) -> None:
    """A study resumed in ``out`` holds records for the workload it was searched for, its documents and its adapters:
    another ``--documents`` or other ``--lora-*`` options there would mix fronts (UserError)."""
    job = study.user_attrs.get("search_job")
    if not isinstance(job, dict):  # a new study: nothing recorded yet
        return
    stored = job.get("documents", "one")  # a study from before documents were recorded: one per sequence
    if stored != documents.to_json():
        raise UserError(
            f"the search in {str(out)!r} is for --documents {DocumentsSpec.from_json(stored).describe()}, not "
            f"{documents.describe()}: give another --out"
        )
    trained = LoraSpec.from_json(job.get("lora"))  # a study from before adapters were recorded: full training
    if trained != lora:
        raise UserError(
            f"the search in {str(out)!r} is for {trained.describe()}, not {lora.describe()}: give another --out"
        )


def search_kernels(backend_name: str, hw: Hardware) -> tuple[str, ...]:
    """The attention kernels a search weighs: those the hardware preset lists (``Hardware.kernels``: a plan search
    prices them on that GPU); a local search, those of them this node runs."""
    if backend_name != "local":
        return hw.kernels
    from trials.kernels.registry import usable_here

    return tuple(kernel for kernel in hw.kernels if kernel in usable_here())


def out_dir(out: Path) -> Path:
    """``--out``, created when missing; refused when it is a file, cannot be created or is not writable."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {str(out)!r} is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--out {str(out)!r} cannot be created: {exc.strerror}") from None
    if not os.access(out, os.W_OK):
        raise UserError(f"--out {str(out)!r} is not writable")
    return out
