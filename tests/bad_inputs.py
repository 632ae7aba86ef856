"""Bad-input cases for the CLI: each must exit 2 with one line on stderr naming the bad value.

Shared by tests/test_bad_input.py (asserts) and bench/bad_inputs.py (prints README's troubleshooting
table from real runs). ``make_files(dir)`` writes the broken files the cases point at. ``range_cases()`` adds,
for every numeric option of every command, values just outside its range (``autotune.cli.options.RANGES``).
"""

from __future__ import annotations

import inspect
import json
import typing
from pathlib import Path

GOOD_TECHNIQUES = {"fsdp": True, "ulysses_degree": 8, "activation_checkpointing": True}
TINY_VOCAB = 4096  # tiny-llama's vocab_size
RUN_SEQ = 512  # run-config.json's seq_len


def _config(**overrides) -> dict:
    doc = {
        "schema": "autotune/config-v1",
        "model": "llama3-8b",
        "hardware": "h100-sxm",
        "gpus": 8,
        "seq_len": 1048576,
        "techniques": dict(GOOD_TECHNIQUES),
        "predicted": None,
        "measured": None,
    }
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
    (root / "config-offload.json").write_text(
        json.dumps(_config(techniques={"activation_offload_layers": 4, "activation_checkpointing": False}))
    )
    (root / "config-truncated.json").write_text(json.dumps(_config())[:50])
    (root / "config-good.json").write_text(json.dumps(_config()))
    (root / "a-file").write_text("not a folder\n")
    _make_run_files(root)
    _make_documents_files(root)
    front = root / "finished-search"
    front.mkdir(exist_ok=True)
    (front / "pareto.json").write_text(
        json.dumps(
            {
                "model": "tiny-llama",
                "hardware": "cpu",
                "gpus": 2,
                "target": 4096,
                "front": [
                    {
                        "trial": 3,
                        "seq_len": 4096,
                        "tokens_per_s": 5000.0,
                        "techniques": GOOD_TECHNIQUES,
                        "record": {"status": "ok", "source": "measured", "seq_len": 4096},
                    }
                ],
            }
        )
    )
    _make_lora_files(root)


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
    ("calibrate with no destination", ["calibrate", "--hardware", "cpu"], "exactly one of --name NAME"),
    (
        "calibrate over a shipped preset",
        ["calibrate", "--hardware", "cpu", "--name", "h100-sxm"],
        "is a shipped preset",
    ),
    (
        "calibrate a GPU preset without a GPU",
        ["calibrate", "--hardware", "h100-sxm", "-o", "{d}/p.yaml"],
        "shows no CUDA device",
    ),
    ("calibrate an unknown base", ["calibrate", "--hardware", "tpu9", "-o", "{d}/p.yaml"], "unknown hardware 'tpu9'"),
    (
        "check a preset with assumed rates",
        ["calibrate", "--check", "--hardware", "h100-sxm"],
        "its rates are assumed, not measured",
    ),
    (
        "check with a destination",
        ["calibrate", "--check", "--hardware", "cpu", "-o", "{d}/p.yaml"],
        "--check writes nothing",
    ),
    (
        "zero GPUs",
        ["search", "--model", "llama3-8b", "--target", "5M", "--gpus", "0"],
        "Invalid value for '--gpus': must be at least 1, got 0",
    ),
    (
        "negative search timeout",
        ["search", "--model", "llama3-8b", "--target", "5M", "--timeout", "-5"],
        "Invalid value for '--timeout': must be above 0 seconds, got -5",
    ),
    (
        "GPU count no Ulysses degree divides",
        ["search", "--model", "llama3-8b", "--target", "5M", "--gpus", "3", "--space", "{d}/space-no-degree.yaml"],
        "--gpus 3",
    ),
    (
        "config's Ulysses degree vs 3 GPUs",
        ["estimate", "--model", "llama3-8b", "--seq", "1M", "--gpus", "3", "--config", "{d}/config-good.json"],
        "ulysses_degree 8 does not divide the GPU count 3",
    ),
    ("unknown hardware", ["search", "--model", "llama3-8b", "--target", "5M", "--hardware", "tpu-v9"], "'tpu-v9'"),
    (
        "malformed space YAML",
        ["search", "--model", "llama3-8b", "--target", "5M", "--space", "{d}/space-malformed.yaml", "--out", "{d}/out"],
        "line",
    ),
    (
        "space with unknown knob",
        [
            "search",
            "--model",
            "llama3-8b",
            "--target",
            "5M",
            "--space",
            "{d}/space-unknown-knob.yaml",
            "--out",
            "{d}/out",
        ],
        "unknown knob 'zero_stage'",
    ),
    (
        "space with empty choice list",
        ["search", "--model", "llama3-8b", "--target", "5M", "--space", "{d}/space-empty.yaml", "--out", "{d}/out"],
        "empty choice list",
    ),
    (
        "space with a type error",
        ["search", "--model", "llama3-8b", "--target", "5M", "--space", "{d}/space-type.yaml", "--out", "{d}/out"],
        "'yes-please'",
    ),
    (
        "config with unknown key",
        ["estimate", "--model", "llama3-8b", "--seq", "1M", "--config", "{d}/config-unknown-key.json"],
        "unknown key 'zero_stage'",
    ),
    (
        "config with wrong schema",
        ["estimate", "--model", "llama3-8b", "--seq", "1M", "--config", "{d}/config-schema.json"],
        "'autotune/config-v0'",
    ),
    (
        "config with impossible combination",
        ["estimate", "--model", "llama3-8b", "--seq", "1M", "--config", "{d}/config-offload.json"],
        "needs activation_checkpointing",
    ),
    (
        "config with truncated JSON",
        ["trial", "--model", "tiny-llama", "--seq", "1K", "--config", "{d}/config-truncated.json"],
        "not valid JSON",
    ),
    (
        "config file missing",
        ["trial", "--model", "tiny-llama", "--seq", "1K", "--config", "{d}/nope.json"],
        "does not exist",
    ),
    ("--out is a file", ["search", "--model", "llama3-8b", "--target", "5M", "--out", "{d}/a-file"], "is a file"),
    (
        "--out cannot be created",
        ["search", "--model", "llama3-8b", "--target", "5M", "--out", "/proc/autotune-out"],
        "cannot be created",
    ),
    ("export target beyond the front", ["export", "{d}/finished-search", "--target", "1M"], "longest reached is 4,096"),
    ("export of a folder that is no search", ["export", "{d}"], "no pareto.json"),
    ("export format unknown", ["export", "{d}/finished-search", "--format", "megatron"], "'megatron'"),
    (
        "export -o where no folder can be made",
        ["export", "{d}/finished-search", "-o", "{d}/a-file/best.json"],
        "is not a folder this user may write in",
    ),
    (
        "unknown attention kernel",
        ["estimate", "--config", "baseline", "--model", "tiny-llama", "--seq", "1K", "--attention", "flash9"],
        "--attention 'flash9' must be one of",
    ),
    (
        "--storage that cannot be opened",
        [
            "search",
            "--model",
            "llama3-8b",
            "--target",
            "5M",
            "--out",
            "{d}/out",
            "--storage",
            "sqlite:////proc/no/such/dir/study.db",
        ],
        "cannot be opened",
    ),
    (
        "--storage that is no URL",
        ["search", "--model", "llama3-8b", "--target", "5M", "--out", "{d}/out", "--storage", "my-database"],
        "'my-database'",
    ),
    ("unknown option", ["search", "--model", "llama3-8b", "--target", "5M", "--bogus"], "--bogus"),
    ("non-integer --gpus", ["search", "--model", "llama3-8b", "--target", "5M", "--gpus", "eight"], "--gpus"),
]


# ``autotune run``: the data file problems it finds before launching training
CASES += [
    ("--data missing", ["run", "--config", "{d}/run-config.json", "--data", "{d}/no-tokens.parquet"], "does not exist"),
    (
        "--data not Parquet/Arrow",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/tokens.txt"],
        "cannot be read as a Parquet or Arrow file",
    ),
    (
        "--data .arrow that is not Arrow",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/tokens.arrow"],
        "cannot be read as a Parquet or Arrow file",
    ),
    (
        "--data without a token column",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/text.parquet"],
        "needs a column 'input_ids'",
    ),
    (
        "--data with ids outside the vocabulary",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/big-ids.parquet"],
        f"token 1,031 (document 2, position 7) is id {TINY_VOCAB + 5}, outside the model's vocabulary [0, {TINY_VOCAB})",
    ),
    (
        "--data with negative ids",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/negative-ids.parquet"],
        f"token 700 is id -1, outside the model's vocabulary [0, {TINY_VOCAB})",
    ),
    (
        "--data with a null id",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/null-ids.parquet"],
        "token 3 is null, not a token id",
    ),
    (
        "--data empty file",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/empty.parquet"],
        "the file is empty (0 bytes)",
    ),
    (
        "--data with no documents",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/no-documents.parquet"],
        "holds no documents (the column 'input_ids' has no rows)",
    ),
    (
        "--data whose documents hold no tokens",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/empty-documents.parquet"],
        "its 4 documents (rows of 'input_ids') hold no tokens",
    ),
    (
        "--data with string tokens",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/string-tokens.parquet"],
        "holds string values, not integer token ids",
    ),
    (
        "--data with float tokens",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/float-tokens.parquet"],
        "holds double values, not integer token ids",
    ),
    (
        "--data shorter than one sequence",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/short.parquet"],
        f"fewer than one sequence of {RUN_SEQ}",
    ),
]


# ``autotune run``: the trainer's options (trials.train's), checked before launching
CASES += [
    (
        "--resume without a checkpoint",
        ["run", "--config", "{d}/run-config.json", "--save", "{d}/no-checkpoints", "--resume"],
        "no complete checkpoint in",
    ),
    (
        "--init that is not a model folder",
        ["run", "--config", "{d}/run-config.json", "--init", "{d}"],
        "is not a Hugging Face model folder (no config.json)",
    ),
    (
        "--init of another model",
        ["run", "--config", "{d}/run-config.json", "--init", "{d}/other-model"],
        "is not the model the config was tuned for",
    ),
    ("--save-every without --save", ["run", "--config", "{d}/run-config.json", "--save-every", "10"], "need --save"),
    ("--schedule unknown", ["run", "--config", "{d}/run-config.json", "--schedule", "linear"], "invalid choice"),
    ("--min-lr above --lr", ["run", "--config", "{d}/run-config.json", "--min-lr", "1"], "--min-lr must lie in"),
    (
        "a trainer option abbreviated",
        ["run", "--config", "{d}/run-config.json", "--log", "{d}/train.jsonl"],
        "unrecognized arguments: --log",
    ),
    (
        "an unknown trainer option",
        ["run", "--config", "{d}/run-config.json", "--bogus-option", "3"],
        "unrecognized arguments: --bogus-option 3",
    ),
]

# ``autotune run --pack``: packing the trainer refuses (trials.train.packing), checked before launching
CASES += [
    (
        "--pack with a token stream and no EOS id",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/stream.parquet", "--pack"],
        "has no document boundary: its 'tokens' hold no EOS id before the last token (the model names no eos_token_id",
    ),
    (
        "--pack with one document",
        ["run", "--config", "{d}/run-config.json", "--data", "{d}/one-document.parquet", "--pack"],
        "has no document boundary: its rows of 'input_ids' hold one document",
    ),
    ("--pack without --data", ["run", "--config", "{d}/run-config.json", "--pack"], "--pack needs --data"),
]

# ``--memory-timeline`` / ``--memory-snapshot`` / ``--rank``: checked before any trace
CASES += [
    (
        "--memory-timeline a folder",
        ["estimate", "--config", "{d}/config-good.json", "--memory-timeline", "{d}"],
        "is a directory",
    ),
    (
        "--memory-snapshot under a file",
        ["estimate", "--config", "{d}/config-good.json", "--memory-snapshot", "/dev/null/t.pickle"],
        "cannot write there",
    ),
    (
        "--rank outside the job",
        ["estimate", "--config", "{d}/config-good.json", "--rank", "8", "--memory-timeline", "{d}/t.html"],
        "--rank 8: the job has 8 ranks",
    ),
]

# LoRA adapters (``--lora-rank``, a config's ``lora``): refused where nothing runs them
CASES += [
    (
        "--lora-alpha without --lora-rank",
        ["estimate", "--config", "baseline", "--model", "tiny-llama", "--seq", "1K", "--lora-alpha", "32"],
        "--lora-alpha, --lora-targets and --lora-trainable need --lora-rank",
    ),
    (
        "--lora-targets naming no module",
        [
            "estimate",
            "--config",
            "baseline",
            "--model",
            "tiny-llama",
            "--seq",
            "1K",
            "--lora-rank",
            "8",
            "--lora-targets",
            "q_prj",
        ],
        "lora: Target modules {'q_prj'} not found in the base model",
    ),  # fmt: skip
    (
        "--lora-trainable naming no module",
        [
            "search",
            "--model",
            "tiny-llama",
            "--target",
            "4K",
            "--lora-rank",
            "8",
            "--lora-trainable",
            "embed,norm",
            "--out",
            "{d}/out",
        ],
        "lora: no module of the model is named 'embed'",
    ),  # fmt: skip
    (
        "--lora-trainable of a tied embedding",
        [
            "estimate",
            "--config",
            "baseline",
            "--model",
            "tiny-gemma3",
            "--seq",
            "1K",
            "--lora-rank",
            "8",
            "--lora-trainable",
            "embed_tokens",
        ],
        "the input embedding shares its weight with the output head",
    ),  # fmt: skip
    (
        "--lora-targets not module names",
        [
            "estimate",
            "--config",
            "baseline",
            "--model",
            "tiny-llama",
            "--seq",
            "1K",
            "--lora-rank",
            "8",
            "--lora-targets",
            "q proj",
        ],
        "must be all-linear or module names separated by commas",
    ),  # fmt: skip
    (
        "--lora-rank for another trainer",
        [
            "search",
            "--model",
            "tiny-llama",
            "--target",
            "4K",
            "--trainer",
            "arctic",
            "--lora-rank",
            "8",
            "--out",
            "{d}/out",
        ],
        "ArcticTraining trains every weight only",
    ),  # fmt: skip
    ("a config's lora of a bad rank", ["estimate", "--config", "{d}/config-lora-rank.json"], "non-negative integer"),
    (
        "--export-merged of full training",
        ["run", "--config", "{d}/run-config.json", "--export-merged", "{d}/merged"],
        "--export-merged merges LoRA adapters",
    ),
    (
        "export a LoRA search to DeepSpeed",
        ["export", "{d}/lora-search", "--format", "deepspeed"],
        "DeepSpeed trains every weight only",
    ),
]


def _make_lora_files(root: Path) -> None:
    (root / "config-lora-rank.json").write_text(json.dumps(_config(lora={"rank": "16"})))
    (root / "lora-search").mkdir(exist_ok=True)
    front = json.loads((root / "finished-search" / "pareto.json").read_text())
    (root / "lora-search" / "pareto.json").write_text(json.dumps({**front, "lora": {"rank": 8}}))


def _make_run_files(root: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    techniques = {"ulysses_degree": 1, "activation_checkpointing": True, "attention": "sdpa"}
    (root / "run-config.json").write_text(
        json.dumps(_config(model="tiny-llama", hardware="cpu", gpus=1, seq_len=RUN_SEQ, techniques=techniques))
    )
    (root / "other-model").mkdir(exist_ok=True)  # tiny-llama's shape but for its MLP width
    tiny = json.loads(
        (Path(__file__).resolve().parents[1] / "trials" / "models" / "presets" / "tiny-llama.json").read_text()
    )
    (root / "other-model" / "config.json").write_text(json.dumps({**tiny, "intermediate_size": 256}))
    (root / "tokens.txt").write_text(" ".join(str(i) for i in range(4 * RUN_SEQ)) + "\n")
    (root / "tokens.arrow").write_text("not an Arrow IPC file\n")
    pq.write_table(pa.table({"text": ["a document"] * 4}), root / "text.parquet")
    documents = [[1] * RUN_SEQ, [2] * RUN_SEQ, [3] * 7 + [TINY_VOCAB + 5, TINY_VOCAB + 6] + [4] * RUN_SEQ]
    pq.write_table(pa.table({"input_ids": documents}), root / "big-ids.parquet")  # the first: token 2 * 512 + 7
    pq.write_table(pa.table({"tokens": [5] * 700 + [-1] * (2 * RUN_SEQ)}), root / "negative-ids.parquet")
    pq.write_table(pa.table({"tokens": [5, 6, 7, None] + [8] * (2 * RUN_SEQ)}), root / "null-ids.parquet")
    (root / "empty.parquet").write_bytes(b"")
    no_documents = pa.table({"input_ids": pa.array([], type=pa.list_(pa.int64()))})
    pq.write_table(no_documents, root / "no-documents.parquet")
    pq.write_table(
        pa.table({"input_ids": pa.array([[]] * 4, type=pa.list_(pa.int64()))}), root / "empty-documents.parquet"
    )
    pq.write_table(pa.table({"tokens": ["17"] * (2 * RUN_SEQ)}), root / "string-tokens.parquet")
    pq.write_table(pa.table({"tokens": [17.5] * (2 * RUN_SEQ)}), root / "float-tokens.parquet")
    pq.write_table(pa.table({"input_ids": [[1, 2, 3]] * 100}), root / "short.parquet")  # 300 tokens < 513
    pq.write_table(pa.table({"tokens": [7] * (2 * RUN_SEQ)}), root / "stream.parquet")
    pq.write_table(pa.table({"input_ids": [[7] * (2 * RUN_SEQ)]}), root / "one-document.parquet")


# the smallest valid command line of each command with numeric options; range_cases adds one bad option to it
COMMAND_ARGV = {
    "search": ["search", "--model", "tiny-llama", "--target", "4K", "--out", "{d}/out"],
    "estimate": ["estimate", "--model", "tiny-llama", "--seq", "1K", "--config", "baseline"],
    "trial": ["trial", "--model", "tiny-llama", "--seq", "1K", "--config", "baseline"],
    "verify": ["verify", "{d}/finished-search"],
    "run": ["run", "--config", "{d}/run-config.json"],
    "calibrate": ["calibrate", "--hardware", "cpu", "-o", "{d}/preset.yaml"],  # ranges refuse before measuring
}


def numeric_options() -> list[tuple[str, str, type]]:
    """(command, flag, int or float) for every numeric option of every command, read from the typer app; ``run``'s
    are trials.train's (its parser declares them), of which those ``RANGES`` names (the trainer checks the rest)."""
    from autotune.cli import app
    from autotune.cli.options import RANGES
    from autotune.cli.run import trainer_options

    found = [("run", flag, action.type) for flag, action in trainer_options() if flag in RANGES]
    for command in app.registered_commands:
        function = command.callback
        hints = typing.get_type_hints(function)
        for name, parameter in inspect.signature(function).parameters.items():
            kinds = {hints[name], *typing.get_args(hints[name])} & {int, float}  # int, float, Optional[...]
            if not kinds:
                continue
            declared = getattr(parameter.default, "param_decls", None)
            flag = declared[0] if declared else "--" + name.replace("_", "-")
            found.append((command.name or function.__name__, flag, kinds.pop()))
    return found


def _outside(allowed, kind: type) -> list[str]:
    """Values just outside ``allowed`` (an ``autotune.cli.options.Range``) as a user would type them."""

    def typed(value: float) -> str:
        return str(int(value)) if kind is int else str(float(value))

    values = [typed(allowed.minimum - 1)]
    if allowed.above_minimum:
        values.append(typed(allowed.minimum))
    if allowed.maximum is not None:
        values.append(typed(allowed.maximum + 1))
    if kind is float:
        values += ["nan", "inf"]
    return values


def range_cases() -> list[tuple[str, list[str], str]]:
    """For every numeric option of every command in ``COMMAND_ARGV``, each value just outside its range: (what,
    argv, fragment). (tests/test_bad_input.py checks that every command with numeric options is there.)"""
    from autotune.cli.options import RANGES

    cases = []
    for command, flag, kind in numeric_options():
        if command not in COMMAND_ARGV or flag not in RANGES:
            continue
        allowed = RANGES[flag]
        for value in _outside(allowed, kind):
            cases.append(
                (
                    f"{command} {flag} {value}",
                    [*COMMAND_ARGV[command], flag, value],
                    f"Invalid value for '{flag}': must be {allowed.describe()}, got ",
                )
            )
    return cases


def argv_for(case_argv: list[str], files: Path) -> list[str]:
    return [arg.replace("{d}", str(files)) for arg in case_argv]


# ``--documents``: the spec and the files it names (``autotune.core.documents``)
ESTIMATE_TINY = ["estimate", "--config", "baseline", "--model", "tiny-llama", "--seq", "1K", "--hardware", "cpu"]


def _make_documents_files(root: Path) -> None:
    (root / "documents-empty.json").write_text("[]")
    (root / "documents-zero.json").write_text("[512, 0, 12]")
    (root / "documents-object.json").write_text('{"lengths": [512]}')
    (root / "documents-malformed.json").write_text("[512, ")
    (root / "config-documents.json").write_text(json.dumps(_config(documents="many")))


CASES += [
    ("--documents neither one, a length nor a file", [*ESTIMATE_TINY, "--documents", "lots"], "'lots' is not 'one'"),
    ("--documents length zero", [*ESTIMATE_TINY, "--documents", "0"], "'0' is not 'one'"),
    ("--documents file missing", [*ESTIMATE_TINY, "--documents", "{d}/no-documents.json"], "does not exist"),
    ("--documents file empty", [*ESTIMATE_TINY, "--documents", "{d}/documents-empty.json"], "holds no documents"),
    (
        "--documents file with a zero length",
        [*ESTIMATE_TINY, "--documents", "{d}/documents-zero.json"],
        "must be a positive integer, got 0",
    ),
    (
        "--documents file not a list",
        [*ESTIMATE_TINY, "--documents", "{d}/documents-object.json"],
        "must hold a JSON list",
    ),
    ("--documents file not JSON", [*ESTIMATE_TINY, "--documents", "{d}/documents-malformed.json"], "not valid JSON"),
    (
        "search --documents unknown",
        ["search", "--model", "tiny-llama", "--target", "4K", "--documents", "lots", "--out", "{d}/out"],
        "'lots' is not 'one'",
    ),
    (
        "config file documents of the wrong type",
        ["estimate", "--config", "{d}/config-documents.json"],
        "documents must be",
    ),
]
