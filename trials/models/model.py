"""Build a Hugging Face causal LM from a preset config with seeded random weights (no downloads).

``TrainingModel`` wraps it so one ``forward`` returns the (scaled) loss: FSDP's root hooks then cover the
embedding, final norm and lm_head, and the loss can be tiled without materialising [seq, vocab] logits.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from trials.core.dist import is_sharded
from trials.core.memory import active_tracker
from trials.kernels import attention
from trials.kernels.documents import DOCUMENTS_KWARG
from trials.models.families import family_of
from trials.models.lora import FULL_TRAINING, TRAINED_COPY, LoraSpec, apply_lora

_CONFIG_ONLY_KEYS = ("_name", "_source")  # autotune's own keys, not transformers'


def hf_config(model_config: dict):
    from transformers import AutoConfig

    values = {k: v for k, v in model_config.items() if k not in _CONFIG_ONLY_KEYS and k != "model_type"}
    values.pop("architectures", None)
    config = AutoConfig.for_model(model_config["model_type"], **values)
    config.use_cache = False
    config._attn_implementation = attention.ATTN_IMPLEMENTATION
    return config


def build_model(
    model_config: dict, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> TrainingModel:
    """Random-weight model, identical on every rank for the same seed.

    ``device="meta"`` builds it without memory (nothing initialised): apply the technique stack, then
    ``materialize`` -- a sharded model then only ever holds its shards (70B in fp32 is 280 GB: it could never be
    built whole on an 80 GB device first). Either way the weights are ``init_weights``'s, so a model built whole
    and one materialised shard by shard hold the same values.
    """
    from transformers import AutoModelForCausalLM

    from trials.models import moe

    attention.register()
    config = hf_config(model_config)
    options = moe.experts_options(config)  # grouped experts: static shapes (the oracle traces them)
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(
            config, attn_implementation=attention.ATTN_IMPLEMENTATION, dtype=dtype, **options
        )
    model = TrainingModel(lm)
    if torch.device(device).type != "meta":
        materialize(model, device, seed)
    return model


# -- weights: built on meta, materialised after the stack ---------------------------------------------------

INIT_BLOCK_ROWS = 4096  # rows of a parameter drawn from one seeded generator (any shard needs whole blocks only)
# wrappers a parameter's name passes through that the plain model lacks: checkpointing's, FSDP1's, compile's, and
# peft's LoRA layer around the base linear (``q_proj.base_layer.weight`` is the checkpoint's ``q_proj.weight``)
_WRAPPER_NAMES = {"_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod", "base_layer", "original_module"}


def materialize(model: TrainingModel, device, seed: int = 0, params_device=None, init: bool = True) -> None:
    """Give a meta-built model (plain, or with the technique stack applied) real storage and its weights.

    Parameters go to ``params_device`` (default ``device``; the host for FSDP2's CPU offload), buffers (the
    rotary frequencies) are rebuilt on ``device``. Each rank draws only the rows of its own shards. ``init=False``
    leaves the parameters' storage unset, for a checkpoint's values (``trials.hf.from_pretrained``).
    """

    tracker = active_tracker()
    # parameters on the host (FSDP2's offloaded shards) are host memory for the tracker, on CPU trials too
    with tracker.on_host() if tracker is not None and params_device is not None else contextlib.nullcontext():
        _allocate_parameters(model, params_device or device)
    _rebuild_buffers(model, device)
    if init:
        init_weights(model, seed)


def _allocate_parameters(model, device) -> None:
    """``model.to_empty(device)`` for the parameters, by assignment rather than ``Module._apply``'s tensor swap
    (which the memory oracle's fake tensors refuse); tied parameters stay tied."""
    from torch.distributed.fsdp import FSDPModule

    allocated: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in allocated:  # DTensor shards stay DTensors: empty_like keeps the spec
                allocated[id(param)] = nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=param.requires_grad
                )
            module._parameters[key] = allocated[id(param)]
    for module in model.modules():  # FSDP2 holds its own reference to each sharded parameter: re-read them
        if isinstance(module, FSDPModule):
            group = module._get_fsdp_state()._fsdp_param_group
            for fsdp_param in group.fsdp_params if group is not None else ():
                fsdp_param.reset_sharded_param()


def _rebuild_buffers(model, device) -> None:
    """Buffers hold computed values: HF rotary embeddings' inverse frequencies (per layer type in Gemma 3) and a
    scaled embedding's scale (Gemma). Rebuild them on ``device``."""
    for module in model.modules():
        if next(module.buffers(recurse=False), None) is None:
            continue
        name = type(module).__name__
        if name.endswith("RotaryEmbedding"):
            with torch.device(device):
                fresh = type(module)(module.config)
            for key, buffer in fresh.named_buffers(recurse=False):
                setattr(module, key, buffer)
            for key, value in vars(fresh).items():  # ``attention_scaling``, ``{layer_type}_attention_scaling``
                if key.endswith("attention_scaling"):
                    setattr(module, key, value)
        elif name.endswith("ScaledWordEmbedding"):
            module.embed_scale = torch.tensor(module.scalar_embed_scale, device=device)
        else:
            raise ValueError(f"cannot materialise the buffers of {name}")


@torch.no_grad()
def init_weights(model: TrainingModel, seed: int = 0, adapters_only: bool = False) -> None:
    """HF's initialisation (``PreTrainedModel._init_weights``: Linear/Embedding weights ~ N(0, initializer_range),
    biases 0, norm weights 1 (0 where the family's norms scale by 1 + weight)) drawn so that the values depend only on (seed, parameter name, row): rows come in
    blocks of ``INIT_BLOCK_ROWS``, each from its own seeded generator on the host, so a rank holding a shard
    (FSDP2: dim-0 chunks) draws just the blocks it needs and gets exactly the rows the whole model would have.
    MoE (HF's own rule too): the experts' 3-D weights and the router's weight ~ N(0, initializer_range), the
    experts' biases 0; a 3-D weight's rows are its leading dims flattened ([E, out, in] -> [E * out, in]), so a
    dim-0 shard (whole experts) is a contiguous range of them and a block stays ``INIT_BLOCK_ROWS`` x ``in``.
    LoRA adapters (``trials.models.lora``, ``model.lora``): A ~ N(0, 1/rank), B zero (peft's ``"gaussian"``), or
    B ~ N(0, initializer_range) with ``init_lora_weights`` off. ``adapters_only``: draw the adapters alone (the base
    weights come from a checkpoint: ``trials.hf.from_pretrained``). A LoRA model's base weights draw what the plain
    model's do (their names are the plain model's: ``_canonical``).
    """
    from trials.models import lora, moe

    std = getattr(model.config, "initializer_range", None) or 0.02
    adapters = model.lora
    norm_init = family_of(model.config.model_type).norm_weight_init
    tracker = active_tracker()
    seen = set()
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights
                continue
            seen.add(id(param))
            name = _canonical(f"{module_name}.{param_name}")
            local, start = _local_rows(param)
            role = lora.adapter_role(module_name)
            if adapters_only and role is None:
                continue
            if role == "A":
                _fill_normal(local, start, param.shape, 1.0 / adapters.rank, _seed(seed, name), tracker)
            elif role == "B" and adapters.init_lora_weights:
                local.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding)) and param_name == "weight":
                _fill_normal(local, start, param.shape, std, _seed(seed, name), tracker)
            elif param_name == "bias":
                local.zero_()
            elif "Norm" in type(module).__name__ and param_name == "weight":
                local.fill_(norm_init)
            elif moe.is_experts_module(module) and param_name.endswith("_bias"):
                local.zero_()
            elif moe.is_experts_module(module) and param.dim() == 3:
                experts, per_expert, width = param.shape
                rows = local.view(-1, width)  # [E_local * out, in]: this shard's rows start at start * out
                _fill_normal(rows, start * per_expert, (experts * per_expert, width), std, _seed(seed, name), tracker)
            elif moe.is_router_module(module) and param_name == "weight":
                _fill_normal(local, start, param.shape, std, _seed(seed, name), tracker)
            else:
                raise ValueError(f"no initialisation rule for {name} ({type(module).__name__})")


def _canonical(name: str) -> str:
    """The parameter's name in the plain model (wrappers of checkpointing/FSDP/compile and peft's ``base_layer``,
    ``original_module`` and trained copies dropped: a copy starts as its original)."""
    name = name.replace(TRAINED_COPY, ".")
    return ".".join(part for part in name.split(".") if part and part not in _WRAPPER_NAMES)


def _seed(seed: int, name: str) -> int:
    import zlib

    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def _local_rows(param) -> tuple[torch.Tensor, int]:
    """(the tensor this rank stores, the first global row of it): FSDP2 shards dim 0 in ``torch.chunk`` pieces."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return param.data, 0
    if any(not isinstance(p, Shard) or p.dim != 0 for p in param.placements) or len(param.placements) != 1:
        raise ValueError(f"unexpected placements {param.placements} for a sharded parameter")
    local = param.to_local()
    rows, world = param.shape[0], param.device_mesh.size()
    chunk = -(-rows // world)
    start = min(rows, param.device_mesh.get_local_rank() * chunk)
    if local.shape[0] != max(0, min(rows, start + chunk) - start):
        raise ValueError(f"shard of {local.shape[0]} rows does not match torch.chunk's {chunk} from row {start}")
    return local, start


def _fill_normal(local: torch.Tensor, start: int, shape, std: float, seed: int, tracker) -> None:
    rows = shape[0]
    stop = start + local.shape[0]
    for block in range(start // INIT_BLOCK_ROWS, -(-stop // INIT_BLOCK_ROWS)):
        first = block * INIT_BLOCK_ROWS
        count = min(INIT_BLOCK_ROWS, rows - first)
        generator = torch.Generator().manual_seed(seed + block)
        with tracker.on_host() if tracker is not None else contextlib.nullcontext():  # whatever the shard's device
            values = torch.empty((count, *shape[1:]), dtype=torch.float32, device="cpu")
            values.normal_(0.0, std, generator=generator)
        lo, hi = max(start, first), min(stop, first + count)
        local[lo - start : hi - start].copy_(values[lo - first : hi - first])


class SoftcappedHead(nn.Module):
    """``lm_head`` followed by the final logits' tanh softcap (Gemma 2: ``cap * tanh(logits / cap)``); its parameters
    are the head's, so the loss functions take it where they take ``lm_head``."""

    def __init__(self, lm_head: nn.Module, cap: float):
        super().__init__()
        self.lm_head = lm_head
        self.cap = cap

    def forward(self, hidden):
        return torch.tanh(self.lm_head(hidden) / self.cap) * self.cap


def plain_loss(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """Sum of token cross-entropies times ``scale``. hidden [b, s, h] -> logits [b, s, vocab] (full)."""
    logits = lm_head(hidden).float()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss * scale


class TrainingModel(nn.Module):
    """A causal LM whose forward returns ``loss_sum * scale`` for this rank's tokens.

    ``scale`` is chosen by the caller so that gradients summed (or averaged) over ranks equal those of the
    plain single-process mean loss; see ``trials.training.step``. ``loss_fn`` is swapped by loss tiling.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.loss_fn = plain_loss
        self.autocast_dtype: torch.dtype | None = None  # set by ``set_compute_dtype``
        self.logit_softcap = family_of(lm.config.model_type).final_softcap(lm.config)
        self.lora = FULL_TRAINING  # the LoRA adapters it trains (``trials.models.lora.apply_lora``); none: every weight

    @property
    def config(self):
        return self.lm.config

    @property
    def generation_config(self):
        """The causal LM's (what trainers built on ``transformers.Trainer``, TRL's, set the pad token in)."""
        return self.lm.generation_config

    def add_model_tags(self, tags) -> None:
        """The causal LM's hub tags (TRL's trainers add theirs)."""
        self.lm.add_model_tags(tags)

    @property
    def layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def forward(self, input_ids, position_ids, labels, scale: float = 1.0, documents=None):
        """``documents`` (``trials.kernels.documents.Documents``, global over the whole sequence): attention stays
        inside each; ``position_ids`` then restart at each document (``Documents.positions``)."""
        if self.autocast_dtype is None:
            return self._forward(input_ids, position_ids, labels, scale, documents)
        with torch.autocast(input_ids.device.type, dtype=self.autocast_dtype):
            return self._forward(input_ids, position_ids, labels, scale, documents)

    def _forward(self, input_ids, position_ids, labels, scale, documents=None):
        packed = {DOCUMENTS_KWARG: documents} if documents is not None else {}
        hidden = self.lm.model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False, **packed
        ).last_hidden_state
        head = self.lm.lm_head if self.logit_softcap is None else SoftcappedHead(self.lm.lm_head, self.logit_softcap)
        return self.loss_fn(hidden, head, labels, scale)


def default_compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPUs, fp32 on CPU (what CPU trials and the ``cpu`` hardware preset model)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def set_compute_dtype(model: TrainingModel, compute_dtype: torch.dtype) -> None:
    """Mixed precision, one scheme for every configuration: fp32 master weights, fp32 gradients, fp32 AdamW
    states; matmuls and activations in ``compute_dtype``.

    - FSDP-sharded model: ``trials.stack.fsdp.apply_fsdp(param_dtype=compute_dtype)`` already gives FSDP2's
      ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 shards, bf16 all-gathered
      parameters, fp32 reduce-scatter into fp32 sharded gradients. Nothing to add here.
    - Not sharded (one rank, or replicated): the fp32 model runs its forward (loss included) under
      ``torch.autocast(dtype=compute_dtype)`` (AMP). Parameters, gradients and optimizer states stay fp32;
      autocast casts each weight to bf16 when used (its cache keeps the casts until the forward ends).

    Call after ``trials.stack.apply``; fp32 turns autocast off.
    """

    low = compute_dtype is not None and compute_dtype != torch.float32
    model.autocast_dtype = compute_dtype if low and not is_sharded(model) else None


def lora_mismatch(model_config: dict, spec: LoraSpec) -> str | None:
    """Why ``spec``'s adapters cannot go on ``model_config``'s model (None: they can): a target or a trainable name
    that matches no module, an adapted module trained whole, a shared embedding. Checked on the model built on meta
    (no memory), so a command refuses bad names before it traces or launches anything."""
    if not spec.on:
        return None
    try:
        apply_lora(build_model(model_config, device="meta"), spec)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError is one
        message = str(exc).splitlines()[0]
        return message if message.startswith("lora:") else f"lora: {message}"
    return None
