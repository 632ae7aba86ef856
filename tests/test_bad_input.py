"""Bad input: exit code 2, one line on stderr naming the bad value, never a traceback (issue 8); every numeric
option's range, and the data file problems ``autotune run`` finds before launching (issue 18)."""

import pytest
from bad_inputs import CASES, COMMAND_ARGV, argv_for, make_files, numeric_options, range_cases
from conftest import ROOT

from autotune.cli import main
from autotune.cli.options import RANGES

RANGE_CASES = range_cases()
# what each case printed when bench/bad_inputs.py last ran (the files' folder shown as …): the table the docs quote
STORED = {
    row.split(" | ")[0][2:]: row.rsplit(" | ", 1)[1][: -len(" |")].replace("\\|", "|")
    for row in (ROOT / "bench" / "results" / "bad_inputs.md").read_text().splitlines()
    if row.startswith("| ") and not row.startswith("| what")
}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    make_files(root)
    return root


@pytest.mark.parametrize("what, argv, fragment", CASES + RANGE_CASES, ids=[c[0] for c in CASES + RANGE_CASES])
def test_bad_input_exits_2_with_one_line(what, argv, fragment, files, capsys):
    code = main(argv_for(argv, files))
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, (what, captured.err)
    assert len(lines) == 1, (what, captured.err)
    assert "Traceback" not in captured.err
    assert fragment in lines[0], (what, lines[0])
    assert captured.out == ""
    if what in STORED:  # not a range case: bench/results/bad_inputs.md shows this very line
        assert lines[0].replace(str(files), "…") == STORED[what], "run bench/bad_inputs.py again: the message changed"


def test_the_stored_table_has_every_case():
    assert [what for what, _, _ in CASES] == list(STORED), "run bench/bad_inputs.py again: the cases changed"


def test_every_numeric_option_has_a_range():
    """An int or float option of any command is declared in ``RANGES`` (and so checked, and covered above)."""
    options = numeric_options()
    assert {flag for _, flag, _ in options} == set(RANGES)
    assert {command for command, _, _ in options} <= set(COMMAND_ARGV)  # so range_cases covers each of them
    # the options this issue names, in the commands that take them
    assert {
        ("search", "--trials"),
        ("search", "--timeout"),
        ("search", "--trial-timeout"),
        ("search", "--memory-gib"),
        ("search", "--seed"),
        ("search", "--gpus"),
        ("trial", "--steps"),
        ("run", "--steps"),
        ("run", "--seed"),
        ("verify", "--top"),
    } <= {(command, flag) for command, flag, _ in options}


@pytest.mark.parametrize("flag", sorted(RANGES))
def test_the_bounds_themselves_are_accepted(flag):
    """A range's own bounds (its minimum when included, its maximum) are in it: the refusals above are at the edge."""
    allowed = RANGES[flag]
    assert allowed.contains(allowed.minimum) != allowed.above_minimum
    assert not allowed.contains(allowed.minimum - 1)
    if allowed.maximum is not None:
        assert allowed.contains(allowed.maximum) and not allowed.contains(allowed.maximum + 1)
