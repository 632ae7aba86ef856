"""docs/library.md's code runs as written: its loop, the ``build_training`` variant and the ``trials.hf`` plugin
loop, each in a fresh process on a tiny model (the page's placeholders -- ``my_token_windows``, the model folder --
filled in by the test), and the flat paths of earlier releases still import as the modules they moved to."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys

import pytest
from conftest import ROOT
from train_harness import ENV, write_config, write_pretrained

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

PAGE = ROOT / "docs" / "library.md"
# the user's own token source: two windows of the seeded synthetic stream per replica
TOKEN_WINDOWS = """
from trials.training.data import synthetic_sample

def my_token_windows(length, replica):
    for step in range(2):
        yield synthetic_sample(2 * replica + step, length - 1, 4096)
"""


def python_blocks(section: str) -> list[str]:
    """The ``python`` code blocks of the page's section headed ``section``, in order."""
    text = PAGE.read_text()
    start = text.index(f"## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start : end if end > 0 else None], re.S)


def run_page_code(code: str, cwd) -> subprocess.CompletedProcess:
    script = cwd / "loop.py"
    script.write_text(TOKEN_WINDOWS + code)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600)


def test_the_loop_and_build_training_run_as_written(tmp_path):
    loop, with_build_training = python_blocks("The loop")
    (tmp_path / "out").mkdir()
    write_config(tmp_path / "out" / "best.json", mlp_tile_tokens=64, loss_tile_tokens=64)
    done = run_page_code(
        loop
        + "\n"
        + with_build_training
        + "\nfrom trials.models.model import TrainingModel\nprint('built', isinstance(model, TrainingModel))\n",
        tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    losses = re.findall(r"^loss (\d+\.\d+)  grad norm \d+\.\d+$", done.stdout, re.M)
    assert len(losses) == 2 and all(float(loss) > 0 for loss in losses), done.stdout
    assert "built True" in done.stdout


def test_the_hf_plugin_loop_runs_as_written(tmp_path):
    (plugin_loop,) = python_blocks("Hugging Face models: the plugin `trials.hf`")
    (tmp_path / "out").mkdir()
    write_config(tmp_path / "out" / "best.json")
    write_pretrained(tmp_path / "hf-model")
    code = plugin_loop.replace('"path/to/hf-model"', repr(str(tmp_path / "hf-model")))
    done = run_page_code(code + "\n    print(f'loss {result.loss:.4f}')\n", tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(re.findall(r"^loss \d+\.\d+$", done.stdout, re.M)) == 2, done.stdout


# the flat modules of earlier releases: library loops and exported scripts import them
FLAT_MODULES = (
    "allocator attention checkpoint checkpointing config_file data dist errors families fsdp kernels knobs "
    "layer_clock memory memory_timeline model model_config moe offload patches rules runner segments spec stack "
    "step techniques tiling ulysses upipe"
).split()


@pytest.mark.parametrize("name", FLAT_MODULES)
def test_a_flat_path_of_earlier_releases_still_imports(name):
    """Each imports as the very module it moved to (``trials.MOVED``); ``trials.kernels`` and ``trials.stack`` are
    rooms now, holding what the flat modules held."""
    import trials

    module = importlib.import_module(f"trials.{name}")
    moved = trials.MOVED.get(f"trials.{name}")
    if moved:
        assert module is importlib.import_module(moved)
    elif name == "kernels":
        from trials.kernels.registry import KERNELS

        assert module.KERNELS is KERNELS
    else:
        from trials.stack.recipe import apply

        assert module.apply is apply
