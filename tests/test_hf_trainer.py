"""The stack inside Hugging Face's ``Trainer`` (``trials.hf_trainer``) trains the plain model exactly.

- ``accelerate launch`` (the real CLI) runs the ``accelerate`` export's ``.trainer.py`` (``transformers.Trainer``
  with ``StackTrainer``) on 2 processes with Ulysses 2, head chunk 1, FSDP2, checkpointing, offload and the three
  tiles, a tiny Llama saved by ``transformers``: each logged loss is the plain one-process ``Trainer``'s on the same
  data, each rank's peak within 2% of ``autotune estimate``'s for the exported config, a run resumed from the step-2
  checkpoint (on 2 processes, and on one without Ulysses: DCP reshards) logs the same step-3 loss and saves the same
  model, which ``from_pretrained`` loads; the script with
  TRL's ``SFTTrainer`` (``--sft``) logs the same losses in the same memory; a config the integration cannot run
  (``fsdp`` off on 2 processes) stops before training with one line naming the knob.
- A ring config's script (ring_degree 2 over the 2 processes, a short sequence) logs the plain ``Trainer``'s losses.
- In one process: gradient accumulation over 2 micro-batches logs the plain ``Trainer``'s losses and gradient norms.
- In one process: each ``TrainingArguments`` (and TRL ``SFTConfig``) field the stack needs, set otherwise, is
  refused in one line naming it, before the trainer prepares anything.
- In one process: a trainer made without ``use_cpu`` on a machine without CUDA, or in a run whose processes are
  not the model's mesh's or do not split into its Ulysses x ring groups, is refused in one line that says the fix.
- ``--sft --packing``: TRL's ``SFTTrainer(packing=True)`` on 2 processes logs the plain one-process
  ``SFTTrainer``'s first loss on the same packed documents (the plain model attending per document).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

KNOBS = dict(
    fsdp=True,
    ulysses_degree=2,
    head_chunk=1,
    activation_checkpointing=True,
    activation_offload_layers=2,
    mlp_tile_tokens=256,
    loss_tile_tokens=256,
    norm_tile_tokens=256,
)
SEQ_LEN = 2048
RING = dict(fsdp=True, ring_degree=2)  # a ring over the 2 processes, no Ulysses
DOCUMENT_LENGTH = 1000  # each window of SEQ_LEN cut into documents of 1000, 1000 and 48 tokens; TRL packs them back
RING_SEQ_LEN = 512  # short: the ring's run shows that the script starts and trains a ring, at little cost
PYTHONPATH = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])  # the checkout first
LR = "1e-3"  # large enough that each step's loss moves: the logged losses after step 1 check the gradients too

# the plain one-process references, all in one interpreter (a fresh one costs more than these runs): for each job
# of argv[1] (JSON) its logged losses by step, as JSON. "trainer": the plain Trainer on the script's data (example i:
# synthetic tokens of window i, seq_len of them); "packed_sft": the plain SFTTrainer packing the same windows cut
# into documents of `length` (TRL's packing: best-fit decreasing, padding-free), the plain model attending per
# document through transformers' own reading of position_ids that restart at 0 (torch SDPA with the block-diagonal
# mask it builds from them when a batch has no attention_mask)
PLAIN = """
import json, sys, torch
import datasets
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments
from trl import SFTConfig, SFTTrainer
from trials.kernels.documents import Documents
from trials.training.data import synthetic_sample

def trainer(folder, seq_len, steps, lr, out):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    data = [synthetic_sample(i, seq_len - 1, model.config.vocab_size, 0) for i in range(steps)]
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=1, learning_rate=lr,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, train_sampling_strategy="sequential")
    return Trainer(model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in data])

def packed_sft(folder, seq_len, steps, lr, out, length):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    windows = [synthetic_sample(i, seq_len - 1, model.config.vocab_size, 0).tolist() for i in range(steps)]
    spans = Documents.packed(seq_len, [length]).spans()
    rows = datasets.Dataset.from_list([{"input_ids": w[a:b]} for w in windows for a, b in spans])
    args = SFTConfig(output_dir=out, max_steps=steps, per_device_train_batch_size=1, learning_rate=lr,
        logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, train_sampling_strategy="sequential",
        packing=True, padding_free=True, max_length=seq_len)
    return SFTTrainer(model=model, args=args, train_dataset=rows, processing_class=AutoTokenizer.from_pretrained(folder))

said = {}
for name, (kind, *args) in json.loads(sys.argv[1]).items():
    run = {"trainer": trainer, "packed_sft": packed_sft}[kind](*args)
    run.train()
    said[name] = {e["step"]: e["loss"] for e in run.state.log_history if "loss" in e}
print(json.dumps(said))
"""


def launch(script, config_yaml, *args, cwd):
    return subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--config_file", str(config_yaml)]
        + ["--main_process_port", "0"]  # a free port: other tests may launch at the same time (pytest-xdist)
        + [str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
    )


def export_search(root, name: str, techniques: Techniques, seq_len: int) -> None:
    """The ``accelerate`` export of ``techniques`` at ``seq_len`` on 2 CPU ranks for root's model, as ``autotune
    export`` writes it from a search folder (``{name}-search``): ``{name}.yaml`` and its companions in root."""
    from autotune.backends import Evaluation, make_backend
    from autotune.cli import main
    from autotune.core.hardware import load_hardware

    model_json = str(root / "model" / "config.json")
    record = make_backend("plan").evaluate(
        Evaluation(load_model_config(model_json), techniques, seq_len, 2, load_hardware("cpu"))
    )
    assert record.status == "ok"
    entry = {"trial": 0, "seq_len": seq_len, "tokens_per_s": record.tokens_per_s, "techniques": techniques.to_dict()}
    search = root / f"{name}-search"
    search.mkdir()
    (search / "pareto.json").write_text(
        json.dumps(
            {
                "model": model_json,
                "hardware": "cpu",
                "gpus": 2,
                "target": seq_len,
                "front": [{**entry, "record": record.to_dict()}],
            }
        )
    )
    assert main(["export", str(search), "--format", "accelerate", "-o", str(root / f"{name}.yaml")]) == 0


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A tiny Llama saved by ``transformers`` and two ``accelerate`` exports on 2 CPU ranks: KNOBS at SEQ_LEN
    (``sp.yaml``) and RING at RING_SEQ_LEN (``ring.yaml``): the folder."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("hf-trainer")
    values = {k: v for k, v in load_model_config("tiny-llama").items() if not k.startswith("_")}
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**values)).save_pretrained(root / "model")
    tokens = Tokenizer(models.WordLevel({f"t{i}": i for i in range(values["vocab_size"])}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokens, pad_token="t0", unk_token="t0").save_pretrained(root / "model")
    export_search(root, "sp", Techniques(**KNOBS), SEQ_LEN)
    export_search(root, "ring", Techniques(**RING), RING_SEQ_LEN)
    return root


@pytest.fixture(scope="module")
def plain(exported) -> dict:
    """The plain one-process references' logged losses by step (PLAIN, one process): "sp" (the Trainer, SEQ_LEN, 3
    steps), "ring" (the Trainer, RING_SEQ_LEN, 2 steps), "packed" (the packing SFTTrainer, SEQ_LEN, documents of
    DOCUMENT_LENGTH, 1 step)."""
    root = exported
    jobs = {
        "sp": ["trainer", str(root / "model"), SEQ_LEN, 3, float(LR), str(root / "plain")],
        "ring": ["trainer", str(root / "model"), RING_SEQ_LEN, 2, float(LR), str(root / "plain-ring")],
        "packed": ["packed_sft", str(root / "model"), SEQ_LEN, 1, float(LR), str(root / "plain-packed"),
                   DOCUMENT_LENGTH],
    }  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-c", PLAIN, json.dumps(jobs)],
        capture_output=True, text=True, timeout=600, cwd=root, env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_trainer_trains_resumes_and_saves_like_the_plain_trainer_in_the_estimated_memory(exported, plain, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    from autotune.cli import main

    capsys.readouterr()
    root = exported
    script = root / "sp.trainer.py"
    first = launch(script, root / "sp.yaml", "--model", root / "model", "--output-dir", root / "a", "--steps", 3,
                   "--lr", LR, "--save-steps", 2, "--summary", root / "a.json", cwd=root)  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads((root / "a.json").read_text())
    plain_losses = plain["sp"]
    assert summary["world_size"] == 2 and list(summary["losses"]) == ["1", "2", "3"]
    for step, loss in plain_losses.items():
        assert summary["losses"][step] == pytest.approx(loss, rel=1e-5), (summary["losses"], plain_losses)

    capsys.readouterr()
    estimate = main(["estimate", "--model", str(root / "model" / "config.json"), "--seq", str(SEQ_LEN),
                     "--config", str(root / "sp.autotune.json"), "--gpus", "2", "--hardware", "cpu", "--json"])  # fmt: skip
    assert estimate == 0
    predicted = json.loads(capsys.readouterr().out)["peak_device_bytes"]
    measured = [rank["peak_device_bytes"] for rank in summary["ranks"]]
    assert len(measured) == 2
    for peak in measured:
        assert abs(peak - predicted) <= 0.02 * predicted, (measured, predicted)

    sft = launch(script, root / "sp.yaml", "--model", root / "model", "--output-dir", root / "sft", "--steps", 3,
                 "--lr", LR, "--sft", "--summary", root / "sft.json", cwd=root)  # fmt: skip
    assert sft.returncode == 0, sft.stderr[-3000:]
    sft_summary = json.loads((root / "sft.json").read_text())
    for step, loss in plain_losses.items():
        assert sft_summary["losses"][step] == pytest.approx(loss, rel=1e-5), (sft_summary["losses"], plain_losses)
    for peak in [rank["peak_device_bytes"] for rank in sft_summary["ranks"]]:
        assert abs(peak - predicted) <= 0.02 * predicted, (sft_summary["ranks"], predicted)

    resumed = launch(script, root / "sp.yaml", "--model", root / "model", "--output-dir", root / "b", "--steps", 3,
                     "--lr", LR, "--resume", root / "a" / "checkpoint-2", "--summary", root / "b.json", cwd=root)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert json.loads((root / "b.json").read_text())["losses"]["3"] == pytest.approx(summary["losses"]["3"], rel=1e-5)

    # the same checkpoint resumed by one process (no Ulysses): DCP reshards the 2-rank shards
    one_rank = json.loads((root / "sp.autotune.json").read_text())
    one_rank["gpus"], one_rank["techniques"]["ulysses_degree"], one_rank["techniques"]["head_chunk"] = 1, 1, None
    (root / "one.json").write_text(json.dumps(one_rank))
    alone = subprocess.run(
        [sys.executable, script, "--model", root / "model", "--output-dir", root / "one", "--steps", "3", "--lr", LR,
         "--config", root / "one.json", "--resume", root / "a" / "checkpoint-2", "--summary", root / "one-sum.json"],
        capture_output=True, text=True, timeout=600, cwd=root, env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )  # fmt: skip
    assert alone.returncode == 0, alone.stderr[-3000:]
    assert json.loads((root / "one-sum.json").read_text())["losses"]["3"] == pytest.approx(
        summary["losses"]["3"], rel=1e-5
    )

    initial = AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.float32).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(root / "a" / "final", dtype=torch.float32).state_dict()
    for resumed_run in ("b", "one"):
        again = AutoModelForCausalLM.from_pretrained(root / resumed_run / "final", dtype=torch.float32).state_dict()
        assert trained.keys() == initial.keys() == again.keys()
        for name, tensor in trained.items():
            assert not torch.equal(tensor, initial[name]), name  # three steps moved every tensor
            torch.testing.assert_close(again[name], tensor, rtol=1e-5, atol=1e-6, msg=f"{resumed_run}: {name}")

    unsharded = root / "unsharded.json"
    unsharded.write_text((root / "sp.autotune.json").read_text().replace('"fsdp": true', '"fsdp": false'))
    refused = launch(script, root / "sp.yaml", "--model", root / "model", "--output-dir", root / "c",
                     "--config", unsharded, cwd=root)  # fmt: skip
    assert refused.returncode != 0
    said = [line for line in refused.stderr.splitlines() if line.startswith("sp.trainer.py: ")]
    assert len(said) == 1 and said[0].startswith("sp.trainer.py: fsdp: "), refused.stderr[-3000:]
    assert "'loss'" not in refused.stdout and not list((root / "c").glob("checkpoint-*"))


@pytest.mark.slow
def test_a_ring_config_trains_like_the_plain_trainer(exported, plain):
    """The ring export's script (ring_degree 2 over the 2 processes, no Ulysses) joins a mesh with its ring and logs
    the plain one-process Trainer's losses on the same data."""
    root = exported
    run = launch(root / "ring.trainer.py", root / "ring.yaml", "--model", root / "model", "--output-dir", root / "ring",
                 "--steps", 2, "--lr", LR, "--summary", root / "ring-sum.json", cwd=root)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    plain_losses = plain["ring"]
    summary = json.loads((root / "ring-sum.json").read_text())
    assert summary["world_size"] == 2 and list(summary["losses"]) == list(plain_losses) == ["1", "2"]
    for step, loss in plain_losses.items():
        assert summary["losses"][step] == pytest.approx(loss, rel=1e-5), (summary["losses"], plain_losses)


@pytest.mark.slow
def test_sft_packing_masks_documents_and_logs_the_plain_sft_trainers_first_loss(exported, plain):
    """TRL's ``SFTTrainer(packing=True)`` through the export's script (``--sft --packing``, 2 processes, KNOBS): its
    batches' position_ids restart at each document, the stack masks the documents, and the first logged loss is the
    plain one-process SFTTrainer's on the same packed documents."""
    root = exported
    packed = json.loads((root / "sp.autotune.json").read_text())
    packed["documents"] = DOCUMENT_LENGTH
    (root / "packed.json").write_text(json.dumps(packed))
    run = launch(root / "sp.trainer.py", root / "sp.yaml", "--model", root / "model", "--output-dir", root / "packed",
                 "--steps", 1, "--lr", LR, "--sft", "--packing", "--config", root / "packed.json",
                 "--summary", root / "packed-sum.json", cwd=root)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    plain_losses = plain["packed"]
    losses = json.loads((root / "packed-sum.json").read_text())["losses"]
    assert list(losses) == list(plain_losses) == ["1"]
    assert losses["1"] == pytest.approx(plain_losses["1"], rel=1e-5), (losses, plain_losses)


# each field the stack needs (TRL's SFTConfig's too), set to a value it cannot run; the script prints each refusal
REFUSALS = """
import json
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments
from trl import SFTConfig, SFTTrainer
from trials import hf
from trials.hf_trainer import REQUIRED_ARGUMENTS, SFT_ARGUMENTS, StackTrainer, StackTrainerError, StackTrainerMixin
from trials.hf_trainer import training_arguments
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

class StackSFTTrainer(StackTrainerMixin, SFTTrainer):
    pass

values = {k: v for k, v in load_model_config("tiny-llama").items() if not k.startswith("_")}
model = hf.apply(AutoModelForCausalLM.from_config(AutoConfig.for_model(**values)), Techniques())
others = {"per_device_train_batch_size": 2, "eval_strategy": "steps", "optim": "sgd", "label_smoothing_factor": 0.1}
said = {}
for field, (value, _) in {**REQUIRED_ARGUMENTS, **SFT_ARGUMENTS}.items():
    sft = field in SFT_ARGUMENTS
    config, trainer = (SFTConfig, StackSFTTrainer) if sft else (TrainingArguments, StackTrainer)
    stack = {**training_arguments(sft=sft), field: others.get(field, not value)}
    args = config(output_dir="out", report_to=[], use_cpu=True, **stack)
    try:
        trainer(model=model, args=args, train_dataset=[], eval_dataset=[])
        said[field] = None
    except StackTrainerError as exc:
        said[field] = str(exc)
try:
    StackTrainer(model=model.lm, args=TrainingArguments(output_dir="out", report_to=[], use_cpu=True))
except StackTrainerError as exc:
    said["model"] = str(exc)
print(json.dumps(said))
"""


# what the stack needs the Trainer not to do, written out here rather than read from the code under test: one
# sequence per rank, no evaluation, its own AdamW, precision and checkpointing, no label smoothing or compile, the
# optimizer's state in the checkpoints; TRL's: its own activation offload, no Liger kernels
STACK_FIELDS = {
    "per_device_train_batch_size", "eval_strategy", "optim", "bf16", "fp16", "bf16_full_eval", "fp16_full_eval",
    "activation_checkpointing", "label_smoothing_factor", "torch_compile", "save_only_model",
}  # fmt: skip
SFT_FIELDS = {"activation_offloading", "use_liger_kernel"}


def test_the_trainer_refuses_each_argument_the_stack_cannot_run_naming_it(tmp_path):
    from trials.hf_trainer import REQUIRED_ARGUMENTS, SFT_ARGUMENTS

    assert set(REQUIRED_ARGUMENTS) == STACK_FIELDS and set(SFT_ARGUMENTS) == SFT_FIELDS

    result = subprocess.run(
        [sys.executable, "-c", REFUSALS],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    said = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(said) == {*STACK_FIELDS, *SFT_FIELDS, "model"}
    for field, line in said.items():
        assert line is not None, field
        assert "\n" not in line and (line.startswith(f"{field} ") or line.startswith(f"{field}:")), (field, line)


# one process: the plain Trainer and StackTrainer (FSDP2 on a 1-rank mesh, checkpointing, tiles) with gradient
# accumulation over 2 micro-batches, 2 steps, on the same 4 sequences; prints both logged losses and gradient norms
ACCUMULATION = """
import copy, json, torch
from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments
from trials import hf
from trials.hf_trainer import StackTrainer, training_arguments
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques
from trials.training.data import synthetic_sample

values = {k: v for k, v in load_model_config("tiny-llama").items() if not k.startswith("_")}
torch.manual_seed(7)
plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(**values))
stacked = hf.apply(copy.deepcopy(plain), Techniques(fsdp=True, activation_checkpointing=True, mlp_tile_tokens=64,
                                                    loss_tile_tokens=64, norm_tile_tokens=64))
data = [synthetic_sample(i, 255, values["vocab_size"], 3) for i in range(4)]
data = [{"input_ids": t, "labels": t} for t in data]
common = dict(max_steps=2, gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=1, save_strategy="no",
              report_to=[], use_cpu=True, train_sampling_strategy="sequential")
losses = {}
for name, trainer_class, model, extra in (("plain", Trainer, plain, {"per_device_train_batch_size": 1}),
                                          ("stack", StackTrainer, stacked, training_arguments())):
    trainer = trainer_class(model=model, args=TrainingArguments(output_dir=name, **common, **extra), train_dataset=data)
    trainer.train()
    losses[name] = [[e["loss"], e["grad_norm"]] for e in trainer.state.log_history if "loss" in e]
print(json.dumps(losses))
"""


@pytest.mark.slow
def test_gradient_accumulation_trains_like_the_plain_trainer(tmp_path):
    result = subprocess.run(
        [sys.executable, "-c", ACCUMULATION],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(losses["plain"]) == 2 and losses["plain"][0][0] != losses["plain"][1][0]
    for stack, plain in zip(losses["stack"], losses["plain"]):
        assert stack == pytest.approx(plain, rel=1e-5), losses


# StackTrainer made in one process where it cannot train: without use_cpu on the CPU, and in a run of 2 processes
# (WORLD_SIZE, set once the arguments exist) with a model applied on this 1-process mesh; prints each refusal
MISLAUNCHED = """
import json, os
from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments
from trials import hf
from trials.hf_trainer import StackTrainer, StackTrainerError, training_arguments
from trials.models.config import load_model_config
from trials.stack.techniques import Techniques

values = {k: v for k, v in load_model_config("tiny-llama").items() if not k.startswith("_")}
model = hf.apply(AutoModelForCausalLM.from_config(AutoConfig.for_model(**values)), Techniques())
said = {}
for case, use_cpu, world in (("fits", True, None), ("use_cpu", False, None), ("world", True, "2")):
    args = TrainingArguments(output_dir="out", report_to=[], **{**training_arguments(), "use_cpu": use_cpu})
    if world:
        os.environ["WORLD_SIZE"] = world
    try:
        StackTrainer(model=model, args=args, train_dataset=[])
        said[case] = None
    except StackTrainerError as exc:
        said[case] = str(exc)
    os.environ.pop("WORLD_SIZE", None)
print(json.dumps(said))
"""


@pytest.fixture(scope="module")
def mislaunched(tmp_path_factory) -> dict:
    """What StackTrainer said in each MISLAUNCHED case (None: it was made)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    result = subprocess.run(
        [sys.executable, "-c", MISLAUNCHED],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path_factory.mktemp("mislaunched"),
        env={**env, "PYTHONPATH": PYTHONPATH, "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_trainer_on_the_cpu_without_use_cpu_is_refused_when_made(mislaunched):
    assert mislaunched["fits"] is None
    line = mislaunched["use_cpu"]
    assert line.startswith("use_cpu False: ") and "\n" not in line and "use_cpu=True" in line, line


def test_a_run_of_other_processes_than_the_models_mesh_is_refused_when_made(mislaunched):
    line = mislaunched["world"]
    assert line.startswith("processes: ") and "\n" not in line and "world size 1, this run 2 processes" in line, line


def test_a_world_the_ulysses_and_ring_groups_do_not_divide_names_the_launch_that_does():
    from trials.core.dist import Mesh
    from trials.hf_trainer import world_problem

    techniques = Techniques(ulysses_degree=2, ring_degree=2)
    line = world_problem(Mesh.single(), techniques, 2)
    assert line is not None and "\n" not in line, line
    assert line.startswith("processes: ulysses_degree 2 x ring_degree 2 splits each sequence over 4 processes, "), line
    assert "this run has 2" in line and "accelerate launch --multi_gpu --num_processes 4 " in line, line
    mesh = Mesh(rank=0, world_size=8, sp_degree=2, device=Mesh.single().device, ring_degree=2)
    assert world_problem(mesh, techniques, 8) is None
