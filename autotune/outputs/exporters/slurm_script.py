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

from autotune.core.sizes import format_duration
from autotune.core.trainers import AUTOTUNE
from autotune.outputs.exporters.base import Exporter, Rendered, comment_block
from trials.train import recorded_step_time_s
from trials.training.config_file import TrialConfig

CONFIG_ENV = "AUTOTUNE_CONFIG_JSON"  # the config, handed to every node's task through srun's environment
DEFAULT_STEPS = 10  # the script's steps when STEPS is not set
# #SBATCH --time: the steps at the config's recorded step time with this margin, plus the start-up (torchrun, the
# model built and its --init weights read shard by shard, the first step's warm-up)
TIME_MARGIN = 1.5
STARTUP_S = 1800.0


def time_limit(step_time_s: float, steps: int) -> str:
    """Slurm's ``--time`` (D-HH:MM:SS) for ``steps`` steps of ``step_time_s`` each, with the margin and start-up."""
    seconds = int(STARTUP_S + steps * TIME_MARGIN * step_time_s + 59) // 60 * 60
    days, rest = divmod(seconds, 86400)
    return f"{days}-{rest // 3600:02d}:{rest % 3600 // 60:02d}:00"


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
        step_time_s = recorded_step_time_s(config)
        if step_time_s:
            time_lines = [
                f"#SBATCH --time={time_limit(step_time_s, DEFAULT_STEPS)}",
                f"# --time: {DEFAULT_STEPS} steps (STEPS's default) at {format_duration(step_time_s)} a step (the config's "
                f"{'measured' if config.measured else 'predicted'} step time) x {TIME_MARGIN}, plus "
                f"{format_duration(STARTUP_S)} to start; for more steps give sbatch --time too (N steps take about "
                f"N x {format_duration(step_time_s)})",
            ]
        else:
            time_lines = ["# no --time: the config records no step time (autotune estimate --config FILE predicts one)"]
        node_command = (
            multi_node_command(
                '"$config"',
                config.gpus,
                '"$SLURM_NNODES"',
                '"$head_node:$port"',
                '"autotune-$SLURM_JOB_ID"',
                steps=f'"${{STEPS:-{DEFAULT_STEPS}}}"',
                python='"${PYTHON:-python}"',
            )
            + ' ${DATA:+--data "$DATA"} "$@"'
        )
        per_node = "\n".join(
            [
                # the CPU's share of each rank (the optimizer step on the host with optimizer offload; torchrun
                # would give each rank one thread), as trials measured it
                f'export OMP_NUM_THREADS="${{OMP_NUM_THREADS:-$(( ${{SLURM_CPUS_ON_NODE:-{config.gpus}}} / {config.gpus} '
                f'> 0 ? ${{SLURM_CPUS_ON_NODE:-{config.gpus}}} / {config.gpus} : 1 ))}}"',
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
                    *time_lines,
                    comment_block(notes),
                    "# usage: STEPS=N DATA=/shared/tokens.parquet sbatch [--time=D-HH:MM:SS] this-file [--init HF_FOLDER "
                    "--save CKPT --save-every N --resume ...]",
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
                    "# the node's CPUs to its one task (srun gives a task one CPU unless told)",
                    f'srun --nodes={config.nodes} --ntasks-per-node=1 --cpus-per-task="${{SLURM_CPUS_ON_NODE:-1}}" '
                    f"--kill-on-bad-exit=1 bash -c {shlex.quote(per_node)} "
                    'autotune-node "$@"',  # the script's arguments, as the node's $@
                ]
            )
        )

    def launch(self, path: str, config: TrialConfig) -> str:
        return f"sbatch {path}"  # the default steps, inside the script's --time
