"""``--format accelerate-deepspeed``: a Hugging Face Accelerate config backed by DeepSpeed (ALST's Hugging Face
integration; YAML for ``accelerate launch --config_file``), the DeepSpeed JSON it points at (``.ds.json``), and a
Python snippet for Trainer users (``.trainer.py``). ``--format accelerate`` (``accelerate_config``) runs every knob
through the plugin ``trials.hf`` instead; this flavour is for users who keep the Trainer and DeepSpeed.

Accelerate >= 1.12 runs DeepSpeed-Ulysses (ALST's sequence parallelism) with ``distributed_type: DEEPSPEED`` and
a ``parallelism_config`` section (``sp_backend: deepspeed``); the Trainer (transformers >= 5.0) takes the same as
``TrainingArguments(parallelism_config=..., deepspeed=...)``. ZeRO-3, its CPU offload and activation
checkpointing are expressed, and (transformers 5.23's ``activation_checkpointing_kwargs={"offload": True}``)
offloading every checkpointed layer's input to pinned host memory -- synchronously, where autotune overlaps the
copies with compute, so slower than predicted. Neither has tiled MLP or tiled loss (the Trainer computes the
model's own loss over each rank's shard); DeepSpeed's Ulysses has no head chunking; tiled RMSNorm is autotune's
own.
"""

from __future__ import annotations

import json

import yaml

from autotune.core.trainers import TRAINERS
from autotune.outputs.exporters.base import (
    Exporter,
    Rendered,
    beside,
    comment_block,
    hf_attention,
    hf_model_name,
)
from autotune.outputs.exporters.deepspeed_config import deepspeed_json
from trials.training.config_file import TrialConfig


class AccelerateDeepSpeedExporter(Exporter):
    name = "accelerate-deepspeed"
    trainer = TRAINERS["accelerate-deepspeed"]
    default_file = "accelerate-deepspeed.yaml"

    def accelerate_yaml(self, config: TrialConfig, deepspeed_path: str) -> dict:
        t = config.techniques
        doc: dict = {
            "compute_environment": "LOCAL_MACHINE",
            "distributed_type": "DEEPSPEED",
            "deepspeed_config": {"deepspeed_config_file": deepspeed_path},
            "machine_rank": 0,
            "main_training_function": "main",
            "num_machines": 1,
            "num_processes": config.gpus,
            "rdzv_backend": "static",
            "same_network": True,
            "use_cpu": False,
        }
        if t.ulysses_degree > 1:
            # dp_replicate x dp_shard x sp = processes; with DeepSpeed, ZeRO shards over the data-parallel ranks
            doc["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": 1,
                "parallelism_config_dp_shard_size": config.gpus // t.ulysses_degree,
                "parallelism_config_sp_size": t.ulysses_degree,
                "parallelism_config_sp_backend": "deepspeed",
                "parallelism_config_sp_seq_length_is_variable": True,
                "parallelism_config_sp_attn_implementation": hf_attention(t),
            }
        return doc

    def render(self, config: TrialConfig, notes: list[str], path: str) -> Rendered:
        deepspeed_path = beside(path, ".ds.json")
        text = (
            comment_block(notes)
            + "\n"
            + yaml.safe_dump(self.accelerate_yaml(config, deepspeed_path), sort_keys=False).rstrip()
        )
        companions = {
            ".ds.json": json.dumps(deepspeed_json(config.techniques, with_optimizer=False), indent=2),
            ".trainer.py": trainer_python(config, notes, path, deepspeed_path),
        }
        return Rendered(text, companions)

    def launch(self, path: str, config: TrialConfig) -> str:
        return f"accelerate launch --config_file {path} your_train.py"


def trainer_python(config: TrialConfig, notes: list[str], accelerate_path: str, deepspeed_path: str) -> str:
    """The Trainer's side of the same config (transformers >= 5.0, accelerate >= 1.12; checkpoint offload and the
    ``activation_checkpointing`` names: transformers 5.23)."""
    t = config.techniques
    attention = hf_attention(t)
    if t.ulysses_degree > 1:
        parallelism = (
            f'ParallelismConfig(\n    sp_backend="deepspeed", sp_size={t.ulysses_degree}, '
            f"dp_shard_size={config.gpus // t.ulysses_degree},\n"
            f"    sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, "
            f"sp_attn_implementation={attention!r}),\n)"
        )
        batch = (
            f"one sequence of {config.seq_len:,} tokens (input_ids, labels, position_ids; a multiple of "
            f"{t.ulysses_degree}), which the Trainer shards over the {t.ulysses_degree} sequence-parallel ranks"
        )
    else:
        parallelism = "None  # no sequence parallelism: each rank trains whole sequences"
        batch = f"one sequence of {config.seq_len:,} tokens per rank (input_ids, labels)"
    checkpointing = {"offload": True} if t.activation_offload_layers else None
    return f'''{comment_block(notes)}
"""Hugging Face Trainer with this config (transformers 5.23 for activation_checkpointing*, >= 5.0 otherwise;
accelerate >= 1.12). Launch your script with accelerate launch --config_file {accelerate_path}
Each batch: {batch}. An Accelerate loop without the Trainer: model.activation_checkpointing_enable(
offload={bool(t.activation_offload_layers)}) when activation_checkpointing is on, and the same DeepSpeed JSON."""
import torch
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DeepSpeedSequenceParallelConfig
from transformers import AutoModelForCausalLM, TrainingArguments

parallelism_config = {parallelism}
training_args = TrainingArguments(
    output_dir="out",
    per_device_train_batch_size=1,  # the DeepSpeed JSON's micro batch
    gradient_accumulation_steps=1,
    bf16=True,
    activation_checkpointing={t.activation_checkpointing},
    activation_checkpointing_kwargs={checkpointing!r},
    deepspeed={deepspeed_path!r},  # before the model is created: ZeRO-3 builds it sharded
    parallelism_config=parallelism_config,
)


def load_model(name_or_path={hf_model_name(config.model)!r}):
    return AutoModelForCausalLM.from_pretrained(name_or_path, attn_implementation={attention!r},
                                                dtype=torch.bfloat16)
'''
