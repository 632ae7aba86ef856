"""``--format accelerate``: a Hugging Face Accelerate config (YAML for ``accelerate launch --config_file``) and the
training script it launches (``.train.py``), which applies every knob through the plugin ``trials.hf``; beside
them the autotune config itself (``.autotune.json``, for ``autotune estimate --config``).

Accelerate only starts the processes: ``distributed_type: MULTI_GPU`` (``NO`` for one process) is
``torch.distributed.run`` underneath, on CUDA and on CPU alike (Accelerate's ``MULTI_CPU`` starts one process
unless it is given an MPI host file). The script joins that job with ``trials.core.dist.init_mesh`` (NCCL + gloo on
CUDA, gloo on CPU), builds the Hugging Face model of ``--model`` with ``trials.hf.from_pretrained`` (on meta, the
techniques applied, each rank reading only its shards of the safetensors weights) and trains it with
``trials.training.step.train_step``. Sharding is the plugin's own FSDP2 (``fully_shard`` per decoder layer + root), not
Accelerate's ``FSDP`` plugin: that is the code autotune's memory oracle traced. Precision is trials' too (fp32
master weights, bf16 compute on CUDA), so the YAML says ``mixed_precision: 'no'``.

The same YAML launches ``.trainer.py``: a minimal ``transformers.Trainer`` script with the stack
(``trials.hf_trainer.StackTrainer``, ``hf_trainer_script``), for users who keep their own ``Trainer``.

``--format accelerate-deepspeed`` (``accelerate_deepspeed``) is the DeepSpeed-backed flavour for the Trainer.
"""

from __future__ import annotations

import json

import yaml

from autotune.core.hardware import load_hardware
from autotune.core.trainers import TRAINERS
from autotune.outputs.exporters.base import (
    MODEL_PLACEHOLDER,
    Exporter,
    Rendered,
    beside,
    comment_block,
    hf_model_name,
)
from autotune.outputs.exporters.hf_trainer_script import trainer_script
from trials.models.config import model_names
from trials.training.config_file import TrialConfig

FIRST_NODE_PLACEHOLDER = "REPLACE-WITH-THE-FIRST-NODE"


class AccelerateConfigExporter(Exporter):
    name = "accelerate"
    trainer = TRAINERS["accelerate"]
    default_file = "accelerate-config.yaml"

    def accelerate_yaml(self, config: TrialConfig) -> dict:
        processes = config.gpus * config.nodes
        doc: dict = {
            "compute_environment": "LOCAL_MACHINE",
            # torch.distributed.run starts the processes; trials.core.dist picks NCCL on CUDA, gloo on CPU
            "distributed_type": "MULTI_GPU" if processes > 1 else "NO",
            "downcast_bf16": "no",
            "gpu_ids": "all",
            "machine_rank": 0,
            "main_training_function": "main",
            "mixed_precision": "no",  # trials' own: fp32 master weights, bf16 compute on CUDA
            "num_machines": config.nodes,
            "num_processes": processes,
            "rdzv_backend": "static",
            "same_network": True,
            "use_cpu": load_hardware(config.hardware).device_is_host,
        }
        if config.nodes > 1:
            doc.update(main_process_ip=FIRST_NODE_PLACEHOLDER, main_process_port=29500)
        return doc

    def render(self, config: TrialConfig, notes: list[str], path: str) -> Rendered:
        lines = [*notes]
        if config.nodes > 1:
            lines.append(
                f"on each of the {config.nodes} nodes: main_process_ip = the first node, machine_rank = this node's"
            )
        lines.append(
            "sharding: trials.hf's FSDP2 (fully_shard per decoder layer + root, what the memory oracle traced); "
            "Accelerate only starts the processes"
        )
        text = comment_block(lines) + "\n" + yaml.safe_dump(self.accelerate_yaml(config), sort_keys=False).rstrip()
        companions = {
            ".train.py": training_script(config, lines, path),
            ".trainer.py": trainer_script(config, lines, path, load_hardware(config.hardware).device_is_host),
            ".autotune.json": json.dumps(config.to_dict(), indent=2),
        }
        return Rendered(text, companions)

    def launch(self, path: str, config: TrialConfig) -> str:
        """The launch line; ``--model`` is a folder (the script reads config.json and safetensors files): a
        config.json's own folder, else ``HF_FOLDER``, named after the hub model to download into it."""
        command = f"accelerate launch --config_file {path} {beside(path, '.train.py')} --model {{}} --steps 100"
        if config.model not in model_names():
            return command.format(hf_model_name(config.model))
        hub = hf_model_name(config.model)
        download = f" (HF_FOLDER: {hub} downloaded, config.json + safetensors)" if hub != MODEL_PLACEHOLDER else ""
        return command.format("HF_FOLDER") + download


def training_script(config: TrialConfig, notes: list[str], accelerate_path: str) -> str:
    """The ``.train.py`` the YAML launches: the config inline, ``trials.hf`` for the model, ``trials.training.step`` for the
    step, a loss line per step and (``--summary``) a JSON summary with each rank's measured peak."""
    script = beside(accelerate_path, ".train.py")
    return f'''{comment_block(notes)}
"""Train a Hugging Face causal LM with this autotune config, every knob applied by the plugin trials.hf.

    accelerate launch --config_file {accelerate_path} {script} --model HF_FOLDER [--steps N] \\
        [--data tokens.parquet [--pack | --no-pack]] [--summary summary.json]

HF_FOLDER holds config.json and safetensors weights (model.safetensors or an index of several files). Each step
trains one sequence of {config.seq_len:,} tokens per data-parallel replica: trials' seeded synthetic tokens, or
--data, a Parquet/Arrow file of token ids (a column input_ids of lists, or tokens). --data is packed as autotune
run --pack packs it (trials.train.packing; the default when the config's documents, {config.documents.to_json()!r},
are not "one"): its documents (rows of input_ids, or tokens cut after the model's EOS) back to back in windows,
each window's boundaries passed to the stack (position ids restart, attention and labels stay inside each
document); --no-pack reads it as one stream of windows. Rank 0
prints the loss of each step (the mean over the global batch) and a final "summary {{json}}" line, which --summary
also writes: the losses and each rank's peak device bytes (on CPU the simulated device's, as trials measure it; on
CUDA torch.cuda's max allocated and max reserved), from before the model is built to the last step.
"""

import argparse
import contextlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from trials import hf

from trials.core import allocator
from trials.training.config_file import parse_config
from trials.training.data import read_token_data
from trials.core.dist import collective_timeout_s, init_mesh
from trials.core.memory import DeviceMemoryTracker
from trials.training.step import make_optimizer, train_step
from trials.train import TokenSource, TrainOptions, packing, recorded_step_time_s

CONFIG = json.loads(
    r"""
{json.dumps(config.to_dict(), indent=2)}
"""
)


def peak_bytes(mesh, tracker) -> dict:
    if tracker is not None:
        return {{"peak_device_bytes": int(tracker.peak_device_bytes), "peak_host_bytes": int(tracker.peak_host_bytes)}}
    return {{
        "peak_device_bytes": int(torch.cuda.max_memory_allocated(mesh.device)),
        "peak_reserved_bytes": int(torch.cuda.max_memory_reserved(mesh.device)),
    }}


def token_data(args, config):
    """How --data trains (trials.train.Packing: its tokens, where its documents end when packed, their pads on a ring,
    a warning where that differs from the documents the config's estimate assumed); None without --data."""
    if args.data is None:
        if args.pack:
            raise ValueError("--pack needs --data (the synthetic tokens are one document per window)")
        return None
    with open(os.path.join(args.model, "config.json")) as file:
        data = read_token_data(args.data, json.load(file)["vocab_size"])
    options = TrainOptions(config="", data=args.data, pack=args.pack, init=args.model)  # EOS: the folder's
    return packing(options, config, {{}}, data)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--data", default=None, help="Parquet/Arrow file of token ids (default: synthetic tokens)")
    parser.add_argument("--pack", dest="pack", action="store_true", default=None,
                        help="pack --data's documents into windows (default: if the config's documents are packed)")
    parser.add_argument("--no-pack", dest="pack", action="store_false", help="read --data as one stream of windows")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic tokens and LoRA adapters")
    parser.add_argument("--config", default=None, help="another autotune config file (default: the one above)")
    parser.add_argument("--summary", default=None, help="write the JSON summary here (rank 0)")
    args = parser.parse_args(argv)
    config = parse_config(json.load(open(args.config)) if args.config else CONFIG, args.config or "CONFIG")
    techniques, seq_len = config.techniques, config.seq_len
    try:  # --data read and checked whole before any rank builds the model, and packed as autotune run packs it
        packed = token_data(args, config)
    except ValueError as exc:  # trials' DataError is one; every rank refuses alike, the first says why
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{{os.path.basename(sys.argv[0])}}: {{str(exc).strip().splitlines()[0]}}", file=sys.stderr)
        return 2
    if packed is not None and int(os.environ.get("RANK", "0")) == 0:
        if packed.warning is not None:
            print(f"warning: {{packed.warning}}", file=sys.stderr, flush=True)
        if packed.note is not None:
            print(packed.note, file=sys.stderr, flush=True)
    allocator.configure()  # before CUDA starts: the allocator settings the trials measured under
    mesh = init_mesh(  # its collectives' timeout above the longest step (the config's recorded step time)
        techniques.ulysses_degree,
        timeout_s=collective_timeout_s(recorded_step_time_s(config)),
        ring_degree=techniques.ring_degree,
    )
    tracker = DeviceMemoryTracker() if mesh.device.type != "cuda" else None
    if tracker is None:
        torch.cuda.reset_peak_memory_stats(mesh.device)
    losses = []
    with tracker if tracker is not None else contextlib.nullcontext():
        model = hf.from_pretrained(args.model, techniques, mesh, lora=config.lora, seed=args.seed)
        optimizer = make_optimizer(model, techniques, mesh, lr=args.lr)
        stream, ends, pads = (packed.tokens, packed.ends, packed.pads) if packed is not None else (None, None, None)
        source = TokenSource(seq_len, model.config.vocab_size, args.seed, stream=stream, ends=ends, pads=pads)
        for step in range(args.steps):
            index = step * mesh.dp_size + mesh.dp_rank
            batch = source.batch(index, mesh)
            start = time.perf_counter()
            result = train_step(model, optimizer, batch, mesh)
            losses.append(result.loss)
            if mesh.rank == 0:
                rate = seq_len * mesh.dp_size / (time.perf_counter() - start)
                print(
                    f"step {{step + 1}}/{{args.steps}}  loss {{result.loss:.6f}}  grad_norm {{result.grad_norm:.4f}}  "
                    f"{{rate:,.0f}} tokens/s",
                    flush=True,
                )
    peaks = [peak_bytes(mesh, tracker)]
    if dist.is_initialized():
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak_bytes(mesh, tracker))
    summary = {{
        "steps": args.steps,
        "seq_len": seq_len,
        "world_size": mesh.world_size,
        "first_loss": losses[0] if losses else None,
        "losses": losses,
        "ranks": peaks,
    }}
    if mesh.rank == 0:
        print("summary " + json.dumps(summary), flush=True)
        if args.summary:
            with open(args.summary, "w") as out:
                json.dump(summary, out, indent=2)
    if dist.is_initialized():
        dist.barrier()  # every rank done before any tears the group down
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no C++ static destructors: one can abort a finished rank (see trials.train)
'''
