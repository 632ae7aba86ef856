"""What `autotune run`'s trainer does with a pretrained model, measured on CPU with a tiny Llama that transformers
saves here (bf16 files): how much a rank holds while loading, that training from the folder starts at
transformers' own loss, that a run killed after a checkpoint resumes to the uninterrupted run's losses, and that
fine-tuning on a repeated document lowers its loss.

    .venv/bin/python bench/train_resume.py | tee bench/results/train_resume.txt
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.train_harness import (  # noqa: E402 -- after the repository is on the path
    DOCUMENT_TOKENS,
    RECIPE,
    SEQ_LEN,
    STEPS,
    first_window,
    hf_loss,
    stored_largest,
    summary_of,
    train,
    train_until_killed,
    write_config,
    write_document,
    write_pretrained,
)

RESUMED_AT = 20  # the checkpoint the killed runs resume from


def losses(path: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in path.read_text().splitlines()]


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="train-resume-"))
    write_pretrained(work / "pre")
    write_document(work / "doc.parquet")
    one, two = write_config(work / "one.json"), write_config(work / "two.json", gpus=2, ulysses_degree=2)
    window = first_window(work / "doc.parquet")
    common = ["--init", "pre", "--data", "doc.parquet", *RECIPE]

    print(f"model: tiny-llama (4 layers, hidden 128), saved by transformers in bf16; sequences of {SEQ_LEN} tokens")
    loading = summary_of(train(2, "--config", two, "--init", "pre", "--steps", "1", cwd=work))["init_load"]
    largest, dtype = stored_largest(work / "pre" / "model.safetensors")
    over = loading["peak_bytes"] - loading["shard_bytes"] - largest
    print(
        f"loading on 2 FSDP ranks: rank 0 held at most {loading['peak_bytes']:,} bytes = its shards and buffers "
        f"{loading['shard_bytes']:,} + the largest tensor as stored ({dtype}) {largest:,} + {over:,}"
    )

    reference = summary_of(
        train(1, "--config", one, *common, "--export-hf", "out", "--log-file", "ref.jsonl", cwd=work)
    )
    start = hf_loss(work / "pre", window)
    print(
        f"step 1 loss from the folder {reference['first_loss']:.7f}, transformers' own {start:.7f}: "
        f"relative difference {abs(reference['first_loss'] - start) / start:.1e}"
    )

    saves = ["--save-every", "10", "--keep", "2"]
    checkpoint = f"step-{RESUMED_AT:08d}"
    for name, ranks, config in (("k1", 1, one), ("k2", 2, two)):
        run = ["--config", config, *common, "--save", f"ck-{name}", *saves, "--log-file", f"{name}.jsonl"]
        train_until_killed(ranks, *run, cwd=work, after=checkpoint)
        summary_of(train(1, "--config", one, *run[2:], "--resume", cwd=work))  # resumed on 1 rank
    ref = losses(work / "ref.jsonl")
    for name, label in (("k1", "1 rank, resumed on 1"), ("k2", "2 ranks (FSDP + Ulysses 2), resumed on 1")):
        resumed = losses(work / f"{name}.jsonl")
        worst = max(abs(a - b) / b for a, b in zip(resumed[RESUMED_AT:], ref[RESUMED_AT:]))
        print(
            f"killed (SIGKILL) after the step-{RESUMED_AT} checkpoint, {label}: steps {RESUMED_AT + 1}-{STEPS}, "
            f"largest relative loss difference to the uninterrupted run {worst:.1e} over "
            f"{len(resumed) - RESUMED_AT} steps"
        )

    after = hf_loss(work / "out", window)
    print(
        f"fine-tuning {STEPS} steps on a repeated {DOCUMENT_TOKENS}-token document: its loss {start:.3f} -> "
        f"{after:.3f} (the exported folder, read by transformers)"
    )


if __name__ == "__main__":
    main()
