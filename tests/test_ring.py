"""Ring attention and Ulysses x ring (USP) are exact (issue 49), and the ring's split and schedule are right.

Exactness: the stack harness (``tests/stack_harness.py``) on gloo ranks, each case against the plain single-process
model (loss within rel 1e-5, every parameter gradient within rel 1e-4, fp32): ring 2 alone, with the other knobs
and through the plugin ``trials.hf`` on 2 ranks; ring 4, Ulysses 2 x ring 2, head chunking, the full stack and GQA with fewer kv heads than ranks on 4
(slow: four ranks on a shared 2-core host). The cases (``two_rank_cases``, ``two_rank_slow_cases``,
``four_rank_cases``) run in the launches of ``tests/test_ring_documents.py`` (its 4-rank table in
``tests/test_stack.py``'s 4-rank launch), one per world size and suite: starting ranks costs more than the cases.

Without processes: the zigzag split gives every column to exactly one rank (chunks r and 2R-1-r), and the ring's
block schedule, run for every rank and step, visits exactly the causal (query, key) pairs once each, with equal work
in every step after the first.
"""

from __future__ import annotations

import pytest
import torch

from trials.core.errors import ConfigError
from trials.models.config import load_model_config
from trials.stack.ring import Ring
from trials.stack.techniques import Techniques
from trials.training.data import make_batch, zigzag_columns

pytestmark = pytest.mark.torch_release  # bin/test --oldest runs it on the oldest torch too

SEQ = 256
TILES = {"mlp_tile_tokens": 48, "loss_tile_tokens": 40, "norm_tile_tokens": 56}  # uneven last tiles on purpose
CKPT_OFFLOAD = {"activation_checkpointing": True, "activation_offload_layers": 2}
FULL = {"fsdp": True, "optimizer_offload": True, **CKPT_OFFLOAD, "activation_offload_layers": 4, **TILES}


def _case(name: str, model: str, step: bool = False, **techniques) -> dict:
    return {"name": f"{model}/{name}", "model": model, "techniques": techniques, "step": step}


def _saved_model(folder, name: str) -> str:
    """``name``'s preset as ``transformers`` saves a model of it (random weights), for the plugin ``trials.hf``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    values = {k: v for k, v in load_model_config(name).items() if not k.startswith("_")}
    torch.manual_seed(49)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**values)).save_pretrained(folder)
    return str(folder)


def two_rank_cases() -> list[dict]:
    """Ring 2 alone and with checkpointing, offload and tiles (the fast suite); they run in the 2-rank launch of the
    ring's packed documents (tests/test_ring_documents.py), as do ``two_rank_slow_cases``; ``four_rank_cases`` run in
    tests/test_stack.py's 4-rank launch."""
    return [
        _case("ring2", "tiny-llama", ring_degree=2),
        _case("ring2+checkpointing+offload+tiles", "tiny-qwen3", ring_degree=2, **CKPT_OFFLOAD, **TILES),
    ]


def two_rank_slow_cases(tmp_path) -> list[dict]:
    """Ring 2 with head chunks, the full stack and through the plugin ``trials.hf`` (a model saved under tmp_path)."""
    folder = _saved_model(tmp_path / "tiny-llama", "tiny-llama")
    cases = [
        _case("ring2", "tiny-qwen3", ring_degree=2),
        _case("ring2+head_chunk=1", "tiny-llama", ring_degree=2, head_chunk=1),
        _case("ring2+full+head_chunk=2", "tiny-llama", step=True, ring_degree=2, head_chunk=2, **FULL),
    ]
    for via in ("from_pretrained", "apply"):  # the plugin runs the knob like every other
        case = _case(f"ring2+checkpointing (trials.hf.{via})", "tiny-llama", ring_degree=2, **CKPT_OFFLOAD)
        cases.append({**case, "pretrained": {"dir": folder, "via": via}})
    return cases


def four_rank_cases() -> list[dict]:
    """Ring 4, Ulysses 2 x ring 2, head chunking, the full stack and data parallel on 4 ranks (slow).
    tiny-llama: 8 query, 2 kv heads: ring 4 sends the 2 kv heads, never 8; under Ulysses 2 each rank has 1 kv head."""
    return [
        _case("ring4", "tiny-llama", ring_degree=4),
        _case("ring4+head_chunk=1+checkpointing", "tiny-qwen3", ring_degree=4, head_chunk=1, **CKPT_OFFLOAD),
        _case("ulysses2xring2", "tiny-llama", ulysses_degree=2, ring_degree=2),
        _case("ulysses2xring2+head_chunk=1", "tiny-qwen3", ulysses_degree=2, ring_degree=2, head_chunk=1),
        _case(
            "ulysses2xring2+full+head_chunk=2",
            "tiny-llama",
            step=True,
            ulysses_degree=2,
            ring_degree=2,
            head_chunk=2,
            **FULL,
        ),
        _case("ring2 x dp2+full", "tiny-qwen3", step=True, ring_degree=2, **FULL),
    ]


# -- the split and the schedule (no processes) ----------------------------------------------------------------------


@pytest.mark.parametrize("ring", [2, 3, 4])
def test_zigzag_split_gives_each_rank_two_mirrored_chunks(ring):
    seq = 2 * ring * 8
    chunk = seq // (2 * ring)
    held = [zigzag_columns(seq, r, ring) for r in range(ring)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    for r, columns in enumerate(held):
        assert columns[:chunk].tolist() == list(range(r * chunk, (r + 1) * chunk))
        mirror = 2 * ring - 1 - r
        assert columns[chunk:].tolist() == list(range(mirror * chunk, (mirror + 1) * chunk))


def test_usp_batches_tile_the_sequence_with_global_positions():
    seq, ulysses, ring = 48, 2, 3
    tokens = torch.arange(seq + 1) * 7
    seen = []
    for r in range(ring):
        for u in range(ulysses):
            batch = make_batch(tokens, u, ulysses, "cpu", ring_rank=r, ring_degree=ring)
            positions = batch.position_ids[0]
            assert torch.equal(batch.input_ids[0], tokens[positions])  # rotary sees where each token sits
            assert torch.equal(batch.labels[0], tokens[positions + 1])  # labels shifted before the split
            seen += positions.tolist()
    assert sorted(seen) == list(range(seq))


def _ring(rank: int, degree: int) -> Ring:
    ring = Ring.__new__(Ring)
    ring.rank, ring.degree = rank, degree
    return ring


@pytest.mark.parametrize("degree", [1, 2, 3, 4])
def test_ring_schedule_visits_each_causal_pair_once_with_equal_work(degree):
    seq = 2 * degree * 4
    local = seq // degree
    columns = [zigzag_columns(seq, r, degree) for r in range(degree)]
    visits = torch.zeros(seq, seq, dtype=torch.int64)
    for rank in range(degree):
        ring = _ring(rank, degree)
        for step in range(degree):
            work = 0
            for q_start, q_rows, kv_start, kv_rows, causal in ring.blocks(step, local):
                q_cols = columns[rank][q_start : q_start + q_rows]
                k_cols = columns[ring.source(step)][kv_start : kv_start + kv_rows]
                visible = torch.ones(len(q_cols), len(k_cols), dtype=torch.bool)
                if causal:
                    visible = visible.tril()
                rows, cols = torch.nonzero(visible, as_tuple=True)
                visits.index_put_((q_cols[rows], k_cols[cols]), torch.ones_like(rows), accumulate=True)
                work += len(q_cols) * len(k_cols)
            if step:  # the zigzag's balance: every later step is half the square of the local columns
                assert work == local * local // 2
    assert torch.equal(visits, torch.ones(seq, seq, dtype=torch.int64).tril())


# -- the knob's rules -------------------------------------------------------------------------------------------


def test_ring_degree_is_declared_and_validated():
    llama = load_model_config("tiny-llama")
    Techniques.from_dict({"ring_degree": 2, "ulysses_degree": 2}).validate(llama, 4, 256)
    # heads bound Ulysses only: a ring of 8 over 1 kv head per rank is fine with 2 kv heads
    Techniques(ring_degree=8).validate(llama, 8, 256)
    refused = {
        "ring_degree must be at least 1, got 0": (Techniques(ring_degree=0), 4, None),
        "ulysses_degree 2 x ring_degree 4 does not divide the GPU count 4": (
            Techniques(ulysses_degree=2, ring_degree=4),
            4,
            None,
        ),
        "seq_len 204 is not divisible by 2 x ring_degree 2 x ulysses_degree 2 = 8": (
            Techniques(ulysses_degree=2, ring_degree=2),
            4,
            204,
        ),
    }
    for message, (techniques, gpus, seq) in refused.items():
        with pytest.raises(ConfigError) as error:
            techniques.validate(llama, gpus, seq)
        assert str(error.value) == message
    with pytest.raises(ConfigError, match="sliding-window"):
        Techniques(ring_degree=2).validate(load_model_config("tiny-mistral"), 2, 256)
    with pytest.raises(ConfigError, match="ring_degree must be an integer"):
        Techniques.from_dict({"ring_degree": "two"})


# -- the time model: a ring step costs max(attention, transfer), on NVLink or the NIC ------------------------------


def _ring_counts(phase: str, wire: float, calls: int, attention_bh: float):
    """One rank's counts with ``calls`` ring sends of ``wire`` bytes in ``phase`` and non-causal attention blocks."""
    from autotune.timing.counts import CollectiveCounts, StepCounts, attention_key

    counts = StepCounts(seq_len=1024)
    counts.collectives[f"p2p/{phase}/sync/2"] = CollectiveCounts(calls, wire, wire, wire / calls)
    counts.attention_calls[attention_key(phase, phase == "backward", 4096, 4096, 128, 128, False, None)] = attention_bh
    return counts


def test_ring_transfers_hide_behind_attention_and_cross_nodes_on_the_nic():
    from autotune.core.hardware import load_hardware
    from autotune.timing.counts import CollectiveCounts
    from autotune.timing.model import attention_time, predict_step_time, ring_crosses_nodes

    r = load_hardware("h100-sxm").rates
    usp = Techniques(ulysses_degree=8, ring_degree=2)
    assert ring_crosses_nodes(usp, 16, 8) and not ring_crosses_nodes(usp, 16, 16)
    assert not ring_crosses_nodes(Techniques(ulysses_degree=2, ring_degree=4), 16, 8)  # the whole ring in a node
    wire, calls = 4e9, 8
    for phase in ("forward", "backward"):
        for bh in (1.0, 64.0, 4096.0):  # transfer-bound, balanced, attention-bound
            counts = _ring_counts(phase, wire, calls, bh)
            hidden = attention_time(counts, (phase,), r.for_kernel(usp.attention, None)) * (2 - 1) / 2
            floor = 1 / 3 if phase == "backward" else 0.0  # 2R-1 transfers per layer; the last has nothing after it
            for gpus_per_node, link, latency in (
                (16, r.intra_node_bytes_per_s * r.all_reduce_efficiency, r.collective_latency_s),
                (8, r.inter_node_bytes_per_s * r.inter_node_efficiency, r.inter_node_latency_s),
            ):
                seconds = wire / link + calls * latency
                breakdown = predict_step_time(counts, r, 16, usp, gpus_per_node=gpus_per_node)
                assert breakdown.detail["ring_transfer_s"] == pytest.approx(seconds)
                assert breakdown.detail["ring_exposed_s"] == pytest.approx(max(floor * seconds, seconds - hidden))
    # the dK sends waited at once show whole, beside the hideable ones
    counts = _ring_counts("backward", wire, calls, 4096.0)
    counts.collectives["p2p_waited/backward/sync/2"] = CollectiveCounts(calls, wire / 2, wire / 2, wire / 2 / calls)
    link, latency = r.inter_node_bytes_per_s * r.inter_node_efficiency, r.inter_node_latency_s
    hideable, waited = wire / link + calls * latency, wire / 2 / link + calls * latency
    hidden = attention_time(counts, ("backward",), r) / 2
    breakdown = predict_step_time(counts, r, 16, usp, gpus_per_node=8)
    assert breakdown.detail["ring_transfer_s"] == pytest.approx(hideable + waited)
    assert breakdown.detail["ring_exposed_s"] == pytest.approx(max(hideable / 3, hideable - hidden) + waited)
    # without a ring the sends do not exist, and tokens/s count one replica per Ulysses x ring group
    plain = predict_step_time(_ring_counts("forward", wire, calls, 1.0), r, 16, Techniques(ulysses_degree=8), 1024)
    ring = predict_step_time(_ring_counts("forward", wire, calls, 1.0), r, 16, usp, 1024)
    assert plain.tokens_per_s == pytest.approx(2 * 1024 / plain.step_time_s)
    assert ring.tokens_per_s == pytest.approx(1024 / ring.step_time_s)


# -- the search space factors the context-parallel world into Ulysses x ring ---------------------------------------


def test_the_space_factors_the_world_into_ulysses_x_ring_and_samples_only_runnable_configs():
    import optuna

    from autotune.search.space import DEFAULT_SPACE, load_space

    config = load_model_config("tiny-llama")  # 8 query heads: Ulysses 1, 2, 4, 8 on 8 GPUs
    space = load_space(DEFAULT_SPACE, config, 8, 64 * 1024)
    assert space.split_choices["ring_degree"] == {1: [1, 2, 4, 8], 2: [1, 2, 4], 4: [1, 2], 8: [1]}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    rings = set()
    for _ in range(200):
        trial = study.ask()
        techniques, seq_len = space.sample(trial, config["num_hidden_layers"])
        techniques.validate(config, 8, seq_len)  # every sampled config and length runs (raises otherwise)
        rings.add((techniques.ulysses_degree, techniques.ring_degree))
        study.tell(trial, 0.0)
    assert {(1, 8), (2, 4), (4, 2), (8, 1)} <= rings


class _Sent:
    """A send in flight: keeps its tensors alive until waited, as a process group's work does."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        self.tensors = None


class _OneProcessRing(Ring):
    """Ring rank ``rank`` of ``degree`` without processes: every exchange receives fresh (empty) buffers, enough to
    count what ``ring_backward`` keeps alive."""

    def __init__(self, degree: int, rank: int):
        self.degree, self.rank = degree, rank

    def exchange(self, *tensors):
        return [torch.empty_like(t) for t in tensors], [_Sent(list(tensors))]


@pytest.mark.parametrize("degree", [2, 3])
def test_ring_backward_keeps_three_fp32_dkv_accumulators_alive_at_most(degree):
    """In flight per rank in backward: dK then dV, each exchange waited before the next, so three accumulators at
    most (dK sent, dK received, dV; then dK received, dV sent, dV received), never both pairs. The K/V handed over
    are freed once the next step's have arrived (two pairs at most: the ones held and the ones arriving), and a
    block's dK goes into an accumulator already here at once (the blocks of a step keep one dK at most)."""
    from trials.core.memory import DeviceMemoryTracker, TrackerListener
    from trials.stack.ring import ring_backward, ring_forward

    class Live(TrackerListener):  # the most live storages of each (dtype, shape), and every event in order
        def __init__(self, like):
            self.like, self.live, self.most, self.events = tuple(like.shape), {}, {}, []
            self.most_kv_bytes = 0  # the most bytes of K/V-shaped storages (bf16 K/V and fp32 accumulators) at once

        def on_new_storage(self, tracker, info, tensor):
            key = (tensor.dtype, tuple(tensor.shape))
            self.live.setdefault(key, set()).add(id(info))
            self.most[key] = max(self.most.get(key, 0), len(self.live[key]))
            self.events.append(("new", key, id(info)))
            kv_bytes = sum(
                len(self.live.get((dtype, self.like), ())) * size
                for dtype, size in ((torch.float32, 4), (torch.bfloat16, 2))
            )
            self.most_kv_bytes = max(self.most_kv_bytes, kv_bytes)

        def on_free(self, tracker, info):
            for live in self.live.values():
                live.discard(id(info))
            self.events.append(("free", None, id(info)))

    torch.manual_seed(0)
    query = torch.randn(1, 4, 32, 8, dtype=torch.bfloat16)  # K/V in bf16: fp32 ones are accumulators
    key, value = (torch.randn(1, 2, 32, 8, dtype=torch.bfloat16) for _ in range(2))
    ring = _OneProcessRing(degree, rank=degree - 1)
    out, residuals = ring_forward(query, key, value, 8**-0.5, "sdpa", ring)
    grad_out = torch.randn_like(out)
    counter = Live(key)
    with DeviceMemoryTracker() as tracker:
        tracker.add_listener(counter)
        ring_backward(grad_out, query, [key.clone(), value.clone()], out, residuals, 8**-0.5, "sdpa", ring)
    kv, block = (1, 2, 32, 8), (1, 2, 16, 8)
    assert counter.most[(torch.float32, kv)] == 3
    # the handed-over K/V (the first two storages) are freed before step 1's blocks (half-sized gradients) start
    handed = [info for _, _, info in counter.events[:2]]
    step_one = counter.events.index(next(e for e in counter.events if e[1] == (torch.bfloat16, block)))
    assert all(("free", None, info) in counter.events[:step_one] for info in handed)
    assert counter.most[(torch.bfloat16, block)] == 3  # the first block's dV, the second's dK and dV
    # K/V-sized bytes at most (per element): at step 0 its own K/V, the next step's arriving and the block's dV in
    # bf16, dK and dV in fp32, made from the block's gradients (each freed once copied; the step's K/V freed before
    # dK travels); at a middle step (rings of 3 or more) two K/V pairs in bf16 and dK, dV and the dV sent in fp32
    step_zero = (2 + 2 + 1) * 2 + 2 * 4
    middle = (2 + 2) * 2 + 3 * 4 if degree > 2 else 0
    assert counter.most_kv_bytes == max(step_zero, middle)


def test_the_counter_keeps_the_ring_backward_s_waited_dk_sends_apart():
    """Traced on a fake world of 2 ranks: forward sends K/V R-1 times; backward sends K/V R-1 times and dV R times
    overlapped, and dK R times waited at once (``p2p_waited``). dK and dV are alike, so the waited bytes are the
    backward's overlapped bytes less the forward's."""
    from autotune.backends import Evaluation
    from autotune.backends.plan import PlanBackend, step_counts
    from autotune.core.hardware import load_hardware

    backend = PlanBackend()
    evaluation = Evaluation(
        load_model_config("tiny-llama"), Techniques(ring_degree=2), SEQ, 2, load_hardware("h100-sxm")
    )
    record = backend.evaluate(evaluation)
    assert record.status == "ok", record.error
    counts = step_counts(backend.last_prediction)
    overlapped, waited = counts.by_phase("p2p"), counts.by_phase("p2p_waited")
    assert set(waited) == {"backward"}
    assert waited["backward"].wire_bytes > 0
    assert waited["backward"].wire_bytes == overlapped["backward"].wire_bytes - overlapped["forward"].wire_bytes
    assert waited["backward"].calls == overlapped["backward"].calls - overlapped["forward"].calls
