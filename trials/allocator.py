"""The CUDA allocator settings every trial and training run uses, so that what the memory oracle counts is what
the process holds.

- ``expandable_segments:True`` (device): the caching allocator maps more memory into one segment instead of
  cutting new fixed-size segments, which keeps fragmentation small at long sequences; the hardware presets'
  ``allocator_fragmentation`` (5%) assumes it.
- ``pinned_max_round_threshold_mb:1`` (host): torch's pinned host allocator rounds each block up to a power of
  two below this threshold, and the default threshold is unlimited (``ATen/core/CachingHostAllocator.h``): a
  5 GiB offloaded layer input would take an 8 GiB pinned block, 32 layers 256 GiB instead of 160. Above 1 MiB
  blocks are exact, so the oracle's host bytes (the tensors' own sizes) are what the node pins. This one setting
  covers every pinned allocation in the process: activation offload's buffers and FSDP2's offloaded shards and
  gradients alike, which a private pinned pool for activation offload alone would not. The caching host
  allocator keeps freed blocks and hands them back for the next step's tensors of the same size, so after the
  warm-up step no new ``cudaHostAlloc`` happens.

A user's own value for a key wins over ours except for these two keys, which the oracle's numbers rest on.
"""

from __future__ import annotations

import os

SETTINGS = {"expandable_segments": "True", "pinned_max_round_threshold_mb": "1"}
ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the current name first, then the older alias


def merged_settings(existing: str | None) -> str:
    """``existing`` (``key:value,...``) with ``SETTINGS`` put in (ours replace the same keys)."""
    pairs = [item.split(":", 1) for item in (existing or "").split(",") if ":" in item]
    kept = [(key.strip(), value.strip()) for key, value in pairs if key.strip() not in SETTINGS]
    return ",".join(f"{key}:{value}" for key, value in kept + list(SETTINGS.items()))


def trial_environment(environ: dict) -> dict:
    """A child process's environment with the settings in ``PYTORCH_ALLOC_CONF`` (read before CUDA starts)."""
    existing = next((environ[name] for name in ENV_NAMES if environ.get(name)), None)
    env = {k: v for k, v in environ.items() if k not in ENV_NAMES}
    env[ENV_NAMES[0]] = merged_settings(existing)
    return env


def configure() -> str:
    """Apply the settings in this process (before its first CUDA allocation); returns the settings string."""
    import torch

    settings = merged_settings(next((os.environ[n] for n in ENV_NAMES if os.environ.get(n)), None))
    os.environ[ENV_NAMES[0]] = settings
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:  # torch >= 2.9: takes effect now, whatever read the environment at import
        setter(settings)
    return settings
