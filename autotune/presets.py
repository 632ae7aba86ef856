"""Model and hardware presets shipped as files inside the package (no model hub).

Models are Hugging Face ``config.json`` files (Llama or Qwen3 style); ``--model`` also takes a path
to any such file. Hardware presets are YAML with capacities, rates and named runtime overheads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path

import yaml

from autotune.errors import UserError

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")
_REQUIRED_MODEL_KEYS = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
)


def _preset_dir(kind: str) -> Path:
    return Path(str(resources.files("autotune") / "presets" / kind))


def model_names() -> list[str]:
    return sorted(p.stem for p in _preset_dir("models").glob("*.json"))


def hardware_names() -> list[str]:
    return sorted(p.stem for p in _preset_dir("hardware").glob("*.yaml"))


def load_model_config(name_or_path: str) -> dict:
    """The HF config dict of a preset name or a ``config.json`` path, validated as Llama/Qwen-style."""
    path = _preset_dir("models") / f"{name_or_path}.json"
    if not path.exists():
        path = Path(name_or_path)
        if not path.is_file():
            raise UserError(
                f"unknown model {name_or_path!r}: use a preset ({', '.join(model_names())}) "
                "or a path to a Hugging Face config.json"
            )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"model config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise UserError(f"model config {str(path)!r} is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UserError(
            f"model config {str(path)!r} has model_type {model_type!r}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for key in _REQUIRED_MODEL_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise UserError(f"model config {str(path)!r}: {key} must be a positive integer, got {value!r}")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise UserError(
            f"model config {str(path)!r}: num_key_value_heads {config['num_key_value_heads']} "
            f"does not divide num_attention_heads {config['num_attention_heads']}"
        )
    config["_name"] = name_or_path if (_preset_dir("models") / f"{name_or_path}.json").exists() else str(path)
    return config


@dataclass(frozen=True)
class Hardware:
    """One accelerator of a node: capacity, rates (per direction) and runtime overheads, in bytes and FLOP/s."""

    name: str
    description: str
    device_memory_bytes: int
    bf16_flops: float
    hbm_bytes_per_s: float
    intra_node_bytes_per_s: float
    host_bytes_per_s: float
    cuda_context_bytes: int = 0
    nccl_buffer_bytes: int = 0
    allocator_fragmentation: float = 0.0
    host_memory_bytes_per_device: int = 0  # the node's host RAM / its accelerators; 0 = not checked
    # the oracle's error band on this hardware: a local search's prefilter skips a real trial only when the
    # predicted peak is over capacity by more than this fraction; closer calls run for real
    oracle_margin: float = 0.05

    def host_fits(self, host_bytes_per_rank: int | None) -> bool:
        return not self.host_memory_bytes_per_device or (host_bytes_per_rank or 0) <= self.host_memory_bytes_per_device

    @property
    def runtime_overhead_bytes(self) -> int:
        """Bytes no tensor shows: CUDA context and NCCL buffers."""
        return int(self.cuda_context_bytes + self.nccl_buffer_bytes)

    def with_memory_gib(self, gib: float | None) -> "Hardware":
        if gib is None:
            return self
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values["device_memory_bytes"] = int(gib * 1024**3)
        return Hardware(**values)


def load_hardware(name: str) -> Hardware:
    path = _preset_dir("hardware") / f"{name}.yaml"
    if not path.exists():
        raise UserError(f"unknown hardware {name!r}: choose one of {', '.join(hardware_names())}")
    data = yaml.safe_load(path.read_text())
    # YAML 1.1 reads 989.0e12 (no exponent sign) as a string: coerce to each field's declared type
    casts = {"int": lambda v: int(float(v)), "float": float, "str": str}
    return Hardware(**{f.name: casts[f.type](data[f.name]) for f in fields(Hardware) if f.name in data})
