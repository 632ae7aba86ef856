"""The GPU install (bin/setup-gpu, constraints-gpu.txt, pyproject's floors), checked on CPU.

Floors, and where they come from:
- deepspeed 0.19.7: the first release with ``deepspeed.sequence.layer.register_all_to_all_group`` and the
  ``deepspeed::dim_zero_all_to_all`` custom op (the 0.19.6 sdist on PyPI has neither; ``UlyssesSPAttentionHF``
  and ``TiledMLP`` are there since 0.17.0).
- flash-attn 2.7: ``flash_attn_interface._wrapped_flash_attn_forward`` / ``_backward`` first appear in tag v2.7.0
  (commit 83e41b3c, "Add custom ops for compatibility with PT Compile"); v2.6.3 has neither.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
SETUP_GPU = ROOT / "bin" / "setup-gpu"
DEEPSPEED_FLOOR = Version("0.19.7")
FLASH_ATTN_FLOOR = Version("2.7")


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _floor(requirement: Requirement) -> Version:
    floors = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    assert floors, f"{requirement} has no lower bound"
    return max(floors)


def _requirement(specs: list[str], name: str) -> Requirement:
    found = [Requirement(s) for s in specs if Requirement(s).name == name]
    assert len(found) == 1, f"{name} listed {len(found)} times in {specs}"
    return found[0]


def _torch_pin(path: Path) -> str:
    pins = re.findall(r"^torch==(\S+)\s*$", path.read_text(), flags=re.M)
    assert len(pins) == 1, f"{path.name} should pin torch once, found {pins}"
    return pins[0]


def test_deepspeed_floor_has_the_apis_upipe_uses():
    assert _floor(_requirement(_pyproject()["project"]["dependencies"], "deepspeed")) >= DEEPSPEED_FLOOR


def test_gpu_extra_floor_has_flash_attn_wrapped_kernels():
    gpu = _pyproject()["project"]["optional-dependencies"]["gpu"]
    assert _floor(_requirement(gpu, "flash-attn")) >= FLASH_ATTN_FLOOR


def test_setup_gpu_installs_the_extras_flash_attn_floor():
    gpu = _requirement(_pyproject()["project"]["optional-dependencies"]["gpu"], "flash-attn")
    script = SETUP_GPU.read_text()
    quoted = re.findall(r'^flash_attn="([^"]+)"', script, flags=re.M)
    assert quoted and Requirement(quoted[0]) == gpu, f"bin/setup-gpu installs {quoted}, the gpu extra says {gpu}"


def test_setup_gpu_is_valid_strict_bash():
    assert os.access(SETUP_GPU, os.X_OK), "bin/setup-gpu is not executable"
    script = SETUP_GPU.read_text()
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script
    done = subprocess.run(["bash", "-n", str(SETUP_GPU)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_setup_gpu_builds_flash_attn_without_isolation_and_tries_a_wheel_first():
    script = SETUP_GPU.read_text()
    wheel, build = script.find("--only-binary flash-attn"), script.find("--no-build-isolation --no-binary flash-attn")
    assert 0 <= wheel < build, "bin/setup-gpu should try a prebuilt wheel first, then build without isolation"
    for needed in ("MAX_JOBS", "FLASH_ATTENTION_FORCE_BUILD=TRUE", "constraints-gpu.txt", "nvcc"):
        assert needed in script, needed


def test_gpu_and_cpu_constraints_pin_the_same_torch():
    gpu, cpu = _torch_pin(ROOT / "constraints-gpu.txt"), _torch_pin(ROOT / "constraints-cpu.txt")
    assert gpu == cpu
    assert "+" not in gpu, "the GPU pin must not name a local build (+cpu, +cu130): PyPI's plain wheel is CUDA"


@pytest.mark.parametrize(
    "driver, says",
    [
        (None, "nvidia-smi not found"),  # no driver installed
        ("#!/bin/sh\nexit 9\n", "nvidia-smi fails: is the NVIDIA driver loaded?"),  # installed, not loaded
    ],
    ids=["no-driver", "driver-not-loaded"],
)
def test_setup_gpu_without_a_driver_fails_loudly_before_touching_anything(tmp_path, driver, says):
    (tmp_path / "bin").mkdir()
    shutil.copy2(SETUP_GPU, tmp_path / "bin" / "setup-gpu")
    # the script's PATH holds only what it needs before its driver check, and the nvidia-smi this case gives it
    # (none, or a stub that fails): the machine's own nvidia-smi, if any, is out of its sight
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("dirname",):
        (tools / tool).symlink_to(shutil.which(tool))
    if driver is not None:
        (tools / "nvidia-smi").write_text(driver)
        (tools / "nvidia-smi").chmod(0o755)
    done = subprocess.run(
        [shutil.which("bash"), str(tmp_path / "bin" / "setup-gpu")],
        capture_output=True,
        text=True,
        env={"PATH": str(tools), "HOME": str(tmp_path)},
        timeout=60,
    )
    assert done.returncode != 0
    assert says in done.stderr, done.stderr
    assert not (tmp_path / ".venv").exists()


def test_installed_deepspeed_has_the_apis_trials_use():
    """The venv's deepspeed (at or above the floor) has everything trials/ imports from it."""
    code = """
import torch, deepspeed.comm
from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF, TiledMLP
from deepspeed.sequence.layer import register_all_to_all_group
assert callable(deepspeed.comm.init_distributed)
assert hasattr(torch.ops.deepspeed, "dim_zero_all_to_all")
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
