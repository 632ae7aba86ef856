"""The GPU install (bin/setup-gpu, constraints-gpu.txt, pyproject's floors), checked on CPU.

Floors, and where they come from:
- deepspeed 0.19.7: the first release with ``deepspeed.sequence.layer.register_all_to_all_group`` and the
  ``deepspeed::dim_zero_all_to_all`` custom op (the 0.19.6 sdist on PyPI has neither; ``UlyssesSPAttentionHF``
  and ``TiledMLP`` are there since 0.17.0).
- flash-attn 2.7: ``flash_attn_interface._wrapped_flash_attn_forward`` / ``_backward`` first appear in tag v2.7.0
  (commit 83e41b3c, "Add custom ops for compatibility with PT Compile"); v2.6.3 has neither.
"""

import ast
import base64
import hashlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from autotune.core import node_setup
from trials.kernels.registry import FLASH_KERNELS, KERNELS

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
    assert Requirement(node_setup.FLASH_ATTN) == gpu, f"setup-gpu installs {node_setup.FLASH_ATTN}, the extra: {gpu}"


def test_setup_gpu_is_valid_strict_bash():
    assert os.access(SETUP_GPU, os.X_OK), "bin/setup-gpu is not executable"
    script = SETUP_GPU.read_text()
    assert script.startswith("#!/usr/bin/env bash\n")
    assert "set -euo pipefail" in script
    done = subprocess.run(["bash", "-n", str(SETUP_GPU)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_setup_gpu_builds_flash_attn_without_isolation_and_only_as_the_last_route():
    assert KERNELS["flash"].routes()[-1] == "source"
    assert all("source" not in KERNELS[name].routes() for name in FLASH_KERNELS if name != "flash")
    code = (ROOT / "autotune" / "core" / "node_setup.py").read_text()
    for needed in (
        '"--no-build-isolation", "--no-binary", "flash-attn"',
        "MAX_JOBS",
        '"FLASH_ATTENTION_FORCE_BUILD": "TRUE"',
    ):
        assert needed in code, needed


def test_the_torch_pins_lie_in_pyprojects_range_the_oldest_at_its_floor():
    (torch,) = [Requirement(s) for s in _pyproject()["project"]["dependencies"] if Requirement(s).name == "torch"]
    low, above = node_setup.torch_range()
    assert torch.specifier == SpecifierSet(f">={low},<{above}")
    assert Version(_torch_pin(ROOT / "constraints-oldest.txt")) == Version(low)
    for pins in ("constraints-cpu.txt", "constraints-gpu.txt", "constraints-oldest.txt"):
        assert _torch_pin(ROOT / pins) in torch.specifier, pins


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


# -- bin/setup-gpu's decisions, run against a fake nvidia-smi, a fake venv and a local wheel folder ------------------

H100 = "NVIDIA H100 80GB HBM3, 9.0, 580.65.06\n"
H100_OLD_DRIVER = "NVIDIA H100 80GB HBM3, 9.0, 550.54.15\n"
A100 = "NVIDIA A100-SXM4-80GB, 8.0, 580.65.06\n"

_FAKE_VENV_PYTHON = r"""#!{python}
# the venv's python as node_setup calls it. pip logs each call (with the torch its constraints file pins) and, with
# --no-index, finds a package only where the wheel folder has a file of that name, as pip does; torch is FAKE_TORCH
# ("version,cuda[,distribution version]" or "none"; the distribution's version is torch.__version__ unless given);
# a kernel's check fails where FAKE_CHECK_FAILS names it ("flash3=TypeError: ...")
import json, os, re, sys
from pathlib import Path
log = open(os.environ["FAKE_LOG"], "a")
args = sys.argv[1:]
if args[:2] == ["-m", "pip"]:
    pins = ""
    if "-c" in args:
        pins = Path(args[args.index("-c") + 1]).read_text().strip()
    log.write(" ".join(args[2:]) + " | " + pins + "\n")
    if args[2] == "uninstall" or "-e" in args:
        sys.exit(0)
    for wanted in args[3:]:  # pip installs torch: its build follows the index (PyPI's: CUDA 13)
        if wanted.startswith("torch=="):
            pin = wanted[len("torch=="):]
            if any(a.endswith("/cu128") for a in args):  # PyTorch's index: the local label in the metadata too
                installed = f"{pin}+cu128,12.8,{pin}+cu128"
            else:  # PyPI's wheel: torch.__version__ has the label, the distribution's metadata has none
                installed = f"{pin}+cu132,13.2,{pin}"
            Path(os.environ["FAKE_LOG"] + ".torch").write_text(installed)
    if "--no-index" in args:
        folder = Path(args[args.index("--find-links") + 1])
        have = {re.split(r"-\d", f.name)[0].replace("_", "-").lower() for f in folder.iterdir() if f.is_file()}
        names = [re.split(r"[\[<>=]", w)[0].lower() for w in args[3:] if not w.startswith("-") and "/" not in w]
        sys.exit(0 if all(n in have for n in names) else 1)
    sys.exit(0)
code = args[1] if args[:1] == ["-c"] else ""
state = Path(os.environ["FAKE_LOG"] + ".torch")
torch = state.read_text() if state.exists() else os.environ["FAKE_TORCH"]
if "torch.version.cuda" in code or "metadata.version('torch')" in code:
    if torch == "none":
        sys.exit(1)
    version, cuda, *distribution = torch.split(",")
    print(json.dumps([version, cuda or None]) if "torch.version.cuda" in code else (distribution or [version])[0])
elif "cuda.is_available" in code:
    sys.exit(1 if os.environ.get("FAKE_NO_GPU") else 0)
elif "check_kernel" in code:
    log.write("check " + args[2] + "\n")
    fails = dict(item.split("=", 1) for item in filter(None, os.environ.get("FAKE_CHECK_FAILS", "").split(";")))
    if args[2] in fails:
        print(fails[args[2]], file=sys.stderr)
        sys.exit(1)
    print("its layer and head-chunk forward and backward (as the stack calls them) match SDPA on NVIDIA H100")
else:
    sys.exit(3)
"""


def _setup_gpu(
    tmp_path,
    smi: str,
    torch: str,
    *options,
    wheels: list[str] | None = None,
    check_fails: str = "",
    env: dict | None = None,
):
    """bin/setup-gpu of this checkout with ``smi`` as nvidia-smi's answer, ``torch`` in the venv and, when given,
    a wheel folder holding ``wheels`` (file names; "kernels/NAME" a hub build). Returns (run, pip log lines, venv)."""
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("dirname",):
        (tools / tool).symlink_to(shutil.which(tool))
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{smi}'\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(_FAKE_VENV_PYTHON.replace("{python}", sys.executable))
    for path in ((tools / "nvidia-smi"), venv / "bin" / "python"):
        path.chmod(0o755)
    argv = [*options]
    if wheels is not None:
        folder = tmp_path / "wheels"
        folder.mkdir()
        for name in wheels:
            if name.startswith("kernels/"):
                (folder / name / "build" / "torch-cuda").mkdir(parents=True)
                (folder / name / "build" / "torch-cuda" / "__init__.py").write_text("")
            else:
                (folder / name).write_text("")
        argv += ["--wheels", str(folder)]
    log = tmp_path / "pip.log"
    log.touch()
    env = {
        "PATH": f"{tools}:{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PYTHONPATH": str(ROOT),
        "FAKE_LOG": str(log),
        "FAKE_TORCH": torch,
        "FAKE_CHECK_FAILS": check_fails,
        "CUDA_HOME": str(tmp_path / "no-toolkit"),  # the machine's own CUDA toolkit, if any, is out of sight
        **(env or {}),
    }
    done = subprocess.run(
        [sys.executable, "-m", "autotune.core.node_setup", "--venv", str(venv), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    return done, log.read_text().splitlines(), venv


def _said(done, prefix: str) -> list[str]:
    return [line for line in done.stderr.splitlines() if line.startswith(f"setup-gpu: {prefix}")]


OFFLINE_WHEELS = ["kernels-0.17.2-cp38-abi3-manylinux_2_17_x86_64.whl", "kernels/flash", "kernels/flash3"]
OFFLINE_WHEELS += ["flash_attn_4-4.0.0b36-py3-none-any.whl", "nvidia_cutlass_dsl-4.6.2-py3-none-any.whl"]


def test_offline_on_h100_keeps_the_nodes_torch_and_installs_every_kernel_from_the_wheel_folder(tmp_path):
    """The done-when of issue 47: a node's own CUDA torch is kept (every pip call pins it exactly: its
    distribution's version, what pip compares; PyPI's CUDA wheel has no local label there), nothing is fetched from
    an index, FA2 and FA3 come from the hub builds in the folder, FA4 from its wheel with the [cu13] extra, each
    checked, and it says so: one line per kernel, and a last line with what it kept and installed."""
    done, pip, venv = _setup_gpu(
        tmp_path, H100 * 8, "2.13.0+cu130,13.0,2.13.0", "--use-installed-torch", wheels=OFFLINE_WHEELS
    )
    assert done.returncode == 0, done.stderr
    installs = [line for line in pip if line.startswith("install")]
    assert installs and all("--no-index --find-links" in line for line in installs), pip
    assert all(line.endswith("| torch==2.13.0") for line in installs), pip
    assert any(line.split(" | ")[0].endswith(f" {node_setup.KERNELS_PACKAGE}") for line in installs), pip
    assert not any(re.search(r"install .*\btorch==", line.split(" | ")[0]) for line in installs), pip
    assert not any(line.startswith("uninstall") for line in pip), pip
    assert _said(done, "torch 2.13.0+cu130 (CUDA 13.0) is installed: keeping it")
    for name in ("flash", "flash3"):
        assert (venv / "share" / "autotune" / "kernels" / name / "build" / "torch-cuda").is_dir()
    assert _said(done, "FlashAttention-3 (attention: flash3): from the kernel hub (kernels-community/flash-attn3): ")
    assert _said(done, "FlashAttention-4 (attention: flash4): flash-attn-4[cu13]==4.0.0b36 (wheel): ")
    assert [line for line in pip if line.startswith("check")] == ["check flash", "check flash3", "check flash4"]
    last = done.stderr.strip().splitlines()[-1]
    assert last == "setup-gpu: kept torch 2.13.0+cu130 (CUDA 13.0); attention kernels sdpa, flash, flash3, flash4"


def test_a_kernel_whose_calls_drifted_is_refused_at_install_and_the_next_route_tried(tmp_path):
    """Review item 9: FA3's hub build installs but the stack's own calls fail its check (a signature drift) -- it is
    removed, the wheel route is tried (none in the folder), and the line says both and how to get FA3."""
    drift = "TypeError: _flash_attn_forward() got an unexpected keyword argument 'softcap'"
    done, pip, venv = _setup_gpu(
        tmp_path,
        H100,
        "2.13.0+cu130,13.0",
        "--use-installed-torch",
        wheels=OFFLINE_WHEELS,
        check_fails=f"flash3={drift}",
    )
    assert done.returncode == 0, done.stderr
    assert not (venv / "share" / "autotune" / "kernels" / "flash3").exists()
    (line,) = _said(done, "FlashAttention-3 (attention: flash3): ")
    assert f"not installed (hub: installed, but {drift}; wheel: no wheel on the index)" in line, line
    assert line.endswith(KERNELS["flash3"].how_to_build)
    assert any(p.startswith("uninstall") and "flash-attn-3" in p for p in pip), pip
    assert done.stderr.strip().splitlines()[-1].endswith("attention kernels sdpa, flash, flash4")


def test_a_driver_older_than_580_gets_torchs_cuda_12_build_and_fa4_without_the_cu13_extra(tmp_path):
    """Review item 8: on driver 550 torch comes from PyTorch's CUDA 12.8 index and FA4 without ``[cu13]``; every
    later install pins the build pip installed (that index's metadata version has its local label)."""
    done, pip, _ = _setup_gpu(tmp_path, H100_OLD_DRIVER, "none")
    assert done.returncode == 0, done.stderr
    pin = node_setup.torch_pin()
    (torch_install,) = [line for line in pip if re.search(r"install .*\btorch==", line.split(" | ")[0])]
    assert f"--index-url https://download.pytorch.org/whl/cu128 torch=={pin}" in torch_install, torch_install
    later = [line for line in pip[pip.index(torch_install) + 1 :] if line.startswith("install")]
    assert later and all(line.endswith(f"| torch=={pin}+cu128") for line in later), pip
    assert any("--only-binary flash-attn-4 flash-attn-4==4.0.0b36 |" in line for line in pip), pip
    assert not any("[cu13]" in line for line in pip), pip


def test_pypis_cuda_13_torch_is_pinned_by_its_distributions_version_not_torch_version(tmp_path):
    """PyPI's CUDA wheel: ``torch.__version__`` is PIN+cu132, its metadata PIN; every install after it pins PIN,
    which that wheel satisfies (PIN+cu132 matches no distribution under PEP 440)."""
    done, pip, _ = _setup_gpu(tmp_path, H100, "none")
    assert done.returncode == 0, done.stderr
    pin = node_setup.torch_pin()
    (torch_install,) = [line for line in pip if re.search(r"install .*\btorch==", line.split(" | ")[0])]
    assert "--index-url" not in torch_install, torch_install
    later = [line for line in pip[pip.index(torch_install) + 1 :] if line.startswith("install")]
    assert later and all(line.endswith(f"| torch=={pin}") for line in later), pip
    assert done.stderr.strip().splitlines()[-1].startswith(f"setup-gpu: installed torch {pin} (CUDA 13.2); "), (
        done.stderr
    )


@pytest.mark.parametrize(
    "driver, cuda, index", [(580, "13.2", None), (595, "13.2", None), (579, "12.8", "cu128"), (525, "12.8", "cu128")]
)
def test_the_cuda_build_follows_the_driver(driver, cuda, index):
    gpus = node_setup.read_gpus(f"NVIDIA H100, 9.0, {driver}.10.01\n")
    choice = node_setup.choose_torch(gpus, None, False, "2.13.0", ("2.11", "2.16"))
    assert (choice.cuda, choice.keep) == (cuda, False)
    assert (choice.index_url or "").endswith(index or "") and bool(choice.index_url) == bool(index)
    fa4 = [plan for plan in node_setup.choose_kernels(gpus, choice.cuda) if plan.name == "flash4"]
    assert fa4[0].requirement == (
        "flash-attn-4[cu13]==4.0.0b36" if cuda.startswith("13.") else "flash-attn-4==4.0.0b36"
    )


@pytest.mark.parametrize(
    "torch, says",
    [
        ("none", "the venv has no torch"),
        ("2.13.0+cpu,", "torch 2.13.0+cpu in the venv is a CPU build"),
        ("2.10.0+cu128,12.8", "torch 2.10.0+cu128 is outside autotune's range (>=2.11,<2.16)"),
        ("2.16.0,13.0", "torch 2.16.0 is outside autotune's range (>=2.11,<2.16)"),
    ],
)
def test_use_installed_torch_refuses_what_it_cannot_keep_in_one_line_and_installs_nothing(tmp_path, torch, says):
    done, pip, _ = _setup_gpu(tmp_path, H100, torch, "--use-installed-torch", wheels=OFFLINE_WHEELS)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1].startswith("setup-gpu: error: ") and says in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not any(line.startswith(("install", "uninstall")) for line in pip), pip


def test_a_torch_that_sees_no_gpu_stops_the_set_up_before_autotune_and_the_kernels(tmp_path):
    done, pip, _ = _setup_gpu(tmp_path, H100, "2.13.0+cu130,13.0", "--use-installed-torch", env={"FAKE_NO_GPU": "1"})
    assert done.returncode == 1 and "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last == (
        "setup-gpu: error: torch (CUDA 13.0) sees no GPU: the driver must support CUDA 13.0 (nvidia-smi's header "
        "shows what it supports)"
    )
    assert not any(line.startswith("install") for line in pip), pip


def test_cuda_13_torch_on_an_older_driver_is_refused():
    gpus = node_setup.read_gpus(H100_OLD_DRIVER)
    with pytest.raises(node_setup.SetupError, match="built with CUDA 13.0, which driver 550 does not run"):
        node_setup.choose_torch(gpus, ("2.13.0", "13.0"), True, "2.13.0", ("2.11", "2.16"))


@pytest.mark.parametrize(
    "options, says", [(["--wheels", "nowhere"], "not a folder"), (["--use-installed"], "unrecognized arguments")]
)
def test_bad_options_are_one_line_and_exit_2(tmp_path, options, says):
    done = subprocess.run(
        [sys.executable, "-m", "autotune.core.node_setup", *options],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and says in done.stderr, done.stderr


def test_a_cuda_13_torch_of_the_pin_on_an_older_driver_is_replaced_by_the_cuda_12_build(tmp_path):
    """torch==PIN is satisfied by the CUDA 13 build already there: it is uninstalled first, or pip would keep it."""
    done, pip, _ = _setup_gpu(tmp_path, H100_OLD_DRIVER, "2.13.0,13.0")
    assert done.returncode == 0, done.stderr
    torch_steps = [
        line for line in pip if re.search(r"(uninstall .*\btorch$|install .*\btorch==)", line.split(" | ")[0])
    ]
    assert len(torch_steps) == 2 and torch_steps[0].startswith("uninstall"), pip
    assert "download.pytorch.org/whl/cu128" in torch_steps[1], pip


def test_without_a_prebuilt_route_flash_attn_is_built_and_without_nvcc_left_out_with_the_reason(tmp_path):
    """An A100 node offline with no hub build and no wheel: FA2 falls to its source build, which needs nvcc (none
    here): it is left out, nothing half installed, trials fall back to SDPA; FA3 and FA4 are not for 8.0."""
    done, pip, _ = _setup_gpu(tmp_path, A100, "2.13.0+cu130,13.0", "--use-installed-torch", wheels=[])
    assert done.returncode == 0, done.stderr
    (line,) = _said(done, "FlashAttention-2 (attention: flash): ")
    assert "not installed (hub: the kernels package is not installed; wheel: no wheel on the index; source: " in line
    assert "nvcc" in line and pip[-1].startswith("uninstall") and "flash-attn" in pip[-1], (line, pip)
    assert not _said(done, "FlashAttention-3") and not _said(done, "FlashAttention-4")
    assert done.stderr.strip().endswith(
        "attention kernels sdpa (no flash kernel: trials and searches fall back to torch's SDPA)"
    )


def test_every_kernel_a_gpu_preset_offers_is_one_setup_gpu_installs_there_from_a_prebuilt_route():
    """The search never recommends a kernel that bin/setup-gpu would not install on that node: each kernel a GPU
    preset lists (and its device runs) is among setup-gpu's kernels for that generation, with a prebuilt route
    (hub or wheel) ahead of any source build -- on H100 that includes flash3, what the main job's best.json names."""
    from autotune.core.hardware import hardware_names, is_shipped, load_hardware

    checked = []
    for preset in filter(is_shipped, hardware_names()):
        hardware = load_hardware(preset)
        if not hardware.compute_capability:
            continue
        gpus = node_setup.read_gpus(f"GPU, {hardware.compute_capability}.0, 580.65.06\n")
        plans = {plan.name: plan for plan in node_setup.choose_kernels(gpus, "13.0")}
        for name in hardware.kernels:
            if name in FLASH_KERNELS and KERNELS[name].runs_on(hardware.compute_capability):
                prebuilt = plans[name].routes[0] == "hub" or KERNELS[name].pypi_wheel if name in plans else False
                assert prebuilt, (preset, name, plans)
                checked.append((preset, name))
    assert ("h100-sxm", "flash3") in checked, checked


# -- what setup-gpu asks pip for, with real pip ---------------------------------------------------------------------


def _wheel(folder: Path, name: str, version: str, files: dict[str, str], requires: tuple[str, ...] = ()) -> Path:
    """A pure-Python wheel of distribution ``name`` at ``version`` holding ``files`` (path: text), laid out as pip
    installs one: METADATA, WHEEL and RECORD (each file's sha256 and size) in its dist-info folder."""
    dist_info = f"{name}-{version}.dist-info"
    metadata = [f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"]
    metadata += [f"Requires-Dist: {requirement}\n" for requirement in requires]
    contents = {
        **files,
        f"{dist_info}/METADATA": "".join(metadata),
        f"{dist_info}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}\n")
    contents[f"{dist_info}/RECORD"] = "".join(record) + f"{dist_info}/RECORD,,\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in contents.items():
            archive.writestr(path, text)
    return wheel


def _cuda_torch_wheel(folder: Path, pin: str) -> Path:
    """A stand-in of PyPI's CUDA torch wheel at ``pin``: metadata version PIN, ``torch.__version__`` PIN+cu132,
    CUDA 13.2, ``torch.cuda.is_available()`` true."""
    torch_files = {
        "torch/__init__.py": f'__version__ = "{pin}+cu132"\nfrom . import cuda, version\n',
        "torch/version.py": 'cuda = "13.2"\n',
        "torch/cuda/__init__.py": "def is_available():\n    return True\n",
    }
    return _wheel(folder, "torch", pin, torch_files)


def test_the_torch_pin_setup_gpu_writes_lets_real_pip_install_a_package_that_requires_torch(tmp_path, monkeypatch):
    """Real pip in a fresh venv, offline from a wheel folder (``--wheels``) that holds a stand-in of PyPI's CUDA
    torch wheel (metadata version PIN, ``torch.__version__`` PIN+cu132, CUDA 13.2) and a package requiring
    ``torch>=2.11`` (as autotune does): after setup-gpu installs torch, and after it keeps it
    (``--use-installed-torch``), the package installs under the constraints setup-gpu wrote."""
    for name in [name for name in os.environ if name.startswith("PIP_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # this machine's pip config (indexes, find-links) unread
    monkeypatch.setenv("PIP_DISABLE_PIP_VERSION_CHECK", "1")
    pin = node_setup.torch_pin()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _cuda_torch_wheel(wheels, pin)
    low, _ = node_setup.torch_range()
    _wheel(wheels, "needs_torch", "1.0", {"needs_torch.py": ""}, requires=(f"torch>={low}",))
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    node = node_setup.Node(venv / "bin" / "python", wheels, tmp_path / "constraints.txt")
    gpus = node_setup.read_gpus(H100)
    for use_installed in (False, True):
        installed = node.installed_torch()
        assert (installed is None) == (not use_installed), installed
        choice = node_setup.choose_torch(gpus, installed, use_installed, pin, node_setup.torch_range())
        node_setup.set_up_torch(node, choice, installed)
        assert node.installed_torch() == (f"{pin}+cu132", "13.2")
        constraints = node.constraints.read_text()
        assert node.pip("needs_torch"), f"pip cannot install a package requiring torch>={low} under {constraints}"
        node.uninstall("needs_torch")


@pytest.mark.slow
def test_setup_gpu_sets_up_an_h100_node_from_the_real_index_and_names_each_kernel_it_leaves_out(tmp_path):
    """bin/setup-gpu's whole path with real pip and the real index, as on an H100 node with driver 580 whose venv
    holds a CUDA torch (``--use-installed-torch``): a stand-in of PyPI's CUDA 13.2 wheel (metadata version PIN,
    ``torch.cuda.is_available()`` true), so pip resolves autotune's test extra, ``kernels`` and each kernel's wheel
    route against that pin. No kernel can pass its check without a GPU (the stand-in runs nothing; the hub is
    offline, no nvcc): each is left out with one line, and the set-up exits 0."""
    pin = node_setup.torch_pin()
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    stand_in = _cuda_torch_wheel(wheels, pin)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", str(stand_in)], check=True, timeout=120)
    tools = tmp_path / "tools"
    tools.mkdir()
    (tools / "nvidia-smi").write_text(f"#!/bin/sh\nprintf '{H100.strip()}\\n'\n")
    (tools / "nvidia-smi").chmod(0o755)
    env = {
        **{name: value for name, value in os.environ.items() if name not in ("VIRTUAL_ENV", "PYTHONPATH")},
        "PATH": f"{tools}:{os.environ['PATH']}",
        "CUDA_HOME": str(tmp_path / "no-cuda-toolkit"),  # flash-attn's source route: no nvcc here
        "HF_HUB_OFFLINE": "1",  # the kernel hub's route: answered without waiting on the network
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    done = subprocess.run(
        [str(SETUP_GPU), "--use-installed-torch", "--venv", str(venv)],
        capture_output=True, text=True, env=env, timeout=1500,
    )  # fmt: skip
    said = [line for line in done.stderr.splitlines() if line.startswith("setup-gpu: ")]
    assert done.returncode == 0, done.stderr[-4000:]
    assert said[1] == f"setup-gpu: torch {pin}+cu132 (CUDA 13.2) is installed: keeping it", said
    plans = node_setup.choose_kernels(node_setup.read_gpus(H100), "13.2")
    assert {plan.name for plan in plans} >= {"flash", "flash3"}, plans
    for plan in plans:
        (line,) = [line for line in said if line.startswith(f"setup-gpu: {plan.label}: ")]
        assert ": not installed (" in line, line
    kept = f"setup-gpu: kept torch {pin}+cu132 (CUDA 13.2); attention kernels sdpa (no flash kernel: "
    assert said[-1].startswith(kept), said
    listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True, check=True)
    installed = {row["name"].lower(): row["version"] for row in json.loads(listed.stdout)}
    assert installed["torch"] == pin, "a later install moved the venv's torch"
    for package in ("autotune", "deepspeed", "transformers", "optuna", "pytest", "kernels"):
        assert package in installed, (package, sorted(installed))


def _function(source: str, name: str) -> tuple[inspect.Signature, str]:
    """Top-level function ``name`` of module text ``source``: its signature (annotations as written, strings) and
    docstring, read from the text (importing the module would need its dependencies)."""
    (function,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == name]
    docstring = ast.get_docstring(function) or ""
    function.body, function.decorator_list = [ast.Pass()], []
    module = ast.Module([ast.ImportFrom("__future__", [ast.alias("annotations")], 0), function], [])
    namespace: dict = {}
    exec(compile(ast.fix_missing_locations(module), name, "exec"), namespace)
    return inspect.signature(namespace[name]), docstring


def _call(source: str, name: str) -> ast.Call:
    """The one call of ``name`` in ``source``."""
    (call,) = [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == name]
    return call


def _bind(signature: inspect.Signature, call: ast.Call) -> None:
    """Binds ``call``'s arguments (positional and keyword, placeholders for their values) to ``signature``."""
    signature.bind(*(f"arg{i}" for i in range(len(call.args))), **{kw.arg: 1 for kw in call.keywords})


@pytest.fixture(scope="module")
def kernels_release(tmp_path_factory) -> Path:
    """The ``kernels`` release setup-gpu installs, really installed (from the index, without its dependencies) into
    a folder of its own: its package folder."""
    target = tmp_path_factory.mktemp("kernels-release")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary", ":all:", "--target",
         str(target), node_setup.KERNELS_PACKAGE],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return target / "kernels"


def test_the_hub_routes_calls_bind_to_the_pinned_kernels_release(kernels_release):
    """setup-gpu's ``install_kernel(repo, version=N)`` and the registry's ``get_local_kernel(folder)`` bind to the
    real signatures of the ``kernels`` release setup-gpu pins, both exported by the package, and ``install_kernel``
    returns the variant folder's path, which setup-gpu copies (``install_from_hub``)."""
    from trials.kernels import registry

    pinned = Requirement(node_setup.KERNELS_PACKAGE).specifier
    assert [spec.operator for spec in pinned] == ["=="], f"setup-gpu installs {node_setup.KERNELS_PACKAGE}, unpinned"
    exported = {
        alias.name
        for node in ast.parse((kernels_release / "__init__.py").read_text()).body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    assert {"install_kernel", "get_local_kernel"} <= exported, sorted(exported)
    install_kernel, documented = _function((kernels_release / "install.py").read_text(), "install_kernel")
    _bind(install_kernel, _call(node_setup._FETCH, "install_kernel"))
    assert install_kernel.return_annotation == "Path", install_kernel
    assert "`Path`: The path to the variant directory." in documented, documented
    get_local_kernel, _ = _function((kernels_release / "load.py").read_text(), "get_local_kernel")
    _bind(get_local_kernel, _call(inspect.getsource(registry._load_hub_kernel), "get_local_kernel"))


def _index_has_a_wheel(requirement: str, scratch: Path) -> dict | None:
    """What the package index serves for ``requirement`` as a wheel (pip's install report of it, its dependencies
    left out), None when it serves none."""
    report = scratch / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--no-deps",
         "--only-binary", ":all:", "--report", str(report), requirement],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return json.loads(report.read_text())["install"][0] if done.returncode == 0 else None


def test_every_kernel_requirement_setup_gpu_issues_is_served_as_a_wheel_where_the_registry_says_so(tmp_path):
    """The requirements setup-gpu gives pip for kernels on every GPU generation a kernel runs on, on CUDA 12 and 13
    (``choose_kernels``, as setup-gpu derives them) and the hub route's ``kernels``, asked of the real index: each
    wheel route a kernel declares PyPI serves (``pypi_wheel``) resolves to a wheel that provides its extras, each it
    declares PyPI does not serve finds none; the source route needs a build, so it is not asked for a wheel."""
    majors = sorted({major for name in FLASH_KERNELS for major in KERNELS[name].compute_capabilities})
    served = {node_setup.KERNELS_PACKAGE: True}  # requirement: whether PyPI serves a wheel of it
    built, planned = set(), set()
    for build in node_setup.CUDA_BUILDS:
        for major in majors:
            gpus = node_setup.read_gpus(f"GPU, {major}.0, {build.min_driver}.00.00\n")
            for plan in node_setup.choose_kernels(gpus, build.cuda):
                planned.add(plan.name)
                if "wheel" in plan.routes:
                    served[plan.requirement] = KERNELS[plan.name].pypi_wheel
                if "source" in plan.routes:
                    built.add(plan.requirement)
    assert planned == set(FLASH_KERNELS), planned
    assert built == {node_setup.FLASH_ATTN}, built  # flash-attn's source build: PyPI has its sdist only
    found = {requirement: _index_has_a_wheel(requirement, tmp_path) for requirement in served}
    assert {requirement: report is not None for requirement, report in found.items()} == served
    for requirement, report in found.items():
        if report is not None:
            extras = Requirement(requirement).extras
            assert extras <= set(report["metadata"].get("provides_extra", [])), (requirement, report["metadata"])
