"""Bad input: exit code 2, one line on stderr naming the bad value, never a traceback (issue 8); every numeric
option's range, and the data file problems ``autotune run`` finds before launching (issue 18)."""

import pytest
from bad_inputs import CASES, COMMAND_ARGV, argv_for, make_files, numeric_options, range_cases

from autotune.cli import main
from autotune.cli.options import RANGES

RANGE_CASES = range_cases()


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
