"""The training workload autotune measures and users train with: the model, the technique stack, the step.

A library without the tuner (it never imports ``autotune``). Its rooms, lowest first; each imports only the rooms
below it (import-linter's contracts in pyproject.toml):

    trials.core       errors, process groups, the device-memory tracker, allocator settings, patches of torch
    trials.kernels    the attention kernels: their declarations and the attention op that calls them
    trials.models     model families, model configs and presets, the training model, mixture-of-experts layers
    trials.stack      the knobs and their rules, one module per technique, ``trials.stack.apply`` (the recipe)
    trials.training   the training step, the sequence split, the config file, the trainer's checkpoints
    trials.trial      one measured trial: the runner, its spec, segment peaks, layer clocks, the memory timeline
    trials.hf         the stack as a plugin for Hugging Face models (public face)
    trials.train      the trainer: ``python -m trials.train``, what ``autotune run`` and the exported scripts start

The flat paths of earlier releases (``trials.model``, ``trials.step``, ``trials.config_file``, ...) still import:
each is an alias of its module in a room, declared once in ``MOVED`` below, so library loops and exported scripts
written against them keep running.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

MOVED = {
    "trials.allocator": "trials.core.allocator",
    "trials.dist": "trials.core.dist",
    "trials.errors": "trials.core.errors",
    "trials.memory": "trials.core.memory",
    "trials.patches": "trials.core.patches",
    "trials.attention": "trials.kernels.attention",
    "trials.families": "trials.models.families",
    "trials.model_config": "trials.models.config",
    "trials.model": "trials.models.model",
    "trials.moe": "trials.models.moe",
    "trials.knobs": "trials.stack.knobs",
    "trials.techniques": "trials.stack.techniques",
    "trials.rules": "trials.stack.rules",
    "trials.fsdp": "trials.stack.fsdp",
    "trials.ulysses": "trials.stack.ulysses",
    "trials.upipe": "trials.stack.upipe",
    "trials.checkpointing": "trials.stack.checkpointing",
    "trials.offload": "trials.stack.offload",
    "trials.tiling": "trials.stack.tiling",
    "trials.step": "trials.training.step",
    "trials.data": "trials.training.data",
    "trials.checkpoint": "trials.training.checkpoint",
    "trials.config_file": "trials.training.config_file",
    "trials.runner": "trials.trial.runner",
    "trials.spec": "trials.trial.spec",
    "trials.segments": "trials.trial.segments",
    "trials.layer_clock": "trials.trial.layer_clock",
    "trials.memory_timeline": "trials.trial.memory_timeline",
}
"""Old flat path -> its module now. ``trials.kernels`` and ``trials.stack`` are rooms themselves: their old
contents are ``trials.kernels.registry`` and ``trials.stack.apply``."""


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports an old flat path as the very module it moved to (one module object under both names)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module):
        """The module ran when it was imported under its own name."""


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.insert(0, _MovedModules())  # before the path finders: an old path is always the alias
