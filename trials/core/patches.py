"""Every patch of torch and DeepSpeed internals the trials need, as context managers that restore what they
change.

torch offers no public hook for these events, and the CPU memory tracker (``trials.core.memory``) and the memory
oracle need them; DeepSpeed offers no switch to skip a set-up step whose result no trial uses. Each manager
wraps one attribute, calls ``callback`` at the event (if it has one), and puts the original back on exit
(nesting is fine: an inner manager wraps the outer one's wrapper and restores it).

    storage_resized(callback)          callback(storage) after ``UntypedStorage.resize_`` (FSDP2 frees and
                                       re-allocates unsharded parameters this way, invisibly to dispatch)
    fsdp_shard_made(callback)          callback(fsdp_param, tensor) before FSDP2 wraps a new local shard
                                       (a sharded parameter, or a sharded gradient after its reduce-scatter)
    fsdp_all_gather_buffers(callback)  callback(fsdp_param) after FSDP2 allocates a parameter's all-gather
                                       output buffers (first all-gather only; later ones resize them)
    deepspeed_shm_comm_op_skipped()    DeepSpeed's comm backend starts without its shared-memory comm op
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable

import torch


@contextlib.contextmanager
def _wrapped(owner, name: str, make: Callable):
    original = getattr(owner, name)
    setattr(owner, name, make(original))
    try:
        yield
    finally:
        setattr(owner, name, original)


def storage_resized(callback: Callable):
    def make(original):
        def resize_(storage, size):
            result = original(storage, size)
            callback(storage)
            return result

        return resize_

    return _wrapped(torch.UntypedStorage, "resize_", make)


def _fsdp_param_class():
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return FSDPParam


def fsdp_shard_made(callback: Callable):
    def make(original):
        def to_sharded_dtensor(self, tensor):
            callback(self, tensor)
            return original(self, tensor)

        return to_sharded_dtensor

    return _wrapped(_fsdp_param_class(), "to_sharded_dtensor", make)


def fsdp_all_gather_buffers(callback: Callable):
    def make(original):
        def init_all_gather_outputs(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            callback(self)
            return result

        return init_all_gather_outputs

    return _wrapped(_fsdp_param_class(), "init_all_gather_outputs", make)


def deepspeed_shm_comm_op_skipped():
    """``deepspeed.comm``'s torch backend without its shared-memory comm op.

    On a CPU accelerator, ``TorchBackend.__init__`` (``deepspeed.comm.init_distributed``) JIT-builds the op with
    g++ and ninja (a minute on a small machine, in the middle of a trial; again whenever the build in
    ``$TORCH_EXTENSIONS_DIR`` is stale, e.g. after another virtual environment built it there) and prints
    ``DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully`` to stdout. Only
    ``inference_all_reduce`` uses the op, and no trial calls it: every collective a trial runs is the process
    group's, with or without it. On CUDA, DeepSpeed has no such op: nothing changes there."""
    # by name: ``deepspeed.comm``'s attribute ``torch`` is torch itself, not its module ``deepspeed.comm.torch``
    backend_module = importlib.import_module("deepspeed.comm.torch")
    return _wrapped(backend_module, "build_shm_op", lambda original: lambda: None)
