"""Training LoRA adapters (``trials.models.lora``) with the trainers that run them, as their users run them.

- ``autotune run`` (the CLI, a fresh process) trains a LoRA config from a tiny Llama saved by ``transformers``, with
  the embedding and the norms trained whole (LongLoRA's recipe, peft's ``modules_to_save``): its first loss is
  ``transformers``' loss of the saved model (B starts at zero), a run stopped at step 2 on 2 Ulysses ranks and resumed
  on 1 rank logs the uninterrupted run's losses, its checkpoints hold the trained tensors and their optimizer state
  alone, ``--export-hf`` writes a folder ``peft.PeftModel.from_pretrained`` loads (the adapters and the modules
  trained: the logits move off the base's) and ``--export-merged`` one ``from_pretrained`` loads with the logits of
  peft's own ``merge_and_unload``; a resume on another base is refused in one line.
- TRL's ``SFTTrainer`` with a ``peft_config`` (its ``modules_to_save`` the embedding and the norms) and the two lines
  of the Hugging Face Trainer path (``trials.hf.apply(..., lora=peft_config)``, ``StackTrainerMixin``) under
  ``accelerate launch`` on 2 CPU processes (Ulysses 2, FSDP2, checkpointing) logs the plain one-process
  ``SFTTrainer``'s losses (peft training copies of those modules, the stack the modules themselves), and
  ``save_model`` writes the adapters and the modules as peft does.
- A LoRA search exports to the trainers that train adapters, with a line saying how, and is refused by the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, run_cli
from train_harness import (
    first_window,
    hf_loss,
    log_of,
    write_config,
    write_document,
    write_pretrained,
)

LORA = {"rank": 4, "alpha": 8.0, "targets": "all-linear", "trainable": ["embed_tokens", "norm"]}
WHOLE = ("embed_tokens.", "norm.")  # the names of the tensors trained whole
STEPS = ["--steps", "4", "--lr", "1e-2", "--beta2", "0.98"]  # lr large enough that the adapters move each step


def lora_config(path: Path, gpus: int = 1, **techniques) -> str:
    write_config(path, gpus, **techniques)
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "lora": LORA}))
    return str(path)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    work = tmp_path_factory.mktemp("lora-train")
    write_pretrained(work / "pretrained")
    vocabulary = {f"t{i}": i for i in range(4096)}  # TRL's SFTTrainer loads the folder's tokenizer
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="t0", unk_token="t0").save_pretrained(
        work / "pretrained"
    )
    write_document(work / "document.parquet")
    lora_config(work / "one.json")
    lora_config(work / "ulysses.json", gpus=2, ulysses_degree=2)
    return work


def autotune_run(work: Path, *args) -> subprocess.CompletedProcess:
    common = ["--init", str(work / "pretrained"), "--data", str(work / "document.parquet"), *STEPS]
    return run_cli("run", *common, *map(str, args), env={"OMP_NUM_THREADS": "1"})


def logits(model, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(tokens[None]).logits


@pytest.mark.slow
def test_autotune_run_trains_adapters_resumes_them_exactly_and_writes_what_peft_loads(work):
    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    straight = autotune_run(work, "--config", work / "one.json", "--log-file", work / "straight.jsonl",
                            "--export-hf", work / "adapters", "--export-merged", work / "merged")  # fmt: skip
    assert straight.returncode == 0, straight.stderr[-3000:]
    assert "exported the adapters to" in straight.stdout
    # the adapters' 36,352, the embedding's 4,096 x 128 and the 9 norms' 128 each
    trained = "training LoRA rank 4 (alpha 8) on all linear layers, embed_tokens and norm trained whole: 561,792 of "
    assert trained + "1,790,592 parameters" in straight.stdout, straight.stdout
    uninterrupted = log_of(work / "straight.jsonl")
    tokens = first_window(work / "document.parquet")
    assert uninterrupted[0]["loss"] == pytest.approx(hf_loss(work / "pretrained", tokens), rel=1e-5)

    # 2 steps on 2 Ulysses ranks, then resumed on 1: the same losses; the checkpoint holds the adapters alone
    half = ["--log-file", work / "resumed.jsonl", "--save", work / "ckpt"]
    first = autotune_run(work, "--config", work / "ulysses.json", *half, "--steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    stored = FileSystemReader(str(work / "ckpt" / "step-00000002")).read_metadata().state_dict_metadata
    weights = [key for key in stored if key.startswith("model.")]
    assert any(".lora_A." in key for key in weights) and any("embed_tokens." in key for key in weights)
    assert all(".lora_A." in key or ".lora_B." in key or any(w in key for w in WHOLE) for key in weights), weights
    assert any(".lora_A." in key for key in stored if key.startswith("optimizer.state.")), sorted(stored)[:4]
    resumed = autotune_run(work, "--config", work / "one.json", *half, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "saved on 2 ranks" in resumed.stdout
    losses = [entry["loss"] for entry in log_of(work / "resumed.jsonl")]
    assert losses == pytest.approx([entry["loss"] for entry in uninterrupted], rel=1e-5)
    assert len(set(losses)) == len(losses)  # the adapters trained: each step's loss moved

    # the exports: peft loads the adapters onto the saved base; the merged folder is peft's merge_and_unload
    base = AutoModelForCausalLM.from_pretrained(work / "pretrained", dtype=torch.float32)
    window = tokens[:128]
    plain = logits(base, window)
    adapted = PeftModel.from_pretrained(base, work / "adapters")
    with_adapters = logits(adapted, window)
    assert (with_adapters - plain).abs().max() > 1e-3  # the exported adapters are the trained ones, not B = 0
    # the embedding trained whole is exported and peft uses it (its trained copy), not the base's
    exported = load_file(work / "adapters" / "adapter_model.safetensors")["base_model.model.model.embed_tokens.weight"]
    embedding = adapted.get_input_embeddings()
    assert type(embedding).__name__ == "ModulesToSaveWrapper", type(embedding)
    torch.testing.assert_close(embedding.modules_to_save["default"].weight, exported, rtol=0, atol=0)
    assert not torch.equal(embedding.original_module.weight, exported)
    merged = AutoModelForCausalLM.from_pretrained(work / "merged", dtype=torch.float32)
    torch.testing.assert_close(logits(merged, window), with_adapters, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits(merged, window), logits(adapted.merge_and_unload(), window), rtol=0, atol=1e-5)

    # the checkpoint's adapters were trained on the saved base: a resume on the seeded draw is refused
    other = run_cli("run", "--config", str(work / "one.json"), "--steps", "6", "--save", str(work / "ckpt"), "--resume")
    assert other.returncode == 2, other.stderr[-2000:]
    assert "trained adapters on" in other.stderr and "resume with the same --init" in other.stderr, other.stderr


# A TRL script with a peft_config: plain (one process, peft's get_peft_model inside SFTTrainer), or with the stack's two
# lines (trials.hf.apply with the same peft_config, then SFTTrainer with the mixin) under accelerate launch
SFT_SCRIPT = """
import json, sys, torch
import datasets
from peft import LoraConfig
from transformers import AutoModelForCausalLM, set_seed
from trl import SFTConfig, SFTTrainer
from trials.training.data import synthetic_sample
stack, folder, out, steps = sys.argv[1] == "stack", sys.argv[2], sys.argv[3], int(sys.argv[4])
seq_len = 512
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
rows = datasets.Dataset.from_list(
    [{"input_ids": synthetic_sample(i, seq_len - 1, model.config.vocab_size, 0).tolist()} for i in range(steps)]
)
peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM",
                         modules_to_save=["embed_tokens", "norm"])
arguments = dict(output_dir=out, max_steps=steps, learning_rate=1e-2, logging_steps=1, save_strategy="no",
    report_to=[], use_cpu=True, train_sampling_strategy="sequential", max_length=None, bf16=False,
    dataset_kwargs={"skip_prepare_dataset": True}, per_device_train_batch_size=1)
trainer_class = SFTTrainer
if stack:
    from trials import hf
    from trials.hf_trainer import StackTrainerMixin, training_arguments
    from trials.stack.techniques import Techniques

    class StackSFTTrainer(StackTrainerMixin, SFTTrainer):
        pass

    arguments.update(training_arguments(sft=True))
    set_seed(42)  # SFTConfig's default seed, as SFTTrainer seeds before get_peft_model: peft draws the same adapters
    model = hf.apply(model, Techniques(fsdp=True, ulysses_degree=2, activation_checkpointing=True), lora=peft_config)
    trainer_class = StackSFTTrainer
trainer = trainer_class(model=model, args=SFTConfig(**arguments), train_dataset=rows, peft_config=peft_config)
trainer.train()
trainer.save_model(out + "/final")
if trainer.is_world_process_zero():
    print(json.dumps({e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}))
"""


@pytest.mark.slow
def test_trl_sft_with_a_peft_config_and_the_stack_logs_the_plain_sft_trainers_losses(work, tmp_path):
    from safetensors.torch import load_file

    script = tmp_path / "sft.py"
    script.write_text(SFT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    plain = subprocess.run([sys.executable, script, "plain", work / "pretrained", tmp_path / "plain", "3"],
                           capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)  # fmt: skip
    assert plain.returncode == 0, plain.stderr[-3000:]
    accelerate = [os.path.join(os.path.dirname(sys.executable), "accelerate"), "launch", "--multi_gpu", "--num_processes",
                  "2", "--main_process_port", "0"]  # fmt: skip
    stack = subprocess.run([*accelerate, script, "stack", work / "pretrained", tmp_path / "stack", "3"],
                           capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)  # fmt: skip
    assert stack.returncode == 0, stack.stderr[-3000:]
    plain_losses = json.loads(plain.stdout.strip().splitlines()[-1])
    losses = json.loads(stack.stdout.strip().splitlines()[-1])
    assert list(losses) == list(plain_losses) == ["1", "2", "3"]
    assert list(losses.values()) == pytest.approx(list(plain_losses.values()), rel=1e-5), (losses, plain_losses)
    assert len(set(losses.values())) == 3  # the adapters trained: each step's loss moved
    # save_model wrote the adapters and the modules trained whole as SFTTrainer with a peft_config does: the same
    # tensor names and shapes
    ours, theirs = (load_file(tmp_path / side / "final" / "adapter_model.safetensors") for side in ("stack", "plain"))
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    for name in theirs:
        if ".lora_" in name:
            torch.testing.assert_close(ours[name], theirs[name], rtol=1e-3, atol=1e-5)
        else:  # an embedding row whose gradient sums to about zero over both ranks' tokens takes AdamW's step of the
            # rounding's sign: a few elements then differ by a fraction of the learning rate; the tensor agrees
            difference = torch.linalg.vector_norm(ours[name] - theirs[name])
            assert difference <= 1e-4 * torch.linalg.vector_norm(theirs[name]), (name, difference)
    assert any("embed_tokens" in name for name in theirs) and any("layernorm" in name for name in theirs)


def lora_search(root: Path, lora: dict) -> Path:
    """A search folder for tiny-llama on 2 CPU ranks with ``lora``'s adapters: one front config, priced by the plan
    backend, as ``autotune search --lora-rank`` writes it."""
    from autotune.backends import Evaluation, make_backend
    from autotune.core.hardware import load_hardware
    from trials.models.config import load_model_config
    from trials.models.lora import LoraSpec
    from trials.stack.techniques import Techniques

    techniques = Techniques(fsdp=True, ulysses_degree=2, activation_checkpointing=True)
    spec = LoraSpec.from_json(lora)
    evaluation = Evaluation(load_model_config("tiny-llama"), techniques, 1024, 2, load_hardware("cpu"), lora=spec)
    record = make_backend("plan").evaluate(evaluation)
    assert record.status == "ok"
    entry = {"trial": 0, "seq_len": 1024, "tokens_per_s": record.tokens_per_s, "techniques": techniques.to_dict()}
    search = root / "search"
    search.mkdir()
    front = {"model": "tiny-llama", "hardware": "cpu", "gpus": 2, "target": 1024, "lora": lora}
    (search / "pareto.json").write_text(json.dumps({**front, "front": [{**entry, "record": record.to_dict()}]}))
    return search


def test_a_lora_search_exports_its_adapters_to_the_trainers_that_train_them_and_no_other(tmp_path, capsys):
    from autotune.cli import main
    from trials.models.lora import LoraSpec
    from trials.training.config_file import load_config_file

    search = lora_search(tmp_path, LORA)
    for format, output in (("autotune", "best.json"), ("accelerate", "run.yaml")):
        assert main(["export", str(search), "--format", format, "-o", str(tmp_path / output)]) == 0
    said = capsys.readouterr()
    trained = "LoRA rank 4 (alpha 8) on all linear layers, embed_tokens and norm trained whole on the frozen model"
    assert trained + ": the config file's lora" in said.out + said.err
    assert load_config_file(str(tmp_path / "best.json")).lora == LoraSpec.from_json(LORA)
    script = (tmp_path / "run.trainer.py").read_text()
    assert '"lora"' in script and "lora=config.lora" in script  # the config it embeds, and the adapters put in
    assert main(["export", str(search), "--format", "deepspeed", "-o", str(tmp_path / "ds.json")]) == 2
    line = capsys.readouterr().err.strip().splitlines()
    assert len(line) == 1 and "DeepSpeed trains every weight only" in line[0], line
    assert not (tmp_path / "ds.json").exists()


@pytest.mark.slow
def test_the_accelerate_exports_trainer_script_trains_the_adapters_and_saves_what_peft_loads(work, tmp_path):
    """The ``accelerate`` export of a LoRA search, launched as it says on 2 CPU processes (Ulysses 2, FSDP2,
    checkpointing): step 1's loss is ``transformers``' loss of the saved model (B starts at zero), and the final folder
    is the trained adapters, which peft loads onto the saved model."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from autotune.cli import main
    from trials.training.data import synthetic_sample

    search = lora_search(tmp_path, LORA)
    assert main(["export", str(search), "--format", "accelerate", "-o", str(tmp_path / "run.yaml")]) == 0
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")

    def launch(out: str, *more) -> dict:
        done = subprocess.run(
            [accelerate, "launch", "--config_file", tmp_path / "run.yaml", "--main_process_port", "0",
             tmp_path / "run.trainer.py", "--model", work / "pretrained", "--output-dir", tmp_path / out,
             "--steps", "3", "--lr", "1e-2", *more],
            capture_output=True, text=True, timeout=600, cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.split("summary ", 1)[1].splitlines()[0])

    summary = launch("out", "--save-steps", "2")
    # resumed from step 2's checkpoint (the adapters and their optimizer state): step 3's loss and the adapters again
    resumed = launch("again", "--resume", tmp_path / "out" / "checkpoint-2")
    assert resumed["losses"]["3"] == pytest.approx(summary["losses"]["3"], rel=1e-6)
    ours, again = (load_file(tmp_path / out / "final" / "adapter_model.safetensors") for out in ("out", "again"))
    assert ours.keys() == again.keys() and all(torch.allclose(ours[k], again[k], atol=1e-6) for k in ours)
    window = synthetic_sample(0, 1023, 4096, 0)  # the script's example 0: 1,024 tokens
    assert summary["losses"]["1"] == pytest.approx(hf_loss(work / "pretrained", window), rel=1e-5)
    base = AutoModelForCausalLM.from_pretrained(work / "pretrained", dtype=torch.float32)
    plain = logits(base, window[:128])
    adapted = PeftModel.from_pretrained(base, tmp_path / "out" / "final")
    assert (logits(adapted, window[:128]) - plain).abs().max() > 1e-3  # the trained adapters, loaded
