"""``--format deepspeed``: a DeepSpeed config JSON (judged by ``deepspeed.runtime.config.DeepSpeedConfig``) and,
beside it, ``.alst.py``: the ALST pieces the JSON cannot carry, through DeepSpeed's own API (Ulysses attention and
its data loader adapter, ``TiledMLP``, ``TiledFusedLogitsLoss``, checkpoint-input offload), for a script that
trains a Hugging Face model with ``deepspeed.initialize``.

What DeepSpeed cannot do: head chunking (its Ulysses attention runs all local heads at once) and tiled RMSNorm.
Autotune's optimizer offload (FSDP2 ``CPUOffloadPolicy``: sharded params, grads and Adam states on the host) is
ZeRO-3 with ``offload_optimizer`` and ``offload_param`` on the CPU. Checkpoint offload of the first N layers is
DeepSpeed's ``CheckpointHiddenStatesOffload`` keeping the newest ``layers - N`` inputs on the device.
``seq_parallel_communication_data_type`` is written where Ulysses runs: ``fp32``, the precision autotune's trials
reduce gradients in (ALST's own recipes use ``bf16``, which saves a few GiB at a cost in gradient precision).
"""

from __future__ import annotations

import json

from autotune.core.trainers import TRAINERS
from autotune.outputs.exporters.base import (
    Exporter,
    Rendered,
    adamw,
    comment_block,
    hf_attention,
    hf_model_name,
)
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques
from trials.training.config_file import TrialConfig


def mlp_classes(model_config: dict) -> list[tuple[str, str]]:
    """(module, class name) of the model's decoder-layer MLPs (``LlamaMLP``; an MoE model's sparse block, and its
    dense MLP where some layers have one), read off the model ``transformers`` builds (on meta: no memory)."""
    from trials.models.model import build_model

    model = build_model(model_config, device="meta")
    return sorted({(type(layer.mlp).__module__, type(layer.mlp).__name__) for layer in model.layers})


def deepspeed_json(techniques: Techniques, with_optimizer: bool = True) -> dict:
    """The DeepSpeed config of ``techniques``: bf16 compute, ZeRO-3 for ``fsdp`` (0 without), CPU offload of
    optimizer states and params for ``optimizer_offload``, Ulysses' degree and gradient precision, clipping as
    ``autotune run`` clips. ``with_optimizer``: an AdamW section with ``autotune run``'s defaults (``adamw``;
    Accelerate and the Trainer bring their own optimizer)."""
    t = techniques
    zero: dict = {"stage": 3 if t.fsdp else 0}
    if t.fsdp:
        zero.update(
            {"overlap_comm": True, "contiguous_gradients": True, "stage3_gather_16bit_weights_on_model_save": True}
        )
    if t.optimizer_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    optimizer = adamw()
    config: dict = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": optimizer["max_grad_norm"] or 0.0,  # DeepSpeed's 0: no clipping
        "bf16": {"enabled": True},
        "zero_optimization": zero,
        "sequence_parallel_size": t.ulysses_degree,
    }
    if t.ulysses_degree > 1:
        config["seq_parallel_communication_data_type"] = "fp32"
    if with_optimizer:
        params = {key: optimizer[key] for key in ("lr", "betas", "weight_decay")}
        config["optimizer"] = {"type": "AdamW", "params": params}  # autotune run's defaults
    return config


class DeepSpeedConfigExporter(Exporter):
    name = "deepspeed"
    default_file = "ds.json"
    trainer = TRAINERS["deepspeed"]

    def render(self, config: TrialConfig, notes: list[str], path: str) -> Rendered:
        json_text = json.dumps(deepspeed_json(config.techniques), indent=2)
        return Rendered(json_text, {".alst.py": alst_python(config, notes, json_name=path)})

    def launch(self, path: str, config: TrialConfig) -> str:
        return (
            f"deepspeed --num_gpus {config.gpus} your_train.py  (your_train.py uses {path} and the .alst.py beside it)"
        )


def alst_python(config: TrialConfig, notes: list[str], json_name: str) -> str:
    """The ``.alst.py`` companion: this config's ALST pieces through DeepSpeed's API, as functions a training
    script calls. Every value comes from ``config``; a technique that is off leaves its function a no-op."""
    t = config.techniques
    model_config = load_model_config(config.model)
    mlps = mlp_classes(model_config)
    imports = "\n".join(sorted({f"import {module}" for module, _ in mlps}))
    tile_mlps = "\n".join(f"        {module}.{name}.forward = _tiled_mlp_forward" for module, name in mlps)
    layers = model_config["num_hidden_layers"]
    return f'''{comment_block(notes)}
"""DeepSpeed ALST for this config: what {json_name} cannot carry (deepspeed >= 0.19.8, transformers >= 4.56).

    mpu = before_model()                        # before the model is created (Ulysses attention, tiled MLP)
    model = AutoModelForCausalLM.from_pretrained(MODEL, attn_implementation=ATTENTION, dtype=torch.bfloat16)
    after_model(model)                          # activation checkpointing
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config="{json_name}", mpu=mpu)
    loader = packed_windows(documents)          # your documents (lists of token ids) packed, as autotune run --pack
    loader = sequence_parallel_loader(loader, engine.device)  # each batch: input_ids, labels, position_ids
    for batch in loader:
        with offload_context():                 # checkpointed inputs to the host, through forward and backward
            loss = tiled_loss(engine.module, batch)
            engine.backward(loss)
        engine.step()
"""
import contextlib
import math

import torch
import torch.distributed as dist
from deepspeed.runtime.activation_checkpointing.offload_activations import (
    get_checkpoint_hidden_states_offloading_ctx_manager,
)
from deepspeed.runtime.sequence_parallel.ulysses_sp import (
    TiledFusedLogitsLoss, TiledMLP, UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter,
)
from deepspeed.utils import groups
from transformers import DataCollatorWithFlattening
{imports}

MODEL = {hf_model_name(config.model)!r}
SEQ_LEN = {config.seq_len}                 # tokens per sequence
DOCUMENTS = {json.dumps(config.documents.to_json())}  # what the estimate packed per sequence ("one": whole sequences)
SEQUENCE_PARALLEL = {t.ulysses_degree}     # Ulysses degree
ATTENTION = {hf_attention(t)!r}
CHECKPOINTING = {t.activation_checkpointing}
OFFLOADED_LAYERS = {t.activation_offload_layers}          # the first N of {layers} layers' checkpointed inputs
MLP_TILE_TOKENS = {t.mlp_tile_tokens}        # 0 = untiled
LOSS_TILE_TOKENS = {t.loss_tile_tokens}       # 0 = untiled
LAYERS = {layers}


def before_model():
    """Ulysses attention over SEQUENCE_PARALLEL ranks (DeepSpeed's mpu; None without) and the tiled MLP."""
    if MLP_TILE_TOKENS:
{tile_mlps}
    return UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=MODEL, core_attn_implementation=ATTENTION, sequence_parallel_size=SEQUENCE_PARALLEL,
        micro_batch_size=1, seq_length=SEQ_LEN, seq_length_is_variable=True)


def after_model(model):
    if CHECKPOINTING:  # non-reentrant: what DeepSpeed's checkpoint offload hooks into
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})


def sequence_parallel_loader(loader, device):
    """Each rank gets its shard of every sequence, labels pre-shifted into shift_labels (a no-op without SP)."""
    if SEQUENCE_PARALLEL == 1:
        return loader
    group = groups._get_sequence_parallel_group()
    return UlyssesSPDataLoaderAdapter(loader, sp_rank=dist.get_rank(group), sp_group=group,
                                      sp_world_size=SEQUENCE_PARALLEL, device=device)


def packed_windows(documents):
    """``documents`` (lists of token ids) back to back in windows of SEQ_LEN tokens, a document crossing a window's
    end cut there (the last, partial window dropped): each window one batch of input_ids, labels and position_ids
    that restart at 0 at each document (transformers' DataCollatorWithFlattening: each document's first label is
    -100, so no label crosses a boundary). Attention stays inside each document where the kernel reads the
    position_ids (transformers' flash_attention_2 derives cu_seqlens from them)."""
    collate = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
    pieces, room = [], SEQ_LEN
    for document in documents:
        document = list(document)
        while document:
            piece, document = document[:room], document[room:]
            pieces.append({{"input_ids": piece}})
            room -= len(piece)
            if room == 0:
                yield collate(pieces)
                pieces, room = [], SEQ_LEN


def offload_context():
    if not OFFLOADED_LAYERS:
        return contextlib.nullcontext()
    return get_checkpoint_hidden_states_offloading_ctx_manager(keep_last_count=LAYERS - OFFLOADED_LAYERS)


def _mlp(self, x):
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _tiled_mlp_forward(self, x):
    tiles = max(1, math.ceil(x.shape[-2] / MLP_TILE_TOKENS))
    return TiledMLP.apply(_mlp, self, x, tiles, [self.down_proj.weight, self.gate_proj.weight, self.up_proj.weight])


def _loss_sum(self, x, y):
    logits = self.lm_head(x).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1), ignore_index=-100,
                                             reduction="sum")


def tiled_loss(model, batch):
    """The mean loss over the whole sequence: forward, then logits + cross-entropy in LOSS_TILE_TOKENS tiles,
    each tile's sum divided by the sequence's label count before DeepSpeed's tiled loss takes its gradients
    (it computes them inside forward), then summed over the sequence-parallel group."""
    labels = batch["shift_labels"] if "shift_labels" in batch else torch.nn.functional.pad(
        batch["labels"][..., 1:], (0, 1), value=-100)
    count = (labels != -100).sum()
    group = groups._get_sequence_parallel_group() if SEQUENCE_PARALLEL > 1 else None
    if group is not None:
        dist.all_reduce(count, group=group)
    count = count.clamp(min=1)

    def tile_loss(self, x, y):
        return _loss_sum(self, x, y) / count

    inputs = {{k: v for k, v in batch.items() if k not in ("labels", "shift_labels")}}
    hidden = model.model(**inputs, use_cache=False).last_hidden_state
    if LOSS_TILE_TOKENS:
        tiles = max(1, math.ceil(labels.shape[-1] / LOSS_TILE_TOKENS))
        loss = TiledFusedLogitsLoss.apply(tile_loss, model, hidden, labels, None, tiles, [model.lm_head.weight], "sum")
    else:
        loss = tile_loss(model, hidden, labels)
    if group is not None:
        loss = sum(torch.distributed.nn.functional.all_gather(loss, group=group))
    return loss
'''
