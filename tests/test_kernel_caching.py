"""What the attention path looks up once, not per call: each kernel's entry points (resolved once per process, a
failure never kept) and packed documents' ``cu_seqlens`` (one tensor per ``Documents`` and device)."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from trials.kernels import registry
from trials.kernels.attention import causal_attention, flash_kernels
from trials.kernels.documents import Documents
from trials.kernels.registry import KERNELS, forget_resolved

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too


@pytest.fixture
def counted_imports(monkeypatch):
    """Every ``importlib.import_module`` call the registry makes while the test runs, by module name; nothing
    resolved before the test, nothing the test resolved kept after it."""
    forget_resolved()
    imported: list[str] = []
    real = importlib.import_module

    def import_module(name, package=None):
        imported.append(name)
        return real(name, package)

    monkeypatch.setattr(registry.importlib, "import_module", import_module)
    yield imported
    forget_resolved()


def _fa3_package(monkeypatch, tmp_path) -> types.ModuleType:
    """A stand-in for flash-attn-3's pip package (module ``flash_attn_interface``), installed in ``sys.modules``."""
    package = types.ModuleType("flash_attn_interface")
    package.__file__ = str(tmp_path / "site-packages" / "flash_attn_interface.py")
    package.flash_attn_func = object()
    package._flash_attn_forward = object()
    package._flash_attn_backward = object()
    monkeypatch.setitem(sys.modules, "flash_attn_interface", package)
    return package


def test_a_pip_packages_entry_point_is_imported_once_per_process(counted_imports, monkeypatch, tmp_path):
    package = _fa3_package(monkeypatch, tmp_path)
    kernel = KERNELS["flash3"]
    first, second = kernel.resolve("forward"), kernel.resolve("forward")
    assert first is second is package._flash_attn_forward
    assert counted_imports == ["flash_attn_interface"]
    assert kernel.installed() and kernel.installed()  # each of the three entry points: one import each, once
    assert counted_imports == ["flash_attn_interface"] * 3


def test_a_hub_builds_entry_point_is_looked_up_once_per_process(counted_imports, monkeypatch, tmp_path):
    """Without the pip package, the hub build serves: the failed pip import, the hub folder's check and the hub
    module's load happen on the first resolution only."""
    interface = types.SimpleNamespace(_flash_attn_forward=object(), _flash_attn_backward=object())
    hub_module = types.SimpleNamespace(flash_attn_func=object(), flash_attn_interface=interface)
    loaded, folders = [], []
    fake_kernels = types.ModuleType("kernels")
    fake_kernels.get_local_kernel = lambda path: loaded.append(path) or hub_module
    monkeypatch.setitem(sys.modules, "kernels", fake_kernels)
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)  # the pip package is not installed
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    registry.hub_kernel_dir("flash3").mkdir(parents=True)
    real_hub_kernel_dir = registry.hub_kernel_dir
    monkeypatch.setattr(registry, "hub_kernel_dir", lambda name: folders.append(name) or real_hub_kernel_dir(name))
    kernel = KERNELS["flash3"]
    assert kernel.resolve("backward") is kernel.resolve("backward") is interface._flash_attn_backward
    assert counted_imports == ["flash_attn_interface"]
    assert folders == ["flash3", "flash3"]  # the folder's check and its load, on the first resolution
    assert len(loaded) == 1


def test_a_failed_resolution_is_not_kept(counted_imports, monkeypatch, tmp_path):
    """An entry point that does not resolve is looked up again on the next call: installed later, it resolves;
    a stand-in swapped in after ``forget_resolved`` is what resolves then."""
    monkeypatch.setitem(sys.modules, "flash_attn_interface", None)
    monkeypatch.setattr(sys, "prefix", str(tmp_path))  # no hub build in this venv
    kernel = KERNELS["flash3"]
    for _ in range(2):
        with pytest.raises(ModuleNotFoundError):
            kernel.resolve("layer")
    assert not kernel.installed()
    first = _fa3_package(monkeypatch, tmp_path)
    assert kernel.resolve("layer") is first.flash_attn_func
    second = _fa3_package(monkeypatch, tmp_path)
    assert kernel.resolve("layer") is first.flash_attn_func  # kept for the process
    forget_resolved()
    assert kernel.resolve("layer") is second.flash_attn_func


def test_cu_seqlens_is_one_tensor_per_documents_and_device():
    documents = Documents((5, 20, 7))
    first = documents.cu_seqlens("cpu")
    assert documents.cu_seqlens(torch.device("cpu")) is first
    assert first.dtype == torch.int32 and first.tolist() == [0, 5, 25, 32]
    on_meta = documents.cu_seqlens("meta")
    assert on_meta is not first and on_meta.device.type == "meta" and documents.cu_seqlens("meta") is on_meta
    # a copy of the same documents (FSDP2 copies each module's dataclass inputs; the next batch of a fixed length)
    # shares it; other lengths get their own
    assert Documents((5, 20, 7)).cu_seqlens("cpu") is first and Documents((5, 20, 8)).cu_seqlens("cpu") is not first
    assert documents == Documents((5, 20, 7)) and hash(documents) == hash(Documents((5, 20, 7)))
    with torch.inference_mode():
        assert Documents((3, 4)).cu_seqlens("cpu").is_inference() is False  # autograd may save it for backward


def test_packed_documents_pass_fsdps_cast_of_each_modules_inputs():
    """FSDP2 in bf16 (a GPU preset's ``param_dtype``) hands each sharded module's forward a copy of its dataclass
    inputs (``dataclasses.replace``): the documents survive it, and the oracle traces a packed step of a GPU
    config."""
    from autotune.backends.plan import PlanBackend
    from autotune.core.evaluation import Evaluation
    from autotune.core.hardware import load_hardware
    from trials.kernels.documents import DocumentsSpec
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques

    evaluation = Evaluation(
        load_model_config("tiny-llama"),
        Techniques(fsdp=True, ulysses_degree=2, attention="flash"),
        4096,
        2,
        load_hardware("h100-sxm"),
        documents=DocumentsSpec((1024,)),
    )
    record = PlanBackend(store=None).evaluate(evaluation)
    assert record.status == "ok", record.error


def test_cu_seqlens_under_fake_tensor_mode_is_that_modes_and_not_kept():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    documents = Documents((5, 20, 7))
    for _ in range(2):
        with FakeTensorMode():
            fake = documents.cu_seqlens("cpu")
            assert isinstance(fake, FakeTensor) and documents.cu_seqlens("cpu") is not fake
    real = documents.cu_seqlens("cpu")
    assert not isinstance(real, FakeTensor) and real.tolist() == [0, 5, 25, 32]


def test_every_layers_varlen_call_gets_the_same_cu_seqlens():
    """Layers (and a checkpointed layer's recompute) of one batch attend over its one ``Documents``: each varlen
    call receives the same ``cu_seqlens`` tensor, built once."""
    documents = Documents((5, 20, 7))
    received = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        received.extend((cu_seqlens_q, cu_seqlens_k))
        return torch.zeros_like(q)

    q, k, v = (torch.randn(1, heads, 32, 8, dtype=torch.bfloat16) for heads in (4, 2, 2))
    with flash_kernels(layer=lambda *a, **kw: None, varlen=varlen, kernel="flash"):
        for _layer in range(3):
            causal_attention(q, k, v, kernel="flash", documents=documents)
    assert len(received) == 6 and all(t is received[0] for t in received)
