"""The CUDA allocator settings every trial and training run uses, so that what the memory oracle counts is what
the process holds.

- ``expandable_segments:True`` (device): the caching allocator maps more memory into one segment instead of
  cutting new fixed-size segments, which keeps fragmentation small at long sequences; the hardware presets'
  ``allocator_fragmentation`` (5%) assumes it.
- ``pinned_max_round_threshold_mb:1`` (host): torch's caching host allocator (``ATen/core/CachingHostAllocator.h``,
  what ``pin_memory=True`` and a non-blocking copy to the host allocate from) rounds a block up to a power of two
  when it is at most the round threshold (default: unlimited, so a 5 GiB block takes 8 GiB), and files freed blocks
  in buckets by ``Log2_64_Ceil(size)``. With the threshold at 1 MiB a block above 1 MiB is exact: the host bytes it
  holds are its tensor's, which is what the oracle counts.
- ``pinned_max_cached_size_mb:1`` (host), only on a torch whose ``get_free_block`` hands out the last block of the
  request's bucket without comparing sizes (before 2.14: ``UNCHECKED_REUSE_BEFORE``). Rounded blocks are exactly
  their bucket's size, but an exact one is not: a request can get a smaller block of its bucket and the copy into
  it overruns the heap (pytorch#192722). With this limit a block above 1 MiB is never cached, so never handed to
  another request: it is page-locked when allocated and released when freed, and FSDP2's CPU offload pins and
  unpins every gradient shard every step (each rank's share of the fp32 parameters), a cost the trial
  measures. From 2.14 ``get_free_block`` scans the bucket for a block at least the request's size, so blocks are
  cached (torch's default): FSDP2's gradient shards are pinned in the first step and reused after it. They stay
  page-locked between steps, which moves no peak: the host peak is the optimizer step, where every gradient is
  live, and the gradients find their own blocks again each step (every shipped model at 1 to 64 ranks,
  ``tests/test_cuda_path.py``), so the cache holds no block beyond them.

What else pins through this allocator is FSDP2's offloaded parameter shards, once. Activation offload does not use
it: its host buffers are an arena of their own, allocated once (``trials.stack.offload.HostArena``). Blocks up to
1 MiB are rounded and cached, each bucket then holding one size.

A user's own value for a key wins over ours except for these keys, which the oracle's numbers rest on.

torch releases differ here, and this is the one place that handles it: torch 2.11's allocator config has no
``pinned_max_*`` keys (it refuses a config that names one: "Unrecognized key"; torch 2.13 has both), and the
cache limit is for releases before 2.14 only (``settings_for``). Each process asks its torch which of its release's
settings it knows (``supported_settings``) and passes on those only; without the pinned limits the host allocator
rounds a pinned block up to a power of two, so FSDP2's CPU-offloaded shards can hold up to twice the host bytes the
oracle counts on such a torch.

On the CPU path (no CUDA: tensors come from glibc's malloc) a trial's process is told to keep the memory it frees,
as CUDA's caching allocator does: ``glibc.malloc.mmap_max=0`` (no block gets its own mapping, which glibc gives
every block above its mmap threshold, at most 32 MiB, and unmaps on free) and a trim threshold no step reaches
(the heap's free top is not given back to the OS). Otherwise each step of a long sequence maps its large
activations afresh and page-faults every byte of them in, inside the kernels that first write them:
a cost a GPU step does not have, that the time model does not price and that a
calibration at 2,048 tokens (under the threshold) never sees. These are glibc tunables, read when a process starts:
a child's environment carries them.
"""

from __future__ import annotations

import functools
import os

SETTINGS = {"expandable_segments": "True", "pinned_max_round_threshold_mb": "1"}
UNCHECKED_REUSE_SETTINGS = {"pinned_max_cached_size_mb": "1"}  # where a cached block can be smaller than its request
UNCHECKED_REUSE_BEFORE = (2, 14)  # the first release whose get_free_block compares sizes (2.14.0's header)
ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # the current name first, then the older alias
HOST_MALLOC_TUNABLES = {"glibc.malloc.mmap_max": "0", "glibc.malloc.trim_threshold": str(1 << 46)}  # CPU path


def _merged(existing: str | None, ours: dict, item_sep: str, pair_sep: str) -> str:
    """``existing`` (``key<pair_sep>value<item_sep>...``) with ``ours`` put in: ours replace the same keys, the
    others are kept in their order, ours come last."""
    pairs = [item.split(pair_sep, 1) for item in (existing or "").split(item_sep) if pair_sep in item]
    kept = [(key.strip(), value.strip()) for key, value in pairs if key.strip() not in ours]
    return item_sep.join(f"{key}{pair_sep}{value}" for key, value in kept + list(ours.items()))


def settings_for(release: tuple[int, ...]) -> dict:
    """The settings for a torch release ``(major, minor, ...)``: ``SETTINGS``, and before ``UNCHECKED_REUSE_BEFORE``
    the limit that keeps its host allocator from handing a request a smaller cached block."""
    return {**SETTINGS, **UNCHECKED_REUSE_SETTINGS} if tuple(release[:2]) < UNCHECKED_REUSE_BEFORE else dict(SETTINGS)


def torch_release(version: str) -> tuple[int, ...]:
    """A torch version's release numbers: "2.15.0+cu132" -> (2, 15, 0)."""
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


@functools.cache
def supported_settings() -> dict:
    """``settings_for`` this process's torch, less the keys it does not know (each is set once to find out: the
    value is ours either way)."""
    import torch

    wanted = settings_for(torch_release(torch.__version__))
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        return wanted
    known = {}
    for key, value in wanted.items():
        try:
            setter(f"{key}:{value}")
        except (ValueError, RuntimeError) as error:  # ValueError in torch 2.11
            if "Unrecognized key" not in str(error):
                raise
            continue
        known[key] = value
    return known


def merged_settings(existing: str | None) -> str:
    """``existing`` ``PYTORCH_ALLOC_CONF`` (``key:value,...``) with ``supported_settings`` put in."""
    return _merged(existing, supported_settings(), ",", ":")


def merged_tunables(existing: str | None) -> str:
    """``existing`` ``GLIBC_TUNABLES`` (``name=value:...``) with ``HOST_MALLOC_TUNABLES`` put in."""
    return _merged(existing, HOST_MALLOC_TUNABLES, ":", "=")


def trial_environment(environ: dict, cpu: bool = False) -> dict:
    """A child process's environment with the settings in ``PYTORCH_ALLOC_CONF`` (read before CUDA starts), and
    with ``cpu`` (a trial on the CPU path) glibc told to keep freed memory (``HOST_MALLOC_TUNABLES``)."""
    existing = next((environ[name] for name in ENV_NAMES if environ.get(name)), None)
    env = {k: v for k, v in environ.items() if k not in ENV_NAMES}
    env[ENV_NAMES[0]] = merged_settings(existing)
    if cpu:
        env["GLIBC_TUNABLES"] = merged_tunables(environ.get("GLIBC_TUNABLES"))
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
