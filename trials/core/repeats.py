"""Loops of identical iterations (sequence tiles), which a watcher may account for without running them all.

A tiled op runs the same ops on equal-shaped tiles: at millions of tokens the tiled loss runs hundreds of tiles,
the tiled MLP and RMSNorm tens per layer, and attention over packed documents one kernel call per document
(``trials.kernels.attention``: 80 per layer for 64K-token documents in a 5M sequence). On real tensors every tile
must run. Under fake tensors (the memory oracle) a tile computes nothing, yet each one costs the oracle ~100
dispatches through its modes, and tiles are most of a long trace's time. ``for_each_tile`` is the loop: it runs
every iteration unless a ``LoopWatcher`` is active; then it runs iterations 0 and 1 and asks the watcher whether
they did exactly the same thing to the same state (``observe``); where iteration 0 differs (it allocated what
later ones reuse) it runs iteration 2 and compares 1 and 2. Once two are the same, the watcher accounts for the
identical iterations after them (``repeat``) instead of running them. Any shorter tile after the full ones always
runs, and so does the last full one of a loop that keeps every result (its peak stands on all of them).

Two kinds of loop: a tile whose result lives only until the next tile's does (the loss, RMSNorm, the MLP's
backward: the state repeats), and a tile whose result is kept to the end (``keep_all``: the MLP forward's
output tiles, concatenated after the loop: the state grows by one result per tile). For the second the watcher
hands back a stand-in for each result not computed: a tensor of the same shape, stride and dtype.

A third kind: iterations that each leave the state as they found it (what one makes, it frees; its result
unused) and that differ from one another only in a size, so that all iterations of one size run the same ops on
the same shapes: attention over packed documents of lengths in any order, one call per document. ``for_each_kind``
is that loop; it names each iteration's kind (the size and everything else its ops depend on). A watcher may
account for an iteration of a kind it has seen run, once it knows the iteration could not change anything it
reports: its peak stands at or below the peaks already reached.

The watcher decides what "exactly the same" means; the memory oracle's (``autotune.oracle.repeats``) compares
the live bytes before and after, the peak above them, the storages alive, and every count the time model takes,
so that the step's peak and counts equal those of the full loop, byte for byte and count for count.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable

import torch

_WATCHERS: list[LoopWatcher] = []

# iterations run at most before the watcher may stand in: 0 (may allocate what later ones reuse), 1 and 2
_SEEN = 3


class LoopWatcher:
    """What stands in for iterations of a ``for_each_tile`` loop that are not run. Implement both methods.

    ``observe(run, kept)`` calls ``run()`` (one iteration; it returns the iteration's result) and returns a
    signature of what it did, equal for two iterations only when running one more would change everything the
    watcher reports (memory, counts) exactly as the second did; or None when the iteration cannot stand for
    others. ``kept``: the loop keeps every result (the state may grow by the result's storage, nothing else);
    otherwise the state must come back to where it was (the previous result released as this one is made).
    ``repeat(signature, times, like)`` accounts for ``times`` more iterations like the one that gave
    ``signature``; with ``like`` (a result of a kept loop) it returns ``times`` stand-ins for their results, or
    None when it cannot stand in for them (the loop then runs them)."""

    def observe(self, run: Callable[[], object], kept: bool) -> Hashable | None:
        raise NotImplementedError

    def repeat(self, signature: Hashable, times: int, like=None) -> list | None:
        raise NotImplementedError

    def run_kind(self, run: Callable[[], object], kind: Hashable, kept: bool = False):
        """One iteration of a ``for_each_kind`` loop: ``run()``'s result, or an accounting for it where an iteration
        of ``kind`` ran before and this one could not change what the watcher reports (``kept``: the loop keeps
        each result; a stand-in of the same shapes is returned for it). Runs it unless overridden."""
        return run()


@contextlib.contextmanager
def watching(watcher: LoopWatcher):
    """``for_each_tile`` loops inside the block may be shortened by ``watcher``."""
    _WATCHERS.append(watcher)
    try:
        yield watcher
    finally:
        _WATCHERS.remove(watcher)


def for_each_tile(count: int, body: Callable[[int], object], uniform: int, keep_all: bool = False):
    """``body(i)`` for i in range(count); iterations ``0 .. uniform - 1`` run the same ops on the same shapes (the
    full tiles; a shorter last tile comes after them). Without a watcher every iteration runs.

    ``keep_all``: returns every result, in order. Otherwise what ``body`` returns stays alive until the next
    iteration has returned its own, as a ``for`` loop's variable does (a tile's output held while the next is
    computed is part of the peak), and the last one is returned for the caller to hold as long as the loop's
    variable would have lived."""
    watcher = _WATCHERS[-1] if _WATCHERS else None
    # the last iteration the watcher may stand for: the last full tile, except in a loop keeping every result
    end = uniform - 1 if keep_all else uniform
    results = [None]  # keep_all: every result; else the loop variable, released as the next result exists

    def run(index: int):
        result = body(index)
        if keep_all:
            results.append(result)
        else:
            results[0] = result
        return result

    if keep_all:
        results.clear()
    if watcher is None or end < 3:  # nothing to stand for after iterations 0 and 1
        for index in range(count):
            run(index)
        return results if keep_all else results.pop()
    signature = watcher.observe(lambda: run(0), keep_all)
    ran, same = 1, False
    while ran < _SEEN and not same:
        previous, signature = signature, watcher.observe(lambda index=ran: run(index), keep_all)
        ran += 1
        same = signature is not None and signature == previous
    if same and end > ran:
        stand_ins = watcher.repeat(signature, end - ran, results[-1] if keep_all else None)
        if not keep_all or stand_ins is not None:
            results.extend(stand_ins or [])
            ran = end
    for index in range(ran, count):
        run(index)
    return results if keep_all else results.pop()


def for_each_kind(count: int, body: Callable[[int], object], kind: Callable[[int], Hashable], keep_all: bool = False):
    """``body(i)`` for i in range(count), each iteration leaving the state as it found it (its result unused; with
    ``keep_all``, the state grown by its result alone, and every result returned in order), and ``kind(i)`` naming
    everything its ops depend on: two iterations of one kind run the same ops on the same shapes. Without a watcher
    every iteration runs; a watcher may account for an iteration of a kind it has seen (``LoopWatcher.run_kind``)."""
    watcher = _WATCHERS[-1] if _WATCHERS else None
    results = []
    for index in range(count):
        if watcher is None:
            result = body(index)
        else:
            result = watcher.run_kind(lambda index=index: body(index), kind(index), keep_all)
        if keep_all:
            results.append(result)
        del result
    return results if keep_all else None


def kind_of(loop: str, *parts) -> tuple:
    """What a loop body's ops depend on besides its own size, for ``for_each_kind``: the loop's name (which body it
    is: kinds of different loops never meet), each tensor it reads by its shape, stride, dtype, device and whether
    it requires grad, every other argument as it is, and the grad mode and autocast state the loop runs in."""
    devices = {part.device.type for part in parts if isinstance(part, torch.Tensor)}
    return (
        loop,
        torch.is_grad_enabled(),
        tuple(torch.is_autocast_enabled(device) for device in sorted(devices)),
        *(
            (tuple(part.shape), part.stride(), part.dtype, part.device, part.requires_grad)
            if isinstance(part, torch.Tensor)
            else part
            for part in parts
        ),
    )
