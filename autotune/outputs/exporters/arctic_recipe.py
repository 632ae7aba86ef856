"""``--format arctic``: an ArcticTraining recipe (YAML), valid against arctic-training 0.8's config schema
(``arctic_training.config.trainer.TrainerConfig``; unknown keys are refused there, so every key written here is
one of its fields).

ArcticTraining's ALST switches are booleans, so tile sizes are its own: ``tiled_mlp_compute`` tiles the MLP at
the model's hidden size (``ceil(tokens per rank / hidden)`` tiles, ``arctic_training/model/tiled_compute.py``);
with ``sequence_parallel_size > 1`` the logits + loss are always tiled (DeepSpeed's ``TiledFusedLogitsLoss``,
about 1 GiB of fp32 logits per tile, ``arctic_training/trainer/sft_trainer.py``), and not at all without it;
``activation_checkpoint_cpu_offload`` offloads every checkpointed layer input. Activation checkpointing is its
default (``model.disable_activation_checkpoint`` turns it off). It has no head chunking and no tiled RMSNorm.
``type: causal`` packs: its data factory puts each text row (a document) into ``max_length`` windows back to back
with ``position_ids`` restarting at each (``slice_and_pack_causal_batch``; no key turns it off), which
``flash_attention_2`` masks by; with another kernel the export re-estimates it attending across the documents.
The recipe uses the Hugging Face model factory, not ``type: liger``: Liger's kernels change the memory in ways
the oracle does not model, so a recipe using them could not claim the length it was estimated at.
"""

from __future__ import annotations

import yaml

from autotune.core.trainers import TRAINERS
from autotune.outputs.exporters.base import (
    MODEL_PLACEHOLDER,
    Exporter,
    Rendered,
    adamw,
    comment_block,
    hf_attention,
    hf_model_name,
)
from trials.training.config_file import TrialConfig

DATA_PLACEHOLDER = "REPLACE-WITH-YOUR-DATASET"


class ArcticRecipeExporter(Exporter):
    name = "arctic"
    default_file = "arctic-recipe.yaml"
    trainer = TRAINERS["arctic"]

    def recipe(self, config: TrialConfig) -> dict:
        t = config.techniques
        zero: dict = {"stage": 3 if t.fsdp else 0}
        if t.optimizer_offload:  # autotune's optimizer offload: sharded params, grads and Adam states on the host
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
        deepspeed: dict = {"zero_optimization": zero}
        if t.ulysses_degree > 1:  # the precision autotune's trials reduce gradients in (DeepSpeed's default)
            deepspeed["seq_parallel_communication_data_type"] = "fp32"
        model: dict = {
            "type": "huggingface",
            "name_or_path": hf_model_name(config.model),
            "attn_implementation": hf_attention(t),
        }
        if not t.activation_checkpointing:
            model["disable_activation_checkpoint"] = True
        defaults = adamw()  # autotune run's
        optimizer: dict = {
            "type": "cpu_adam" if t.optimizer_offload else "fused_adam",
            "learning_rate": defaults["lr"],
            "betas": defaults["betas"],
            "weight_decay": defaults["weight_decay"],
        }
        return {
            "type": "causal",
            "micro_batch_size": 1,
            "sequence_parallel_size": t.ulysses_degree,
            "activation_checkpoint_cpu_offload": t.activation_offload_layers > 0,
            "tiled_mlp_compute": t.mlp_tile_tokens > 0,
            "deepspeed": deepspeed,
            "optimizer": optimizer,
            "model": model,
            "data": {
                "sources": [{"type": "huggingface_causal", "name_or_path": DATA_PLACEHOLDER}],
                "max_length": config.seq_len,
            },
        }

    def render(self, config: TrialConfig, notes: list[str], path: str) -> Rendered:
        replace = [
            f"replace data.sources' {DATA_PLACEHOLDER} with your text dataset (a Hugging Face id or a "
            "folder with a 'text' column); causal packs it into max_length windows"
        ]
        if hf_model_name(config.model) == MODEL_PLACEHOLDER:
            replace.append(
                f"replace model.name_or_path {MODEL_PLACEHOLDER} with your model (a Hugging Face id or folder)"
            )
        header = comment_block(notes + replace)
        return Rendered(header + "\n" + yaml.safe_dump(self.recipe(config), sort_keys=False).rstrip())

    def launch(self, path: str, config: TrialConfig) -> str:
        return f"arctic_training {path} --num_gpus {config.gpus}"
