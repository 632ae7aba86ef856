"""Exports of a search's front: config-v1 JSON, DeepSpeed config, ArcticTraining recipe, torchrun command."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from trials.config_file import TrialConfig
from trials.model_config import load_model_config
from trials.techniques import Techniques
from autotune.core.errors import UserError
from autotune.core.sizes import parse_tokens

FORMATS = ("autotune", "deepspeed", "arctic", "torchrun")
FRONT_SCHEMA = "autotune/pareto-v1"  # what ``autotune.outputs.report`` writes


def load_front(directory: Path) -> dict:
    """A search folder's ``pareto.json`` (``autotune/pareto-v1``; files from before the schema field are v1)."""
    path = Path(directory) / "pareto.json"
    if not path.is_file():
        raise UserError(f"{str(directory)!r} has no pareto.json: is it a search output folder?")
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise UserError(f"{str(path)!r} is not valid JSON ({exc})") from None
    schema = doc.get("schema", FRONT_SCHEMA) if isinstance(doc, dict) else None
    if schema != FRONT_SCHEMA:
        raise UserError(f"{str(path)!r}: schema {schema!r} is not {FRONT_SCHEMA!r}")
    return doc


def choose(front_doc: dict, target: int | None) -> dict:
    """The fastest front entry at or above ``target`` (default: the search's own target)."""
    target = front_doc["target"] if target is None else target
    reaching = [f for f in front_doc["front"] if f["seq_len"] >= target]
    if not reaching:
        longest = max((f["seq_len"] for f in front_doc["front"]), default=0)
        raise UserError(f"no front config reaches {target:,} tokens; the longest reached is {longest:,}")
    return max(reaching, key=lambda f: (f["tokens_per_s"], -f["seq_len"]))


def entry_config(front_doc: dict, entry: dict) -> TrialConfig:
    """A front entry as a config file. Entries carry ``predicted`` / ``measured`` (both sides, e.g. after
    ``autotune verify``); older ones only ``record``, which goes on its own side."""
    record = entry["record"]
    sides = {side: entry[side] if side in entry else (record if record["source"] == side else None)
             for side in ("predicted", "measured")}
    return TrialConfig(model=front_doc["model"], hardware=front_doc["hardware"], gpus=front_doc["gpus"],
                       seq_len=entry["seq_len"], techniques=Techniques.from_dict(entry["techniques"]), **sides)


def export_config(directory: Path, target: str | None, fmt: str) -> tuple[str, dict[str, str]]:
    """The exported text, and companion files of the format as {suffix: text} (a DeepSpeed JSON comes with
    the Python lines that enable what it cannot express)."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} must be one of {', '.join(FORMATS)}")
    front_doc = load_front(directory)
    entry = choose(front_doc, parse_tokens(target, "--target") if target is not None else None)
    config = entry_config(front_doc, entry)
    extras = {".alst.py": deepspeed_python(config)} if fmt == "deepspeed" else {}
    return EXPORTERS[fmt](config, entry), extras


def to_autotune(config: TrialConfig, entry: dict) -> str:
    return json.dumps(config.to_dict(), indent=2)


def _hf_attention(techniques: Techniques) -> str:
    return "flash_attention_2" if techniques.attention == "flash" else "sdpa"


def deepspeed_config(config: TrialConfig) -> dict:
    """The DeepSpeed JSON for the parts DeepSpeed's config can express (ZeRO, offload, SP, checkpointing)."""
    t = config.techniques
    zero: dict = {"stage": 3 if t.fsdp else 0}
    if t.fsdp:
        zero.update({"overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": "auto",
                     "stage3_gather_16bit_weights_on_model_save": True})
    if t.optimizer_offload:
        # our optimizer_offload = FSDP2 CPUOffloadPolicy: sharded params, grads and Adam states on the host
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "sequence_parallel_size": t.ulysses_degree,
        "activation_checkpointing": {
            "partition_activations": False,
            "cpu_checkpointing": t.activation_offload_layers > 0,
            "contiguous_memory_optimization": False,
            "number_checkpoints": None,
        },
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "betas": [0.9, 0.999], "weight_decay": 0.0}},
    }


def deepspeed_python(config: TrialConfig) -> str:
    """The lines that enable the ALST pieces a DeepSpeed JSON cannot express."""
    t = config.techniques
    lines = [
        "# ALST pieces the DeepSpeed JSON cannot express (DeepSpeed >= 0.19.7, before deepspeed.initialize):",
        "from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, TiledMLP",
        f"mpu = UlyssesSPAttentionHF.register_with_transformers(model_name_or_path=model, "
        f"core_attn_implementation={_hf_attention(t)!r}, sequence_parallel_size={t.ulysses_degree}, "
        f"micro_batch_size=1, seq_length={config.seq_len}, seq_length_is_variable=True)",
    ]
    if t.activation_checkpointing:
        lines.append("model.gradient_checkpointing_enable()")
    if t.mlp_tile_tokens or t.loss_tile_tokens or t.norm_tile_tokens or t.head_chunk is not None:
        lines.append(f"# tiling (mlp {t.mlp_tile_tokens}, loss {t.loss_tile_tokens}, rmsnorm {t.norm_tile_tokens} "
                     f"tokens) and head_chunk "
                     f"{t.head_chunk}: apply autotune's stack instead -- trials.stack.apply(model, techniques, mesh)")
    return "\n".join(lines)


def to_deepspeed(config: TrialConfig, entry: dict) -> str:
    return json.dumps(deepspeed_config(config), indent=2)


def to_arctic(config: TrialConfig, entry: dict) -> str:
    """An ArcticTraining recipe (projects/sequence-parallelism style)."""
    t = config.techniques
    model_config = load_model_config(config.model)
    recipe = {
        "type": "causal",
        "micro_batch_size": 1,
        "exit_iteration": 10,
        "sequence_parallel_size": t.ulysses_degree,
        "activation_checkpoint_cpu_offload": t.activation_offload_layers > 0,
        "tiled_mlp_compute": t.mlp_tile_tokens > 0,
        "deepspeed": {"zero_optimization": {"stage": 3 if t.fsdp else 0}},
        "optimizer": {"type": "cpu_adam" if t.optimizer_offload else "fused_adam", "learning_rate": 1e-5},
        "model": {"type": "liger" if t.loss_tile_tokens else "causal",
                  "name_or_path": model_config.get("_name", config.model),
                  "attn_implementation": _hf_attention(t)},
        "data": {"max_length": config.seq_len, "sources": ["HuggingFaceH4/ultrachat_200k"]},
    }
    if t.optimizer_offload:
        recipe["deepspeed"]["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if t.activation_checkpointing:
        recipe["gradient_checkpointing"] = True
    return yaml.safe_dump(recipe, sort_keys=False)


def torchrun_command(config_path: str, gpus: int, steps: str = "${STEPS:-10}") -> str:
    if gpus == 1:
        return f"python -m trials.train --config {config_path} --steps {steps}"
    return f"torchrun --standalone --nproc-per-node={gpus} -m trials.train --config {config_path} --steps {steps}"


def to_torchrun(config: TrialConfig, entry: dict) -> str:
    """A shell script: the config inline, then the exact command to train with autotune's own runner."""
    record = entry["record"]
    rate = record.get("tokens_per_s")
    return "\n".join([
        "#!/usr/bin/env bash",
        f"# autotune: {config.model}, {config.seq_len:,} tokens on {config.gpus}x {config.hardware} "
        f"(trial {entry['trial']}, {record['source']} {rate or 0:,.0f} tokens/s)",
        "# usage: STEPS=100 DATA=tokens.parquet bash this-file",
        "set -euo pipefail",
        "config=\"${CONFIG:-autotune-config.json}\"",
        "cat > \"$config\" <<'JSON'",
        json.dumps(config.to_dict(), indent=2),
        "JSON",
        torchrun_command('"$config"', config.gpus) + ' ${DATA:+--data "$DATA"}',
    ])


EXPORTERS = {"autotune": to_autotune, "deepspeed": to_deepspeed, "arctic": to_arctic, "torchrun": to_torchrun}
