"""Published, measured long-context training runs against autotune's predictions of the same configs.

Each run below is one end-to-end training run that its authors measured and published (a paper's abstract or
table, a project's README or recipe, a benchmark table in a pull request), not one of autotune's own: the model,
the GPUs and nodes, the sequence length, the stack mapped onto autotune's knobs (what does not map, in one line),
and the published figure: step time, tokens/s, peak memory per GPU, or the longest length that trained. The
prediction is the plan backend's, the path of ``autotune estimate`` (``--max-seq`` for a longest length): the
memory oracle on a fake world of the run's size, the step priced with the hardware preset's rates. Nothing here is
fitted to these figures; a run outside its band says where the model or its mapping of the stack is off, and its
declaration says the likely cause.

Bands, predicted / published: step time within [0.8, 1.25] (tokens/s: the same band inverted), peak memory within
[0.85, 1.15], longest length within [0.7, 1.4]. A run is inside when every figure it publishes is. Peak memory is
compared with the oracle's tensor peak (torch's ``max_memory_allocated``), which is what the runs' tools report;
"GB" in a source is read as GiB (torch's statistics divided by 2**30, and HF's blog calls a 128K run needing about
81 "GB" an OOM on an 80 GB H100, which only GiB makes true).

Models that are not autotune presets are declared here as Hugging Face config dicts (from each model's
config.json) and written to a temporary folder for the run.

    .venv/bin/python bench/published_runs.py                 # predict every run (minutes to an hour, cold)
    .venv/bin/python bench/published_runs.py --list          # the declarations only, no prediction
    .venv/bin/python bench/published_runs.py --only trl-qwen3-8b-1m,easycontext-512k
    .venv/bin/python bench/published_runs.py --out bench/results/published_runs.txt
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

K = 1024
GIB = 2**30
BANDS = {"step_s": (0.8, 1.25), "tokens_per_s": (0.8, 1.25), "peak_gib": (0.85, 1.15), "max_seq": (0.7, 1.4)}
UNITS = {"step_s": "s/step", "tokens_per_s": "tokens/s", "peak_gib": "GiB", "max_seq": "tokens"}

# Hugging Face configs of the models that are not autotune presets (each from its config.json on the Hub)
MODELS = {
    "qwen3-8b": {
        "_source": "https://huggingface.co/Qwen/Qwen3-8B/blob/main/config.json",
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
    },
    "qwen3-4b": {
        "_source": "https://huggingface.co/Qwen/Qwen3-4B/blob/main/config.json",
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
    "qwen3-0.6b": {
        "_source": "https://huggingface.co/Qwen/Qwen3-0.6B/blob/main/config.json",
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "attention_bias": False,
    },
    "llama2-7b": {
        "_source": "https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json",
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "qwen2.5-7b": {
        "_source": "https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json",
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 152064,
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "max_window_layers": 28,
        "tie_word_embeddings": False,
    },
}

# ALST's stack as bench/ablation.py maps it (ZeRO-3 + CPU Adam, Ulysses, Liger's fused loss, TiledMLP, checkpoints
# offloaded to the host), without UPipe's head chunks; `ulysses_degree` set per run
ALST = {
    "fsdp": True,
    "optimizer_offload": True,
    "activation_checkpointing": True,
    "activation_offload_layers": "all",
    "mlp_tile_tokens": 16 * K,
    "loss_tile_tokens": 4 * K,
    "attention": "flash",
}


@dataclass(frozen=True)
class Figure:
    """One published figure: its kind (a key of ``BANDS``), its value in autotune's unit, and as published."""

    kind: str
    value: float
    published: str


@dataclass(frozen=True)
class Run:
    """One published run: where it is published, what ran, autotune's knobs for it, and its figures."""

    name: str
    source: str  # short name of the source (runs from one project or paper share it)
    url: str  # the primary source, with the table / figure / line
    model: str  # an autotune preset or a key of MODELS
    hardware: str
    gpus: int  # per node
    nodes: int
    seq_len: int  # the length the figures are at (a max-length figure: the first guess of the search)
    techniques: dict
    unmapped: str  # what of the run's stack autotune does not model, one line
    figures: tuple[Figure, ...]
    outside: str = ""  # the likely cause when a figure is outside its band (filled in from the stored run)
    # the trainer that ran it, as ``autotune estimate`` takes a config's: what it holds beside the traced tensors
    # (DeepSpeed ZeRO-3's buffers, ``Trainer.held_bytes``) counts against capacity and in the peak
    trainer: str = "autotune"
    mfu: float = 0.0  # a figure published as MFU: converted to tokens/s over the world (``resolve_figures``)

    @property
    def world(self) -> int:
        return self.gpus * self.nodes


RUNS = [
    Run(
        "alst-llama8b-1gpu",
        "ALST",
        "arXiv 2506.13996 (abstract, Fig. 1); recipe snowflakedb/ArcticTraining "
        "projects/sequence-parallelism/run-h100-sp1-llama-8b.yml",
        "llama3-8b",
        "h100-sxm",
        1,
        1,
        500_000,
        dict(ALST, ulysses_degree=1),
        "Llama-3.1-8B (the same shapes as llama3-8b); DeepSpeed's CPU Adam and ZeRO-3 on one GPU; "
        "Liger's fused linear cross-entropy as a 4K tiled loss",
        (Figure("max_seq", 500_000, "500K"),),
        trainer="deepspeed",
    ),
    Run(
        "alst-llama8b-8gpu",
        "ALST",
        "arXiv 2506.13996 (abstract, Fig. 1); recipe run-h100-sp8-llama-8b.yml sets max_length 3,800,000",
        "llama3-8b",
        "h100-sxm",
        8,
        1,
        3_700_000,
        dict(ALST, ulysses_degree=8),
        "Llama-3.1-8B; packed samples of ultrachat (attention over the whole pack, as one document); "
        "Liger's fused linear cross-entropy as a 4K tiled loss",
        (Figure("max_seq", 3_700_000, "3.7M"),),
        trainer="deepspeed",
    ),
    Run(
        "alst-llama8b-32gpu",
        "ALST",
        "arXiv 2506.13996 (abstract, Fig. 1); recipe run-h100-sp32-llama-8b.yml",
        "llama3-8b",
        "h100-sxm",
        8,
        4,
        15_000_000,
        dict(ALST, ulysses_degree=32),
        "Llama-3.1-8B; AWS EFA v2 between the nodes (the preset's fabric: 400 Gb/s per GPU); "
        "Liger's loss as a 4K tiled loss",
        (Figure("max_seq", 15_000_000, "15M"),),
        trainer="deepspeed",
    ),
    Run(
        "alst-qwen3-32b-8gpu",
        "ALST",
        "snowflakedb/ArcticTraining projects/sequence-parallelism/run-h100-sp8-qwen3-32b.yml "
        "(max_length: 1_550_000 # ok)",
        "qwen3-32b",
        "h100-sxm",
        8,
        1,
        1_550_000,
        dict(ALST, ulysses_degree=8),
        "the recipe's comment 'ok' is the length that ran, not a bisected limit; Liger's loss as a 4K tiled loss",
        (Figure("max_seq", 1_550_000, "1.55M"),),
        trainer="deepspeed",
    ),
    Run(
        "upipe-llama8b-8gpu",
        "UPipe",
        "arXiv 2602.21196 (abstract: 5M tokens, Llama3-8B, one 8xH100 node); "
        "togethercomputer/Untied-Ulysses torchtitan/exps/llama3_8b/run_all_8B.sh",
        "llama3-8b",
        "h100-sxm",
        8,
        1,
        5_242_880,
        {
            "fsdp": True,
            "ulysses_degree": 8,
            "head_chunk": 1,
            "activation_checkpointing": True,
            "activation_offload_layers": "all",
            "mlp_tile_tokens": 16 * K,
            "norm_tile_tokens": 64 * K,
            "loss_tile_tokens": 4 * K,
            "attention": "flash3",
        },
        "torchtitan's FSDP2 with Adam states on the GPU; UPipe's preallocated output buffers; Liger's fused "
        "loss as a 4K tiled loss; tiles of ceil(tokens / hidden) shards as 16K (MLP) and 64K (RMSNorm)",
        (Figure("max_seq", 5_242_880, "5M"),),
    ),
    Run(
        "easycontext-128k",
        "EasyContext",
        "github.com/jzhang38/EasyContext README, 'Speed' table (8 A100, Llama-2-7B, zigzag ring attention)",
        "llama2-7b",
        "a100-80g",
        8,
        1,
        128 * 1000,
        {
            "fsdp": True,
            "optimizer_offload": True,
            "ring_degree": 8,
            "activation_checkpointing": True,
            "attention": "flash",
        },
        "ZeRO-3 with parameters as well as Adam states offloaded (accelerate_configs/zero3_offload.json); "
        "flash-attn's fused cross-entropy over untiled logits; 128K read as 128,000 tokens",
        (Figure("tokens_per_s", 4266, "4266 tokens/s"),),
        outside="fixed per-step costs priced low or left out, which the 512K row's longer step hides: DeepSpeed ZeRO-3's parameter fetches from the host and its hooks, CPU Adam every 4 sequences; the figure is the first 5 steps, warm-up included",
        trainer="deepspeed",
    ),
    Run(
        "easycontext-512k",
        "EasyContext",
        "github.com/jzhang38/EasyContext README, 'Speed' table (8 A100, Llama-2-7B, zigzag ring attention)",
        "llama2-7b",
        "a100-80g",
        8,
        1,
        512_000,
        {
            "fsdp": True,
            "optimizer_offload": True,
            "ring_degree": 8,
            "activation_checkpointing": True,
            "attention": "flash",
        },
        "ZeRO-3 with parameters as well as Adam states offloaded; flash-attn's fused cross-entropy over untiled "
        "logits; the training script's --seq-length 512000",
        (Figure("tokens_per_s", 2133, "2133 tokens/s"),),
        trainer="deepspeed",
    ),
    Run(
        "trl-qwen3-8b-1m",
        "TRL",
        "huggingface/trl examples/sft_qwen3_8b_1m_context/sft_qwen3_8b_1m_context.py docstring "
        "(373 s/step, 56.2 GB per GPU; PR #6846)",
        "qwen3-8b",
        "h100-sxm",
        8,
        1,
        1_048_576,
        {
            "fsdp": True,
            "ring_degree": 8,
            "activation_checkpointing": True,
            "activation_offload_layers": "all",
            "loss_tile_tokens": 8 * K,
            "attention": "sdpa",
        },
        "torch's context parallelism (DTensor ring over SDPA, FSDP2, accelerate cp_size 8); TRL's chunked NLL "
        "(its chunk size as an 8K tile); YaRN RoPE (no memory or time of note)",
        (Figure("step_s", 373, "373 s"), Figure("peak_gib", 56.2, "56.2 GB")),
    ),
    Run(
        "trl-qwen3-0.6b-1m",
        "TRL",
        "huggingface/trl examples/sft_qwen3_8b_1m_context/sft_qwen3_8b_1m_context.py docstring "
        "(Qwen3-0.6B: 137 s/step on the same node)",
        "qwen3-0.6b",
        "h100-sxm",
        8,
        1,
        1_048_576,
        {
            "fsdp": True,
            "ring_degree": 8,
            "activation_checkpointing": True,
            "activation_offload_layers": "all",
            "loss_tile_tokens": 8 * K,
            "attention": "sdpa",
        },
        "as trl-qwen3-8b-1m; tied embeddings",
        (Figure("step_s", 137, "137 s"),),
    ),
    Run(
        "trl-qwen3-8b-2m-16gpu",
        "TRL",
        "huggingface/trl PR #6845, docs/source/distributing_training.md table "
        "(Qwen3-8B, 2M, 16 GPUs, cp_size 16: 696 s)",
        "qwen3-8b",
        "h100-sxm",
        8,
        2,
        2 * 1_048_576,
        {
            "fsdp": True,
            "ring_degree": 16,
            "activation_checkpointing": True,
            "activation_offload_layers": "all",
            "loss_tile_tokens": 8 * K,
            "attention": "sdpa",
        },
        "as trl-qwen3-8b-1m, the ring over two nodes; the PR's cluster fabric is not stated (the preset's: "
        "400 Gb/s per GPU)",
        (Figure("step_s", 696, "696 s"),),
    ),
    Run(
        "hfblog-qwen3-4b-64k",
        "HF blog",
        "huggingface.co/blog/ulysses-sp, 'Benchmarks': Memory Reduction and Throughput tables (SP=4, 64K)",
        "qwen3-4b",
        "h100-sxm",
        4,
        1,
        65_536,
        {
            "fsdp": True,
            "optimizer_offload": True,
            "ulysses_degree": 4,
            "activation_checkpointing": True,
            "attention": "flash",
        },
        "DeepSpeed ZeRO-3 + CPU Adam through TRL; gradient accumulation 8 (autotune's step has one optimizer "
        "step per sequence); untiled loss; hub kernel kernels-community/flash-attn2",
        (Figure("tokens_per_s", 13_396, "13,396 tokens/s"), Figure("peak_gib", 50.5, "50.5 GB")),
        outside="time: FA2 on H100 at the preset's assumed 0.33/0.27 of peak, below this run's, and the host Adam step (1.65 s) counted per sequence where the run takes it once per 8; memory: the published peaks sit about 16 GiB above the oracle's with ZeRO-3's buffers counted, at 32K and 64K alike (the same slope per token), a constant the oracle does not count: a reserved rather than allocated figure, or what DeepSpeed holds beyond its buffers at their defaults",
        trainer="deepspeed",
    ),
    Run(
        "hfblog-qwen3-4b-max",
        "HF blog",
        "huggingface.co/blog/ulysses-sp, 'Memory Reduction' table (SP=4: 96K fits at 66.0 GB, 128K OOM)",
        "qwen3-4b",
        "h100-sxm",
        4,
        1,
        98_304,
        {
            "fsdp": True,
            "optimizer_offload": True,
            "ulysses_degree": 4,
            "activation_checkpointing": True,
            "attention": "flash",
        },
        "as hfblog-qwen3-4b-64k; the published limit lies between 96K and 128K (96K taken)",
        (Figure("max_seq", 98_304, "96K"),),
        outside="the constant of hfblog-qwen3-4b-64k (about 16 GiB beyond ZeRO-3's buffers) missing from the peak; the published limit lies between 96K and 128K, and the prediction is beyond even the 128K that ran out of memory",
        trainer="deepspeed",
    ),
    Run(
        "360lf-qwen2.5-7b",
        "360-LLaMA-Factory",
        "github.com/Qihoo360/360-LLaMA-Factory README, 'SFT Max Length' table (8 x A800, SP 8)",
        "qwen2.5-7b",
        "a100-80g",
        8,
        1,
        210_000,
        {
            "fsdp": True,
            "optimizer_offload": True,
            "ring_degree": 8,
            "activation_checkpointing": True,
            "attention": "flash",
        },
        "zigzag ring-flash-attn; ZeRO-3 offload of parameters and optimizer; HF loss with logits upcast to fp32, "
        "untiled; A800 = A100 80 GB with 400 GB/s NVLink; 'coarse-grained' limit",
        (Figure("max_seq", 210_000, "210k"),),
        outside="DeepSpeed ZeRO-3 with offload, like the HF blog's runs whose peaks sit about 18 GiB above the oracle; the README calls its limits coarse-grained",
        trainer="deepspeed",
    ),
    Run(
        "360lf-qwen2.5-14b",
        "360-LLaMA-Factory",
        "github.com/Qihoo360/360-LLaMA-Factory README, 'SFT Max Length' table (8 x A800, SP 8)",
        "qwen2.5-14b",
        "a100-80g",
        8,
        1,
        175_000,
        {
            "fsdp": True,
            "optimizer_offload": True,
            "ring_degree": 8,
            "activation_checkpointing": True,
            "attention": "flash",
        },
        "as 360lf-qwen2.5-7b",
        (Figure("max_seq", 175_000, "175k"),),
        outside="DeepSpeed ZeRO-3 with offload, like the HF blog's runs whose peaks sit above the oracle's by a constant beyond ZeRO-3's buffers; the README calls its limits coarse-grained (its 7B row is inside)",
        trainer="deepspeed",
    ),
    Run(
        "usp-llama3-8b-208k-16gpu",
        "USP",
        "arXiv 2405.07719 (abstract: 86% MFU, LLAMA3-8B, 208K, two 8xA800 nodes)",
        "llama3-8b",
        "a100-80g",
        8,
        2,
        208 * K,
        {
            "fsdp": True,
            "ulysses_degree": 8,
            "ring_degree": 2,
            "activation_checkpointing": True,
            "attention": "flash",
        },
        "Megatron-DeepSpeed; the Ulysses x ring split (8 x 2) and ZeRO stage are this mapping's guess; MFU "
        "converted at 312 TFLOP/s with 6N + 12 L h s FLOPs per token (the paper's count is not in the abstract)",
        (Figure("tokens_per_s", 0.0, "86% MFU"),),
        mfu=0.86,
    ),
]


def model_flops_per_token(cfg: dict, seq_len: int) -> float:
    """6 x matmul parameters + full (non-causal) attention, 12 L h s: the count MFU figures are usually given in."""
    h, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d, hq, hkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    matmul = layers * (h * d * (hq + 2 * hkv) + hq * d * h + 3 * h * cfg["intermediate_size"])
    matmul += h * cfg["vocab_size"]
    return 6 * matmul + 12 * layers * hq * d * seq_len


def resolve_figures(run: Run, cfg: dict, peak_flops: float) -> tuple[Figure, ...]:
    """The run's figures in autotune's units: an MFU figure becomes tokens/s over the whole world."""
    if run.mfu:
        rate = run.mfu * peak_flops * run.world / model_flops_per_token(cfg, run.seq_len)
        return (Figure("tokens_per_s", rate, f"{run.mfu:.0%} MFU = {rate:,.0f} tokens/s"),)
    return run.figures


def model_path(name: str, folder: Path) -> str:
    """A preset name as is; a model of MODELS written to ``folder`` as its config.json."""
    if name not in MODELS:
        return name
    path = folder / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(MODELS[name]))
    return str(path)


def describe(run: Run) -> list[str]:
    """The declaration of one run, for ``--list`` and the output's header block."""
    knobs = ", ".join(f"{k}={v}" for k, v in run.techniques.items())
    figures = "; ".join(f"{f.kind} {f.published}" for f in run.figures)
    return [
        f"{run.name} [{run.source}] {run.model} on {run.nodes}x{run.gpus} {run.hardware}, {run.seq_len:,} tokens"
        + (f", trainer {run.trainer}" if run.trainer != "autotune" else ""),
        f"    source: {run.url}",
        f"    knobs: {knobs}",
        f"    not mapped: {run.unmapped}",
        f"    published: {figures}",
    ] + ([f"    outside its band: {run.outside}"] if run.outside else [])


def predict(run: Run, folder: Path, store: dict) -> dict:
    """The plan backend's answer for ``run``: the record at its length, or ``--max-seq``'s record."""
    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend
    from autotune.core.hardware import load_hardware
    from autotune.core.trainers import TRAINERS
    from autotune.search.max_seq import find_max_seq
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    cfg = load_model_config(model_path(run.model, folder))
    techniques = Techniques.from_dict(dict(run.techniques), cfg["num_hidden_layers"])
    techniques.validate(cfg, run.world)
    held = TRAINERS[run.trainer].held_bytes(techniques, cfg)
    hardware = load_hardware(run.hardware).for_nodes(run.nodes).holding(held)
    evaluation = Evaluation(cfg, techniques, run.seq_len, run.gpus, hardware, run.nodes)
    backend = PlanBackend()
    started = time.perf_counter()
    if any(f.kind == "max_seq" for f in run.figures):
        record = find_max_seq(evaluation, backend=backend)
    else:
        record = backend.evaluate(evaluation)
    store["seconds"] = time.perf_counter() - started
    store["cfg"] = cfg
    store["peak_flops"] = hardware.rates_for(run.world).bf16_flops
    store["held_bytes"] = held
    return record


def predicted_value(kind: str, record, held_bytes: int = 0) -> float | None:
    """The record's figure of ``kind``; the peak is the traced tensors' and what the trainer holds beside them."""
    if record.status != "ok":
        return None
    return {
        "step_s": record.step_time_s,
        "tokens_per_s": record.tokens_per_s,
        "peak_gib": ((record.peak_allocated_bytes or 0) + held_bytes) / GIB,
        "max_seq": record.seq_len,
    }[kind]


def fmt(kind: str, value: float | None) -> str:
    if value is None:
        return "-"
    if kind == "max_seq":
        return f"{value:,.0f}"
    if kind == "peak_gib":
        return f"{value:.1f}"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="print the declarations without predicting")
    parser.add_argument("--only", default="", help="comma-separated run names")
    parser.add_argument("--out", default="", help="also write the output to this file")
    args = parser.parse_args(argv)

    runs = [r for r in RUNS if not args.only or r.name in args.only.split(",")]
    unknown = set(filter(None, args.only.split(","))) - {r.name for r in runs}
    if unknown:
        parser.error(f"unknown run(s): {', '.join(sorted(unknown))}")
    if args.list:
        for run in runs:
            print("\n".join(describe(run)))
        print(f"{len(runs)} runs from {len({r.source for r in runs})} sources")
        return 0

    lines: list[str] = []

    def emit(line: str = "") -> None:
        print(line, flush=True)
        lines.append(line)

    emit("published, measured runs against autotune's plan backend (ratio = predicted / published)")
    emit(
        "bands: step time [0.8, 1.25] (tokens/s the same band inverted), peak memory [0.85, 1.15], "
        "longest length [0.7, 1.4]"
    )
    header = (
        f"{'run':<26} {'source':<17} {'GPUs':>7} {'length':>10} {'figure':<12} {'published':>12} "
        f"{'autotune':>12} {'ratio':>6} {'band':>4} {'predict s':>9}"
    )
    emit(header)
    emit("-" * len(header))
    inside_runs = 0
    outside_names: set[str] = set()
    figures_inside = figures_total = 0
    with tempfile.TemporaryDirectory(prefix="published-runs-") as tmp:
        for run in runs:
            store: dict = {}
            try:
                record = predict(run, Path(tmp), store)
            except Exception as why:  # a run autotune cannot express is a row, not a crash
                emit(f"{run.name:<26} {run.source:<17} error: {type(why).__name__}: {str(why)[:160]}")
                continue
            all_inside = True
            for figure in resolve_figures(run, store["cfg"], store["peak_flops"]):
                value = predicted_value(figure.kind, record, store["held_bytes"])
                ratio = None if value is None or not figure.value else value / figure.value
                low, high = BANDS[figure.kind]
                inside = ratio is not None and low <= ratio <= high
                all_inside &= inside
                figures_total += 1
                figures_inside += inside
                gpus = f"{run.nodes}x{run.gpus}"
                emit(
                    f"{run.name:<26} {run.source:<17} {gpus:>7} {run.seq_len:>10,} {figure.kind:<12} "
                    f"{fmt(figure.kind, figure.value):>12} "
                    f"{fmt(figure.kind, value) if value is not None else record.status:>12} "
                    f"{(f'{ratio:.2f}' if ratio is not None else '-'):>6} {'in' if inside else 'out':>4} "
                    f"{store['seconds']:9.0f}"
                )
            inside_runs += all_inside
            if not all_inside:
                outside_names.add(run.name)
    emit()
    for run in runs:
        if run.mfu:
            emit(
                f"{run.name}: published as {run.mfu:.0%} MFU, converted at the preset's bf16 peak with "
                "6N + 12 L h s FLOPs/token"
            )
    for run in runs:
        if run.outside and run.name in outside_names:
            emit(f"outside: {run.name}: {run.outside}")
    emit(
        "figure kinds: step_s seconds per step; tokens_per_s tokens per second over all GPUs; peak_gib the tensor "
        "peak per GPU; max_seq the longest length that fits (autotune estimate --max-seq)"
    )
    emit(f"figures inside their bands: {figures_inside}/{figures_total}")
    emit(f"sources: {len({r.source for r in runs})}; runs: {len(runs)}")
    emit(f"runs inside their bands: {inside_runs}/{len(runs)} = {inside_runs / max(1, len(runs)):.0%}")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
