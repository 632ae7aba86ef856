"""bin/check-docs: every figure in README.md and docs/ is found in the stored output it cites."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CHECK = ROOT / "bin" / "check-docs"


def _check(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(CHECK), "--root", str(root)], capture_output=True, text=True)


def _copy_docs(tmp_path: Path) -> Path:
    """The parts of the tree the checker reads, to plant mistakes in."""
    copy = tmp_path / "tree"
    copy.mkdir()
    shutil.copy(ROOT / "README.md", copy / "README.md")
    shutil.copytree(ROOT / "docs", copy / "docs")
    shutil.copytree(ROOT / "bench", copy / "bench", ignore=shutil.ignore_patterns("__pycache__"))
    if (ROOT / "search_spaces").is_dir():
        shutil.copytree(ROOT / "search_spaces", copy / "search_spaces", ignore=shutil.ignore_patterns("*.yaml", "*.py"))
    return copy


def test_every_figure_in_readme_and_docs_is_in_the_output_it_cites():
    done = _check(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr


def test_a_stored_output_that_no_longer_prints_the_figure_fails(tmp_path):
    copy = _copy_docs(tmp_path)
    stored = copy / "bench/results/main_job.txt"
    stored.write_text(stored.read_text().replace("5,242,880", "5,111,808"))
    done = _check(copy)
    assert done.returncode == 1
    assert "5,242,880 is not in bench/results/main_job.txt" in done.stdout
    assert "not a line of bench/results/main_job.txt: best.json: 5,242,880 tokens" in done.stdout


def test_an_uncited_figure_and_an_uncited_result_and_an_unlisted_bench_fail(tmp_path):
    copy = _copy_docs(tmp_path)
    readme = copy / "README.md"
    readme.write_text(readme.read_text() + "\nThe step takes 1.37 s, and `2.13.0` in code is no figure.\n")
    (copy / "bench/results/orphan.txt").write_text("1.37\n")
    (copy / "bench/orphan_bench.py").write_text("")
    done = _check(copy)
    assert done.returncode == 1
    problems = done.stdout.splitlines()
    assert any(line.endswith("1.37 is cited by no figures marker") for line in problems), problems
    assert not any("2.13.0" in line for line in problems), problems
    assert "bench/results/orphan.txt is cited nowhere in README.md or docs/" in problems
    assert "bench/orphan_bench.py is not listed on docs/validation.md" in problems


def test_a_plain_count_beside_cited_figures_is_checked_too(tmp_path):
    """In a block that cites measured figures, a count such as "60 of 64" or "25 configs" drifts like any figure:
    planted "63 of 64" and "31 configs" fail; a one-digit count and a count in inline code are no figure."""
    copy = _copy_docs(tmp_path)
    readme = copy / "README.md"
    text = readme.read_text()
    assert "in 60 of 64 configs" in text and "on 25 configs" in text
    readme.write_text(
        text.replace("in 60 of 64 configs", "in 63 of 64 configs").replace("on 25 configs", "on 31 configs")
    )
    done = _check(copy)
    assert done.returncode == 1
    said = done.stdout
    assert "63 is cited by no figures marker" in said and "31 is cited by no figures marker" in said, said
    assert "60 is not in the block above the marker" in said and "25 is not in the block above the marker" in said


def test_a_readme_over_250_lines_fails(tmp_path):
    copy = _copy_docs(tmp_path)
    readme = copy / "README.md"
    readme.write_text(readme.read_text() + "\n" * 300)
    done = _check(copy)
    assert done.returncode == 1
    assert any(line.startswith("README.md has ") for line in done.stdout.splitlines())


def test_the_training_page_lists_every_option_of_the_trainer():
    """docs/training.md's option table names each option ``trials.train`` declares (what ``autotune run`` and the
    exported scripts pass through)."""
    from trials.train import parser

    table = (ROOT / "docs" / "training.md").read_text().split("## Every option", 1)[1].split("\n## ", 1)[0]
    flags = [flag for action in parser()._actions for flag in action.option_strings if flag.startswith("--")]
    missing = [flag for flag in flags if flag != "--help" and f"`{flag}" not in table]
    assert len(flags) > 20 and not missing, missing


def _backticked(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def test_the_names_the_docs_list_are_the_codes():
    """Where the docs list names the code declares -- the model presets, the model families, the attention
    kernels -- they list exactly those: one added to (or dropped from) the code and not the docs fails here."""
    from trials.kernels.registry import KERNEL_NAMES
    from trials.models.config import model_names
    from trials.models.families import MODEL_TYPES

    guide = (ROOT / "docs" / "guide.md").read_text()
    model_row = next(line for line in guide.splitlines() if line.startswith("| `--model M`"))
    assert set(_backticked(model_row)) - {"--model M", "autotune models", "config.json"} == set(model_names())
    table = (ROOT / "docs" / "models.md").read_text().split("| family (`model_type`)", 1)[1].split("\n\n", 1)[0]
    assert [_backticked(row)[0] for row in table.splitlines()[2:]] == list(MODEL_TYPES)
    readme = (ROOT / "README.md").read_text()
    families = readme.split("`--model` takes a preset", 1)[1].split("Details and limits", 1)[0]
    assert set(MODEL_TYPES) <= set(_backticked(families)), families
    kernels = guide.split("`--attention KERNEL` (", 1)[1].split(")", 1)[0]
    assert _backticked(kernels) == list(KERNEL_NAMES)


def test_the_guides_bad_input_messages_are_the_stored_runs():
    """Each message the guide's bad-input table quotes is one the CLI printed in bench/results/bad_inputs.md (its
    ``...`` and ``…`` elisions aside); tests/test_bad_input.py holds that stored table to the code's messages."""
    stored = [
        row.rsplit(" | ", 1)[-1].replace("\\|", "|")
        for row in (ROOT / "bench" / "results" / "bad_inputs.md").read_text().splitlines()
        if row.startswith("| ")
    ]
    table = (ROOT / "docs" / "guide.md").read_text().split("\n## Bad input\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| what")]
    assert len(rows) > 10
    for row in rows:
        message = _backticked(row.rsplit(" | ", 1)[-1])[0]
        parts = [part for part in re.split(r"\.\.\.|…", message) if part.strip()]  # elisions, shortened paths
        assert any(all(part in line for part in parts) for line in stored), message


def test_the_readme_knob_table_names_every_attention_kernel():
    """README's ``attention`` row names each kernel ``trials.kernels.registry`` declares, so a new kernel shows up
    in the table users read."""
    from trials.kernels.registry import KERNEL_NAMES

    row = next(line for line in (ROOT / "README.md").read_text().splitlines() if line.startswith("| `attention` |"))
    assert [name for name in KERNEL_NAMES if f"`{name}`" not in row] == []
