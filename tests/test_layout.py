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
    assert "4 kept, 0 broken" in done.stdout


ROOMS = ("core", "kernels", "models", "stack", "training", "trial")


def test_trials_is_rooms_and_its_public_faces():
    """``trials`` holds its rooms (each a package whose docstring says what belongs there) and, beside them, only
    the public faces: the plugin ``trials.hf``, the plugin inside Hugging Face's ``Trainer`` ``trials.hf_trainer``
    and the trainer ``trials.train``."""
    top = ROOT / "trials"
    assert sorted(p.name for p in top.glob("*.py")) == ["__init__.py", "hf.py", "hf_trainer.py", "train.py"]
    packages = sorted(p.parent.name for p in top.glob("*/__init__.py"))
    assert packages == sorted(ROOMS)
    for room in ROOMS:
        assert "May import" in ast.get_docstring(ast.parse((top / room / "__init__.py").read_text()))


def _lint_copy(tmp_path, module: str, planted: str) -> subprocess.CompletedProcess:
    """``lint-imports`` over a copy of the checkout's packages with ``planted`` appended to ``module``."""
    import shutil

    for package in ("trials", "autotune"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    target = tmp_path / module
    target.write_text(target.read_text() + "\n" + planted + "\n")
    lint = Path(sys.executable).with_name("lint-imports")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path)}
    return subprocess.run(
        [str(lint), "--config", "pyproject.toml"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300
    )


def test_an_upward_import_between_rooms_fails_the_contracts(tmp_path):
    """A model family reaching up into the stack, even inside a function, breaks the rooms' layers."""
    done = _lint_copy(tmp_path, "trials/models/families.py", "def _up():\n    from trials.stack import rules  # noqa")
    assert done.returncode != 0
    assert "the library's rooms import downwards only BROKEN" in done.stdout, done.stdout[-3000:]


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
