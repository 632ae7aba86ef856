"""bin/setup-gpu's default path on a fresh clone, rehearsed on a CPU machine against the real package index.

What stands in for the node: an ``nvidia-smi`` on PATH that answers as an H100 with driver 580 does, and a
``sitecustomize`` that tells the venv's torch it sees a GPU (``torch.cuda.is_available()`` answers True). Everything
else is real: the fresh clone of HEAD, pip, the index, PyPI's CUDA 13.2 torch (about 6 GB installed), autotune's
test extra, ``kernels``, each kernel's routes. No kernel can pass ``check_kernel`` without a GPU, so each is left out
with one line; the hub is offline here and the CUDA toolkit hidden (``CUDA_HOME`` names no folder), so no route
waits on the network or starts a source build of tens of minutes. Prints setup-gpu's own lines (pip's are counted,
not shown), its exit code, and what the venv holds after it.

    .venv/bin/python bench/setup_gpu_rehearsal.py > bench/results/setup_gpu_rehearsal.txt
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NVIDIA_SMI = """#!/bin/sh
for a in "$@"; do case "$a" in --query-gpu=*) printf 'NVIDIA H100 80GB HBM3, 9.0, 580.65.06\\n'; exit 0;; esac; done
echo "NVIDIA-SMI 580.65.06  Driver Version: 580.65.06  CUDA Version: 13.2"
"""
# torch.cuda.is_available() answers True: the module is patched as it loads, so nothing imports torch early
SEES_A_GPU = """import importlib.abc, importlib.machinery, sys


class _SeesAGpu(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torch.cuda":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None:
            return None
        loader = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                module.is_available = lambda: True

        spec.loader = Loader()
        return spec


sys.meta_path.insert(0, _SeesAGpu())
"""


def main() -> int:
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    with tempfile.TemporaryDirectory(prefix="setup-gpu-rehearsal-") as scratch:
        scratch = Path(scratch)
        clone = scratch / "autotune"
        subprocess.run(["git", "clone", "--quiet", str(REPO), str(clone)], check=True)
        tools, site = scratch / "tools", scratch / "site"
        tools.mkdir()
        site.mkdir()
        (tools / "nvidia-smi").write_text(NVIDIA_SMI)
        (tools / "nvidia-smi").chmod(0o755)
        (site / "sitecustomize.py").write_text(SEES_A_GPU)
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "CUDA_HOME")},
            "PATH": f"{tools}:{os.environ['PATH']}",
            "PYTHONPATH": str(site),
            "CUDA_HOME": str(scratch / "no-cuda-toolkit"),
            "HF_HUB_OFFLINE": "1",
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        }
        print(
            f"# bin/setup-gpu on a fresh clone of {head.stdout.strip()}: an H100 with driver 580 (nvidia-smi stood in),"
        )
        print("# torch told it sees a GPU; pip, the index and every package real; the hub offline, no nvcc")
        start = time.monotonic()
        done = subprocess.run([str(clone / "bin" / "setup-gpu")], capture_output=True, text=True, env=env)
        wall = time.monotonic() - start
        lines = (done.stdout + done.stderr).splitlines()
        said = [line for line in lines if line.startswith("setup-gpu: ")]
        print("\n".join(said))
        print(
            f"# exit {done.returncode} after {wall:.0f} s; pip and the builds printed {len(lines) - len(said)} more lines"
        )
        if done.returncode != 0:
            print("\n".join(lines[-40:]))
            return 1
        python = str(clone / ".venv" / "bin" / "python")
        listed = subprocess.run([python, "-m", "pip", "list", "--format=json"], capture_output=True, text=True)
        installed = {row["name"].lower(): row["version"] for row in json.loads(listed.stdout)}
        for name in ("torch", "autotune", "deepspeed", "transformers", "optuna", "kernels", "flash-attn-4"):
            print(f"{name:14s} {installed.get(name, 'not installed')}")
        cuda = subprocess.run([python, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
                              capture_output=True, text=True, env={**os.environ, "PYTHONPATH": ""})  # fmt: skip
        version, cuda_version = cuda.stdout.split()
        print(f"the venv imports torch {version}, built with CUDA {cuda_version}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
