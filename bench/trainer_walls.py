"""Every search ends in a config the user's trainer runs: for each ``--trainer``, a plan search for Llama-3-8B at
1M tokens on 8x H100 (the installed ``autotune``, as a user runs it), ``autotune export --format <that trainer>``
without ``--allow-partial``, and the front's longest point against ``autotune estimate --max-seq`` of the most
memory-frugal config that trainer runs (``SearchSpace.frugal``): the trainer's wall on this node.

    .venv/bin/python bench/trainer_walls.py                 # every trainer, 20 trials each
    .venv/bin/python bench/trainer_walls.py --trainer arctic --trials 30

Goals, checked and printed: each front's longest point is >= 97% of its trainer's frugal wall, and every search
and export exits 0 -- or, for a trainer whose wall is below the target, the search exits 1 saying so and the export
exits 2 (no front config reaches the target). The ratios are the last lines.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from autotune.core.trainers import TRAINERS  # noqa: E402
from autotune.search.space import load_space  # noqa: E402
from trials.models.config import load_model_config  # noqa: E402
from trials.stack.techniques import Techniques  # noqa: E402

MODEL, TARGET, TARGET_TOKENS, GPUS = "llama3-8b", "1M", 1024**2, 8
GOAL_FRACTION = 0.97


def _run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True)


def _frugal_config(trainer: str, path: Path) -> dict:
    model_config = load_model_config(MODEL)
    space = load_space(None, model_config, GPUS, TARGET_TOKENS, trainer=TRAINERS[trainer])
    techniques = space.runs(space.frugal(model_config["num_hidden_layers"]), TARGET_TOKENS)
    config = {
        "schema": "autotune/config-v1",
        "model": MODEL,
        "hardware": "h100-sxm",
        "gpus": GPUS,
        "techniques": techniques.to_dict(),
        "trainer": trainer,  # estimate --max-seq evaluates what the trainer runs at each length it tries
    }
    path.write_text(json.dumps(config))
    return config


def one_trainer(autotune: str, trainer: str, trials: int, work: Path) -> tuple[bool, str]:
    out = work / trainer
    search = _run(
        [autotune, "search", "--model", MODEL, "--target", TARGET, "--trainer", trainer, "--backend", "plan"]
        + ["--trials", str(trials), "--out", str(out)]
    )
    export_path = work / f"{trainer}.export"
    export = _run([autotune, "export", str(out), "--format", trainer, "-o", str(export_path)])
    front = json.loads((out / "pareto.json").read_text())["front"] if search.returncode in (0, 1) else []
    longest = max((f["seq_len"] for f in front), default=0)
    config = _frugal_config(trainer, work / f"{trainer}-frugal.json")
    wall = _run([autotune, "estimate", "--config", str(work / f"{trainer}-frugal.json"), "--max-seq", "--json"])
    wall_record = json.loads(wall.stdout) if wall.returncode == 0 else {"status": "error", "seq_len": 0}
    wall_len = wall_record["seq_len"] if wall_record["status"] == "ok" else 0
    fraction = longest / wall_len if wall_len else 0.0
    # a trainer whose wall is below the target: the search says so (exit 1) and there is nothing to export
    reaches = wall_len >= TARGET_TOKENS
    answered = search.returncode == (0 if reaches else 1) and export.returncode == (0 if reaches else 2)
    ok = answered and fraction >= GOAL_FRACTION
    knobs = {k: v for k, v in config["techniques"].items() if v != getattr(Techniques(), k)}
    lines = [
        f"--trainer {trainer}: search exit {search.returncode}, export --format {trainer} exit {export.returncode}"
        + ("" if export.returncode == 0 else f" ({export.stderr.strip().splitlines()[-1]})"),
        f"  front: {len(front)} points, longest {longest:,} tokens",
        f"  most frugal config it runs: {json.dumps(knobs, sort_keys=True)}",
        f"  its --max-seq: {wall_len:,} tokens; the front reaches {fraction:.1%} of it "
        f"(goal >= {GOAL_FRACTION:.0%}): {'met' if ok else 'MISSED'}",
    ]
    return ok, "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--autotune", default=str(Path(sys.executable).parent / "autotune"))
    parser.add_argument("--trainer", action="append", choices=list(TRAINERS), help="default: every trainer")
    parser.add_argument("--trials", type=int, default=20)
    args = parser.parse_args(argv)
    print(
        f"{MODEL} on {GPUS}x h100-sxm, target {TARGET} ({TARGET_TOKENS:,} tokens), plan backend, {args.trials} trials"
    )
    results = []
    with tempfile.TemporaryDirectory() as work:
        for trainer in args.trainer or list(TRAINERS):
            ok, text = one_trainer(args.autotune, trainer, args.trials, Path(work))
            print(text, flush=True)
            results.append(ok)
    print("goals met" if all(results) else "goals MISSED")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
