"""Untied Ulysses (UPipe, arXiv 2602.21196): sequence-parallel attention processed a chunk of heads at a time.

Plain DeepSpeed-Ulysses (``trials.stack.ulysses``) projects q/k/v for *all* heads of this rank's sequence shard, swaps
the sequence shard for a head shard with one all-to-all per tensor, runs attention over the full sequence for
``H/P`` heads, and swaps back. Every intermediate is as large as the layer's full q/k/v: at 5M tokens that, not
the weights, is what decides whether a layer fits. Untied Ulysses unties the projection from the all-to-all:
the rank's ``L = H/P`` local heads are processed in ``L/c`` chunks of ``c = head_chunk`` heads each, and only
one chunk's q/k/v/attention output is ever alive.

Notation (per rank)::

    b batch (1 here), s_l = s/P local tokens, s full sequence, P ulysses degree (1 allowed), h hidden size,
    H query heads, K kv heads, g = H/K query heads per kv head, d head_dim, L = H/P local heads,
    c = head_chunk, n = L/c chunks.

Which heads form chunk i. Across the Ulysses group a chunk covers ``c*P`` *consecutive* global query heads,
``[i*c*P, (i+1)*c*P)``; after the all-to-all, rank r attends to ``c`` of them, ``i*c*P + r*c + [0, c)``. So the q
weight rows of a chunk are one contiguous slice of ``q_proj.weight`` (no weight copy), and the attention outputs
come back as one contiguous column block of the output. (This assigns heads to ranks differently from plain
Ulysses, where rank r owns heads ``[r*L, (r+1)*L)``; attention is independent per head, so the result is the
same.)

GQA and kv replication. Rank r's ``c`` query heads need the kv heads ``(i*c*P + r*c + j) // g``. Each rank gets
``kc`` kv "slots" per chunk:
    - ``g`` divides ``c``: ``kc = c/g`` distinct kv heads, query j uses slot ``j // g``;
    - ``c`` divides ``g``: ``kc = 1``; several ranks (and, when ``c*P < g``, consecutive chunks) share a kv
      head, which is then *replicated* into each rank's slot -- this is DeepSpeed's "kv heads < degree" case,
      and chunks with identical slots reuse the k/v already exchanged instead of recomputing them;
    - otherwise ``kc = c``, one slot per query head.
The chunk projects its contiguous range of distinct kv heads once and ``index_select``-s them into the
``P*kc`` slots (the gradient of that select sums the replicas back).

One chunk, forward (shapes on rank r)::

    hidden [b, s_l, h]
      q = rope(norm(hidden @ Wq[rows of the chunk's c*P heads]^T))    [b, s_l, c*P, d]
      k, v = slots(rope(norm(hidden @ Wk[kv rows]^T)), ...)           [b, s_l, kc*P, d]
      all-to-all, sequence -> heads (dim 0 of both buffers is the peer):
        send  [P, b, c, s_l, d]   block r' = my tokens of the c heads rank r' attends to
        recv  [P, b, c, s_l, d]   block r' = rank r''s tokens of *my* c heads
        q_h = recv as [b, c, s, d]   (peers' shards in rank order = the full sequence; dense, which the CPU
                                      kernel needs; flash-attn's layout [b, s, c, d] uses send [P, b, s_l, c, d])
      o_h, lse = causal attention(q_h, k_h, v_h)                      [b, c, s, d], [b, c, s]
      all-to-all, heads -> sequence:
        send  [P, b, s_l, c, d]   block r' = my heads' outputs for rank r''s tokens
        recv  [P, b, s_l, c, d]   block r' = rank r''s c heads for my tokens
      written straight into columns [i*c*P*d, (i+1)*c*P*d) of ONE output buffer [b, s_l, H*d]

then ``o_proj(out)`` as usual. The all-to-all is DeepSpeed's ``deepspeed::dim_zero_all_to_all`` custom op (the
one ``UlyssesSPAttentionHF`` uses: a registered fake, so it runs under FakeTensorMode too); with ``P = 1`` there
is no exchange and this is plain head chunking.

Autograd. Everything above runs inside one ``torch.autograd.Function`` under ``no_grad``: it saves only the
layer input, the output buffer (which ``o_proj`` saves anyway -- same storage) and each chunk's logsumexp
(``[b, c, s]`` fp32, 1/d of an output). Backward walks the chunks again, per chunk: recompute q (and, once per
kv group, k/v), exchange them and the chunk's output and output gradient, call the attention kernel's
*backward* directly with the saved logsumexp (no attention recompute, see
``trials.kernels.attention.attention_backward``), exchange dq/dk/dv back, then push them through rope (its explicit
adjoint, so the pre-rope tensor need not be kept), the optional norm (autograd on a recomputed norm) and the
projection (explicit matmuls accumulating into d_hidden and into the weight-gradient rows of the chunk). So the
attention's working set in forward *and* backward is one chunk's, ``~c/L`` of plain Ulysses'. The price is
recomputing the q/k/v projections and re-exchanging q/k/v/out in backward.

LoRA adapters (``trials.models.lora``). A q/k/v projection that carries peft's adapter adds
``(hidden @ A^T) @ B[rows]^T * scaling`` to its chunk's rows: ``hidden @ A^T`` (``[b, s_l, r]``) is computed once per
call, B is sliced by rows as the weight is. Backward accumulates ``d(hidden @ A^T)`` over the chunks and pushes it
through A once at the end. A frozen parameter (the base weights under LoRA) gets no gradient and no GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from trials.kernels.attention import attention_backward, attention_forward, head_layout
from trials.kernels.documents import documents_of
from trials.models.families import family_of
from trials.models.lora import adapter_of
from trials.stack.ring import Ring, ring_backward, ring_forward
from trials.stack.ulysses import attention_modules

# The attention modules of every family ``trials.models.families`` declares have this forward: q/k/v projections (separate,
# or one fused ``qkv_proj``), optional per-head q_norm/k_norm over head_dim, HF rotary (``x * cos + rotate_half(x) *
# sin``), causal attention (optionally windowed, optionally softcapped), o_proj.


@dataclass(frozen=True)
class Chunk:
    q_head: int  # first global query head of the chunk (it covers c*P consecutive heads)
    kv_lo: int  # distinct kv heads projected for the chunk: [kv_lo, kv_hi)
    kv_hi: int
    kv_slots: tuple[int, ...]  # global kv head of each of the P*kc slots, rank-major
    needs_select: bool  # False when the slots are exactly kv_lo..kv_hi-1 in order


@dataclass(frozen=True)
class ChunkPlan:
    q_heads: int
    kv_heads: int
    head_dim: int
    degree: int
    chunk: int  # c, local heads per chunk
    kv_slots_per_rank: int  # kc
    chunks: tuple[Chunk, ...]

    @classmethod
    def build(cls, q_heads: int, kv_heads: int, head_dim: int, degree: int, chunk: int) -> ChunkPlan:
        if q_heads % degree or (kv_heads % degree and degree % kv_heads):
            raise ValueError(f"ulysses_degree {degree} does not fit {q_heads} query / {kv_heads} kv heads")
        local = q_heads // degree
        if not 1 <= chunk <= local or local % chunk:
            raise ValueError(f"head_chunk {chunk} must divide the {local} heads per rank")
        group = q_heads // kv_heads
        if chunk % group == 0:
            kc = chunk // group
        elif group % chunk == 0:
            kc = 1
        else:
            kc = chunk
        chunks = []
        for index in range(local // chunk):
            q_head = index * chunk * degree
            slots = []
            for rank in range(degree):
                first = q_head + rank * chunk
                if kc == chunk:
                    slots += [(first + j) // group for j in range(chunk)]
                else:  # the rank's c queries map onto kc consecutive kv heads
                    slots += [first // group + j for j in range(kc)]
            kv_lo, kv_hi = min(slots), max(slots) + 1
            chunks.append(Chunk(q_head, kv_lo, kv_hi, tuple(slots), slots != list(range(kv_lo, kv_hi))))
        return cls(q_heads, kv_heads, head_dim, degree, chunk, kc, tuple(chunks))

    def kv_groups(self) -> list[list[Chunk]]:
        """Consecutive chunks with identical kv slots: they share one exchanged k/v."""
        groups: list[list[Chunk]] = []
        for chunk in self.chunks:
            if groups and groups[-1][0].kv_slots == chunk.kv_slots:
                groups[-1].append(chunk)
            else:
                groups.append([chunk])
        return groups


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x, cos, sin):
    """HF rotary on [b, s, n, d] with cos/sin [b, s, d] (same arithmetic as ``apply_rotary_pos_emb``)."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return (x * cos) + (_rotate_half(x) * sin)


def _rope_backward(grad, cos, sin):
    """Adjoint of ``_rope`` (it is linear in x): grad * cos + rotate_half^T(grad * sin), with
    rotate_half^T(z) = cat(z2, -z1). Same arithmetic as autograd through ``_rope``, without keeping its input."""
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    scaled = grad * sin
    half = grad.shape[-1] // 2
    return (grad * cos) + torch.cat((scaled[..., half:], -scaled[..., :half]), dim=-1)


class UPipeAttention:
    """The head-chunked attention of one attention module (what its ``forward`` is replaced by)."""

    def __init__(
        self,
        module,
        plan: ChunkPlan,
        group,
        kernel: str,
        batch_exchanges: bool = False,
        fused_qkv: bool = False,
        window: int | None = None,
        softcap: float | None = None,
        ring: Ring | None = None,
    ):
        self.module = module
        self.ring = ring  # each chunk's attention runs around this ring (``trials.stack.ring``), None: locally
        self.fused_qkv = fused_qkv
        self.window = window  # this layer's sliding window (None: full causal)
        self.softcap = softcap
        self.plan = plan
        self.group_name = None
        if plan.degree > 1:
            from deepspeed.sequence.layer import register_all_to_all_group

            self.group_name = register_all_to_all_group(group)
        self.kernel = kernel
        self.layout = head_layout(kernel)
        # True: each step's tensors (q/k/v, or q/out/d_out) share one all-to-all -- fewer collectives, but a few
        # more chunk-sized buffers alive at once. Off: memory first, as in UPipe (no difference measurable on CPU).
        self.batch_exchanges = batch_exchanges
        self.scaling = module.scaling
        self.q_norm = getattr(module, "q_norm", None)
        self.k_norm = getattr(module, "k_norm", None)
        self._slot_indices: dict = {}  # (chunk, device) -> index tensor, made once: a host list copied to a GPU
        # per use would block the host on every kv group of every layer

    # -- called as the attention module's forward -----------------------------------------------------
    def __call__(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        if past_key_values is not None:
            raise ValueError("head-chunked attention is for training; it has no kv cache")
        cos, sin = position_embeddings
        m = self.module
        params = (
            *self.projections(),
            None if self.q_norm is None else self.q_norm.weight,
            None if self.k_norm is None else self.k_norm.weight,
        )
        adapters, scalings = self.adapters()
        ring = 1 if self.ring is None else self.ring.degree  # a ring holds 1/ring of the sequence per rank
        documents = documents_of(kwargs, hidden_states.shape[1] * self.plan.degree * ring)
        out = _HeadChunkedAttention.apply(self, documents, scalings, hidden_states, cos, sin, *params, *adapters)
        return m.o_proj(out), None

    def projections(self):
        """(q weight, q bias, k weight, k bias, v weight, v bias): the module's own parameters, or the row blocks of
        a fused ``qkv_proj`` (views: their gradients flow back into the fused parameter)."""
        m = self.module
        if not self.fused_qkv:
            return m.q_proj.weight, m.q_proj.bias, m.k_proj.weight, m.k_proj.bias, m.v_proj.weight, m.v_proj.bias
        blocks = []
        for rows in self.fused_rows():
            blocks.append(m.qkv_proj.weight[rows])
            blocks.append(None if m.qkv_proj.bias is None else m.qkv_proj.bias[rows])
        return tuple(blocks)

    def fused_rows(self) -> tuple[slice, slice, slice]:
        """The q, k and v row blocks of a fused ``qkv_proj``'s output."""
        d, q_heads, kv_heads = self.plan.head_dim, self.plan.q_heads, self.plan.kv_heads
        return (
            slice(0, q_heads * d),
            slice(q_heads * d, (q_heads + kv_heads) * d),
            slice((q_heads + kv_heads) * d, None),
        )

    def adapters(self):
        """((q A, q B, k A, k B, v A, v B), (q, k, v scalings)): each projection's LoRA adapter
        (``trials.models.lora.adapter_of``), None where it has none; a fused ``qkv_proj``'s B in row blocks (views)
        beside its one A."""
        m = self.module
        if not self.fused_qkv:
            found = [adapter_of(proj) for proj in (m.q_proj, m.k_proj, m.v_proj)]
        else:
            adapter = adapter_of(m.qkv_proj)
            if adapter is None:
                found = [None] * 3
            else:
                a, b, scaling = adapter
                found = [(a, b[rows], scaling) for rows in self.fused_rows()]
        tensors, scalings = [], []
        for adapter in found:
            tensors += [None, None] if adapter is None else list(adapter[:2])
            scalings.append(None if adapter is None else adapter[2])
        return tuple(tensors), tuple(scalings)

    # -- pieces shared by forward and backward ----------------------------------------------------------
    def core_forward(self, q_heads, k_heads, v_heads, documents):
        """One chunk's attention in the kernel's layout: the kernel on this rank, or around the ring; returns (out,
        residuals)."""
        if self.ring is None:
            return attention_forward(
                q_heads, k_heads, v_heads, self.scaling, self.kernel, self.window, self.softcap, documents
            )
        return ring_forward(q_heads, k_heads, v_heads, self.scaling, self.kernel, self.ring, self.softcap, documents)

    def core_backward(self, do_heads, q_heads, kv: list, o_heads, residuals, documents):
        """(dq, dk, dv) of ``core_forward``. ``kv`` is [k, v], handed over: the ring empties it, so K/V the caller
        no longer holds are freed once the ring's next ones have arrived."""
        if self.ring is None:
            return attention_backward(
                do_heads,
                q_heads,
                *kv,
                o_heads,
                residuals,
                self.scaling,
                self.kernel,
                self.window,
                self.softcap,
                documents,
            )
        return ring_backward(
            do_heads, q_heads, kv, o_heads, residuals, self.scaling, self.kernel, self.ring, self.softcap, documents
        )

    def _norm(self, norm_module, weight, x):
        if norm_module is None:
            return x
        return torch.func.functional_call(norm_module, {"weight": weight}, (x,))

    def q_post(self, projected, cos, sin, q_norm_weight):
        """[b, s_l, c*P, d] projection -> normed, rotated queries (same shape)."""
        return _rope(self._norm(self.q_norm, q_norm_weight, projected), cos, sin)

    def k_post(self, projected, cos, sin, k_norm_weight):
        return _rope(self._norm(self.k_norm, k_norm_weight, projected), cos, sin)

    def project(self, hidden, weight, bias, first_head: int, heads: int, adapter=None):
        """hidden [b, s_l, h] -> [b, s_l, heads, d] for the contiguous heads [first_head, first_head + heads);
        ``adapter``: (hidden @ A^T, B, scaling) of a LoRA adapter (``low_rank``), its rows added as peft adds them."""
        d = self.plan.head_dim
        rows = slice(first_head * d, (first_head + heads) * d)
        out = F.linear(hidden, weight[rows], None if bias is None else bias[rows])
        if adapter is not None:
            low, b, scaling = adapter
            out = out + F.linear(low, b[rows]) * scaling
        return out.view(*hidden.shape[:-1], heads, d)

    @staticmethod
    def low_rank(hidden, adapters, scalings):
        """Per projection (q, k, v): (hidden @ A^T, B, scaling) of its adapter, or None."""
        pairs = zip(adapters[0::2], adapters[1::2], scalings)
        return [None if a is None else (F.linear(hidden, a), b, scaling) for a, b, scaling in pairs]

    def select_slots(self, chunk: Chunk, kv):
        """[b, s_l, kv_hi - kv_lo, d] -> [b, s_l, P*kc, d] (replicas where ranks share a kv head)."""
        if not chunk.needs_select:
            return kv
        return kv.index_select(2, self.slot_index(chunk, kv.device))

    def slot_index(self, chunk: Chunk, device) -> torch.Tensor:
        """The kv heads ``select_slots`` picks for ``chunk``, as an index tensor on ``device`` (cached)."""
        key = (chunk, device)
        if key not in self._slot_indices:
            self._slot_indices[key] = torch.tensor([slot - chunk.kv_lo for slot in chunk.kv_slots], device=device)
        return self._slot_indices[key]

    def to_heads(self, *locals_):
        """``seq_to_heads`` of several tensors: one exchange, or one each (``batch_exchanges``)."""
        if self.batch_exchanges or len(locals_) == 1:
            return self.seq_to_heads(*locals_)
        return [self.seq_to_heads(t)[0] for t in locals_]

    def to_seq(self, *fulls):
        """``heads_to_seq`` of several tensors: one exchange, or one each (``batch_exchanges``)."""
        if self.batch_exchanges or len(fulls) == 1:
            return self.heads_to_seq(*fulls)
        return [self.heads_to_seq(t)[0] for t in fulls]

    def seq_to_heads(self, *locals_):
        """All-to-all: each [b, s_l, P*n_i, d] (my tokens, the chunk's heads) -> all tokens of my n_i heads, dense,
        in the kernel's layout: [b, n_i, s, d] ("bhsd") or [b, s, n_i, d] ("bshd"). One exchange for all.

        The send buffer [P, b, sum n_i, s_l, d] (flash: [P, b, s_l, sum n_i, d]) is laid out so that the received
        blocks (dim 0 = the peer = which sequence shard) already sit in sequence order.
        """
        P = self.plan.degree
        if P == 1:
            return [t if self.layout == "bshd" else t.transpose(1, 2).contiguous() for t in locals_]
        b, s_l, _, d = locals_[0].shape
        widths = [t.shape[2] // P for t in locals_]
        head_dim_of_send = 3 if self.layout == "bshd" else 2
        shape = [P, b, s_l, d]
        shape.insert(head_dim_of_send, sum(widths))
        send = locals_[0].new_empty(shape)
        offset = 0
        for t, n in zip(locals_, widths):
            split = t.reshape(b, s_l, P, n, d)
            block = split.permute(2, 0, 1, 3, 4) if self.layout == "bshd" else split.permute(2, 0, 3, 1, 4)
            send.narrow(head_dim_of_send, offset, n).copy_(block)
            offset += n
        recv = torch.ops.deepspeed.dim_zero_all_to_all(send, self.group_name)
        del send
        outs, offset = [], 0
        for n in widths:
            part = recv.narrow(head_dim_of_send, offset, n)
            if self.layout == "bshd":
                outs.append(part.permute(1, 0, 2, 3, 4).reshape(b, P * s_l, n, d))
            else:
                outs.append(part.permute(1, 2, 0, 3, 4).reshape(b, n, P * s_l, d))
            offset += n
        return outs

    def heads_to_seq(self, *fulls):
        """All-to-all back, one exchange: each n_i heads over all tokens (kernel layout) -> a [b, s_l, P, n_i, d]
        view: my tokens of the chunk's P*n_i heads (head block = peer)."""
        P = self.plan.degree
        blocks = []
        for full in fulls:
            if self.layout == "bshd":
                b, s, n, d = full.shape
                blocks.append(full.reshape(b, P, s // P, n, d).transpose(0, 1))  # [P, b, s_l, n, d]
            else:
                b, n, s, d = full.shape
                blocks.append(full.reshape(b, n, P, s // P, d).permute(2, 0, 3, 1, 4))  # [P, b, s_l, n, d]
        if P > 1:
            widths = [block.shape[3] for block in blocks]
            send = torch.cat(blocks, dim=3) if len(blocks) > 1 else blocks[0].contiguous()
            recv = torch.ops.deepspeed.dim_zero_all_to_all(send, self.group_name)
            del send
            blocks, offset = [], 0
            for n in widths:
                blocks.append(recv.narrow(3, offset, n))
                offset += n
        return [block.permute(1, 2, 0, 3, 4) for block in blocks]  # [b, s_l, P, n, d]


class _HeadChunkedAttention(torch.autograd.Function):
    """hidden [b, s_l, h] -> attention output before o_proj [b, s_l, H*d]; see the module docstring."""

    @staticmethod
    def forward(ctx, layer: UPipeAttention, documents, scalings, hidden, cos, sin, *params):
        # Mixed precision: under autocast, compute in its dtype with explicit casts (autocast itself is off
        # inside, and would be off in backward anyway); parameters and the gradients returned stay fp32.
        device_type = hidden.device.type
        compute = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        ctx.compute_dtype = compute
        with torch.autocast(device_type, enabled=False):
            out, residuals = _HeadChunkedAttention._forward(
                layer,
                documents,
                hidden.to(compute),
                cos.to(compute),
                sin.to(compute),
                [None if p is None else p.to(compute) for p in params],
                scalings,
            )
        ctx.layer, ctx.documents, ctx.scalings = layer, documents, scalings
        ctx.residuals_per_chunk = len(residuals) // len(layer.plan.chunks)
        ctx.present = [p is not None for p in params]
        ctx.save_for_backward(hidden, cos, sin, out, *residuals, *(p for p in params if p is not None))
        return out

    @staticmethod
    def _forward(layer: UPipeAttention, documents, hidden, cos, sin, params, scalings):
        plan = layer.plan
        q_w, q_b, k_w, k_b, v_w, v_b, qn_w, kn_w = params[:8]
        q_lr, k_lr, v_lr = layer.low_rank(hidden, params[8:], scalings)
        b, s_l, _ = hidden.shape
        width = plan.chunk * plan.degree  # global query heads per chunk
        out = hidden.new_empty(b, s_l, plan.q_heads * plan.head_dim)
        out_heads = out.view(b, s_l, plan.q_heads, plan.head_dim)
        residuals: list[torch.Tensor] = []
        for group in plan.kv_groups():
            first = group[0]
            n_kv = first.kv_hi - first.kv_lo
            k = layer.select_slots(
                first, layer.k_post(layer.project(hidden, k_w, k_b, first.kv_lo, n_kv, k_lr), cos, sin, kn_w)
            )
            v = layer.select_slots(first, layer.project(hidden, v_w, v_b, first.kv_lo, n_kv, v_lr))  # [b, s_l, P*kc, d]
            for index, chunk in enumerate(group):
                q = layer.q_post(
                    layer.project(hidden, q_w, q_b, chunk.q_head, width, q_lr), cos, sin, qn_w
                )  # [b, s_l, c*P, d]
                if index == 0:  # the group's k/v travel with its first chunk's queries
                    q_heads, k_heads, v_heads = layer.to_heads(q, k, v)
                    del k, v
                else:
                    (q_heads,) = layer.to_heads(q)
                del q
                o_heads, chunk_residuals = layer.core_forward(q_heads, k_heads, v_heads, documents)
                del q_heads
                (o_local,) = layer.to_seq(o_heads)  # [b, s_l, P, c, d]
                del o_heads
                out_heads[:, :, chunk.q_head : chunk.q_head + width].view(
                    b, s_l, plan.degree, plan.chunk, plan.head_dim
                ).copy_(o_local)
                del o_local
                residuals += chunk_residuals
            del k_heads, v_heads
        return out, residuals

    @staticmethod
    def backward(ctx, grad_out):
        hidden, cos, sin, out, *rest = ctx.saved_tensors
        n_res = ctx.residuals_per_chunk * len(ctx.layer.plan.chunks)
        residuals, present = rest[:n_res], iter(rest[n_res:])
        params = [next(present) if here else None for here in ctx.present]
        compute = ctx.compute_dtype
        wanted = ctx.needs_input_grad[6:]  # a frozen parameter (LoRA's base weights): no gradient, no GEMM
        with torch.autocast(hidden.device.type, enabled=False):
            d_hidden, grads = _HeadChunkedAttention._backward(
                ctx.layer,
                ctx.documents,
                ctx.scalings,
                ctx.residuals_per_chunk,
                grad_out.to(compute),
                hidden.to(compute),
                cos.to(compute),
                sin.to(compute),
                out,
                residuals,
                [None if p is None else p.to(compute) for p in params],
                [None if p is None or not want else torch.zeros_like(p) for p, want in zip(params, wanted)],
                hidden.dtype,
            )
        return (None, None, None, d_hidden.to(hidden.dtype), None, None, *grads)

    @staticmethod
    def _backward(
        layer: UPipeAttention,
        documents,
        scalings,
        per_chunk: int,
        grad_out,
        hidden,
        cos,
        sin,
        out,
        residuals,
        params,
        grads,
        accumulate_dtype,
    ):
        """Everything in the compute dtype except ``grads`` (zeros like the parameters that want one, else None),
        accumulated in place."""
        plan = layer.plan
        q_w, q_b, k_w, k_b, v_w, v_b, qn_w, kn_w = params[:8]
        q_lr, k_lr, v_lr = layer.low_rank(hidden, params[8:], scalings)
        b, s_l, h = hidden.shape
        d, width = plan.head_dim, plan.chunk * plan.degree
        out_heads = out.view(b, s_l, plan.q_heads, d)
        grad_heads = grad_out.reshape(b, s_l, plan.q_heads, d)
        x2d = hidden.reshape(-1, h)
        # d_hidden sums every chunk's q and every group's k/v projections: accumulate in the dtype of the gradient
        # handed back (fp32 under autocast, where the residual stream is fp32; bf16 under FSDP's bf16 params,
        # where every gradient of the residual stream is bf16 and an fp32 copy would cost 2 bytes/token/h more)
        d_hidden = torch.zeros_like(hidden, dtype=accumulate_dtype)
        d_x2d = d_hidden.view(-1, h)
        dq_w, dq_b, dk_w, dk_b, dv_w, dv_b, dqn_w, dkn_w = grads[:8]
        # per adapted projection: d(hidden @ A^T) [b * s_l, r], summed over its chunks (fp32: a few columns)
        d_low = [None if lr is None else x2d.new_zeros(x2d.shape[0], lr[0].shape[-1], dtype=torch.float32)
                 for lr in (q_lr, k_lr, v_lr)]  # fmt: skip
        dq_lb, dk_lb, dv_lb = grads[9::2]

        def post_backward(norm_module, norm_weight, d_norm_weight, projected, d_post):
            """Through rope (explicit adjoint) and the optional per-head norm (autograd on a recomputed norm):
            d(rope(norm(projected))) [b, s_l, n, d] -> d projected."""
            d_normed = _rope_backward(d_post, cos, sin)
            if norm_module is None:
                return d_normed
            with torch.enable_grad():
                leaf = projected.detach().requires_grad_(True)
                weight = norm_weight.detach().requires_grad_(d_norm_weight is not None)
                normed = layer._norm(norm_module, weight, leaf)
            if d_norm_weight is None:  # a frozen norm (LoRA)
                return torch.autograd.grad(normed, [leaf], d_normed)[0]
            d_projected, d_weight = torch.autograd.grad(normed, [leaf, weight], d_normed)
            d_norm_weight += d_weight
            return d_projected

        def linear_backward(d_proj, weight, d_weight, d_bias, first_head, heads, adapter, d_b_lr, d_low_lr):
            """d_proj [b, s_l, heads, d] -> accumulate into d_hidden, the weight rows of those heads (where the weight
            wants a gradient), and an adapter's B rows and d(hidden @ A^T)."""
            rows = slice(first_head * d, (first_head + heads) * d)
            d2d = d_proj.reshape(-1, heads * d)
            _add_mm(d_x2d, d2d, weight[rows])
            if d_weight is not None:
                _add_mm(d_weight[rows], d2d.t(), x2d)
            if d_bias is not None:
                d_bias[rows] += d2d.sum(0)
            if adapter is not None:  # d B[rows] = scaling d^T (x A^T); d (x A^T) += scaling d B[rows]
                low, b_lr, scaling = adapter
                scaled = d2d * scaling
                if d_b_lr is not None:
                    _add_mm(d_b_lr[rows], scaled.t(), low.reshape(-1, low.shape[-1]))
                _add_mm(d_low_lr, scaled, b_lr[rows])

        def slots_backward(chunk, d_slots, n_kv):
            """Gradient of ``select_slots``: [b, s_l, P*kc, d] -> [b, s_l, n_kv, d], replicas summed."""
            if not chunk.needs_select:
                return d_slots
            return d_slots.new_zeros(b, s_l, n_kv, d).index_add_(2, layer.slot_index(chunk, d_slots.device), d_slots)

        chunk_index = {chunk: i for i, chunk in enumerate(plan.chunks)}
        for group in plan.kv_groups():
            first = group[0]
            n_kv = first.kv_hi - first.kv_lo
            # recompute this group's k/v; the projection output is kept only where a norm needs it in backward
            k_proj = layer.project(hidden, k_w, k_b, first.kv_lo, n_kv, k_lr)
            k = layer.select_slots(first, layer.k_post(k_proj, cos, sin, kn_w))
            if layer.k_norm is None:
                k_proj = None
            v = layer.select_slots(first, layer.project(hidden, v_w, v_b, first.kv_lo, n_kv, v_lr))
            dk_heads = dv_heads = None
            for index, chunk in enumerate(group):
                q_proj = layer.project(hidden, q_w, q_b, chunk.q_head, width, q_lr)
                q = layer.q_post(q_proj, cos, sin, qn_w)
                if layer.q_norm is None:
                    q_proj = None
                heads = slice(chunk.q_head, chunk.q_head + width)
                # one exchange: the chunk's q, output and output gradient (+ the group's k/v on its first chunk)
                sent = [q, out_heads[:, :, heads], grad_heads[:, :, heads]] + ([k, v] if index == 0 else [])
                received = layer.to_heads(*sent)
                del sent, q
                q_heads, o_heads, do_heads = received[:3]
                if index == 0:
                    k_heads, v_heads = received[3:]
                    del k, v
                del received
                i = chunk_index[chunk]
                chunk_residuals = tuple(residuals[i * per_chunk : (i + 1) * per_chunk])
                last = index == len(group) - 1
                kv = [k_heads, v_heads]
                if last:  # no later chunk of the group needs the k/v: ``kv`` holds the only references
                    del k_heads, v_heads
                dq_heads, dk_c, dv_c = layer.core_backward(do_heads, q_heads, kv, o_heads, chunk_residuals, documents)
                del kv, q_heads, o_heads, do_heads
                dk_heads = dk_c if dk_heads is None else dk_heads.add_(dk_c)
                dv_heads = dv_c if dv_heads is None else dv_heads.add_(dv_c)
                del dk_c, dv_c
                if last:  # the group's k/v gradients travel back with its last chunk's dq
                    dq, dk_local, dv_local = layer.to_seq(dq_heads, dk_heads, dv_heads)
                    del dk_heads, dv_heads
                else:
                    (dq,) = layer.to_seq(dq_heads)
                del dq_heads
                dq_proj = post_backward(layer.q_norm, qn_w, dqn_w, q_proj, dq.reshape(b, s_l, width, d))
                del dq, q_proj
                linear_backward(dq_proj, q_w, dq_w, dq_b, chunk.q_head, width, q_lr, dq_lb, d_low[0])
                del dq_proj
            slot_shape = (b, s_l, plan.degree * plan.kv_slots_per_rank, d)
            dk = slots_backward(first, dk_local.reshape(slot_shape), n_kv)  # [b, s_l, n_kv, d]
            del dk_local
            dk_proj = post_backward(layer.k_norm, kn_w, dkn_w, k_proj, dk)
            del dk, k_proj
            linear_backward(dk_proj, k_w, dk_w, dk_b, first.kv_lo, n_kv, k_lr, dk_lb, d_low[1])
            del dk_proj
            dv = slots_backward(first, dv_local.reshape(slot_shape), n_kv)
            del dv_local
            linear_backward(dv, v_w, dv_w, dv_b, first.kv_lo, n_kv, v_lr, dv_lb, d_low[2])
            del dv
        # through each adapter's A: d hidden += d(x A^T) A, d A += d(x A^T)^T x
        for d_lr, a, d_a in zip(d_low, params[8::2], grads[8::2]):
            if d_lr is None:
                continue
            d_lr = d_lr.to(x2d.dtype)
            _add_mm(d_x2d, d_lr, a)
            if d_a is not None:
                _add_mm(d_a, d_lr.t(), x2d)
        return d_hidden, grads


def _add_mm(target, a, b) -> None:
    """target += a @ b in place; a product in another dtype than ``target`` (a bf16 computation's fp32 gradient) is
    made first and added."""
    if target.dtype == a.dtype:
        target.addmm_(a, b)
    else:
        target.add_(torch.mm(a, b))


def apply_head_chunking(model, mesh, head_chunk: int, kernel: str = "sdpa") -> None:
    """Replace every attention module's forward by ``UPipeAttention`` (Ulysses degree = ``mesh.sp_degree``; with a
    ring, ``mesh.ring_degree`` > 1, each chunk's attention runs around ``mesh.ring_group``)."""

    config = model.config
    family = family_of(config.model_type)
    plan = ChunkPlan.build(
        config.num_attention_heads, config.num_key_value_heads, config.head_dim, mesh.sp_degree, head_chunk
    )
    softcap = family.attention_features(config).get("softcap")
    ring = Ring(mesh.ring_group) if mesh.ring_degree > 1 else None
    for module, window in zip(attention_modules(model), family.layer_windows(config), strict=True):
        module.forward = UPipeAttention(
            module, plan, mesh.sp_group, kernel, fused_qkv=family.fused_qkv, window=window, softcap=softcap, ring=ring
        )
