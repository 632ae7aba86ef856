"""CUDA acceptance (``pytest -m cuda``): each installed flash kernel's (FlashAttention 2 / 3 / 4, ``flash`` /
``flash3`` / ``flash4``) real forward and backward, whole layers and through head chunking, with and without a
sliding window (one GPU), and FA2 through Ulysses with and without head chunks (two GPUs, one torchrun launch of
this file), against torch's SDPA. A kernel not installed here, or not built for this GPU, is skipped with the
reason.

bf16 kernels differ from one another by rounding, so each case is held to a yardstick, as in
``tests/test_stack.py``'s mixed-precision test: its gradients' distance from an fp32 SDPA reference of the same
model and data must be within twice the distance of plain bf16 SDPA on one GPU. A wrong head, kv head or sequence
slice is an error of order one, far outside it.

    torchrun --nproc-per-node 2 tests/test_cuda_flash.py OUT.json      (what the two-GPU test launches)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.torch_release,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device"),
]

SEQ = 8192
LOSS_RTOL = 1e-2
YARDSTICK = 2.0


WINDOW = SEQ // 4  # the windowed model's sliding_window (a Mistral of the same shape)


def _config(window: int | None = None) -> dict:
    """A small Llama with flash-attn's usual head size (64) and GQA (4 query heads per kv head); with ``window``,
    the same shape as a Mistral attending through that sliding window."""
    from trials.models.config import load_model_config

    config = dict(
        load_model_config("tiny-llama"),
        hidden_size=512,
        intermediate_size=1408,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        num_hidden_layers=2,
    )
    return dict(config, model_type="mistral", sliding_window=window) if window else config


def _flash_skip(kernel: str = "flash"):
    from trials.kernels.attention import flash_available
    from trials.kernels.registry import kernel_problem

    device = torch.device("cuda", 0)
    if not flash_available(device, kernel):
        why = kernel_problem(kernel, torch.cuda.get_device_capability(device)[0])
        pytest.skip(f"attention {kernel!r} cannot run here ({why}): trials fall back to SDPA")


def run(
    techniques: dict, mesh, compute_dtype=torch.bfloat16, window: int | None = None
) -> tuple[float, dict[str, torch.Tensor]]:
    """(loss, full fp32 gradients) of one forward + backward of the seeded model with ``techniques`` on ``mesh``
    (sample 0: a mesh of one Ulysses group holds one replica, the reference's data)."""
    from stack_harness import full_grads

    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import build_training, forward_backward, global_loss

    config = _config(window)
    techniques = Techniques.from_dict(techniques, config["num_hidden_layers"])
    model, _ = build_training(config, techniques, mesh, seed=0, compute_dtype=compute_dtype)
    tokens = synthetic_sample(mesh.dp_rank, SEQ, model.config.vocab_size, 0)
    batch = make_batch(tokens, mesh.sp_rank, mesh.sp_degree, mesh.device)
    loss = global_loss(forward_backward(model, batch, mesh), mesh)
    grads = {name: g.cpu() for name, g in full_grads(model).items()}
    del model
    torch.cuda.empty_cache()
    return loss, grads


def distance(grads: dict, reference: dict) -> float:
    """The largest per-parameter relative distance ||g - g_ref|| / ||g_ref||."""
    assert set(grads) == set(reference), sorted(set(grads) ^ set(reference))[:4]
    return max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in reference.items())


def compare(cases: dict, mesh, reference_mesh, window: int | None = None) -> dict:
    """{name: {"loss_rel", "grad_rel"}} for each case, and the yardstick (plain bf16 SDPA on one device). With a
    ``window``, SDPA runs on the CPU (it runs windows on the CPU kernel only): the fp32 reference and the bf16
    yardstick both."""
    if window:
        from trials.core.dist import Mesh

        cpu = Mesh.single(torch.device("cpu"))
        ref_loss, ref_grads = run({"attention": "sdpa"}, cpu, torch.float32, window)
        plain_loss, plain_grads = run({"attention": "sdpa"}, cpu, window=window)
    else:
        ref_loss, ref_grads = run({"attention": "sdpa"}, reference_mesh, torch.float32)
        plain_loss, plain_grads = run({"attention": "sdpa"}, reference_mesh)
    out = {
        "yardstick": {"loss_rel": abs(plain_loss - ref_loss) / ref_loss, "grad_rel": distance(plain_grads, ref_grads)}
    }
    for name, techniques in cases.items():
        loss, grads = run(techniques, mesh, window=window)
        out[name] = {"loss_rel": abs(loss - ref_loss) / ref_loss, "grad_rel": distance(grads, ref_grads)}
    return out


def check(results: dict) -> None:
    yardstick = results.pop("yardstick")
    assert 0 < yardstick["grad_rel"] < 0.1, yardstick  # bf16 moves the gradients, but not by much
    bad = [
        f"{name}: loss rel {r['loss_rel']:.2e}, grad rel {r['grad_rel']:.2e} (plain bf16 sdpa: {yardstick['grad_rel']:.2e})"
        for name, r in results.items()
        if r["loss_rel"] > LOSS_RTOL or r["grad_rel"] > YARDSTICK * yardstick["grad_rel"]
    ]
    assert not bad, "\n".join(bad)


def _one_gpu_cases(kernel: str) -> dict:
    return {
        kernel: {"attention": kernel},
        f"{kernel}, head_chunk=1": {"attention": kernel, "head_chunk": 1},
        f"{kernel}, head_chunk=4 + checkpointing": {
            "attention": kernel,
            "head_chunk": 4,
            "activation_checkpointing": True,
        },
    }


@pytest.mark.parametrize("kernel", ["flash", "flash3", "flash4"])
def test_flash_kernel_and_head_chunks_match_sdpa_on_one_gpu(kernel):
    _flash_skip(kernel)
    from trials.core.dist import Mesh

    mesh = Mesh.single(torch.device("cuda", 0))
    check(compare({**_one_gpu_cases(kernel), "sdpa, head_chunk=2": {"attention": "sdpa", "head_chunk": 2}}, mesh, mesh))


@pytest.mark.parametrize("kernel", ["flash", "flash3", "flash4"])
def test_flash_kernel_with_a_sliding_window_matches_sdpa_on_one_gpu(kernel):
    """The window's (left, right) form each kernel takes, whole layers and head chunks."""
    _flash_skip(kernel)
    from trials.core.dist import Mesh

    mesh = Mesh.single(torch.device("cuda", 0))
    check(compare(_one_gpu_cases(kernel), mesh, mesh, window=WINDOW))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_flash_through_ulysses_and_head_chunks_matches_sdpa_on_two_gpus(tmp_path):
    _flash_skip()
    out = tmp_path / "out.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*command, __file__, str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    assert done.returncode == 0 and "error" not in report, f"{report.get('error')}\n{done.stderr[-4000:]}"
    check(report["results"])


def _two_gpu_main(out_path: str) -> int:
    """One rank of the two-GPU launch: Ulysses degree 2 (one replica, the reference's data), rank 0 writes."""
    from trials.core.dist import Mesh, init_mesh

    rank = int(os.environ["RANK"])
    try:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        mesh = init_mesh(2, device, timeout_s=600)
        u = {"ulysses_degree": 2}
        cases = {
            "ulysses sdpa": {**u, "attention": "sdpa"},
            "ulysses flash": {**u, "attention": "flash"},
            "ulysses flash, head_chunk=1": {**u, "attention": "flash", "head_chunk": 1},
            "ulysses flash, head_chunk=2 + fsdp": {**u, "attention": "flash", "head_chunk": 2, "fsdp": True},
            "ulysses flash, full stack": {
                **u,
                "attention": "flash",
                "head_chunk": 1,
                "fsdp": True,
                "activation_checkpointing": True,
                "activation_offload_layers": "all",
                "mlp_tile_tokens": SEQ // 8,
                "loss_tile_tokens": SEQ // 8,
            },
        }
        results = compare(cases, mesh, Mesh.single(device))
    except Exception as exc:
        if rank == 0:
            Path(out_path).write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}))
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        os._exit(1)  # no collective after a failure: the peer may sit in one; torchrun stops it
    if rank == 0:
        Path(out_path).write_text(json.dumps({"results": results}))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_two_gpu_main(sys.argv[1]))
