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


# -- flash-attn: a working kernel or a clean fallback to SDPA (bin/setup-gpu run against stand-ins) ------------

_FAKE_PYTHON = r"""#!{python}
# the venv's python as bin/setup-gpu calls it: pip logs what it is asked; flash-attn's install, build and kernel
# succeed or fail as FAKE_FLASH says (wheel | build | none, then :ok or :broken)
import os, sys
log = open(os.environ["FAKE_LOG"], "a")
source, mode = os.environ["FAKE_FLASH"].split(":")
args = sys.argv[1:]
code = sys.stdin.read() if args[:1] == ["-"] else args[1] if args[:1] == ["-c"] else ""
if args[:2] == ["-m", "pip"]:
    log.write(" ".join(args[2:]) + "\n")
    if "uninstall" in args or not any(a.startswith("flash-attn") for a in args):
        sys.exit(0)
    if "--only-binary" in args:
        sys.exit(0 if source == "wheel" else 1)
    print("error: subprocess-exited-with-error (nvcc)", file=sys.stderr)
    sys.exit(0 if source == "build" else 1)
if "torch.version.cuda" in code:
    print("13.0")
elif "flash_attn_func" in code:
    log.write("verify\n")
    if mode == "broken":
        raise SystemExit("its kernel fails: ImportError: flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice")
    print("flash-attn: imports and runs a causal bf16 forward and backward on NVIDIA H100 80GB HBM3")
elif "version(name)" in code:
    print("torch         2.13.0")
elif "__version__" in code:
    print("2.13.0")
"""


def _run_setup_gpu(tmp_path, flash: str, nvcc: bool = True):
    (tmp_path / "bin").mkdir()
    shutil.copy2(SETUP_GPU, tmp_path / "bin" / "setup-gpu")
    (tmp_path / "constraints-gpu.txt").write_text("torch==2.13.0\n")
    venv_bin = tmp_path / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "python").write_text(_FAKE_PYTHON.replace("{python}", sys.executable))
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("dirname", "sed", "cut", "sort", "awk", "nproc", "readlink", "date", "tail", "cat"):
        (tools / tool).symlink_to(shutil.which(tool))
    stubs = {"nvidia-smi": "#!/bin/sh\necho 9.0\n"}
    if nvcc:
        stubs["nvcc"] = "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n"
    for name, text in stubs.items():
        (tools / name).write_text(text)
    for path in [*tools.iterdir(), venv_bin / "python"]:
        if not path.is_symlink():
            path.chmod(0o755)
    log = tmp_path / "pip.log"
    log.touch()
    done = subprocess.run(
        [shutil.which("bash"), str(tmp_path / "bin" / "setup-gpu")],
        capture_output=True,
        text=True,
        # without the nvcc stub, CUDA_HOME names a folder without one: the machine's own toolkit is out of sight
        env={
            "PATH": str(tools),
            "HOME": str(tmp_path),
            "FAKE_LOG": str(log),
            "FAKE_FLASH": flash,
            **({} if nvcc else {"CUDA_HOME": str(tmp_path / "no-toolkit")}),
        },
        timeout=60,
    )
    return done, log.read_text().splitlines()


def _flash_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("setup-gpu: flash-attn: ")]


@pytest.mark.parametrize(
    "flash, nvcc, reason",
    [
        ("wheel:broken", True, "its kernel fails: ImportError"),  # installs, cannot load its CUDA library
        ("none:ok", True, "its source build failed"),  # no wheel, the build fails (flash-attention#2064)
        ("none:ok", False, "nvcc"),  # no wheel, no toolkit to build with
    ],
    ids=["kernel-fails", "build-fails", "no-nvcc"],
)
def test_setup_gpu_falls_back_to_sdpa_and_leaves_no_flash_attn(tmp_path, flash, nvcc, reason):
    done, pip = _run_setup_gpu(tmp_path, flash, nvcc)
    assert done.returncode == 0, done.stderr  # torch, deepspeed and autotune stand: the set-up is usable
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("setup-gpu: flash-attn: not installed (") and reason in last, last
    assert "fall back to torch's SDPA" in last
    assert len(_flash_lines(done.stderr)) >= 1 and "imports and runs" not in done.stderr
    # whatever pip got as far as installing is removed: its uninstall is the last thing pip is asked
    assert pip[-1].startswith("uninstall") and "flash-attn" in pip[-1], pip
    if not nvcc:
        assert not any("--no-build-isolation" in line for line in pip), pip


@pytest.mark.parametrize("flash", ["wheel:ok", "build:ok"])
def test_setup_gpu_keeps_a_flash_attn_whose_kernel_runs(tmp_path, flash):
    done, pip = _run_setup_gpu(tmp_path, flash)
    assert done.returncode == 0, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("setup-gpu: flash-attn: imports and runs")
    assert "verify" in pip and not any(line.startswith("uninstall") for line in pip), pip


@pytest.mark.parametrize(
    "flash, says, removed",
    [
        ("wheel:ok", "imports and runs", False),
        ("wheel:broken", "not installed (its kernel fails: ImportError", True),
        ("build:ok", "not installed (no flash-attn-4 wheel on the package index", False),
    ],
    ids=["runs", "kernel-fails", "no-wheel"],
)
def test_setup_gpu_keeps_flash_attention_4_and_3_only_where_they_run(tmp_path, flash, says, removed):
    """On a Hopper node (the stub says 9.0) FA4 and FA3 are tried as wheels, each verified; one that cannot run is
    uninstalled, and one line per kernel says what is usable."""
    done, pip = _run_setup_gpu(tmp_path, flash)
    assert done.returncode == 0, done.stderr
    for label in ("FlashAttention-4 (attention: flash4)", "FlashAttention-3 (attention: flash3)"):
        lines = [line for line in done.stderr.splitlines() if line.startswith(f"setup-gpu: {label}: ")]
        assert len(lines) == 1, done.stderr
        if label.startswith("FlashAttention-4"):
            assert says in lines[0], lines
    uninstalled = [line for line in pip if line.startswith("uninstall") and "flash-attn-4" in line]
    assert bool(uninstalled) == removed, pip
