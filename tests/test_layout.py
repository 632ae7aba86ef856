"""The code's layout holds: imports run one way (import-linter's contracts in pyproject.toml), the library never
imports the tuner, and every knob's facts come from its one declaration in ``trials.stack.techniques``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
from conftest import ROOT


def test_import_contracts_hold():
    """Layers import downwards only, ``trials`` never imports ``autotune``, no import cycles (function-local
    imports included): ``lint-imports`` checks pyproject.toml's contracts."""
    lint = Path(sys.executable).with_name("lint-imports")
    done = subprocess.run(
        [str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "3 kept, 0 broken" in done.stdout


def test_no_module_under_trials_imports_autotune():
    offenders = []
    for path in sorted((ROOT / "trials").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [f"{path.name}:{node.lineno} {n}" for n in names if n.split(".")[0] == "autotune"]
    assert offenders == []


def test_every_knob_reaches_config_space_parquet_and_labels():
    """A knob declared in ``Techniques`` is parsed from config files, offered by the default space, a typed parquet
    column, and (when it has a label) named in plot labels -- with nothing to add anywhere else."""
    from autotune.outputs.plots import knob_label
    from autotune.outputs.report import _SCHEMA
    from autotune.search.space import load_space
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques, knobs

    model = load_model_config("llama3-8b")
    space = load_space(None, model, 8, 1024**2)
    types = {"bool": pa.bool_(), "int": pa.int64(), "tokens": pa.int64(), "choice": pa.string()}
    for knob in knobs():
        assert _SCHEMA.field(knob.name).type == types[knob.kind]
        assert knob.name in space.choices
        assert Techniques.from_dict({knob.name: knob.default}) == Techniques()
        if knob.label and knob.parent is None:
            on = True if knob.kind == "bool" else 2 if knob.kind == "int" else 4096
            assert knob.label.format(on) in knob_label(Techniques(**{knob.name: on}).to_dict())
