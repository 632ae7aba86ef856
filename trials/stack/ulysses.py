"""DeepSpeed-Ulysses sequence parallelism around attention (DeepSpeed ALST's ``UlyssesSPAttentionHF``).

Each rank of a Ulysses group holds seq/deg tokens of every head. Around the core attention op, an
all-to-all swaps the sequence shard for a head shard, and a second one swaps back:

    q [b, hq, s/deg, d]  --all-to-all-->  [b, hq/deg, s, d]   (kv heads: hkv/deg, or 1 after replication
    k [b, hkv, s/deg, d]                  [b, hkv/deg, s, d]   when hkv < deg)
    attention over the full sequence for the local heads -> [b, s, hq/deg, d]
    --all-to-all-->  [b, s/deg, hq*d]  (this rank's tokens, all heads), then o_proj as usual

DeepSpeed's module does the reshapes, the GQA replication and the all-gather of ``position_ids``; we
hand it our causal core op and attach it per attention module (``module.autotune_attention``) instead of
replacing the process-wide HF registry, so several models can live in one process.
"""

from __future__ import annotations

from trials.kernels.attention import causal_attention
from trials.kernels.documents import documents_of


def _core_attention(kernel: str):
    def core(module, query, key, value, attention_mask, scaling=None, **kwargs):
        # a window or packed documents do not change Ulysses: each rank attends over the whole sequence for its
        # heads, so the documents' boundaries are the global ones
        window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
        documents = documents_of(kwargs, key.shape[2])
        return causal_attention(query, key, value, scaling, kernel, window, softcap, documents), None

    return core


def apply_ulysses(model, mesh, kernel: str = "sdpa", core=None) -> None:
    """Ulysses around every attention module; ``core``: the attention op between the exchanges (default: the
    causal kernel over the whole sequence; ``trials.stack.ring`` passes its ring attention)."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    config = model.config
    uattn = UlyssesSPAttentionHF(
        attn=core or _core_attention(kernel),
        batch_size=1,
        attn_head_count=config.num_attention_heads,
        attn_head_size=config.head_dim,
        kv_head_count=config.num_key_value_heads,
        num_hidden_layers=config.num_hidden_layers,
        process_group=mesh.sp_group,
        seq_length_is_variable=True,
    )

    def ulysses_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        return uattn(module, query, key, value, None, scaling=scaling, **kwargs)

    for attn_module in attention_modules(model):
        attn_module.autotune_attention = ulysses_attention


def attention_modules(model):
    return [layer.self_attn for layer in model.lm.model.layers]
