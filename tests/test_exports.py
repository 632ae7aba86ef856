"""Exports that the trainers people use accept (issues 7, 19).

Three front configs (short, middle, target: tiny-llama on 2 ranks, predicted by the plan backend at 0.25 GiB per
rank) are exported in every format, and each trainer's own code judges each export: ArcticTraining's config
loader, Accelerate's config loader + launch-argument validation (and for ``accelerate-deepspeed``
``ParallelismConfig`` and the Trainer snippet's ``TrainingArguments``), DeepSpeed's ``DeepSpeedConfig`` (and the
``.alst.py`` trains one step). Then the choice: the fastest config a format expresses in full, exit 1 naming the
longest it can reach where none reaches the target, ``--allow-partial`` with what it will not do and the
re-estimate, and never a length the trainer cannot reach. The autotune and torchrun formats run autotune's own
runner; ``accelerate launch`` runs the ``accelerate`` export's script (the plugin ``trials.hf``) on 2 processes to
the plain model's loss and the estimated peak.
"""

import json
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from conftest import ROOT, here, run_cli, run_judge

from autotune.cli import main
from autotune.core.trainers import TRAINERS, ExportJob, Trainer, exactly
from autotune.outputs.exporters import EXPORTERS, make_exporter
from autotune.outputs.exporters.selection import export_entry
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques, knob_names
from trials.training.config_file import load_config_file

TECHNIQUES = {
    "fsdp": False,
    "optimizer_offload": False,
    "ulysses_degree": 1,
    "head_chunk": None,
    "activation_checkpointing": True,
    "activation_offload_layers": 0,
    "mlp_tile_tokens": 0,
    "loss_tile_tokens": 0,
    "attention": "sdpa",
}
CAPACITY_GIB = 0.25
# (label, length, techniques): what the front of a long-context search looks like, in small
FRONT_CONFIGS = [
    (
        "short",
        2048,
        dict(activation_checkpointing=True, activation_offload_layers=2, mlp_tile_tokens=512, loss_tile_tokens=512),
    ),
    (
        "middle",
        4096,
        dict(
            fsdp=True,
            ulysses_degree=2,
            activation_checkpointing=True,
            activation_offload_layers=4,
            mlp_tile_tokens=16384,
            loss_tile_tokens=8192,
        ),
    ),
    (
        "target",
        8192,
        dict(
            fsdp=True,
            optimizer_offload=True,
            ulysses_degree=2,
            head_chunk=1,
            activation_checkpointing=True,
            activation_offload_layers=4,
            mlp_tile_tokens=1024,
            loss_tile_tokens=1024,
            norm_tile_tokens=1024,
        ),
    ),
]
LABELS = [label for label, _, _ in FRONT_CONFIGS]
TRAINER_FORMATS = ("arctic", "accelerate", "accelerate-deepspeed", "deepspeed")


@pytest.fixture(scope="module")
def plan_front(tmp_path_factory):
    """A search folder whose pareto.json holds the three configs as the plan backend predicts them."""
    from autotune.backends import Evaluation, make_backend
    from autotune.core.hardware import load_hardware

    root = tmp_path_factory.mktemp("plan-front")
    model_config = load_model_config("tiny-llama")
    hardware = load_hardware("cpu").with_memory_gib(CAPACITY_GIB)
    plan = make_backend("plan")
    front = []
    for trial, (_, length, knobs) in enumerate(FRONT_CONFIGS):
        record = plan.evaluate(Evaluation(model_config, Techniques(**knobs), length, 2, hardware)).to_dict()
        assert record["status"] == "ok", record
        front.append(
            {
                "trial": trial,
                "seq_len": length,
                "tokens_per_s": record["tokens_per_s"],
                "techniques": Techniques(**knobs).to_dict(),
                "record": record,
                "predicted": record,
                "measured": None,
            }
        )
    (root / "pareto.json").write_text(
        json.dumps(
            {
                "schema": "autotune/pareto-v1",
                "model": "tiny-llama",
                "hardware": "cpu",
                "gpus": 2,
                "target": 8192,
                "capacity_bytes": hardware.device_memory_bytes,
                "front": front,
            }
        )
    )
    return root


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The user's model folder a trainer loads: here the tiny-llama preset's config.json."""
    root = tmp_path_factory.mktemp("model")
    config = {k: v for k, v in load_model_config("tiny-llama").items() if not k.startswith("_")}
    (root / "config.json").write_text(json.dumps(config))
    return root


@pytest.fixture(scope="module")
def exports(plan_front, tmp_path_factory):
    """Every trainer format's export of each front config, written as ``autotune export -o`` writes them:
    {(format, label): (Export, path of the main file)}."""
    out = tmp_path_factory.mktemp("exports")
    front_doc = json.loads((plan_front / "pareto.json").read_text())
    model_config = load_model_config("tiny-llama")
    written = {}
    for fmt in TRAINER_FORMATS:
        exporter = make_exporter(fmt)
        for label, entry in zip(LABELS, front_doc["front"]):
            path = out / f"{fmt}-{label}{os.path.splitext(exporter.default_file)[1]}"
            result = export_entry(front_doc, entry, exporter, str(path), model_config)
            path.write_text(result.rendered.text + "\n")
            for suffix, body in result.rendered.companions.items():
                path.with_suffix(suffix).write_text(body + "\n")
            written[fmt, label] = (result, path)
    return written


def knobs_of(label: str) -> dict:
    return {**Techniques().to_dict(), **dict((c[0], c[2]) for c in FRONT_CONFIGS)[label]}


# -- the declarations ---------------------------------------------------------------------------------------------


def test_every_format_declares_every_knob_once():
    for cls in EXPORTERS.values():
        assert set(cls().expresses) == set(knob_names()), cls.name
        assert cls.trainer is TRAINERS[cls.trainer.name], cls.name  # the one declaration the search reads


def test_a_trainer_that_forgets_a_knob_is_refused():
    with pytest.raises(TypeError, match="norm_tile_tokens"):
        Trainer("forgetful", "nothing", {k: exactly(k) for k in knob_names() if k != "norm_tile_tokens"})


def test_what_each_trainer_runs_follows_its_declaration():
    model_config = load_model_config("tiny-llama")
    job = ExportJob("tiny-llama", model_config, 2, 8192, Techniques(**knobs_of("target")))
    arctic = make_exporter("arctic").trainer_techniques(job)
    assert (arctic.head_chunk, arctic.norm_tile_tokens) == (None, 0)
    assert arctic.mlp_tile_tokens == model_config["hidden_size"]  # tiled_mlp_compute tiles at the hidden size
    assert arctic.activation_offload_layers == model_config["num_hidden_layers"]
    # ~1 GiB of fp32 logits per tile: 4,096 tokens per rank x 4,096 vocab is 64 MiB, one tile
    assert arctic.loss_tile_tokens == 4096
    accelerate = make_exporter("accelerate-deepspeed").trainer_techniques(job)
    assert (accelerate.mlp_tile_tokens, accelerate.loss_tile_tokens, accelerate.norm_tile_tokens) == (0, 0, 0)
    assert accelerate.ulysses_degree == 2 and accelerate.fsdp and accelerate.optimizer_offload
    deepspeed = make_exporter("deepspeed").trainer_techniques(job)
    assert deepspeed == Techniques(**{**knobs_of("target"), "head_chunk": None, "norm_tile_tokens": 0})
    for fmt in ("autotune", "torchrun", "accelerate"):  # accelerate: every knob through the plugin trials.hf
        assert make_exporter(fmt).trainer_techniques(job) == job.techniques


# -- each trainer judges each export -------------------------------------------------------------------------------


def test_arctic_training_loads_each_recipe(exports, model_dir):
    paths = [str(exports["arctic", label][1]) for label in LABELS]
    judged = run_judge("arctic", str(model_dir), "2", *paths)
    assert [j["path"] for j in judged] == paths
    for label, verdict in zip(LABELS, judged):
        result = exports["arctic", label][0]
        t = result.config.techniques
        assert verdict["type"] == "causal" and verdict["world_size"] == 2
        assert verdict["sequence_parallel_size"] == t.ulysses_degree
        assert verdict["max_length"] == result.config.seq_len
        assert verdict["activation_checkpoint_cpu_offload"] == (t.activation_offload_layers > 0)
        assert verdict["tiled_mlp_compute"] == (t.mlp_tile_tokens > 0)
        assert verdict["disable_activation_checkpoint"] is False
        assert verdict["zero"]["stage"] == (3 if t.fsdp else 0)
        assert verdict["optimizer"] == ("cpu_adam" if t.optimizer_offload else "fused_adam")
        assert verdict["attn_implementation"] == "sdpa"
        assert verdict["train_batch_size"] == 2 // t.ulysses_degree  # ArcticTraining's data-parallel replicas
    assert judged[2]["zero"]["offload_optimizer"]["device"] == "cpu"


def test_accelerate_launches_the_plugin_script_with_each_config(exports):
    paths = [str(exports["accelerate", label][1]) for label in LABELS]
    judged = run_judge("accelerate", *paths)
    assert [j["path"] for j in judged] == paths
    for label, verdict in zip(LABELS, judged):
        result, path = exports["accelerate", label]
        assert not result.gaps and result.config.techniques.to_dict() == knobs_of(label)
        assert verdict["distributed_type"] == "DistributedType.MULTI_GPU" and verdict["num_processes"] == 2
        assert verdict["launcher"] == "torch.distributed.run" and verdict["processes"] == 2
        assert verdict["mixed_precision"] == "no"  # the plugin's own: fp32 master weights, bf16 compute on CUDA
        assert verdict["script_techniques"] == knobs_of(label)
        assert verdict["script_seq_len"] == result.config.seq_len
        assert load_config_file(path.with_suffix(".autotune.json")).techniques == result.config.techniques
        assert "sharding: trials.hf's FSDP2" in path.read_text()


# (knobs, length) of the end-to-end run: every kind of knob at once on 2 processes
PLUGIN_RUN = (
    dict(
        fsdp=True,
        ulysses_degree=2,
        head_chunk=1,
        activation_checkpointing=True,
        activation_offload_layers=2,
        mlp_tile_tokens=256,
        loss_tile_tokens=256,
        norm_tile_tokens=256,
    ),
    2048,
)


def _launch_accelerate_export(tmp_path, capsys, knobs: dict, seq_len: int, gpus: int, steps: int):
    """A tiny Llama saved by ``transformers`` (``tmp_path/model``), a front of one config (``knobs`` at ``seq_len``
    on ``gpus`` CPU processes, the plan backend's record) exported as ``autotune export --format accelerate``
    writes it, then ``accelerate launch`` (the real CLI) of its script for ``steps`` steps: (the script's summary,
    the first loss of the plain one-process model on the same tokens, the export's config file)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from autotune.backends import Evaluation, make_backend
    from autotune.core.hardware import load_hardware
    from trials.training.data import synthetic_sample

    values = {k: v for k, v in load_model_config("tiny-llama").items() if not k.startswith("_")}
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**values)).save_pretrained(tmp_path / "model")
    model_json = str(tmp_path / "model" / "config.json")
    techniques = Techniques(**knobs)
    record = make_backend("plan").evaluate(
        Evaluation(load_model_config(model_json), techniques, seq_len, gpus, load_hardware("cpu"))
    )
    assert record.status == "ok"
    entry = {"trial": 0, "seq_len": seq_len, "tokens_per_s": record.tokens_per_s, "techniques": techniques.to_dict()}
    front = {"model": model_json, "hardware": "cpu", "gpus": gpus, "target": seq_len, "front": [entry]}
    (tmp_path / "search").mkdir()
    (tmp_path / "search" / "pareto.json").write_text(
        json.dumps({**front, "front": [{**entry, "record": record.to_dict()}]})
    )
    exported = tmp_path / "sp.yaml"
    assert main(["export", str(tmp_path / "search"), "--format", "accelerate", "-o", str(exported)]) == 0
    capsys.readouterr()

    launched = subprocess.run(
        [
            os.path.join(os.path.dirname(sys.executable), "accelerate"),
            "launch",
            "--config_file",
            str(exported),
            "--main_process_port",
            "0",  # a free port: other tests may launch at the same time (pytest-xdist)
            str(tmp_path / "sp.train.py"),
            "--model",
            str(tmp_path / "model"),
            "--steps",
            str(steps),
            "--summary",
            str(tmp_path / "summary.json"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert launched.returncode == 0, launched.stderr[-3000:]
    assert [line.split()[1] for line in launched.stdout.splitlines() if line.startswith("step ")] == [
        f"{step}/{steps}" for step in range(1, steps + 1)
    ]
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    tokens = synthetic_sample(0, seq_len, plain.config.vocab_size, 0)  # replica 0's window, the script's default
    with torch.no_grad():
        plain_loss = float(plain(input_ids=tokens[None], labels=tokens[None]).loss)
    return json.loads((tmp_path / "summary.json").read_text()), plain_loss, tmp_path / "sp.autotune.json"


def test_accelerate_launch_trains_the_export_like_the_plain_model_in_the_estimated_memory(tmp_path, capsys):
    """``accelerate launch`` (the real CLI) runs the ``accelerate`` export of a front config on 2 processes for 3
    steps with a tiny Llama saved by ``transformers``: the first loss is the plain one-process model's on the same
    tokens, and each rank's measured peak (from before the model is built to the last step, as trials measure it)
    is the one ``autotune estimate`` predicts for the exported config."""
    knobs, seq_len = PLUGIN_RUN
    summary, plain_loss, config = _launch_accelerate_export(tmp_path, capsys, knobs, seq_len, gpus=2, steps=3)
    estimate = here(  # in-process: a fresh interpreter would import torch again
        "estimate",
        "--model",
        str(tmp_path / "model" / "config.json"),
        "--seq",
        str(seq_len),
        "--config",
        str(config),
        "--gpus",
        "2",
        "--hardware",
        "cpu",
        "--json",
    )
    assert estimate.returncode == 0, estimate.stderr
    predicted = json.loads(estimate.stdout)["peak_device_bytes"]

    assert summary["world_size"] == 2 and len(summary["losses"]) == 3
    assert summary["first_loss"] == pytest.approx(plain_loss, rel=1e-5)
    measured = [rank["peak_device_bytes"] for rank in summary["ranks"]]
    assert len(measured) == 2
    for peak in measured:
        assert abs(peak - predicted) <= 0.02 * predicted, (measured, predicted)


@pytest.mark.slow
def test_accelerate_launch_trains_a_ulysses_by_ring_export_on_four_processes(tmp_path, capsys):
    """The ``accelerate`` export of a Ulysses 2 x ring 2 config (4 processes: each sequence split over Ulysses
    groups and rings, head chunks on) starts under ``accelerate launch`` and its step's loss is the plain model's."""
    knobs = dict(fsdp=True, ulysses_degree=2, ring_degree=2, head_chunk=1, activation_checkpointing=True)
    summary, plain_loss, _ = _launch_accelerate_export(tmp_path, capsys, knobs, 1024, gpus=4, steps=1)
    assert summary["world_size"] == 4 and len(summary["losses"]) == 1
    assert summary["first_loss"] == pytest.approx(plain_loss, rel=1e-5)


def test_accelerate_deepspeed_launches_each_config(exports):
    paths = [str(exports["accelerate-deepspeed", label][1]) for label in LABELS]
    judged = run_judge("accelerate-deepspeed", *paths)
    assert [j["path"] for j in judged] == paths
    for label, verdict in zip(LABELS, judged):
        result, path = exports["accelerate-deepspeed", label]
        t = result.config.techniques
        assert verdict["distributed_type"] == "DistributedType.DEEPSPEED" and verdict["num_processes"] == 2
        assert verdict["deepspeed_config_file"] == str(path.with_suffix(".ds.json"))
        assert verdict["zero_stage"] == (3 if t.fsdp else 0)
        assert verdict["sp_size"] == verdict["trainer_sp_size"] == t.ulysses_degree
        assert verdict["use_parallelism_config"] == (t.ulysses_degree > 1)
        if t.ulysses_degree > 1:
            assert verdict["sp_backend"] == "deepspeed" and verdict["sp_attn_implementation"] == "sdpa"
            assert verdict["sp_seq_length_is_variable"] is True
        assert verdict["trainer_checkpointing"] is True
        assert verdict["trainer_checkpointing_kwargs"] == ({"offload": True} if t.activation_offload_layers else None)
        assert verdict["trainer_deepspeed"] == str(path.with_suffix(".ds.json"))


def test_deepspeed_parses_each_config(exports):
    from deepspeed.runtime.config import DeepSpeedConfig

    for fmt, suffix in (("deepspeed", ".json"), ("accelerate-deepspeed", ".ds.json")):
        for label in LABELS:
            result, path = exports[fmt, label]
            t = result.config.techniques
            config = json.loads(path.with_suffix(suffix).read_text())
            parsed = DeepSpeedConfig(config, mpu=None, mesh_device=None)
            assert parsed.zero_optimization_stage == (3 if t.fsdp else 0), (fmt, label)
            assert config["sequence_parallel_size"] == t.ulysses_degree  # read by the engine (world / degree)
            assert (parsed.zero_config.offload_optimizer is not None) == t.optimizer_offload
            assert (parsed.zero_config.offload_param is not None) == t.optimizer_offload
            assert str(parsed.seq_parallel_communication_data_type) == "torch.float32"


def test_deepspeed_alst_python_trains_like_the_plain_model(exports, model_dir):
    """The short config's .alst.py (one rank: tiled MLP in 4 tiles, tiled loss in 4, 2 of 4 layers' checkpointed
    inputs offloaded) trains a tiny Llama to the plain model's loss and gradients."""
    result, path = exports["deepspeed", "short"]
    assert not result.gaps  # DeepSpeed runs every knob of this config as searched
    for label in LABELS:
        compile(exports["deepspeed", label][1].with_suffix(".alst.py").read_text(), label, "exec")
    (verdict,) = run_judge("alst", str(path.with_suffix(".alst.py")), str(model_dir))
    assert verdict["mlp_tiled"] and verdict["checkpointing"] and verdict["offloaded_layers"] == 2
    assert verdict["loss"] == pytest.approx(verdict["reference"], rel=1e-5)
    assert verdict["worst_relative_grad_error"] < 1e-4


# -- what an export says and which length it claims ------------------------------------------------------------------


def test_an_export_never_claims_a_length_its_trainer_cannot_reach(exports, plan_front):
    """Every export's length fits, as the oracle estimates what the trainer runs; ArcticTraining's version of the
    target config (no head chunk, no tiled RMSNorm, a larger loss tile) does not fit at 8K, so its recipe is for
    the longest length it fits, and says so."""
    from autotune.backends import Evaluation, make_backend
    from autotune.core.hardware import load_hardware

    hardware = load_hardware("cpu").with_memory_gib(CAPACITY_GIB)
    plan = make_backend("plan")
    model_config = load_model_config("tiny-llama")
    for (fmt, label), (result, _) in exports.items():
        claimed = result.re_estimate.to_dict() if result.re_estimate else result.entry["record"]
        assert claimed["status"] == "ok" and claimed["seq_len"] == result.config.seq_len, (fmt, label)
        assert result.config.seq_len <= result.entry["seq_len"]
    arctic, path = exports["arctic", "target"]
    assert arctic.partial and arctic.config.seq_len < 8192
    assert yaml.safe_load(path.read_text())["data"]["max_length"] == arctic.config.seq_len
    assert f"so this export is for {arctic.config.seq_len:,} tokens" in path.read_text()
    # what ArcticTraining runs at 8K does not fit there; what the recipe is for fits at its length
    at_target = ExportJob("tiny-llama", model_config, 2, 8192, Techniques(**knobs_of("target")))
    runs = make_exporter("arctic").trainer_techniques(at_target)
    assert plan.evaluate(Evaluation(model_config, runs, 8192, 2, hardware)).status == "oom"
    assert (
        plan.evaluate(Evaluation(model_config, arctic.config.techniques, arctic.config.seq_len, 2, hardware)).status
        == "ok"
    )


def test_a_partial_export_lists_what_its_trainer_will_not_do(exports):
    result, path = exports["accelerate-deepspeed", "target"]
    text = path.read_text()
    assert result.partial
    assert "# PARTIAL EXPORT (--allow-partial): Accelerate/Trainer with DeepSpeed will not do all" in text
    for knob in ("head_chunk", "mlp_tile_tokens", "loss_tile_tokens", "norm_tile_tokens"):
        assert f"#   {knob}: asked" in text, knob
    assert "# re-estimate of what Accelerate/Trainer with DeepSpeed runs: ok at 8,192 tokens" in text
    assert "# launch: accelerate launch --config_file" in text
    # JSON carries no comments: the DeepSpeed export's notes are in its .alst.py
    deepspeed, ds_path = exports["deepspeed", "target"]
    assert "#   head_chunk: asked 1, DeepSpeed runs null -- will not do" in ds_path.with_suffix(".alst.py").read_text()


def test_a_trainers_own_way_is_said_but_still_in_full(exports):
    result, path = exports["arctic", "middle"]
    assert result.gaps and not result.partial
    assert "ArcticTraining does some of it its own way, never with more device memory" in path.read_text()
    assert result.re_estimate.status == "ok" and result.config.seq_len == 4096


def test_export_picks_the_fastest_config_its_trainer_runs_in_full(plan_front, tmp_path, capsys):
    assert (
        main(["export", str(plan_front), "--format", "arctic", "--target", "2K", "-o", str(tmp_path / "r.yaml")]) == 0
    )
    capsys.readouterr()
    # the short config is faster, but ArcticTraining has no tiled loss without Ulysses: the middle one
    assert yaml.safe_load((tmp_path / "r.yaml").read_text())["data"]["max_length"] == 4096
    assert (
        main(["export", str(plan_front), "--format", "deepspeed", "--target", "2K", "-o", str(tmp_path / "ds.json")])
        == 0
    )
    assert "max_length" not in (tmp_path / "ds.json").read_text()
    assert "SEQ_LEN = 2048" in (tmp_path / "ds.alst.py").read_text()


def test_no_expressible_config_at_the_target_exits_1_with_the_longest_it_reaches(plan_front, capsys):
    assert main(["export", str(plan_front), "--format", "arctic"]) == 1
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert captured.out == "" and len(lines) == 1
    assert "no front config that --format arctic expresses in full reaches 8,192 tokens" in lines[0]
    assert "the longest its expressible configs reach is 4,096" in lines[0]
    # the front was searched for autotune's own trainer: a search for arctic is the way to an arctic config
    assert "autotune search ... --trainer arctic finds the fastest it runs in full" in lines[0]
    assert main(["export", str(plan_front), "--format", "accelerate-deepspeed", "--target", "2K"]) == 1
    assert "none of the front's configs is expressible" in capsys.readouterr().err


def test_allow_partial_exports_the_fastest_at_the_target(plan_front, capsys):
    assert main(["export", str(plan_front), "--format", "accelerate-deepspeed", "--allow-partial"]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["parallelism_config"]["parallelism_config_sp_size"] == 2
    assert "PARTIAL EXPORT" in captured.out


# -- autotune's own formats -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def search_dir(tmp_path_factory):
    """A search folder whose front holds one real measured trial (tiny-llama, 1 rank, 1K tokens)."""
    root = tmp_path_factory.mktemp("search")
    config = {
        "schema": "autotune/config-v1",
        "model": "tiny-llama",
        "hardware": "cpu",
        "gpus": 1,
        "seq_len": 1024,
        "techniques": TECHNIQUES,
        "predicted": None,
        "measured": None,
    }
    (root / "config.json").write_text(json.dumps(config))
    trial = run_cli(
        "trial", "--model", "tiny-llama", "--seq", "1K", "--config", str(root / "config.json"), "--steps", "1", "--json"
    )
    assert trial.returncode == 0, trial.stderr
    record = json.loads(trial.stdout)
    assert record["status"] == "ok"
    front = [
        {
            "trial": 0,
            "seq_len": 1024,
            "tokens_per_s": record["tokens_per_s"],
            "techniques": TECHNIQUES,
            "record": record,
        },
        {
            "trial": 1,
            "seq_len": 512,
            "tokens_per_s": record["tokens_per_s"] * 2,
            "techniques": {**TECHNIQUES, "activation_checkpointing": False},
            "record": {**record, "seq_len": 512},
        },
    ]
    (root / "pareto.json").write_text(
        json.dumps({"model": "tiny-llama", "hardware": "cpu", "gpus": 1, "target": 1024, "front": front})
    )
    return root


def export(search_dir, *args, capsys):
    code = main(["export", str(search_dir), *args])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured


def test_autotune_format_round_trips(search_dir, tmp_path, capsys):
    export(search_dir, "--format", "autotune", "-o", str(tmp_path / "best.json"), capsys=capsys)
    loaded = load_config_file(tmp_path / "best.json")
    assert loaded.seq_len == 1024 and loaded.techniques.activation_checkpointing
    assert loaded.measured["status"] == "ok"


def test_any_front_target_can_be_exported(search_dir, capsys):
    out = export(search_dir, "--target", "512", capsys=capsys).out
    assert json.loads(out)["seq_len"] == 512  # the fastest config reaching 512 tokens


def test_torchrun_export_trains_and_matches_the_trial_loss(search_dir, tmp_path, capsys):
    export(search_dir, "--format", "torchrun", "-o", str(tmp_path / "train.sh"), capsys=capsys)
    env = {
        **os.environ,
        "STEPS": "2",
        "CONFIG": str(tmp_path / "cfg.json"),
        "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),
    }
    result = subprocess.run(
        ["bash", str(tmp_path / "train.sh"), "--log-file", "log.jsonl"],  # the script's arguments reach the trainer
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    summary = json.loads(result.stdout.split("summary ", 1)[1].splitlines()[0])
    trial_loss = json.loads((search_dir / "pareto.json").read_text())["front"][0]["record"]["loss"]
    assert summary["steps"] == 2
    assert [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()] == [1, 2]
    assert summary["first_loss"] == pytest.approx(trial_loss, rel=1e-6)


def test_run_trains_on_a_parquet_file(tmp_path):
    tokens = [[(7 * i + j) % 4096 for j in range(700)] for i in range(4)]
    pq.write_table(pa.table({"input_ids": tokens}), tmp_path / "tokens.parquet")
    config = {
        "schema": "autotune/config-v1",
        "model": "tiny-llama",
        "hardware": "cpu",
        "gpus": 1,
        "seq_len": 512,
        "techniques": TECHNIQUES,
        "predicted": None,
        "measured": None,
    }
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    result = run_cli(
        "run", "--config", str(tmp_path / "cfg.json"), "--steps", "3", "--data", str(tmp_path / "tokens.parquet")
    )
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 3
    summary = json.loads(result.stdout.split("summary ", 1)[1].splitlines()[0])
    # a periodic token stream is far more predictable than uniform noise, but step 1 is untrained: ~ln(4096)
    assert 7.5 < summary["first_loss"] < 9.0


def test_export_beyond_the_front_fails_cleanly(search_dir, capsys):
    assert main(["export", str(search_dir), "--target", "1M"]) == 2
    assert "longest reached is 1,024" in capsys.readouterr().err


def test_export_makes_a_missing_folder_and_says_each_line_as_autotune(tmp_path, capsys):
    """``-o`` into folders that do not exist yet makes them; what the export says (the trainer's ZeRO-3 buffers here)
    is an ``autotune:`` line, as the rest of its output."""
    techniques = {"fsdp": True, "optimizer_offload": True, "activation_checkpointing": True, "ulysses_degree": 2}
    record = {"status": "ok", "source": "predicted", "seq_len": 4096, "peak_device_bytes": 2**20}
    front = [{"trial": 3, "seq_len": 4096, "tokens_per_s": 5000.0, "techniques": techniques, "record": record}]
    doc = {"model": "tiny-llama", "hardware": "cpu", "gpus": 2, "target": 4096, "front": front}
    (tmp_path / "pareto.json").write_text(json.dumps(doc))
    output = tmp_path / "no" / "such" / "ds.json"
    assert main(["export", str(tmp_path), "--format", "deepspeed", "-o", str(output)]) == 0
    err = capsys.readouterr().err
    assert (
        json.loads(output.read_text())["zero_optimization"]["stage"] == 3 and output.with_suffix(".alst.py").is_file()
    )
    lines = err.strip().splitlines()
    assert "ZeRO-3" in err and all(line.startswith("autotune: ") for line in lines), err


def test_export_to_where_no_folder_can_be_made_is_bad_input(search_dir, tmp_path, capsys):
    (tmp_path / "a-file").write_text("")
    for output, says in ((tmp_path / "a-file" / "best.json", "cannot be written"), (tmp_path, "is a folder")):
        assert main(["export", str(search_dir), "-o", str(output)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], lines


def test_the_accelerate_launch_line_gives_the_script_a_model_folder():
    """The ``.train.py`` reads ``--model`` as a folder (config.json + safetensors): the launch line names one, never
    a hub id, and says which model to download into it."""
    from trials.training.config_file import TrialConfig

    def launch(model: str) -> str:
        config = TrialConfig(
            model=model, hardware="h100-sxm", gpus=8, nodes=1, seq_len=1024, techniques=Techniques(), predicted=None,
            measured=None,
        )  # fmt: skip
        return make_exporter("accelerate").launch("acc.yaml", config)

    line = launch("llama3-8b")
    assert " --model HF_FOLDER " in line and "meta-llama/Meta-Llama-3-8B downloaded" in line, line
    assert " --model /models/Qwen3-8B " in launch("/models/Qwen3-8B/config.json")


def test_exports_that_write_an_optimizer_write_autotune_runs_adamw():
    """The DeepSpeed config's and the Arctic recipe's AdamW (lr, betas, weight decay) and the clipping are
    ``autotune run``'s defaults (trials.train's options), so a config trains alike under either."""
    from autotune.outputs.exporters.arctic_recipe import ArcticRecipeExporter
    from autotune.outputs.exporters.deepspeed_config import deepspeed_json
    from trials.train import TrainOptions
    from trials.training.config_file import TrialConfig

    run = TrainOptions(config="")
    ds = deepspeed_json(Techniques(fsdp=True))
    assert ds["optimizer"]["params"] == {
        "lr": run.lr,
        "betas": [run.beta1, run.beta2],
        "weight_decay": run.weight_decay,
    }
    assert ds["gradient_clipping"] == run.max_grad_norm
    config = TrialConfig(
        model="tiny-llama", hardware="cpu", gpus=2, nodes=1, seq_len=1024, techniques=Techniques(fsdp=True),
        predicted=None, measured=None,
    )  # fmt: skip
    optimizer = ArcticRecipeExporter().recipe(config)["optimizer"]
    assert (optimizer["learning_rate"], optimizer["betas"], optimizer["weight_decay"]) == (
        run.lr, [run.beta1, run.beta2], run.weight_decay
    )  # fmt: skip


def test_a_search_given_a_model_folder_exports_that_folder_for_from_pretrained(tmp_path):
    """``--model /path/to/folder``: the exports' ``from_pretrained`` argument is the folder the search was given,
    not the placeholder a user must replace; a preset gives its hub id, a tiny test preset the placeholder."""
    from autotune.outputs.exporters.base import MODEL_PLACEHOLDER, hf_model_name

    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert hf_model_name(str(folder)) == str(folder)
    assert hf_model_name(str(folder / "config.json")) == str(folder)
    assert hf_model_name("llama3-8b").startswith("meta-llama/")
    assert hf_model_name("tiny-llama") == MODEL_PLACEHOLDER
    assert hf_model_name(str(tmp_path / "no-such-folder")) == MODEL_PLACEHOLDER
