"""Exactness harness for the technique stack: many configurations in ONE process group launch.

    torchrun --nproc-per-node N tests/stack_harness.py CASES.json OUT.json      (N > 1)
    python tests/stack_harness.py CASES.json OUT.json                            (one rank)

CASES.json: {"seq_len": int, "cases": [{"name", "model", "techniques": {...}, "step": bool,
"batch_exchanges": bool, "pretrained": {"dir", "via"}, "documents": [lengths], "hf_batch": bool, "lora": {...},
"seq_len": int}]} (a case's own ``seq_len`` over the spec's: tables of other lengths share a launch).
Every rank builds,
for each (model, data-parallel size, pretrained folder), the plain single-process reference itself (cheap at these
sizes): the loss and parameter gradients of ``dp`` replicas (sample r for replica r, DESIGN.md's data rule)
averaged, plus the loss after one AdamW step. Then, per case: a fresh model with the techniques applied on the real
mesh, one forward + backward (``trials.training.step.forward_backward``), full gradients gathered (``DTensor.full_tensor()``
under FSDP) and compared with the reference; with ``"step": true`` also one optimizer step and the loss after it.

The model is ``trials.models.model.build_model``'s (seeded random weights), or with ``"pretrained"`` a Hugging Face model
folder (``dir``, saved by ``transformers``) through the plugin ``trials.hf``: ``via`` ``"from_pretrained"``
(``trials.hf.from_pretrained``: built on meta, each rank reads its shards) or ``"apply"`` (``trials.hf.apply`` on
``AutoModelForCausalLM.from_pretrained``); its reference is then the plain ``transformers`` model of that folder
(``attn_implementation="sdpa"``), wrapped in ``TrainingModel`` for the same loss sum.

With ``"documents"`` (lengths summing to seq_len) the sequence packs those documents
(``trials.training.data.make_batch(..., documents)``), and the reference is the plain model run on each document
*alone* (its own tokens, positions from 0, its last label ignored): the sum of the documents' loss sums over the
packed sequence's labelled tokens, and its gradient. With ``"hf_batch"`` the stack gets the sequence as a Hugging
Face batch through the plugin (``trials.hf.batch``: ``input_ids``, unshifted ``labels`` and ``position_ids`` that
restart at 0 at each document, the documents' only trace), the reference still the lengths run alone.

With ``"lora"`` (``trials.models.lora.LoraSpec.to_json``'s form) both models carry peft's LoRA adapters, drawn alike
(``seeded_model``); the reference is the plain model with them put in by peft itself, and the gradients compared are
the adapters' and, with ``trainable``, those of the modules trained whole (peft's trained copies, ``modules_to_save``,
against the stack's modules themselves); the base is frozen: a parameter with a gradient on one side only fails the
case.

Rank 0 writes OUT.json: {"world_size", "results": [{"name", "loss_rel", "grad_rel", "grad_rel_param",
"grad_maxabs_rel", "step_loss_rel"?, "seconds"}]}, where
    loss_rel       |loss - ref| / |ref|
    grad_rel       max over parameters of ||g - g_ref|| / ||g_ref|| (the parameter: grad_rel_param)
    grad_maxabs_rel  max over parameters of max|g - g_ref| / max|g_ref| (informational)
A failing case stops the job (exit 1, the traceback in OUT.json) rather than leave peers blocked in a collective.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

# exact comparisons: no thread-count changes between runs (MKL/OpenMP dynamic threading reorders reductions)
os.environ.setdefault("MKL_DYNAMIC", "FALSE")
os.environ.setdefault("OMP_DYNAMIC", "FALSE")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

LR = 1e-2


def full_grads(model) -> dict[str, torch.Tensor]:
    from trials.models.lora import TRAINED_COPY

    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        if grad is None:
            continue
        if hasattr(grad, "full_tensor"):
            grad = grad.full_tensor()
        # the plain model's name: peft trains a module of ``modules_to_save`` as a copy, the stack the module itself
        name = name.replace("_checkpoint_wrapped_module.", "").replace(TRAINED_COPY, ".")
        grads[name] = grad.detach().float().clone()
    return grads


def counted_grad_norm(model, mesh) -> tuple[float, list[str]]:
    """``trials.training.step.grad_norm`` and the device of every all-reduce it made (NCCL groups take device tensors
    only, so with optimizer offload a host-tensor collective would fail on a GPU node)."""
    import torch.distributed as dist

    from trials.training.step import grad_norm

    calls, real = [], dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        calls.append(str(tensor.device))
        return real(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        return float(grad_norm(model, mesh)), calls
    finally:
        dist.all_reduce = real


def seeded_model(model_config: dict, lora, plain: bool = False):
    """``build_model``'s seeded model, with ``lora``'s adapters when it has any: built on meta, the adapters put in,
    then materialised, so their values depend on the seed alone (as in a trial). The adapters: the stack's
    (``trials.models.lora.apply_lora``), or with ``plain`` peft's own ``inject_adapter_in_model`` (which freezes the
    rest itself): the reference."""
    from trials.models.lora import apply_lora
    from trials.models.model import build_model, materialize

    if not lora.on:
        return build_model(model_config)
    model = build_model(model_config, device="meta")
    if plain:
        from peft import inject_adapter_in_model

        inject_adapter_in_model(lora.peft_config(model.lm), model.lm)
        model.lora = lora  # how ``init_weights`` draws the adapters
    else:
        apply_lora(model, lora)
    materialize(model, "cpu")
    return model


def plain_pretrained(folder: str):
    """The plain ``transformers`` model of ``folder`` (fp32, torch SDPA), wrapped for the same loss sum."""
    from transformers import AutoModelForCausalLM

    from trials.models.model import TrainingModel

    return TrainingModel(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa"))


def stacked_pretrained(pretrained: dict, techniques, mesh):
    """The plugin's model of ``pretrained["dir"]``, loaded the way ``pretrained["via"]`` says."""
    from transformers import AutoModelForCausalLM

    from trials import hf

    if pretrained["via"] == "from_pretrained":
        return hf.from_pretrained(pretrained["dir"], techniques, mesh)
    if pretrained["via"] == "apply":
        return hf.apply(AutoModelForCausalLM.from_pretrained(pretrained["dir"], dtype=torch.float32), techniques, mesh)
    raise ValueError(f"unknown pretrained via {pretrained['via']!r}")


def documents_reference(
    model_config: dict, seq_len: int, dp: int, lengths, pretrained_dir: str | None = None, lora=None
) -> dict:
    """Plain model (``pretrained_dir``'s ``transformers`` model when given), one process, each document of each
    replica's sequence run alone: the replicas' mean loss and gradients, and the mean loss after one AdamW step."""
    from trials.kernels.documents import Documents
    from trials.models.lora import FULL_TRAINING
    from trials.training.data import make_batch, synthetic_sample

    model = (
        plain_pretrained(pretrained_dir)
        if pretrained_dir
        else seeded_model(model_config, lora or FULL_TRAINING, plain=True)
    )
    packed = Documents(tuple(lengths))
    valid = seq_len - len(packed.lengths)
    alone = []  # (replica, batch of one document)
    for replica in range(dp):
        tokens = synthetic_sample(replica, seq_len, model.config.vocab_size, 0)
        for start, end in packed.spans():  # the document's tokens and the one after it (its last label: ignored)
            alone.append(make_batch(tokens[start : end + 1], 0, 1, "cpu", documents=Documents((end - start,))))

    def mean_loss(backward: bool) -> float:
        total = 0.0
        for batch in alone:
            loss = model(batch.input_ids, batch.position_ids, batch.labels, scale=1.0 / (valid * dp))
            if backward:
                loss.backward()
            total += float(loss.detach())
        return total

    loss = mean_loss(backward=True)
    grads = full_grads(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    optimizer.step()
    with torch.no_grad():
        step_loss = mean_loss(backward=False)
    return {"loss": loss, "grads": grads, "step_loss": step_loss}


def reference(
    model_config: dict, seq_len: int, dp: int, pretrained_dir: str | None = None, documents=None, lora=None
) -> dict:
    """Plain model (with ``lora``'s adapters, if any), one process: dp replicas' mean gradients, mean loss, and mean
    loss after one AdamW step."""
    from trials.core.dist import Mesh
    from trials.models.lora import FULL_TRAINING
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import forward_backward

    if documents:
        return documents_reference(model_config, seq_len, dp, documents, pretrained_dir, lora)
    mesh = Mesh.single()
    model = (
        plain_pretrained(pretrained_dir)
        if pretrained_dir
        else seeded_model(model_config, lora or FULL_TRAINING, plain=True)
    )
    batches = [make_batch(synthetic_sample(r, seq_len, model.config.vocab_size, 0), 0, 1, "cpu") for r in range(dp)]
    loss = sum(float(forward_backward(model, batch, mesh)) for batch in batches) / dp
    for param in model.parameters():
        if param.grad is not None:
            param.grad /= dp
    grads = full_grads(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    optimizer.step()
    with torch.no_grad():
        step_loss = (
            sum(float(model(b.input_ids, b.position_ids, b.labels, scale=1.0 / b.valid_tokens)) for b in batches) / dp
        )
    return {"loss": loss, "grads": grads, "step_loss": step_loss}


def run_case(case: dict, seq_len: int, refs: dict, meshes: dict) -> dict:
    import torch.distributed as dist

    from trials.core.dist import build_mesh
    from trials.kernels.documents import Documents
    from trials.models.config import load_model_config
    from trials.models.lora import LoraSpec
    from trials.stack import apply
    from trials.stack.techniques import Techniques
    from trials.training.data import mesh_batch, synthetic_sample
    from trials.training.step import forward_backward, global_loss

    start = time.perf_counter()
    model_config = load_model_config(case["model"])
    techniques = Techniques.from_dict(case["techniques"], model_config["num_hidden_layers"])
    world = int(os.environ.get("WORLD_SIZE", 1))
    techniques.validate(model_config, world, seq_len)
    groups = (techniques.ulysses_degree, techniques.ring_degree)
    if groups not in meshes:
        from trials.core.dist import init_mesh

        sp, ring = groups
        meshes[groups] = (
            build_mesh(sp, torch.device("cpu"), ring_degree=ring) if dist.is_initialized() else init_mesh(sp)
        )
    mesh = meshes[groups]
    pretrained = case.get("pretrained")
    lengths = tuple(case.get("documents") or ())
    lora = LoraSpec.from_json(case.get("lora"))
    key = (case["model"], mesh.dp_size, pretrained["dir"] if pretrained else None, lengths, lora, seq_len)
    if key not in refs:
        refs[key] = reference(model_config, seq_len, mesh.dp_size, key[2], lengths, lora)
    ref = refs[key]

    if pretrained:
        model = stacked_pretrained(pretrained, techniques, mesh)
    else:
        model = seeded_model(model_config, lora)
        apply(model, techniques, mesh)
    if case.get("batch_exchanges"):  # untied Ulysses with one all-to-all per step instead of one per tensor
        for layer in model.lm.model.layers:
            layer.self_attn.forward.batch_exchanges = True
    tokens = synthetic_sample(mesh.dp_rank, seq_len, model.config.vocab_size, 0)
    documents = Documents(lengths) if lengths else None
    if case.get("hf_batch"):  # the plugin's seam: a Hugging Face batch, the documents only in its position_ids
        from trials import hf  # (with documents: the last document's last label is ignored either way)

        ids = tokens[:seq_len].unsqueeze(0)
        positions = torch.tensor(documents.positions()).unsqueeze(0)
        batch = hf.batch({"input_ids": ids, "labels": ids, "position_ids": positions}, mesh)
    else:
        batch = mesh_batch(tokens, mesh, documents=documents)
    loss = global_loss(forward_backward(model, batch, mesh), mesh)
    grads = full_grads(model)
    result = {"name": case["name"], "loss": loss, "loss_rel": abs(loss - ref["loss"]) / abs(ref["loss"])}
    if set(grads) != set(ref["grads"]):
        missing = sorted(set(ref["grads"]) ^ set(grads))
        raise AssertionError(f"{case['name']}: gradients differ in names: {missing[:4]}")
    worst, worst_name, worst_abs = 0.0, None, 0.0
    for name, expected in ref["grads"].items():
        diff = grads[name] - expected
        rel = float(diff.norm() / expected.norm().clamp_min(1e-30))
        worst_abs = max(worst_abs, float(diff.abs().max() / expected.abs().max().clamp_min(1e-30)))
        if rel > worst:
            worst, worst_name = rel, name
    result.update(grad_rel=worst, grad_rel_param=worst_name, grad_maxabs_rel=worst_abs)
    norm, collectives = counted_grad_norm(model, mesh)
    ref_norm = float(sum(float(g.double().square().sum()) for g in ref["grads"].values()) ** 0.5)
    result.update(grad_norm_rel=abs(norm - ref_norm) / ref_norm, grad_norm_collectives=collectives)
    if case.get("step"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            scaled = model(
                batch.input_ids,
                batch.position_ids,
                batch.labels,
                scale=mesh.cp_degree / batch.valid_tokens,
                documents=batch.documents,
            )
        step_loss = global_loss(scaled, mesh)
        result["step_loss_rel"] = abs(step_loss - ref["step_loss"]) / abs(ref["step_loss"])
    result["seconds"] = round(time.perf_counter() - start, 3)
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out_path = Path(argv[1])
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        torch.set_num_threads(1)  # ranks share the machine's cores
    results, refs, meshes = [], {}, {}
    try:
        if world > 1:
            from trials.core.dist import init_mesh

            meshes[(world, 1)] = init_mesh(world, timeout_s=300)
        for case in spec["cases"]:
            results.append(run_case(case, case.get("seq_len", spec["seq_len"]), refs, meshes))
            if rank == 0:
                print(json.dumps(results[-1]), flush=True)
    except Exception as exc:
        if rank == 0 or world == 1:
            out_path.write_text(
                json.dumps(
                    {
                        "world_size": world,
                        "results": results,
                        "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}",
                    }
                )
            )
        print(traceback.format_exc(), file=sys.stderr, flush=True)
        os._exit(1)
    if rank == 0:
        out_path.write_text(json.dumps({"world_size": world, "results": results}, indent=1))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
