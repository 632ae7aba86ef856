"""Counting a real training step in this process (world 1 or a fake process group): the CPU path of
``StepCounter``, for tests and benches that check counts against analytic formulas."""

from __future__ import annotations

import torch

from autotune.timing.counting import StepCounter
from autotune.timing.counts import StepCounts
from trials.core.dist import Mesh
from trials.core.memory import DeviceMemoryTracker
from trials.models.model import build_model
from trials.stack import apply
from trials.stack.techniques import Techniques
from trials.training.data import mesh_batch, synthetic_sample
from trials.training.step import train_step


def count_real_step(
    model_config: dict, techniques, seq_len: int, mesh=None, steps: int = 1, seed: int = 0
) -> StepCounts:
    """Build the trial's model, apply the stack and count ``steps`` training steps (after one uncounted
    warm-up step, as the trial runner does) with real tensors in this process. ``mesh``: a ``trials.core.dist.Mesh``
    (default: one rank)."""

    if not isinstance(techniques, Techniques):
        techniques = Techniques.from_dict(dict(techniques))
    mesh = mesh or Mesh.single()
    tracker = DeviceMemoryTracker(None)
    with tracker:
        model = build_model(model_config, seed=seed, device=mesh.device)
        apply(model, techniques, mesh)
        tracker.retag(model.parameters(), "params")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
        tokens = synthetic_sample(mesh.dp_rank, seq_len, model.config.vocab_size, seed)
        batch = mesh_batch(tokens, mesh)
        train_step(model, optimizer, batch, mesh, tracker)  # warm-up: optimizer states appear here
        counter = StepCounter(tracker, seq_len=seq_len, world_size=mesh.world_size)
        with counter:
            for _ in range(steps):
                train_step(model, optimizer, batch, mesh, tracker)
    counts = counter.counts
    counts.seq_len = seq_len
    return counts.scaled(steps) if steps > 1 else counts
