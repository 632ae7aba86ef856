"""Model families (issue 37): every family ``trials.models.families`` declares runs exactly what ``transformers`` runs.

- Semantics: a tiny model of each family built by ``trials.models.model.build_model`` (autotune's attention, windows,
  softcaps, fused q/k/v, Gemma norms, experts) gives the loss and gradients of ``transformers``' own eager model.
- Windows: ``Family.layer_windows`` is what the model's attention modules pass, layer by layer.
- The stack: under Ulysses, head chunking, checkpointing, offload and every tile, each tiny family equals its plain
  model on 1 and 2 ranks (``tests/stack_harness.py``); with LoRA adapters too for a fused ``qkv_proj`` and experts.
  The 2-rank launch also runs the windowed families' packed documents (``tests/test_documents.py``).
- Planning: ``autotune estimate`` runs on the ``config.json`` that ``transformers`` writes for each published shape.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.model_families import TINY_WINDOW, real_configs, save, tiny_configs
from tests.test_stack import HARNESS, LORA, _check_exact, _launch

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

SEQ = 256  # above TINY_WINDOW: windowed layers attend a band
DENSE = ("tiny-mistral", "tiny-qwen2", "tiny-qwen3-window", "tiny-gemma3", "tiny-gemma2", "tiny-phi3")
EXPERTS = ("tiny-qwen3-moe", "tiny-mixtral")


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("families")
    return {name: str(save(config, root / name)) for name, config in tiny_configs().items()}


def _loss_and_grads(model, ids):
    positions = torch.arange(ids.shape[1]).unsqueeze(0)
    loss = model(ids, positions, ids, 1.0)
    loss.backward()
    return float(loss.detach()), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", DENSE + EXPERTS)
def test_each_family_equals_transformers_eager_model(name, tiny_paths):
    from transformers import AutoModelForCausalLM

    from trials.models.config import load_model_config
    from trials.models.model import TrainingModel, build_model, hf_config

    config = load_model_config(tiny_paths[name])
    ours = build_model(config)
    eager_config = hf_config(config)
    eager_config._attn_implementation = "eager"
    eager = AutoModelForCausalLM.from_config(eager_config, attn_implementation="eager")
    eager.load_state_dict(ours.lm.state_dict())
    ids = torch.randint(0, config["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(0))
    loss, grads = _loss_and_grads(ours, ids)
    eager_loss, eager_grads = _loss_and_grads(TrainingModel(eager), ids)
    with torch.no_grad():  # transformers' own logits (its final softcap included) give the same loss
        logits = eager(ids).logits.float()[0]
    assert abs(float(torch.nn.functional.cross_entropy(logits, ids[0], reduction="sum")) - loss) <= 1e-5 * loss
    assert abs(loss - eager_loss) <= 1e-5 * abs(eager_loss)
    assert list(grads) == list(eager_grads)
    for key, grad in grads.items():
        assert float((grad - eager_grads[key]).norm()) <= 1e-4 * float(eager_grads[key].norm()) + 1e-12, key


def test_a_window_changes_the_model(tiny_paths):
    """The windowed family's loss differs from the same weights attending the whole causal triangle."""
    from trials.models.config import load_model_config
    from trials.models.model import build_model

    config = load_model_config(tiny_paths["tiny-mistral"])
    ids = torch.randint(0, config["vocab_size"], (1, SEQ), generator=torch.Generator().manual_seed(0))
    windowed = float(build_model(config)(ids, torch.arange(SEQ)[None], ids, 1.0))
    full = float(build_model({**config, "sliding_window": None})(ids, torch.arange(SEQ)[None], ids, 1.0))
    assert abs(windowed - full) > 10 * 1e-5 * abs(full)  # ten times the tolerance the exact tests allow


@pytest.mark.parametrize("name", DENSE + EXPERTS)
def test_layer_windows_are_what_the_attention_modules_pass(name, tiny_paths):
    from trials.kernels import attention
    from trials.models.config import layer_windows, load_model_config
    from trials.models.model import build_model

    config = load_model_config(tiny_paths[name])
    model = build_model(config)
    passed = []

    def probe(module, query, key, value, attention_mask, scaling=None, **kwargs):
        passed.append(kwargs.get("sliding_window"))
        return attention.causal_attention(query, key, value, scaling, window=kwargs.get("sliding_window")), None

    for layer in model.layers:
        layer.self_attn.autotune_attention = probe
    model(torch.zeros(1, 8, dtype=torch.long), torch.arange(8)[None], torch.zeros(1, 8, dtype=torch.long), 1.0)
    assert passed == layer_windows(config)
    expected = {"tiny-mistral": {TINY_WINDOW}, "tiny-gemma3": {TINY_WINDOW, None}, "tiny-qwen2": {None}}
    if name in expected:
        assert set(passed) == expected[name]


FULL = {
    "fsdp": True,
    "head_chunk": 1,
    "activation_checkpointing": True,
    "activation_offload_layers": 2,
    "mlp_tile_tokens": 96,
    "loss_tile_tokens": 80,
    "norm_tile_tokens": 112,
}


def _family_cases(paths: dict, degree: int) -> list[dict]:
    u = {"ulysses_degree": degree}
    rows = []
    for name in DENSE + EXPERTS:
        cases = {
            "ulysses" if degree > 1 else "plain": {},
            "head_chunk=1": {"head_chunk": 1},
            "head_chunk=2+checkpointing": {"head_chunk": 2, "activation_checkpointing": True},
            "full": FULL,
        }
        for label, techniques in cases.items():
            rows.append(
                {"name": f"{name}/{label}", "model": paths[name], "techniques": {**u, **techniques}, "step": False}
            )
    for name in ("tiny-phi3", "tiny-qwen3-moe"):  # LoRA on a fused qkv_proj (row blocks of B); experts frozen
        for label, techniques in {"lora+head_chunk=1": {"head_chunk": 1}, "lora+full": FULL}.items():
            row = {"name": f"{name}/{label}", "model": paths[name], "techniques": {**u, **techniques}, "step": False}
            rows.append({**row, "lora": LORA})
    return rows


@pytest.mark.parametrize("world", [1, 2])
def test_every_family_is_exact_under_the_stack(world, tiny_paths, tmp_path):
    cases = _family_cases(tiny_paths, world)
    if world == 2:  # the windowed families' packed documents (tests/test_documents.py) share the 2-rank launch
        from tests.test_documents import FAMILY_SEQ, windowed_cases

        assert FAMILY_SEQ == SEQ
        cases += windowed_cases(2, tiny_paths)
    report = _launch(HARNESS, world, {"seq_len": SEQ, "cases": cases}, tmp_path, timeout=900)
    _check_exact(report, len(cases))


# -- planning the published shapes ---------------------------------------------------------------------------------

PLAN_TECHNIQUES = {  # flash-attn: the kernel that runs windows on GPUs; Ulysses 4 divides every shape's heads
    "attention": "flash",
    "fsdp": True,
    "ulysses_degree": 4,
    "activation_checkpointing": True,
    "loss_tile_tokens": 4096,
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(real_configs()))
def test_estimate_and_a_plan_search_run_on_each_published_shape(name, tmp_path, capsys):
    # in-process (the CLI's own entry point): a fresh interpreter per command would import torch again for each
    from autotune.cli import main

    path = save(real_configs()[name], tmp_path / name)
    config = tmp_path / "config.json"
    config.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": str(path),
                "hardware": "h100-sxm",
                "gpus": 8,
                "seq_len": 65536,
                "techniques": PLAN_TECHNIQUES,
                "predicted": None,
                "measured": None,
            }
        )
    )
    assert main(["estimate", "--config", str(config), "--json"]) == 0, capsys.readouterr().err[-2000:]
    record = json.loads(capsys.readouterr().out)
    assert record["status"] in ("ok", "oom") and record["tokens_per_s"] > 0, record
    out = tmp_path / "search"
    search = ["search", "--model", str(path), *"--target 64K --backend plan --trials 2 --out".split(), str(out)]
    assert main(search) == 0, capsys.readouterr().err[-2000:]
    front = json.loads((out / "pareto.json").read_text())
    assert front["front"], front


def test_pretrained_weights_of_new_families_load_through_the_plugin(tmp_path):
    """A windowed, an alternating (Gemma's scaled embedding, its norms) and two MoE models saved by ``transformers``
    with their own weights: ``trials.hf.from_pretrained`` and ``trials.hf.apply`` with the stack give the loss and
    gradients of the plain ``transformers`` model of the folder (one rank)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from trials.models.config import load_model_config

    models = {
        name: AutoConfig.for_model(**{k: v for k, v in load_model_config(name).items() if not k.startswith("_")})
        for name in ("tiny-mistral", "tiny-gemma3", "tiny-qwen3-moe")
    }
    models["tiny-mixtral"] = tiny_configs()["tiny-mixtral"]  # its checkpoint names experts w1/w2/w3, per expert
    cases = []
    for index, (name, config) in enumerate(models.items()):
        torch.manual_seed(4321 + index)
        folder = tmp_path / name
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        for via in ("from_pretrained", "apply"):
            cases.append(
                {
                    "name": f"{name}/{via}",
                    "model": str(folder / "config.json"),
                    "techniques": {"head_chunk": 2, "activation_checkpointing": True, "mlp_tile_tokens": 96},
                    "step": False,
                    "pretrained": {"dir": str(folder), "via": via},
                }
            )
    report = _launch(HARNESS, 1, {"seq_len": 512, "cases": cases}, tmp_path, timeout=600)
    _check_exact(report, len(cases))
