"""What `autotune run`'s trainer does with a pretrained model, measured on CPU with a tiny Llama that transformers
saves here (bf16 files): how much a rank holds while loading, that training from the folder starts at
transformers' own loss, that a run killed after a checkpoint resumes to the uninterrupted run's losses, and that
fine-tuning on a repeated document lowers its loss.

    .venv/bin/python bench/train_resume.py | tee bench/results/train_resume.txt
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SEQ_LEN = 256
RECIPE = "--steps 50 --lr 1e-3 --warmup-steps 10 --schedule cosine --min-lr 1e-4 --beta2 0.98 --weight-decay 0.01"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def config(path: Path, gpus: int, **techniques) -> str:
    knobs = {"fsdp": True, "activation_checkpointing": True, "attention": "sdpa", **techniques}
    path.write_text(
        json.dumps(
            {
                "schema": "autotune/config-v1",
                "model": "tiny-llama",
                "hardware": "cpu",
                "gpus": gpus,
                "seq_len": SEQ_LEN,
                "techniques": knobs,
            }
        )
    )
    return str(path)


def command(ranks: int, *args: str) -> list[str]:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"] if ranks > 1 else []
    return [sys.executable, *launcher, "-m", "trials.train", *args]


def train(ranks: int, *args: str, cwd: Path) -> dict:
    done = subprocess.run(command(ranks, *args), capture_output=True, text=True, env=ENV, cwd=cwd, timeout=900)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.split("summary ", 1)[1].splitlines()[0])


def killed_after(step_folder: str, ranks: int, *args: str, cwd: Path) -> None:
    process = subprocess.Popen(
        command(ranks, *args),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=ENV,
        cwd=cwd,
        start_new_session=True,
    )
    for line in process.stdout:
        if step_folder in line:
            os.killpg(process.pid, signal.SIGKILL)
            break
    process.wait()


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def stored_largest(file: Path) -> tuple[int, str]:
    """(bytes, dtype) of the largest tensor in a safetensors file, as stored."""
    from safetensors import safe_open

    sizes = {"BF16": 2, "F16": 2, "F32": 4}
    with safe_open(file, framework="pt") as handle:
        slices = [handle.get_slice(key) for key in handle.keys()]
        return max((torch.Size(s.get_shape()).numel() * sizes[s.get_dtype()], s.get_dtype()) for s in slices)


def hf_loss(folder: Path, tokens: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return float(model(tokens[None], labels=tokens[None]).loss)


def main() -> None:
    from transformers import AutoModelForCausalLM

    from trials.model import hf_config
    from trials.model_config import load_model_config
    from trials.train import TokenSource

    work = Path(tempfile.mkdtemp(prefix="train-resume-"))
    hf = hf_config(load_model_config("tiny-llama"))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(hf, attn_implementation="eager").to(torch.bfloat16).save_pretrained(work / "pre")
    document = torch.randint(0, hf.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    pq.write_table(pa.table({"input_ids": [document.tolist()] * 20}), work / "doc.parquet")
    one, two = config(work / "one.json", 1), config(work / "two.json", 2, ulysses_degree=2)
    window = TokenSource(SEQ_LEN, hf.vocab_size, path=str(work / "doc.parquet")).window(0)
    common = ["--init", "pre", "--data", "doc.parquet", *RECIPE.split()]

    print("model: tiny-llama (4 layers, hidden 128), saved by transformers in bf16; sequences of 256 tokens")
    loading = train(2, "--config", "two.json", "--init", "pre", "--steps", "1", cwd=work)["init_load"]
    largest, dtype = stored_largest(work / "pre" / "model.safetensors")
    over = loading["peak_bytes"] - loading["shard_bytes"] - largest
    print(
        f"loading on 2 FSDP ranks: rank 0 held at most {loading['peak_bytes']:,} bytes = its shards and buffers "
        f"{loading['shard_bytes']:,} + the largest tensor as stored ({dtype}) {largest:,} + {over:,}"
    )

    reference = train(1, "--config", one, *common, "--export-hf", "out", "--log-file", "ref.jsonl", cwd=work)
    start = hf_loss(work / "pre", window)
    print(
        f"step 1 loss from the folder {reference['first_loss']:.7f}, transformers' own {start:.7f}: "
        f"relative difference {abs(reference['first_loss'] - start) / start:.1e}"
    )

    saves = ["--save-every", "10", "--keep", "2"]
    killed_after(
        "step-00000020", 1, "--config", one, *common, "--save", "ck1", *saves, "--log-file", "k1.jsonl", cwd=work
    )
    train(1, "--config", one, *common, "--save", "ck1", *saves, "--log-file", "k1.jsonl", "--resume", cwd=work)
    killed_after(
        "step-00000020", 2, "--config", two, *common, "--save", "ck2", *saves, "--log-file", "k2.jsonl", cwd=work
    )
    train(1, "--config", one, *common, "--save", "ck2", *saves, "--log-file", "k2.jsonl", "--resume", cwd=work)
    ref = losses(work / "ref.jsonl")
    for name, label in (("k1", "1 rank, resumed on 1"), ("k2", "2 ranks (FSDP + Ulysses 2), resumed on 1")):
        resumed = losses(work / f"{name}.jsonl")
        worst = max(abs(a - b) / b for a, b in zip(resumed[20:], ref[20:]))
        print(
            f"killed (SIGKILL) after the step-20 checkpoint, {label}: steps 21-50, largest relative loss "
            f"difference to the uninterrupted run {worst:.1e} over {len(resumed) - 20} steps"
        )

    after = hf_loss(work / "out", window)
    print(
        f"fine-tuning 50 steps on a repeated 300-token document: its loss {start:.3f} -> {after:.3f} "
        f"(the exported folder, read by transformers)"
    )


if __name__ == "__main__":
    main()
