"""The technique stack as a plugin for Hugging Face training (``trials.hf``) trains the plain model exactly.

Models are saved by ``transformers`` itself (``save_pretrained``; tiny-qwen3 in several safetensors files with an
index), with weights of their own (not the seeded ones trials draw), so a tensor the plugin fails to load shows.

- In this process, one rank: a plain ``transformers`` loop (the model's own ``labels=`` loss, AdamW) against the
  plugin's model in ``trials.training.step.train_step``: the same loss, gradients and loss after two steps.
- The stack tests' matrix (``tests/test_stack.py``'s cases: every knob alone, pairs, the full stack, data
  parallel) through ``tests/stack_harness.py`` on 1 and 2 ranks, the model loaded by ``trials.hf.from_pretrained``
  (and a few by ``trials.hf.apply``), against the plain ``transformers`` model of the same folder. These cases
  (``_plugin_cases``, ``_packed_cases``) run in ``tests/test_stack.py``'s launches of the same world size
  (``test_exact_one_rank``, ``test_exact_two_ranks``): starting ranks costs more than the cases.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_stack import GRAD_RTOL, LOSS_RTOL, SEQ, _cases

from trials.models.config import load_model_config

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

MODELS = ("tiny-llama", "tiny-qwen3")
APPLY_CASES = ("full", "fsdp", "head_chunk=1+checkpointing", "dp2+full")  # also run through ``trials.hf.apply``


def save_models(root: Path) -> dict[str, str]:
    """{preset: folder}: each tiny preset as ``transformers`` saves a model of it, with its own random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folders = {}
    for index, name in enumerate(MODELS):
        values = {k: v for k, v in load_model_config(name).items() if not k.startswith("_")}
        torch.manual_seed(1234 + index)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**values))
        folder = root / name
        # tiny-qwen3 in several files: the loader follows model.safetensors.index.json
        model.save_pretrained(folder, max_shard_size="300KB" if name == "tiny-qwen3" else "1GB")
        folders[name] = str(folder)
    assert (root / "tiny-qwen3" / "model.safetensors.index.json").is_file()
    return folders


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> dict[str, str]:
    return save_models(tmp_path_factory.mktemp("pretrained"))


def _plugin_cases(degree: int, pretrained: dict[str, str]) -> list[dict]:
    rows = []
    for case in _cases(degree):
        rows.append({**case, "pretrained": {"dir": pretrained[case["model"]], "via": "from_pretrained"}})
        if case["name"].split("/", 1)[1] in APPLY_CASES:
            rows.append(
                {
                    **case,
                    "name": case["name"] + " (hf.apply)",
                    "pretrained": {"dir": pretrained[case["model"]], "via": "apply"},
                }
            )
    return rows


PACKED_LENGTHS = [100, 1, 236, 175]  # uneven, one of a single token; on 2 ranks a boundary falls inside each shard


def _packed_cases(pretrained: dict[str, str]) -> list[dict]:
    """Packed documents through the plugin, on 2 ranks (in ``tests/test_stack.py::test_exact_two_ranks``' launch): a
    ``transformers`` model stacked by ``trials.hf.apply`` (Ulysses 2, head chunks, checkpointing) given a Hugging Face
    batch whose ``position_ids`` restart at 0 at each document (``trials.hf.batch``) trains as the plain model run on
    each document alone: loss and gradients, and (tiny-llama, with FSDP) the loss after one step."""
    techniques = {"ulysses_degree": 2, "head_chunk": 1, "activation_checkpointing": True}
    full = {"fsdp": True, "activation_offload_layers": 1, "mlp_tile_tokens": 96, "loss_tile_tokens": 80}
    return [
        {
            "name": f"{model}/hf.apply/documents/ulysses2+head_chunk=1+checkpointing" + ("+fsdp+tiles" if step else ""),
            "model": model,
            "techniques": {**techniques, **(full if step else {})},
            "step": step,
            "documents": PACKED_LENGTHS,
            "hf_batch": True,
            "pretrained": {"dir": pretrained[model], "via": "apply"},
        }
        for model in MODELS
        for step in ((False, True) if model == "tiny-llama" else (False,))
    ]


# -- a plain transformers loop, in this process ---------------------------------------------------------------------

LOOP_TECHNIQUES = {  # every knob that needs no process group (fsdp starts one: the harness runs those)
    "head_chunk": 2,
    "activation_checkpointing": True,
    "activation_offload_layers": 2,
    "mlp_tile_tokens": 96,
    "loss_tile_tokens": 80,
    "norm_tile_tokens": 112,
}


@pytest.mark.parametrize("via", ["from_pretrained", "apply"])
def test_the_plugin_trains_like_a_plain_transformers_loop(pretrained, via):
    """Two AdamW steps on one window: the model's own ``labels=`` loss on ``tokens`` (seq + 1 ids: the last one only
    a label) against ``trials.training.step.train_step`` on the plugin's model; first-step loss and gradients, second-step
    loss (after the optimizer step)."""
    from stack_harness import full_grads
    from transformers import AutoModelForCausalLM

    from trials import hf
    from trials.core.dist import Mesh
    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, synthetic_sample
    from trials.training.step import forward_backward, global_loss, make_optimizer, train_step

    folder, mesh = pretrained["tiny-qwen3"], Mesh.single()
    techniques = Techniques(**LOOP_TECHNIQUES)
    tokens = [synthetic_sample(0, SEQ, load_model_config("tiny-qwen3")["vocab_size"])] * 2  # the same window twice

    plain = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2, foreach=False)
    plain_losses = []
    for step, ids in enumerate(tokens):
        loss = plain(input_ids=ids[None], labels=ids[None]).loss
        loss.backward()
        if step == 0:
            plain_grads = {f"lm.{n}": p.grad.clone() for n, p in plain.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        plain_losses.append(float(loss))

    if via == "from_pretrained":
        model = hf.from_pretrained(folder, techniques, mesh)
    else:
        model = hf.apply(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32), techniques, mesh)
    assert model.mesh is mesh and model.lm.config._attn_implementation == "autotune"
    batch = make_batch(tokens[0], mesh.sp_rank, mesh.sp_degree, mesh.device)
    first = global_loss(forward_backward(model, batch, mesh), mesh)
    grads = full_grads(model)
    assert set(grads) == set(plain_grads)
    worst = max(float((grads[n] - g).norm() / g.norm()) for n, g in plain_grads.items())
    model.zero_grad(set_to_none=True)
    optimizer = make_optimizer(model, techniques, mesh, lr=1e-2)
    losses = [train_step(model, optimizer, make_batch(ids, 0, 1, "cpu"), mesh).loss for ids in tokens]

    assert first == pytest.approx(plain_losses[0], rel=LOSS_RTOL)
    assert worst < GRAD_RTOL
    assert losses == pytest.approx(plain_losses, rel=LOSS_RTOL)
    assert losses[1] < losses[0] - 0.1  # the first step trained the weights the second loss sees


def test_a_checkpoint_that_does_not_fit_the_model_is_refused(pretrained, tmp_path):
    from safetensors.torch import load_file, save_file

    from trials import hf
    from trials.core.dist import Mesh
    from trials.stack.techniques import Techniques

    source = pretrained["tiny-llama"]
    tensors = load_file(f"{source}/model.safetensors")
    config = json.loads(open(f"{source}/config.json").read())
    for name, changed in (
        ("missing", {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}),
        ("extra", {**tensors, "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)}),
        ("reshaped", {**tensors, "lm_head.weight": tensors["lm_head.weight"][:-1]}),
    ):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        save_file(changed, str(folder / "model.safetensors"))
        with pytest.raises((KeyError, ValueError), match="model.layers|lm_head"):
            hf.from_pretrained(folder, Techniques(), Mesh.single())


def test_a_batch_reads_its_documents_from_position_ids_and_refuses_what_it_cannot_run():
    """``trials.hf.batch``: position ids restarting at 0 give the documents, the label at each document's last token
    ignored; position ids that do not count 0, 1, 2 ... within a document, and packed documents a ring cannot split,
    are refused in one line naming ``position_ids``; a ring holds its zigzag chunks of each document."""
    from types import SimpleNamespace

    from trials import hf
    from trials.core.dist import Mesh
    from trials.kernels.documents import Documents

    ids = torch.arange(10).unsqueeze(0)
    packed = Documents((4, 1, 5))
    batch = hf.batch(
        {"input_ids": ids, "labels": ids, "position_ids": torch.tensor(packed.positions()).unsqueeze(0)}, Mesh.single()
    )
    assert batch.documents == packed and batch.position_ids.tolist() == [packed.positions().tolist()]
    assert batch.labels.tolist() == [[1, 2, 3, -100, -100, 6, 7, 8, 9, -100]] and batch.valid_tokens == 7
    plain = hf.batch({"input_ids": ids, "labels": ids, "position_ids": torch.arange(10).unsqueeze(0)}, Mesh.single())
    assert plain.documents is None and plain.labels.tolist() == [[*range(1, 10), -100]]

    ring = SimpleNamespace(sp_degree=1, sp_rank=0, ring_degree=2, ring_rank=0)
    for positions, said in (
        ([0, 1, 2, 4, 0, 1, 2, 3, 4, 5], "token 3 has position 4, not 3"),
        ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "starts at position 0"),
    ):
        with pytest.raises(ValueError, match=said) as refused:
            hf.batch({"input_ids": ids, "position_ids": torch.tensor([positions])}, Mesh.single())
        assert str(refused.value).startswith("position_ids: ") and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"^position_ids: ring_degree 2 splits each packed document into 2 x "):
        hf.batch({"input_ids": ids, "position_ids": torch.tensor(packed.positions()).unsqueeze(0)}, ring)
    # documents of multiples of 2 x ring: ring rank 0 holds chunks 0 and 3 of each, positions restarting per document
    split = Documents((4, 8))
    ids = torch.arange(12).unsqueeze(0)
    held = hf.batch(
        {"input_ids": ids, "labels": ids, "position_ids": torch.tensor(split.positions()).unsqueeze(0)}, ring
    )
    assert held.input_ids.tolist() == [[0, 3, 4, 5, 10, 11]] and held.position_ids.tolist() == [[0, 3, 0, 1, 6, 7]]
    assert held.labels.tolist() == [[1, -100, 5, 6, 11, -100]] and held.documents == split
