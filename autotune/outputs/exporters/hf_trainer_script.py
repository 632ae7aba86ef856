"""The ``accelerate`` export's ``.trainer.py``: a minimal ``transformers.Trainer`` script with every knob applied,
for a user to diff against their own (``trials.hf_trainer``: the two lines, the ``TrainingArguments`` fields the
stack needs)."""

from __future__ import annotations

import json

from autotune.outputs.exporters.base import beside, comment_block
from trials.training.config_file import TrialConfig


def trainer_script(config: TrialConfig, notes: list[str], accelerate_path: str, device_is_host: bool) -> str:
    from trials.hf_trainer import training_arguments  # imports transformers' Trainer: only when exporting

    script = beside(accelerate_path, ".trainer.py")
    arguments = {**training_arguments(), "use_cpu": device_is_host}
    sft_arguments = {k: v for k, v in training_arguments(sft=True).items() if k not in arguments}
    return f'''{comment_block(notes)}
"""Train a Hugging Face causal LM with transformers' Trainer and this autotune config, every knob applied by the
plugin trials.hf: diff it against your own Trainer script (--sft: TRL's SFTTrainer). What changes in yours is two
lines (marked "the stack") and the TrainingArguments fields in STACK_ARGUMENTS (and SFT_STACK_ARGUMENTS for SFTConfig).

    accelerate launch --config_file {accelerate_path} {script} --model HF_FOLDER --output-dir OUT [--steps N] \\
        [--data tokens.parquet] [--save-steps K] [--resume OUT/checkpoint-K] [--summary summary.json] \\
        [--sft [--tokenizer FOLDER] [--packing]]

HF_FOLDER holds config.json and safetensors weights. Each example is one sequence of {config.seq_len:,} tokens
(input_ids, labels = input_ids: the stack shifts them over the whole sequence): trials' seeded synthetic tokens, or
--data, a Parquet/Arrow file of token ids read as one stream. The model is saved to OUT/final (from_pretrained
loads it). Rank 0 prints a "summary {{json}}" line, which --summary also writes: the logged losses and each rank's
peak device bytes (on CPU the simulated device's, as trials measure it; on CUDA torch.cuda's max allocated), from
before the model is built to the last step. A setting the stack cannot run stops it before training: one line, exit 2.
Packed documents run document-masked: --sft --packing cuts each window into the config's documents ("documents";
one: whole windows) and TRL's SFTTrainer packs them (packing=True, best-fit decreasing, padding-free: its batches'
position_ids restart at 0 at each document, from which the stack derives the documents; attention stays inside each).
A transformers.Trainer batch with such position_ids runs the same way. Padded batches are not supported.
A config with LoRA adapters ("lora") trains them alone on the frozen weights; OUT/final is then a peft adapter folder
(PeftModel.from_pretrained(base, OUT/final) loads it).
"""

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist
from transformers import TrainingArguments

from trials import hf  # the stack
from trials.core import allocator
from trials.core.dist import collective_timeout_s, init_mesh
from trials.core.errors import ConfigError
from trials.core.memory import DeviceMemoryTracker
from trials.hf_trainer import StackTrainer, StackTrainerMixin  # the stack
from trials.train import TokenSource, recorded_step_time_s
from trials.training.config_file import parse_config

CONFIG = json.loads(
    r"""
{json.dumps(config.to_dict(), indent=2)}
"""
)
# the TrainingArguments fields the stack needs (trials.hf_trainer.REQUIRED_ARGUMENTS refuses others)
STACK_ARGUMENTS = {json.dumps(arguments, indent=4).replace("true", "True").replace("false", "False")}
# and TRL's SFTConfig fields it needs (--sft)
SFT_STACK_ARGUMENTS = {json.dumps(sft_arguments, indent=4).replace("true", "True").replace("false", "False")}


class Windows(torch.utils.data.Dataset):
    """Example i: window i of the token stream, as input_ids and (unshifted) labels."""

    def __init__(self, source, count):
        self.source, self.count = source, count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        tokens = self.source.window(index)
        return {{"input_ids": tokens, "labels": tokens}}


def documents(examples, spec):
    """The training rows: one per window, or with ``spec`` (the config's documents, to pack) those documents cut
    from each window."""
    windows = [examples[i]["input_ids"].tolist() for i in range(len(examples))]
    packed = spec.for_length(len(windows[0])) if spec is not None and windows else None
    if packed is None:
        return [{{"input_ids": window}} for window in windows]
    return [{{"input_ids": window[start:end]}} for window in windows for start, end in packed.spans()]


def sft_trainer(model, training_args, examples, tokenizer, packed=None):
    import datasets
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    class StackSFTTrainer(StackTrainerMixin, SFTTrainer):  # the stack
        pass

    rows = datasets.Dataset.from_list(documents(examples, packed))
    return StackSFTTrainer(
        model=model,
        args=training_args,
        train_dataset=rows,
        processing_class=AutoTokenizer.from_pretrained(tokenizer),
    )


def peak_bytes(device, tracker) -> dict:
    if tracker is not None:
        return {{"peak_device_bytes": int(tracker.peak_device_bytes), "peak_host_bytes": int(tracker.peak_host_bytes)}}
    return {{"peak_device_bytes": int(torch.cuda.max_memory_allocated(device))}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="Hugging Face model folder (config.json + safetensors)")
    parser.add_argument("--output-dir", required=True, help="the Trainer's output_dir (checkpoints, final model)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--data", default=None, help="Parquet/Arrow file of token ids (default: synthetic tokens)")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--save-steps", type=int, default=0, help="a checkpoint every K steps (0: none)")
    parser.add_argument("--resume", default=None, help="a checkpoint folder to resume from")
    parser.add_argument("--config", default=None, help="another autotune config file (default: the one above)")
    parser.add_argument("--summary", default=None, help="write the JSON summary here (rank 0)")
    parser.add_argument("--sft", action="store_true", help="TRL's SFTTrainer instead of transformers' Trainer")
    parser.add_argument("--tokenizer", default=None, help="with --sft: the tokenizer's folder (default: --model)")
    parser.add_argument(
        "--packing", action="store_true", help="with --sft: TRL's packing of the config's documents, document-masked"
    )
    args = parser.parse_args(argv)
    if args.packing and not args.sft:
        parser.error("--packing: TRL's packing, with --sft")
    config = parse_config(json.load(open(args.config)) if args.config else CONFIG, args.config or "CONFIG")
    allocator.configure()  # before CUDA starts: the allocator settings the trials measured under
    mesh = init_mesh(  # the process group Accelerate then joins, its collectives' timeout above the longest step
        config.techniques.ulysses_degree,
        timeout_s=collective_timeout_s(recorded_step_time_s(config)),
        ring_degree=config.techniques.ring_degree,
    )
    if args.sft:
        from trl import SFTConfig

        packing = {{  # TRL packs the documents into sequences of seq_len; its batches carry position_ids
            "packing": True,
            "padding_free": True,
            "max_length": config.seq_len,
        }}
        whole = {{
            "max_length": None,  # whole sequences, as the config was tuned for
            "dataset_kwargs": {{"skip_prepare_dataset": True}},  # the examples are token ids already
        }}
        arguments_class = SFTConfig
        stack_arguments = {{**STACK_ARGUMENTS, **SFT_STACK_ARGUMENTS, **(packing if args.packing else whole)}}
    else:
        arguments_class, stack_arguments = TrainingArguments, STACK_ARGUMENTS
    training_args = arguments_class(
        output_dir=args.output_dir,
        max_steps=args.steps,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        train_sampling_strategy="sequential",
        report_to=[],
        **stack_arguments,
    )
    device = training_args.device
    tracker = DeviceMemoryTracker() if device.type != "cuda" else None
    if tracker is None:
        torch.cuda.reset_peak_memory_stats(device)
    with tracker if tracker is not None else contextlib.nullcontext():
        # the stack (and the config's LoRA adapters, if any): each rank reads its shards
        model = hf.from_pretrained(args.model, config.techniques, mesh, lora=config.lora)
        source = TokenSource(config.seq_len - 1, model.config.vocab_size, 0, args.data)  # windows of seq_len
        steps = args.steps * training_args.gradient_accumulation_steps * mesh.dp_size
        examples = Windows(source, steps)
        if args.sft:
            packed = config.documents if args.packing else None
            trainer = sft_trainer(model, training_args, examples, args.tokenizer or args.model, packed)
        else:
            trainer = StackTrainer(model=model, args=training_args, train_dataset=examples)
        trainer.train(resume_from_checkpoint=args.resume)
    peaks = [peak_bytes(device, tracker)]
    if dist.is_initialized():
        peaks = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, peak_bytes(device, tracker))
    trainer.save_model(os.path.join(args.output_dir, "final"))
    losses = {{entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}}
    summary = {{"world_size": mesh.world_size, "losses": losses, "ranks": peaks}}
    if trainer.is_world_process_zero():
        print("summary " + json.dumps(summary), flush=True)
        if args.summary:
            with open(args.summary, "w") as out:
                json.dump(summary, out, indent=2)
    return 0


if __name__ == "__main__":
    try:
        code = main()
    except ConfigError as exc:  # every rank refuses alike; the first says why
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"{{os.path.basename(sys.argv[0])}}: {{exc}}", file=sys.stderr, flush=True)
        code = 2
    if dist.is_initialized():
        dist.barrier()  # every rank done before any tears the group down
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no C++ static destructors: one can abort a finished rank (see trials.train)
'''
