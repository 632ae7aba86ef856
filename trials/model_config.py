"""Model configs: Hugging Face ``config.json`` files of Llama/Qwen-style models, shipped presets or a path.

Presets live in ``trials/models/*.json`` (random weights are built from them; no hub, no downloads).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from trials.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral")
_REQUIRED_MODEL_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


def _preset_path(name: str) -> Path:
    return Path(str(resources.files("trials") / "models")) / f"{name}.json"


def model_names() -> list[str]:
    return sorted(p.stem for p in _preset_path("x").parent.glob("*.json"))


def load_model_config(name_or_path: str) -> dict:
    """The HF config dict of a preset name or a ``config.json`` path, validated as Llama/Qwen-style
    (``ConfigError`` with the reason otherwise); ``num_key_value_heads`` and ``head_dim`` filled in."""
    preset = _preset_path(name_or_path)
    path = preset
    if not preset.exists():
        path = Path(name_or_path)
        if not path.is_file():
            raise ConfigError(
                f"unknown model {name_or_path!r}: use a preset ({', '.join(model_names())}) "
                "or a path to a Hugging Face config.json"
            )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {str(path)!r} is not a JSON object")
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"model config {str(path)!r} has model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    for key in _REQUIRED_MODEL_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model config {str(path)!r}: {key} must be a positive integer, got {value!r}")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ConfigError(
            f"model config {str(path)!r}: num_key_value_heads {config['num_key_value_heads']} "
            f"does not divide num_attention_heads {config['num_attention_heads']}"
        )
    problem = _attention_problem(config)
    if problem:
        raise ConfigError(f"model config {str(path)!r}: {problem}")
    config["_name"] = name_or_path if preset.exists() else str(path)
    return config


PER_LAYER_KEYS = ("layer_types",)  # lists with one entry per decoder layer (``transformers`` 5 writes them)


def with_layers(model_config: dict, layers: int) -> dict:
    """The config of the same model ``layers`` decoder layers deep (a reduced-depth copy): per-layer lists cut to
    that length, so ``transformers`` takes the copy as a model of the same family."""
    config = dict(model_config, num_hidden_layers=layers)
    for key in PER_LAYER_KEYS:
        if isinstance(config.get(key), list):
            config[key] = config[key][:layers]
    return config


def _attention_problem(config: dict) -> str | None:
    """Why the model's attention is not what trials run (full causal attention in every layer), or None."""
    layer_types = config.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, list) or len(layer_types) != config["num_hidden_layers"]:
            return f"layer_types must list one type per layer ({config['num_hidden_layers']})"
        other = sorted(set(layer_types) - {"full_attention"})
        if other:
            return f"layer_types {other} are not supported: trials run full causal attention in every layer"
    window = config.get("sliding_window")
    windowed = window is not None and config.get("use_sliding_window") is not False
    if windowed and layer_types is None:
        return (
            f"sliding_window {window} is not supported: trials run full causal attention in every layer "
            "(set sliding_window to null to plan the model without its window)"
        )
    return None


def parameter_count(config: dict) -> int:
    """Parameters of the model: attention (GQA) and MLP per layer, norms, embedding and (untied) lm_head."""
    h, layers, inter, vocab = (
        config["hidden_size"],
        config["num_hidden_layers"],
        config["intermediate_size"],
        config["vocab_size"],
    )
    d, hq, hkv = config["head_dim"], config["num_attention_heads"], config["num_key_value_heads"]
    attn = h * d * (2 * hq + 2 * hkv)
    per_layer = attn + 3 * h * inter + 2 * h
    head = 0 if config.get("tie_word_embeddings") else vocab * h
    return layers * per_layer + vocab * h + head + h
