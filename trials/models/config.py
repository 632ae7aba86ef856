"""Model configs: Hugging Face ``config.json`` files of the families ``trials.models.families`` declares, shipped presets or
a path.

Presets live in ``trials/models/presets/*.json`` (random weights are built from them; no hub, no downloads); each names the
published config it copies in ``_source``.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

from trials.core.errors import ConfigError
from trials.models.families import FULL, MODEL_TYPES, SLIDING, Family, family_of

_REQUIRED_MODEL_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
ATTENTION_LAYER_TYPES = (FULL, SLIDING)  # what the attention kernels run: full causal, and a sliding window


def _preset_path(name: str) -> Path:
    return Path(str(resources.files("trials.models") / "presets")) / f"{name}.json"


def model_names() -> list[str]:
    return sorted(p.stem for p in _preset_path("x").parent.glob("*.json"))


def model_reference(name_or_path: str) -> str:
    """The model as a config file records it: a preset's name, or the absolute path of a ``config.json`` or model
    folder. A relative path would load only from the folder the search ran in; an absolute one loads from anywhere
    on the machine, and on another machine ``--model`` names where the model is there."""
    if _preset_path(name_or_path).exists() or not Path(name_or_path).exists():
        return name_or_path
    return str(Path(name_or_path).resolve())


def load_model_config(name_or_path: str) -> dict:
    """The HF config dict of a preset name, a ``config.json`` path or a model folder holding one, validated against its family and by
    ``transformers`` (``ConfigError`` with the reason otherwise); ``num_key_value_heads`` and ``head_dim`` filled in.
    A Gemma 3 multimodal config gives its text model's config."""
    preset = _preset_path(name_or_path)
    path = preset
    if not preset.exists():
        path = Path(name_or_path)
        if path.is_dir() and (path / "config.json").is_file():  # a model folder: its config
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(
                f"unknown model {name_or_path!r}: use a preset ({', '.join(model_names())}) "
                "or a path to a Hugging Face config.json or its model folder"
            )
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"model config {str(path)!r} is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model config {str(path)!r} is not a JSON object")
    config = _text_config(config)
    model_type = config.get("model_type")
    try:
        declared = family_of(model_type)
    except KeyError:
        raise ConfigError(
            f"model config {str(path)!r} has model_type {model_type!r}; supported: {', '.join(MODEL_TYPES)}"
        ) from None
    for key in _REQUIRED_MODEL_KEYS:
        value = config.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError(f"model config {str(path)!r}: {key} must be a positive integer, got {value!r}")
    config.setdefault("num_key_value_heads", config["num_attention_heads"])
    if config.get("head_dim") is None:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise ConfigError(
            f"model config {str(path)!r}: num_key_value_heads {config['num_key_value_heads']} "
            f"does not divide num_attention_heads {config['num_attention_heads']}"
        )
    problem = _layer_types_problem(config) or _transformers_problem(config, declared)
    if problem:
        raise ConfigError(f"model config {str(path)!r}: {problem}")
    config["_name"] = name_or_path if preset.exists() else str(path)
    return config


def _text_config(config: dict) -> dict:
    """A multimodal config's language model (Gemma 3's ``text_config``): trials train the decoder."""
    text = config.get("text_config")
    if config.get("model_type") == "gemma3" and isinstance(text, dict):
        return {"model_type": "gemma3_text", **text}
    return config


def _layer_types_problem(config: dict) -> str | None:
    """Why the model's per-layer attention types are not what the kernels run, or None."""
    layer_types = config.get("layer_types")
    if layer_types is None:
        return None
    if not isinstance(layer_types, list) or len(layer_types) != config["num_hidden_layers"]:
        return f"layer_types must list one type per layer ({config['num_hidden_layers']})"
    other = sorted(set(layer_types) - set(ATTENTION_LAYER_TYPES))
    if other:
        return f"layer_types {other} are not supported: trials run {' and '.join(ATTENTION_LAYER_TYPES)} layers"
    return None


def _transformers_problem(config: dict, family: Family) -> str | None:
    """Why ``transformers`` refuses the config, or why its attention is not one the kernels run (None: fine)."""
    try:
        hf = hf_config_of(config)
    except Exception as exc:  # transformers' own validation: its message says what is wrong
        return f"transformers refuses it ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    windows = [w for w in family.layer_windows(hf) if w is not None]
    if any(w <= 0 for w in windows):
        return f"sliding_window must be positive, got {min(windows)}"
    partial = (getattr(hf, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    if family.name == "phi3" and partial not in (None, 1.0):
        return f"partial_rotary_factor {partial} is not supported: trials rotate whole heads"
    return None


def hf_config_of(model_config: dict):
    """The ``transformers`` config object of a model config dict (its class fills and normalises the keys); read
    it, do not change it (one object per distinct dict)."""
    return _hf_config_cached(json.dumps(model_config, sort_keys=True))


@functools.lru_cache(maxsize=64)
def _hf_config_cached(config_json: str):
    from trials.models.model import hf_config

    return hf_config(json.loads(config_json))


def family(model_config: dict) -> Family:
    return family_of(model_config["model_type"])


def with_layers(model_config: dict, layers: int) -> dict:
    """The config of the same model ``layers`` decoder layers deep (a reduced-depth copy), valid for its family."""
    return family(model_config).with_layers(model_config, layers)


def copy_for_runs(model_config: dict, runs) -> dict:
    """The config of the copy of the model whose decoder layers are ``runs`` (``trials.trial.segments.layer_runs``): as
    deep as the runs, its layers' attention kinds in the runs' order where the runs name them."""
    depth = sum(int(n) for _, n in runs)
    kinds = [kind.split("/", 1)[1] for kind, n in runs for _ in range(int(n)) if "/" in kind]
    return family(model_config).with_layers(model_config, depth, kinds or None)


def layer_kinds(model_config: dict) -> list[str] | None:
    """Each layer's attention kind (``sliding_attention`` / ``full_attention``) where the model has both, else None."""
    windows = layer_windows(model_config)
    if len({w is None for w in windows}) < 2:
        return None
    return [FULL if w is None else SLIDING for w in windows]


def layer_windows(model_config: dict) -> list[int | None]:
    """Each decoder layer's sliding window (None: full causal attention)."""
    return family(model_config).layer_windows(hf_config_of(model_config))


def attention_features(model_config: dict) -> dict[str, float]:
    """What the model's attention needs of a kernel beyond full causal attention (``Family.attention_features``:
    a window, a softcap), and its ``head_dim`` (q, k and v alike in every family here), which kernels bound per GPU
    generation (``trials.kernels.registry.AttentionKernel.head_dims``)."""
    features = family(model_config).attention_features(hf_config_of(model_config))
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]
    return {**features, "head_dim": head_dim}


def experts(model_config: dict) -> tuple[int, int] | None:
    """(experts per MoE layer, experts per token) of a mixture-of-experts model; None for a dense one."""
    hf = hf_config_of(model_config)
    count = family(model_config).experts(hf)
    return (count, int(hf.num_experts_per_tok)) if count else None


def parameter_count(config: dict) -> int:
    """Parameters of the model, counted on the model ``transformers`` builds (on the meta device: no memory)."""
    from trials.models.model import build_model

    model = build_model(config, device="meta")
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
