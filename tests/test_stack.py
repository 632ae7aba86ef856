"""The technique stack is exact and composable, and every knob moves memory the way theory says (issue 3).

Exactness matrix: world sizes 1, 2, 4 (4 is slow-marked, and packed documents' 4-rank cases run in its launch);
tiny-llama (GQA: 2 kv heads, so degree 4 replicates them) and tiny-qwen3 (q/k norms, 4 kv heads); each technique
alone, pairs, the full stack; head_chunk 1 and 2 (and all local heads). Every case must reproduce the plain
single-process model: loss within rel 1e-5 and every parameter gradient within rel 1e-4 (||g - g_ref|| / ||g_ref||
per parameter), first-step gradients before the optimizer step; cases marked ``step`` also take one AdamW step
(exercising optimizer offload) and compare the loss after it. LoRA (``_lora_cases``): peft's adapters on a frozen
base, against the plain model with the same adapters, through head chunks, tiles, checkpointing and offload, FSDP, a
ring and packed documents. Many cases run inside ONE launch per world size (``tests/stack_harness.py``): starting
torchrun costs ~20 s. The plugin's cases (``tests/test_hf_plugin.py``: these cases through ``trials.hf``, the model
saved by ``transformers``) join the 1- and 2-rank launches.

Memory (slow): world 2, 6K tokens, tiny-llama, the tracker's peak (``tests/stack_memory_harness.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

ROOT = Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests" / "stack_harness.py"
MEMORY_HARNESS = ROOT / "tests" / "stack_memory_harness.py"

LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
SEQ = 512

FULL = {
    "fsdp": True,
    "optimizer_offload": True,
    "head_chunk": 1,
    "activation_checkpointing": True,
    "activation_offload_layers": 4,
    "mlp_tile_tokens": 96,
    "loss_tile_tokens": 80,
    "norm_tile_tokens": 112,
}


def _cases(degree: int) -> list[dict]:
    """name, model, techniques, step for one world size (Ulysses degree = world: one replica, the plain model's
    data), plus a couple of data-parallel cases (degree 1 over 2 ranks: the reference averages the replicas)."""
    u = {"ulysses_degree": degree}
    ckpt = {"activation_checkpointing": True}
    rows = []
    for model in ("tiny-llama", "tiny-qwen3"):
        local_heads = 8 // degree
        singles = {
            "ulysses": {},
            "head_chunk=1": {"head_chunk": 1},
            "head_chunk=2": {"head_chunk": 2},
            "mlp_tiles": {"mlp_tile_tokens": 96},  # uneven last tile on purpose
            "loss_tiles": {"loss_tile_tokens": 80},
            "norm_tiles": {"norm_tile_tokens": 112},  # qwen3: per-head q/k norms tiled too
            "checkpointing": ckpt,
            "offload=2": {**ckpt, "activation_offload_layers": 2},
            "fsdp": {"fsdp": True},
        }
        if local_heads > 2:
            singles["head_chunk=all"] = {"head_chunk": local_heads}
        pairs = {
            "head_chunk=1+mlp": {"head_chunk": 1, "mlp_tile_tokens": 96},
            "head_chunk=2+loss": {"head_chunk": 2, "loss_tile_tokens": 80},
            "head_chunk=1+checkpointing": {"head_chunk": 1, **ckpt},
            "mlp+loss": {"mlp_tile_tokens": 96, "loss_tile_tokens": 80},
            "head_chunk=2+norm": {"head_chunk": 2, "norm_tile_tokens": 112},
            "checkpointing+norm": {**ckpt, "norm_tile_tokens": 112},
            "fsdp+norm": {"fsdp": True, "norm_tile_tokens": 112},
            "offload=all+mlp": {**ckpt, "activation_offload_layers": 4, "mlp_tile_tokens": 96},
            "fsdp+loss": {"fsdp": True, "loss_tile_tokens": 80},
            "fsdp+offload": {"fsdp": True, **ckpt, "activation_offload_layers": 4},
            "fsdp+optimizer_offload": {"fsdp": True, "optimizer_offload": True},
        }
        for name, techniques in {**singles, **pairs, "full": FULL}.items():
            if degree == 1 and name == "ulysses":
                name = "plain"
            step = name in ("fsdp", "fsdp+optimizer_offload", "full")
            rows.append({"name": f"{model}/{name}", "model": model, "techniques": {**u, **techniques}, "step": step})
    if degree > 1:  # untied Ulysses packing each step's tensors into one all-to-all
        for model in ("tiny-llama", "tiny-qwen3"):
            rows.append(
                {
                    "name": f"{model}/head_chunk=1 batched exchanges",
                    "model": model,
                    "step": False,
                    "techniques": {**u, "head_chunk": 1, "activation_checkpointing": True},
                    "batch_exchanges": True,
                }
            )
    rows += _lora_cases(degree)
    if degree == 2:  # data parallel: two replicas of degree 1 (different samples), sharded and head-chunked
        rows.append(
            {
                "name": "tiny-llama/dp2+fsdp+optimizer_offload+head_chunk=1",
                "model": "tiny-llama",
                "techniques": {"fsdp": True, "optimizer_offload": True, "head_chunk": 1},
                "step": True,
            }
        )
        rows.append({"name": "tiny-qwen3/dp2+full", "model": "tiny-qwen3", "techniques": FULL, "step": True})
    return rows


LORA = {"rank": 4, "alpha": 8, "init_lora_weights": False}  # B drawn too: every adapter has a gradient at step 1
WHOLE = {**LORA, "trainable": ["embed_tokens", "norm"]}  # LongLoRA's: the embedding and every norm trained whole too


def _lora_cases(degree: int) -> list[dict]:
    """LoRA adapters (peft's) through the knobs: the reference is the plain model with the same adapters; only the
    adapters have gradients (tiny-qwen3: its q/k norms frozen inside head-chunked attention too). With ``WHOLE`` the
    embedding and the norms train too, peft's ``modules_to_save`` in the reference (trained copies), the modules
    themselves in the stack (tiny-qwen3: its q/k norms trained inside head-chunked attention)."""
    u = {"ulysses_degree": degree}
    ckpt = {"activation_checkpointing": True}
    cases = {
        "tiny-llama/lora": ({}, LORA, True),
        "tiny-qwen3/lora+head_chunk=1+checkpointing": ({"head_chunk": 1, **ckpt}, LORA, False),
        "tiny-qwen3/lora+whole+head_chunk=1+checkpointing": ({"head_chunk": 1, **ckpt}, WHOLE, True),
        "tiny-llama/lora+full": (FULL, LORA, True),
        "tiny-llama/lora+whole+full": (FULL, WHOLE, True),
        "tiny-qwen3/lora q,v+head_chunk=2+mlp+loss": (
            {"head_chunk": 2, "mlp_tile_tokens": 96, "loss_tile_tokens": 80},
            {**LORA, "alpha": 2, "targets": ["q_proj", "v_proj"]},
            False,
        ),
    }
    if degree == 2:  # a ring, data parallel under FSDP, packed documents
        cases["tiny-llama/lora+whole+ring=2+checkpointing"] = (
            {"ring_degree": 2, "ulysses_degree": 1, **ckpt},
            WHOLE,
            False,
        )
        cases["tiny-llama/lora+whole dp2+fsdp+mlp"] = (
            {"fsdp": True, "ulysses_degree": 1, "mlp_tile_tokens": 96},
            WHOLE,
            True,
        )
    rows = []
    for name, (techniques, lora, step) in cases.items():
        model = name.split("/")[0]
        rows.append({"name": name, "model": model, "techniques": {**u, **techniques}, "step": step, "lora": lora})
    if degree > 1:
        rows.append(
            {
                "name": "tiny-llama/lora+head_chunk=2 documents",
                "model": "tiny-llama",
                "techniques": {**u, "head_chunk": 2},
                "step": False,
                "lora": LORA,
                "documents": [200, 120, SEQ - 320],
            }
        )
    return rows


def _launch(script: Path, world: int, spec: dict, tmp_path: Path, timeout: float) -> dict:
    cases, out = tmp_path / "cases.json", tmp_path / "out.json"
    cases.write_text(json.dumps(spec))
    if world == 1:
        command = [sys.executable, str(script), str(cases), str(out)]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={world}",
            str(script),
            str(cases),
            str(out),
        ]
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "OMP_NUM_THREADS": "1" if world > 1 else os.environ.get("OMP_NUM_THREADS", "2"),  # a worker's share
        "MKL_DYNAMIC": "FALSE",
        "OMP_DYNAMIC": "FALSE",
    }
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    report = json.loads(out.read_text()) if out.exists() else {}
    if done.returncode or "error" in report:
        pytest.fail(
            f"harness failed (exit {done.returncode}): {report.get('error', '')}\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
        )
    return report


def _check_exact(report: dict, expected: int) -> None:
    results = report["results"]
    assert len(results) == expected
    bad = []
    for row in results:
        # the norm is one scalar collective on the mesh's device (never one per parameter, never a host tensor)
        if (
            row["grad_norm_rel"] > GRAD_RTOL
            or len(row["grad_norm_collectives"]) > 1
            or any(device != "cpu" for device in row["grad_norm_collectives"])
        ):
            bad.append(
                f"{row['name']}: grad norm rel {row['grad_norm_rel']:.2e}, collectives {row['grad_norm_collectives']}"
            )
        if row["loss_rel"] > LOSS_RTOL or row["grad_rel"] > GRAD_RTOL or row.get("step_loss_rel", 0) > LOSS_RTOL:
            bad.append(
                f"{row['name']}: loss rel {row['loss_rel']:.2e}, grad rel {row['grad_rel']:.2e} "
                f"({row['grad_rel_param']}), after-step loss rel {row.get('step_loss_rel', 0):.2e}"
            )
    assert not bad, "not exact:\n" + "\n".join(bad)


def test_exact_one_rank(tmp_path):
    # the plugin's cases (tests/test_hf_plugin.py: these cases, the model saved by transformers) join this launch
    from test_hf_plugin import _plugin_cases, save_models

    cases = _cases(1) + _plugin_cases(1, save_models(tmp_path / "pretrained"))
    _check_exact(_launch(HARNESS, 1, {"seq_len": SEQ, "cases": cases}, tmp_path, timeout=900), len(cases))


def test_exact_two_ranks(tmp_path):
    # the plugin's cases and its packed documents (tests/test_hf_plugin.py) join this launch: starting ranks costs
    # more than the cases
    from test_hf_plugin import _packed_cases, _plugin_cases, save_models

    pretrained = save_models(tmp_path / "pretrained")
    cases = _cases(2) + _plugin_cases(2, pretrained) + _packed_cases(pretrained)
    _check_exact(_launch(HARNESS, 2, {"seq_len": SEQ, "cases": cases}, tmp_path, timeout=900), len(cases))


@pytest.mark.slow
def test_exact_four_ranks_with_replicated_kv_heads(tmp_path):
    # tiny-llama: 2 kv heads < degree 4, so every kv head is replicated on 2 ranks; 2 local heads per rank. Packed
    # documents' 4-rank cases (tests/test_documents.py) and the ring's (tests/test_ring_documents.py, at their own
    # length) join this launch: four ranks cost the most to start
    from tests.test_documents import _cases as document_cases
    from tests.test_ring_documents import four_rank_ring_cases

    cases = _cases(4) + document_cases(4) + four_rank_ring_cases()
    _check_exact(_launch(HARNESS, 4, {"seq_len": SEQ, "cases": cases}, tmp_path, timeout=900), len(cases))


# -- head chunk plan (no processes) ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "heads, kv_heads, degree, chunk",
    [
        (8, 2, 1, 1),
        (8, 2, 1, 8),
        (8, 2, 2, 1),
        (8, 2, 2, 2),
        (8, 2, 4, 1),
        (8, 2, 4, 2),
        (8, 4, 2, 1),
        (8, 4, 2, 4),
        (8, 8, 2, 2),
        (32, 8, 8, 1),
        (64, 8, 8, 2),
        (24, 8, 2, 2),
        (24, 8, 2, 4),
    ],
)
def test_chunk_plan_gives_every_query_its_kv_head(heads, kv_heads, degree, chunk):
    from trials.stack.upipe import ChunkPlan

    plan = ChunkPlan.build(heads, kv_heads, 16, degree, chunk)
    group, kc = heads // kv_heads, plan.kv_slots_per_rank
    covered = []
    for c in plan.chunks:
        assert len(c.kv_slots) == degree * kc
        for rank in range(degree):
            for j in range(chunk):
                query = c.q_head + rank * chunk + j
                covered.append(query)
                # query j of a rank uses slot j // (chunk / kc) (the kernel's GQA grouping)
                assert c.kv_slots[rank * kc + j * kc // chunk] == query // group
        assert all(c.kv_lo <= slot < c.kv_hi for slot in c.kv_slots)
    assert sorted(covered) == list(range(heads))
    assert sum(len(g) for g in plan.kv_groups()) == len(plan.chunks)


def test_chunk_plan_refuses_what_cannot_be_chunked():
    from trials.stack.upipe import ChunkPlan

    with pytest.raises(ValueError):
        ChunkPlan.build(8, 2, 2, 16, 3)  # 3 does not divide the 4 local heads
    with pytest.raises(ValueError):
        ChunkPlan.build(8, 3, 16, 2, 1)  # kv heads and degree do not divide one another


# -- memory ------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_each_knob_moves_the_peak_as_theory_says(tmp_path):
    seq, sp = 6144, {"ulysses_degree": 2}
    ckpt = {**sp, "activation_checkpointing": True}
    tiled = {**ckpt, "mlp_tile_tokens": 128, "loss_tile_tokens": 64}  # attention, not the logits, sets the peak
    cases = {
        "ulysses": sp,
        "mlp_tiles": {**sp, "mlp_tile_tokens": 512},
        "loss_tiles": {**sp, "loss_tile_tokens": 512},
        "checkpointing": ckpt,
        "offload": {**ckpt, "activation_offload_layers": 4},
        "tiled": tiled,
        "tiled+head_chunk=2": {**tiled, "head_chunk": 2},
        "tiled+head_chunk=1": {**tiled, "head_chunk": 1},
        "fsdp": {**tiled, "fsdp": True},
        "fsdp+optimizer_offload": {**tiled, "fsdp": True, "optimizer_offload": True},
    }
    spec = {"model": "tiny-llama", "seq_len": seq, "cases": [{"name": k, "techniques": v} for k, v in cases.items()]}
    r = _launch(MEMORY_HARNESS, 2, spec, tmp_path, timeout=900)["results"]
    peak = {name: row["peak_device_bytes"] for name, row in r.items()}
    layer_input = seq // 2 * 128 * 4  # one checkpointed layer input on a rank: [s/2, hidden] fp32

    # tiling the MLP and the loss, and checkpointing, each lower the peak of plain Ulysses
    assert peak["mlp_tiles"] < peak["ulysses"]
    assert peak["loss_tiles"] < peak["ulysses"]
    assert peak["checkpointing"] < peak["ulysses"]
    assert r["checkpointing"]["forward_device_bytes"] < r["ulysses"]["forward_device_bytes"] / 2
    # offload: the 4 checkpointed layer inputs leave the device after forward and sit on the host
    assert r["offload"]["forward_host_bytes"] == 4 * layer_input
    assert r["checkpointing"]["forward_device_bytes"] - r["offload"]["forward_device_bytes"] == 4 * layer_input
    assert peak["offload"] < peak["checkpointing"]
    # untied Ulysses: attention's working set scales with the chunk
    assert peak["tiled+head_chunk=1"] < peak["tiled+head_chunk=2"] < peak["tiled"]
    # optimizer offload: sharded params, grads, AdamW states on the host (fp32: 4 + 4 + 8 bytes per shard element)
    assert peak["fsdp+optimizer_offload"] < peak["fsdp"]
    assert r["fsdp+optimizer_offload"]["host_bytes"] >= 16 * _shard_elements("tiny-llama", 2)
    assert r["fsdp"]["host_bytes"] == 0


def _shard_elements(preset: str, world: int) -> int:
    from trials.models.config import load_model_config
    from trials.models.model import build_model

    return sum(p.numel() for p in build_model(load_model_config(preset)).parameters()) // world


# -- mixed precision (one process) -------------------------------------------------------------------------------


def test_bf16_autocast_stack_is_as_close_to_fp32_as_plain_autocast():
    """Unsharded bf16 runs under autocast (``trials.models.model.set_compute_dtype``); the custom autograd Functions
    (head chunking, tiled MLP recompute, tiled loss) must compute in bf16 like the plain model, not crash on
    mixed dtypes, and land as close to the fp32 gradients as plain autocast does."""
    import torch

    from trials.core.dist import Mesh
    from trials.models.config import load_model_config
    from trials.models.model import build_model, set_compute_dtype
    from trials.stack import apply
    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import forward_backward

    config, mesh = load_model_config("tiny-qwen3"), Mesh.single()
    batch = make_batch(synthetic_sample(0, 256, config["vocab_size"], 0), 0, 1, "cpu")

    def run(techniques: dict, dtype):
        model = build_model(config)
        apply(model, Techniques(**techniques), mesh)
        set_compute_dtype(model, dtype)
        loss = float(forward_backward(model, batch, mesh))
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        return loss, torch.cat([p.grad.flatten() for p in model.parameters()])

    ref_loss, ref_grad = run({}, torch.float32)
    plain_loss, plain_grad = run({}, torch.bfloat16)
    yardstick = float((plain_grad - ref_grad).norm() / ref_grad.norm())
    assert 0 < yardstick < 0.05
    full = {
        "head_chunk": 2,
        "activation_checkpointing": True,
        "activation_offload_layers": 2,
        "mlp_tile_tokens": 100,
        "loss_tile_tokens": 100,
        "norm_tile_tokens": 100,
    }
    for techniques in ({"head_chunk": 1}, full):
        loss, grad = run(techniques, torch.bfloat16)
        assert abs(loss - ref_loss) / ref_loss < 1e-3
        assert float((grad - ref_grad).norm() / ref_grad.norm()) < 1.5 * yardstick
