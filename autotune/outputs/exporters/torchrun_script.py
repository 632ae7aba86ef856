"""``--format torchrun``: a shell script with the config inline and the command that trains with autotune's own
runner (``python -m trials.train`` under torchrun). It expresses every knob, like ``--format autotune``; the
script's arguments go to the trainer (``--init``, ``--save``, ``--resume``, ...)."""

from __future__ import annotations

import json

from autotune.core.trainers import AUTOTUNE
from autotune.outputs.exporters.base import Exporter, Rendered, comment_block
from autotune.outputs.exporters.slurm_script import multi_node_command
from trials.training.config_file import TrialConfig


def trainer_launcher(gpus: int) -> str:
    """The command that starts ``trials.train`` on ``gpus`` ranks of this node, before its options."""
    if gpus == 1:
        return "python -m trials.train"
    return f"torchrun --standalone --nproc-per-node={gpus} -m trials.train"


def torchrun_command(config_path: str, gpus: int, steps: str = "${STEPS:-10}") -> str:
    return f"{trainer_launcher(gpus)} --config {config_path} --steps {steps}"


class TorchrunScriptExporter(Exporter):
    name = "torchrun"
    default_file = "train.sh"
    trainer = AUTOTUNE

    def render(self, config: TrialConfig, notes: list[str], path: str) -> Rendered:
        command = torchrun_command('"$config"', config.gpus)
        usage = (
            "# usage: STEPS=100 DATA=tokens.parquet bash this-file [--init HF_FOLDER --save CKPT --save-every N "
            "--resume ...]\n#   (every option of `python -m trials.train --help` passes through; docs/training.md)"
        )
        if config.nodes > 1:  # the same script on every node, all joining one c10d rendezvous
            command = multi_node_command(
                '"$config"',
                config.gpus,
                str(config.nodes),
                '"${RDZV_ENDPOINT:?set RDZV_ENDPOINT=HOST:PORT, the same on every node}"',
                '"${RDZV_ID:-autotune}"',
            )
            usage = (
                f"# usage, on each of the {config.nodes} nodes: RDZV_ENDPOINT=first-node:29500 STEPS=100 "
                f"DATA=tokens.parquet bash this-file [trials.train options: --init HF_FOLDER --save CKPT ...]"
            )
        return Rendered(
            "\n".join(
                [
                    "#!/usr/bin/env bash",
                    comment_block(notes),
                    usage,
                    "set -euo pipefail",
                    'config="${CONFIG:-autotune-config.json}"',
                    "cat > \"$config\" <<'JSON'",
                    json.dumps(config.to_dict(), indent=2),
                    "JSON",
                    command + ' ${DATA:+--data "$DATA"} "$@"',
                ]
            )
        )

    def launch(self, path: str, config: TrialConfig) -> str:
        return f"STEPS=100 bash {path}"
