"""What a new user sees in their first hour, with output piped (not a terminal): whole tables, an explained
front, a pasteable training command, and a CLI kept thin."""

from __future__ import annotations

import io
import json
import shlex

from conftest import ROOT, run_cli


def test_tables_are_whole_when_piped():
    done = run_cli("hardware")
    assert done.returncode == 0, done.stderr
    header = next(line for line in done.stdout.splitlines() if "name" in line)
    for column in ("from", "GiB", "host GiB/GPU", "TFLOP/s", "HBM TB/s", "link GB/s", "host GB/s", "rates"):
        assert column in header, header
    h100 = next(line for line in done.stdout.splitlines() if "h100-sxm" in line)
    assert " 79.65 " in h100 and " 232.8 " in h100, h100  # the capacities the oracle compares with, per GPU
    assert "…" not in done.stdout, done.stdout
    assert "e+" not in done.stdout, done.stdout  # b200's 2,250 TFLOP/s as written


def test_the_fronts_star_is_explained(monkeypatch):
    from autotune.cli import common

    buffer = io.StringIO()
    monkeypatch.setattr(common.OUT, "file", buffer)
    record = {"peak_device_bytes": 3 * 2**30, "source": "predicted"}
    front = [
        {"trial": 4, "seq_len": 8192, "tokens_per_s": 900.0, "record": record, "techniques": {"fsdp": True}},
        {"trial": 2, "seq_len": 2048, "tokens_per_s": 3000.0, "record": record, "techniques": {}},
    ]
    common.print_front(front, target=4096)
    lines = buffer.getvalue().splitlines()
    starred = [line for line in lines if "8,192 *" in line]
    assert len(starred) == 1 and not any("2,048 *" in line for line in lines), lines
    assert lines[-1].strip() == "* reaches the target", lines


def test_a_records_table_shows_what_it_holds_in_one_number_format(monkeypatch):
    """``estimate``'s and ``trial``'s table: no row for a field without a value (a prediction's loss), and every
    figure in the same plain form (``14,350``, ``5,489``: no ``1.435e+04``)."""
    from autotune.cli import common

    buffer = io.StringIO()
    monkeypatch.setattr(common.OUT, "file", buffer)
    record = {"status": "ok", "loss": None, "grad_norm": None, "error": None, "measured_layers": None}
    common.print_record({**record, "step_time_s": 14350.2, "first_s": 5489.3, "ratio": 0.402396, "n": 5489}, False, "t")
    shown = buffer.getvalue()
    assert "None" not in shown and "e+" not in shown, shown
    assert "14,350" in shown and "5,489" in shown and "0.4024" in shown, shown
    assert not any(key in shown for key in record if key != "status"), shown
    common.print_record({**record, "step_time_s": 14350.2}, True, "t")
    assert json.loads(buffer.getvalue().splitlines()[-1])["loss"] is None  # --json keeps every field


def test_run_prints_its_training_command_on_one_line(tmp_path):
    folder = tmp_path / ("long-folder-name-" * 6)  # the command is far wider than a piped console's 80 columns
    folder.mkdir()
    config = folder / "config.json"
    config.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": "tiny-llama",
                "hardware": "cpu",
                "gpus": 2,
                "seq_len": 256,
                "techniques": {"ulysses_degree": 2},
            }
        )
    )
    done = run_cli("run", "--config", str(config), "--steps", "1", timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    command = next(line for line in done.stderr.splitlines() if "torch.distributed.run" in line)
    words = shlex.split(command)
    assert words[1:3] == ["-m", "torch.distributed.run"] and words[-6:] == [
        "-m",
        "trials.train",
        "--config",
        str(config),
        "--steps",
        "1",
    ], command  # the command line as given
    assert "step 1/1" in done.stdout


def test_the_cli_is_thin():
    modules = sorted((ROOT / "autotune" / "cli").glob("*.py"))
    assert modules and all(len(path.read_text().splitlines()) <= 300 for path in modules), [
        (path.name, len(path.read_text().splitlines())) for path in modules
    ]
    private = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in sorted((ROOT / "autotune").rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "typer._" in line
    ]
    assert not private, private


def test_run_help_lists_every_option_of_the_trainer():
    """``autotune run``'s options are trials.train's: ``--help`` shows each with its help, a flag without a value
    type; a range autotune declares is shown and checked."""
    from trials.train import parser

    done = run_cli("run", "--help", env={"COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    actions = [action for action in parser()._actions if action.dest != "help"]
    assert len(actions) > 20
    for action in actions:
        row = next((line for line in done.stdout.splitlines() if f" {action.option_strings[-1]} " in line), "")
        assert action.help in row, (action.option_strings, row)
        assert ("<" in row) == (action.nargs != 0), row
    assert "(at least 1)" in next(line for line in done.stdout.splitlines() if " --steps " in line)


def test_help_shows_flags_as_flags_and_no_markup(capsys, monkeypatch):
    """Every command's ``--help``: a flag has no value type (not ``<bool>``), and a docstring's code is rendered,
    not shown with its backticks."""
    from autotune.cli import app, main

    monkeypatch.setenv("COLUMNS", "200")
    names = [command.name or command.callback.__name__ for command in app.registered_commands]
    for argv in ([], *([name] for name in names)):
        assert main([*argv, "--help"]) == 0
        shown = capsys.readouterr().out
        assert "--help" in shown, argv
        assert "<bool>" not in shown and "`" not in shown, (argv, shown)
