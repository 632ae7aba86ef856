"""Model configs of every family ``trials.models.families`` declares, written by ``transformers``' own config classes
(``save_pretrained``, as users' ``config.json`` files are): real shapes for planning, tiny ones for exactness."""

from __future__ import annotations

from pathlib import Path

TINY = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
TINY_WINDOW = 96  # below the tests' sequence lengths, so the band is narrower than the causal triangle


def tiny_configs() -> dict:
    """name -> transformers config of a tiny model of each family (windows, alternation, softcaps, fused q/k/v,
    q/k norms, biases, experts)."""
    from transformers import (
        Gemma2Config,
        Gemma3TextConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    layers = dict(num_hidden_layers=4, intermediate_size=128, max_position_embeddings=4096)
    return {
        "tiny-mistral": MistralConfig(**TINY, **layers, sliding_window=TINY_WINDOW),
        "tiny-qwen2": Qwen2Config(**TINY, **layers),  # q/k/v biases
        "tiny-qwen3-window": Qwen3Config(  # layer_types: the upper half windowed
            **TINY, **layers, use_sliding_window=True, sliding_window=TINY_WINDOW, max_window_layers=2
        ),
        "tiny-gemma3": Gemma3TextConfig(  # alternating windows, q/k norms, tied embeddings
            **TINY, **layers, sliding_window=TINY_WINDOW, sliding_window_pattern=2, query_pre_attn_scalar=16
        ),
        "tiny-gemma2": Gemma2Config(  # final-logit softcap (attention softcap needs flash: off here)
            **TINY, **layers, sliding_window=TINY_WINDOW, attn_logit_softcapping=None, query_pre_attn_scalar=16
        ),
        "tiny-phi3": Phi3Config(  # fused qkv_proj, gate_up_proj
            **TINY, **layers, sliding_window=TINY_WINDOW, pad_token_id=None, bos_token_id=0, eos_token_id=1
        ),
        "tiny-qwen3-moe": Qwen3MoeConfig(
            **TINY, **layers, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2
        ),
        "tiny-mixtral": MixtralConfig(**TINY, **layers, num_local_experts=4, num_experts_per_tok=2),
    }


def real_configs() -> dict:
    """name -> transformers config of the published shapes the planner must take (no weights, no hub)."""
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        MixtralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    return {
        "llama3.1-8b": LlamaConfig(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
            rope_scaling={
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
        ),
        "mistral-7b": MistralConfig(sliding_window=4096),  # the class defaults are Mistral 7B's
        "qwen2.5-7b": Qwen2Config(
            vocab_size=152064,
            hidden_size=3584,
            intermediate_size=18944,
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            max_position_embeddings=131072,
            rope_theta=1000000.0,
        ),
        "qwen3-8b": Qwen3Config(  # transformers writes layer_types
            vocab_size=151936,
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40960,
        ),
        "gemma3-12b": Gemma3TextConfig(  # its real layer pattern: five sliding layers, then a global one
            vocab_size=262208,
            hidden_size=3840,
            intermediate_size=15360,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            sliding_window_pattern=6,
        ),
        "phi3-mini": Phi3Config(
            vocab_size=32064,
            hidden_size=3072,
            intermediate_size=8192,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            max_position_embeddings=4096,
            sliding_window=2047,
        ),
        "qwen3-30b-a3b": Qwen3MoeConfig(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            max_position_embeddings=40960,
        ),
        "mixtral-8x7b": MixtralConfig(rope_theta=1000000.0),  # the class defaults are Mixtral 8x7B's
    }


def save(config, folder: Path) -> Path:
    """``config.save_pretrained(folder)``; the path of its config.json."""
    config.save_pretrained(folder)
    return folder / "config.json"
