"""Model families: one declaration per decoder architecture that trials run, read from its ``transformers`` config.

A ``Family`` says what a decoder layer of that architecture contains, as far as the technique stack cares: how
its attention projects q/k/v (separate ``q_proj``/``k_proj``/``v_proj``, or Phi-3's fused ``qkv_proj``), whether
q/k are normed per head, which layers attend through a sliding window and which config keys say so, whether
attention logits or final logits are softcapped, whether its MLP is a mixture of experts, and how its norms are
initialised. Everything layer-specific derives from the declaration and the config: the window of each layer
(``layer_windows``), a reduced-depth copy that is a valid model of the same family (``with_layers``), the
attention features a kernel must support (``attention_features``).

Windows follow Hugging Face's convention: a window ``W`` lets query ``i`` attend keys ``i-W+1 .. i``.
"""

from __future__ import annotations

from dataclasses import dataclass

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]  # the ``model_type`` values of ``config.json`` it covers
    # where a layer's sliding window comes from: "none" (full causal everywhere), "every_layer" (the config's
    # ``sliding_window`` applies to every layer when set), "layer_types" (layers typed ``sliding_attention``)
    window: str = "none"
    fused_qkv: bool = False  # one ``qkv_proj`` (rows: q heads, then k heads, then v heads)
    qk_norm: bool = False  # per-head RMSNorm of q and k (``q_norm``/``k_norm``)
    attn_softcap_key: str | None = None  # config key of the attention logits' tanh softcap
    final_softcap_key: str | None = None  # config key of the final logits' tanh softcap
    experts_key: str | None = None  # config key of the expert count (mixture-of-experts MLP)
    norm_weight_init: float = 1.0  # RMSNorm weight at initialisation (Gemma's norms scale by 1 + weight)
    # config keys holding one entry per decoder layer, or layer indices (cut for a reduced-depth copy)
    per_layer_keys: tuple[str, ...] = ("layer_types",)
    layer_index_keys: tuple[str, ...] = ()

    def layer_windows(self, config) -> list[int | None]:
        """The sliding window of each decoder layer (None: full causal), as the model's attention modules pass it.

        ``config`` is the ``transformers`` config object (its class normalises keys such as
        ``use_sliding_window`` and fills ``layer_types``)."""
        layers = config.num_hidden_layers
        window = getattr(config, "sliding_window", None)
        if self.window == "none" or not window:
            return [None] * layers
        if self.window == "every_layer":
            return [int(window)] * layers
        types = getattr(config, "layer_types", None) or [FULL] * layers
        return [int(window) if kind == SLIDING else None for kind in types]

    def attention_features(self, config) -> dict[str, float]:
        """The attention features a kernel must support for this model: ``window`` (the smallest window of any
        layer) and ``softcap`` (attention logit softcap), where present."""
        features = {}
        windows = [w for w in self.layer_windows(config) if w]
        if windows:
            features["window"] = min(windows)
        cap = getattr(config, self.attn_softcap_key, None) if self.attn_softcap_key else None
        if cap:
            features["softcap"] = float(cap)
        return features

    def final_softcap(self, config) -> float | None:
        cap = getattr(config, self.final_softcap_key, None) if self.final_softcap_key else None
        return float(cap) if cap else None

    def experts(self, config) -> int:
        return int(getattr(config, self.experts_key, 0) or 0) if self.experts_key else 0

    def with_layers(self, config_dict: dict, layers: int, layer_types: list[str] | None = None) -> dict:
        """The config dict of the same model ``layers`` decoder layers deep: per-layer lists cut to that length and
        layer-index lists to the layers that remain, so ``transformers`` takes the copy as the same family;
        ``layer_types`` (one per layer) sets the copy's attention kinds instead."""
        config = dict(config_dict, num_hidden_layers=layers)
        if layer_types is not None:
            if self.window != "layer_types" or len(layer_types) != layers:
                raise ValueError(f"a {self.name} copy of {layers} layers cannot take layer_types {layer_types}")
            config["layer_types"] = list(layer_types)
        for key in self.per_layer_keys:
            if isinstance(config.get(key), list):
                config[key] = config[key][:layers]
        for key in self.layer_index_keys:
            if isinstance(config.get(key), list):
                config[key] = [index for index in config[key] if index < layers]
        return config


FAMILIES = (
    Family("llama", ("llama",)),
    Family("mistral", ("mistral",), window="every_layer"),
    Family("qwen2", ("qwen2",), window="layer_types"),
    Family("qwen3", ("qwen3",), window="layer_types", qk_norm=True),
    Family(
        "gemma2",
        ("gemma2",),
        window="layer_types",
        attn_softcap_key="attn_logit_softcapping",
        final_softcap_key="final_logit_softcapping",
        norm_weight_init=0.0,
    ),
    Family(
        "gemma3",
        ("gemma3_text",),
        window="layer_types",
        qk_norm=True,
        attn_softcap_key="attn_logit_softcapping",
        final_softcap_key="final_logit_softcapping",
        norm_weight_init=0.0,
    ),
    Family("phi3", ("phi3",), window="every_layer", fused_qkv=True),
    Family(
        "qwen3_moe",
        ("qwen3_moe",),
        window="every_layer",
        qk_norm=True,
        experts_key="num_experts",
        layer_index_keys=("mlp_only_layers",),
    ),
    Family("mixtral", ("mixtral",), window="every_layer", experts_key="num_local_experts"),
)

MODEL_TYPES = tuple(t for family in FAMILIES for t in family.model_types)


def family_of(model_type: str) -> Family:
    """The family declaring ``model_type`` (``KeyError`` naming the supported ones otherwise)."""
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    raise KeyError(f"model_type {model_type!r} is not supported; supported: {', '.join(MODEL_TYPES)}")
