"""The structural rules of a technique set: pure functions, each returning the reasons a thing cannot run.

One place for every rule about which knob values fit a model and a world: config validation
(``Techniques.validate``), the search space's filter (``autotune.search.space``) and ``trials.stack.apply``
all call these, so a rule is stated once. ``techniques`` is a ``trials.stack.techniques.Techniques``; its declared
knobs say which knob requires which, and which the length must divide. Nothing here imports torch.

    world     ranks of the job (``--gpus``)
    heads     the model's query heads; kv_heads its key/value heads (GQA: kv_heads divides heads)
    degree    the Ulysses degree: ranks that split one sequence by heads; each holds heads / degree query heads
    ring      the ring degree: Ulysses groups that split one sequence into zigzag chunks (``trials.stack.ring``);
              the context-parallel world is degree x ring
"""

from __future__ import annotations

import math

from trials.stack.knobs import ATTENTION_KERNELS, declared_knobs


def ulysses_degree_problem(degree: int, world: int, heads: int, kv_heads: int) -> str | None:
    """Why a Ulysses degree cannot run on ``world`` ranks with these heads (None: it can). kv heads fewer
    than the degree are replicated, so they and the degree must divide one another."""
    if degree < 1:
        return f"ulysses_degree must be at least 1, got {degree}"
    if world % degree:
        return f"ulysses_degree {degree} does not divide the GPU count {world}"
    if heads % degree:
        return f"ulysses_degree {degree} does not divide the {heads} query heads"
    if kv_heads % degree and degree % kv_heads:
        return f"ulysses_degree {degree} and the {kv_heads} kv heads must divide one another"
    return None


def ring_document_unit(ring: int) -> int:
    """What every packed document's length is a multiple of on a ring of ``ring``: it splits each document into 2 x
    ring zigzag chunks (``trials.stack.ring``); 1 without a ring. Ulysses splits a ring rank's columns as a whole,
    so it adds nothing per document (the sequence's own rule, ``ring_length_problem``, covers it). autotune's trainer
    pads each document up to it (``trials.training.data.pad_documents``), and the predictions price the padded
    documents (``DocumentsSpec.for_length``'s ``unit``)."""
    return 2 * ring if ring > 1 else 1


def ring_documents_problem(ring: int, lengths) -> str | None:
    """Why a ring cannot split packed documents of ``lengths`` as they are (None: it can): a length that is not a
    multiple of ``ring_document_unit``. Where the documents come padded (autotune's trainer, the predictions) this
    never holds; a batch whose documents are someone else's (``trials.hf``) is refused with it."""
    if ring <= 1:
        return None
    unit = ring_document_unit(ring)
    odd = next((n for n in lengths if n % unit), None)
    if odd is None:
        return None
    return (
        f"ring_degree {ring} splits each packed document into 2 x ring_degree = {unit} chunks: a document of "
        f"{odd:,} tokens is not a multiple of {unit}"
    )


def ring_degree_problem(ring: int, degree: int, world: int, windowed: bool = False) -> str | None:
    """Why a ring degree cannot run beside Ulysses degree ``degree`` on ``world`` ranks (None: it can). The heads
    do not bound it: a ring splits the sequence, every rank keeps all its heads."""
    if ring < 1:
        return f"ring_degree must be at least 1, got {ring}"
    if ring > 1 and world % (degree * ring):
        return f"ulysses_degree {degree} x ring_degree {ring} does not divide the GPU count {world}"
    if ring > 1 and windowed:
        return f"ring_degree {ring} cannot run sliding-window attention (the ring passes whole chunks)"
    return None


def split_unit(ulysses_degree: int, ring_degree: int) -> int:
    """What a length must be a multiple of to split over Ulysses x ring: the Ulysses degree, or with a ring its 2 x
    ring zigzag chunks each split by Ulysses."""
    return 2 * ring_degree * ulysses_degree if ring_degree > 1 else ulysses_degree


def ring_length_problem(ring: int, degree: int, seq_len: int) -> str | None:
    """Why ``seq_len`` cannot be split by a ring (``split_unit``: 2 x ring zigzag chunks, each rank's two split by
    Ulysses)."""
    unit = split_unit(degree, ring)
    if ring > 1 and seq_len % unit:
        return f"seq_len {seq_len:,} is not divisible by 2 x ring_degree {ring} x ulysses_degree {degree} = {unit}"
    return None


def head_chunk_problem(chunk: int | None, heads: int, degree: int) -> str | None:
    """Why a head chunk cannot split the ``heads / degree`` heads of a rank evenly (None: it can)."""
    if chunk is None:
        return None
    local = heads // degree
    if not 1 <= chunk <= local:
        return f"head_chunk {chunk} must be between 1 and heads/ulysses_degree = {local}"
    if local % chunk:
        return f"head_chunk {chunk} does not divide the {local} heads per rank"
    return None


def head_chunk_split_problem(chunk: int | None, degree: int, model_config: dict, world: int) -> str | None:
    """``head_chunk``'s ``split_by`` rule: why a chunk cannot run under Ulysses degree ``degree`` with the model's
    query heads (``head_chunk_problem``; None: it can)."""
    return head_chunk_problem(chunk, model_config["num_attention_heads"], degree)


def ring_split_problem(ring: int, degree: int, model_config: dict, world: int) -> str | None:
    """``ring_degree``'s ``split_by`` rule: why a ring cannot run beside Ulysses degree ``degree`` on ``world``
    ranks (``ring_degree_problem``; None: it can)."""
    return ring_degree_problem(ring, degree, world)


def requirement_problems(techniques) -> list[str]:
    """Knobs set without the knob they need (each knob's ``requires``)."""
    found = []
    for k in declared_knobs(type(techniques)):
        if k.requires and not k.is_off(getattr(techniques, k.name)):
            needed, why = k.requires
            if not getattr(techniques, needed):
                found.append(f"{k.name} needs {needed} ({why})")
    return found


def problems(techniques, model_config: dict, world: int, seq_len: int | None = None) -> list[str]:
    """Every reason ``techniques`` cannot train ``model_config`` on ``world`` ranks (at ``seq_len``), in the
    order a person fixes them; empty when it can."""
    t = techniques
    heads, kv_heads = model_config["num_attention_heads"], model_config["num_key_value_heads"]
    layers = model_config["num_hidden_layers"]
    if world < 1:
        return [f"gpus must be at least 1, got {world}"]
    found = []
    degree_problem = ulysses_degree_problem(t.ulysses_degree, world, heads, kv_heads)
    if degree_problem:
        found.append(degree_problem)
        if t.ulysses_degree < 1:
            return found
    ring_problem = ring_degree_problem(t.ring_degree, max(1, t.ulysses_degree), world)
    if ring_problem:
        found.append(ring_problem)
    chunk_problem = head_chunk_problem(t.head_chunk, heads, t.ulysses_degree)
    if chunk_problem:
        found.append(chunk_problem)
    if not 0 <= t.activation_offload_layers <= layers:
        found.append(f"activation_offload_layers {t.activation_offload_layers} must be between 0 and {layers}")
    found += requirement_problems(t)
    for k in declared_knobs(type(techniques)):
        if k.kind == "tokens" and getattr(t, k.name) < 0:
            found.append(f"{k.name} must be 0 (off) or positive, got {getattr(t, k.name)}")
    if t.attention not in ATTENTION_KERNELS:
        found.append(f"attention {t.attention!r} must be one of {', '.join(ATTENTION_KERNELS)}")
    if seq_len is not None:
        found += length_problems(t, seq_len)
        ring_length = ring_length_problem(t.ring_degree, max(1, t.ulysses_degree), seq_len)
        found += [ring_length] if ring_length else []
    return found


def length_problems(techniques, seq_len: int) -> list[str]:
    """Knobs whose value the sequence length must be a multiple of (``length_unit: required``)."""
    return [
        f"seq_len {seq_len:,} is not divisible by {k.name} {getattr(techniques, k.name)}"
        for k in declared_knobs(type(techniques))
        if k.length_unit == "required" and seq_len % max(1, getattr(techniques, k.name))
    ]


def length_unit(techniques, base: int = 1024) -> int:
    """Lengths worth searching for ``techniques`` are multiples of lcm(base, every ``length_unit`` knob's value)."""
    unit = base
    for k in declared_knobs(type(techniques)):
        value = getattr(techniques, k.name)
        if k.length_unit and value:
            unit = math.lcm(unit, int(value))
    ring = getattr(techniques, "ring_degree", 1)
    if ring > 1:
        unit = math.lcm(unit, split_unit(max(1, techniques.ulysses_degree), ring))
    return unit
