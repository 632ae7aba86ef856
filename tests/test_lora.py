"""LoRA adapters (``trials.models.lora``): the workload's declaration, what ``"all-linear"`` adapts, and a backward that
runs no GEMM for a frozen weight. Exactness through every knob against peft's plain model: ``tests/test_stack.py``'s
``_lora_cases`` and ``tests/test_families.py`` (fused q/k/v, experts)."""

from __future__ import annotations

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from tests.model_families import tiny_configs
from trials.models.lora import ALL_LINEAR, FULL_TRAINING, LoraSpec, apply_lora, linear_module_names

SEQ = 256


def test_a_lora_spec_reads_back_what_it_writes_and_refuses_bad_values():
    spec = LoraSpec(rank=16, alpha=32, targets=["q_proj", "v_proj"])
    assert spec.targets == ("q_proj", "v_proj") and spec.scaling == 2.0
    assert LoraSpec.from_json(spec.to_json()) == spec
    assert LoraSpec.from_json(None) == FULL_TRAINING and FULL_TRAINING.to_json() is None
    assert LoraSpec(rank=8).scaling == 2.0 and LoraSpec(rank=8).targets == ALL_LINEAR  # alpha: twice the rank
    assert LoraSpec(rank=16).describe() == "LoRA rank 16 (alpha 32) on all linear layers"
    whole = LoraSpec(rank=8, alpha=16.0, trainable=["embed_tokens", "norm"])  # LongLoRA's modules trained whole
    assert whole.trainable == ("embed_tokens", "norm") and LoraSpec.from_json(whole.to_json()) == whole
    assert whole.peft_config().modules_to_save == ["embed_tokens", "norm"] and LoraSpec.of(whole.peft_config()) == whole
    assert whole.describe().endswith("on all linear layers, embed_tokens and norm trained whole")
    for bad, said in (
        ({"rank": -1}, "non-negative"),
        ({"rank": 4, "alpha": 0}, "alpha must be positive"),
        ({"rank": 4, "targets": "attention"}, "targets must be"),
        ({"rank": 4, "targets": []}, "module names"),
        ({"rank": 4, "dropout": 0.1}, "unknown lora key 'dropout'"),
        ({"rank": 0, "trainable": ["norm"]}, "need a LoRA rank"),
        ({"rank": 4, "trainable": [""]}, "must be module names"),
        ("16", "must be a mapping"),
    ):
        with pytest.raises(ValueError, match=said):
            LoraSpec.from_json(bad)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-phi3", "tiny-qwen3-moe"])
def test_all_linear_adapts_each_linear_layer_but_the_head_and_freezes_the_rest(name, tmp_path):
    """Every decoder ``nn.Linear`` (a fused ``qkv_proj`` included) gets A and B; the head, embeddings, norms, a mixture's
    experts and router stay frozen, as does every base weight."""
    from tests.model_families import save
    from trials.models.config import load_model_config
    from trials.models.model import build_model

    path = name if name == "tiny-llama" else str(save(tiny_configs()[name], tmp_path / name))
    model = build_model(load_model_config(path), device="meta")
    linear = set(linear_module_names(model.lm))
    apply_lora(model, LoraSpec(rank=4))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    adapted = {n.split(".")[-4] for n in trainable}
    expected = {
        "tiny-llama": {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"},
        "tiny-phi3": {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"},
        "tiny-qwen3-moe": {"q_proj", "k_proj", "v_proj", "o_proj"},
    }[name]
    assert adapted == expected and linear == expected
    layers = model.config.num_hidden_layers
    assert len(trainable) == 2 * layers * len(expected)  # A and B of each, nothing else
    assert all(".lora_A." in n or ".lora_B." in n for n in trainable)


class _GemmFlops(TorchDispatchMode):
    """FLOPs of every matrix product dispatched (mm, addmm and its in-place form, bmm, baddbmm)."""

    PRODUCTS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "baddbmm_"}

    def __init__(self):
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__.split(".")[0]
        if name in self.PRODUCTS:
            a, b = (args[0], args[1]) if name in ("mm", "bmm") else (args[1], args[2])
            batch = a.shape[0] if a.dim() == 3 else 1
            self.flops += 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]
        return func(*args, **(kwargs or {}))


def _step_flops(techniques: dict, base_trainable: bool) -> int:
    from tests.stack_harness import seeded_model
    from trials.core.dist import Mesh
    from trials.models.config import load_model_config
    from trials.stack import apply
    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, synthetic_sample

    config = load_model_config("tiny-llama")
    model = seeded_model(config, LoraSpec(rank=4, init_lora_weights=False))
    apply(model, Techniques(**techniques), Mesh.single())
    if base_trainable:
        for param in model.parameters():
            param.requires_grad_(True)
    batch = make_batch(synthetic_sample(0, SEQ, config["vocab_size"], 0), 0, 1, "cpu")
    with _GemmFlops() as counted:  # the forward too: the tiled loss takes its gradients there
        model(batch.input_ids, batch.position_ids, batch.labels, scale=1.0 / batch.valid_tokens).backward()
    return counted.flops


@pytest.mark.parametrize(
    "techniques",
    [
        {"head_chunk": 1},  # head-chunked attention runs its projections' backward itself
        {"head_chunk": 2, "activation_checkpointing": True, "mlp_tile_tokens": 96, "loss_tile_tokens": 80},
    ],
    ids=["head_chunk", "head_chunk+checkpointing+tiles"],
)
def test_a_lora_backward_runs_no_gemm_for_a_frozen_weight(techniques):
    """A forward and backward with the base frozen run exactly the weight-gradient GEMMs of every base linear weight
    (2 x tokens x in x out each, the head's included) fewer than the same model with its base trainable: what a
    frozen weight saves, through the stack's own backward passes (head chunks, tiled MLP and loss) too."""
    from trials.models.config import load_model_config

    config = load_model_config("tiny-llama")
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * config["intermediate_size"]  # q, o; k, v; gate, up, down
    weight_gradient_flops = 2 * SEQ * (layers * per_layer + h * vocab)
    saved = _step_flops(techniques, base_trainable=True) - _step_flops(techniques, base_trainable=False)
    assert saved == weight_gradient_flops


def test_the_oracle_counts_optimizer_states_for_the_adapters_alone():
    """A LoRA step's AdamW holds two fp32 moments per adapter parameter and a step count per adapter tensor: the
    frozen base has none (and no gradient at the peak)."""
    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend
    from autotune.core.hardware import load_hardware
    from trials.models.config import load_model_config
    from trials.models.model import build_model
    from trials.stack.techniques import Techniques

    config = load_model_config("tiny-llama")
    lora = LoraSpec(rank=8)
    adapters = [p for p in apply_lora(build_model(config, device="meta"), lora).parameters() if p.requires_grad]
    evaluation = Evaluation(config, Techniques(), 2048, 1, load_hardware("cpu"), lora=lora)
    record = PlanBackend().evaluate(evaluation)
    assert record.status == "ok", record.error
    assert record.breakdown["optimizer"] == 8 * sum(p.numel() for p in adapters) + 4 * len(adapters)
    full = PlanBackend().evaluate(Evaluation(config, Techniques(), 2048, 1, load_hardware("cpu")))
    assert full.breakdown["optimizer"] > 20 * record.breakdown["optimizer"]


def test_a_lora_search_stores_its_adapters_and_a_resume_for_other_adapters_is_refused(tmp_path):
    """``search --lora-rank``: best.json and pareto.json carry the adapters, ``estimate --config best.json`` predicts
    the same step (the config travels), and the same folder refuses a search for full training."""
    import json

    from conftest import here, tiny_plan_search

    out = tmp_path / "search"  # each command in this process (conftest.here): the claim is not the process
    done = here("search", *tiny_plan_search(), "--lora-rank", "8", "--trials", "6", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "LoRA rank 8 (alpha 16) on all linear layers" in done.stdout + done.stderr  # the header line
    assert "Pareto front (sequence length vs tokens/s), LoRA rank 8 (alpha 16)" in " ".join(done.stdout.split())
    best = json.loads((out / "best.json").read_text())
    assert best["lora"] == {"rank": 8, "alpha": None, "targets": ALL_LINEAR, "init_lora_weights": True}
    assert json.loads((out / "pareto.json").read_text())["lora"] == best["lora"]
    estimate = here("estimate", "--config", str(out / "best.json"), "--json")
    assert estimate.returncode == 0, estimate.stderr[-2000:]
    assert json.loads(estimate.stdout)["peak_device_bytes"] == best["predicted"]["peak_device_bytes"]
    again = here("search", *tiny_plan_search(), "--trials", "6", "--out", str(out))
    assert again.returncode == 2
    assert "is for LoRA rank 8 (alpha 16) on all linear layers, not full training" in again.stderr
