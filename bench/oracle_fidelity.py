"""Memory oracle vs real CPU trials: predicted peak device bytes / measured peak, config by config.

    .venv/bin/python bench/oracle_fidelity.py [--quick] [--only SUBSTRING[,SUBSTRING]] | tee bench/results/oracle_fidelity.txt
    .venv/bin/python bench/oracle_fidelity.py --only tiny-mistral,tiny-gemma3,tiny-qwen3-moe \
        | tee bench/results/oracle_fidelity_families.txt
    .venv/bin/python bench/oracle_fidelity.py --only docs | tee bench/results/oracle_fidelity_documents.txt
    .venv/bin/python bench/oracle_fidelity.py --only lora | tee bench/results/oracle_fidelity_lora.txt

Real trials run through ``trials.trial.runner.run_trial`` (the local backend's code), several configs per torchrun
launch (one launch per world size; a torchrun start costs ~20 s here), 1 warm-up + 1 measured step, no
capacity. The oracle (``autotune.oracle.predict``) runs on the ``cpu`` hardware preset (no runtime overheads)
with the trial's compute dtype. Configs deeper than 4 layers exercise the depth extrapolation. The last line
is the worst ratio; done-when: every ratio within 1 +- 0.05.

Also a library for tests: ``run_real(configs)`` and ``predict_config(config)``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass
class Config:
    model: str
    world: int
    seq: int
    techniques: dict = field(default_factory=dict)
    layers: int | None = None  # override the preset's depth
    compute_dtype: str = "fp32"  # "bf16": the GPU precision scheme, run on CPU
    documents: tuple[int, ...] = ()  # packed documents' lengths (``DocumentsSpec``); empty: one per sequence
    lora: dict | None = None  # LoRA adapters (``LoraSpec.to_json``'s form); None: full training

    @property
    def name(self) -> str:
        t = self.techniques
        parts = [
            f"{self.model}{'/L' + str(self.layers) if self.layers else ''}",
            f"w{self.world}",
            f"{self.seq // 1024}K",
        ]
        if t.get("fsdp"):
            parts.append("fsdp" + ("+optoff" if t.get("optimizer_offload") else ""))
        if t.get("ulysses_degree", 1) > 1:
            parts.append(f"sp{t['ulysses_degree']}")
        if t.get("ring_degree", 1) > 1:
            parts.append(f"ring{t['ring_degree']}")
        if t.get("head_chunk"):
            parts.append(f"hc{t['head_chunk']}")
        if t.get("activation_checkpointing"):
            parts.append("ac" + (f"+off{t['activation_offload_layers']}" if t.get("activation_offload_layers") else ""))
        if t.get("mlp_tile_tokens"):
            parts.append(f"mlp{t['mlp_tile_tokens']}")
        if t.get("loss_tile_tokens"):
            parts.append(f"loss{t['loss_tile_tokens']}")
        if t.get("norm_tile_tokens"):
            parts.append(f"norm{t['norm_tile_tokens']}")
        if self.compute_dtype != "fp32":
            parts.append(self.compute_dtype)
        if self.documents:
            parts.append("docs" + "/".join(str(n) for n in self.documents))
        if self.lora:
            parts.append(f"lora{self.lora['rank']}" + ("" if "targets" not in self.lora else "qv"))
            parts[-1] += "+whole" if self.lora.get("trainable") else ""
        return " ".join(parts)

    def model_config(self) -> dict:
        from trials.models.config import load_model_config

        config = dict(load_model_config(self.model))
        if self.layers:
            config["num_hidden_layers"] = self.layers
        return config

    def spec(self) -> dict:
        return {
            "model_config": self.model_config(),
            "techniques": self.techniques,
            "seq_len": self.seq,
            "steps": 1,
            "warmup": 1,
            "capacity_bytes": None,
            "seed": 0,
            "compute_dtype": self.compute_dtype,
            "documents": list(self.documents),
            "lora": self.lora,
        }


def _c(model, world, seq, layers=None, dtype="fp32", documents=(), lora=None, **t):
    return Config(model, world, seq, t, layers, dtype, tuple(documents), lora)


LORA = {"rank": 16}
LORA_WHOLE = {"rank": 16, "trainable": ["embed_tokens", "norm"]}


K = 1024
CONFIGS = [
    # one rank
    _c("tiny-llama", 1, 1 * K),
    _c("tiny-llama", 1, 4 * K, activation_checkpointing=True),
    _c("tiny-qwen3", 1, 2 * K),
    _c("tiny-qwen3", 1, 8 * K, activation_checkpointing=True),
    _c("tiny-llama", 1, 2 * K, layers=6),
    _c("tiny-llama", 1, 4 * K, layers=6, activation_checkpointing=True),
    _c("tiny-llama", 1, 2 * K, dtype="bf16"),
    _c("tiny-qwen3", 1, 4 * K, layers=6, dtype="bf16", activation_checkpointing=True),
    # two ranks
    _c("tiny-llama", 2, 1 * K),
    _c("tiny-llama", 2, 2 * K, fsdp=True),
    _c("tiny-llama", 2, 4 * K, fsdp=True, activation_checkpointing=True),
    _c("tiny-llama", 2, 4 * K, ulysses_degree=2),
    _c("tiny-llama", 2, 8 * K, fsdp=True, ulysses_degree=2, activation_checkpointing=True),
    _c("tiny-qwen3", 2, 2 * K, fsdp=True, ulysses_degree=2),
    _c("tiny-qwen3", 2, 4 * K, ulysses_degree=2, activation_checkpointing=True),
    _c("tiny-llama", 2, 4 * K, layers=6, fsdp=True, ulysses_degree=2),
    _c("tiny-qwen3", 2, 8 * K, layers=7, fsdp=True, ulysses_degree=2, activation_checkpointing=True),
    _c("tiny-llama", 2, 4 * K, dtype="bf16", fsdp=True, ulysses_degree=2, activation_checkpointing=True),
    _c("tiny-llama", 2, 2 * K, layers=6, dtype="bf16", fsdp=True),
    # three ranks (uneven FSDP shards; Ulysses degree 1 with dp 3)
    _c("tiny-llama", 3, 2 * K, fsdp=True),
    _c("tiny-qwen3", 3, 4 * K, fsdp=True, activation_checkpointing=True),
    _c("tiny-llama", 3, 2 * K, layers=5),
    # four ranks
    _c("tiny-llama", 4, 4 * K, fsdp=True),
    _c("tiny-llama", 4, 4 * K, ulysses_degree=4),
    _c("tiny-llama", 4, 8 * K, fsdp=True, ulysses_degree=4, activation_checkpointing=True),
    _c("tiny-llama", 4, 8 * K, fsdp=True, ulysses_degree=2, activation_checkpointing=True),
    _c("tiny-qwen3", 4, 4 * K, fsdp=True, ulysses_degree=4),
    _c("tiny-qwen3", 4, 8 * K, ulysses_degree=2),
    _c("tiny-llama", 4, 8 * K, layers=6, fsdp=True, ulysses_degree=4, activation_checkpointing=True),
    _c("tiny-qwen3", 4, 4 * K, layers=6, dtype="bf16", fsdp=True, ulysses_degree=4, activation_checkpointing=True),
    _c("tiny-llama", 4, 2 * K, fsdp=True, ulysses_degree=2),
    _c("tiny-llama", 4, 8 * K, dtype="bf16", fsdp=True, ulysses_degree=4),
    # the rest of the stack: head chunking, tiling, activation offload (all / partial), optimizer offload
    _c("tiny-llama", 1, 4 * K, head_chunk=2),
    _c("tiny-llama", 1, 4 * K, activation_checkpointing=True, mlp_tile_tokens=512),
    _c("tiny-qwen3", 1, 4 * K, loss_tile_tokens=1024),
    _c("tiny-llama", 1, 4 * K, activation_checkpointing=True, activation_offload_layers=4),
    _c("tiny-llama", 1, 4 * K, layers=6, activation_checkpointing=True, activation_offload_layers=2),
    # model families: a sliding window, alternating window/global layers (deeper: kinds ordered in the copies), experts
    _c("tiny-mistral", 1, 2 * K),
    _c("tiny-mistral", 2, 4 * K, fsdp=True, ulysses_degree=2, head_chunk=1, activation_checkpointing=True),
    _c("tiny-gemma3", 1, 2 * K, activation_checkpointing=True),
    _c("tiny-gemma3", 2, 4 * K, layers=8, fsdp=True, ulysses_degree=2, activation_checkpointing=True),
    # packed documents (attention inside each): whole layers, head chunks, Ulysses, a window
    _c("tiny-llama", 1, 4 * K, documents=(1000,)),
    _c("tiny-llama", 1, 4 * K, head_chunk=2, activation_checkpointing=True, documents=(512,)),
    _c("tiny-llama", 2, 4 * K, fsdp=True, ulysses_degree=2, activation_checkpointing=True, documents=(700, 300, 1500)),
    _c("tiny-mistral", 2, 4 * K, fsdp=True, ulysses_degree=2, head_chunk=1, documents=(1024,)),
    _c("tiny-qwen3-moe", 1, 2 * K),
    _c("tiny-qwen3-moe", 2, 4 * K, fsdp=True, ulysses_degree=2, activation_checkpointing=True, mlp_tile_tokens=1024),
    _c("tiny-llama", 1, 2 * K, fsdp=True, optimizer_offload=True),
    _c("tiny-llama", 2, 8 * K, fsdp=True, ulysses_degree=2, head_chunk=1, activation_checkpointing=True),
    _c(
        "tiny-llama",
        2,
        8 * K,
        fsdp=True,
        ulysses_degree=2,
        activation_checkpointing=True,
        mlp_tile_tokens=1024,
        loss_tile_tokens=1024,
    ),
    _c(
        "tiny-qwen3",
        2,
        4 * K,
        fsdp=True,
        optimizer_offload=True,
        activation_checkpointing=True,
        activation_offload_layers=2,
    ),
    _c(
        "tiny-llama",
        2,
        8 * K,
        layers=6,
        dtype="bf16",
        fsdp=True,
        optimizer_offload=True,
        ulysses_degree=2,
        head_chunk=2,
        activation_checkpointing=True,
        activation_offload_layers=6,
        mlp_tile_tokens=1024,
        loss_tile_tokens=1024,
    ),
    _c(
        "tiny-llama",
        4,
        8 * K,
        fsdp=True,
        optimizer_offload=True,
        ulysses_degree=4,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers=4,
        mlp_tile_tokens=512,
        loss_tile_tokens=512,
    ),
    _c(
        "tiny-qwen3",
        4,
        8 * K,
        fsdp=True,
        ulysses_degree=4,
        head_chunk=2,
        activation_checkpointing=True,
        mlp_tile_tokens=1024,
        loss_tile_tokens=2048,
    ),
    _c(
        "tiny-llama",
        4,
        8 * K,
        layers=8,
        fsdp=True,
        ulysses_degree=2,
        head_chunk=2,
        activation_checkpointing=True,
        activation_offload_layers=4,
        loss_tile_tokens=1024,
    ),
    # ring attention (zigzag, K/V passed around) and Ulysses x ring: the K/V in flight counted
    _c("tiny-llama", 2, 4 * K, ring_degree=2),
    _c("tiny-qwen3", 2, 4 * K, fsdp=True, ring_degree=2, activation_checkpointing=True),
    _c("tiny-llama", 2, 8 * K, fsdp=True, ring_degree=2, head_chunk=2, activation_checkpointing=True),
    _c("tiny-llama", 4, 8 * K, fsdp=True, ring_degree=4, activation_checkpointing=True),
    _c("tiny-llama", 4, 8 * K, fsdp=True, ulysses_degree=2, ring_degree=2, activation_checkpointing=True),
    _c(
        "tiny-qwen3",
        4,
        8 * K,
        fsdp=True,
        ulysses_degree=2,
        ring_degree=2,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers=4,
        mlp_tile_tokens=1024,
        loss_tile_tokens=1024,
    ),
    # ring attention over packed documents (the per-document zigzag: each rank holds two chunks of every document)
    _c("tiny-llama", 2, 4 * K, ring_degree=2, documents=(1000,)),
    _c(
        "tiny-qwen3",
        2,
        4 * K,
        fsdp=True,
        ring_degree=2,
        head_chunk=1,
        activation_checkpointing=True,
        documents=(700, 300, 1500),
    ),
    _c(
        "tiny-llama",
        4,
        8 * K,
        fsdp=True,
        ulysses_degree=2,
        ring_degree=2,
        activation_checkpointing=True,
        documents=(2044, 1000),
    ),
    # LoRA adapters on a frozen base (no base gradients or optimizer states; the stack's own backward passes)
    _c("tiny-llama", 1, 4 * K, lora=LORA),
    _c("tiny-llama", 1, 4 * K, lora=LORA, dtype="bf16", activation_checkpointing=True, mlp_tile_tokens=1024),
    _c("tiny-qwen3", 1, 4 * K, layers=6, lora=LORA, head_chunk=2, activation_checkpointing=True, loss_tile_tokens=1024),
    _c("tiny-llama", 1, 4 * K, lora={"rank": 8, "targets": ["q_proj", "v_proj"]}, fsdp=True, optimizer_offload=True),
    _c("tiny-llama", 2, 4 * K, lora=LORA, fsdp=True, ulysses_degree=2, activation_checkpointing=True),
    _c(
        "tiny-qwen3",
        2,
        8 * K,
        layers=6,
        lora=LORA,
        dtype="bf16",
        fsdp=True,
        ulysses_degree=2,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers=6,
        mlp_tile_tokens=1024,
        loss_tile_tokens=1024,
    ),
    _c("tiny-llama", 2, 4 * K, lora=LORA, fsdp=True, ring_degree=2, activation_checkpointing=True, documents=(1000,)),
    # the embedding and the norms trained whole beside them (LongLoRA's recipe: their gradients and AdamW states)
    _c("tiny-llama", 1, 4 * K, lora=LORA_WHOLE),
    _c(
        "tiny-llama",
        2,
        4 * K,
        lora=LORA_WHOLE,
        fsdp=True,
        ulysses_degree=2,
        activation_checkpointing=True,
        norm_tile_tokens=1024,
    ),  # fmt: skip
]


# ---------------------------------------------------------------------------------------------------------
# Real trials, batched per world size
# ---------------------------------------------------------------------------------------------------------


def _worker(specs_path: str, out_dir: str) -> int:
    """Run every spec of SPECS on this rank (under torchrun, or alone for world 1)."""
    import torch
    import torch.distributed as dist

    from trials.core.dist import Mesh, build_mesh
    from trials.trial.runner import run_trial
    from trials.trial.spec import TrialSpec

    specs = json.loads(Path(specs_path).read_text())
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    for index, spec in enumerate(specs):
        degree, ring = spec["techniques"].get("ulysses_degree", 1), spec["techniques"].get("ring_degree", 1)
        mesh = build_mesh(degree, torch.device("cpu"), ring_degree=ring) if world > 1 else Mesh.single()
        started = time.perf_counter()
        try:
            record = run_trial(TrialSpec.from_dict(spec), mesh).to_dict()
        except NotImplementedError as exc:
            record = {"status": "skipped", "error": str(exc)}
        record["wall_s"] = time.perf_counter() - started
        Path(out_dir, f"{index}_rank{rank}.json").write_text(json.dumps(record))
        if world > 1:
            dist.barrier()
    if world > 1:
        dist.destroy_process_group()
    return 0


def run_real(configs: list[Config], timeout_s: float = 1800) -> list[dict]:
    """Measured records (max peak over ranks) of ``configs``, in order; one launch per world size."""
    results: list[dict | None] = [None] * len(configs)
    by_world: dict[int, list[int]] = {}
    for index, config in enumerate(configs):
        by_world.setdefault(config.world, []).append(index)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for world, indices in sorted(by_world.items()):
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
        with tempfile.TemporaryDirectory(prefix="oracle-fidelity-") as work:
            specs_path = Path(work, "specs.json")
            specs_path.write_text(json.dumps([configs[i].spec() for i in indices]))
            script = [str(Path(__file__).resolve()), "--worker", str(specs_path), work]
            if world == 1:
                command = [sys.executable, *script]
            else:
                command = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={world}",
                    *script,
                ]
            proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s)
            for local, index in enumerate(indices):
                ranks = [json.loads(p.read_text()) for p in sorted(Path(work).glob(f"{local}_rank*.json"))]
                if len(ranks) < world:
                    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
                    results[index] = {"status": "error", "error": f"missing rank records; output:\n{tail}"}
                    continue
                worst = next((r for r in ranks if r["status"] != "ok"), ranks[0])
                peak = max(r.get("peak_device_bytes") or 0 for r in ranks)
                peak_rank = max(ranks, key=lambda r: r.get("peak_device_bytes") or 0)
                results[index] = {
                    "status": worst["status"],
                    "error": worst.get("error"),
                    "peak_device_bytes": peak,
                    "breakdown": peak_rank.get("breakdown"),
                    "host_bytes": max(r.get("host_bytes") or 0 for r in ranks),
                    "wall_s": max(r.get("wall_s", 0) for r in ranks),
                    "peak_rank": peak_rank.get("rank"),
                    "moe_routing": peak_rank.get("moe_routing"),
                }
    return results  # type: ignore[return-value]


def predict_config(config: Config):
    """The oracle's ``Prediction`` for ``config`` on the cpu preset with the config's compute dtype."""
    import torch

    from autotune.backends import Evaluation
    from autotune.core.hardware import load_hardware
    from autotune.oracle import predict
    from trials.kernels.documents import DocumentsSpec
    from trials.models.lora import LoraSpec
    from trials.stack.techniques import Techniques

    evaluation = Evaluation(
        config.model_config(),
        Techniques.from_dict(config.techniques),
        config.seq,
        config.world,
        load_hardware("cpu"),
        documents=DocumentsSpec(config.documents),
        lora=LoraSpec.from_json(config.lora),
    )
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[config.compute_dtype]
    return predict(evaluation, compute_dtype=dtype)


def _mib(value) -> str:
    return f"{value / 2**20:9.2f}" if value is not None else "      n/a"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", nargs=2, metavar=("SPECS", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="world sizes 1 and 2 only")
    parser.add_argument("--only", default=None, help="configs whose name contains this (comma: any of these)")
    args = parser.parse_args(argv)
    if args.worker:
        return _worker(*args.worker)
    configs = [
        c
        for c in CONFIGS
        if (not args.quick or c.world <= 2) and (not args.only or any(o in c.name for o in args.only.split(",")))
    ]
    started = time.perf_counter()
    real = run_real(configs)
    real_s = time.perf_counter() - started
    print(
        f"{'config':<58} {'real MiB':>9} {'oracle MiB':>10} {'ratio':>7} {'diff bytes':>10} {'host':>5} "
        f"{'oracle s':>8}  peak at (oracle)"
    )
    worst = None
    oracle_s = []
    routings = []  # MoE configs: the routing the real trial saw
    exact = same_host = same_breakdown = 0
    for config, measured in zip(configs, real):
        if measured["status"] == "skipped":
            print(f"{config.name:<58} skipped: {measured['error']}")
            continue
        if measured["status"] != "ok":
            print(f"{config.name:<58} REAL TRIAL {measured['status']}: {str(measured['error'])[-300:]}")
            continue
        try:
            predicted = predict_config(config)
        except NotImplementedError as exc:
            print(f"{config.name:<58} oracle skipped: {exc}")
            continue
        oracle_s.append(predicted.elapsed_s)
        if measured.get("moe_routing"):
            routings.append((config.name, measured["moe_routing"]))
        ratio = predicted.peak_device_bytes / measured["peak_device_bytes"]
        if worst is None or abs(ratio - 1) > abs(worst[1] - 1):
            worst = (config.name, ratio)
        flag = "" if abs(ratio - 1) <= 0.05 else "  <-- off by more than 5%"
        diff = predicted.peak_device_bytes - measured["peak_device_bytes"]
        host = "same" if predicted.host_bytes == measured["host_bytes"] else "DIFF"
        exact += diff == 0
        same_host += host == "same"
        same_breakdown += predicted.breakdown == measured["breakdown"]
        print(
            f"{config.name:<58} {_mib(measured['peak_device_bytes'])} {_mib(predicted.peak_device_bytes):>10} "
            f"{ratio:7.4f} {diff:10d} {host:>5} {predicted.elapsed_s:8.2f}  {predicted.peak_segment}{flag}",
            flush=True,
        )
    print(
        f"\n{len(oracle_s)} configs compared: peak exact to the byte in {exact}, same breakdown by category in "
        f"{same_breakdown}, same host bytes in {same_host}; real trials {real_s:.0f} s in "
        f"{len({c.world for c in configs})} launches; oracle {sum(oracle_s):.1f} s total, "
        f"{max(oracle_s, default=0):.2f} s max"
    )
    for name, seen in routings:  # memory does not depend on the routing: what the router did, for the record
        print(
            f"routing of {name}: at most {seen['max_tokens_per_expert']:,} tokens on one expert, balanced "
            f"{seen['balanced_tokens_per_expert']:,.0f} ({seen['experts']} experts, top-{seen['top_k']})"
        )
    if worst:
        print(f"worst ratio (oracle / real peak): {worst[1]:.4f} ({worst[0]})")
    return 0 if worst and abs(worst[1] - 1) <= 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
