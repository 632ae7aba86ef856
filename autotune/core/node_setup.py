"""What ``bin/setup-gpu`` does on a GPU node: which torch it keeps or installs, which attention kernels it installs and
from where, and what it says. ``bin/setup-gpu`` checks the driver, creates ``.venv`` and runs ``main`` with the venv's
Python before anything is installed in it, so this module needs the standard library and the kernel declarations
(``trials.kernels.registry``, which imports nothing else) only.

torch. ``--use-installed-torch`` keeps the CUDA torch already in the venv (inside pyproject's range; pip then installs
everything with it pinned, so nothing moves it). Otherwise torch is ``constraints-gpu.txt``'s version, in the CUDA
build the driver runs (``CUDA_BUILDS``: CUDA 13 from PyPI on drivers 580 and newer, CUDA 12.8 from PyTorch's index
on older ones).

Kernels. Each flash kernel the node's oldest GPU generation runs (``AttentionKernel.runs_on``) is tried by its routes
in order (``AttentionKernel.routes``: the kernel hub's prebuilt build, a wheel, flash-attn's source build last),
and each one installed is kept only when ``trials.kernels.attention.check_kernel`` passes: the exact calls the stack
makes, forward and backward, against SDPA. A kernel no route gives is left out with one line saying why and how to
get it (``AttentionKernel.how_to_build``).

Offline. ``--wheels DIR`` installs from DIR only (``pip --no-index --find-links DIR``) and takes hub builds from
``DIR/kernels/<kernel>/`` (docs/guide.md gives the commands that fill DIR on a machine with access).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from trials.kernels.registry import FLASH_KERNELS, KERNELS, hub_kernel_dir

ROOT = Path(__file__).resolve().parents[2]
FLASH_ATTN = "flash-attn>=2.7"  # the `gpu` extra's floor: upipe uses _wrapped_flash_attn_forward/_backward
# the kernel hub's client, the release whose API the hub route calls: install_kernel(repo_id, *, version=...) -> Path
# (kernels/install.py), and get_local_kernel(repo_path) that trials load hub builds with (kernels/load.py); both
# calls are bound to that release's signatures in tests/test_gpu_install.py
KERNELS_PACKAGE = "kernels==0.17.2"


class SetupError(Exception):
    """A node this set-up cannot serve as asked: one line, exit 1."""


@dataclass(frozen=True)
class CudaBuild:
    """A CUDA build of torch: the driver it needs and the index that serves it."""

    cuda: str
    min_driver: int  # the driver's major version
    index_url: str | None  # None: PyPI's own Linux x86_64 wheel
    source: str


# Newest first: the first one the driver runs is installed.
CUDA_BUILDS = (
    CudaBuild(
        "13.2",
        580,
        None,
        "PyPI's Linux x86_64 torch 2.11-2.15 wheels require cuda-toolkit 13.x (their metadata; 2.15.0: 13.2.2); "
        "CUDA 13.x runs on drivers 580 and newer (NVIDIA's CUDA 13.0 release notes, minor-version compatibility)",
    ),
    CudaBuild(
        "12.8",
        525,
        "https://download.pytorch.org/whl/cu128",
        "PyTorch's CUDA 12.8 index; CUDA 12.x runs on drivers 525 and newer through minor-version compatibility "
        "(NVIDIA's CUDA compatibility guide)",
    ),
)


@dataclass(frozen=True)
class Gpu:
    name: str
    capability: tuple[int, int]
    driver: str

    @property
    def driver_major(self) -> int:
        return int(self.driver.split(".")[0])


NVIDIA_SMI_QUERY = ["nvidia-smi", "--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader"]


def read_gpus(text: str) -> tuple[Gpu, ...]:
    """The GPUs in ``NVIDIA_SMI_QUERY``'s output ("NVIDIA H100 80GB HBM3, 9.0, 580.65.06" per line)."""
    gpus = []
    for line in filter(None, (line.strip() for line in text.splitlines())):
        name, capability, driver = (part.strip() for part in line.rsplit(",", 2))
        major, minor = capability.split(".")
        gpus.append(Gpu(name, (int(major), int(minor)), driver))
    if not gpus:
        raise SetupError("nvidia-smi lists no GPU")
    return tuple(gpus)


def release(version: str) -> tuple[int, ...]:
    """A version's release numbers: "2.13.0+cu130" -> (2, 13, 0)."""
    return tuple(int(part) for part in re.match(r"\d+(\.\d+)*", version).group(0).split("."))


def torch_range(root: Path = ROOT) -> tuple[str, str]:
    """pyproject.toml's torch range: (lowest, first release above it), from its ``torch>=A,<B``."""
    found = re.search(r'"torch>=([\d.]+),<([\d.]+)"', (root / "pyproject.toml").read_text())
    if not found:
        raise SetupError("pyproject.toml declares no torch>=A,<B range")
    return found.group(1), found.group(2)


def torch_pin(root: Path = ROOT) -> str:
    """The torch version constraints-gpu.txt pins."""
    found = re.search(r"^torch==(\S+)\s*$", (root / "constraints-gpu.txt").read_text(), flags=re.M)
    if not found:
        raise SetupError("constraints-gpu.txt pins no torch")
    return found.group(1)


def cuda_build_for(driver_major: int) -> CudaBuild | None:
    """The newest CUDA build of torch a driver of this major version runs (None: too old for any)."""
    return next((build for build in CUDA_BUILDS if driver_major >= build.min_driver), None)


@dataclass(frozen=True)
class TorchChoice:
    keep: bool
    version: str  # kept: the installed one (local label included); else the pin
    cuda: str
    index_url: str | None  # where pip gets it (None: the default index, or the wheel folder)
    line: str  # what setup-gpu says about it


def choose_torch(
    gpus: tuple[Gpu, ...],
    installed: tuple[str, str | None] | None,
    use_installed: bool,
    pin: str,
    allowed: tuple[str, str],
) -> TorchChoice:
    """Which torch the node gets: ``installed`` ((version, CUDA version or None), None: no torch in the venv) kept
    when ``use_installed``; else ``pin`` in the CUDA build the oldest driver runs."""
    driver = min(gpu.driver_major for gpu in gpus)
    low, above = allowed
    if use_installed:
        if installed is None:
            raise SetupError("--use-installed-torch: the venv has no torch (install a CUDA torch into it first)")
        version, cuda = installed
        if not cuda:
            raise SetupError(f"--use-installed-torch: torch {version} in the venv is a CPU build")
        if not release(low) <= release(version) < release(above):
            raise SetupError(f"--use-installed-torch: torch {version} is outside autotune's range (>={low},<{above})")
        build = cuda_build_for(driver)
        if build is None or release(cuda)[0] > release(build.cuda)[0]:
            raise SetupError(f"torch {version} is built with CUDA {cuda}, which driver {driver} does not run")
        return TorchChoice(True, version, cuda, None, f"torch {version} (CUDA {cuda}) is installed: keeping it")
    build = cuda_build_for(driver)
    if build is None:
        oldest = CUDA_BUILDS[-1]
        raise SetupError(f"driver {driver} is older than any CUDA build of torch {pin} needs ({oldest.min_driver})")
    where = f"from {build.index_url}" if build.index_url else "from PyPI"
    line = f"torch {pin}: installing its CUDA {build.cuda} build {where} (driver {driver})"
    return TorchChoice(False, pin, build.cuda, build.index_url, line)


@dataclass(frozen=True)
class KernelPlan:
    name: str
    label: str  # "FlashAttention-3 (attention: flash3)"
    routes: tuple[str, ...]
    requirement: str  # what pip installs for the wheel and source routes


def choose_kernels(gpus: tuple[Gpu, ...], cuda: str) -> tuple[KernelPlan, ...]:
    """The flash kernels the node's oldest GPU generation runs, each with its routes and its pip requirement for
    torch's CUDA version."""
    major = min(gpu.capability[0] for gpu in gpus)
    cuda_major = release(cuda)[0]
    plans = []
    for name in FLASH_KERNELS:
        kernel = KERNELS[name]
        if not kernel.runs_on(major):
            continue
        requirement = FLASH_ATTN if kernel.name == "flash" else kernel.requirement(cuda_major)
        label = f"{kernel.description.split(' (')[0]} (attention: {name})"
        plans.append(KernelPlan(name, label, kernel.routes(), requirement))
    return tuple(plans)


# -- doing it --------------------------------------------------------------------------------------------------------


def say(line: str) -> None:
    print(f"setup-gpu: {line}", file=sys.stderr, flush=True)


@dataclass
class Node:
    """The venv being set up and how pip reaches packages."""

    python: Path
    wheels: Path | None
    constraints: Path
    log: list[str] = field(default_factory=list)

    def run(self, *args: str, quiet: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.python), *args],
            capture_output=quiet,
            text=True,
            env={**os.environ, **(env or {})},
        )

    def pip(self, *args: str, quiet: bool = True) -> bool:
        offline = ["--no-index", "--find-links", str(self.wheels)] if self.wheels else []
        done = self.run("-m", "pip", "install", "--quiet", "-c", str(self.constraints), *offline, *args, quiet=quiet)
        return done.returncode == 0

    def uninstall(self, package: str) -> None:
        self.run("-m", "pip", "uninstall", "--quiet", "-y", package)

    def torch_distribution_version(self) -> str | None:
        """The venv's torch as pip compares it: its distribution's metadata version (PyPI's CUDA wheel says 2.15.0
        where ``torch.__version__`` says 2.15.0+cu132); None: no torch distribution."""
        done = self.run("-c", "import importlib.metadata as metadata; print(metadata.version('torch'))")
        return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else None

    def installed_torch(self) -> tuple[str, str | None] | None:
        done = self.run("-c", "import json, torch; print(json.dumps([torch.__version__, torch.version.cuda]))")
        if done.returncode != 0:
            return None
        version, cuda = json.loads(done.stdout.strip().splitlines()[-1])
        return version, cuda

    def torch_sees_a_gpu(self) -> bool:
        return self.run("-c", "import sys, torch; sys.exit(not torch.cuda.is_available())").returncode == 0


_CHECK = "import sys; from trials.kernels.attention import check_kernel; print(check_kernel(sys.argv[1]))"


def check(node: Node, name: str) -> tuple[bool, str]:
    """``check_kernel`` in the venv: (passed, its line or the cause)."""
    done = node.run("-c", _CHECK, name)
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, lines[-1] if lines else f"exit {done.returncode}"


# Fetches kernel ``repo``'s hub build for this torch and CUDA into the HF cache and prints its variant folder.
_FETCH = "import sys; from kernels import install_kernel; print(install_kernel(sys.argv[1], version=int(sys.argv[2])))"


def install_from_hub(node: Node, name: str) -> str | None:
    """Kernel ``name``'s hub build into the venv (``hub_kernel_dir``); None, else why not."""
    hub = KERNELS[name].hub
    target = hub_kernel_dir(name, node.python.parent.parent)
    shutil.rmtree(target, ignore_errors=True)
    if node.wheels:
        folder = node.wheels / "kernels" / name
        if not (folder / "build").is_dir():
            return f"no {folder}/build in the wheel folder"
        shutil.copytree(folder, target)
        return None
    done = node.run("-c", _FETCH, hub.repo, str(hub.version))
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        return f"{hub.repo}: {lines[-1] if lines else 'the download failed'}"
    variant = Path(done.stdout.strip().splitlines()[-1])
    shutil.copytree(variant, target / "build" / variant.name)
    return None


def set_up_torch(node: Node, choice: TorchChoice, installed: tuple[str, str | None] | None) -> None:
    """Installs ``choice``'s torch unless it is kept (``installed``: what the venv had), then pins the venv's torch
    in ``node.constraints`` for every later install: its distribution's version exactly, which is what pip compares
    (a pin on ``torch.__version__``'s local label, 2.15.0+cu132, matches no distribution PyPI serves)."""
    if not choice.keep:
        node.constraints.write_text(f"torch=={choice.version}\n")  # the pin, any build of it
        if installed is not None and (not installed[1] or release(installed[1])[0] != release(choice.cuda)[0]):
            node.uninstall("torch")  # a CPU or other-CUDA build also satisfies torch==PIN: pip would keep it
        index = ["--index-url", choice.index_url] if choice.index_url and not node.wheels else []
        if not node.pip(*index, f"torch=={choice.version}", quiet=False):
            raise SetupError(f"pip could not install torch {choice.version} (its output above)")
        now = node.installed_torch()
        if now is None or not now[1]:
            raise SetupError("pip installed a CPU build of torch: is a +cpu wheel on your index or find-links?")
    version = node.torch_distribution_version()
    if version is None:
        raise SetupError("torch imports in the venv but pip sees no torch distribution there (reinstall it with pip)")
    node.constraints.write_text(f"torch=={version}\n")


def build_flash_attn(node: Node, gpus: tuple[Gpu, ...], cuda: str) -> str | None:
    """flash-attn's source build (the last resort): None when it built, else why not."""
    nvcc = Path(os.environ["CUDA_HOME"], "bin", "nvcc") if os.environ.get("CUDA_HOME") else None
    nvcc = nvcc or Path(shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc")
    if not os.access(nvcc, os.X_OK):
        return f"its source build needs the CUDA {cuda} toolkit's nvcc: put its bin/ on PATH or set CUDA_HOME"
    version = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True).stdout
    found = re.search(r"release ([\d.]+),", version)
    if not found or found.group(1).split(".")[0] != cuda.split(".")[0]:
        return f"{nvcc} is CUDA {found.group(1) if found else '?'} but torch is built with CUDA {cuda}"
    archs = sorted({f"{gpu.capability[0]}0" for gpu in gpus})
    if any(arch not in ("80", "90", "100", "120") for arch in archs):
        return f"compute capability {min(g.capability for g in gpus)}: flash-attn 2 builds for 8.0 and newer"
    # nvcc jobs take up to ~9 GB each (flash-attn's setup.py): min(cores / 2, available GiB / 9)
    available = int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) // 2**20
    env = {
        "CUDA_HOME": os.environ.get("CUDA_HOME", str(nvcc.resolve().parent.parent)),
        "FLASH_ATTN_CUDA_ARCHS": os.environ.get("FLASH_ATTN_CUDA_ARCHS", ";".join(archs)),
        "MAX_JOBS": os.environ.get("MAX_JOBS", str(max(1, min((os.cpu_count() or 2) // 2, available // 9)))),
        # no download of a prebuilt wheel from GitHub releases (none for every torch; offline nodes would wait)
        "FLASH_ATTENTION_FORCE_BUILD": "TRUE",
    }
    say(
        f"flash-attn: compiling for sm {env['FLASH_ATTN_CUDA_ARCHS']} with MAX_JOBS={env['MAX_JOBS']} (tens of minutes)"
    )
    # --no-build-isolation: its setup.py imports torch, which pip's isolated build environment lacks
    node.pip("setuptools", "wheel", "packaging", "psutil", "ninja")
    offline = ["--no-index", "--find-links", str(node.wheels)] if node.wheels else []
    done = node.run(
        "-m", "pip", "install", "-c", str(node.constraints), *offline,
        "--no-build-isolation", "--no-binary", "flash-attn", FLASH_ATTN,
        quiet=False, env=env,
    )  # fmt: skip
    return None if done.returncode == 0 else "its source build failed (pip's output above)"


def install_kernel(node: Node, plan: KernelPlan, gpus: tuple[Gpu, ...], cuda: str, has_hub: bool) -> str:
    """Tries ``plan``'s routes in order, keeping the first whose kernel passes ``check``; returns its line."""
    kernel = KERNELS[plan.name]
    tried = []
    for route in plan.routes:
        if route == "hub":
            if not has_hub:
                tried.append("hub: the kernels package is not installed")
                continue
            why = install_from_hub(node, plan.name)
            where = f"from the kernel hub ({kernel.hub.repo})"
        elif route == "wheel":
            why = None if node.pip("--only-binary", kernel.package, plan.requirement) else "no wheel on the index"
            where = f"{plan.requirement} (wheel)"
        else:
            why = build_flash_attn(node, gpus, cuda)
            where = f"{plan.requirement} (source build)"
        if why is None:
            passed, line = check(node, plan.name)
            if passed:
                return f"{plan.label}: {where}: {line}"
            why = f"installed, but {line}"
            if route == "hub":
                shutil.rmtree(hub_kernel_dir(plan.name, node.python.parent.parent), ignore_errors=True)
            else:
                node.uninstall(kernel.package)  # never a half install: trials would pick it up and fail
        elif route != "hub":
            node.uninstall(kernel.package)
        tried.append(f"{route}: {why}")
    how = f": {kernel.how_to_build}" if kernel.how_to_build else ""
    return f"{plan.label}: not installed ({'; '.join(tried)}){how}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # bad input: one line, exit 2
        self.exit(2, f"setup-gpu: error: {message} (bin/setup-gpu --help)\n")


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="bin/setup-gpu", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument(
        "--use-installed-torch", action="store_true", help="keep the venv's CUDA torch (inside pyproject's range)"
    )
    parser.add_argument("--wheels", type=Path, help="install offline, from this folder only (see docs/guide.md)")
    parser.add_argument("--venv", type=Path, default=ROOT / ".venv")
    args = parser.parse_args(argv)
    if args.wheels and not args.wheels.is_dir():
        print(f"setup-gpu: error: --wheels {args.wheels}: not a folder", file=sys.stderr)
        return 2
    try:
        return _set_up(args)
    except SetupError as error:
        print(f"setup-gpu: error: {error}", file=sys.stderr)
        return 1


def _set_up(args) -> int:
    smi = subprocess.run(NVIDIA_SMI_QUERY, capture_output=True, text=True)
    if smi.returncode != 0:
        raise SetupError("nvidia-smi fails: is the NVIDIA driver loaded?")
    gpus = read_gpus(smi.stdout)
    caps = sorted({f"{gpu.capability[0]}.{gpu.capability[1]}" for gpu in gpus})
    say(f"found {len(gpus)} x {gpus[0].name} (compute capability {', '.join(caps)}, driver {gpus[0].driver})")
    with tempfile.TemporaryDirectory() as scratch:
        constraints = Path(scratch, "constraints.txt")
        node = Node(args.venv / "bin" / "python", args.wheels, constraints)
        installed = node.installed_torch()
        choice = choose_torch(gpus, installed, args.use_installed_torch, torch_pin(), torch_range())
        say(choice.line)
        set_up_torch(node, choice, installed)  # every install from here on runs with the venv's torch pinned
        if not node.torch_sees_a_gpu():
            raise SetupError(
                f"torch (CUDA {choice.cuda}) sees no GPU: the driver must support CUDA {choice.cuda} "
                "(nvidia-smi's header shows what it supports)"
            )
        if not node.pip("-e", f"{ROOT}[test]", quiet=False):
            raise SetupError("pip could not install autotune and its dependencies (its output above)")
        plans = choose_kernels(gpus, choice.cuda)
        has_hub = any("hub" in plan.routes for plan in plans) and node.pip(KERNELS_PACKAGE)
        lines = [install_kernel(node, plan, gpus, choice.cuda, has_hub) for plan in plans]
    for line in lines:
        say(line)
    kept = [plan.name for plan, line in zip(plans, lines) if ": not installed (" not in line]
    torch_said = f"{'kept' if choice.keep else 'installed'} torch {choice.version} (CUDA {choice.cuda})"
    kernels_said = f"attention kernels {', '.join(['sdpa', *kept])}"
    if not kept:
        kernels_said += " (no flash kernel: trials and searches fall back to torch's SDPA)"
    say(f"{torch_said}; {kernels_said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
