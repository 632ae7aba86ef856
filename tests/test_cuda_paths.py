"""CUDA acceptance (``pytest -m cuda``) of the stack's GPU paths beyond one causal call per layer: ring attention
over NCCL point-to-point (2 GPUs: ring 2; 4 GPUs: Ulysses 2 x ring 2), with and without packed documents; packed
documents on one GPU (FA2's varlen call for a whole layer, one call per document for head chunks and the other
kernels); the ring's non-causal blocks called through the kernels' entry points and merged by their logsumexps; a
flash kernel's hub build loaded from this venv; and torch's SDPA through the backend torch picks on this GPU, which
the test prints (``pytest -s``).

Each model-level case is held to ``tests/test_cuda_flash.py``'s yardstick: its loss within rel 1e-2 of an fp32
reference of the same model and data, its gradients within twice the distance of plain bf16 SDPA from that
reference. Without documents the reference is the plain model on one GPU; with documents it is the plain model run
on each document alone (its own tokens, positions from 0), as ``tests/stack_harness.py``'s documents reference is
on CPU. Kernel-level cases are held to ``trials.kernels.attention.check_kernel``'s bound against SDPA's fp32 math.

A kernel not installed here, or not built for this GPU, is skipped with the reason; so are the multi-GPU tests
where fewer GPUs are present. One CPU test runs the multi-rank launch itself (gloo, SDPA, a short sequence), so the
harness is known to work where no GPU is.

    torchrun --nproc-per-node N tests/test_cuda_paths.py ranks DEVICE SEQ OUT.json   (what the ring tests launch)
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from tests.stack_harness import full_grads  # noqa: E402
from tests.test_cuda_flash import LOSS_RTOL, SEQ, _config, _flash_skip, check, distance  # noqa: E402
from trials.core.dist import Mesh, init_mesh  # noqa: E402
from trials.kernels.attention import (  # noqa: E402
    FLASH_KERNELS,
    VARLEN_KERNELS,
    attention_backward,
    attention_forward,
    check_kernel,
    flash_available,
    flash_kernels,
    head_layout,
    residuals_from_lse,
)
from trials.kernels.documents import Documents  # noqa: E402
from trials.kernels.registry import KERNELS, _load_hub_kernel, device_problem, hub_kernel_dir  # noqa: E402
from trials.stack.techniques import Techniques  # noqa: E402
from trials.training.data import make_batch, mesh_batch, synthetic_sample  # noqa: E402
from trials.training.step import build_training, forward_backward, global_loss  # noqa: E402

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too


def on_cuda(test):
    """Mark ``test`` a CUDA acceptance test, skipped without a CUDA device (the CPU harness test is not one)."""
    test = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")(test)
    return pytest.mark.cuda(test)


KERNEL_NAMES = ("sdpa", *FLASH_KERNELS)
DOCUMENT_LENGTHS = (1000, 1, 2999, 4192)  # one GPU: uneven, one of a single token
HUB_KERNELS = tuple(name for name in FLASH_KERNELS if KERNELS[name].hub is not None)
CPU_SEQ = 256  # the CPU harness test's sequence
BLOCK_ROWS = 300  # a ring block's rows in the kernel test: not a multiple of 32 (CUDA SDPA pads its logsumexp)
SDPA_OPS = {  # the aten op each SDPA backend runs (the math backend decomposes into plain ops: none)
    SDPBackend.FLASH_ATTENTION: "_scaled_dot_product_flash_attention",
    SDPBackend.EFFICIENT_ATTENTION: "_scaled_dot_product_efficient_attention",
    SDPBackend.CUDNN_ATTENTION: "_scaled_dot_product_cudnn_attention",
    SDPBackend.OVERRIDEABLE: "_scaled_dot_product_fused_attention_overrideable",
}


def _skip_unless_runs(kernel: str) -> None:
    if kernel != "sdpa":
        _flash_skip(kernel)


def ring_document_lengths(seq: int) -> tuple[int, ...]:
    """Three documents over ``seq`` tokens (a multiple of 8), each a multiple of 2 x ring 2, one of 4 tokens."""
    first = seq * 3 // 16 // 4 * 4
    return (first, 4, seq - first - 4)


# -- the model-level comparison --------------------------------------------------------------------------------------


def run(
    techniques: dict,
    mesh,
    seq: int,
    compute_dtype=torch.bfloat16,
    documents: Documents | None = None,
    config: dict | None = None,
) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, full fp32 gradients on the host) of one forward + backward of the seeded model with ``techniques`` on
    this rank of ``mesh`` (its ring rank's zigzag columns and Ulysses slice of sample 0, packing ``documents``)."""
    config = config or _config()
    techniques = Techniques.from_dict(techniques, config["num_hidden_layers"])
    model, _ = build_training(config, techniques, mesh, seed=0, compute_dtype=compute_dtype)
    tokens = synthetic_sample(mesh.dp_rank, seq, model.config.vocab_size, 0)
    batch = mesh_batch(tokens, mesh, documents=documents)
    loss = global_loss(forward_backward(model, batch, mesh), mesh)
    grads = {name: g.cpu() for name, g in full_grads(model).items()}
    del model
    if mesh.device.type == "cuda":
        torch.cuda.empty_cache()
    return loss, grads


def run_documents_alone(
    device, seq: int, documents: Documents, compute_dtype=torch.bfloat16, config: dict | None = None
) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, gradients) of the plain seeded model on ``device`` run on each of ``documents`` alone (its tokens,
    positions from 0, its last label ignored), summed over the packed sequence's labelled tokens."""
    config = config or _config()
    model, _ = build_training(config, Techniques(), Mesh.single(device), seed=0, compute_dtype=compute_dtype)
    tokens = synthetic_sample(0, seq, model.config.vocab_size, 0)
    labelled = seq - len(documents.lengths)
    total = 0.0
    for start, end in documents.spans():
        batch = make_batch(tokens[start : end + 1], 0, 1, device, documents=Documents((end - start,)))
        loss = model(batch.input_ids, batch.position_ids, batch.labels, scale=1.0 / labelled)
        loss.backward()
        total += float(loss.detach())
    grads = {name: g.cpu() for name, g in full_grads(model).items()}
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return total, grads


def relative(result: tuple[float, dict], reference: tuple[float, dict]) -> dict:
    (loss, grads), (ref_loss, ref_grads) = result, reference
    return {"loss_rel": abs(loss - ref_loss) / abs(ref_loss), "grad_rel": distance(grads, ref_grads)}


def compare(
    cases: dict, mesh, device, seq: int, documents: Documents | None = None, config: dict | None = None
) -> dict:
    """{name: {"loss_rel", "grad_rel"}} of each case (techniques) on ``mesh`` against the fp32 reference on
    ``device`` alone (with ``documents``: each document run alone), and the yardstick: the reference in bf16."""
    if documents is None:
        single = Mesh.single(device)
        reference = run({"attention": "sdpa"}, single, seq, torch.float32, config=config)
        plain = run({"attention": "sdpa"}, single, seq, config=config)
    else:
        reference = run_documents_alone(device, seq, documents, torch.float32, config)
        plain = run_documents_alone(device, seq, documents, config=config)
    out = {"yardstick": relative(plain, reference)}
    for name, techniques in cases.items():
        out[name] = relative(run(techniques, mesh, seq, documents=documents, config=config), reference)
        out[name]["kernel"] = techniques["attention"]
    return out


# -- ring attention over NCCL point-to-point (one torchrun launch per world size) -----------------------------------


def _ring_cases(ulysses: int, kernels) -> dict:
    prefix = "ring2" if ulysses == 1 else f"ulysses{ulysses} x ring2"
    cases = {}
    for kernel in kernels:
        knobs = {"attention": kernel, "ring_degree": 2, "ulysses_degree": ulysses}
        cases[f"{prefix} {kernel}"] = knobs
        cases[f"{prefix} {kernel}, head_chunk=1"] = {**knobs, "head_chunk": 1}
    return cases


def _rank_main(device_type: str, seq: str, out_path: str) -> int:
    """One rank of a ring launch: ring 2 on 2 ranks, Ulysses 2 x ring 2 on 4 (one replica, the reference's data),
    each kernel that runs on ``device_type``, over one sequence and over packed documents; rank 0 writes."""
    rank, world, seq = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(seq)
    try:
        if device_type == "cuda":
            device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        else:
            device = torch.device("cpu")
            torch.set_num_threads(1)  # ranks share the machine's cores
        ulysses = world // 2
        mesh = init_mesh(ulysses, device, timeout_s=600, ring_degree=2)
        kernels = ["sdpa", *(name for name in FLASH_KERNELS if flash_available(device, name))]
        cases = _ring_cases(ulysses, kernels)
        documents = Documents(ring_document_lengths(seq))
        results = {
            "sequence": compare(cases, mesh, device, seq),
            f"documents {list(documents.lengths)}": compare(cases, mesh, device, seq, documents),
        }
    except Exception as exc:
        if rank == 0:
            Path(out_path).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        os._exit(1)  # no collective after a failure: the peer may sit in one; torchrun stops it
    if rank == 0:
        Path(out_path).write_text(json.dumps({"kernels": kernels, "results": results}))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


def launch_ranks(world: int, device_type: str, seq: int, out: Path, timeout: float = 900) -> dict:
    """Run ``_rank_main`` on ``world`` ranks (one torchrun launch of this file); its report."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if device_type == "cpu":
        env.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [*command, __file__, "ranks", device_type, str(seq), str(out)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    assert done.returncode == 0 and "error" not in report, f"{report.get('error')}\n{done.stderr[-4000:]}"
    return report


def check_kernel_rows(report: dict, kernel: str) -> None:
    """``check`` of each comparison (sequence, documents) of ``report`` for ``kernel``'s cases."""
    assert kernel in report["kernels"], f"the launch ran {report['kernels']}, not {kernel!r}"
    for group, rows in report["results"].items():
        picked = {f"{group}: {name}": row for name, row in rows.items() if row.get("kernel") == kernel}
        assert picked, f"no {kernel} case in {group}"
        check({"yardstick": rows["yardstick"], **picked})


@pytest.fixture(scope="module")
def two_gpu_ring_report(tmp_path_factory):
    return launch_ranks(2, "cuda", SEQ, tmp_path_factory.mktemp("ring2") / "out.json")


@on_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_ring_over_nccl_matches_sdpa_on_two_gpus(kernel, two_gpu_ring_report):
    """Ring 2 (NCCL point-to-point), whole layers and head chunks, over one sequence and over packed documents."""
    _skip_unless_runs(kernel)
    check_kernel_rows(two_gpu_ring_report, kernel)


@on_cuda
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_ulysses_and_ring_over_nccl_match_sdpa_on_four_gpus(tmp_path):
    """Ulysses 2 x ring 2 (the ring inside the Ulysses exchange), each kernel installed here."""
    report = launch_ranks(4, "cuda", SEQ, tmp_path / "out.json")
    for kernel in report["kernels"]:
        check_kernel_rows(report, kernel)


def test_the_ring_launch_runs_on_cpu_with_gloo(tmp_path):
    """The ring tests' launch, rank code and comparisons themselves, on 2 gloo ranks with SDPA on the CPU."""
    report = launch_ranks(2, "cpu", CPU_SEQ, tmp_path / "out.json", timeout=300)
    assert report["kernels"] == ["sdpa"]
    assert [len(rows) for rows in report["results"].values()] == [3, 3]  # the yardstick, a layer, head chunks
    check_kernel_rows(report, "sdpa")


# -- packed documents on one GPU ---------------------------------------------------------------------------------


@contextlib.contextmanager
def counted_varlen(kernel: str, calls: list):
    """Kernel ``kernel``'s real varlen entry point, each call's ``cu_seqlens_q`` appended to ``calls`` (nothing
    for a kernel without one)."""
    if kernel not in VARLEN_KERNELS:
        yield
        return
    real = KERNELS[kernel].resolve("varlen")

    def varlen(*args, **kwargs):
        calls.append(kwargs["cu_seqlens_q"].tolist())
        return real(*args, **kwargs)

    with flash_kernels(None, kernel=kernel, varlen=varlen):
        yield


@on_cuda
@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_packed_documents_match_each_document_alone_on_one_gpu(kernel):
    """Whole layers (FA2: one varlen call per layer) and head chunks (one call per document)."""
    _skip_unless_runs(kernel)
    device = torch.device("cuda", 0)
    documents = Documents(DOCUMENT_LENGTHS)
    assert documents.total == SEQ
    cases = {
        kernel: {"attention": kernel},
        f"{kernel}, head_chunk=1": {"attention": kernel, "head_chunk": 1},
        f"{kernel}, head_chunk=4 + checkpointing": {
            "attention": kernel,
            "head_chunk": 4,
            "activation_checkpointing": True,
        },
    }
    calls = []
    with counted_varlen(kernel, calls):
        results = compare(cases, Mesh.single(device), device, SEQ, documents)
    check(results)
    if kernel in VARLEN_KERNELS:
        assert calls and all(bounds == list(documents.offsets) for bounds in calls), calls


# -- the ring's non-causal blocks, kernel by kernel ---------------------------------------------------------------


def check_ring_blocks(kernel: str, device, head_dim: int, heads: tuple[int, int] = (8, 2)) -> float:
    """One ring rank's queries against two blocks of keys, each called non-causally through ``kernel``'s entry points
    as ``trials.stack.ring`` calls them (``attention_forward`` / ``attention_backward`` with ``causal=False``, the
    blocks merged by their logsumexps, each block's backward given the merged output and logsumexp), against SDPA's
    fp32 math over all the keys (``is_causal=False``) of the same bf16 inputs: the output, the merged logsumexp and
    dq, dk, dv, each within ``check_kernel``'s bound. Returns the worst error relative to the largest value."""
    rows, (q_heads, kv_heads) = BLOCK_ROWS, heads
    generator = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, rows, q_heads, head_dim, generator=generator) for _ in range(2))
    k, v = (torch.randn(1, 2 * rows, kv_heads, head_dim, generator=generator) for _ in range(2))
    q, k, v, dout = (t.to(device, torch.bfloat16) for t in (q, k, v, dout))
    scaling = head_dim**-0.5

    reference = [t.float().transpose(1, 2).requires_grad_() for t in (q, k, v)]  # [b, h, s, d]
    rq, rk, rv = reference
    groups = q_heads // kv_heads
    rk_all, rv_all = (t.repeat_interleave(groups, dim=1) for t in (rk, rv))
    expected = F.scaled_dot_product_attention(rq, rk_all, rv_all, is_causal=False, scale=scaling)
    expected.backward(dout.float().transpose(1, 2))
    expected_lse = torch.logsumexp(rq @ rk_all.transpose(-1, -2) * scaling, dim=-1).detach()  # [b, h, s]

    bhsd = head_layout(kernel) == "bhsd"
    dim = 2 if bhsd else 1
    into = (lambda t: t.transpose(1, 2).contiguous()) if bhsd else (lambda t: t)
    q, k, v, dout = (into(t) for t in (q, k, v, dout))
    blocks = [(start, rows) for start in (0, rows)]
    out = lse = None
    for start, length in blocks:
        block_out, residuals = attention_forward(
            q, k.narrow(dim, start, length), v.narrow(dim, start, length), scaling, kernel, causal=False
        )
        block_lse = residuals[0][..., :rows].float()
        weights = (lambda x: x.unsqueeze(-1)) if bhsd else (lambda x: x.transpose(1, 2).unsqueeze(-1))
        if out is None:
            out, lse = block_out.float(), block_lse.clone()
            continue
        merged = torch.logaddexp(lse, block_lse)
        out = out * weights(lse - merged).exp() + block_out.float() * weights(block_lse - merged).exp()
        lse = merged
    out = out.to(q.dtype)
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = [], []
    for start, length in blocks:
        grads = attention_backward(
            dout,
            q,
            k.narrow(dim, start, length),
            v.narrow(dim, start, length),
            out,
            residuals_from_lse(kernel, lse.contiguous(), q),
            scaling,
            kernel,
            causal=False,
        )
        dq.add_(grads[0])
        dk.append(grads[1])
        dv.append(grads[2])
    back = (lambda t: t.transpose(1, 2)) if not bhsd else (lambda t: t)  # the kernel's layout -> [b, h, s, d]
    got = {
        "out": (back(out), expected.detach()),
        "logsumexp": (lse, expected_lse),
        "dq": (back(dq), rq.grad),
        "dk": (back(torch.cat(dk, dim)), rk.grad),
        "dv": (back(torch.cat(dv, dim)), rv.grad),
    }
    worst = 0.0
    for name, (value, wanted) in got.items():
        assert value.shape == wanted.shape, (name, tuple(value.shape), tuple(wanted.shape))
        error = (value.float() - wanted).abs().max().item()
        scale = wanted.abs().max().item()
        assert error <= 0.02 * scale + 1e-3, (
            f"{kernel} non-causal {name} differs from SDPA's by {error:.3g} (of {scale:.3g})"
        )
        worst = max(worst, error / scale)
    return worst


@on_cuda
@pytest.mark.parametrize("kernel", KERNEL_NAMES)
def test_non_causal_ring_blocks_match_sdpa_on_one_gpu(kernel):
    _skip_unless_runs(kernel)
    for head_dim in (64, 128):
        check_ring_blocks(kernel, torch.device("cuda", 0), head_dim)


# -- a hub build in this venv ------------------------------------------------------------------------------------


@on_cuda
@pytest.mark.parametrize("kernel", HUB_KERNELS)
def test_a_hub_build_in_the_venv_serves_the_entry_points_and_matches_sdpa(kernel):
    """The hub build ``bin/setup-gpu`` put into this venv (``hub_kernel_dir``): every declared entry point resolves
    in it (and is what trials resolve where the pip package is absent), and the stack's calls through it -- a layer
    and head chunks, with and without a window (``check_kernel``), and non-causal ring blocks -- match SDPA."""
    spec, folder = KERNELS[kernel], hub_kernel_dir(kernel)
    if not folder.is_dir():
        pytest.skip(f"no hub build of {spec.hub.repo} in this venv ({folder}; bin/setup-gpu puts one there)")
    problem = device_problem(kernel, torch.cuda.get_device_capability(0)[0])
    if problem:
        pytest.skip(problem)
    module = _load_hub_kernel(kernel)
    declared = [which for which in ("layer", "forward", "backward", "varlen") if getattr(spec.hub.entry_points, which)]
    entries = {which: spec.hub.entry_points.resolve_in(module, which) for which in declared}
    assert all(callable(entry) for entry in entries.values()), entries
    try:
        spec.entry_points.resolve("layer")
    except (ModuleNotFoundError, AttributeError):  # no pip package: trials resolve the hub build's
        assert all(spec.resolve(which) is entry for which, entry in entries.items())
    stand_ins = {which: entries.get(which) for which in ("layer", "forward", "backward", "varlen")}
    with flash_kernels(kernel=kernel, **stand_ins):
        print(f"{spec.hub.repo} from {folder}: {check_kernel(kernel)}")
        check_ring_blocks(kernel, torch.device("cuda", 0), 64)


# -- SDPA through the backend torch picks here ----------------------------------------------------------------------


class SdpaOps(TorchDispatchMode):
    """The SDPA aten ops run while active (what F.scaled_dot_product_attention dispatched to)."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.seen.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _backend_name(choice: int) -> str:
    return SDPBackend(choice).name


def sdpa_choices(device, seq: int, q_heads: int, kv_heads: int, head_dim: int) -> dict:
    """What torch's SDPA dispatch picks, and which fused backends could run, for the stack's whole-layer call (bf16,
    causal, kv heads repeated to the query heads: ``trials.kernels.attention.causal_attention``) and for the same
    GQA call with ``enable_gqa`` (what a caller passing kv heads natively would get)."""
    q = torch.empty(1, q_heads, seq, head_dim, device=device, dtype=torch.bfloat16)
    out = {}
    for call, kv in (("stack call (kv repeated)", q_heads), ("native GQA call", kv_heads)):
        k = torch.empty(1, kv, seq, head_dim, device=device, dtype=torch.bfloat16)
        gqa = kv != q_heads
        params = torch.backends.cuda.SDPAParams(q, k, k, None, 0.0, True, gqa)
        out[call] = {
            "chosen": _backend_name(torch._fused_sdp_choice(q, k, k, None, 0.0, True, enable_gqa=gqa)),
            "can_use_flash": torch.backends.cuda.can_use_flash_attention(params),
            "can_use_efficient": torch.backends.cuda.can_use_efficient_attention(params),
            "can_use_cudnn": torch.backends.cuda.can_use_cudnn_attention(params),
        }
    return out


def sdpa_settings() -> dict:
    """torch's SDPA switches and priority order on this process, and the flash implementation it has active."""
    import torch.nn.attention as attention

    cuda = torch.backends.cuda
    settings = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "enabled": {
            "cudnn": cuda.cudnn_sdp_enabled(),
            "flash": cuda.flash_sdp_enabled(),
            "mem_efficient": cuda.mem_efficient_sdp_enabled(),
            "math": cuda.math_sdp_enabled(),
        },
    }
    if hasattr(torch._C, "_get_sdp_priority_order"):
        settings["priority"] = [_backend_name(choice) for choice in torch._C._get_sdp_priority_order()]
    if hasattr(attention, "current_flash_attention_impl"):
        settings["flash_impl"] = attention.current_flash_attention_impl()
    return settings


def pinned_run(backend, mesh, config: dict, reference) -> dict:
    """The stack's whole SDPA layer with torch's SDPA pinned to ``backend``: its distance from ``reference``, or
    the error where the backend refuses the stack's call (its strides, say) although it takes contiguous ones."""
    try:
        with sdpa_kernel(backend):
            return relative(run({"attention": "sdpa"}, mesh, SEQ, config=config), reference)
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


@on_cuda
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sdpa_through_the_backend_torch_picks_here_matches_sdpa_s_reference(head_dim):
    """Prints the SDPA backend torch picks on this GPU for the stack's calls (``pytest -s``), the op the stack's
    whole layer ran, and each backend's distance from the fp32 reference; asserts the whole layer (whatever backend
    that is) and head chunks (the memory-efficient kernel: ``attention_forward``) give the reference's loss and
    gradients."""
    device = torch.device("cuda", 0)
    config = dict(_config(), head_dim=head_dim)
    mesh = Mesh.single(device)
    record = {
        "device": torch.cuda.get_device_name(device),
        "capability": ".".join(map(str, torch.cuda.get_device_capability(device))),
        "head_dim": head_dim,
        **sdpa_settings(),
        **sdpa_choices(device, SEQ, config["num_attention_heads"], config["num_key_value_heads"], head_dim),
    }
    reference = run({"attention": "sdpa"}, mesh, SEQ, torch.float32, config=config)
    with SdpaOps() as ops:
        layer = run({"attention": "sdpa"}, mesh, SEQ, config=config)
    record["stack layer ran"] = sorted(ops.seen)
    chosen = SDPBackend[record["stack call (kv repeated)"]["chosen"]]
    record["stack layer ran the chosen backend"] = SDPA_OPS.get(chosen) in ops.seen if chosen in SDPA_OPS else None
    results = {
        "yardstick": relative(layer, reference),
        "sdpa, head_chunk=2": relative(
            run({"attention": "sdpa", "head_chunk": 2}, mesh, SEQ, config=config), reference
        ),
    }
    pinned = {}  # each backend torch can run here, the stack's whole layer pinned to it (informational)
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        flag = {SDPBackend.CUDNN_ATTENTION: "cudnn", SDPBackend.FLASH_ATTENTION: "flash"}.get(backend, "efficient")
        if not record["stack call (kv repeated)"][f"can_use_{flag}"]:
            continue
        pinned[backend.name] = pinned_run(backend, mesh, config, reference)
    pinned["MATH"] = pinned_run(SDPBackend.MATH, mesh, config, reference)
    record["distance from the fp32 reference"] = {
        "stack layer": results["yardstick"],
        "sdpa, head_chunk=2": results["sdpa, head_chunk=2"],
        **{f"layer pinned to {name}": row for name, row in pinned.items()},
    }
    print(json.dumps(record, indent=1))
    assert results["yardstick"]["loss_rel"] <= LOSS_RTOL, results["yardstick"]
    check(results)


if __name__ == "__main__" and sys.argv[1:2] == ["ranks"]:
    sys.exit(_rank_main(*sys.argv[2:]))
