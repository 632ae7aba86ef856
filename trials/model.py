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

    @property
    def config(self):
        return self.lm.config

    @property
    def layers(self) -> nn.ModuleList:
        return self.lm.model.layers

    def forward(self, input_ids, position_ids, labels, scale: float = 1.0):
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).last_hidden_state
        return self.loss_fn(hidden, self.lm.lm_head, labels, scale)
