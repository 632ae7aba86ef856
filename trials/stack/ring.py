"""Ring attention: K/V passed around a ring of ranks, each holding 1/ring of the sequence (zigzag split).

Ring rank r of R holds chunks r and 2R-1-r of the sequence's 2R equal chunks (``trials.training.data``), in that
order: [A | B], each of L tokens, positions increasing. Its queries stay; K/V travel. At ring step s it holds the
K/V of ring rank j = (r - s) mod R, chunks [j | 2R-1-j], and under the causal mask only these blocks are visible:

    s = 0 (j = r)   all 2L queries x all 2L keys, causal (the rank's own columns are in increasing order)
    j < r           queries A x keys of chunk j, then queries B x keys of chunk j, no mask: chunk j precedes
                    both of r's chunks (and chunk 2R-1-j follows both)
    j > r           queries B x keys of chunk j, then queries B x keys of chunk 2R-1-j, no mask: both of j's
                    chunks precede B and follow A

so every step after the first does two L x L blocks: the zigzag's load balance, and on every rank the same
shapes (the memory oracle traces one rank for all).

Packed documents (``trials.kernels.documents.Documents``, global over the sequence) split per document, as
TransformerEngine's context parallelism splits each sequence of ``cu_seqlens``: ring rank r holds chunks r and
2R-1-r of every document (each document's length divisible by 2R), document after document, so its local columns
are one [A_d | B_d] pair of c_d = L_d / 2R tokens per document d (``local_documents``: the local layout, the same on
every ring rank). Attention never crosses a document, and K/V of document d only meet queries of document d: the
rules above hold per document, with d's chunks for the sequence's -- at step 0 one causal block of 2c_d x 2c_d per
document, at every later step two c_d x c_d blocks per document. Every rank thus still runs the same block shapes in
the same order (only which rows differs), so every rank allocates the same shapes, and the oracle's trace of rank 0
stands for all; each document's causal work is balanced over the ring, as the sequence's is without documents.

Each block returns its output and
logsumexp (the kernel's own: ``trials.kernels.attention.attention_forward``, ``causal=False`` for the unmasked
blocks); blocks merge by their logsumexps (online softmax, in fp32):

    lse = logaddexp(lse_a, lse_b);  out = out_a * exp(lse_a - lse) + out_b * exp(lse_b - lse)

Backward walks the ring again: with the merged output and logsumexp each block's (dq, dk, dv) is the kernel's own
backward of that block (``attention_backward``), dq adds up locally, and dK/dV accumulators (fp32) travel with their
K/V: after each step a rank sends the accumulator of the block it holds to the next rank, which holds that block
next; the R-th send brings every block's accumulator home.

Communication: point-to-point (``torch.distributed.batch_isend_irecv``) to the next ring rank and from the
previous one, the next step's K/V received while this step's blocks compute. In backward the dK/dV accumulators
travel one after the other: dK's exchange is waited at once (``WAITED_SCOPE``: the time model prices it exposed),
then dV's travels while the next step's blocks compute. In flight per rank: one more K/V of the local chunk in
forward; in backward one more K/V and, besides dq, three fp32 accumulators at most (dK sent, dK received and dV;
then dK received, dV sent and dV received), one fewer than sending the pair together. A step's block gradients are
added into the received accumulators in place (dK's at once, as it is here already); at step 0 the accumulators are
fp32 copies of the blocks' gradients (the step's blocks cover each local row once: one block, or one per document),
each made as the gradient is freed, and the next step's K/V are waited for before the accumulators travel, so a
caller that hands its K/V over (``ring_backward``'s ``kv``) has them freed then. K/V travel as the kv heads
(GQA: never repeated to the query heads; the kernel call repeats them per block). With Ulysses, the ring runs
inside the Ulysses exchange (USP): after the all-to-all a rank holds its ring rank's 2L columns for its heads and
rings with the ranks of the same Ulysses rank in the other Ulysses groups (``trials.core.dist``).

Sliding windows are not supported (``trials.stack.rules`` refuses them with a ring); softcaps go to the kernel.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trials.core.repeats import for_each_kind, kind_of
from trials.kernels.attention import (
    FLASH_KERNELS,
    attention_backward,
    attention_forward,
    flash_inputs,
    head_layout,
    residuals_from_lse,
)
from trials.kernels.documents import Documents, documents_of
from trials.stack.rules import ring_documents_problem
from trials.stack.ulysses import apply_ulysses, attention_modules

WAITED_SCOPE = "ring::waited"  # the ``record_function`` region of sends waited at once (the time model: exposed)
Block = tuple[int, int, int, int, bool]  # (first query row, query rows, first key row, key rows, causal)


def local_documents(documents: Documents | None, degree: int) -> Documents | None:
    """The layout of every ring rank's columns of packed ``documents`` (global, each length divisible by 2 x
    ``degree``): L_d / degree tokens of each document d, its two zigzag chunks back to back. None: one document."""
    if documents is None or len(documents.lengths) == 1:
        return None
    problem = ring_documents_problem(degree, documents.lengths)
    if problem:
        raise ValueError(problem)
    return Documents(tuple(n // degree for n in documents.lengths))


class Ring:
    """One rank's place in its ring: the group, its rank in it, and the global ranks of its neighbours."""

    def __init__(self, group):
        self.group = group
        self.degree = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.degree)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.degree)

    def source(self, step: int) -> int:
        """The ring rank whose K/V this rank holds at ``step``."""
        return (self.rank - step) % self.degree

    def blocks(self, step: int, length: int, documents: Documents | None = None) -> list[Block]:
        """The blocks visible at ``step`` over ``length`` local columns (see the module docstring), each document's
        in turn when the columns hold packed ``documents`` (their local layout: ``local_documents``)."""
        return [block for blocks in self.document_blocks(step, length, documents) for block in blocks]

    def document_blocks(self, step: int, length: int, documents: Documents | None = None) -> list[list[Block]]:
        """``blocks``, one list per document (one list without ``documents``)."""
        source = self.source(step)
        spans = [(0, length)] if documents is None else documents.spans()
        per_document = []
        for start, end in spans:
            chunk = (end - start) // 2
            first, second = start, start + chunk
            if source == self.rank:
                per_document.append([(start, end - start, start, end - start, True)])
            elif source < self.rank:
                per_document.append([(first, chunk, first, chunk, False), (second, chunk, first, chunk, False)])
            else:
                per_document.append([(second, chunk, first, chunk, False), (second, chunk, second, chunk, False)])
        return per_document

    def exchange(self, *tensors) -> tuple[list, list]:
        """Send ``tensors`` to the next rank and receive as many of their shapes from the previous one; returns
        (the received buffers, the pending works): ``wait`` them before reading the buffers."""
        received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, group=self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, buf, self.prev, group=self.group) for buf in received]
        return received, dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for work in works:
        work.wait()


def _weights(lse, layout: str):
    """[b, h, s] -> broadcastable to an output in ``layout``."""
    return lse.unsqueeze(-1) if layout == "bhsd" else lse.transpose(1, 2).unsqueeze(-1)


def _local(documents: Documents | None, ring: Ring, length: int) -> Documents | None:
    """The local layout of the global ``documents`` on a rank holding ``length`` columns (None: one document)."""
    if documents is not None and documents.total != length * ring.degree:
        raise ValueError(f"documents cover {documents.total} tokens, the ring holds {length * ring.degree}")
    return local_documents(documents, ring.degree)


def ring_forward(query, key, value, scaling: float, kernel: str, ring: Ring, softcap=None, documents=None):
    """Ring attention in ``head_layout(kernel)``, no autograd, inside each of the packed ``documents`` (global over
    the sequence) when given; returns (out, (lse,)) with lse [b, h, s] fp32."""
    layout = head_layout(kernel)
    dim = 2 if layout == "bhsd" else 1
    length = query.shape[dim]
    local = _local(documents, ring, length)
    out = lse = None
    if local is not None:  # documents: each one's step-0 block fills its rows (made first: each document's is the same)
        heads = query.shape[1] if layout == "bhsd" else query.shape[2]
        out = query.new_empty(query.shape, dtype=torch.float32)
        lse = query.new_empty((query.shape[0], heads, length), dtype=torch.float32)
    k, v = key, value

    def document(blocks: list[Block], step: int) -> None:
        nonlocal out, lse
        for q_start, q_rows, kv_start, kv_rows, causal in blocks:
            block_out, residuals = attention_forward(
                query.narrow(dim, q_start, q_rows),
                k.narrow(dim, kv_start, kv_rows),
                v.narrow(dim, kv_start, kv_rows),
                scaling,
                kernel,
                softcap=softcap,
                causal=causal,
            )
            block_lse = residuals[0][..., :q_rows].float()
            if step == 0:  # step 0's blocks cover every query once
                if q_rows == length:  # one document: its block is the whole output
                    out, lse = block_out.float(), block_lse.clone()
                    continue
                out.narrow(dim, q_start, q_rows).copy_(block_out)
                lse.narrow(2, q_start, q_rows).copy_(block_lse)
                del block_out, residuals, block_lse
                continue
            old_out, old_lse = out.narrow(dim, q_start, q_rows), lse.narrow(2, q_start, q_rows)
            new_lse = torch.logaddexp(old_lse, block_lse)
            old_out.mul_(_weights(old_lse - new_lse, layout).exp()).add_(
                block_out.float() * _weights(block_lse - new_lse, layout).exp()
            )
            old_lse.copy_(new_lse)
            del block_out, residuals, block_lse, new_lse

    for step in range(ring.degree):
        pending = ring.exchange(k, v) if step < ring.degree - 1 else None
        per_document = ring.document_blocks(step, length, local)
        common = kind_of("ring forward", query, k, v, out, lse, scaling, kernel, softcap, step == 0)
        for_each_kind(
            len(per_document),
            lambda index: document(per_document[index], step),
            lambda index: (common, _block_sizes(per_document[index])),
        )
        if pending is not None:
            (k, v), works = pending
            _wait(works)
    return out.to(query.dtype), (lse,)


def ring_backward(
    grad_out, query, kv: list, out, residuals, scaling: float, kernel: str, ring: Ring, softcap=None, documents=None
):
    """Gradients (dq, dk, dv) of ``ring_forward``, in the layout and dtypes of (query, key, value).

    ``kv`` is the list [key, value], handed over: it is emptied, so when the caller keeps no other reference this
    rank's own K/V are freed as soon as the next step's have arrived."""
    layout = head_layout(kernel)
    dim = 2 if layout == "bhsd" else 1
    length = query.shape[dim]
    local = _local(documents, ring, length)
    (lse,) = residuals
    k, v = kv
    kv.clear()
    key_dtype, value_dtype = k.dtype, v.dtype
    dq = torch.zeros_like(query, dtype=torch.float32)
    accumulators = None  # (dk, dv) of the block this rank holds: dk here (waited), dv in flight from the previous rank
    accumulator_works = None
    for step in range(ring.degree):
        pending = ring.exchange(k, v) if step < ring.degree - 1 else None
        dk = None if accumulators is None else accumulators[0]

        def document(blocks: list[Block]) -> tuple:
            """The document's blocks' gradients: dq added, dk added where its accumulator is here; returns the
            gradients kept for later (each block's dv, and its dk without an accumulator), in block order."""
            kept = []
            for q_start, q_rows, kv_start, kv_rows, causal in blocks:
                grads = attention_backward(
                    grad_out.narrow(dim, q_start, q_rows).contiguous(),
                    query.narrow(dim, q_start, q_rows),
                    k.narrow(dim, kv_start, kv_rows),
                    v.narrow(dim, kv_start, kv_rows),
                    out.narrow(dim, q_start, q_rows),
                    residuals_from_lse(kernel, lse.narrow(2, q_start, q_rows).contiguous(), query),
                    scaling,
                    kernel,
                    softcap=softcap,
                    causal=causal,
                )
                dq.narrow(dim, q_start, q_rows).add_(grads[0])
                if dk is not None:  # the dK accumulator is here already: add at once, keep only the block's dv
                    dk.narrow(dim, kv_start, kv_rows).add_(grads[1])
                    kept.append(grads[2])
                else:
                    kept += [grads[1], grads[2]]
                del grads
            return tuple(kept)

        per_document = ring.document_blocks(step, length, local)
        common = kind_of("ring backward", grad_out, query, k, v, out, lse, dq, dk, scaling, kernel, softcap)
        kept = for_each_kind(
            len(per_document),
            lambda index: document(per_document[index]),
            lambda index: (common, _block_sizes(per_document[index])),
            keep_all=True,
        )
        block_grads = []  # [first key row, key rows, dk or None, dv] of each block, added once its accumulators are here
        for blocks, grads in zip(per_document, kept):
            grads = list(grads)
            for _, _, kv_start, kv_rows, _ in blocks:
                block_dk = None if dk is not None else grads.pop(0)
                block_grads.append([kv_start, kv_rows, block_dk, grads.pop(0)])
        del kept, grads, block_dk
        if accumulators is None:  # step 0: this rank is the first to visit its own columns
            # = zeros + the blocks' gradients (they cover each row once), with one bf16 buffer fewer alive meanwhile
            dk = _copied(k, dim, block_grads, 2)
            dv = _copied(v, dim, block_grads, 3)
        else:  # the accumulators of this block from the ranks it visited before: add to them in place
            _wait(accumulator_works)
            dv = accumulators[1]
            for kv_start, kv_rows, block_dk, block_dv in block_grads:
                if block_dk is not None:
                    dk.narrow(dim, kv_start, kv_rows).add_(block_dk)
                dv.narrow(dim, kv_start, kv_rows).add_(block_dv)
            del block_dk, block_dv
        del block_grads, accumulators
        if pending is not None:  # the next step's K/V, before the accumulators travel: this step's are freed here
            (k, v), works = pending  # (unless the caller holds them)
            _wait(works)
        # dK, then dV: dK's exchange is waited before dV's starts, so three accumulators are alive at most (dK sent,
        # dK received, dV; then dK received, dV sent, dV received); dV travels while the next step computes
        with torch.profiler.record_function(WAITED_SCOPE):
            (dk_received,), works = ring.exchange(dk)
            del dk
            _wait(works)
        (dv_received,), accumulator_works = ring.exchange(dv)
        del dv
        accumulators = dk_received, dv_received
        del dk_received, dv_received
    _wait(accumulator_works)
    dk, dv = accumulators
    return dq.to(query.dtype), dk.to(key_dtype), dv.to(value_dtype)


def _block_sizes(blocks: list[Block]) -> tuple:
    """What a document's blocks' calls depend on (``for_each_kind``'s kind): each block's rows and causality."""
    return tuple((q_rows, kv_rows, causal) for _, q_rows, _, kv_rows, causal in blocks)


def _copied(like, dim: int, block_grads: list, index: int):
    """An fp32 tensor shaped as ``like`` holding each block's gradient ``block_grads[i][index]`` in its rows (the
    blocks cover every row once); each gradient is dropped from its block once copied, so it is freed then."""
    copy = torch.empty_like(like, dtype=torch.float32)
    for block in block_grads:
        copy.narrow(dim, block[0], block[1]).copy_(block[index])
        block[index] = None
    return copy


class _RingAttention(torch.autograd.Function):
    """A whole layer's ring attention in the kernel's layout: saves q, k, v, out and the merged logsumexp."""

    @staticmethod
    def forward(ctx, query, key, value, scaling, kernel, ring, softcap, documents):
        out, (lse,) = ring_forward(query, key, value, scaling, kernel, ring, softcap, documents)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.scaling, ctx.kernel, ctx.ring, ctx.softcap, ctx.documents = scaling, kernel, ring, softcap, documents
        return out

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(
            grad_out, query, [key, value], out, (lse,), ctx.scaling, ctx.kernel, ctx.ring, ctx.softcap, ctx.documents
        )
        return dq, dk, dv, None, None, None, None, None


def ring_attention(query, key, value, scaling, kernel: str, ring: Ring, softcap=None, documents=None):
    """[b, hq, s, d] x [b, hkv, s, d] (Hugging Face's layout, this rank's zigzag columns) -> [b, s, hq, d], inside
    each of the packed ``documents`` (global over the sequence) when given."""
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    if kernel in FLASH_KERNELS:
        query, key, value = flash_inputs(query, key, value, kernel=kernel)
    else:
        device_type = query.device.type
        if torch.is_autocast_enabled(device_type):  # what autocast does for F.scaled_dot_product_attention
            dtype = torch.get_autocast_dtype(device_type)
            query, key, value = (t.to(dtype) for t in (query, key, value))
    if head_layout(kernel) == "bshd":
        query, key, value = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        return _RingAttention.apply(query, key, value, scaling, kernel, ring, softcap, documents)
    return _RingAttention.apply(query, key, value, scaling, kernel, ring, softcap, documents).transpose(1, 2)


def _ring_core(kernel: str, ring: Ring):
    def core(module, query, key, value, attention_mask, scaling=None, **kwargs):
        if kwargs.get("sliding_window"):
            raise ValueError("ring attention has no sliding window")
        documents = documents_of(kwargs, key.shape[2] * ring.degree)  # global: the ring holds 1/degree of them
        out = ring_attention(query, key, value, scaling, kernel, ring, kwargs.get("softcap"), documents)
        return out, None

    return core


def apply_ring(model, mesh, kernel: str = "sdpa") -> None:
    """Ring attention over ``mesh.ring_group`` for every attention module: the core op under Ulysses when the
    Ulysses degree is above 1 (``trials.stack.ulysses``), else the module's attention itself."""
    ring = Ring(mesh.ring_group)
    core = _ring_core(kernel, ring)
    if mesh.sp_degree > 1:
        apply_ulysses(model, mesh, kernel=kernel, core=core)
        return
    for attn_module in attention_modules(model):
        attn_module.autotune_attention = core
