"""Bad input: exit code 2, one line on stderr naming the bad value, never a traceback (issue 8)."""

import pytest

from autotune.cli import main
from bad_inputs import CASES, argv_for, make_files


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    make_files(root)
    return root


@pytest.mark.parametrize("what, argv, fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_with_one_line(what, argv, fragment, files, capsys):
    code = main(argv_for(argv, files))
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert code == 2, (what, captured.err)
    assert len(lines) == 1, (what, captured.err)
    assert "Traceback" not in captured.err
    assert fragment in lines[0], (what, lines[0])
    assert captured.out == ""
