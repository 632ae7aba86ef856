"""Attention kernels: one declaration per kernel the ``attention`` knob can name.

Each ``AttentionKernel`` says what a kernel is as far as trials, the oracle, the search and the exports care: the
GPU generations it runs on, where its Python entry points live, its tensor layout, the PyPI distribution that
installs it, and the name each trainer knows it by. Everything else (whether it is installed here, which kernels a
hardware preset offers, what an export writes) derives from these declarations.

A flash kernel has three entry points (``EntryPoints``), each ``"module:attribute"``: the autograd function of a
whole layer, and the low-level forward (returning the logsumexp) and backward (taking it) that head-chunked
attention drives. How each is called (argument names and forms) is code, in ``trials.kernels.attention``. The names and
signatures are those of Dao-AILab/flash-attention at commit 0251105a2fb19d2957484b7f023cd8c115286ced:
    FA2  flash_attn/flash_attn_interface.py  flash_attn_func (l. 1156), _flash_attn_forward (l. 85, exported as
         _wrapped_flash_attn_forward), _flash_attn_backward (l. 253, _wrapped_flash_attn_backward)
    FA3  hopper/flash_attn_interface.py      flash_attn_func (l. 809), _flash_attn_forward (l. 60),
         _flash_attn_backward (l. 259)
    FA4  flash_attn/cute/interface.py        flash_attn_func (l. 3371), _flash_attn_fwd (l. 521), _flash_attn_bwd (l. 1807)

How a node gets each kernel (``bin/setup-gpu``, ``autotune.core.node_setup``) is declared here too, once per kernel,
in the order it is tried (``routes``), each route with the same three entry points:
    hub     a prebuilt binary from the Hugging Face kernel hub (PyPI ``kernels``: ``get_kernel(repo, version=...)``,
            what ``transformers`` loads for ``attn_implementation="kernels-community/..."``); ``bin/setup-gpu`` copies
            the build for this torch and CUDA into the venv (``hub_kernel_dir``), and trials load it from there
            (``kernels.get_local_kernel``), never from the network
    wheel   a PyPI distribution installed as a wheel (FA4: pure Python + JIT, ``[cu13]`` extra on CUDA 13)
    source  flash-attn's source build: the last resort, needs the CUDA toolkit
A hub kernel's entry points are the pip package's, relative to the hub module: ``flash_attn_interface:NAME`` is
``get_kernel(repo).flash_attn_interface.NAME`` (kernels-community/flash-attn2 and flash-attn3 export the same
``flash_attn_interface`` module, with the same signatures, as flash-attention's ``flash_attn/`` and ``hopper/``).

Nothing here imports torch or a kernel package at import time: detection imports lazily.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EntryPoints:
    """A flash kernel's Python entry points, each ``"module:attribute"``."""

    layer: str  # autograd function of a whole layer: (q, k, v, ...) -> out (FA3 / FA4 may return (out, lse))
    forward: str  # low-level forward: (out, softmax_lse, ...) without autograd
    backward: str  # low-level backward: takes softmax_lse back, gives dq, dk, dv
    # autograd function of a whole layer over packed documents (``cu_seqlens``; q/k/v [tokens, heads, dim]); "":
    # packed documents run one kernel call per document (FA3 / FA4 have varlen entry points too: declared once the
    # oracle sizes their varlen buffers, ``autotune.oracle.fake_world``)
    varlen: str = ""

    def resolve(self, which: str):
        """The entry point ``which`` ("layer" | "forward" | "backward" | "varlen"), imported."""
        if not getattr(self, which):
            raise ImportError(f"no {which!r} entry point is declared")
        module, attribute = getattr(self, which).split(":")
        imported = importlib.import_module(module)
        try:
            return getattr(imported, attribute)
        except AttributeError:
            if getattr(imported, "__file__", None) is not None:
                raise  # the package is there, without this entry point
            # a namespace package: only another distribution's subpackages (flash-attn-4 installs flash_attn/cute/
            # and no flash_attn/__init__.py), so the package that provides this entry point is not installed
            where = ", ".join(getattr(imported, "__path__", ()))
            raise ModuleNotFoundError(
                f"{module!r} is a namespace package here ({where}) without {attribute!r}", name=module
            ) from None

    def resolve_in(self, root, which: str):
        """The entry point ``which`` inside the loaded hub kernel module ``root`` (``module`` relative to it)."""
        if not getattr(self, which):
            raise ImportError(f"no {which!r} entry point is declared")
        module, attribute = getattr(self, which).split(":")
        for part in filter(None, module.split(".")):
            root = getattr(root, part)
        return getattr(root, attribute)


@dataclass(frozen=True)
class HubKernel:
    """A prebuilt kernel on the Hugging Face kernel hub (``kernels.get_kernel(repo, version=version)``)."""

    repo: str  # e.g. "kernels-community/flash-attn3"
    version: int  # the kernel's API version (a ``v<N>`` branch on the hub)
    entry_points: EntryPoints  # relative to the loaded module: ``flash_attn_interface:_flash_attn_forward``


HUB_KERNELS_DIR = Path("share", "autotune", "kernels")  # under the venv (sys.prefix): where setup-gpu puts hub builds


def hub_kernel_dir(name: str, prefix: str | Path | None = None) -> Path:
    """Where ``bin/setup-gpu`` puts kernel ``name``'s hub build for the venv at ``prefix`` (this one's: sys.prefix):
    a kernel repository folder (``build/<variant>/``) that ``kernels.get_local_kernel`` loads."""
    return Path(prefix or sys.prefix) / HUB_KERNELS_DIR / name


@dataclass(frozen=True)
class HeadDims:
    """The head dims a kernel runs on some GPU generations: q/k's and v's both at most ``up_to`` (and multiples of
    ``multiple``), or one of the ``pairs`` (q/k head dim, v head dim) beyond that."""

    majors: tuple[int, ...]  # CUDA compute-capability majors this applies to
    up_to: int
    pairs: tuple[tuple[int, int], ...] = ()
    multiple: int = 8  # 16 bytes of fp16/bf16: flash kernels' alignment
    source: str = ""

    def allows(self, head_dim: int, head_dim_v: int) -> bool:
        if (head_dim, head_dim_v) in self.pairs:
            return True
        return all(8 <= d <= self.up_to and d % self.multiple == 0 for d in (head_dim, head_dim_v))

    def describe(self) -> str:
        pairs = "".join(f" or {p}" for p in self.pairs)
        return f"head dims up to {self.up_to} (multiples of {self.multiple}){pairs}"


@dataclass(frozen=True)
class NoSoftcap:
    """Where a kernel cannot softcap attention logits in training (forward or backward): on these GPU generations,
    for these (q/k, v) head dims (None: any)."""

    majors: tuple[int, ...]
    head_dims: tuple[int, int] | None = None
    source: str = ""

    def applies(self, major: int, head_dim: int, head_dim_v: int) -> bool:
        return major in self.majors and (self.head_dims is None or self.head_dims == (head_dim, head_dim_v))


@dataclass(frozen=True)
class AttentionKernel:
    name: str  # the ``attention`` knob's value
    description: str
    layout: str  # "bshd" (flash-attn's [batch, seq, heads, dim]) | "bhsd" (torch SDPA's)
    module: str | None  # the Python module of its entry points (None: torch itself)
    package: str | None  # what installs it (``bin/setup-gpu``); None: ships with torch
    compute_capabilities: tuple[int, ...]  # CUDA compute-capability majors it runs on; () = any device, CPU too
    hf_implementation: str  # transformers' ``attn_implementation`` (what DeepSpeed/Accelerate/ArcticTraining pass)
    entry_points: EntryPoints | None = None  # None: torch's own ops
    head_dims: tuple[HeadDims, ...] = ()  # per GPU generation; a generation not named: no limit known
    no_softcap: tuple[NoSoftcap, ...] = ()  # where a softcap cannot train (the flash kernels softcap elsewhere)
    hub: HubKernel | None = None  # its prebuilt build on the kernel hub, tried before the wheel
    # the package's extra per CUDA major of torch (FA4 needs ``[cu13]`` on CUDA 13); none: the plain package
    cuda_extras: dict[int, str] = field(default_factory=dict)
    wheel_only: bool = True  # False: a source build is the last resort (flash-attn 2; needs the CUDA toolkit)
    pypi_wheel: bool = False  # PyPI serves a wheel of ``package`` (else the wheel route needs the user's own index)
    # the release of ``package`` the wheel route installs (``package==package_version``); "": the newest pip takes
    package_version: str = ""
    how_to_build: str = ""  # what to do where no route gives it (the search's note and setup-gpu's line say it)

    def requirement(self, cuda_major: int | None) -> str:
        """What pip installs for torch built with CUDA ``cuda_major``: the package, with its extra for that CUDA, at
        its declared ``package_version``."""
        extra = self.cuda_extras.get(cuda_major) if cuda_major is not None else None
        name = f"{self.package}[{extra}]" if extra else str(self.package)
        return f"{name}=={self.package_version}" if self.package_version else name

    def routes(self) -> tuple[str, ...]:
        """How a node gets it, in the order ``bin/setup-gpu`` tries them ("hub", "wheel", "source")."""
        if self.package is None:
            return ()
        return (*(("hub",) if self.hub else ()), "wheel", *(() if self.wheel_only else ("source",)))

    def resolve(self, which: str):
        """Entry point ``which`` as this process has it: the pip package's module, else the hub build that
        ``bin/setup-gpu`` put into this venv (``hub_kernel_dir``). The pip package counts as absent when its module
        is not found, is a namespace package without it (``EntryPoints.resolve``), or lacks the entry point (an
        AttributeError): the hub build then serves, where there is one.

        Resolved once per process (``_resolved``): the stack calls it on every attention call of every layer, and a
        lookup tries imports and checks the filesystem. A failure is not kept, so an entry point installed later
        resolves on the next call; ``forget_resolved`` drops what was kept (tests that swap packages call it)."""
        key = (self.name, which)
        if key not in _resolved:
            _resolved[key] = self._look_up(which)
        return _resolved[key]

    def _look_up(self, which: str):
        """``resolve``'s lookup, uncached."""
        try:
            return self.entry_points.resolve(which)
        except (ModuleNotFoundError, AttributeError) as missing:
            if self.hub is None or not hub_kernel_dir(self.name).is_dir():
                raise
            try:
                return self.hub.entry_points.resolve_in(_load_hub_kernel(self.name), which)
            except Exception as exc:
                raise ImportError(f"{self.hub.repo} (in {hub_kernel_dir(self.name)}): {exc}") from missing

    def import_error(self) -> Exception | None:
        """The error importing its entry points raises in this process (None: they import; SDPA always does)."""
        if self.entry_points is None:
            return None
        try:
            for which in ("layer", "forward", "backward"):
                self.resolve(which)
        except Exception as exc:  # absent, or present but broken (an ABI mismatch): not usable either way
            return exc
        return None

    def installed(self) -> bool:
        """Whether its entry points import in this process."""
        return self.import_error() is None

    def head_dims_on(self, compute_capability_major: int | None) -> HeadDims | None:
        """The head dims it runs on a GPU of this generation (None: no limit declared, or a CPU)."""
        return next((rule for rule in self.head_dims if compute_capability_major in rule.majors), None)

    def runs_on(self, compute_capability_major: int | None) -> bool:
        """Whether it runs on a GPU of this generation (None: a CPU)."""
        if not self.compute_capabilities:
            return True
        return compute_capability_major in self.compute_capabilities


_hub_modules: dict = {}
_resolved: dict = {}  # (kernel name, "layer" | "forward" | "backward" | "varlen") -> its entry point, resolved


def forget_resolved() -> None:
    """Drop every entry point resolved in this process (``AttentionKernel.resolve``) and every hub build loaded: the
    next call looks each up again (after a test installs or removes a package or a hub build)."""
    _resolved.clear()
    _hub_modules.clear()


def _load_hub_kernel(name: str):
    """Kernel ``name``'s hub build from this venv (loaded once per process; never from the network)."""
    if name not in _hub_modules:
        from kernels import get_local_kernel

        _hub_modules[name] = get_local_kernel(hub_kernel_dir(name))
    return _hub_modules[name]


KERNELS: dict[str, AttentionKernel] = {
    kernel.name: kernel
    for kernel in (
        AttentionKernel(
            "sdpa",
            "torch's scaled_dot_product_attention (its CPU flash kernel; memory-efficient or flash on CUDA)",
            layout="bhsd",
            module=None,
            package=None,
            compute_capabilities=(),
            hf_implementation="sdpa",
        ),
        AttentionKernel(
            "flash",
            "FlashAttention-2 (flash-attn)",
            layout="bshd",
            module="flash_attn",
            package="flash-attn",
            # setup.py l. 74 builds "80;90;100;110;120" by default (Blackwell with CUDA >= 12.8, l. 101-143)
            compute_capabilities=(8, 9, 10, 11, 12),
            hf_implementation="flash_attention_2",
            # csrc/flash_attn/flash_api.cpp l. 416, 868: forward and backward "at most 256"
            head_dims=(HeadDims((8, 9, 10, 11, 12), up_to=256, source="csrc/flash_attn/flash_api.cpp l. 416, 868"),),
            entry_points=EntryPoints(
                "flash_attn:flash_attn_func",
                "flash_attn.flash_attn_interface:_wrapped_flash_attn_forward",  # flash-attn >= 2.7
                "flash_attn.flash_attn_interface:_wrapped_flash_attn_backward",
                "flash_attn:flash_attn_varlen_func",
            ),
            hub=HubKernel(
                "kernels-community/flash-attn2",
                1,
                EntryPoints(
                    ":flash_attn_func",
                    "flash_attn_interface:_wrapped_flash_attn_forward",
                    "flash_attn_interface:_wrapped_flash_attn_backward",
                    ":flash_attn_varlen_func",
                ),
            ),
            wheel_only=False,
            pypi_wheel=False,  # PyPI holds flash-attn's source distribution only: its wheel route needs your index
            how_to_build="bin/setup-gpu builds it from source where the CUDA toolkit of torch's CUDA version is installed",
        ),
        AttentionKernel(
            "flash3",
            "FlashAttention-3 (Hopper; flash-attention's hopper/ package, flash_attn_interface)",
            layout="bshd",
            module="flash_attn_interface",
            package="flash-attn-3",
            compute_capabilities=(9,),  # its sm90a kernels (hopper/setup.py also builds SM8x ones; FA2 serves 8.x)
            hf_implementation="flash_attention_3",
            # hopper/flash_api.cpp l. 494-506: kernels for head dims up to 256
            head_dims=(HeadDims((9,), up_to=256, source="hopper/flash_api.cpp l. 494-506"),),
            entry_points=EntryPoints(
                "flash_attn_interface:flash_attn_func",
                "flash_attn_interface:_flash_attn_forward",
                "flash_attn_interface:_flash_attn_backward",
            ),
            hub=HubKernel(
                "kernels-community/flash-attn3",
                1,
                EntryPoints(
                    ":flash_attn_func",
                    "flash_attn_interface:_flash_attn_forward",
                    "flash_attn_interface:_flash_attn_backward",
                ),
            ),
            pypi_wheel=False,  # PyPI holds no flash-attn-3 release (0.0.0 is yanked): the wheel route needs your index
            how_to_build="build it from flash-attention's hopper/ folder: cd hopper && python setup.py install",
        ),
        AttentionKernel(
            "flash4",
            "FlashAttention-4 (CuTe DSL; flash-attn-4, flash_attn.cute)",
            layout="bshd",
            module="flash_attn.cute",
            package="flash-attn-4",
            # training needs the backward: _flash_attn_bwd asserts ``arch // 10 in [9, 10, 11, 12]``
            # (flash_attn/cute/interface.py l. 1854; the forward also takes 8, l. 681), so Hopper runs it too
            compute_capabilities=(9, 10, 11, 12),
            hf_implementation="flash_attention_4",
            # flash_attn/cute/interface.py _validate_head_dims (l. 112-129), checked on SM90 and SM100/SM110 (l. 684)
            head_dims=(
                HeadDims((9,), up_to=256, source="flash_attn/cute/interface.py l. 119-124"),
                HeadDims(
                    (10, 11),
                    up_to=128,
                    pairs=((192, 128), (256, 256)),
                    source="flash_attn/cute/interface.py l. 125-129",
                ),
            ),
            no_softcap=(
                # the dedicated head-dim-256 kernels of SM100/SM110 (l. 839, 1967) assert no softcap, forward l. 1309
                # and backward l. 2463 (Gemma 2 on B200)
                NoSoftcap((10, 11), (256, 256), source="flash_attn/cute/interface.py l. 1309, 2463"),
                # the backward runs a softcap as a score_mod (l. 2094-2099), which SM 12.x refuses (l. 1913)
                NoSoftcap((12,), None, source="flash_attn/cute/interface.py l. 1913, 2094-2099"),
            ),
            entry_points=EntryPoints(
                "flash_attn.cute:flash_attn_func",
                "flash_attn.cute.interface:_flash_attn_fwd",
                "flash_attn.cute.interface:_flash_attn_bwd",
            ),
            cuda_extras={13: "cu13"},  # flash-attn-4's extra for CUDA 13 (nvidia-cutlass-dsl's CUDA 13 build)
            pypi_wheel=True,  # flash-attn-4 4.0.0b36: py3-none-any (pure Python + CuTe DSL JIT)
            # PyPI's flash-attn-4 release list holds pre-releases only (4.0.0b3 ... 4.0.0b36; 0.0.1 is yanked), which
            # pip takes only when named: the one whose wheel's flash_attn/cute/interface.py has the entry points above
            # (flash_attn_func l. 4145, re-exported by flash_attn/cute/__init__.py; _flash_attn_fwd l. 678;
            # _flash_attn_bwd l. 2241), their signatures in tests/test_kernels.py
            package_version="4.0.0b36",
        ),
    )
}
KERNEL_NAMES = tuple(KERNELS)
FLASH_KERNELS = tuple(name for name, kernel in KERNELS.items() if kernel.layout == "bshd")
# kernels with a varlen whole-layer entry point: packed documents in one call (``cu_seqlens``)
VARLEN_KERNELS = tuple(name for name in FLASH_KERNELS if KERNELS[name].entry_points.varlen)


def this_node_compute_capability() -> int | None:
    """The compute-capability major of this node's first CUDA device (None: no CUDA device)."""
    import torch

    return torch.cuda.get_device_capability(0)[0] if torch.cuda.is_available() else None


def _missing(kernel: AttentionKernel, error: Exception) -> bool:
    """Whether ``error`` says the kernel's package is simply absent (its module, or a parent of it, not found)."""
    name = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    return name is not None and (kernel.module == name or kernel.module.startswith(name + "."))


def broken_import(name: str) -> str | None:
    """The import error of kernel ``name`` when its package is installed but does not import (an ABI mismatch with
    torch, a missing CUDA library); None when it imports or is simply absent."""
    kernel = KERNELS[name]
    error = kernel.import_error()
    return None if error is None or _missing(kernel, error) else f"{type(error).__name__}: {error}"


def install_problem(name: str) -> str | None:
    """Why kernel ``name``'s entry points cannot be used in this process, as a clause naming its package and
    ``bin/setup-gpu`` (None: they import)."""
    kernel = KERNELS[name]
    error = kernel.import_error()
    if error is None:
        return None
    if _missing(kernel, error):
        return f"{kernel.package} is not installed (module {kernel.module}; bin/setup-gpu sets up the GPU kernels)"
    why = f"{type(error).__name__}: {error}"
    return f"{kernel.package} is installed but does not import ({why}; reinstall it with bin/setup-gpu)"


def device_problem(name: str, compute_capability_major: int | None) -> str | None:
    """Why kernel ``name`` does not run on a device of this generation (None: a CPU), as a clause; None: it does."""
    kernel = KERNELS[name]
    if kernel.runs_on(compute_capability_major):
        return None
    here = "a CPU" if compute_capability_major is None else f"compute capability {compute_capability_major}.x"
    majors = ", ".join(f"{m}.x" for m in kernel.compute_capabilities)
    return f"{kernel.package} runs on compute capability {majors} GPUs, not on {here}"


def kernel_problem(name: str, compute_capability_major: int | None) -> str | None:
    """Why kernel ``name`` cannot run here on a device of this generation (None: a CPU): the clause that follows
    "attention 'NAME' cannot run here: " (``refusal``); None when it can."""
    return install_problem(name) or device_problem(name, compute_capability_major)


def refusal(name: str, compute_capability_major: int | None) -> str | None:
    """The one line that refuses kernel ``name`` here (``kernel_problem`` with the kernel named); None: it runs."""
    problem = kernel_problem(name, compute_capability_major)
    return f"attention {name!r} cannot run here: {problem}" if problem else None


def usable_here() -> tuple[str, ...]:
    """The kernels that run on this node: installed, and built for its first CUDA device's generation (torch's
    SDPA everywhere). What a search of real trials on this node may propose."""
    major = this_node_compute_capability()
    return tuple(name for name in KERNEL_NAMES if kernel_problem(name, major) is None)


def attention_kernel_problem(
    attention: str, features: dict, on_gpu: bool, compute_capability_major: int | None = None
) -> str | None:
    """Why kernel ``attention`` cannot run a model whose attention needs ``features``
    (``trials.models.config.attention_features``: ``window``, ``softcap``, ``head_dim``, ``head_dim_v``) on a GPU or on
    the CPU (None: it can). Every flash kernel (``FLASH_KERNELS``) runs windows and softcaps, within the limits its
    declaration states for a GPU generation (``compute_capability_major``, when known): its head dims
    (``AttentionKernel.head_dims``), where it cannot softcap (``AttentionKernel.no_softcap``). torch's SDPA runs a
    window on the CPU kernel only (as masked blocks) and no softcap."""
    if attention not in KERNEL_NAMES:  # unknown names: ``problems`` says so
        return None
    if attention in FLASH_KERNELS:
        return _declared_limit_problem(KERNELS[attention], features, compute_capability_major) if on_gpu else None
    if features.get("softcap"):
        return (
            f"attention 'sdpa' cannot softcap attention logits (attn_logit_softcapping {features['softcap']:g}): "
            f"use a flash kernel ({', '.join(FLASH_KERNELS)})"
        )
    if features.get("window") and on_gpu:
        return (
            f"attention 'sdpa' runs sliding windows (sliding_window {features['window']:,}) on the CPU only: "
            f"use a flash kernel ({', '.join(FLASH_KERNELS)}) on GPUs"
        )
    return None


def _declared_limit_problem(kernel: AttentionKernel, features: dict, major: int | None) -> str | None:
    """Why ``kernel`` cannot train attention with ``features`` on a GPU of generation ``major`` by its declared
    limits (None: it can, or the generation or the head dims are not known)."""
    head_dim = features.get("head_dim")
    if major is None or head_dim is None:
        return None
    head_dim = int(head_dim)
    head_dim_v = int(features.get("head_dim_v", head_dim))
    dims = f"head dim {head_dim}" if head_dim == head_dim_v else f"head dims ({head_dim}, {head_dim_v})"
    rule = kernel.head_dims_on(major)
    if rule is not None and not rule.allows(head_dim, head_dim_v):
        return (
            f"attention {kernel.name!r} ({kernel.package}) runs {rule.describe()} on compute capability {major}.x, "
            f"not {dims} ({rule.source})"
        )
    softcap = features.get("softcap")
    refused = next((r for r in kernel.no_softcap if r.applies(major, head_dim, head_dim_v)), None) if softcap else None
    if refused is not None:
        return (
            f"attention {kernel.name!r} ({kernel.package}) cannot train a softcap (attn_logit_softcapping "
            f"{softcap:g}) with {dims} on compute capability {major}.x ({refused.source})"
        )
    return None
