"""What each stored output in ``bench/results/`` rests on: real trials on this CPU, the plan backend's predictions,
wall time on this machine, or a check of the time model against itself; the torch it ran on; the load it ran at.

The torch is the one the output prints where it prints one, else the torch ``constraints-cpu.txt`` pinned at the
last commit that changed the output (the working tree's, for an output not committed since it changed). The load
is the one the output prints (``load A B C``), else "not recorded". What backs each output is declared below, once
per output; an output in ``bench/results/`` that is not declared is an error, so a new bench says what it is.

    .venv/bin/python bench/provenance.py > bench/results/provenance.txt
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

TRIALS = "real trials on this CPU"
PLAN = "the plan backend's predictions (no trial)"
TIMED = "wall time on this machine"
SELF = "the time model against itself (a consistency check)"
PUBLISHED = "the plan backend against published runs"
CLI = "the CLI's messages"
INSTALL = "real pip against the real package index (the GPU stood in)"

BACKED_BY = {
    "ablation.txt": PLAN,
    "bad_inputs.md": CLI,
    "calibrated-cpu.yaml": TRIALS,
    "ci_report.txt": TIMED,
    "front_optimality.txt": PLAN,
    "gpu_check_cpu.txt": TRIALS,
    "gpu_check_cpu_rehearsal.txt": TRIALS,
    "lengths_file_speed.txt": f"{PLAN}; {TIMED}",
    "lora_fronts.txt": f"{PLAN}; {TIMED}",
    "lora_reach.txt": PLAN,
    "main_job.txt": f"{PLAN}; {TIMED}",
    "max_seq_speed.txt": f"{PLAN}; {TIMED}",
    "memory_timeline.txt": PLAN,
    "multi_node.txt": PLAN,
    "multi_node_explain.txt": PLAN,
    "multi_node_qwen2.5-14b-like.txt": PLAN,
    "multi_node_usp.txt": PLAN,
    "multi_node_usp_explain.txt": PLAN,
    "oracle_fidelity.txt": TRIALS,
    "oracle_fidelity_documents.txt": TRIALS,
    "oracle_fidelity_families.txt": TRIALS,
    "oracle_fidelity_lora.txt": TRIALS,
    "oracle_fidelity_ring.txt": TRIALS,
    "packed_documents.txt": SELF,
    "packed_documents_ring.txt": SELF,
    "planner_speed.txt": f"{PLAN}; {TIMED}",
    "planner_speed_documents.txt": f"{PLAN}; {TIMED}",
    "provenance.txt": "this table",
    "published_runs.txt": PUBLISHED,
    "reduced_depth.txt": TRIALS,
    "search_llama3-8b_4_nodes.txt": PLAN,
    "search_llama3-8b_lora_1_gpu.txt": f"{PLAN}; {TIMED}",
    "search_quality.txt": PLAN,
    "search_qwen2.5-14b-like_2_nodes.txt": PLAN,
    "setup_gpu_rehearsal.txt": INSTALL,
    "sliding_window.txt": SELF,
    "throughput_fidelity.txt": TRIALS,
    "throughput_fidelity_ring_documents.txt": TRIALS,
    "throughput_fidelity_summary.txt": TRIALS,
    "throughput_h100.txt": PLAN,
    "train_resume.txt": TRIALS,
    "trainer_walls.txt": PLAN,
}

PRINTED_TORCH = re.compile(r"\btorch[ =]=?(\d+\.\d+\.\d+(\+\w+)?)")
PRINTED_LOAD = re.compile(r"\bload (\d+\.\d+(?: \d+\.\d+){1,2})")


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def pinned_torch(path: Path) -> str:
    """The torch ``constraints-cpu.txt`` pins where ``path`` was last changed: its last commit's, or the working
    tree's when it changed since (or was never committed)."""
    relative = str(path.relative_to(REPO))
    changed = _git("status", "--porcelain", "--", relative).strip()
    commit = "" if changed else _git("log", "-1", "--format=%H", "--", relative).strip()
    text = _git("show", f"{commit}:constraints-cpu.txt") if commit else (REPO / "constraints-cpu.txt").read_text()
    found = re.search(r"^torch==(\S+)", text, re.MULTILINE)
    return f"{found.group(1)} (pinned)" if found else "unknown"


def rows() -> list[tuple[str, str, str, str]]:
    """(output, what backs it, torch, load) for every stored output, by name."""
    found = sorted(p for p in RESULTS.iterdir() if p.is_file())
    undeclared = [p.name for p in found if p.name not in BACKED_BY]
    if undeclared:
        raise SystemExit(f"bench/provenance.py: declare what backs {', '.join(undeclared)} (BACKED_BY)")
    table = []
    for path in found:
        text = path.read_text(errors="replace") if path.name != "provenance.txt" else ""
        torch = PRINTED_TORCH.search(text)
        load = PRINTED_LOAD.search(text)
        table.append(
            (
                path.name,
                BACKED_BY[path.name],
                f"{torch.group(1)} (printed)" if torch else ("-" if not text else pinned_torch(path)),
                load.group(1) if load else "not recorded",
            )
        )
    return table


def main() -> int:
    table = rows()
    widths = [max(len(row[i]) for row in table) for i in range(3)]
    print("What each stored output rests on, the torch it ran on and the load it ran at")
    print(f"{'output':<{widths[0]}}  {'backed by':<{widths[1]}}  {'torch':<{widths[2]}}  load")
    for name, backed, torch, load in table:
        print(f"{name:<{widths[0]}}  {backed:<{widths[1]}}  {torch:<{widths[2]}}  {load}")
    measured = sum(TRIALS in backed for _, backed, _, _ in table)
    print(f"outputs: {len(table)}; from real trials on this CPU: {measured}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
