"""Run every bad-input case of tests/bad_inputs.py through the real CLI (a fresh process each) and print
README's troubleshooting table: the input, the exit code, and the one line the user sees.

    .venv/bin/python bench/bad_inputs.py > bench/results/bad_inputs.md

The last line is the figure: how many cases exited 2 with exactly one line.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from bad_inputs import CASES, argv_for, make_files


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        files = Path(tmp) / "files"
        make_files(files)
        print("| what is wrong | command | exit | message |")
        print("|---|---|---|---|")
        good = 0
        for what, argv, _fragment in CASES:
            args = argv_for(argv, files)
            result = subprocess.run(
                [sys.executable, "-m", "autotune.cli", *args], capture_output=True, text=True, cwd=ROOT, timeout=300
            )
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            good += result.returncode == 2 and len(lines) == 1
            shown = " ".join(a.replace(str(files), "…") for a in args)
            message = (lines[0] if len(lines) == 1 else " / ".join(lines)).replace(str(files), "…").replace("|", "\\|")
            print(f"| {what} | `autotune {shown}` | {result.returncode} | {message} |")
        print()
        print(f"{good}/{len(CASES)} bad inputs exit 2 with one line")
    return 0


if __name__ == "__main__":
    sys.exit(main())
