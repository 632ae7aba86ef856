"""Build a Hugging Face causal LM from a preset config with seeded random weights (no downloads).

``TrainingModel`` wraps it so one ``forward`` returns the (scaled) loss: FSDP's root hooks then cover the
embedding, final norm and lm_head, and the loss can be tiled without materialising [seq, vocab] logits.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from trials import attention

_CONFIG_ONLY_KEYS = ("_name",)


def hf_config(model_config: dict):
    from transformers import AutoConfig

    values = {k: v for k, v in model_config.items() if k not in _CONFIG_ONLY_KEYS and k != "model_type"}
    values.pop("architectures", None)
    config = AutoConfig.for_model(model_config["model_type"], **values)
    config.use_cache = False
    config._attn_implementation = attention.ATTN_IMPLEMENTATION
    return config


def build_model(model_config: dict, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> "TrainingModel":
    """Random-weight model, identical on every rank for the same seed."""
    from transformers import AutoModelForCausalLM

    attention.register()
    config = hf_config(model_config)
    torch.manual_seed(seed)
    with torch.device(device):
        lm = AutoModelForCausalLM.from_config(config, attn_implementation=attention.ATTN_IMPLEMENTATION,
                                              dtype=dtype)
    return TrainingModel(lm)


def plain_loss(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor, scale: float) -> torch.Tensor:
    """Sum of token cross-entropies times ``scale``. hidden [b, s, h] -> logits [b, s, vocab] (full)."""
    logits = lm_head(hidden).float()
    loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    return loss * scale


class TrainingModel(nn.Module):
    """A causal LM whose forward returns ``loss_sum * scale`` for this rank's tokens.

    ``scale`` is chosen by the caller so that gradients summed (or averaged) over ranks equal those of the
    plain single-process mean loss; see ``trials.step``. ``loss_fn`` is swapped by loss tiling.
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        self.loss_fn = plain_loss
        self.autocast_dtype: torch.dtype | None = None  # set by ``set_compute_dtype``

    @property
    def config(self):
        return self.lm.config

    @property
    def layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def forward(self, input_ids, position_ids, labels, scale: float = 1.0):
        if self.autocast_dtype is None:
            return self._forward(input_ids, position_ids, labels, scale)
        with torch.autocast(input_ids.device.type, dtype=self.autocast_dtype):
            return self._forward(input_ids, position_ids, labels, scale)

    def _forward(self, input_ids, position_ids, labels, scale):
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.loss_fn(hidden, self.lm.lm_head, labels, scale)


def default_compute_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on GPUs, fp32 on CPU (what CPU trials and the ``cpu`` hardware preset model)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def set_compute_dtype(model: "TrainingModel", compute_dtype: torch.dtype) -> None:
    """Mixed precision, one scheme for every configuration: fp32 master weights, fp32 gradients, fp32 AdamW
    states; matmuls and activations in ``compute_dtype``.

    - FSDP-sharded model: ``trials.fsdp.apply_fsdp(param_dtype=compute_dtype)`` already gives FSDP2's
      ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``: fp32 shards, bf16 all-gathered
      parameters, fp32 reduce-scatter into fp32 sharded gradients. Nothing to add here.
    - Not sharded (one rank, or replicated): the fp32 model runs its forward (loss included) under
      ``torch.autocast(dtype=compute_dtype)`` (AMP). Parameters, gradients and optimizer states stay fp32;
      autocast casts each weight to bf16 when used (its cache keeps the casts until the forward ends).

    Call after ``trials.stack.apply``; fp32 turns autocast off.
    """
    from trials.fsdp import is_sharded

    low = compute_dtype is not None and compute_dtype != torch.float32
    model.autocast_dtype = compute_dtype if low and not is_sharded(model) else None
