"""Bad-input cases for the CLI: each must exit 2 with one line on stderr naming the bad value.

Shared by tests/test_bad_input.py (asserts) and bench/bad_inputs.py (prints README's troubleshooting
table from real runs). ``make_files(dir)`` writes the broken files the cases point at.
"""

from __future__ import annotations

import json
from pathlib import Path

GOOD_TECHNIQUES = {"fsdp": True, "ulysses_degree": 8, "activation_checkpointing": True}


def _config(**overrides) -> dict:
    doc = {"schema": "autotune/config-v1", "model": "llama3-8b", "hardware": "h100-sxm", "gpus": 8,
           "seq_len": 1048576, "techniques": dict(GOOD_TECHNIQUES), "predicted": None, "measured": None}
    doc.update(overrides)
    return doc


def make_files(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / "malformed-config.json").write_text('{"model_type": "llama", "hidden_size": ')
    (root / "bert-config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": 768}))
    (root / "space-malformed.yaml").write_text("knobs:\n  fsdp: [true, false\n  ulysses_degree: [1, 2]\n")
    (root / "space-unknown-knob.yaml").write_text("knobs:\n  zero_stage: [1, 2, 3]\n")
    (root / "space-empty.yaml").write_text("knobs:\n  ulysses_degree: []\n")
    (root / "space-type.yaml").write_text("knobs:\n  fsdp: [yes-please]\n")
    (root / "space-no-degree.yaml").write_text("knobs:\n  ulysses_degree: [2, 4, 8]\n")
    (root / "config-unknown-key.json").write_text(json.dumps(_config(zero_stage=3)))
    (root / "config-schema.json").write_text(json.dumps(_config(schema="autotune/config-v0")))
    (root / "config-impossible.json").write_text(json.dumps(_config(techniques={"ulysses_degree": 3})))
    (root / "config-offload.json").write_text(json.dumps(_config(
        techniques={"activation_offload_layers": 4, "activation_checkpointing": False})))
    (root / "config-truncated.json").write_text(json.dumps(_config())[:50])
    (root / "config-good.json").write_text(json.dumps(_config()))
    (root / "a-file").write_text("not a folder\n")
    front = root / "finished-search"
    front.mkdir(exist_ok=True)
    (front / "pareto.json").write_text(json.dumps({
        "model": "tiny-llama", "hardware": "cpu", "gpus": 2, "target": 4096,
        "front": [{"trial": 3, "seq_len": 4096, "tokens_per_s": 5000.0, "techniques": GOOD_TECHNIQUES,
                   "record": {"status": "ok", "source": "measured", "seq_len": 4096}}]}))


# (what is wrong, argv with {d} for the files folder, a fragment the one-line message must contain)
CASES: list[tuple[str, list[str], str]] = [
    ("unknown model preset", ["search", "--model", "llama9-1t", "--target", "5M"], "'llama9-1t'"),
    ("malformed config.json", ["search", "--model", "{d}/malformed-config.json", "--target", "5M"], "not valid JSON"),
    ("non-Llama config.json", ["search", "--model", "{d}/bert-config.json", "--target", "5M"], "'bert'"),
    ("target with unknown suffix", ["search", "--model", "llama3-8b", "--target", "5Q"], "'5Q'"),
    ("target zero", ["search", "--model", "llama3-8b", "--target", "0"], "'0' must be positive"),
    ("negative target", ["search", "--model", "llama3-8b", "--target", "-1"], "'-1'"),
    ("absurd target", ["search", "--model", "llama3-8b", "--target", "1e99"], "'1e99'"),
    ("float target", ["search", "--model", "llama3-8b", "--target", "2.5M"], "'2.5M'"),
    ("zero GPUs", ["search", "--model", "llama3-8b", "--target", "5M", "--gpus", "0"], "--gpus must be at least 1, got 0"),
    ("GPU count no Ulysses degree divides", ["search", "--model", "llama3-8b", "--target", "5M", "--gpus", "3",
                                             "--space", "{d}/space-no-degree.yaml"], "--gpus 3"),
    ("config's Ulysses degree vs 3 GPUs", ["estimate", "--model", "llama3-8b", "--seq", "1M", "--gpus", "3",
                                           "--config", "{d}/config-good.json"], "ulysses_degree 8 does not divide the GPU count 3"),
    ("unknown hardware", ["search", "--model", "llama3-8b", "--target", "5M", "--hardware", "tpu-v9"], "'tpu-v9'"),
    ("malformed space YAML", ["search", "--model", "llama3-8b", "--target", "5M", "--space", "{d}/space-malformed.yaml",
                              "--out", "{d}/out"], "line"),
    ("space with unknown knob", ["search", "--model", "llama3-8b", "--target", "5M", "--space",
                                 "{d}/space-unknown-knob.yaml", "--out", "{d}/out"], "unknown knob 'zero_stage'"),
    ("space with empty choice list", ["search", "--model", "llama3-8b", "--target", "5M", "--space",
                                      "{d}/space-empty.yaml", "--out", "{d}/out"], "empty choice list"),
    ("space with a type error", ["search", "--model", "llama3-8b", "--target", "5M", "--space", "{d}/space-type.yaml",
                                 "--out", "{d}/out"], "'yes-please'"),
    ("config with unknown key", ["estimate", "--model", "llama3-8b", "--seq", "1M", "--config",
                                 "{d}/config-unknown-key.json"], "unknown key 'zero_stage'"),
    ("config with wrong schema", ["estimate", "--model", "llama3-8b", "--seq", "1M", "--config",
                                  "{d}/config-schema.json"], "'autotune/config-v0'"),
    ("config with impossible combination", ["estimate", "--model", "llama3-8b", "--seq", "1M", "--config",
                                            "{d}/config-offload.json"], "needs activation_checkpointing"),
    ("config with truncated JSON", ["trial", "--model", "tiny-llama", "--seq", "1K", "--config",
                                    "{d}/config-truncated.json"], "not valid JSON"),
    ("config file missing", ["trial", "--model", "tiny-llama", "--seq", "1K", "--config", "{d}/nope.json"],
     "does not exist"),
    ("--out is a file", ["search", "--model", "llama3-8b", "--target", "5M", "--out", "{d}/a-file"], "is a file"),
    ("--out cannot be created", ["search", "--model", "llama3-8b", "--target", "5M", "--out",
                                 "/proc/autotune-out"], "cannot be created"),
    ("export target beyond the front", ["export", "{d}/finished-search", "--target", "1M"],
     "longest reached is 4,096"),
    ("export of a folder that is no search", ["export", "{d}"], "no pareto.json"),
    ("export format unknown", ["export", "{d}/finished-search", "--format", "megatron"], "'megatron'"),
    ("--storage that cannot be opened", ["search", "--model", "llama3-8b", "--target", "5M", "--out", "{d}/out",
                                         "--storage", "sqlite:////proc/no/such/dir/study.db"], "cannot be opened"),
    ("--storage that is no URL", ["search", "--model", "llama3-8b", "--target", "5M", "--out", "{d}/out",
                                  "--storage", "my-database"], "'my-database'"),
    ("unknown option", ["search", "--model", "llama3-8b", "--target", "5M", "--bogus"], "--bogus"),
    ("non-integer --gpus", ["search", "--model", "llama3-8b", "--target", "5M", "--gpus", "eight"], "--gpus"),
]


def argv_for(case_argv: list[str], files: Path) -> list[str]:
    return [arg.replace("{d}", str(files)) for arg in case_argv]
