"""Exports of a search's front into the formats trainers read (``autotune export``).

One narrow base (``base.Exporter``, its contract in that module's docstring), one module per format, and a
factory (``make_exporter``). Each format declares once which knobs its trainer can express and how
(``Exporter.expresses``); which front config it can export, what a partial export says and the re-estimate of
what the trainer runs derive from that declaration (``selection``).

    autotune     ``autotune_config``   the config file itself (autotune/config-v1)
    torchrun     ``torchrun_script``   a shell script training with autotune's own runner
    deepspeed    ``deepspeed_config``  a DeepSpeed JSON and the ALST Python it cannot carry
    arctic       ``arctic_recipe``     an ArcticTraining recipe
    accelerate   ``accelerate_config`` an Accelerate config and the training script it launches, every knob
                                       through the plugin ``trials.hf`` (and the autotune config beside them)
    accelerate-deepspeed  ``accelerate_deepspeed``  an Accelerate config backed by DeepSpeed, its DeepSpeed JSON
                                       and a Trainer snippet
    slurm        ``slurm_script``      an sbatch script: srun + torchrun's c10d rendezvous on the config's nodes
"""

from __future__ import annotations

from autotune.core.errors import UserError
from autotune.outputs.exporters.accelerate_config import AccelerateConfigExporter
from autotune.outputs.exporters.accelerate_deepspeed import AccelerateDeepSpeedExporter
from autotune.outputs.exporters.arctic_recipe import ArcticRecipeExporter
from autotune.outputs.exporters.autotune_config import AutotuneConfigExporter
from autotune.outputs.exporters.base import Exporter
from autotune.outputs.exporters.deepspeed_config import DeepSpeedConfigExporter
from autotune.outputs.exporters.front import FRONT_SCHEMA, entry_config, load_front
from autotune.outputs.exporters.selection import Export, NotExpressible, export
from autotune.outputs.exporters.slurm_script import SlurmScriptExporter
from autotune.outputs.exporters.torchrun_script import TorchrunScriptExporter, torchrun_command, trainer_launcher

__all__ = [
    "EXPORTERS",
    "Export",
    "Exporter",
    "FORMATS",
    "FRONT_SCHEMA",
    "NotExpressible",
    "entry_config",
    "export",
    "load_front",
    "make_exporter",
    "torchrun_command",
    "trainer_launcher",
]

EXPORTERS: dict[str, type[Exporter]] = {
    cls.name: cls
    for cls in (
        AutotuneConfigExporter,
        DeepSpeedConfigExporter,
        ArcticRecipeExporter,
        AccelerateConfigExporter,
        AccelerateDeepSpeedExporter,
        TorchrunScriptExporter,
        SlurmScriptExporter,
    )
}
FORMATS = tuple(EXPORTERS)


def make_exporter(name: str) -> Exporter:
    if name not in EXPORTERS:
        raise UserError(f"--format {name!r} must be one of {', '.join(FORMATS)}")
    return EXPORTERS[name]()
