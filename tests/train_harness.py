"""The trainer's runs that tests/test_train.py asserts and bench/train_resume.py prints: a tiny Llama saved by
``transformers`` (bf16 files), a repeated document, configs for 1 and 2 ranks, and ``trials.train`` started as a
fresh process each time, as ``autotune run`` (or torchrun) starts it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 256
STEPS = 50
DOCUMENT_TOKENS = 300
# the fine-tuning recipe of the runs: warmup, cosine decay, clipping, AdamW options
RECIPE = (
    f"--steps {STEPS} --lr 1e-3 --warmup-steps 10 --schedule cosine --min-lr 1e-4 --max-grad-norm 1.0 "
    "--beta2 0.98 --weight-decay 0.01"
).split()
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def write_config(path: Path, gpus: int = 1, **techniques) -> str:
    """A tiny-llama config of ``SEQ_LEN`` tokens on ``gpus`` CPU ranks: FSDP and checkpointing, plus ``techniques``."""
    knobs = {"fsdp": True, "activation_checkpointing": True, "attention": "sdpa", **techniques}
    config = {
        "schema": "autotune/config-v1",
        "model": "tiny-llama",
        "hardware": "cpu",
        "gpus": gpus,
        "seq_len": SEQ_LEN,
        "techniques": knobs,
    }
    path.write_text(json.dumps(config))
    return str(path)


def write_pretrained(folder: Path) -> None:
    """tiny-llama with seeded random weights, saved by ``transformers`` in bf16."""
    from transformers import AutoModelForCausalLM

    from trials.models.config import load_model_config
    from trials.models.model import hf_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_config(load_model_config("tiny-llama")), attn_implementation="eager")
    model.to(torch.bfloat16).save_pretrained(folder)


def write_document(path: Path, vocab_size: int = 4096) -> None:
    """A Parquet token file: one random document of ``DOCUMENT_TOKENS`` tokens, 20 times."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    document = torch.randint(0, vocab_size, (DOCUMENT_TOKENS,), generator=torch.Generator().manual_seed(1))
    pq.write_table(pa.table({"input_ids": [document.tolist()] * 20}), path)


def write_poisoned(pretrained: Path, folder: Path, token: int) -> None:
    """A copy of the ``pretrained`` folder whose input embedding of ``token`` is nan: a step that reads ``token``
    has a nan loss, the steps before it train as from ``pretrained``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(pretrained, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.embed_tokens.weight"][token] = float("nan")
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})


def write_windows(path: Path, windows: int, token_at: tuple[int, int] | None = None, vocab_size: int = 4000) -> None:
    """A Parquet ``tokens`` file of exactly ``windows`` windows of ``SEQ_LEN`` + 1 random ids below ``vocab_size``;
    ``token_at`` (token, index): that one id placed at that index of the stream."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    stream = torch.randint(0, vocab_size, (windows * (SEQ_LEN + 1),), generator=torch.Generator().manual_seed(2))
    if token_at is not None:
        stream[token_at[1]] = token_at[0]
    pq.write_table(pa.table({"tokens": stream.tolist()}), path)


def first_window(document: Path, vocab_size: int = 4096) -> torch.Tensor:
    """The token window step 1 trains on."""
    from trials.train import TokenSource

    return TokenSource(SEQ_LEN, vocab_size, path=str(document)).window(0)


def trainer(ranks: int, *args: str) -> list[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    return [sys.executable, *launcher, "-m", "trials.train", *args]


def train(ranks: int, *args: str, cwd: Path, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        trainer(ranks, *args), capture_output=True, text=True, env=ENV, cwd=cwd, timeout=600, preexec_fn=preexec_fn
    )


def summary_of(done: subprocess.CompletedProcess) -> dict:
    """The run's ``summary {json}`` line; the run must have exited 0."""
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.split("summary ", 1)[1].splitlines()[0])


def train_until_killed(ranks: int, *args: str, cwd: Path, after: str) -> int:
    """Start a run and SIGKILL its whole process group (launcher and every rank, as a node failure does) as soon as
    rank 0 prints a line containing ``after``; the run's return code."""
    process = subprocess.Popen(
        trainer(ranks, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ENV,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        for line in process.stdout:
            if after in line:
                os.killpg(process.pid, signal.SIGKILL)
                break
        return process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def log_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def hf_loss(folder: Path, tokens: torch.Tensor) -> float:
    """``transformers``' own loss of the model in ``folder`` (fp32, eager attention) on one window."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return float(model(tokens[None], labels=tokens[None]).loss)


def stored_largest(file: Path) -> tuple[int, str]:
    """(bytes, dtype) of the largest tensor of a safetensors file, as stored."""
    from safetensors import safe_open

    sizes = {"BF16": 2, "F16": 2, "F32": 4}
    with safe_open(file, framework="pt") as handle:
        slices = [handle.get_slice(key) for key in handle.keys()]
        return max((torch.Size(s.get_shape()).numel() * sizes[s.get_dtype()], s.get_dtype()) for s in slices)


def atomic_write_rank(
    rank: int, world: int, store: str, folder: str, fail_at: str, outcomes, timeout_s: float = 120, finish_s: float = 0
) -> None:
    """One gloo rank of ``trials.training.checkpoint._write_atomically`` into ``folder``, rank 0 failing at
    ``fail_at`` (``prepare``: making the partial folder; ``finish``: its own step after every write; ``""``: nowhere)
    and taking ``finish_s`` over its finish, the group's collectives timing out after ``timeout_s``. Puts (rank,
    "ok" or the error) on ``outcomes``, then stays alive, as a trainer that handles the error does."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from trials.training import checkpoint

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
    )
    checkpoint.WAIT_ROUND_S = timeout_s / 5
    final = Path(folder)
    if fail_at == "prepare" and rank == 0:  # a file where the partial folder goes: rank 0 cannot make it
        final.with_name(final.name + checkpoint.PARTIAL_SUFFIX).write_text("in the way")

    def write(partial: Path) -> None:
        (partial / f"part-{rank}").write_text("written")

    def finish(partial: Path) -> None:
        time.sleep(finish_s)
        if fail_at == "finish":
            raise OSError("the config could not be written")

    try:
        checkpoint._write_atomically(final, write, finish, "save the test folder", torch.device("cpu"))
        outcomes.put((rank, "ok"))
    except Exception as exc:  # noqa: BLE001 -- the test reads which error each rank saw
        outcomes.put((rank, f"{type(exc).__name__}: {exc}"))
    time.sleep(600)
