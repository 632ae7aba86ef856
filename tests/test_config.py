import json
from pathlib import Path

import pytest
from conftest import run_cli

from autotune.core.hardware import load_hardware
from trials.core.errors import ConfigError
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques
from trials.training.config_file import SCHEMA, load_config_file, parse_config


def full_stack(**overrides):
    values = dict(
        fsdp=True,
        optimizer_offload=True,
        ulysses_degree=8,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers=32,
        mlp_tile_tokens=65536,
        loss_tile_tokens=65536,
        attention="flash",
    )
    values.update(overrides)
    return Techniques(**values)


def test_full_stack_is_valid_for_llama3_8b():
    full_stack().validate(load_model_config("llama3-8b"), gpus=8, seq_len=5_242_880)


@pytest.mark.parametrize(
    "overrides, gpus, reason",
    [
        ({"ulysses_degree": 3}, 8, "does not divide the GPU count"),
        ({"ulysses_degree": 8}, 4, "does not divide the GPU count"),
        ({"head_chunk": 3}, 8, "does not divide"),
        ({"head_chunk": 5}, 8, "between 1 and"),
        ({"activation_checkpointing": False}, 8, "needs activation_checkpointing"),
        ({"fsdp": False}, 8, "optimizer_offload needs fsdp"),
        ({"activation_offload_layers": 33}, 8, "between 0 and 32"),
        ({"attention": "eager"}, 8, "must be one of"),
        ({"mlp_tile_tokens": -1}, 8, "must be 0"),
    ],
)
def test_impossible_combinations_are_refused_with_reason(overrides, gpus, reason):
    with pytest.raises(ConfigError, match=reason):
        full_stack(**overrides).validate(load_model_config("llama3-8b"), gpus=gpus)


def test_ulysses_degree_must_divide_query_heads():
    config = dict(load_model_config("llama3-8b"), num_attention_heads=24, num_key_value_heads=8)
    with pytest.raises(ConfigError, match="query heads"):
        Techniques(ulysses_degree=16).validate(config, gpus=16)


def test_unknown_technique_key_refused():
    with pytest.raises(ConfigError, match="unknown technique key 'zero_stage'"):
        Techniques.from_dict({"zero_stage": 3})


def test_offload_all_and_none():
    assert Techniques.from_dict({"activation_offload_layers": "all"}, num_layers=32).activation_offload_layers == 32
    assert Techniques.from_dict({"activation_offload_layers": "none"}).activation_offload_layers == 0


def config_doc(**overrides):
    doc = {
        "schema": SCHEMA,
        "model": "llama3-8b",
        "hardware": "h100-sxm",
        "gpus": 8,
        "seq_len": 5_242_880,
        "techniques": full_stack().to_dict(),
        "predicted": None,
        "measured": None,
    }
    doc.update(overrides)
    return doc


def test_config_file_round_trip(tmp_path):
    path = tmp_path / "best.json"
    path.write_text(json.dumps(config_doc()))
    loaded = load_config_file(path)
    assert loaded.techniques == full_stack()
    loaded.write(tmp_path / "again.json")
    assert json.loads((tmp_path / "again.json").read_text()) == config_doc()


@pytest.mark.parametrize(
    "doc, reason",
    [
        (config_doc(extra=1), "unknown key 'extra'"),
        (config_doc(schema="autotune/config-v0"), "schema"),
        (config_doc(techniques={"fsdp": "yes"}), "must be true or false"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_config_documents(doc, reason):
    with pytest.raises(ConfigError, match=reason):
        parse_config(doc)


def test_truncated_json(tmp_path):
    path = tmp_path / "cut.json"
    path.write_text(json.dumps(config_doc())[:40])
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config_file(path)


def test_presets_load():
    tiny = load_model_config("tiny-llama")
    assert (
        tiny["hidden_size"],
        tiny["num_hidden_layers"],
        tiny["num_attention_heads"],
        tiny["num_key_value_heads"],
        tiny["vocab_size"],
    ) == (128, 4, 8, 2, 4096)
    h100 = load_hardware("h100-sxm")
    assert h100.device_memory_bytes == 81_559 * 2**20 and h100.bf16_flops == 989e12  # the card reports 79.65 GiB


def test_model_from_hf_config_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "vocab_size": 512,
            }
        )
    )
    config = load_model_config(str(path))
    assert config["num_key_value_heads"] == 4 and config["head_dim"] == 64


def test_non_llama_config_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "bert", "hidden_size": 256}))
    with pytest.raises(ConfigError, match="model_type 'bert'"):
        load_model_config(str(path))


def _saved_by_transformers(tmp_path, config) -> str:
    """``config.json`` as ``save_pretrained`` writes it (transformers 5: ``layer_types`` for Qwen2/3)."""
    config.save_pretrained(tmp_path)
    return str(tmp_path / "config.json")


def test_a_qwen3_config_saved_by_transformers_is_estimated_at_reduced_depth(tmp_path):
    """``layer_types`` lists every layer: the oracle's 3- and 4-layer copies cut it to their depth, so transformers
    takes them (a 6-layer model is traced as reduced copies and extended)."""
    from transformers import Qwen3Config

    path = _saved_by_transformers(
        tmp_path,
        Qwen3Config(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=256,
        ),
    )
    assert len(json.loads(Path(path).read_text())["layer_types"]) == 6
    done = run_cli(
        "estimate", "--model", path, "--seq", "1K", "--config", "baseline", "--gpus", "1", "--hardware", "cpu", "--json"
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["status"] == "ok"


def test_what_the_kernels_do_not_run_is_refused_in_one_line(tmp_path):
    """Supported families load (a sliding window included); a layer type the kernels do not run, a family not
    declared, and Phi's partial rotary are refused, naming what is missing."""
    from transformers import GptOssConfig, MistralConfig, Phi3Config, Qwen3Config

    tiny = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    windowed = load_model_config(_saved_by_transformers(tmp_path / "mistral", MistralConfig(**tiny, sliding_window=64)))
    assert windowed["sliding_window"] == 64
    chunked = _saved_by_transformers(
        tmp_path / "chunked", Qwen3Config(**tiny, layer_types=["full_attention", "chunked_attention"])
    )
    with pytest.raises(ConfigError, match=r"layer_types \['chunked_attention'\] are not supported"):
        load_model_config(chunked)
    with pytest.raises(ConfigError, match="model_type 'gpt_oss'; supported: llama, mistral"):
        load_model_config(_saved_by_transformers(tmp_path / "oss", GptOssConfig(**tiny)))
    partial = Phi3Config(**tiny, pad_token_id=None, bos_token_id=0, eos_token_id=1)
    partial.rope_parameters["partial_rotary_factor"] = 0.75
    with pytest.raises(ConfigError, match="partial_rotary_factor 0.75 is not supported"):
        load_model_config(_saved_by_transformers(tmp_path / "phi", partial))


def test_a_config_transformers_refuses_is_bad_input(tmp_path):
    """Caught when the config is read (one line, the field and the reason), not in every trial of a search."""
    config = json.loads(Path(_preset_path_of("tiny-llama")).read_text())
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config, "rms_norm_eps": "x"}))
    with pytest.raises(ConfigError, match="transformers refuses it .*rms_norm_eps"):
        load_model_config(str(path))


def _preset_path_of(name: str) -> Path:
    from trials.models.config import _preset_path

    return _preset_path(name)
