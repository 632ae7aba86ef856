"""Packed documents are exact through the stack (issue 50): a sequence packing several documents trains as the plain
model run on each document alone.

Every case packs uneven documents (one of a single token, boundaries off the Ulysses shards' edges) and must
reproduce the plain single-process model run on each document separately (``tests/stack_harness.py``'s documents
reference): loss within rel 1e-5 and every parameter gradient within rel 1e-4, as the stack tests. Whole layers,
Ulysses, head chunks, checkpointing and offload, the tiles, FSDP; windowed families (a document longer than the
window, others shorter); 1, 2 and 4 ranks, only 2 in the fast suite; the 4-rank cases (``_cases(4)``) run in the
stack's 4-rank launch (``tests/test_stack.py``), the windowed families' 2-rank ones (``windowed_cases``) in the
families' (``tests/test_families.py``).
"""

from __future__ import annotations

import pytest
import torch

from tests.model_families import TINY_WINDOW, save, tiny_configs
from tests.test_stack import FULL, HARNESS, _check_exact, _launch
from trials.kernels.attention import attention_backward, attention_forward, causal_attention, flash_kernels
from trials.kernels.documents import Documents

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

SEQ = 512
LENGTHS = [100, 1, 236, 175]  # 4 ranks hold 128 tokens each: every boundary falls inside a shard


def _cases(degree: int) -> list[dict]:
    """tiny-llama (GQA) through every technique; tiny-qwen3 (q/k norms) head-chunked and under the full stack."""
    u = {"ulysses_degree": degree}
    ckpt = {"activation_checkpointing": True}
    techniques = {
        "ulysses" if degree > 1 else "plain": {},
        "head_chunk=1": {"head_chunk": 1},
        "head_chunk=2+checkpointing": {"head_chunk": 2, **ckpt},
        "offload=2+tiles": {**ckpt, "activation_offload_layers": 2, "mlp_tile_tokens": 96, "loss_tile_tokens": 80},
        "fsdp+norm": {"fsdp": True, "norm_tile_tokens": 112},
        "full": FULL,
    }
    rows = []
    for model in ("tiny-llama", "tiny-qwen3"):
        for name, knobs in techniques.items():
            if model == "tiny-qwen3" and name not in ("head_chunk=1", "full"):
                continue
            rows.append(
                {
                    "name": f"{model}/documents/{name}",
                    "model": model,
                    "techniques": {**u, **knobs},
                    "step": name == "full",
                    "documents": LENGTHS,
                }
            )
    if degree == 2:  # two replicas, each packing the same document lengths over its own sample
        rows.append(
            {
                "name": "tiny-llama/documents/dp2+full",
                "model": "tiny-llama",
                "techniques": FULL,
                "step": True,
                "documents": LENGTHS,
            }
        )
    return rows


@pytest.mark.slow  # over 2 minutes on a loaded 2-core machine; 2 ranks run the same techniques in the fast suite
def test_documents_exact_one_rank(tmp_path):
    cases = _cases(1)
    _check_exact(_launch(HARNESS, 1, {"seq_len": SEQ, "cases": cases}, tmp_path, timeout=600), len(cases))


def test_documents_exact_two_ranks(tmp_path):
    cases = _cases(2)
    _check_exact(_launch(HARNESS, 2, {"seq_len": SEQ, "cases": cases}, tmp_path, timeout=600), len(cases))


FAMILY_SEQ = 256
FAMILY_LENGTHS = [40, 150, 66]  # one document longer than the window (TINY_WINDOW), two shorter
WINDOWED = ("tiny-mistral", "tiny-gemma3", "tiny-gemma2")


def windowed_cases(world: int, paths: dict[str, str]) -> list[dict]:
    """The windowed families' packed documents on ``world`` ranks (``paths``: each family's saved ``config.json``)."""
    assert max(FAMILY_LENGTHS) > TINY_WINDOW > min(FAMILY_LENGTHS)
    u = {"ulysses_degree": world}
    cases = []
    for name in WINDOWED:
        for label, knobs in {
            "layer": {},
            "head_chunk=1+checkpointing": {"head_chunk": 1, "activation_checkpointing": True},
        }.items():
            cases.append(
                {
                    "name": f"{name}/documents/{label}",
                    "model": paths[name],
                    "techniques": {**u, **knobs},
                    "step": False,
                    "documents": FAMILY_LENGTHS,
                }
            )
    return cases


@pytest.mark.slow
def test_documents_exact_in_windowed_families(tmp_path):
    """One rank; on 2 (the fast suite) they run in the families' 2-rank launch (``tests/test_families.py``)."""
    paths = {name: str(save(config, tmp_path / name)) for name, config in tiny_configs().items() if name in WINDOWED}
    cases = windowed_cases(1, paths)
    report = _launch(HARNESS, 1, {"seq_len": FAMILY_SEQ, "cases": cases}, tmp_path, timeout=900)
    _check_exact(report, len(cases))


# -- the kernel calls (no processes) -------------------------------------------------------------------------------


def _qkv(seq=64, heads=(4, 2), dim=8, layout="bhsd"):
    generator = torch.Generator().manual_seed(0)
    shapes = [(1, h, seq, dim) if layout == "bhsd" else (1, seq, h, dim) for h in (heads[0], heads[1], heads[1])]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def test_document_attention_equals_each_document_alone():
    documents = Documents((10, 1, 30, 23))
    q, k, v = _qkv()
    out = causal_attention(q, k, v, kernel="sdpa", documents=documents)
    for start, end in documents.spans():
        alone = causal_attention(q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], kernel="sdpa")
        torch.testing.assert_close(out[:, start:end], alone)


def test_head_chunk_calls_equal_the_whole_layer_over_documents():
    documents = Documents((17, 40, 7))
    q, k, v = (t.requires_grad_() for t in _qkv())
    dout = torch.randn(1, 64, 4, 8)
    out = causal_attention(q, k, v, 0.3, "sdpa", window=12, documents=documents)
    out.backward(dout)
    with torch.no_grad():
        chunk_out, residuals = attention_forward(q, k, v, 0.3, "sdpa", 12, None, documents)
        grads = attention_backward(
            dout.transpose(1, 2), q, k, v, chunk_out, residuals, 0.3, "sdpa", 12, None, documents
        )
    torch.testing.assert_close(chunk_out.transpose(1, 2), out)
    for got, tensor in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, tensor.grad)


def test_a_varlen_kernel_gets_the_documents_boundaries():
    """A flash kernel that declares a varlen entry point runs a layer of packed documents in one call, with
    ``cu_seqlens`` and the longest document; the stand-in computes each document with SDPA."""
    documents = Documents((5, 20, 7))
    calls = []

    def varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal, window_size, softcap
    ):
        calls.append((cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), max_seqlen_q, max_seqlen_k, causal, window_size))
        bounds = cu_seqlens_q.tolist()
        parts = []
        for start, end in zip(bounds, bounds[1:]):
            part = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
            parts.append(causal_attention(*part, softmax_scale, "sdpa")[0])
        return torch.cat(parts)

    q, k, v = _qkv(seq=32)
    with flash_kernels(layer=lambda *a, **kw: None, varlen=varlen, kernel="flash"):
        out = causal_attention(*(t.bfloat16() for t in (q, k, v)), kernel="flash", documents=documents)
    assert calls == [([0, 5, 25, 32], [0, 5, 25, 32], 20, 20, True, (-1, -1))]
    expected = causal_attention(*(t.bfloat16() for t in (q, k, v)), kernel="sdpa", documents=documents)
    torch.testing.assert_close(out, expected)


def test_documents_spans_and_positions():
    documents = Documents.packed(10, [4, 3])
    assert documents.lengths == (4, 3, 3)
    assert documents.offsets == (0, 4, 7, 10)
    assert documents.positions().tolist() == [0, 1, 2, 3, 0, 1, 2, 0, 1, 2]
    assert Documents.fixed(10, 4).lengths == (4, 4, 2)
    with pytest.raises(ValueError):
        Documents((3, 0))


def test_a_packed_batch_restarts_positions_and_labels_no_boundary():
    """RoPE is relative, so positions that run on across documents give the same attention inside each document:
    the exactness tests cannot see them. Here the batch itself: each shard's positions count from each document's
    start, and the label of each document's last token (the next document's first) is ignored."""
    from trials.training.data import make_batch

    documents = Documents((5, 1, 7, 3))
    tokens = torch.arange(100, 117)
    positions, labels, starts = [], [], []
    for start, end in documents.spans():
        positions += list(range(end - start))
        labels += tokens[start + 1 : end].tolist() + [-100]
        starts.append(start)
    for rank in range(2):
        batch = make_batch(tokens, rank, 2, "cpu", documents=documents)
        cols = slice(rank * 8, (rank + 1) * 8)
        assert batch.position_ids[0].tolist() == positions[cols]
        assert batch.labels[0].tolist() == labels[cols]
        assert batch.valid_tokens == 16 - len(starts)
        assert batch.documents == documents


def test_documents_padded_for_a_ring_train_as_the_documents_themselves():
    """Each document padded to a multiple of 4 (``pad_documents``, as the trainer pads for a ring of 2): no pad is
    a label or has one, so one rank's step over the padded window has the unpadded window's loss and gradients
    (fp32; the pads are after every real token of their document, which causal attention never lets one see)."""
    import numpy as np

    from trials.core.dist import Mesh
    from trials.models.config import load_model_config
    from trials.stack.techniques import Techniques
    from trials.training.data import make_batch, pad_documents
    from trials.training.step import build_training, forward_backward

    lengths = (5, 9, 2, 16)  # padded: 8, 12, 4, 16
    stream = torch.randint(0, 4096, (32,), generator=torch.Generator().manual_seed(0))
    padded, ends, pads = pad_documents(stream, np.cumsum(lengths), 4)
    assert ends.tolist() == [8, 20, 24, 40] and int(pads.sum()) == 8
    assert padded[~pads].tolist() == stream.tolist() and not padded[pads].any()
    next_token = torch.tensor([7])  # the window's last token: only a label, of nothing when packed
    cases = {
        "documents": (torch.cat([stream, next_token]), Documents(lengths), None),
        "padded": (
            torch.cat([padded, next_token]),
            Documents((8, 12, 4, 16)),
            torch.cat([pads, torch.tensor([False])]),
        ),
    }
    mesh = Mesh.single(torch.device("cpu"))
    losses, grads = {}, {}
    for name, (tokens, documents, window_pads) in cases.items():
        model, _ = build_training(load_model_config("tiny-llama"), Techniques(), mesh, seed=0)
        batch = make_batch(tokens, 0, 1, "cpu", documents=documents, pads=window_pads)
        assert batch.valid_tokens == 32 - len(lengths)
        losses[name] = float(forward_backward(model, batch, mesh)) * batch.valid_tokens
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert losses["padded"] == pytest.approx(losses["documents"], rel=1e-6)
    for name, grad in grads["documents"].items():
        assert torch.allclose(grads["padded"][name], grad, rtol=1e-5, atol=1e-7), name


@pytest.mark.slow
def test_the_oracle_traces_packed_trials_to_the_byte():
    """The memory oracle's fake step packs the same documents as the real CPU trial: equal peaks, to the byte, for
    a whole layer and head chunks (bench/oracle_fidelity.py's packed configs, one rank)."""
    import sys

    from tests.conftest import ROOT

    sys.path.insert(0, str(ROOT / "bench"))
    from oracle_fidelity import Config, predict_config, run_real

    K = 1024
    configs = [
        Config("tiny-llama", 1, 4 * K, {}, documents=(1000,)),
        Config("tiny-llama", 1, 4 * K, {"head_chunk": 2, "activation_checkpointing": True}, documents=(512,)),
    ]
    for config, real in zip(configs, run_real(configs)):
        assert real["status"] == "ok", (config.name, real["error"])
        predicted = predict_config(config)
        assert predicted.peak_device_bytes == real["peak_device_bytes"], (config.name, predicted.breakdown)
        assert predicted.host_bytes == real["host_bytes"]
