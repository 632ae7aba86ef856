"""``--format slurm``: an sbatch script that trains the exported config on its nodes with autotune's own runner.

``srun`` starts one task per node; each writes the inline config to its node's temporary folder (no shared
filesystem needed) and starts ``torchrun --nnodes N --nproc-per-node G`` joining a c10d rendezvous on the
allocation's first node (``--rdzv-endpoint FIRST_NODE:PORT --rdzv-id $SLURM_JOB_ID``), which runs
``python -m trials.train`` on every GPU. It expresses every knob, like ``--format torchrun``; the config's
``nodes`` x ``gpus`` are the allocation (``#SBATCH --nodes``, ``--gpus-per-node``). The script's arguments
(``sbatch train.sbatch --init ... --save ...``) go to the trainer on every node."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from autotune.core.trainers import AUTOTUNE
from autotune.outputs.exporters.base import Exporter, Rendered, comment_block
from trials.training.config_file import TrialConfig

CONFIG_ENV = "AUTOTUNE_CONFIG_JSON"  # the config, handed to every node's task through srun's environment


def multi_node_command(
    config_path: str,
    gpus: int,
    nodes: str,
    endpoint: str,
    rdzv_id: str,
    steps: str = "${STEPS:-10}",
    python: str = "python",
) -> str:
    """``torchrun`` on one node of a multi-node job: the c10d rendezvous at ``endpoint`` under ``rdzv_id``."""
    return (
        f"{python} -m torch.distributed.run --nnodes={nodes} --nproc-per-node={gpus} --rdzv-backend=c10d "
        f"--rdzv-endpoint={endpoint} --rdzv-id={rdzv_id} -m trials.train --config {config_path} --steps {steps}"
    )


class SlurmScriptExporter(Exporter):
    name = "slurm"
    default_file = "train.sbatch"
    trainer = AUTOTUNE

    def render(self, config: TrialConfig, notes: list[str], path: str) -> Rendered:
        gpu_line = [] if config.hardware == "cpu" else [f"#SBATCH --gpus-per-node={config.gpus}"]
        node_command = (
            multi_node_command(
                '"$config"',
                config.gpus,
                '"$SLURM_NNODES"',
                '"$head_node:$port"',
                '"autotune-$SLURM_JOB_ID"',
                steps='"${STEPS:-10}"',
                python='"${PYTHON:-python}"',
            )
            + ' ${DATA:+--data "$DATA"} "$@"'
        )
        per_node = "\n".join(
            [
                'config="${TMPDIR:-/tmp}/autotune-config-$SLURM_JOB_ID.json"',
                f'printf "%s\\n" "${CONFIG_ENV}" > "$config"',
                f"exec {node_command}",
            ]
        )
        return Rendered(
            "\n".join(
                [
                    "#!/usr/bin/env bash",
                    f"#SBATCH --job-name=autotune-{Path(config.model).stem}",
                    f"#SBATCH --nodes={config.nodes}",
                    "#SBATCH --ntasks-per-node=1",
                    *gpu_line,
                    "#SBATCH --exclusive",
                    comment_block(notes),
                    "# usage: STEPS=100 DATA=/shared/tokens.parquet sbatch this-file [--init HF_FOLDER --save CKPT "
                    "--save-every N --resume ...]",
                    "#   (every option of `python -m trials.train --help` passes through: docs/training.md; its paths must",
                    "#   be on a filesystem every node shares)",
                    "#   (PYTHON: the interpreter with autotune installed on every node, default python; RDZV_PORT: a free",
                    "#   port on the first node, default 29500; DATA must be a path every node can read)",
                    "set -euo pipefail",
                    f"export {CONFIG_ENV}=$(cat <<'JSON'",
                    json.dumps(config.to_dict(), indent=2),
                    "JSON",
                    ")",
                    "# the first host without a pipe into head: under pipefail, scontrol killed by SIGPIPE once head has its",
                    "# line would fail the job",
                    'nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
                    "head_node=${nodes%%$'\\n'*}",
                    "port=${RDZV_PORT:-29500}",
                    "export head_node port",
                    "# one task per node: write the config there, then one torchrun agent joining the rendezvous",
                    f"srun --nodes={config.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c {shlex.quote(per_node)} "
                    'autotune-node "$@"',  # the script's arguments, as the node's $@
                ]
            )
        )

    def launch(self, path: str, config: TrialConfig) -> str:
        return f"STEPS=100 sbatch {path}"
